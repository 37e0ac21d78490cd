"""Kimi K2.x kernels on device buffers: MoE routing, the INT4 W4A16 MoE layer, MLA absorbed attention.

Kernel sources: cutlass_kernels/moe_routing.cu, moe_int4.cu, mla_verify.cu (design notes at their tops).
Numpy references: runtime/kimi_reference.py. Benchmarks: tools/bench_moe.py, tools/bench_mla.py.

INT4 expert layout (`repack_int4_experts`, cached by loader.int4): for a matrix [N, K] (N output rows):
  packed uint32 [N/16, K/64, 32, 4]: row block, 64-wide K unit, lane, word. Lane l = 4g + t holds the mma
    A fragments of rows g and g+8 for 4 k16 steps; inside a unit the K order is permuted so that lane t
    covers physical columns 16t..16t+15 (step s: columns 16t+4s..16t+4s+3). Word s, nibble i holds row
    g + 8*(i & 1), column 16t + 4s + 2*((i >> 1) & 1) + (i >> 2), as q + 8.
  scales uint16 (bf16) [N/16, K/512, 16, 8, 2]: row block, 512-wide superblock, lane pair p = 2g + (t >> 1),
    unit u, row half r: scale of row 16rb + g + 8r, group (512sb + 64u)/32 + (t >> 1).
Requirements: N % 16 == 0, K % 512 == 0 (Kimi: 2048 and 7168).
"""
from __future__ import annotations

import contextlib
import math
import os
import warnings
from dataclasses import dataclass

import numpy as np

GROUP = 32
KIMI_TOPK = 8
KIMI_SCALING = 2.827

# ------------------------------------------------------------------------------------------------------
# Weight repack (CPU, numpy; runs once per tensor at load, cached on disk by loader.int4)


def _nibble_coords():
    """For nibble i of a word: (row half, column inside the lane's 4-column step group)."""
    i = np.arange(8)
    return i & 1, 2 * ((i >> 1) & 1) + (i >> 2)


def slot_order_source(c):
    """The physical column (0..63) of slot c of a 64-column unit in the slot order of the wgmma PIPE 6 path
    (moe_int4_sm90.cu x_slot_source): slot 16 s + 8 h + 2 t + b of k16 step s is what lane quad position t's
    repacked word s holds for A register pair h, i.e. physical column 16 t + 4 s + 2 h + b."""
    c = np.asarray(c)
    return 16 * ((c >> 1) & 3) + 4 * (c >> 4) + 2 * ((c >> 3) & 1) + (c & 1)


