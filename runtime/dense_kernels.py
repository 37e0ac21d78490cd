"""Python entry points of the dense-model CUDA kernels (cutlass_kernels/dense_linear.cu, norm_rope.cu,
tree_attention.cu, sampling.cu), on runtime.cuda DeviceArrays. One function per backend op, named after
runtime/backends/base.py; the CUDA backend calls these.

Conventions:
- bf16 tensors are DeviceArrays of np.uint16; the caller passes the output buffer (`out`), so a captured
  graph replays into the same memory. Nothing here allocates in steady state: scratch memory (split-K and
  split-KV partials, split-K tickets) comes from a `Workspace` that grows only when a larger shape appears.
- Row strides (`ld*`, in elements) let an op read or write one slice of a fused buffer, e.g. q/k/v of a
  fused qkv projection, or a rope writing k straight into its cache slots. Default: contiguous rows.
- Values that change between graph replays (the prefix length, the KV commit plan) are read by the
  kernels from device memory; host ints are accepted too and uploaded (tests, eager use).
- Shapes are checked before launch and errors name the op and the sizes.
"""
from __future__ import annotations

import math
import os

import numpy as np

from runtime.cuda import DeviceArray, empty, get_device, get_kernel

BF16 = np.dtype(np.uint16)
LN2 = math.log(2.0)


def _need(cond: bool, op: str, msg: str):
    if not cond:
        raise ValueError(f"{op}: {msg}")


def _bf16(a: DeviceArray, op: str, name: str):
    _need(a.dtype == BF16, op, f"{name} must be bf16 (uint16 bits), got {a.dtype}")


def _i32(v) -> np.int32:
    return np.int32(int(v))


def _host_values_allowed(op: str, what: str):
    """Host values are uploaded into a temporary buffer that is freed when the call returns: fine eagerly, a
    dangling pointer inside a captured graph. So refuse them while any capture is active."""
    from runtime.cuda import graph
    _need(not graph._active, op, f"{what} given as a host value while a CUDA graph is being captured; pass an "
          f"int32 device array (the graph would read a freed temporary)")