def repack_int4_experts(weight_packed: np.ndarray, weight_scale: np.ndarray, weight_shape):
    """compressed-tensors pack-quantized INT4 -> this module's kernel layout.

    weight_packed int32 [N, K/8] or [E, N, K/8]; weight_scale bf16 bits (uint16) [N, K/32] or [E, N, K/32];
    weight_shape (N, K). Returns (packed uint32 [(E,) N/16, K/64, 32, 4], scales uint16 [(E,) N/16, K/512,
    16, 8, 2])."""
    n, k = (int(v) for v in np.asarray(weight_shape).ravel()[-2:])
    wp = np.asarray(weight_packed)
    ws = np.asarray(weight_scale)
    if wp.dtype not in (np.int32, np.uint32) or ws.dtype != np.uint16:
        raise ValueError(f"weight_packed must be int32 and weight_scale bf16 bits (uint16), got {wp.dtype} and "
                         f"{ws.dtype}")
    if wp.ndim != ws.ndim or wp.ndim not in (2, 3) or (wp.ndim == 3 and wp.shape[0] != ws.shape[0]):
        raise ValueError(f"weight_packed {wp.shape} and weight_scale {ws.shape}: want [N, K/8] and [N, K/32], "
                         f"or both stacked over the same experts")
    if wp.ndim == 3:
        outs = [repack_int4_experts(wp[e], ws[e], (n, k)) for e in range(wp.shape[0])]
        return np.stack([o[0] for o in outs]), np.stack([o[1] for o in outs])
    if n % 16 or k % 512:
        raise ValueError(f"INT4 MoE layout needs N % 16 == 0 and K % 512 == 0, got N={n}, K={k}")
    if wp.shape != (n, k // 8) or ws.shape != (n, k // GROUP):
        raise ValueError(f"weight_packed {wp.shape} / weight_scale {ws.shape} do not match shape ({n}, {k}) "
                         f"with group {GROUP}")
    words = np.ascontiguousarray(wp).view(np.uint32)
    nib = ((words[:, :, None] >> (np.arange(8, dtype=np.uint32) * 4)) & 0xF).reshape(n, k)   # q + 8
    # [rb, rhalf, g, unit, t, s, c] with row = 16rb + 8rhalf + g and column = 64unit + 16t + 4s + c
    q = nib.reshape(n // 16, 2, 8, k // 64, 4, 4, 4).transpose(0, 3, 2, 4, 5, 1, 6)  # rb, u, g, t, s, rh, c
    rh, col = _nibble_coords()
    packed = np.zeros(q.shape[:5], np.uint32)
    for i in range(8):
        packed |= q[..., rh[i], col[i]].astype(np.uint32) << np.uint32(4 * i)
    packed = packed.reshape(n // 16, k // 64, 32, 4)
    # scales [N, K/32] -> [rb, r, g, sb, u, th] -> [rb, sb, g, th, u, r]
    sc = np.ascontiguousarray(ws).view(np.uint16).reshape(n // 16, 2, 8, k // 512, 8, 2)
    scales = sc.transpose(0, 3, 2, 5, 4, 1).reshape(n // 16, k // 512, 16, 8, 2)
    return np.ascontiguousarray(packed), np.ascontiguousarray(scales)


def unrepack_int4_experts(packed: np.ndarray, scales: np.ndarray, weight_shape):
    """The inverse of repack_int4_experts for one matrix: (weight_packed int32 [N, K/8], weight_scale uint16)."""
    n, k = (int(v) for v in weight_shape)
    rh, col = _nibble_coords()
    w = np.asarray(packed, np.uint32).reshape(n // 16, k // 64, 8, 4, 4)      # rb, u, g, t, s
    q = np.zeros((n // 16, k // 64, 8, 4, 4, 2, 4), np.uint32)                 # rb, u, g, t, s, rh, c
    for i in range(8):
        q[..., rh[i], col[i]] = (w >> np.uint32(4 * i)) & 0xF
    nib = q.transpose(0, 5, 2, 1, 3, 4, 6).reshape(n, k)
    words = np.zeros((n, k // 8), np.uint32)
    nib8 = nib.reshape(n, k // 8, 8)
    for i in range(8):
        words |= nib8[:, :, i] << np.uint32(4 * i)
    sc = np.asarray(scales, np.uint16).reshape(n // 16, k // 512, 8, 2, 8, 2)  # rb, sb, g, th, u, r
    ws = sc.transpose(0, 5, 2, 1, 4, 3).reshape(n, k // GROUP)
    return words.view(np.int32), np.ascontiguousarray(ws)


def _register_repacker():
    try:
        from loader.int4 import register_int4_repacker
    except ImportError:   # loader not importable: the function still works directly
        return

    def fn(weight_packed, weight_scale, shape):
        packed, scales = repack_int4_experts(weight_packed, weight_scale, shape)
        return {"packed": packed, "scales": scales}

    register_int4_repacker(fn, name="kimi_moe_w4a16", version="1")


_register_repacker()

# ------------------------------------------------------------------------------------------------------
# GPU side


def _cuda():
    from . import cuda
    return cuda


def _family_archs(family: str) -> tuple:
    from cutlass_kernels.registry import FAMILIES
    return FAMILIES[family].archs


def _family_runs_here(family: str, dev) -> bool:
    """Whether the registry builds `family` for the device's arch (the sm_90a-only wgmma families)."""
    return dev.arch in _family_archs(family)


I32, F32 = np.int32, np.float32


@dataclass
class MoeWeights:
    """Repacked INT4 experts on the device: gate/up [E, I/16, K/64, 32, 4] (+ scales), down [E, K/16, I/64, ..]."""
    num_experts: int
    hidden: int          # K of gate/up, N of down (7168)
    inter: int           # N of gate/up, K of down (2048)
    gate_q: object
    gate_s: object
    up_q: object
    up_s: object
    down_q: object
    down_s: object

    @property
    def bytes_per_expert(self) -> int:
        return sum(a.nbytes for a in (self.gate_q, self.gate_s, self.up_q, self.up_s, self.down_q,
                                      self.down_s)) // self.num_experts

    @classmethod
    def upload(cls, gate, up, down):
        """gate/up/down: (packed, scales) numpy pairs from repack_int4_experts, stacked over experts."""
        cuda = _cuda()
        for name, (q, sc) in (("gate", gate), ("up", up), ("down", down)):
            if q.ndim != 5 or q.dtype != np.uint32 or sc.ndim != 6 or sc.dtype != np.uint16:
                raise ValueError(f"{name}: want stacked repack_int4_experts output (uint32 [E, N/16, K/64, 32, 4], "
                                 f"uint16 [E, N/16, K/512, 16, 8, 2]), got {q.dtype} {q.shape}, {sc.dtype} {sc.shape}")
        e = gate[0].shape[0]
        inter, hidden = gate[0].shape[1] * 16, gate[0].shape[2] * 64
        if up[0].shape != gate[0].shape or up[1].shape != gate[1].shape:
            raise ValueError(f"up {up[0].shape} does not match gate {gate[0].shape}")
        if down[0].shape[0] != e or down[0].shape[1] * 16 != hidden or down[0].shape[2] * 64 != inter:
            raise ValueError(f"down {down[0].shape} does not match gate {gate[0].shape}: want "
                             f"[E={e}, hidden/16={hidden // 16}, inter/64={inter // 64}, 32, 4]")
        for name, (_, sc) in (("gate", gate), ("up", up), ("down", down)):
            check_scale_range(sc, name)
        d = [cuda.to_device(np.ascontiguousarray(a)) for pair in (gate, up, down) for a in pair]
        return cls(e, hidden, inter, *d)


# The mma.sync and register-A wgmma MoE kernels dequantize with the group scale times 2^130 and read
# (q - 8) * s / 8 as a normal bf16 (int4_dequant.cuh, offset-free form): every scale must be 0 or have
# 2^-123 <= |s| < 2^-2.
# INT4 group scales are max |w| / 7.5 or so: 2^-2 allows weights up to ~1.9 in magnitude.
SCALE_MIN_BITS, SCALE_LIMIT_BITS = 0x0200, 0x3E80   # bf16 bits of 2^-123 and 2^-2 (magnitudes order as bits)


def check_scale_range(scales: np.ndarray, name: str = "scales") -> None:
    """Raise ValueError unless every bf16 scale (uint16 bits) is 0 or has 2^-123 <= |s| < 2^-2 (inf, NaN refused)."""
    mag = np.asarray(scales, np.uint16) & np.uint16(0x7FFF)
    bad = (mag != 0) & ((mag < SCALE_MIN_BITS) | (mag >= SCALE_LIMIT_BITS))
    if bad.any():
        i = int(np.flatnonzero(bad.ravel())[0])
        value = float((np.uint32(mag.ravel()[i]) << 16).view(np.float32))
        raise ValueError(f"{name}: {int(bad.sum())} group scales outside 2^-123 <= |s| < 2^-2 (first: index {i}, "
                         f"|s| = {value!r}); the INT4 MoE kernels' dequantization needs that range")


# Variant per token bucket (T <= key): (gate_up entry, down entry), template arguments MODE, RB, WN, KS, NTMAX,
# STAGES[, XS, RG] (variant_params). Each is the fastest whole-layer choice measured on the H200 with
# tools/bench_moe.py, under uniform and skewed routing (docs/PERF.md, sessions 2026-12-03 (4) to 2026-12-04 (13)):
# - gate_up, T = 1 and 3..5: the two-buffer register ring, 8-token chunks; T = 2: the same with the activations
#   staged in shared memory (XS; session (14): layer -12 / -16% skewed / uniform against the one-buffer ring chosen
#   in session (5), which lost ground with the one-shift dequantization: gate_up alone 72.3 vs 93.2 us); at T = 2
#   the tile sized to the T rows (FIT: 4 blocks per SM, one wave; H100, 2026-12-06 (34), layer: uniform / skewed
#   139.8 / 123.1 us against 141.9 / 125.8; it loses at T = 4: 277.8 / 185.0 against 274.4 / 173.4).
# - gate_up, T = 6..8: the 16-token cp.async ring (since its ring keeps two steps in flight it wins there: skewed
#   T = 6 -11%, uniform T = 7 -4%; at 3..5 it is ~1% slower).
# - gate_up, T = 9..24: the 32-token ring with 4 warps (the T > 128 one: one weight pass for an expert of 17-32
#   tokens; H100, 2026-12-07 (38), layer graph replay against the 16-token ring, us: skewed T = 12 / 16 / 17 / 20 / 24
#   233.1 / 306.8 / 337.2 / 345.6 / 370.1 against 232.4 / 308.7 / 345.6 / 364.0 / 387.3, uniform 709.5 / 872.3 /
#   956.2 / 1085.7 / 1238.7 against 719.7 / 883.4 / 964.8 / 1099.4 / 1250.0; at T = 31, where the hot tier takes
#   the experts of >= 16 tokens, it lost skewed 420.0 / 415.5 and tied uniform 1573.4 / 1573.5). Again in another
#   call, against it (us): skewed T = 9 / 12 / 20 / 24 228.8 / 233.3 / 345.9 / 367.1 against 227.5 / 231.8 / 363.8 /
#   390.9, uniform 525.1 / 710.4 / 1088.3 / 1240.2 against 531.1 / 719.6 / 1101.5 / 1250.5. (Its faster gate_up exposed
#   a race of the combine with the shared MLP in graph replay, fixed in moe_combine_kernel.)
# - gate_up, T = 25..48: still the 16-token ring (session (13): skewed T = 32 / 48 -5 / -2%, uniform within 1%);
#   T = 49..128: the 8-token cp.async ring (the 16-token one loses 2-4% at uniform T = 64..96 and wins 3-5% at
#   skewed, whose cold experts it sees); T > 128: the 32-token ring (skewed routing leaves experts of up to 63
#   tokens on mma.sync there). Where hidden splits into 7 pieces (Kimi's 7168), GATE_UP_PIECES replaces these at
#   T = 3..8 and 25..511 (since session 40's hot tiers leave mma.sync experts of <= 15 tokens from T = 25).
# - down, T = 1: activations staged in shared memory (XS) with three register buffers (loses at T = 2..8); T =
#   2..8: XS, two buffers; T = 9..31: XS, 16-token chunks (session (14), whole layer: skewed T = 16 / 24 -2 / -8%,
#   uniform within 1%; from T = 32, where the hot experts leave mma.sync, it lost 3-4% at skewed T = 32..48);
#   T = 32..128: XS, four row groups per warp; T = 129..768: XS, 16-token chunks; T > 768:
#   the 32-token cp.async ring (uniform T = 1024 -9%, skewed +1%; it loses at T = 512, so the 768 bound lies
#   between the measured sizes) until session 40, whose hot tiers leave mma.sync experts of <= 8 tokens there: XS,
#   four row groups per warp (H100, 2026-12-07 (40), layer graph replay against the ring, us: skewed T = 769 / 896 /
#   1024 2022.3 / 2304.4 / 2426.8 against 2041.6 / 2339.7 / 2450.6, uniform 3531.6 / 3564.5 / 3614.7 against 3523.1 /
#   3572.5 / 3643.2; at T = 1024 in two more calls skewed -1.0 / -1.1%, uniform -1.7 / -1.2%; at T = 512 / 767 it
#   was mixed, uniform 767 +0.7 / +1.4%).
DEFAULT_VARIANTS = {
    1: ("moe_w4a16_kernel<0, 2, 4, 1, 1, 1>", "moe_w4a16_kernel<1, 2, 4, 1, 1, -3, 1>"),
    2: ("moe_w4a16_kernel<0, 2, 4, 1, 1, 1, 1, 1, 1>", "moe_w4a16_kernel<1, 2, 4, 1, 1, 1, 1>"),
    5: ("moe_w4a16_kernel<0, 2, 4, 1, 1, 1>", "moe_w4a16_kernel<1, 2, 4, 1, 1, 1, 1>"),
    8: ("moe_w4a16_kernel<0, 2, 2, 1, 2, 3>", "moe_w4a16_kernel<1, 2, 4, 1, 1, 1, 1>"),
    24: ("moe_w4a16_kernel<0, 2, 4, 1, 4, 3>", "moe_w4a16_kernel<1, 2, 4, 1, 2, 1, 1>"),
    31: ("moe_w4a16_kernel<0, 2, 2, 1, 2, 3>", "moe_w4a16_kernel<1, 2, 4, 1, 2, 1, 1>"),
    48: ("moe_w4a16_kernel<0, 2, 2, 1, 2, 3>", "moe_w4a16_kernel<1, 2, 4, 1, 1, 1, 1, 4>"),
    128: ("moe_w4a16_kernel<0, 2, 2, 1, 1, 3>", "moe_w4a16_kernel<1, 2, 4, 1, 1, 1, 1, 4>"),
    768: ("moe_w4a16_kernel<0, 2, 4, 1, 4, 3>", "moe_w4a16_kernel<1, 2, 4, 1, 2, 1, 1>"),
    1 << 30: ("moe_w4a16_kernel<0, 2, 4, 1, 4, 3>", "moe_w4a16_kernel<1, 2, 4, 1, 1, 1, 1, 4>"),
}


def variant_params(entry: str) -> tuple[int, ...]:
    """"moe_w4a16_kernel<0, 2, 4, 1, 1, 3>" -> (MODE, RB, WN, KS, NTMAX, STAGES, XS, RG, FIT); the template's
    defaults XS = 0, RG = 1, FIT = 0 where the name leaves them out."""
    params = tuple(int(v) for v in entry[entry.index("<") + 1:entry.index(">")].split(","))
    return params + (0, 1, 0)[len(params) - 6:]


def moe_smem_bytes(entry: str, k: int, tokens: int) -> int:
    """Dynamic shared memory of a variant at reduction width k for a layer of `tokens` tokens: each warp's cp.async
    ring (STAGES x 5 RB x 32 lanes x 16 B; none for the register pipelines, STAGES 0, 1 and -D), or with XS the
    activation tile of one token chunk: 8 NTMAX rows (FIT: min(8, tokens)) of k bf16 (XS 1), or of two K pieces of
    k / XS (XS > 1: one read, the next copied)."""
    _, rb, wn, ks, ntmax, stages, xs, _, fit = variant_params(entry)
    if xs:
        row_width = k if xs == 1 else 2 * (k // xs)
        return (min(8, tokens) if fit else 8 * ntmax) * row_width * 2
    return wn * ks * stages * (4 * rb + rb) * 32 * 16 if stages > 1 else 0


# MoeLayer's routing (top-k, then the grouping by expert), each giving the same bits:
#   "blocks": moe_route_blocks_kernel, a block per token (a thread per expert, every rank at once), the last block
#     groups (one token: straight from the picks);
#   "batch": moe_route_batch_kernel, up to ROUTE_BATCH_TOKENS tokens (and tokens x topk <= 32) in one such block,
#     which also groups the picks (warp 0): no ticket, no group_block;
#   "warp-one": moe_route_one_kernel, T = 1 only, one warp picking the topk experts one after another;
#   "fused": moe_route_kernel, a warp per token (route_token), the last block groups;
#   "two": moe_topk_kernel (a warp per token) then moe_group_kernel.
# Default (default_routing): "blocks" at T = 1, "batch" for 2..ROUTE_BATCH_TOKENS tokens (where T x topk <= 32),
# "blocks" up to ROUTE_BLOCKS_MAX_TOKENS tokens (the largest T measured), else "two".
# H100, 2026-12-06 (33), layer graph replay, uniform / skewed: T = 1 blocks 72.7 / 74.5 us against warp-one
# 75.1 / 77.0 and two 77.0 / 79.2 (the routing kernel 2.3 us against 5.1, traced); T = 2..64 blocks faster than
# two by 1.3-3.7 us and than fused by 1.1-22.9 us at every T. (34): batch against blocks, T = 1 75.1 / 75.2 against
# 74.2 / 74.5, T = 2 140.6 / 124.5 against 141.9 / 125.8, T = 4 274.1 / 173.9 against 274.4 / 173.4.
ROUTINGS = ("blocks", "batch", "warp-one", "fused", "two")
ROUTE_BLOCKS_MAX_TOKENS = 64
ROUTE_BATCH_TOKENS = 4   # moe_routing.cu kRouteBatchTokens


def default_routing(T: int, topk: int = KIMI_TOPK) -> str:
    """MoeLayer's routing where left None."""
    if 2 <= T <= ROUTE_BATCH_TOKENS and T * topk <= 32:
        return "batch"
    return "blocks" if T <= ROUTE_BLOCKS_MAX_TOKENS else "two"


# The combine is folded into the down GEMM (last block per column tile sums the tokens' expert outputs) up
# to this many tokens; above it the separate moe_combine_kernel runs (more parallel for large T). 0: never.
# The defaults of MoeLayer are the plan measured fastest (docs/PERF.md: separate combine since run 6 on the H200;
# PDL with the early down start at T <= 8 since session 27 on the H100); the others stay selectable for A/B timing.
FUSE_COMBINE_MAX_TOKENS = 0
# Programmatic dependent launch between the layer's kernels up to PDL_MAX_TOKENS tokens, and with it the down GEMM's
# early weight start up to EARLY_MAX_TOKENS (below GMMA_AUTO_TOKENS: the hot path does not take it). 0: never.
# Measured on the H100 (docs/PERF.md, session 2026-12-05 (27), whole layer, same-run graph replay): PDL + early
# start vs plain launches: uniform T = 1 / 2 / 4 / 8 84.2 -> 80.2, 153.1 -> 149.2, 292.1 -> 286.8, 512.9 -> 513.4 us;
# skewed 84.5 -> 79.6 ... 226.0 -> 222.9 us. From T = 16 PDL alone loses 0-27 us and early start up to 2x (skewed).
# Above T = 8 they pay only with the block-level hand-offs (signals, below), so the three bounds move together.
# H100, 2026-12-06 (36), layer graph replay, plain launches (the old default) / PDL + early / PDL + early + signals, us:
# uniform T = 12 701.6 / 703.5 / 694.1, 16 866.8 / 870.4 / 854.8, 24 1219.2 / 1224.0 / 1213.5, 31 1527.2 / 1533.5 /
# 1520.7; skewed T = 12 229.5 / 226.9 / 225.3, 16 304.9 / 303.8 / 301.0, 24 380.1 / 383.0 / 378.8, 31 462.6 / 463.8 /
# 467.6 (session 35: T = 16 893.0 / 883.6 uniform, 312.2 / 309.7 skewed, PDL + early against + signals; session 36's
# call 3, the new default against plain at T = 16 / 24: uniform 882.2 / 1249.8 against 892.7 / 1251.7, skewed 309.4 /
# 388.5 against 312.7 / 388.5). T = 25..31 stays plain: skewed T = 31 loses 5 us.
PDL_MAX_TOKENS = 24
EARLY_MAX_TOKENS = 24
# moe_combine_kernel reads the routing weights and positions before its dependency wait (they were written three
# launches back) up to this many tokens, with PDL. H100, 2026-12-06 (34), layer graph replay, uniform / skewed:
# T = 1 73.8 / 73.7 us against 74.2 / 74.5, T = 2 141.7 / 125.7 against 141.9 / 125.8, T = 4 274.3 / 173.4 against
# 274.4 / 173.4.
COMBINE_EARLY_MAX_TOKENS = 4
# Block-level hand-offs through counters (MoeLayer signals: down waits for its slot's gate_up blocks, the combine for
# down's blocks, not for the whole previous grid) from SIGNALS_MIN_TOKENS to SIGNALS_MAX_TOKENS tokens, where the
# plan allows them. H100, 2026-12-06 (34), layer graph replay, uniform / skewed, us: T = 2 134.2 / 116.7 against
# 137.8 / 121.5, T = 3 196.1 / 158.2 against 203.0 / 167.2, T = 4 266.7 / 166.9 against 273.7 / 173.9, T = 8
# 471.9 / 200.7 against 480.7 / 207.5; T = 1 loses: 75.2 / 75.1 against 73.9 / 74.3 (gate_up ends ~2 us later).
# T = 9..24 with PDL and the early start (PDL_MAX_TOKENS above, 2026-12-06 (36)).
SIGNALS_MIN_TOKENS, SIGNALS_MAX_TOKENS = 2, 24


# With shared_mlp, the shared MLP's side stream is forked after the routing up to this many tokens, else at the
# layer's start. H100, 2026-12-05 (31), Kimi layer + one shared expert (88 MB), graph replay, fork at the start /
# after the routing / every stage on one stream, us: uniform T = 1 117.3 / 113.0 / 118.0, T = 2 169.6 / 174.3 /
# 183.0, T = 4 304.2 / 308.2 / 315.3, T = 8 513.8 / 528.6 / 530.4, T = 16 905.4 / 898.6 / 915.8; skewed T = 1 119.7 /
# 115.5 / 121.6, T = 2 156.9 / 161.8 / 170.2, T = 8 241.9 / 248.3 / 255.9. (The routed chain on a stream of the
# highest priority gained nothing: T = 2 171.7, T = 8 518.1 us.) Since the signals and the batch routing the fork after
# the routing wins at T = 2..4 (H100, layer + shared MLP, after the routing / at the start, us): 2026-12-06 (34)
# T = 2 uniform 158.0 / 165.1, skewed 143.7 / 150.7; (35) uniform T = 2 163.7 / 164.6, T = 4 297.7 / 301.2. T = 8 was
# last timed in (31), where the start won. With the signals to T = 24 the fork after the routing wins there too
# (H100, after the routing / at the start, us): (36) T = 8 uniform 497.2 / 499.7, skewed 228.6 / 231.1; (37) uniform
# T = 8 / 16 / 24 509.6 / 513.2, 909.7 / 911.5, 1281.7 / 1283.2, skewed 233.3 / 236.5, 344.0 / 344.8, 422.9 / 425.7.
SHARED_FORK_ROUTE_MAX_TOKENS = 24


def default_shared_fork(T: int) -> str:
    """MoeLayer's shared_fork where left None: "route" up to SHARED_FORK_ROUTE_MAX_TOKENS tokens, else "start"."""
    return "route" if T <= SHARED_FORK_ROUTE_MAX_TOKENS else "start"


# With shared_mlp, the shared MLP's linears on the gemv kernel (linear_bf16_gemv_kernel: SwiGLU fused into down's x
# load, 15 KB of shared memory, 256 threads) up to this many tokens, else on the dense linears' plan (GMMA / narrow
# rows). 0: never. H100, 2026-12-06 (33), layer + shared MLP, traced builds with the stamps off: T = 1 105.2 us
# against 112.8 (the fused SwiGLU + down runs beside gate_up instead of behind the routed down's waiting blocks);
# T = 2 172.8 against 172.8. Untraced (34): T = 1 103.2 against 109.8; T = 2 174.7 against 171.2.
SHARED_GEMV_MAX_TOKENS = 1


def default_shared_kernel(T: int) -> str:
    """MoeLayer's shared_kernel where left None: "gemv" up to SHARED_GEMV_MAX_TOKENS tokens, else "auto"."""
    return "gemv" if T <= SHARED_GEMV_MAX_TOKENS else "auto"


def launch_defaults(T: int, pdl: bool | None, early: bool | None, hot_asked: bool,
                    combine_early: bool | None = None) -> tuple[bool, bool, bool]:
    """MoeLayer's (pdl, early, combine_early) where left None: PDL up to PDL_MAX_TOKENS; the early down start with
    PDL up to EARLY_MAX_TOKENS, but not where a hot-expert tier was asked for by name (the wgmma path takes no early
    start); the combine's early routing reads with PDL up to COMBINE_EARLY_MAX_TOKENS."""
    pdl = T <= PDL_MAX_TOKENS if pdl is None else bool(pdl)
    early = pdl and T <= EARLY_MAX_TOKENS and not hot_asked if early is None else bool(early)
    combine_early = pdl and T <= COMBINE_EARLY_MAX_TOKENS if combine_early is None else bool(combine_early)
    return pdl, early, combine_early


# Hot experts on the wgmma grouped GEMM (moe_int4_sm90.cu) by default from GMMA_AUTO_TOKENS tokens: experts with
# >= min tokens, tile-token passes, pipeline PIPE, tiers of (min, tile, pipe) from GMMA_AUTO by T. Measured on the H200
# (docs/PERF.md, sessions 2026-12-03 (4) to 2026-12-04 (13), whole layer, same-run A/B):
# - T = 32..255: PIPE 8 (register A in slot order, two blocks per SM, weights in a shared cp.async ring) on
#   experts of >= 16 tokens in 64-token passes, the hot chain on its own stream; skewed T = 32 / 64 / 128 12 / 19 /
#   36% faster than without (PIPE 3, session (6)); PIPE 6's hot stages 8-12% faster than PIPE 3's (session (11));
#   PIPE 7's layer 0.5-2% faster than PIPE 6's (session (12)); PIPE 8's hot stages 8-14% and its layer 3-5%
#   faster than PIPE 7's at skewed T = 32..128, then its offset-free dequantization another ~1% (3-5% on plans
#   PIPE 8 carries alone; session (13)). Under uniform routing no expert is hot and the empty launches with the
#   fork / join cost ~2%; below T = 32 that outweighs the gain.
# - T >= 256: PIPE 5 (warp-specialized, wgmma N cut to the token count) on experts of >= 64 tokens in 256-token
#   passes (skewed T = 256: PIPE 4 1127.5 vs PIPE 3 1195.0 us, then PIPE 5 1118.6 vs PIPE 4 1132.3).
# - T >= 768: also experts of 17..63 tokens, on PIPE 8's 32-token tiles (uniform T = 1024 -12.5%, skewed +1%,
#   session (13); the same tier on PIPE 7 lost at skewed T = 256..1024, session (12)); at T = 512 it ties.
# - T = 25..31 (H100, 2026-12-07 (37), layer graph replay, us, mma.sync alone / >= 16 tokens on PIPE 8's 32- / 64-token
#   tiles): skewed T = 25 390.6 / 359.6 / 366.3, 26 408.2 / 375.4, 28 513.2 / 469.9 / 475.7, 31 476.9 / 415.5; uniform
#   (no hot expert: the empty launches) 1316.1 / 1318.6 / 1318.8, 1299.7 / 1303.2, 1399.3 / 1402.7 / 1400.3, 1569.4 /
#   1574.8. Below 25 the signals and the early start (which the hot path does not take) win: skewed T = 17 / 20 / 24
#   347.0 / 365.9 / 386.9 against 370.5 / 369.5 / 393.5. From T = 40 the 64-token tile wins (skewed T = 40 / 48 / 63:
#   527.7 / 488.6 / 592.9 against 530.9 / 504.5 / 615.9).
# - T >= 256 (H100, 2026-12-07 (40), layer graph replay, us; default before = >= 64 tokens on PIPE 5, from T = 768
#   also 17..63 on PIPE 8's 32-token tiles; each change at one T measured against that default in the same run):
#   T = 256..511: also experts of 16..63 tokens on PIPE 8's 64-token tiles, the PIPE 8 grid capped at 32 block rows
#   (gmma_grid_rows): skewed T = 256 / 384 1118.3 / 1379.2 against 1193.5 / 1457.3, uniform 3236.5 / 3402.0 against
#   3237.8 / 3368.4. T >= 512: experts of 33..63 tokens on 64-token tiles and 9..32 on 32-token ones, 64 block rows
#   (to T = 767) or 128: skewed T = 512 / 640 / 767 1550.3 / 1802.9 / 2117.2 against 1608.7 / 1841.8 / 2191.1, uniform
#   3426.6 / 3459.7 / 3506.1 against 3519.5 / 3731.2 / 4039.8; T = 1024 (128 rows) skewed 2473.7 against 2518.0,
#   uniform 3609.0 against 3646.8. The 16..63 tiers lose at uniform T >= 640 (3667.5 / 3841.2 / 3989.6 at 640 / 767 /
#   1024: half-empty 64-token tiles on every expert); the row cap saves the empty blocks of the P // min possible
#   slots under skewed routing but serializes the walk under uniform routing at T >= 640 (hence 64 / 128 there).
#   Below T = 256 these tiers lose (skewed T = 128 / 192: +6 / +5%). Not measured on the H200, where the tensor
#   cores are the same and the memory 1.4x faster (session 13 there: the 17..63 tier +0.6% at skewed T = 256).
GMMA_AUTO_TOKENS = 25
# T bound -> hot tiers (min tokens per expert, tokens per pass, PIPE), most tokens first
# - From T = 256 the experts of >= 64 tokens on PIPE 20 (PIPE 8 at 256-token tiles) instead of the warp-specialized
#   PIPE 5 (H100, 2026-12-07 (42), layer graph replay, us, same run, PIPE 20 / PIPE 5): skewed T = 256 / 384 / 512 /
#   767 / 1024 1131.9 / 1393.3 / 1564.7 / 2091.4 / 2397.9 against 1146.6 / 1396.7 / 1573.4 / 2147.8 / 2447.3 (hot
#   down -8..-11%), uniform T = 1024 (no expert of 64 tokens: the empty launches) 3732.6 against 3704.8. Below 256
#   it loses (skewed T = 128: 865.6 against 794.0 with PIPE 8's 64-token tiles on every expert of >= 16 tokens).
GMMA_AUTO = {31: ((16, 32, 8),), 255: ((16, 64, 8),), 511: ((64, 256, 20), (16, 64, 8)),
             1 << 30: ((64, 256, 20), (33, 64, 8), (9, 32, 8))}
# T bound -> the default plan's gmma_grid_rows (None: one block row per possibly hot slot)
GMMA_AUTO_GRID_ROWS = {255: None, 511: 32, 767: 64, 1 << 30: 128}
# The default plan's cap on the block rows of its 256-token tier (PIPE 20, one block per SM), below the one above:
# at uniform T >= 512 no expert reaches its 64 tokens, and each of the P // 64 rows x column tiles launched is an
# empty block of 223 KB that exits. H100, PERF.md session 43, layer graph replay against no cap of its own: uniform
# T = 512 / 767 / 1024 -0.9 / -2.8 / -2.2% (a second run -0.6 / -2.0 / +0.5%), skewed -0.4..-1.5%; 16 or 8 rows
# were no better (skewed +0.4..+2.1%). Under skewed routing the bench's T = 1024 has 23 such experts; past 32 a block
# row walks two slots.
GMMA_AUTO_WIDE_GRID_ROWS = 32
# T bound -> where the default plan runs its hot chain: (SMs of a green partition for it, or None: every SM; its stream
# at the top priority). With a partition the cold chain keeps every SM (cold_sms "all"), so under uniform routing,
# where next to no expert is hot up to T = 256, it loses little, and under skewed routing the top priority gives the
# hot blocks their partition's SMs as the cold blocks there retire. From T = 512 uniform routing puts most of the work
# in the hot tiers, which a partition would hold to its SMs (+16..+115%); the top priority alone still pays there.
# H100, PERF.md session 46 (call 2), layer graph replay, us, against the hot chain on every SM at the default priority:
# T = 128, 64 SMs: uniform 2896.7 / 2881.5, skewed 751.8 / 772.8 (80 SMs: 2900.8 / 769.3); T = 256, 80 SMs: uniform
# 3172.3 / 3143.9, skewed 986.3 / 1111.4 (64 SMs: 3165.9 / 1071.7); the priority alone at T = 512: uniform 3424.6 /
# 3410.3, skewed 1470.7 / 1526.9, T = 1024: 3709.7 / 3695.6, 2317.1 / 2348.5 (at T = 128: 2928.1 / 799.8, a loss).
# Each bucket takes the plan measured at its bound; below T = 128 none was measured.
GMMA_AUTO_HOT_PLACEMENT = {127: (None, False), 128: (64, True), 256: (80, True), 1 << 30: (None, True)}
GMMA_TILE = 64   # tokens per pass when gmma_min_tokens is given without a tile
# moe_gmma_kernel's PIPE: 0 shallow (weights 1 stage ahead, 2 buffers of W tile + x), 1 deep (8 ahead, 3
# buffers), 2 register A (weights dequantized into wgmma A registers, 4 x-only buffers, one wgmma batch kept in
# flight across the stage barrier), 3 the same at two blocks per SM.
# 4: warp-specialized (moe_gmma_ws_kernel: one warpgroup dequantizes into a shared ring, two issue wgmma on
# half the tile's tokens each; 128/256-token tiles).
# 5: the same with the wgmma N cut to each half's token count (rounded up to 16) instead of the full half.
GMMA_PIPES = {0: "shallow", 1: "deep", 2: "register A", 3: "register A, 2 blocks per SM (64/128-token tiles)",
              4: "warp-specialized (128/256-token tiles)", 5: "warp-specialized, N per token count",
              6: "register A in slot order (no fragment shuffles; x copied into slot order), 2 blocks per SM",
              7: "PIPE 6 with its steady-state stages unchecked, a whole x ring per loop step (32/64/128-token tiles)",
              8: "PIPE 7 with the weights 8 stages ahead in a shared-memory cp.async ring (32/64-token tiles)",
              20: "PIPE 8 at 256-token tiles (one block per SM), x 4 stages ahead in 6 buffers, the wgmma N cut to "
                  "each chunk's tokens (rounded up to 32)"}
# the pipelines of moe_gmma_ws_kernel (the others are moe_gmma_kernel's) -> its template tail (NSTEP)
_WS_TEMPLATE = {4: "0", 5: "16"}
GMMA_WS_PIPES = tuple(_WS_TEMPLATE)
GMMA_SLOT_PIPES = (6, 7, 8, 20)   # register A in slot order: they read the slot-ordered x copy, write h in slot order
GMMA_PIPE = 8
GMMA_OVERLAP = True   # the hot chain on its own stream (gmma_overlap's default where the combine is separate)


def _pipe_takes_tile(pipe: int, tile: int) -> bool:
    """PIPE 3 / 6 / 7 (two blocks per SM) are built for 64/128-token tiles (6 / 7 also 32), PIPE 8 for 32/64, the
    warp-specialized 4/5 for 128/256, PIPE 20 for 256."""
    return not ((pipe in (3, 6, 7) and tile > 128) or (pipe == 8 and tile > 64) or (pipe == 20 and tile != 256)
                or (pipe in GMMA_WS_PIPES and tile < 128) or (tile == 32 and pipe not in GMMA_SLOT_PIPES))


def _check_grid_rows(name: str, rows, other_values: str) -> None:
    """A block-row cap of MoeLayer: None or an int >= 1 (the "auto" default resolved before this)."""
    if rows is not None and (isinstance(rows, str) or int(rows) < 1):
        raise ValueError(f"{name}={rows!r}: want >= 1 block rows (or {other_values})")


def moe_gmma_smem_bytes(tile: int, pipe: int) -> int:
    """moe_gmma_kernel's dynamic shared memory: 1024 (alignment slack) + its stage buffers (W [128][64] bf16 +
    x [tile][64] bf16 each, 2 or 3 of them for PIPE 0 / 1; x only, 4 of them for PIPE 2 / 3, 6 for PIPE 6 (and 7
    at 128-token tiles), 8 for PIPE 7 at 32 / 64, those and PIPE 8's weight ring for PIPE 8, 6 and a 6-stage ring
    for PIPE 20; PIPE 4 / 5 below), or the epilogue's staging where that is larger (PIPE 0 at 256-token tiles)."""
    if pipe in GMMA_WS_PIPES:   # moe_gmma_ws_kernel: 4 W stages, 4 x buffers per consumer half, 8 mbarriers
        return 1024 + 4 * 128 * 128 + 2 * 4 * (tile // 2) * 128 + 2 * 4 * 8
    staging = tile * (4 * 68 + 2 * 72)   # the epilogue's up (float) and h (bf16) tiles, over the stage buffers
    if pipe >= 2:
        buffers = 8 if pipe in (7, 8) and tile <= 64 else 6 if pipe in GMMA_SLOT_PIPES else 4
        ring = 6 if pipe == 20 else 8   # PIPE 8 / 20's weight ring: stages of 16 + 4 bytes per thread
        weight_ring = ring * 256 * (16 + 4) if pipe in (8, 20) else 0
        return 1024 + max(buffers * tile * 128 + weight_ring, staging)
    return 1024 + max((2 + pipe) * (128 * 128 + tile * 128), staging)
ROUTE_TOKENS_PER_BLOCK = 64   # moe_route_kernel: 32 warps x ROUTE_TOKENS_PER_WARP (2) tokens


def _without_pdl(launch):
    """Rebind a prepared launch as a plain launch (A/B timing of programmatic dependent launch)."""
    k = launch.kernel
    saved = getattr(k, "pdl", False)
    try:
        k.pdl = False
        launch._bind()
    finally:
        k.pdl = saved
    return launch


def gmma_auto_tiers(tokens: int) -> tuple[tuple[int, int, int], ...]:
    """GMMA_AUTO's hot tiers (min tokens, tile, pipeline) for a T bucket, most tokens first."""
    from .cuda.graph import bucket_for
    return GMMA_AUTO[bucket_for(tokens, GMMA_AUTO)]


def gmma_auto_hot_placement(tokens: int) -> tuple[int | None, bool]:
    """GMMA_AUTO_HOT_PLACEMENT for a T bucket: (the hot chain's SMs or None, its stream at the top priority)."""
    from .cuda.graph import bucket_for
    return GMMA_AUTO_HOT_PLACEMENT[bucket_for(tokens, GMMA_AUTO_HOT_PLACEMENT)]


def gmma_auto_grid_rows(tokens: int) -> int | None:
    """GMMA_AUTO_GRID_ROWS for a T bucket: the block-row cap of the default plan's moe_gmma_kernel tiers."""
    from .cuda.graph import bucket_for
    return GMMA_AUTO_GRID_ROWS[bucket_for(tokens, GMMA_AUTO_GRID_ROWS)]


# Preferred over DEFAULT_VARIANTS' gate_up where hidden splits into its activation pieces (T bounds as there): the
# activations staged in 7 pieces of 1024 at Kimi's 7168. Whole layer, 2026-12-05 (31): H200, two calls, uniform T = 4
# 219.0 -> 211.7 and 220.3 -> 213.7 us, T = 8 380.4 -> 365.6 and 382.5 -> 370.8; skewed T = 4 149.9 -> 150.5, T = 8
# 182.6 -> 167.1; but T = 2 +2.5..5.9% and T = 16 +0.9..9%. H100: T = 3..5 even (within 0.3%); T = 6 / 7 / 8
# uniform -4.5 / +1.3 / -2.8%, skewed +3.0 / -5.6 / -2.6%.
# T = 25..511: the same 7 pieces with 16-token chunks, where the hot tiers (GMMA_AUTO) leave the mma.sync chain experts
# of <= 15 tokens. H100, 2026-12-07 (40), layer graph replay against the table's <0, 2, 2, 1, 2, 3> (T <= 48) /
# <0, 2, 2, 1, 1, 3> (T <= 128) / <0, 2, 4, 1, 4, 3>, us: skewed T = 64 / 128 / 192 / 255 / 256 / 384 / 511 603.3 /
# 772.8 / 981.5 / 1104.8 / 1118.1 / 1376.4 / 1643.1 against 637.4 / 794.9 / 985.5 / 1112.2 / 1128.4 / 1379.8 / 1648.0,
# uniform 2279.6 / 2869.2 / 3076.1 / 3141.1 / 3150.2 / 3239.2 / 3347.4 against 2290.1 / 2882.5 / 3147.7 / 3248.7 /
# 3244.2 / 3403.9 / 3494.8; T = 25 / 28 / 32 / 40 / 48 skewed 346.0 / 453.0 / 412.6 / 515.5 / 473.4 against 350.8 /
# 458.5 / 421.2 / 515.2 / 478.3, uniform 1280.2 / 1359.1 / 1545.7 / 1736.3 / 2031.7 against 1283.2 / 1357.8 / 1549.3 /
# 1741.2 / 2042.5. Not below 25 (signals, no hot tier): skewed T = 12 / 16 / 20 / 24 -2.1 / -0.5 / +1.3 / +1.8%. From
# T = 512 (cold experts of <= 8 tokens) within 1% either way.
GATE_UP_PIECES = {8: "moe_w4a16_kernel<0, 2, 4, 1, 1, 1, 7>", 24: None, 511: "moe_w4a16_kernel<0, 2, 4, 1, 2, 1, 7>"}
GATE_UP_PIECES_MIN_TOKENS = 3


def variant_fits(entry: str, k: int) -> bool:
    """Whether a variant's K-side constraints hold at reduction width k (K % 512; XS pieces of whole 4-unit
    steps), as MoeLayer checks them."""
    xs = variant_params(entry)[6]
    return k % 512 == 0 and (not xs or k % (256 * xs) == 0)


def default_variants(tokens: int, hidden: int | None = None) -> tuple[str, str]:
    """(gate_up, down) entries for T tokens: DEFAULT_VARIANTS, with GATE_UP_PIECES' gate_up (None: none for that T
    bucket) where hidden (gate_up's K) splits into its pieces (hidden None: DEFAULT_VARIANTS alone)."""
    from .cuda.graph import bucket_for
    gate_up, down = DEFAULT_VARIANTS[bucket_for(tokens, DEFAULT_VARIANTS)]
    if hidden is not None and tokens >= GATE_UP_PIECES_MIN_TOKENS:
        pieces = next((GATE_UP_PIECES[b] for b in sorted(GATE_UP_PIECES) if tokens <= b), None)
        if pieces is not None and variant_fits(pieces, hidden):
            gate_up = pieces
    return gate_up, down


def _dense_kernels():
    from . import dense_kernels
    return dense_kernels


@dataclass
class SharedExpertMlp:
    """The shared expert(s) of a DeepSeek-V3 MoE layer: a bf16 SwiGLU MLP on every token, on device.
    gate_up: bf16 [2 * inter, hidden], the gate_proj rows then the up_proj rows; down: bf16 [hidden, inter].
    (n_shared_experts > 1 is one MLP of n x moe_intermediate_size, as the checkpoints store it.)"""
    gate_up: object
    down: object

    def __post_init__(self):
        gu, dn = self.gate_up, self.down
        if gu.dtype != np.uint16 or dn.dtype != np.uint16 or len(gu.shape) != 2 or len(dn.shape) != 2:
            raise ValueError(f"shared expert weights must be 2-d bf16, got gate_up {gu.dtype} {gu.shape}, down "
                             f"{dn.dtype} {dn.shape}")
        if gu.shape[0] % 2 or dn.shape != (gu.shape[1], gu.shape[0] // 2) or gu.shape[0] // 2 % 8:
            raise ValueError(f"shared expert weights: want gate_up [2 I, H] and down [H, I] with I % 8 == 0, got "
                             f"gate_up {gu.shape}, down {dn.shape}")

    @property
    def hidden(self) -> int:
        return self.gate_up.shape[1]

    @property
    def inter(self) -> int:
        return self.down.shape[1]

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes

    def fuses(self, T: int) -> bool:
        """Whether silu(gate) * up goes into the down linear's x load at T rows (the dense kernels' rule)."""
        return _dense_kernels().prologue_fuses(T, self.hidden, self.inter, "swiglu")


_SIGNAL_STAGES = frozenset(("route", "gate_up", "down", "combine"))   # MoeLayer(signals=True): run together


class MoeLayer:
    """The routed MoE of one layer for a fixed token count T (a graph bucket): buffers allocated once,
    launches packed once. `forward(stream)` runs routing -> gate_up -> down (-> combine) on the device.

    Inputs (fill before forward): .x bf16 [T, hidden], .logits fp32 [T, E] (router logits), optional
    shared-expert output bf16 [T, hidden] passed at construction (`shared`), or the shared expert's weights
    (`shared_mlp`, see SharedExpertMlp: the layer then computes that output into .shared itself, on a side stream
    joined before the combine: those weights do not depend on the routing, so their stream runs beside the routing
    and the GEMMs' ramps and tails; shared_fork "start" forks it at the layer's start, "route" after the routing,
    None as default_shared_fork says; shared_kernel "gemv" (T <= 8) runs its linears on the gemv kernel, "auto" on
    the dense linears' plan, None as default_shared_kernel says; shared_plain_start: the branch's first kernel
    launched without PDL, so it starts only when the work before the fork has finished and prefetches nothing beside
    it; default: with shared_fork "route", where its weight prefetch slowed the routing 2.3 -> 5.4 us (H100, session
    33's trace); the layer + shared MLP at T = 1, H100, 2026-12-06 (34): 101.0 us against 103.2). Output: .y bf16
    [T, hidden] = the routing weights times each expert's output rounded to bf16 (as a bf16 expert MLP returns it;
    .down_out holds them, bf16 [T * topk, hidden] in sorted order), summed in fp32 in pick order, plus the shared
    output.

    Launch plan (defaults = fastest measured; the switches exist for A/B timing and tests, all give the same
    bits): routing: one of ROUTINGS (see there; default default_routing(T, topk)); fuse_combine (default
    T <= FUSE_COMBINE_MAX_TOKENS): the combine in the down GEMM's last block per column tile instead of
    moe_combine_kernel; early (default: with PDL, T <= EARLY_MAX_TOKENS and no hot tier asked for): the down
    GEMM starts its weight stream before its dependency wait; combine_early (default: with PDL,
    T <= COMBINE_EARLY_MAX_TOKENS): moe_combine_kernel reads the routing weights and positions before its
    dependency wait; pdl (default T <= PDL_MAX_TOKENS): programmatic dependent launch between the layer's kernels
    (each one's launch and ramp under the previous one's tail), else plain launches;
    gmma_min_tokens (sm_90a): experts with at least that many tokens go through moe_gmma_kernel (weights
    dequantized once per stage into shared memory, wgmma over up to gmma_tile = 32 (PIPE 6-8) / 64 / 128 / 256
    tokens per pass), the rest through moe_w4a16_kernel (moe_slot_split_kernel hands it their counts, 0 for the
    hot ones);
    gmma_parallel_chunks: each gmma_tile-token chunk of a hot expert on its own blocks (else one block row
    per slot runs its chunks in turn); gmma_pipe: moe_gmma_kernel's pipeline (GMMA_PIPES: 0 shallow, 1 deep,
    2 register A, 3 the same with two blocks per SM, 4 warp-specialized, 5 the same with N per token count,
    6 register A in slot order: PIPE 3 without the fragment shuffles, on a slot-ordered copy of x, stage x_hot,
    7 PIPE 6 without bound checks in its steady state, 8 PIPE 7 with its weights in a shared-memory ring),
    default GMMA_PIPE; gmma_overlap (default GMMA_OVERLAP unless the combine is folded into down): the hot
    chain (gate_up_hot -> down_hot) on a second stream, forked after the routing and joined before the
    combine, so the compute-bound wgmma kernels run beside the memory-bound mma.sync ones (both are captured
    as parallel graph branches).
    Default "auto": GMMA_AUTO's tiers of (min tokens, tile, pipeline) by T, from GMMA_AUTO_TOKENS tokens on,
    where the kernel runs; None turns it off. gmma_tiers (instead of gmma_min_tokens / gmma_tile / gmma_pipe):
    several (min tokens, tile, pipeline) tiers, e.g. [(64, 256, 4), (16, 64, 3)]: each slot runs in the tier with
    the largest minimum it reaches, slots below every minimum on mma.sync. gmma_grid_rows: at most that many block
    rows in the hot grids of moe_gmma_kernel (not the warp-specialized one), each walking every
    gmma_grid_rows-th slot and stopping at the first cold one (None: one row per possibly hot slot; default "auto":
    GMMA_AUTO_GRID_ROWS by T with GMMA_AUTO's tiers, else None). gmma_wide_grid_rows: a further cap on the
    256-token tiers of moe_gmma_kernel (one block per SM; default "auto": GMMA_AUTO_WIDE_GRID_ROWS with GMMA_AUTO's
    tiers, else None).
    hot_sms: with gmma_overlap, the hot chain runs on this many SMs only, on the stream of a green context
    (runtime.cuda.green.shared_partition), forked after the routing and joined before the combine; the count is
    rounded up to the driver's partition granularity (.hot_sms tells). cold_sms: where the cold chain (gate_up, down)
    runs then: "all" (default) every SM, on the layer's stream (with no hot work it keeps the whole GPU); "rest" the
    other SMs, on the other green context's stream. None: both chains share every SM.
    hot_priority: the hot chain's stream (gmma_overlap) at the highest stream priority, so that where both chains
    have blocks queued the block scheduler starts the hot ones first (graphs keep it: runtime.cuda.graph).
    Both default to "auto": GMMA_AUTO_HOT_PLACEMENT by T with GMMA_AUTO's tiers and the overlap, else None / False.
    signals: down's blocks wait for their own slot's gate_up blocks, and the combine for down's blocks, through
    counters (moe_int4.cu) instead of for the previous kernel's whole grid; plans with PDL, down's early start, the
    block routings and an XS down variant (default: on there from SIGNALS_MIN_TOKENS to SIGNALS_MAX_TOKENS tokens).
    Its down and combine stages do not run alone."""

    def __init__(self, weights: MoeWeights, tokens: int, bias: np.ndarray, topk: int = KIMI_TOPK,
                 n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
                 routed_scaling_factor: float = KIMI_SCALING, shared=None, shared_mlp: SharedExpertMlp | None = None,
                 shared_fork: str | None = None, shared_kernel: str | None = None,
                 shared_plain_start: bool | None = None,
                 variants: tuple[str, str] | None = None,
                 routing: str | None = None, fuse_combine: bool | None = None,
                 early: bool | None = None, combine_early: bool | None = None,
                 pdl: bool | None = None, gmma_min_tokens: int | str | None = "auto", gmma_tile: int | None = None,
                 gmma_parallel_chunks: bool = False, gmma_pipe: int | None = None,
                 gmma_overlap: bool | None = None, gmma_tiers=None, gmma_grid_rows: int | str | None = "auto",
                 gmma_wide_grid_rows: int | str | None = "auto", hot_sms: int | str | None = "auto",
                 cold_sms: str = "all", hot_priority: bool | str = "auto", signals: bool | None = None):
        cuda = _cuda()
        w = self.weights = weights
        T, E = int(tokens), w.num_experts
        pdl, early, combine_early = launch_defaults(
            T, pdl, early, hot_asked=gmma_tiers is not None or gmma_min_tokens not in ("auto", None),
            combine_early=combine_early)
        if (not 1 <= topk <= min(16, E) or E > 512 or T < 1 or n_group < 1
                or (n_group > 1 and (E % n_group or n_group > 32)) or not 1 <= topk_group <= n_group):
            raise ValueError(f"unsupported routing: T={T}, E={E}, topk={topk} (1..min(16, E)), n_group={n_group} "
                             f"(divides E, <= 32), topk_group={topk_group} (1..n_group)")
        if np.asarray(bias).size != E:
            raise ValueError(f"bias has {np.asarray(bias).size} entries, want E = {E}")
        # the cap on the 256-token tier's rows: asked for, or "auto": the default plan's GMMA_AUTO_WIDE_GRID_ROWS
        wide_grid_rows = None if gmma_wide_grid_rows == "auto" else gmma_wide_grid_rows
        _check_grid_rows("gmma_wide_grid_rows", wide_grid_rows,
                         "None: no cap of its own; 'auto': GMMA_AUTO_WIDE_GRID_ROWS with the default tiers")
        auto_placement = (None, False)   # hot_sms / hot_priority "auto": GMMA_AUTO_HOT_PLACEMENT's with GMMA_AUTO
        if gmma_tiers is not None:
            if gmma_min_tokens != "auto" or gmma_tile is not None or gmma_pipe is not None:
                raise ValueError("gmma_tiers replaces gmma_min_tokens / gmma_tile / gmma_pipe: give one or the other")
            tiers = sorted(((int(m), int(tile), int(pipe)) for m, tile, pipe in gmma_tiers), reverse=True)
            if len({m for m, _, _ in tiers}) != len(tiers):
                raise ValueError(f"gmma_tiers={gmma_tiers}: two tiers with the same minimum token count")
        else:
            auto_tiers = None   # GMMA_AUTO's tiers, where they are taken whole (no tile or pipeline asked for)
            if gmma_min_tokens == "auto":
                auto_tiers = gmma_auto_tiers(T)
                auto_min, auto_tile, _ = auto_tiers[0]   # an asked-for tile / pipeline: the first tier's min
                gmma_min_tokens = auto_min if (T >= GMMA_AUTO_TOKENS and not early and w.inter % 64 == 0
                                               and w.hidden % 128 == 0
                                               and _family_runs_here("moe_int4_sm90", cuda.get_device())) else None
                if gmma_tile is not None or gmma_pipe is not None:
                    auto_tiers = None
                    if gmma_tile is None:   # a pipeline asked for: the auto tile where it fits, else 128 (fits all)
                        gmma_tile = auto_tile if _pipe_takes_tile(gmma_pipe, auto_tile) else 128
            gmma_tile = gmma_tile or GMMA_TILE
            # the default pipeline where it takes the tile, else PIPE 7 (up to 128 tokens) or register A at one
            # block per SM (256-token tiles)
            default_pipe = GMMA_PIPE if _pipe_takes_tile(GMMA_PIPE, gmma_tile) else 7 if gmma_tile <= 128 else 2
            if gmma_min_tokens is None:
                tiers = []
            elif auto_tiers is not None:
                tiers = sorted(auto_tiers, reverse=True)
                if gmma_grid_rows == "auto":
                    gmma_grid_rows = gmma_auto_grid_rows(T)
                if gmma_wide_grid_rows == "auto":
                    wide_grid_rows = GMMA_AUTO_WIDE_GRID_ROWS
                auto_placement = gmma_auto_hot_placement(T)
            else:
                tiers = [(gmma_min_tokens, gmma_tile, default_pipe if gmma_pipe is None else int(gmma_pipe))]
        for m, tile, pipe in tiers:
            if tile not in (32, 64, 128, 256) or m < 1 or early or w.inter % 64 or w.hidden % 128:
                raise ValueError(f"gmma_min_tokens={m}, gmma_tile={tile}, early={early}: want tokens >= 1, a tile "
                                 f"of 32/64/128/256, no early down start, inter % 64 == 0 and hidden % 128 == 0 (got "
                                 f"{w.inter}, {w.hidden})")
            if pipe not in GMMA_PIPES or not _pipe_takes_tile(pipe, tile):
                tiles = "; ".join(f"{p}: " + "/".join(str(t) for t in (32, 64, 128, 256) if _pipe_takes_tile(p, t))
                                  for p in sorted(GMMA_PIPES))
                raise ValueError(f"gmma_pipe={pipe} with gmma_tile={tile}: want one of {sorted(GMMA_PIPES)} "
                                 f"with a token tile it is built for ({tiles})")
        if gmma_grid_rows == "auto":   # tiers asked for by name: one block row per possibly hot slot
            gmma_grid_rows = None
        _check_grid_rows("gmma_grid_rows", gmma_grid_rows, "None: one per slot; 'auto': GMMA_AUTO_GRID_ROWS")
        if shared is not None and (shared.dtype != np.uint16 or tuple(shared.shape) != (T, w.hidden)):
            raise ValueError(f"shared expert output must be bf16 [T, hidden] = [{T}, {w.hidden}], got "
                             f"{shared.dtype} {shared.shape}")
        if shared_mlp is not None:
            if shared is not None:
                raise ValueError("give the shared expert's output (shared) or its weights (shared_mlp), not both")
            if shared_mlp.hidden != w.hidden:
                raise ValueError(f"shared_mlp has hidden size {shared_mlp.hidden}, the routed experts {w.hidden}")
            if shared_fork is None:
                shared_fork = default_shared_fork(T)
            if shared_fork not in ("start", "route"):
                raise ValueError(f"shared_fork={shared_fork!r}: 'start' or 'route'")
            if shared_kernel is None:
                shared_kernel = default_shared_kernel(T)
            if shared_kernel not in ("auto", "gemv") or (shared_kernel == "gemv" and T > 8):
                raise ValueError(f"shared_kernel={shared_kernel!r} at T = {T}: 'auto', or 'gemv' up to 8 tokens")
            if shared_plain_start is None:
                shared_plain_start = shared_fork == "route"
            shared = cuda.empty((T, w.hidden), np.uint16)
        self.T, self.E, self.topk = T, E, topk
        P = T * topk
        self.num_slots = min(E, P)
        self.bias = cuda.to_device(np.asarray(bias, np.float32).reshape(E))
        self.x = cuda.empty((T, w.hidden), np.uint16)
        self.logits = cuda.empty((T, E), np.float32)
        self.topk_ids = cuda.empty((T, topk), np.int32)
        self.topk_w = cuda.empty((T, topk), np.float32)
        self.expert_count = cuda.empty((E,), np.int32)
        self.slot_expert = cuda.empty((self.num_slots,), np.int32)
        self.slot_offset = cuda.empty((self.num_slots,), np.int32)
        self.slot_count = cuda.empty((self.num_slots,), np.int32)
        self.sorted_token = cuda.empty((P,), np.int32)
        self.assign_pos = cuda.empty((T, topk), np.int32)
        self.h = cuda.empty((P, w.inter), np.uint16)
        self.down_out = cuda.empty((P, w.hidden), np.uint16)   # bf16: each expert's output, rounded once
        self.y = cuda.empty((T, w.hidden), np.uint16)
        self.shared = shared
        self.shared_mlp = shared_mlp
        self._shared_gu = cuda.empty((T, 2 * shared_mlp.inter), np.uint16) if shared_mlp is not None else None
        # shared_kernel "gemv": the shared linears on the gemv kernel (SwiGLU fused into down; small shared memory,
        # so its blocks can sit beside the routed GEMMs' instead of holding whole SMs), else the dense linears' plan
        self.shared_kernel = shared_kernel
        self.shared_plain_start = bool(shared_plain_start)
        self._shared_h = (cuda.empty((T, shared_mlp.inter), np.uint16)
                          if shared_mlp is not None and shared_kernel == "auto" and not shared_mlp.fuses(T) else None)
        # the shared branch's own split-K workspace: its linears may run beside other streams' dense linears
        self._shared_ws = _dense_kernels().Workspace() if shared_mlp is not None else None
        self.route_ticket = cuda.empty((1,), np.int32).fill_bytes(0)
        self.x_slot = None   # the slot-ordered copy of x (made below where a hot tier runs PIPE 6-8)
        self.routing = default_routing(T, topk) if routing is None else routing
        if (self.routing not in ROUTINGS or (self.routing == "warp-one" and T != 1)
                or (self.routing == "batch" and (T > ROUTE_BATCH_TOKENS or T * topk > 32))):
            raise ValueError(f"routing={self.routing!r} at T = {T}, topk = {topk}: one of {ROUTINGS} ('warp-one' "
                             f"routes one token, 'batch' up to {ROUTE_BATCH_TOKENS} and 32 picks)")
        self.fuse_combine = T <= FUSE_COMBINE_MAX_TOKENS if fuse_combine is None else bool(fuse_combine)
        self.early = bool(early)
        self.combine_early = bool(combine_early)
        # signals: block-level hand-offs gate_up -> down -> combine through counters (moe_int4.cu), zeroed by the
        # routing kernel; one per slot (gate_up's arrivals) and one for down's
        gu_entry, dn_entry = variants or default_variants(T, w.hidden)
        signals_fit = (pdl and self.early and self.routing in ("blocks", "batch") and not self.fuse_combine
                       and not tiers and variant_params(dn_entry)[6] > 0)
        if signals is None:
            signals = SIGNALS_MIN_TOKENS <= T <= SIGNALS_MAX_TOKENS and signals_fit
        elif signals and not signals_fit:
            raise ValueError("signals: needs PDL with down's early start, routing 'blocks' or 'batch', the separate "
                             "combine, no hot tiers and a down variant with staged activations (XS)")
        self.signals = bool(signals)
        # [num_slots] gate_up's arrivals per slot, then down's arrivals; the routing kernel zeroes them
        self.signal_counts = cuda.empty((self.num_slots + 1,), np.int32).fill_bytes(0) if signals else None
        route_signals = [self.signal_counts if signals else np.uint64(0), I32(self.num_slots + 1)]

        group_smem = (P + 4 * E + 1 + 2 * E * (((T + 31) // 32) | 1)) * 4   # moe_routing.cu group_block's layout
        route_args = [self.logits, self.bias, I32(T), I32(E), I32(topk), I32(n_group), I32(topk_group),
                      I32(int(norm_topk_prob)), F32(routed_scaling_factor)]
        group_outs = [self.expert_count, self.slot_expert, self.slot_offset, self.slot_count, self.sorted_token,
                      self.assign_pos]
        if self.routing == "warp-one":
            route_launches = [cuda.get_kernel("moe_routing", "moe_route_one_kernel").prepare((1,), (32,), [
                self.logits, self.bias, I32(E), I32(topk), I32(n_group), I32(topk_group), I32(int(norm_topk_prob)),
                F32(routed_scaling_factor), self.topk_ids, self.topk_w, *group_outs])]
        elif self.routing == "blocks":
            route_k = cuda.get_kernel("moe_routing", "moe_route_blocks_kernel")
            smem = group_smem if T > 1 else 0
            if smem:   # beside the kernel's ~8 KB of static shared memory
                route_k.set_max_dynamic_smem(smem)
            route_launches = [route_k.prepare((T,), (32 * -(-E // 32),), [
                *route_args, I32(self.num_slots), self.topk_ids, self.topk_w, *group_outs, self.route_ticket,
                *route_signals], smem=smem)]
        elif self.routing == "batch":
            route_launches = [cuda.get_kernel("moe_routing", "moe_route_batch_kernel").prepare(
                (1,), (32 * -(-E // 32),), [*route_args, I32(self.num_slots), self.topk_ids, self.topk_w, *group_outs,
                                            *route_signals])]
        elif self.routing == "fused":
            route_k = cuda.get_kernel("moe_routing", "moe_route_kernel")
            if group_smem > 48 * 1024:
                route_k.set_max_dynamic_smem(group_smem)
            route_launches = [route_k.prepare(((T + ROUTE_TOKENS_PER_BLOCK - 1) // ROUTE_TOKENS_PER_BLOCK,), (1024,), [
                *route_args, I32(self.num_slots), self.topk_ids, self.topk_w, *group_outs, self.route_ticket],
                smem=group_smem)]
        else:
            topk_k = cuda.get_kernel("moe_routing", "moe_topk_kernel")
            group_k = cuda.get_kernel("moe_routing", "moe_group_kernel")
            if group_smem > 48 * 1024:
                group_k.set_max_dynamic_smem(group_smem)
            route_launches = [
                topk_k.prepare(((T + 3) // 4,), (128,), [*route_args, self.topk_ids, self.topk_w]),
                group_k.prepare((1,), (1024,), [self.topk_ids, I32(T), I32(topk), I32(E), I32(self.num_slots),
                                                *group_outs], smem=group_smem)]
        self.variants = (gu_entry, dn_entry)
        self.stages = [("route", launch) for launch in route_launches]
        # hot tiers, most tokens first: tier i takes the slots with min_i <= count < min_{i - 1}
        self.gmma_tiers = tiers
        self.gmma_min_tokens = tiers[-1][0] if tiers else None
        self.gmma_grid_rows = gmma_grid_rows
        self.gmma_wide_grid_rows = wide_grid_rows
        counts = self.slot_count   # what the mma.sync kernels see
        hot_launches = []          # (tier args) per tier
        if tiers:
            if not _family_runs_here("moe_int4_sm90", cuda.get_device()):
                raise ValueError(f"gmma_min_tokens: the wgmma MoE kernel is built for "
                                 f"{_family_archs('moe_int4_sm90')}; this device is sm_{cuda.get_device().arch}")
            counts = self.cold_count = cuda.empty((self.num_slots,), np.int32)
            self.stages.append(("route", cuda.get_kernel("moe_int4_sm90", "moe_slot_split_kernel").prepare(
                ((self.num_slots + 255) // 256,), (256,),
                [self.slot_count, self.cold_count, I32(self.num_slots), I32(self.gmma_min_tokens)])))
            for i, (m, tile, pipe) in enumerate(tiers):
                top = tiers[i - 1][0] if i else 1 << 30
                # slots are ordered by count, most first: at most P // m of them can have m tokens
                hot = max(1, min(self.num_slots, P // m))
                items = None
                if gmma_parallel_chunks:
                    # (slot, chunk) items: slot s (sorted, most first) has at most min(T, P // (s + 1), top - 1)
                    items = [(j, c) for j in range(hot) for c in range(-(-min(T, P // (j + 1), top - 1) // tile))]
                    items = (cuda.to_device(np.array([j for j, _ in items], np.int32)),
                             cuda.to_device(np.array([c for _, c in items], np.int32)))
                hot_launches.append((m, top, tile, pipe, hot, items))
            if any(tier[3] in GMMA_SLOT_PIPES for tier in hot_launches):
                # PIPE 6-8 read x in slot order (moe_int4_sm90.cu): a copy made first in the hot chain
                self.x_slot = cuda.empty((T, w.hidden), np.uint16)
                pairs = T * w.hidden // 2
                self.stages.append(("x_hot", cuda.get_kernel("moe_int4_sm90", "moe_x_slot_kernel").prepare(
                    (min((pairs + 255) // 256, 4 * cuda.get_device().sm_count),), (256,),
                    [self.x, self.x_slot, I32(w.hidden // 2), np.int64(pairs)])))
            for tier in hot_launches:
                x_tier = self.x_slot if tier[3] in GMMA_SLOT_PIPES else self.x
                self.stages.append(("gate_up_hot", self._gmma_launch(0, tier, x_tier, w.hidden, w.gate_q, w.gate_s,
                                                                     w.up_q, w.up_s, w.inter, w.hidden, self.h)))
        gate_up = self._gemm_launch(gu_entry, self.x, w.hidden, w.gate_q, w.gate_s, w.up_q, w.up_s, w.inter, w.hidden,
                                    self.h, counts=counts)
        self.stages.append(("gate_up", gate_up))
        for tier in hot_launches:
            self.stages.append(("down_hot", self._gmma_launch(1, tier, self.h, w.inter, w.down_q, w.down_s,
                                                              w.down_q, w.down_s, w.hidden, w.inter, self.down_out)))
        down = self._gemm_launch(dn_entry, self.h, w.inter, w.down_q, w.down_s, w.down_q, w.down_s, w.hidden, w.inter,
                                 self.down_out, early=self.early, combine=self.fuse_combine, counts=counts,
                                 signal_target=gate_up.grid[0])   # gate_up's blocks per slot
        self.stages.append(("down", down))
        if not self.fuse_combine:
            self.stages.append(("combine", cuda.get_kernel("moe_int4", "moe_combine_kernel").prepare(
                (T, (w.hidden // 4 + 255) // 256), (256,), [
                    self.down_out, self.topk_w, self.assign_pos,
                    shared if shared is not None else np.uint64(0), self.y, I32(w.hidden), I32(topk),
                    I32(int(self.combine_early)),
                    self.signal_counts.view(self.num_slots, (1,)) if signals else np.uint64(0),   # down's arrivals
                    I32(down.grid[0] * down.grid[1])])))
        if not pdl:
            for _, launch in self.stages:
                _without_pdl(launch)
        self.launches = [launch for _, launch in self.stages]
        if shared_mlp is not None:   # dense bf16 launches planned at each call: not among the prepared launches
            self.stages.insert(0, ("shared", self._shared_forward))
            self._shared_side = cuda.Stream()
            self._shared_fork, self._shared_join = cuda.Event(timing=False), cuda.Event(timing=False)
        self.shared_fork = shared_fork
        if gmma_overlap is None:
            gmma_overlap = GMMA_OVERLAP and not self.fuse_combine
        if gmma_overlap and self.fuse_combine:
            raise ValueError("gmma_overlap: the combine folded into the cold down GEMM would not wait for the "
                             "hot chain; use the separate combine (fuse_combine=False)")
        self.gmma_overlap = bool(gmma_overlap) and bool(tiers)
        if cold_sms not in ("rest", "all"):
            raise ValueError(f"cold_sms={cold_sms!r}: 'rest' (the SMs hot_sms leaves) or 'all'")
        hot_sms_auto = hot_sms == "auto"
        if hot_sms_auto:
            hot_sms = auto_placement[0] if self.gmma_overlap else None
        if hot_priority == "auto":
            hot_priority = auto_placement[1] and self.gmma_overlap
        if (hot_sms is not None or hot_priority) and not self.gmma_overlap:
            raise ValueError("hot_sms / hot_priority: need the hot chain on its own stream (gmma_overlap) and a hot "
                             "tier")
        self.partition, self.hot_sms, self.cold_sms, self.hot_priority = None, None, cold_sms, bool(hot_priority)
        # the cold chain's own stream: the other green context's with hot_sms and cold_sms "rest", else the layer's
        self._cold = None
        if self.gmma_overlap:   # a side stream and the fork / join events, made once
            self._fork, self._join = cuda.Event(timing=False), cuda.Event(timing=False)
            hot_prio = cuda.priority_range()[1] if hot_priority else 0
            if hot_sms is not None:
                try:
                    self.partition = cuda.shared_partition(int(hot_sms), priorities=(hot_prio, 0))
                except cuda.CudaError as e:   # no green contexts here (driver, MPS, MIG): asked for, an error
                    if not hot_sms_auto:
                        raise
                    warnings.warn(f"MoeLayer: no SM partition for the hot chain here ({e}); it shares every SM "
                                  "(hot_sms=None)", RuntimeWarning, stacklevel=2)
            if self.partition is None:
                self._side = cuda.Stream(priority=hot_prio)
            else:
                self.hot_sms = self.partition.sizes[0]
                self._side = self.partition.streams[0]
                if cold_sms == "rest":
                    self._cold = self.partition.streams[1]
                    self._cold_join = cuda.Event(timing=False)
        cuda.default_stream().synchronize()   # the zeroed tickets are in place before any stream uses them

    def _gmma_launch(self, mode, tier, x, ldx, q0, s0, q1, s1, n_rows, k, out):
        """One moe_gmma_kernel (moe_gmma_ws_kernel with PIPE 4 / 5) launch for a hot tier (min, top, tile, pipe, rows,
        items): its grid rows are the first `rows` slots (or the (slot, chunk) items); slots with min <= count <
        top run."""
        cuda = _cuda()
        min_count, top, tn, pipe, rows, items = tier
        ws = pipe in GMMA_WS_PIPES
        entry = (f"moe_gmma_ws_kernel<{mode}, {tn}, {_WS_TEMPLATE[pipe]}>" if ws else
                 f"moe_gmma_kernel<{mode}, {tn}, {pipe}>")
        kernel = cuda.get_kernel("moe_int4_sm90", entry)
        n_items = rows if items is None else items[0].shape[0]
        # moe_gmma_kernel walks rows y, y + gridDim.y, ..: gmma_grid_rows caps the grid (fewer empty blocks when
        # most of the P // min_tokens possible hot slots are cold), and the default plan's 256-token tier has a
        # cap of its own; the WS kernel takes one row per block
        caps = [] if ws else [c for c in (self.gmma_grid_rows, self.gmma_wide_grid_rows if tn == 256 else None) if c]
        grid_y = min([n_items, *caps])
        smem = moe_gmma_smem_bytes(tn, pipe)
        kernel.set_max_dynamic_smem(smem)
        null = np.uint64(0)
        return kernel.prepare((n_rows // (64 if mode == 0 else 128), grid_y), (384 if ws else 256,), [
            x, I32(ldx), q0, s0, q1, s1, I32(n_rows), I32(k), self.slot_expert, self.slot_offset, self.slot_count,
            self.sorted_token, out, I32(min_count), I32(top), *(() if ws else (I32(n_items),)),
            *(items if items is not None else (null, null))], smem=smem)

    def _gemm_launch(self, entry, x, ldx, q0, s0, q1, s1, n_rows, k, out, early=False, combine=False, counts=None,
                     signal_target=0):
        """One grouped GEMM launch. Down (MODE 1) only: early = start the weights before the PDL wait;
        combine = fold the combine into it (writes .y; needs the layer's topk_w, assign_pos, shared).
        counts: the slot token counts it reads (default the routing's; with the wgmma path, the cold ones).
        With the layer's signals: gate_up arrives per slot, down waits for signal_target arrivals there."""
        cuda = _cuda()
        mode, rb, wn, ks, _, stages, xs, rg, _ = variant_params(entry)
        rbm = rb // 2 if mode == 0 else rb
        block_rows = 16 * rbm * wn * rg
        if n_rows % block_rows or k % 512:
            raise ValueError(f"{entry}: N={n_rows} must be a multiple of {block_rows} and K={k} of 512")
        if mode == 0 and (early or combine):
            raise ValueError(f"{entry}: early start and the folded combine are for the down GEMM only")
        grid = (n_rows // block_rows, self.num_slots)
        if (xs or rg > 1) and (not (stages == 1 or stages < 0) or ks != 1):
            raise ValueError(f"{entry}: staged activations (XS) and row groups (RG) need a register ring (STAGES 1 "
                             f"or -D) and KS 1")
        if xs and k % (256 * xs):
            raise ValueError(f"{entry}: K={k} does not split into {xs} pieces of whole 4-unit steps")
        smem, smem_max = moe_smem_bytes(entry, k, self.T), cuda.get_device().smem_optin_bytes
        if smem > smem_max:
            raise ValueError(f"{entry}: {smem} bytes of shared memory at K={k}, more than the device's {smem_max}")
        kernel = cuda.get_kernel("moe_int4", entry)
        if smem > 48 * 1024:
            kernel.set_max_dynamic_smem(smem)
        null = np.uint64(0)
        if combine:
            tickets = cuda.empty((grid[0],), np.int32).fill_bytes(0)   # self-resetting, one per column tile
            self._combine_tickets = tickets
            tail = [self.topk_w, self.assign_pos, self.shared if self.shared is not None else null, self.y, tickets,
                    I32(self.T), I32(self.topk)]
        else:   # T for FIT's activation rows
            tail = [null, null, null, null, null, I32(self.T), I32(0)]
        signal_args = [self.signal_counts, I32(signal_target)] if self.signals else [null, I32(0)]
        return kernel.prepare(grid, (32 * wn * ks,), [
            x, I32(ldx), q0, s0, q1, s1, I32(n_rows), I32(k), self.slot_expert, self.slot_offset,
            self.slot_count if counts is None else counts, self.sorted_token, out, I32(int(early)), *tail,
            *signal_args], smem=smem)

    def forward(self, stream=None, stages=None):
        """Launch the layer (or only the named stages, in order on `stream`: 'shared', 'route', 'x_hot',
        'gate_up_hot', 'gate_up', 'down_hot', 'down', 'combine'; 'shared' exists with shared_mlp, the _hot ones
        with the wgmma hot-expert path (x_hot with PIPE 6-8), 'combine' unless it is folded into down).
        The whole layer: with shared_mlp, 'shared' on a side stream forked first (shared_fork "start") or after the
        routing ("route") and joined before the stage that reads .shared (the combine, or down where the combine is
        folded into it); with gmma_overlap, the _hot stages on another side stream forked after the routing and joined
        before the combine."""
        if stages is not None:
            if self.signals and {"down", "combine"} & set(stages) and not _SIGNAL_STAGES <= set(stages):
                # down / combine without the stages before them would wait for arrivals that never come
                raise ValueError(f"signals: the down and combine stages run only with all of {sorted(_SIGNAL_STAGES)}")
            for name, launch in self.stages:
                if name in stages:
                    launch(stream)
            return
        cuda = _cuda()

        def fork_shared():
            self._shared_fork.record(stream)
            self._shared_side.wait(self._shared_fork)
            self._shared_forward(self._shared_side)
            self._shared_join.record(self._shared_side)

        shared_pending = self.shared_mlp is not None
        if shared_pending and self.shared_fork == "start":
            fork_shared()
            shared_pending = False
        reads_shared = "down" if self.fuse_combine else "combine"
        hot_forked = False
        for name, launch in self.stages:
            if name == "shared":
                continue
            if name != "route" and shared_pending:   # shared_fork "route": forked once the routing is queued
                fork_shared()
                shared_pending = False
            if self.gmma_overlap and name != "route" and not hot_forked:
                self._fork.record(stream)   # the hot chain after the routing, beside gate_up / down
                self._side.wait(self._fork)
                if self._cold is not None:
                    self._cold.wait(self._fork)
                hot_forked = True
            if self.gmma_overlap and name.endswith("_hot"):
                launch(self._side)
                continue
            if self._cold is not None and name in ("gate_up", "down"):
                launch(self._cold)
                continue
            if name == "combine" and self.gmma_overlap:
                self._join.record(self._side)
                cuda.stream.wait_event(stream, self._join)
                if self._cold is not None:
                    self._cold_join.record(self._cold)
                    cuda.stream.wait_event(stream, self._cold_join)
            if name == reads_shared and self.shared_mlp is not None:
                cuda.stream.wait_event(stream, self._shared_join)
            launch(stream)

    def _shared_forward(self, stream):
        """The shared expert's MLP into .shared: gate_up, then down with silu(gate) * up (fused into down's x load
        where the dense kernels take it, else its own launch)."""
        m, T = self.shared_mlp, self.T
        dk, cuda = _dense_kernels(), _cuda()
        kernel = self.shared_kernel
        with cuda.plain_launches() if self.shared_plain_start else contextlib.nullcontext():
            dk.linear(self.x, m.gate_up, self._shared_gu, ws=self._shared_ws, stream=stream, kernel=kernel)
        gate = self._shared_gu.view(0, (T, m.inter))
        up = self._shared_gu.view(m.inter, (T, m.inter))
        ld = 2 * m.inter
        if self._shared_h is None:
            dk.linear(gate, m.down, self.shared, ldx=ld, ws=self._shared_ws, stream=stream, prologue="swiglu", x2=up,
                      ldx2=ld, kernel=kernel)
        else:
            dk.swiglu(gate, up, self._shared_h, T=T, I=m.inter, ldg=ld, ldu=ld, stream=stream)
            dk.linear(self._shared_h, m.down, self.shared, ws=self._shared_ws, stream=stream)


# ------------------------------------------------------------------------------------------------------
# MLA

MLA_D, MLA_DV = 576, 512
_MLA_BM, _MLA_BN, _MLA_LD = 64, 32, 584
MLA_SMEM = (_MLA_BM * _MLA_LD + 2 * _MLA_BN * _MLA_LD) * 2 + 2 * 4 * 4 * 4 * 32 * 4
# mla_verify_sm90.cu (sm_90a): Q + two 64-position KV tiles, 128-byte swizzled, + 1 KB alignment
MLA_GMMA_BN = 64
MLA_GMMA_SMEM = 1024 + 3 * _MLA_BM * MLA_D * 2
MLA_GMMA_SPLIT_SMEM = MLA_GMMA_SMEM + _MLA_BM * 64 * 2 + 2 * _MLA_BM * 4   # + the P tile, maxima / sums
# kernel name -> (family, entry, dynamic smem, KV positions per tile): "gmma-split" computes S once (split by
# positions over the two warpgroups, P through shared memory), the sm_90a default (MLA_KERNEL below)
_MLA_KERNELS = {"mma": ("mla_verify", "mla_attention_kernel", MLA_SMEM, _MLA_BN),
                "gmma": ("mla_verify_sm90", "mla_attention_gmma_kernel<0>", MLA_GMMA_SMEM, MLA_GMMA_BN),
                "gmma-split": ("mla_verify_sm90", "mla_attention_gmma_kernel<1>", MLA_GMMA_SPLIT_SMEM, MLA_GMMA_BN)}
# Which attention kernel MlaAttention launches unless told: "auto" = "gmma-split" (wgmma, S computed once)
# on sm_90a, else "mma" (mma.sync, every arch); asking for a wgmma kernel elsewhere is an error.
# DDTREE_MLA_KERNEL for A/B timing. H200 (2026-12-03 (3) run 10, same run): gmma 1.29-1.49x faster than mma
# at budgets 16..256, 1.13-1.33x at budget 1 with H = 64. 2026-12-03 (4) run 1: gmma-split 1.09-1.30x faster
# than gmma at every measured size (H = 64, 32k, b256 4854 -> 3769 us; H = 8, 4k, b1 14.2 -> 13.4).
MLA_KERNEL = os.environ.get("DDTREE_MLA_KERNEL", "auto")


# mla_splits' cost model, from H200 sweeps of tools/bench_mla.py --splits (2026-12-03 (3) runs 2-3, mma.sync;
# it also picks within 6% of the best count for gmma-split, 2026-12-03 (5) run 2): a block
# (one per SM: 165 KB of shared memory) costs ~3 us plus ~3.8 us per 32-row KV tile; blocks past one wave run
# as further waves; the merge costs ~3 us plus the fp32 partials written and read back (rows x 512 x 8 bytes
# per split) at ~2.5 TB/s.
MLA_BLOCK_US, MLA_TILE_US, MLA_MERGE_US, MLA_MERGE_BYTES_PER_US = 3.0, 3.8, 3.0, 2.5e6
MLA_MAX_SPLITS = 1024   # mla_combine_kernel's shared weight table


def mla_splits(rows: int, kv_len: int, sm_count: int = 132) -> int:
    """KV splits (blocks along z) for rows (token, head) rows over kv_len cache rows: the fewest whose time
    under the cost model above is within 2% of the fastest."""
    tiles = (rows + _MLA_BM - 1) // _MLA_BM
    kv_tiles = (kv_len + _MLA_BN - 1) // _MLA_BN

    def est_us(s: int) -> float:
        per = -(-kv_tiles // s)
        waves = -(-tiles * s // sm_count)
        merge = 0.0 if s == 1 else MLA_MERGE_US + s * rows * MLA_DV * 8 / MLA_MERGE_BYTES_PER_US
        return waves * (MLA_BLOCK_US + per * MLA_TILE_US) + merge

    counts = range(1, min(kv_tiles, MLA_MAX_SPLITS) + 1)
    best = min(est_us(s) for s in counts)
    return next(s for s in counts if est_us(s) <= 1.02 * best)


def mla_split_plan(splits: int, kv_len: int, tile: int) -> tuple[int, int]:
    """(splits, positions per split) for a wanted split count: each split a whole number of `tile`-position
    KV tiles; rounding the length up can leave the last splits empty, so the count is recomputed."""
    split_len = math.ceil(kv_len / splits / tile) * tile
    return math.ceil(kv_len / split_len), split_len


class MlaAttention:
    """Absorbed MLA attention for Tq queries x H heads over a [prefix_len + Tq, 576] latent cache, with a
    tree mask (uint32 [Tq, W], bit j of row i: node j visible to query i) or causal (mask None: prefill).
    Buffers: .q bf16 [Tq, H, 576] (absorbed latent query + rope query), .out bf16 [Tq, H, 512]. The cache and
    mask are caller buffers. Shapes and prefix_len are fixed at construction (a graph bucket): a new prefix
    length needs a new MlaAttention (the KV split is sized from it). kernel: "auto" (MLA_KERNEL's default:
    "gmma-split" on sm_90a, mma.sync elsewhere), "mma", "gmma" or "gmma-split"; all give the same
    contract."""

    def __init__(self, tq: int, heads: int, kv, prefix_len: int, softmax_scale: float, mask=None,
                 splits: int | None = None, kernel: str | None = None):
        cuda = _cuda()
        self.tq, self.heads = int(tq), int(heads)
        self.kernel = kernel or MLA_KERNEL
        if self.kernel != "auto" and self.kernel not in _MLA_KERNELS:
            raise ValueError(f"kernel={kernel!r}: 'auto', 'mma' (mma.sync), 'gmma' or 'gmma-split' (wgmma, sm_90a)")
        if self.heads < 1 or (64 % self.heads and self.heads % 64):
            raise ValueError(f"heads={heads}: must divide 64 or be a multiple of it")
        rows = self.tq * self.heads
        kv_len = prefix_len + self.tq
        if prefix_len < 0 or self.tq < 1:
            raise ValueError(f"prefix_len = {prefix_len} must be >= 0 and tq = {tq} >= 1")
        if (kv.dtype != np.uint16 or len(kv.shape) < 2 or kv.shape[0] < kv_len
                or math.prod(kv.shape[1:]) != MLA_D):
            raise ValueError(f"kv cache {kv.dtype} {kv.shape}: want bf16 [>= prefix {prefix_len} + {tq} nodes, "
                             f"{MLA_D}] (or [.., 1, {MLA_D}])")
        need_words = (self.tq + 31) // 32
        if mask is not None and (mask.dtype != np.uint32 or len(mask.shape) != 2 or mask.shape[0] < self.tq
                                 or mask.shape[1] < need_words):
            raise ValueError(f"mask {mask.dtype} {mask.shape}: want uint32 [tq, ceil(tq/32)] = "
                             f"[{self.tq}, {need_words}]")
        if splits is not None and not 1 <= splits <= MLA_MAX_SPLITS:
            raise ValueError(f"splits={splits}: 1..{MLA_MAX_SPLITS} (mla_combine_kernel's weight table), or None "
                             "for the planned count")
        dev = cuda.get_device()
        if self.kernel == "auto":
            self.kernel = "gmma-split" if _family_runs_here("mla_verify_sm90", dev) else "mma"
        family, entry, smem, tile = _MLA_KERNELS[self.kernel]
        if not _family_runs_here(family, dev):
            raise ValueError(f"kernel={self.kernel!r} is built for {_family_archs(family)}; this device is "
                             f"sm_{dev.arch}")
        self.splits, split_len = mla_split_plan(splits or mla_splits(rows, kv_len, dev.sm_count), kv_len, tile)
        self.q = cuda.empty((self.tq, self.heads, MLA_D), np.uint16)
        self.out = cuda.empty((self.tq, self.heads, MLA_DV), np.uint16)
        ws_splits = self.splits if self.splits > 1 else 1
        self.part_o = cuda.empty((ws_splits, rows, MLA_DV), np.float32)
        self.part_ml = cuda.empty((ws_splits, rows, 2), np.float32)
        k = cuda.get_kernel(family, entry)
        k.set_max_dynamic_smem(smem)
        words = mask.shape[1] if mask is not None else 0
        self.attn = k.prepare(((rows + _MLA_BM - 1) // _MLA_BM, 1, self.splits), (256,), [
            self.q, kv, mask if mask is not None else np.uint64(0), I32(words), I32(self.tq), I32(self.heads),
            I32(prefix_len), F32(softmax_scale), I32(split_len), self.out, self.part_o, self.part_ml],
            smem=smem)
        self.combine = None
        if self.splits > 1:
            self.combine = cuda.get_kernel("mla_verify", "mla_combine_kernel").prepare(
                (rows, 4), (256,), [self.part_o, self.part_ml, I32(self.splits), I32(rows), self.out])

    def forward(self, stream=None):
        self.attn(stream)
        if self.combine is not None:
            self.combine(stream)


def mla_head_gemm(x, w, y, tokens: int, heads: int, n: int, k: int, ldx: int, ldy: int, w_sh: int, w_sn: int,
                  w_sk: int, stream=None):
    """y[(t*H + h)*ldy + n] = sum_k x[(t*H + h)*ldx + k] * w[h*w_sh + n*w_sn + k*w_sk] (bf16, fp32 sum).
    Absorption: x = q_nope, w = W_UK; output projection: x = attention latent, w = W_UV."""
    cuda = _cuda()
    if n % 8:
        raise ValueError(f"N={n} must be a multiple of 8")
    for a, name in ((x, "x"), (w, "w"), (y, "y")):
        if a.dtype != np.uint16:
            raise ValueError(f"mla_head_gemm: {name} must be bf16 (uint16 bits), got {a.dtype}")
    if min(tokens, heads, n, k) < 1:
        raise ValueError(f"mla_head_gemm: tokens={tokens}, heads={heads}, n={n}, k={k} must be >= 1")
    warps = tokens * heads * (n // 8)
    cuda.get_kernel("mla_verify", "mla_head_gemm_kernel").launch(((warps + 7) // 8,), (256,), [
        x, w, y, I32(tokens), I32(heads), I32(n), I32(k), I32(ldx), I32(ldy), np.int64(w_sh), I32(w_sn),
        I32(w_sk)], stream=stream)