class Workspace:
    """Scratch device memory for split reductions: grows on demand, never shrinks. `tickets` are int32
    counters the split-K kernel leaves at zero after every launch (allocated zeroed). Kernels on one stream
    may share a workspace (they run in order); concurrent streams need one each."""

    def __init__(self):
        self._scratch: DeviceArray | None = None
        self._tickets: DeviceArray | None = None
        self._slots64: DeviceArray | None = None

    def scratch(self, nbytes: int) -> DeviceArray:
        if self._scratch is None or self._scratch.nbytes < nbytes:
            self._scratch = empty((max(nbytes, 256) // 4 + 1,), np.float32)
        return self._scratch

    def tickets(self, count: int) -> DeviceArray:
        if self._tickets is None or self._tickets.size < count:
            self._tickets = empty((max(count, 64),), np.int32)
            self._tickets.fill_bytes(0)
        return self._tickets

    def slots64(self, count: int) -> DeviceArray:
        """uint64 accumulators that the kernels using them leave at zero (argmax's per-row maxima)."""
        if self._slots64 is None or self._slots64.size < count:
            self._slots64 = empty((max(count, 64),), np.uint64)
            self._slots64.fill_bytes(0)
        return self._slots64


_default_ws: Workspace | None = None


def default_workspace() -> Workspace:
    global _default_ws
    if _default_ws is None:
        _default_ws = Workspace()
    return _default_ws


def _scalar_on_device(value, what: str, op: str) -> DeviceArray:
    """An int32 device scalar/vector from a DeviceArray (used as is) or host values (uploaded)."""
    if isinstance(value, DeviceArray):
        _need(value.dtype == np.int32, op, f"{what} must be int32 on the device, got {value.dtype}")
        return value
    _host_values_allowed(op, what)
    host = np.ascontiguousarray(np.atleast_1d(np.asarray(value, dtype=np.int64)).astype(np.int32))
    dev = empty(host.shape, np.int32)
    dev.upload(host)
    return dev


# ---------------------------------------------------------------- linear
LINEAR_ROWS_PER_BLOCK = 128      # 8 warps x 16 W rows
LINEAR_BLOCKS_PER_SM = 2         # 256 threads at <= 128 registers
XRES_SMEM_CAP = 100 * 1024       # x slice per block, so two blocks fit an SM's 227 KB
# Fixed cost of one x-resident block (x slice load, epilogue, split-K ticket) in 64-wide units of W time:
# without it the model split SmolLM2's lm_head (K = 576) into 9 one-unit blocks, measured 2x slower than
# one split (37.0 vs 18.4 us on the H200).
XRES_BLOCK_OVERHEAD_UNITS = 2
PROLOGUES = {"none": 0, "rmsnorm": 1, "swiglu": 2}  # linear(prologue=...) -> XMODE
FUSED_NORM_MAX_K = 8 * 256       # the fused rmsnorm gives each of the 256 threads one 16-byte vector of a row
# Rows up to which the model's rmsnorm -> linear and swiglu -> linear run as one launch (fused_prologue_ok), per
# prologue. 8: the decode sizes (gemv / x-resident kernel). 16 or 32: also small verify and drafter batches, on
# the x-resident kernel with 16- / 32-row tiles instead of GMMA, which makes a verify layer six launches as in the
# AR step; that measured 1.35-2.4x slower (SmolLM2 verify b16, H200, docs/PERF.md session 17), so 8 stays the
# default. DDTREE_FUSED_PROLOGUE_ROWS=32 sets both, =rmsnorm:32,swiglu:8 each.
FUSED_PROLOGUE_MAX_ROWS = 32


def _fused_prologue_rows(spec: str) -> dict[str, int]:
    rows = {"rmsnorm": 8, "swiglu": 8}
    for part in filter(None, spec.split(",")):
        name, _, n = part.rpartition(":")
        for key in ([name] if name else list(rows)):
            if key not in rows or not n.isdigit():
                raise ValueError(f"DDTREE_FUSED_PROLOGUE_ROWS={spec!r}: N, or rmsnorm:N and / or swiglu:N")
            rows[key] = int(n)
    return rows


FUSED_PROLOGUE_ROWS = _fused_prologue_rows(os.environ.get("DDTREE_FUSED_PROLOGUE_ROWS", ""))


# DDTREE_LINEAR_GEMV=0: decode-size linears (M <= 8) back on the split-K x-resident kernel, for A/B timing
LINEAR_GEMV = os.environ.get("DDTREE_LINEAR_GEMV", "1") != "0"


def _gemv_smem(M: int, K: int) -> int:
    """linear_bf16_gemv_kernel's dynamic smem: x's min(M, 8) rows over the whole K (rounded up to 64) + pad."""
    return min(M, 8) * (64 * -(-K // 64) + 32) * 2


# The gemv kernel's x tile at most this big. Two such blocks per SM leave the rest of the 256 KB L1 / shared
# memory as L1, which stages the W loads in flight: on the H200 (PERF.md, 2026-12-04 (14)) Qwen3-8B's down at
# M = 4 (2 x 98.5 KB of x) ran 43.1 us against 28.8 at M = 2 (2 x 49 KB) and 31.9 on the split-K kernel, and
# every streaming linear slowed 30-45% with the carveout forced to maximum shared memory.
GEMV_SMEM_CAP = 68 * 1024


def gemv_fits(M: int, K: int) -> bool:
    """linear_bf16_gemv_kernel: one 8-row token tile, the whole K of x's rows in shared memory."""
    return M <= 8 and _gemv_smem(M, K) <= GEMV_SMEM_CAP


GEMV_BLOCKS_PER_SM = 2   # linear_bf16_gemv_kernel's __launch_bounds__(256, 2)
# DDTREE_GEMV_KW=8 (or 4, 2): every gemv launch with that KW where it is built, for A/B timing of gemv_kw
GEMV_KW_FORCED = int(os.environ.get("DDTREE_GEMV_KW", "0"))


def gemv_kw(N: int, K: int, sm_count: int, xmode: int = 0) -> int:
    """Warps per 16-row W tile of the gemv kernel (a block holds 16 * 8 / KW rows). KW 2 for the largest N; else
    KW 4 unless KW 8 keeps clearly more of the GPU's block slots busy: the grid's last wave (or, persistent,
    every block's share of row tiles) leaves slots idle, tiles / (waves * slots). H200, M = 1 (PERF.md,
    2026-12-02/03 and 2026-12-04 (14)): qkv 6144x4096 KW 4 16.1 vs KW 8 17.8 us (equal slot use: KW 8's second
    wave is as empty), gate_up 24576x4096 KW 4 54.0 vs 56.2 (both 97%), o 4096x4096 KW 8 11.0 vs 15.3 (KW 4:
    128 blocks), up 12288x4096 KW 8 29.0 vs 31.8 (97% vs 73%), down 4096x12288 KW 8 28.0 vs 42.7, lm_head
    151936x4096 KW 2 306 vs 315; few k units per warp (K < 512) stay on KW 4."""
    from cutlass_kernels.registry import GEMV_INSTANCES
    if GEMV_KW_FORCED and any(kw == GEMV_KW_FORCED and xm == xmode for kw, _, xm in GEMV_INSTANCES):
        return GEMV_KW_FORCED
    if -(-N // 64) >= 8 * sm_count and (2, 4, xmode) in GEMV_INSTANCES:
        return 2
    if -(-K // 64) < 8:
        return 4
    slots = GEMV_BLOCKS_PER_SM * sm_count

    def slot_use(kw: int) -> float:
        tiles = -(-N // (16 * 8 // kw))
        return tiles / (-(-tiles // slots) * slots)
    return 8 if slot_use(8) > slot_use(4) + 0.02 else 4


# DDTREE_GEMV_PERSIST=0 / 1: every gemv launch with one block per row tile / a persistent grid, for A/B timing
GEMV_PERSIST_FORCED = os.environ.get("DDTREE_GEMV_PERSIST", "")


def gemv_blocks(tiles: int, carries: bool, sm_count: int, persist: bool | None) -> int:
    """Blocks of the gemv grid: one per row tile, or persistent: about GEMV_BLOCKS_PER_SM per SM, each walking
    ceil(tiles / blocks) row tiles or one fewer. A warp whose unit count is a multiple of STAGES (carries) runs
    its W ring on from one tile into the next; the others restart it per tile. persist=None: persistent only
    where every warp carries (DDTREE_GEMV_PERSIST=0 / 1 forces it off / on)."""
    if persist is None:
        persist = carries if GEMV_PERSIST_FORCED == "" else GEMV_PERSIST_FORCED == "1"
    if not persist:
        return tiles
    waves = -(-tiles // (GEMV_BLOCKS_PER_SM * sm_count))
    return -(-tiles // waves)


def gemv_plan(M: int, N: int, K: int, sm_count: int, kw: int | None = None, stages: int | None = None,
              xmode: int = 0, persist: bool | None = None):
    """(entry, grid, dynamic smem) of the no-split decode kernel: KW warps share each 16-row W tile's K."""
    from cutlass_kernels.registry import GEMV_INSTANCES
    units = -(-K // 64)
    kw = kw or gemv_kw(N, K, sm_count, xmode)
    per_warp = -(-units // kw)
    stages = stages or (2 if per_warp <= 2 and kw == 8 else 4)
    _need((kw, stages, xmode) in GEMV_INSTANCES, "linear", f"no gemv kernel <KW={kw}, STAGES={stages}, "
          f"XMODE={xmode}>; built: {sorted(GEMV_INSTANCES)}")
    rows_per_block = 16 * (8 // kw)
    tiles = -(-N // rows_per_block)
    # warp wk takes units wk, wk + kw, ...: every warp carries its ring into the next tile if all have per_warp
    carries = units % kw == 0 and per_warp % stages == 0
    blocks = gemv_blocks(tiles, carries, sm_count, persist)
    return f"linear_bf16_gemv_kernel<{kw}, {stages}, {xmode}>", (blocks, 1, 1), _gemv_smem(M, K)


def fused_prologue_ok(M: int, K: int, prologue: str) -> bool:
    """Whether linear(prologue=...) takes this size: M <= FUSED_PROLOGUE_ROWS[prologue] (8 by default: the decode
    path)."""
    if prologue == "none":
        return True
    return (1 <= M <= min(FUSED_PROLOGUE_ROWS[prologue], FUSED_PROLOGUE_MAX_ROWS) and K % 8 == 0
            and (prologue != "rmsnorm" or K <= FUSED_NORM_MAX_K))


# DDTREE_LINEAR_72_ROWS=0: M = 65..72 back on 64-row tiles (two token tiles), for A/B timing
LINEAR_72_ROW_TILE = os.environ.get("DDTREE_LINEAR_72_ROWS", "1") != "0"


def prologue_fuses(M: int, N: int, K: int, prologue: str) -> bool:
    """Whether `linear` fuses `prologue` into the x load at [M, K] x [N, K]^T when its plan is left to it: where the
    sm_90a narrow-row GMMA kernel takes that linear (dense_gmma.narrow_fuses), else at decode sizes unless another
    GMMA plan takes it (faster with the prologue as its own launch, runtime/dense_gmma.py GMMA_DECODE)."""
    from runtime import dense_gmma
    if dense_gmma.gmma_wanted(M, N, K):
        return dense_gmma.narrow_fuses(M, N, K, prologue)
    return fused_prologue_ok(M, K, prologue)


def _mt(M: int) -> int:
    """Token tile (8*MT rows). 65..72 rows (a budget-64 verify: root + 64 nodes) get one 72-row tile
    instead of 64 + a 1-row tile that would re-read W and redo a whole tile's MMAs (chunked kernel only)."""
    if 64 < M <= 72 and LINEAR_72_ROW_TILE:
        return 9
    return 1 if M <= 8 else 2 if M <= 16 else 4 if M <= 32 else 8


def linear_plan(M: int, N: int, K: int, sm_count: int, splits: int | None = None, kernel: str = "auto",
                stages: int | None = None, rt: int = 1, xmode: int = 0, kw: int | None = None,
                persist: bool | None = None):
    """How `linear` launches: (entry, grid, k_per_split, dynamic smem bytes); blocks are 256 threads.

    kernel="auto": M <= 8 -> the gemv kernel when x's rows fit GEMV_SMEM_CAP (no split across blocks: KW
    warps of a block share each 16-row W tile's K, see gemv_plan), else the x-resident kernel (2-deep W ring);
    above 8 rows the chunked kernel (any M; token tiles of 8*MT rows on blockIdx.z). Forcing `splits` keeps the
    split-K kernels. "xres" (M <= 64): its K split comes from a small cost model: per-SM
    bytes of W in the slowest wave (waves = ceil(blocks / (2 * SMs))) plus half the fp32 partial traffic
    (mostly L2), with a fixed per-block cost; fewest splits on ties; the x slice must fit XRES_SMEM_CAP.
    "chunked": K split so that the grid has about 2 blocks per SM."""
    _need(kernel in ("auto", "xres", "chunked", "gemv"), "linear",
          f"kernel {kernel!r}: 'auto', 'gemv', 'xres' or 'chunked'")
    if kernel == "auto" and LINEAR_GEMV and splits is None and gemv_fits(M, K):
        kernel = "gemv"
    if kernel == "gemv":
        _need(gemv_fits(M, K), "linear", f"the gemv kernel takes M <= 8 with x's rows in {GEMV_SMEM_CAP} bytes of "
              f"shared memory (M = {M}, K = {K} needs {_gemv_smem(M, K)})")
        entry, grid, smem = gemv_plan(M, N, K, sm_count, kw, stages, xmode, persist)
        return entry, grid, K, smem
    mt = _mt(M)
    row_blocks = -(-N // LINEAR_ROWS_PER_BLOCK)
    if kernel == "auto":
        # Measured on the H200 (docs/PERF.md): the x-resident kernel with a 2-deep ring is the fastest at
        # M <= 8 on every Qwen3-8B shape but qkv; from M = 16 the chunked kernel wins on most shapes.
        if M <= 8 or xmode:
            return linear_plan(M, N, K, sm_count, splits, "xres", stages, xmode=xmode)
        kernel = "chunked"
    _need(xmode == 0 or (kernel in ("xres", "auto") and M <= FUSED_PROLOGUE_MAX_ROWS), "linear",
          f"a fused prologue needs the x-resident kernel and M <= {FUSED_PROLOGUE_MAX_ROWS} (M = {M}, kernel "
          f"{kernel!r})")
    if kernel == "xres":
        _need(M <= 64, "linear", f"the x-resident kernel takes M <= 64, got M = {M}")
        units = -(-K // 64)
        rows = 8 * mt
        max_units = max(1, (XRES_SMEM_CAP // (2 * rows) - 32) // 64)
        slots = LINEAR_BLOCKS_PER_SM * sm_count
        if splits is None:
            best = None
            for s in range(1, min(units, 128) + 1):
                per = -(-units // s)
                if per > max_units:
                    continue
                s_eff = -(-units // per)
                waves = -(-row_blocks * s_eff // slots)
                unit_bytes = LINEAR_ROWS_PER_BLOCK * 64 * 2  # one block's W per 64-wide k unit
                cost = waves * LINEAR_BLOCKS_PER_SM * (per + XRES_BLOCK_OVERHEAD_UNITS) * unit_bytes
                if s_eff > 1:
                    cost += 0.5 * s_eff * M * N * 8 / sm_count
                if best is None or cost < best[0] - 1e-9:
                    best = (cost, s_eff)
            splits = best[1]
        per = -(-units // max(1, min(int(splits), units)))
        _need(per <= max_units, "linear", f"splits={splits} leaves {per * 64} k per block: x slice over smem cap")
        splits = -(-units // per)
        k_per_split = per * 64
        stages = stages or (2 if mt in (1, 8) else 4)  # the 2-deep ring measured faster where it exists
        from cutlass_kernels.registry import XRES_INSTANCES
        _need((mt, stages, xmode) in XRES_INSTANCES, "linear", f"no x-resident kernel <MT={mt}, "
              f"STAGES={stages}, XMODE={xmode}>; built: {sorted(XRES_INSTANCES)}")
        entry = f"linear_bf16_xres_kernel<{mt}, {stages}, {xmode}>"
        smem = rows * (k_per_split + 32) * 2
        return entry, (row_blocks, splits, 1), k_per_split, smem
    # chunked kernel (any M)
    if rt == 2 and mt == 9:
        mt = 8                                  # RT=2 exists only for the 64-row tile
    _need(rt == 1 or mt == 8, "linear", "rt=2 exists only for the 64-row token tile")
    entry = f"linear_bf16_kernel<{mt}, {rt}>"
    row_blocks = -(-N // (LINEAR_ROWS_PER_BLOCK * rt))
    z = -(-M // (8 * mt))
    chunk = 128 // rt
    n_chunks = -(-K // chunk)
    if splits is None:
        splits = max(1, min(n_chunks, -(-LINEAR_BLOCKS_PER_SM * sm_count // (row_blocks * z))))
    per = -(-n_chunks // max(1, min(int(splits), n_chunks)))
    splits = -(-n_chunks // per)
    return entry, (row_blocks, splits, z), per * chunk, 0


def prologue_checks(op: str, prologue: str, M: int, K: int, x2: DeviceArray | None, ldx2: int | None,
                    norm_weight: DeviceArray | None, sum_out: DeviceArray | None, ldsum: int | None):
    """The operand checks of a fused prologue (linear(prologue=...), also the narrow GMMA kernel's): (ldx2, ldsum)
    with the strides defaulted."""
    _need(prologue in PROLOGUES, op, f"prologue {prologue!r}: one of {', '.join(PROLOGUES)}")
    if not PROLOGUES[prologue]:
        _need(x2 is None and norm_weight is None and sum_out is None, op, "x2/norm_weight/sum_out need a prologue")
        return ldx2, ldsum
    if x2 is not None or prologue == "swiglu":
        _need(x2 is not None, op, "prologue 'swiglu' needs x2 (up)")
        _bf16(x2, op, "x2")
        _need(len(x2.shape) == 2 and x2.shape[0] == M and x2.shape[1] == K, op,
              f"x2 {x2.shape}, want [M, K] = [{M}, {K}]")
        ldx2 = ldx2 or K
        _need(ldx2 % 8 == 0 and ldx2 >= K, op, f"ldx2 = {ldx2} must be a multiple of 8 and >= K = {K}")
    if prologue == "rmsnorm":
        _need(norm_weight is not None, op, "prologue 'rmsnorm' needs norm_weight")
        _bf16(norm_weight, op, "norm_weight")
        _need(norm_weight.size == K, op, f"norm_weight has {norm_weight.size} elements, want K = {K}")
    if sum_out is not None:
        _need(prologue == "rmsnorm" and x2 is not None, op, "sum_out needs prologue 'rmsnorm' with x2")
        _bf16(sum_out, op, "sum_out")
        _need(sum_out.shape[0] == M and sum_out.shape[-1] == K, op, f"sum_out {sum_out.shape}, want [{M}, {K}]")
        ldsum = ldsum or K
        _need(ldsum % 8 == 0 and ldsum >= K, op, f"ldsum = {ldsum} must be a multiple of 8 and >= K = {K}")
    return ldx2, ldsum


def linear_checks(op: str, x: DeviceArray, w: DeviceArray, out: DeviceArray, residual: DeviceArray | None,
                  ldx: int | None, ldo: int | None, ldr: int | None):
    """The input checks of every bf16 linear entry: (M, N, K, ldx, ldo, ldr) with the strides defaulted."""
    for a, n in ((x, "x"), (w, "w"), (out, "out")):
        _bf16(a, op, n)
    _need(len(w.shape) == 2, op, f"w must be [N, K], got {w.shape}")
    N, K = w.shape
    _need(len(x.shape) == 2, op, f"x must be [M, K = {K}], got {x.shape}")
    M = x.shape[0]
    _need(x.shape[-1] == K, op, f"x {x.shape} does not match w {w.shape} (K = {K})")
    _need(M >= 1 and N >= 1, op, f"empty product: M = {M}, N = {N}")
    _need(K % 8 == 0, op, f"K = {K} must be a multiple of 8 (16-byte weight loads)")
    _need(out.shape[0] == M and out.shape[-1] == N, op, f"out {out.shape}, want [M, N] = [{M}, {N}]")
    ldx, ldo = ldx or K, ldo or N
    _need(ldx % 8 == 0 and ldx >= K, op, f"ldx = {ldx} must be a multiple of 8 and >= K = {K}")
    _need(ldo >= N, op, f"ldo = {ldo} must be >= N = {N}")
    if residual is not None:
        _bf16(residual, op, "residual")
        _need(residual.shape[0] == M and residual.shape[-1] == N, op,
              f"residual {residual.shape}, want [M, N] = [{M}, {N}]")
        ldr = ldr or N
        _need(ldr >= N, op, f"ldr = {ldr} must be >= N = {N}")
    return M, N, K, ldx, ldo, ldr


def linear(x: DeviceArray, w: DeviceArray, out: DeviceArray, residual: DeviceArray | None = None, *,
           ldx: int | None = None, ldo: int | None = None, ldr: int | None = None,
           ws: Workspace | None = None, splits: int | None = None, kernel: str = "auto",
           stages: int | None = None, rt: int = 1, kw: int | None = None, persist: bool | None = None,
           stream=None, prologue: str = "none",
           x2: DeviceArray | None = None, ldx2: int | None = None, norm_weight: DeviceArray | None = None,
           eps: float = 1e-6, sum_out: DeviceArray | None = None, ldsum: int | None = None) -> DeviceArray:
    """out[M, N] = x[M, K] @ w[N, K]^T (+ residual[M, N]) in bf16 with fp32 accumulation.
    kernel/splits/stages/rt/kw/persist override the plan (benchmarks and tests).
    prologue fuses the op that makes x into the x load (M <= FUSED_PROLOGUE_ROWS[prologue], see
    fused_prologue_ok; or wherever the sm_90a narrow-row GMMA kernel takes the linear, dense_gmma.narrow_fuses,
    whose rmsnorm rounds h * norm_weight and scales the output rows instead: within bf16 tolerance, not bit-equal):
      "rmsnorm": x <- rmsnorm(x (+ x2), norm_weight, eps), as `rmsnorm`; with x2, sum_out (optional, not
                 aliasing x or x2) receives bf16(x + x2), as rmsnorm's residual_out.
      "swiglu":  x <- silu(x) * x2 (x = gate [M, K], x2 = up [M, K]), as `swiglu`."""
    op = "linear"
    M, N, K, ldx, ldo, ldr = linear_checks(op, x, w, out, residual, ldx, ldo, ldr)
    xmode = PROLOGUES.get(prologue)
    from runtime import dense_gmma
    # the sm_90a narrow-row GMMA kernel takes the fused prologues where it takes the linear (dense_gmma.narrow_fuses)
    narrow_plan = (dense_gmma.narrow_fused_plan(M, N, K, prologue) if xmode and kernel == "auto" and splits is None
                   else None)
    _need(not xmode or narrow_plan is not None or fused_prologue_ok(M, K, prologue), op,
          f"no fused {prologue} kernel for M = {M}, K = {K}")
    ldx2, ldsum = prologue_checks(op, prologue, M, K, x2, ldx2, norm_weight, sum_out, ldsum)
    if narrow_plan is not None:
        return dense_gmma.launch_narrow(x, w, out, residual, M, N, K, ldx, ldo, ldr, narrow_plan, stream=stream,
                                        x2=x2, ldx2=ldx2, norm_weight=norm_weight, eps=eps, sum_out=sum_out,
                                        ldsum=ldsum)
    if kernel == "auto" and not xmode:  # sm_90a GMMA path from dense_gmma.GMMA_MIN_M rows, DDTREE_LINEAR_GMMA=0: off
        if dense_gmma.gmma_wanted(M, N, K):
            return dense_gmma.launch_gmma(x, w, out, residual, M, N, K, ldx, ldo, ldr, ws=ws, splits=splits,
                                          stream=stream)
    dev = get_device()
    entry, grid, k_per_split, smem = linear_plan(M, N, K, dev.sm_count, splits, kernel, stages, rt, xmode, kw,
                                                 persist)
    ws = ws or default_workspace()
    if grid[1] > 1:
        scratch = ws.scratch(grid[1] * M * N * 4)
        tickets = ws.tickets(grid[0] * grid[2])
    else:
        scratch = tickets = out  # unused by the kernel
    kern = get_kernel("dense_linear", entry)
    if smem:  # dynamic + static smem may pass 48 KB (one opt-in per kernel: Kernel.set_max_dynamic_smem)
        kern.set_max_dynamic_smem(XRES_SMEM_CAP + 8192)
    null = np.uint64(0)
    tail = [w, out, _i32(ldo), residual if residual is not None else null, _i32(ldr or 0), scratch, tickets,
            _i32(M), _i32(N), _i32(K), _i32(k_per_split)]
    if "gemv" in entry:
        tail = [w, out, _i32(ldo), residual if residual is not None else null, _i32(ldr or 0), _i32(M), _i32(N),
                _i32(K)]
    if "xres" in entry or "gemv" in entry:
        head = [x, _i32(ldx), x2 if x2 is not None else null, _i32(ldx2 or 0),
                norm_weight if norm_weight is not None else null, np.float32(eps),
                sum_out if sum_out is not None else null, _i32(ldsum or 0)]
    else:
        head = [x, _i32(ldx)]
    kern.launch(grid, 256, head + tail, smem=smem, stream=stream)
    return out


# ---------------------------------------------------------------- norms, rope, elementwise
def embedding(table: DeviceArray, ids: DeviceArray, out: DeviceArray, *, stream=None) -> DeviceArray:
    """out[t] = table[ids[t]]; ids int32 on the device (ids outside [0, V) give zero rows)."""
    op = "embedding"
    _bf16(table, op, "table")
    _bf16(out, op, "out")
    _need(len(table.shape) == 2, op, f"table must be [V, H], got {table.shape}")
    V, H = table.shape
    T = ids.size
    _need(ids.dtype == np.int32, op, f"ids must be int32, got {ids.dtype}")
    _need(T >= 1, op, "no ids")
    _need(out.shape == (T, H), op, f"out {out.shape}, want {(T, H)}")
    _need(H % 8 == 0, op, f"hidden {H} must be a multiple of 8")
    get_kernel("norm_rope", "embedding_kernel").launch(
        T, min(256, max(32, H // 8)), [table, ids, out, _i32(H), _i32(V)], stream=stream)
    return out


def rmsnorm(x: DeviceArray, weight: DeviceArray, out: DeviceArray, eps: float, *,
            residual: DeviceArray | None = None, residual_out: DeviceArray | None = None,
            ldx: int | None = None, ldo: int | None = None, stream=None) -> DeviceArray:
    """out = rmsnorm(x (+ residual)) * weight over the last axis; with `residual`, h = bf16(x + residual)
    is normalised and also written to `residual_out` (may be `residual` itself: the residual stream)."""
    op = "rmsnorm"
    for a, n in ((x, "x"), (weight, "weight"), (out, "out")):
        _bf16(a, op, n)
    H = weight.size
    _need(x.shape[-1] == H and out.shape[-1] == H, op,
          f"x {x.shape}, weight {weight.shape}, out {out.shape}: rows must have the weight's length {H}")
    rows = x.size // H
    _need(rows >= 1 and out.size // H == rows, op, f"x {x.shape} and out {out.shape} must hold the same rows")
    _need(H % 8 == 0 and H <= 8192, op, f"row length {H} must be a multiple of 8 and <= 8192")
    _need(residual_out is None or residual is not None, op,
          "residual_out without residual would never be written (it receives h = x + residual)")
    for a, n in ((residual, "residual"), (residual_out, "residual_out")):
        if a is not None:
            _bf16(a, op, n)
            _need(a.shape[-1] == H and a.size // H == rows, op, f"{n} {a.shape}, want {rows} rows of {H}")
    threads = max(32, -(-(H // 8) // 32) * 32)
    get_kernel("norm_rope", "rmsnorm_kernel").launch(
        rows, threads,
        [x, _i32(ldx or H), residual if residual is not None else np.uint64(0), _i32(H), weight,
         out, _i32(ldo or H), residual_out if residual_out is not None else np.uint64(0), _i32(H),
         _i32(H), np.float32(eps)], stream=stream)
    return out


def rope(x: DeviceArray, positions: DeviceArray, inv_freq: DeviceArray, out: DeviceArray, *,
         n_heads: int, head_dim: int, attention_scaling: float = 1.0, interleaved: bool = False,
         norm_weight: DeviceArray | None = None, eps: float = 1e-6, ldx: int | None = None,
         ldo: int | None = None, stream=None) -> DeviceArray:
    """Rotary embedding of x [T, n_heads, head_dim] (token stride ldx) into out (token stride ldo; may be
    x, or a KV-cache slice: that is the kv_write). `norm_weight`: per-head RMSNorm first (Qwen3 q/k norm).
    positions int32 [T]; inv_freq float32 [head_dim/2] with YaRN/llama3 scaling already applied."""
    op = "rope"
    _bf16(x, op, "x")
    _bf16(out, op, "out")
    D = head_dim
    _need(D % 2 == 0 and D <= 256, op, f"head_dim {D} must be even and <= 256")
    _need(positions.dtype == np.int32, op, "positions must be int32")
    _need(inv_freq.dtype == np.float32 and inv_freq.size == D // 2, op, f"inv_freq must be float32 [{D // 2}]")
    T = positions.size
    for a, n in ((x, "x"), (out, "out")):
        _need(len(a.shape) >= 2 and a.shape[0] == T and math.prod(a.shape[1:]) == n_heads * D, op,
              f"{n} {a.shape}, want [T, n_heads, head_dim] = [{T}, {n_heads}, {D}] (T = positions.size)")
    if norm_weight is not None:
        _bf16(norm_weight, op, "norm_weight")
        _need(norm_weight.size == D, op, f"norm_weight has {norm_weight.size} elements, want head_dim = {D}")
    items = T * n_heads
    warps = 4
    get_kernel("norm_rope", "rope_kernel").launch(
        -(-items // warps), 32 * warps,
        [x, _i32(ldx or n_heads * D), out, _i32(ldo or n_heads * D), positions, inv_freq,
         np.float32(attention_scaling), _i32(1 if interleaved else 0),
         norm_weight if norm_weight is not None else np.uint64(0), np.float32(eps),
         _i32(T), _i32(n_heads), _i32(D)], stream=stream)
    return out


def rope_qkv_cache(q: DeviceArray, k: DeviceArray, v: DeviceArray, positions: DeviceArray, inv_freq: DeviceArray,
                   q_out: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray, *, n_heads: int, n_kv_heads: int,
                   head_dim: int, row0: int = 0, row_offset: DeviceArray | None = None,
                   attention_scaling: float = 1.0, interleaved: bool = False, q_norm: DeviceArray | None = None,
                   k_norm: DeviceArray | None = None, eps: float = 1e-6, ldq: int | None = None,
                   ldk: int | None = None, ldv: int | None = None, ldqo: int | None = None, stream=None):
    """A llama layer's attention prologue in one launch: q_out = rope(q) and k_cache[r] = rope(k),
    v_cache[r] = v at rows r = row0 (+ *row_offset) + t, as `rope` (with q_norm / k_norm) and a cache write.
    q [T, n_heads, D], k and v [T, n_kv_heads, D] (token strides ldq/ldk/ldv); caches [capacity, n_kv_heads, D]
    contiguous; row_offset: int32 device scalar (a captured graph's prefix length)."""
    op = "rope_qkv_cache"
    D, T = head_dim, positions.size
    for a, n in ((q, "q"), (k, "k"), (v, "v"), (q_out, "q_out"), (k_cache, "k_cache"), (v_cache, "v_cache")):
        _bf16(a, op, n)
    _need(D % 8 == 0 and D <= 256, op, f"head_dim {D} must be a multiple of 8 and <= 256")
    _need(positions.dtype == np.int32, op, "positions must be int32")
    _need(inv_freq.dtype == np.float32 and inv_freq.size == D // 2, op, f"inv_freq must be float32 [{D // 2}]")
    for a, n, h in ((q, "q", n_heads), (q_out, "q_out", n_heads), (k, "k", n_kv_heads), (v, "v", n_kv_heads)):
        _need(len(a.shape) >= 2 and a.shape[0] == T and math.prod(a.shape[1:]) == h * D, op,
              f"{n} {a.shape}, want [T = {T}, {h} heads, {D}]")
    for c, n in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        _need(math.prod(c.shape[1:]) == n_kv_heads * D, op, f"{n} {c.shape}, want [capacity, {n_kv_heads}, {D}]")
    ldv = ldv or n_kv_heads * D
    _need(ldv % 8 == 0 and v.ptr % 16 == 0 and v_cache.ptr % 16 == 0, op, "v rows must be 16-byte aligned")
    if row_offset is None:
        _need(0 <= row0 and row0 + T <= k_cache.shape[0], op,
              f"rows {row0}..{row0 + T} outside the cache capacity {k_cache.shape[0]}")
    else:
        _need(row_offset.dtype == np.int32, op, "row_offset must be an int32 device scalar")
    for wt, n in ((q_norm, "q_norm"), (k_norm, "k_norm")):
        if wt is not None:
            _bf16(wt, op, n)
            _need(wt.size == D, op, f"{n} has {wt.size} elements, want head_dim = {D}")
    null = np.uint64(0)
    items = T * (n_heads + 2 * n_kv_heads)
    warps = 4
    get_kernel("norm_rope", "rope_qkv_cache_kernel").launch(
        -(-items // warps), 32 * warps,
        [q, _i32(ldq or n_heads * D), k, _i32(ldk or n_kv_heads * D), v, _i32(ldv),
         q_out, _i32(ldqo or n_heads * D), k_cache, _i32(n_kv_heads * D), v_cache, _i32(n_kv_heads * D),
         _i32(row0), row_offset if row_offset is not None else null, positions, inv_freq,
         np.float32(attention_scaling), _i32(1 if interleaved else 0),
         q_norm if q_norm is not None else null, k_norm if k_norm is not None else null, np.float32(eps),
         _i32(T), _i32(n_heads), _i32(n_kv_heads), _i32(D)], stream=stream)
    return q_out


def swiglu(gate: DeviceArray, up: DeviceArray, out: DeviceArray, *, T: int | None = None, I: int | None = None,
           ldg: int | None = None, ldu: int | None = None, ldo: int | None = None, stream=None) -> DeviceArray:
    """out = silu(gate) * up over [T, I]; gate/up may be the halves of one [T, 2I] buffer (pass ld*)."""
    op = "swiglu"
    for a, n in ((gate, "gate"), (up, "up"), (out, "out")):
        _bf16(a, op, n)
    T = T if T is not None else out.shape[0]
    I = I if I is not None else out.shape[-1]
    _need(I % 8 == 0, op, f"I = {I} must be a multiple of 8")
    if ldo is None:
        _need(out.size == T * I, op, f"out {out.shape}, want [T, I] = [{T}, {I}]")
    blocks = min(-(-T * I // 8 // 256), 4 * get_device().sm_count * 8)
    get_kernel("norm_rope", "swiglu_kernel").launch(
        max(blocks, 1), 256, [gate, _i32(ldg or I), up, _i32(ldu or I), out, _i32(ldo or I), _i32(T), _i32(I)],
        stream=stream)
    return out


def add(a: DeviceArray, b: DeviceArray, out: DeviceArray, *, stream=None) -> DeviceArray:
    op = "add"
    for x, n in ((a, "a"), (b, "b"), (out, "out")):
        _bf16(x, op, n)
    _need(a.size == b.size == out.size and a.size % 8 == 0, op,
          f"sizes {a.size}, {b.size}, {out.size} must be equal and a multiple of 8")
    blocks = min(-(-a.size // 8 // 256), 8 * get_device().sm_count)
    get_kernel("norm_rope", "add_kernel").launch(max(blocks, 1), 256, [a, b, out, np.int64(a.size)], stream=stream)
    return out


# ---------------------------------------------------------------- attention
ATTN_ROWS_PER_BLOCK = 64
ATTN_TILE_KEYS = 64


def attention_smem_bytes(head_dim: int) -> int:
    return 2 * 2 * ATTN_TILE_KEYS * (head_dim + 8) * 2  # K and V, two stages, padded rows


# decode_attention_kernel<D, KT, S>: one block per 16 packed query rows (one warp's mma rows) of a KV head; each of
# the 4 warps streams its own KT-slot K/V tiles through an S-stage ring. DECODE_VARIANTS: (KT, S) per head dim
# (instances: DECODE_ATTN_VARIANTS). DDTREE_ATTN_DECODE=0: tree_attention_kernel for every shape (A/B).
DECODE_ATTN_ROWS = 16
# Picked in the engine's AR graph, not alone: the smallest ring at D = 64 (37 KB of shared memory per block; the
# 110 KB of <64, 32, 3>, fastest alone, made the SmolLM2 AR step 5-8% slower), 32x2 at D = 128 (docs/PERF.md).
DECODE_VARIANTS = {64: (16, 2), 128: (32, 2)}
ATTN_DECODE = os.environ.get("DDTREE_ATTN_DECODE", "1") != "0"
# Rows per KV head up to which "auto" takes the decode kernel (one block per 16 rows), per head dim: at D = 64 it
# wins up to 195 rows (SmolLM2 b64); at 387 rows (b128) the SmolLM2 verify graph ran 5-7% faster on the gmma
# kernel and 1-3% faster on the tree kernel (session 18; in session 16 the decode kernel still beat the tree kernel
# there); at D = 128 the tree kernel's 64-row blocks, which share each K/V tile among 4 warps, win from 68 rows
# (docs/PERF.md, session 16).
DECODE_MAX_ROWS = {64: 256, 128: DECODE_ATTN_ROWS}


def decode_attention_smem_bytes(head_dim: int, variant: tuple[int, int]) -> int:
    kt, stages = variant
    return 4 * stages * 2 * kt * (head_dim + 8) * 2  # 4 warps x stages x K and V, padded rows


# tree_attention_gmma_kernel<D, STAGES> (sm_90a, tree_attention_sm90.cu): the tree kernel's contract on wgmma, one
# warpgroup per 64 packed rows; STAGES-deep K/V ring (instances: TREE_ATTN_GMMA_INSTANCES). "auto" takes it on
# sm_90a where it would take tree_attention_kernel, for the head dims of ATTN_GMMA_AUTO_DIMS. H200 (docs/PERF.md,
# session 18: per-thread tile copies and the FFMA / ex2.approx softmax), against the tree kernel: Qwen3-8B heads
# (D = 128), prefix 1k-32k, budgets 16-256, 1.1-1.6x faster with 3 stages; SmolLM2 heads (D = 64), budgets
# 128-1024 at prefix 1k-8k, 1.0-1.46x with 4 stages (2 stages: 0.95-1.22x). DDTREE_ATTN_GMMA=0: the tree kernel
# everywhere (A/B).
# K/V ring depth per head dim: a depth, or {fewest packed rows per KV head: depth}. At D = 128 from 256 rows (b64 at
# G = 4) 2 stages (65 KB, three blocks per SM) beat 3 (97 KB, two): 8k b64 37.1 vs 42.2 us, b256 112.4 vs 124.2,
# 32k 0.97 / 0.90x; at 68 rows (b16) 3 won (8k 25.3 vs 27.9 us), as at 1k b64 (14.9 vs 16.5; H200, session 18).
ATTN_GMMA_STAGES = {64: 4, 128: {0: 3, 256: 2}}
ATTN_GMMA_AUTO_DIMS = (64, 128)
ATTN_GMMA = os.environ.get("DDTREE_ATTN_GMMA", "1") != "0"
ATTN_GMMA_ARCHS = ("90a",)


def gmma_stages(head_dim: int, rows: int) -> int:
    """The gmma kernel's ring depth (ATTN_GMMA_STAGES) for `rows` packed (query, head) rows per KV head."""
    depth = ATTN_GMMA_STAGES[head_dim]
    return depth if isinstance(depth, int) else depth[max(r for r in depth if r <= rows)]


def tree_attention_gmma_smem_bytes(head_dim: int, stages: int) -> int:
    """stages x (K, V) tiles of 64 rows x head_dim bf16, + 1 KB to align the swizzled tiles."""
    return 1024 + 2 * stages * 64 * head_dim * 2


def decode_variant(head_dim: int, variant: tuple[int, int] | None = None) -> tuple[int, int]:
    """(KT, S) of the decode kernel for head_dim: `variant` if given (it must be an instance), else the default."""
    from cutlass_kernels.registry import DECODE_ATTN_VARIANTS
    variant = tuple(variant) if variant is not None else DECODE_VARIANTS[head_dim]
    _need(variant in DECODE_ATTN_VARIANTS, "attention", f"decode variant {variant}: instances are "
          f"{DECODE_ATTN_VARIANTS}")
    return variant


def attention_kernel_for(T: int, Hq: int, Hkv: int, D: int, kernel: str | None = None,
                         arch: str | None = None) -> str:
    """"decode" (decode_attention_kernel) where a KV head's T * G query rows are at most DECODE_MAX_ROWS[D]; else
    "gmma" (tree_attention_gmma_kernel) on an arch of ATTN_GMMA_ARCHS for D in ATTN_GMMA_AUTO_DIMS (when
    ATTN_GMMA); else "tree" (tree_attention_kernel). `kernel` forces one (each takes any rows; "gmma" only on
    ATTN_GMMA_ARCHS). Without `arch` the answer is "decode" or "tree" (the decode choice needs no arch)."""
    if kernel is not None:
        _need(kernel in ("decode", "tree", "gmma"), "attention", f"kernel {kernel!r}: 'decode', 'tree' or 'gmma'")
        _need(kernel != "gmma" or arch is None or arch in ATTN_GMMA_ARCHS, "attention",
              f"the gmma attention kernel is built for sm_{'/'.join(ATTN_GMMA_ARCHS)}, this device is sm_{arch}")
        return kernel
    if T * (Hq // Hkv) <= DECODE_MAX_ROWS.get(D, DECODE_ATTN_ROWS) and ATTN_DECODE:
        return "decode"
    return "gmma" if ATTN_GMMA and arch in ATTN_GMMA_ARCHS and D in ATTN_GMMA_AUTO_DIMS else "tree"


# KV split plan of tree_attention_kernel: a cost model fitted to split sweeps on the H200 (docs/PERF.md, "Dense
# attention split plan"; largest miss 6.5% over 30 shapes). A block (4 warps, 64 query rows of one KV head) is
# latency-bound: a round of 64-key tiles over the blocks resident on an SM (ATTN_BLOCKS_PER_SM, registers and
# shared memory) costs ATTN_ROUND_US whether the rows are full or not. The combine kernel pays a fixed cost, a
# latency per split and a read of every split's fp32 partials.
ATTN_ROUND_US = 2.5
ATTN_BLOCKS_PER_SM = {64: 4, 128: 2}   # sm_90a: 128 / 206 registers x 128 threads (test_attention_occupancy)
ATTN_MERGE_US = 1.5
ATTN_MERGE_SPLIT_US = 0.2
ATTN_MERGE_BYTES_PER_US = 4.0e6
ATTN_MAX_SPLITS = 64
# tree_attention_gmma_kernel's round at D = 128, fitted to its split sweeps (H200, session 19: counts 2..32 at
# Qwen3-8B heads, prefix 1k / 8k / 32k, budgets 16 / 64 / 256): since session 18 a tile costs a third of the
# instructions, so the merge weighs more against a round than the tree kernel's 2.5 us gave (planned counts had
# measured up to 1.28x the best: 1k b16 9 splits 12.0 us vs 8 splits 9.4). Alone: 1k b16 12.0 -> 9.9 us, 8k b16
# 25.5 -> 23.5, 8k b256 112.5 -> 107.1; in the 12-layer Qwen3-8B-shaped verify graph b16 -2.1% / -1.8% at prefix
# 512 / 1024, b64 -0.7% at 1024, +0.7% at 128. At D = 64 the fit (0.4) won alone at b128 / b256 from 1k but lost
# 3.5-8% in SmolLM2's verify graph (b128 / b256, prompts 64-256): D = 64 keeps ATTN_ROUND_US.
ATTN_GMMA_ROUND_US = {128: 0.6}


# decode_attention_kernel's plan: the same model with its own constants. A round is one KT-slot tile per warp, the
# four warps of a block side by side (a block takes ceil(tiles / 4) rounds of its split's tiles); resident blocks
# per SM from the driver (attention_split_table) or the caller. Rounds fitted to split sweeps (~1.0 us for 32
# slots); the combine's fixed cost is what it adds inside the engine's AR graph, where PDL hides its launch: with
# ATTN_MERGE_US the plan kept one split up to prefix ~400, which measured slower there (docs/PERF.md).
DECODE_ROUND_US = {16: 0.6, 32: 1.0}
DECODE_MERGE_US = 0.5


def attention_splits(T: int, Hq: int, Hkv: int, n_keys: int, sm_count: int, D: int = 128,
                     kernel: str = "tree", decode: tuple[int, int] | None = None, blocks_per_sm: int = 1) -> int:
    """KV splits (blocks along z) for T queries over n_keys cache slots on `kernel` ("tree"; "decode" with its
    (KT, S) variant and resident blocks per SM; "gmma" with its resident blocks per SM): the fewest whose time
    under the cost model above is within 2% of the fastest."""
    if kernel == "decode":
        kt, _ = decode_variant(D, decode)
        blocks, tile_keys, per_round = -(-T * (Hq // Hkv) // DECODE_ATTN_ROWS) * Hkv, kt, 4
        resident, round_us, merge_us = sm_count * blocks_per_sm, DECODE_ROUND_US[kt], DECODE_MERGE_US
    else:   # tree / gmma: 64 packed rows per block, 64-slot tiles; the gmma kernel's resident blocks come from the
        # driver and its round from its own sweeps
        blocks, tile_keys, per_round = -(-T * (Hq // Hkv) // ATTN_ROWS_PER_BLOCK) * Hkv, ATTN_TILE_KEYS, 1
        resident = sm_count * (blocks_per_sm if kernel == "gmma" else ATTN_BLOCKS_PER_SM.get(D, 2))
        round_us = ATTN_GMMA_ROUND_US.get(D, ATTN_ROUND_US) if kernel == "gmma" else ATTN_ROUND_US
        merge_us = ATTN_MERGE_US
    tiles = max(1, -(-n_keys // tile_keys))

    def est_us(s: int) -> float:
        us = -(-blocks * s // resident) * -(-tiles // (s * per_round)) * round_us
        if s > 1:
            us += merge_us + s * ATTN_MERGE_SPLIT_US + s * T * Hq * D * 4 / ATTN_MERGE_BYTES_PER_US
        return us

    counts = range(1, min(tiles, ATTN_MAX_SPLITS) + 1)
    best = min(est_us(s) for s in counts)
    return next(s for s in counts if est_us(s) <= 1.02 * best)


_split_tables: dict[tuple, tuple[DeviceArray, np.ndarray]] = {}


def attention_split_table(T: int, Hq: int, Hkv: int, D: int, capacity: int, sm_count: int, kernel: str = "tree",
                          decode: tuple[int, int] | None = None):
    """The split plan of `kernel` (and decode variant) for every prefix: int32 [capacity tiles + 1], entry n =
    attention_splits for n 64-slot key tiles, on the device (the attention kernel and the combine kernel read
    the replayed prefix's entry, so a graph captured once runs every prefix with its own plan) and on the host.
    Made (one upload) on the first call for a shape, outside any capture; cached."""
    from runtime.cuda import graph, to_device
    decode = decode_variant(D, decode) if kernel == "decode" else None
    stages = gmma_stages(D, T * (Hq // Hkv)) if kernel == "gmma" else None
    key = (T, Hq, Hkv, D, capacity, sm_count, kernel, decode, stages)
    hit = _split_tables.get(key)
    if hit is None:
        _need(not graph._active, "attention", "the KV split table for this shape is made on first use: run the "
              "attention once before capturing it (as the engine's warm-up run does)")
        tiles = -(-capacity // ATTN_TILE_KEYS)
        per_sm = 1
        if decode is not None:
            kern, smem = _decode_kernel(D, decode)
            per_sm = kern.blocks_per_sm(128, smem)
        elif kernel == "gmma":
            kern, smem = _gmma_attention_kernel(D, stages)
            per_sm = kern.blocks_per_sm(128, smem)
        plan = np.asarray([1] + [attention_splits(T, Hq, Hkv, n * ATTN_TILE_KEYS, sm_count, D, kernel, decode, per_sm)
                                 for n in range(1, tiles + 1)], np.int32)
        hit = _split_tables[key] = (to_device(plan), plan)
    return hit


def attention_grid_splits(plan: np.ndarray, max_keys: int) -> int:
    """The split grid a launch needs for prefixes up to max_keys keys: the most any of them plans."""
    return int(plan[:-(-max_keys // ATTN_TILE_KEYS) + 1].max())


def _decode_kernel(D: int, variant: tuple[int, int]):
    """decode_attention_kernel<D, KT, S> with its dynamic shared memory allowed; (kernel, smem bytes)."""
    kt, stages = variant
    kern = get_kernel("tree_attention", f"decode_attention_kernel<{D}, {kt}, {stages}>")
    smem = decode_attention_smem_bytes(D, variant)
    if smem > 48 * 1024:
        kern.set_max_dynamic_smem(smem)
    return kern, smem


def _gmma_attention_kernel(D: int, stages: int):
    """tree_attention_gmma_kernel<D, stages> with its dynamic shared memory allowed; (kernel, smem bytes)."""
    from cutlass_kernels.registry import TREE_ATTN_GMMA_INSTANCES
    _need((D, stages) in TREE_ATTN_GMMA_INSTANCES, "attention", f"no gmma attention instance <{D}, {stages}>; "
          f"built: {TREE_ATTN_GMMA_INSTANCES}")
    kern = get_kernel("tree_attention_sm90", f"tree_attention_gmma_kernel<{D}, {stages}>")
    smem = tree_attention_gmma_smem_bytes(D, stages)
    kern.set_max_dynamic_smem(smem)
    return kern, smem


def attention(q: DeviceArray, k_cache: DeviceArray, v_cache: DeviceArray, n_prefix, visibility: DeviceArray,
              scale: float, out: DeviceArray, *, T: int | None = None, max_keys: int | None = None,
              ldq: int | None = None, ldk: int | None = None, ldv: int | None = None, ldo: int | None = None,
              splits: int | None = None, kernel: str | None = None, decode: tuple[int, int] | None = None,
              ws: Workspace | None = None, stream=None) -> DeviceArray:
    """base.py `attention`: q [T, Hq, D] over cache slots [0, n_prefix + T) of k_cache/v_cache
    [cap, Hkv, D]; prefix slots visible to all, new slot n_prefix + j visible to query i iff bit j of
    visibility row i (uint32 [T, ceil(T/32)], on the device). n_prefix: int or int32 device scalar (then
    pass max_keys, an upper bound on n_prefix + T, to size the KV split grid). A forced `splits` runs exactly
    that many; the planned grid is the most any prefix up to max_keys plans, and at replay the kernels use the
    count planned for the actual prefix (attention_split_table). kernel: see attention_kernel_for; decode: the
    decode kernel's (KT, S) instance (default DECODE_VARIANTS)."""
    op = "attention"
    for a, n in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache"), (out, "out")):
        _bf16(a, op, n)
    _need(len(q.shape) == 3, op, f"q must be [T, Hq, D], got {q.shape}")
    _need(len(k_cache.shape) >= 3, op, f"k_cache must be [capacity, Hkv, D], got {k_cache.shape}")
    T = T if T is not None else q.shape[0]
    Hq, D = q.shape[-2], q.shape[-1]
    _need(1 <= T <= q.shape[0], op, f"T = {T} must be in 1..{q.shape[0]} (q {q.shape})")
    _need(out.shape[0] >= T and math.prod(out.shape[1:]) == Hq * D, op, f"out {out.shape}, want [T, Hq, D] = "
          f"[{T}, {Hq}, {D}]")
    cap, Hkv, Dk = k_cache.shape[-3:]
    _need(Dk == D and v_cache.shape[-1] == D, op, f"head dims q {D}, k {Dk}, v {v_cache.shape[-1]} must agree")
    _need(D in (64, 128), op, f"head_dim {D}: kernels exist for 64 and 128")
    _need(Hq % Hkv == 0, op, f"Hq = {Hq} not a multiple of Hkv = {Hkv}")
    ldq, ldk, ldv, ldo = ldq or Hq * D, ldk or Hkv * D, ldv or Hkv * D, ldo or Hq * D
    _need(ldq >= Hq * D and ldo >= Hq * D and ldk >= Hkv * D and ldv >= Hkv * D, op,
          f"row strides q {ldq}, k {ldk}, v {ldv}, out {ldo} are shorter than a row ({Hq} / {Hkv} heads x {D})")
    _need(ldq % 2 == 0 and ldo % 2 == 0 and ldk % 8 == 0 and ldv % 8 == 0, op,
          f"row strides q {ldq} and out {ldo} must be even (4-byte accesses), k {ldk} and v {ldv} multiples of 8 "
          "(16-byte copies)")
    # the kernel name and the decode variant are checked before the device is touched (the decode choice needs no
    # arch; tree vs gmma is made below, by the device's)
    decode = decode_variant(D, decode) if attention_kernel_for(T, Hq, Hkv, D, kernel) == "decode" else None
    words = -(-T // 32)
    _need(visibility.dtype == np.uint32 and visibility.size >= T * words, op,
          f"visibility must be uint32 [{T}, {words}], got {visibility.dtype} {visibility.shape}")
    if not isinstance(n_prefix, DeviceArray):
        _need(0 <= int(n_prefix) and int(n_prefix) + T <= cap, op, f"n_prefix {n_prefix} + T {T} > capacity {cap}")
        max_keys = int(n_prefix) + T
    _need(max_keys is not None, op, "pass max_keys with a device n_prefix")
    _need(T <= max_keys <= cap, op, f"max_keys = {max_keys} must be in T..capacity = {T}..{cap}")
    n_prefix_dev = _scalar_on_device(n_prefix, "n_prefix", op)
    dev = get_device()
    kernel = attention_kernel_for(T, Hq, Hkv, D, kernel, dev.arch)
    split_table = np.uint64(0)  # forced: the kernels use every split of the grid
    if splits is None:
        split_table, plan = attention_split_table(T, Hq, Hkv, D, cap, dev.sm_count, kernel, decode)
        splits = attention_grid_splits(plan, max_keys)
    G = Hq // Hkv
    grid = (-(-T * G // (DECODE_ATTN_ROWS if kernel == "decode" else ATTN_ROWS_PER_BLOCK)), Hkv, splits)
    ws = ws or default_workspace()
    if splits > 1:
        scratch = ws.scratch(splits * T * Hq * (D + 1) * 4)
        ws_o = scratch
        ws_lse = scratch.view(splits * T * Hq * D, (splits * T * Hq,))
    else:
        ws_o = ws_lse = out  # unused
    if decode is not None:
        kern, smem = _decode_kernel(D, decode)
    elif kernel == "gmma":
        kern, smem = _gmma_attention_kernel(D, gmma_stages(D, T * G))
    else:
        kern = get_kernel("tree_attention", f"tree_attention_kernel<{D}>")
        smem = attention_smem_bytes(D)
        if smem > 48 * 1024:
            kern.set_max_dynamic_smem(smem)
    kern.launch(grid, 128,
                [q, _i32(ldq), k_cache, _i32(ldk), v_cache, _i32(ldv),
                 visibility, _i32(words), n_prefix_dev, out, _i32(ldo), ws_o, ws_lse,
                 _i32(T), _i32(Hq), _i32(Hkv), np.float32(scale / LN2), split_table],
                smem=smem, stream=stream)
    if splits > 1:
        get_kernel("tree_attention", f"attention_combine_kernel<{D}>").launch(
            T * Hq, D, [ws_o, ws_lse, _i32(splits), out, _i32(ldo), _i32(T), _i32(Hq), n_prefix_dev,
                        split_table], stream=stream)
    return out


# ---------------------------------------------------------------- sampling, KV commit
def _logits_checks(logits: DeviceArray, op: str, V: int | None, ld: int | None):
    _bf16(logits, op, "logits")
    _need(len(logits.shape) == 2, op, f"logits must be [rows, V], got {logits.shape}")
    rows = logits.shape[0]
    V = V or logits.shape[-1]
    ld = ld or logits.shape[-1]
    _need(rows >= 1 and V >= 1, op, f"logits {logits.shape}: no rows or no vocabulary")
    _need(ld % 8 == 0, op, f"row stride {ld} must be a multiple of 8 (16-byte loads)")
    _need(V <= ld, op, f"V = {V} is more than the row stride {ld}")
    return rows, V, ld


def log_softmax_topk(logits: DeviceArray, k: int, out_logp: DeviceArray, out_ids: DeviceArray, *,
                     V: int | None = None, ld: int | None = None, stream=None):
    """Per row of bf16 logits [L, V]: the k largest log_softmax values (float32 [L, k], descending) and
    their ids (int32 [L, k]); ties: lower id first. Exact; k <= 1024."""
    op = "log_softmax_topk"
    rows, V, ld = _logits_checks(logits, op, V, ld)
    _need(1 <= k <= min(1024, V), op, f"k = {k} must be in 1..min(1024, V = {V})")
    _need(out_logp.dtype == np.float32 and out_logp.size >= rows * k, op, "out_logp must be float32 [L, k]")
    _need(out_ids.dtype == np.int32 and out_ids.size >= rows * k, op, "out_ids must be int32 [L, k]")
    get_kernel("sampling", "log_softmax_topk_kernel").launch(
        rows, 1024, [logits, _i32(ld), _i32(V), _i32(k), out_logp, out_ids], stream=stream)
    return out_logp, out_ids


ARGMAX_CHUNK = 2048          # the unit of a row's split: one pass of 256 threads x 8 columns
ARGMAX_BLOCKS_PER_SM = 4     # a split aims at about this many blocks in all


def argmax_chunk(rows: int, V: int, sm_count: int) -> int:
    """Columns per argmax block: rows are split into chunks of whole ARGMAX_CHUNK units (merged in-kernel)
    so that all rows together make about ARGMAX_BLOCKS_PER_SM blocks per SM. One row (decode) gets
    2048-column blocks; a verify bucket's rows bigger ones (65 x 151936: 8 blocks of 20480 per row, where
    2048-column blocks ran 11.4 us on the H200); enough rows get one block each (chunk >= V)."""
    units = -(-V // ARGMAX_CHUNK)
    per_block = -(-rows * units // (ARGMAX_BLOCKS_PER_SM * sm_count))
    return V if per_block >= units else ARGMAX_CHUNK * per_block


def argmax(logits: DeviceArray, out: DeviceArray, *, V: int | None = None, ld: int | None = None,
           ws: Workspace | None = None, stream=None) -> DeviceArray:
    """out[row] = index of the row's largest logit (ties: lowest index); int32 [rows]."""
    op = "argmax"
    rows, V, ld = _logits_checks(logits, op, V, ld)
    _need(out.dtype == np.int32 and out.size >= rows, op, "out must be int32 [rows]")
    chunk = argmax_chunk(rows, V, get_device().sm_count)
    chunks = -(-V // chunk)
    ws = ws or default_workspace()
    slots, tickets = (ws.slots64(rows), ws.tickets(rows)) if chunks > 1 else (np.uint64(0), np.uint64(0))
    get_kernel("sampling", "argmax_kernel").launch(
        (chunks, rows), 256, [logits, _i32(ld), _i32(V), out, _i32(chunk), slots, tickets], stream=stream)
    return out


def sample(logits: DeviceArray, temperature: float, positions: DeviceArray, key: DeviceArray, out: DeviceArray, *,
           V: int | None = None, ld: int | None = None, stream=None) -> DeviceArray:
    """base.py `sample`: per row, the first index whose cumulative softmax(logits / T) mass exceeds u * total,
    u = the Philox uniform of (key, positions[row]) (runtime/philox.py), drawn in the kernel. positions int32
    [rows] and key uint32 [2] on the device (a graph reads the seed at replay); out int32 [rows]."""
    op = "sample"
    rows, V, ld = _logits_checks(logits, op, V, ld)
    _need(temperature > 0, op, f"temperature {temperature} must be > 0 (use argmax for greedy)")
    _need(isinstance(positions, DeviceArray) and positions.dtype == np.int32 and positions.size >= rows, op,
          f"positions must be an int32 device array [rows = {rows}], got "
          f"{getattr(positions, 'dtype', type(positions).__name__)} {getattr(positions, 'shape', '')}")
    _need(isinstance(key, DeviceArray) and key.dtype == np.uint32 and key.size >= 2, op,
          f"key must be a uint32 device array [2] (the seed's lo, hi words), got "
          f"{getattr(key, 'dtype', type(key).__name__)} {getattr(key, 'shape', '')}")
    _need(out.dtype == np.int32 and out.size >= rows, op, "out must be int32 [rows]")
    get_kernel("sampling", "sample_kernel").launch(
        rows, 256, [logits, _i32(ld), _i32(V), np.float32(1.0 / temperature), positions, key, out], stream=stream)
    return out


class KVPlanes:
    """The cache planes a KV commit moves rows in (every layer's K and V, plus any per-token buffer such
    as tap-layer hidden states): their device pointers, uploaded once. All rows have the same byte size."""

    def __init__(self, caches: list[DeviceArray]):
        _need(len(caches) > 0, "kv_compact", "no cache planes")
        _need(all(c.shape[0] > 0 and getattr(c, "contiguous", True) for c in caches), "kv_compact",
              "cache planes must be non-empty and contiguous (rows of one plane are moved as whole rows)")
        row_bytes = {c.nbytes // c.shape[0] for c in caches}
        _need(len(row_bytes) == 1, "kv_compact", f"planes have different row sizes {sorted(row_bytes)}")
        self.row_bytes = row_bytes.pop()
        _need(self.row_bytes % 16 == 0, "kv_compact", f"row of {self.row_bytes} bytes is not a multiple of 16")
        self.capacity = min(c.shape[0] for c in caches)
        self.count = len(caches)
        self.caches = list(caches)  # keeps them alive
        self.pointers = empty((self.count,), np.uint64)
        self.pointers.upload(np.array([c.ptr for c in caches], dtype=np.uint64))


def kv_compact(planes: KVPlanes, src_slots, dst_start=None, *, meta: DeviceArray | None = None,
               stream=None):
    """For every plane: cache[dst_start + i] = cache[src_slots[i]], i < m (base.py `kv_compact`; src_slots
    ascending, src_slots[i] >= dst_start + i). Graph use: src_slots int32 device [max_m] and
    meta int32 device [2] = (dst_start, m). Eager use: host src_slots and dst_start are uploaded."""
    op = "kv_compact"
    if meta is None:
        host = np.asarray(src_slots, dtype=np.int64)
        _need(dst_start is not None, op, "dst_start is required without meta")
        _need(host.ndim == 1, op, f"src_slots must be 1-D, got shape {host.shape}")
        _need(np.all(host >= int(dst_start) + np.arange(host.size)) and np.all(np.diff(host) > 0), op,
              "src_slots must be strictly ascending with src_slots[i] >= dst_start + i (the accepted nodes after "
              "the prefix)")
        _need(host.size == 0 or (host.max() < planes.capacity and int(dst_start) + host.size <= planes.capacity),
              op, f"slots exceed the cache capacity {planes.capacity}")
        meta = _scalar_on_device([int(dst_start), host.size], "meta", op)
        src_slots = _scalar_on_device(host if host.size else [0], "src_slots", op)
    else:
        _need(isinstance(meta, DeviceArray) and meta.dtype == np.int32 and meta.size >= 2, op,
              "meta must be an int32 device array [2] = (dst_start, m)")
        _need(isinstance(src_slots, DeviceArray) and src_slots.dtype == np.int32, op,
              "with meta, src_slots must be an int32 device array")
    vecs = planes.row_bytes // 16
    threads = min(256, max(32, vecs))
    get_kernel("sampling", "kv_compact_kernel").launch(
        (-(-vecs // threads), planes.count), threads,
        [planes.pointers, _i32(planes.row_bytes), src_slots, meta], stream=stream)
