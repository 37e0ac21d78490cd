"""Every CUDA kernel family the runtime builds: its source file, its entry points and what its SASS must
contain on each arch (a CuTe atom compiled for the wrong arch silently becomes a trap, so tests look for
the instruction). Each kernel owner registers its families in its own section below, with one
`register(KernelFamily(...))` call per family."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ALL_ARCHS = ("90a", "100a", "103a", "120a")


@dataclass(frozen=True)
class KernelFamily:
    name: str
    source: str  # file name in cutlass_kernels/ (an absolute path is accepted, for tests)
    entries: tuple[str, ...]  # NVRTC name expressions, e.g. "int4_to_bf16_kernel<128>", or extern "C" names
    required_sass: dict | None = None  # {arch: regex} that must match the SASS for that arch
    options: tuple[str, ...] = ()  # extra NVRTC options (e.g. "-DTILE=64")
    archs: tuple[str, ...] = ALL_ARCHS  # archs this family is built for
    required_ptx: dict | None = None  # {arch: regex} on the PTX, checked when no SASS tool is available
    # Programmatic dependent launch: every entry calls ddtree::grid_dependency_wait() (device_common.cuh)
    # before reading what an earlier kernel writes and before any write, so it may be launched with the
    # programmatic-stream-serialization attribute (it then overlaps the previous kernel's tail).
    pdl: bool = False

    @property
    def source_path(self) -> Path:
        p = Path(self.source)
        return p if p.is_absolute() else Path(__file__).resolve().parent / p

    def targets(self, arch: str) -> bool:
        return arch in self.archs


FAMILIES: dict[str, KernelFamily] = {}


def register(family: KernelFamily) -> KernelFamily:
    if family.name in FAMILIES:
        raise ValueError(f"kernel family {family.name!r} registered twice")
    if not family.source_path.is_file():
        raise FileNotFoundError(f"kernel family {family.name!r}: no source {family.source_path}")
    FAMILIES[family.name] = family
    return family


# ---------------------------------------------------------------- foundation (runtime/cuda)
# int4 (uint4b8: stored q+8, group 32, bf16 scales) -> bf16 dequant through CUTLASS's array converter:
# one word per thread (coalesced, the one to use) and one group per thread (benchmark variant).
register(KernelFamily(
    name="int4_convert",
    source="int4_convert.cu",
    entries=("int4_to_bf16_kernel<128>", "int4_to_bf16_kernel<256>", "int4_to_bf16_group_kernel<128>"),
))
# Streaming read kernel for the bandwidth benchmark, a trivial kernel for launch/graph overheads, and the MoE
# weight stream's access pattern without its arithmetic (tools/bench_stream_rows.py).
register(KernelFamily(
    name="runtime_probe",
    source="runtime_probe.cu",
    entries=("read_sum_kernel", "read_sum_deep_kernel<8>", "add_scalar_kernel", "noop_kernel") + tuple(
        f"stream_rows_kernel<{depth}, {hint}>" for depth in (1, 2, 3, 4, 6) for hint in (0, 1)),
))
# The streaming read as a link of a programmatic-dependent-launch chain (tools/bench_dense.py).
register(KernelFamily(
    name="runtime_probe_pdl",
    source="runtime_probe.cu",
    entries=("read_sum_pdl_kernel",),
    pdl=True,
))
# The GMMA linear's weight loads without its MMAs, by three load paths (tools/bench_w_tiles.py times exactly these):
# (LOAD, STAGES, PIECE) single launches; LOAD of the PDL-chain links (4 stages of 256-byte pieces). Session 28 ran
# every (LOAD, 4 / 6, 256 / 512 / 1024): larger pieces changed nothing but for the bulk copy per row piece.
W_TILES_CONFIGS = ((0, 4, 256), (0, 6, 256), (1, 4, 256), (1, 4, 1024), (2, 4, 256), (2, 6, 256))
W_TILES_PDL_LOADS = (0, 2)
register(KernelFamily(
    name="runtime_probe_sm90",
    source="runtime_probe_sm90.cu",
    entries=tuple("read_w_tiles_kernel<%d, %d, %d>" % c for c in W_TILES_CONFIGS),
    archs=("90a",),
))
# The same as links of a programmatic-dependent-launch chain.
register(KernelFamily(
    name="runtime_probe_sm90_pdl",
    source="runtime_probe_sm90.cu",
    entries=tuple(f"read_w_tiles_kernel<{load}, 4, 256, 1>" for load in W_TILES_PDL_LOADS),
    archs=("90a",),
    pdl=True,
))
# One MMA atom per arch family, never run: proves the SASS check catches the tensor-core instruction.
register(KernelFamily(
    name="mma_smoke",
    source="mma_smoke.cu",
    entries=("mma_smoke_kernel",),
    required_sass={"90a": r"HGMMA", "100a": r"UTC\w*MMA", "103a": r"UTC\w*MMA", "120a": r"\bQMMA|OMMA"},
    required_ptx={"90a": r"wgmma\.mma_async", "100a": r"tcgen05\.mma", "103a": r"tcgen05\.mma",
                  "120a": r"mma\.sync\.aligned\.\S*kind::f8f6f4"},
))

# ---------------------------------------------------------------- (other kernel families below)

# ---------------------------------------------------------------- dense models (issue 6): linear, norms, attention, sampling
# Both MMA families use the SM80 bf16 atom (mma.sync m16n8k16), which every target arch runs natively.
_MMA_BF16_PTX = {a: r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32" for a in ALL_ARCHS}
_MMA_BF16_SASS = {"90a": r"HMMA\.16816\.F32\.BF16", "120a": r"HMMA\.16816\.F32\.BF16"}


def _linear_reduce_ilp() -> int:
    """Outputs per thread per pass of the split-K reduce in dense_linear.cu (same bits for any value);
    DDTREE_LINEAR_REDUCE_ILP=1 selects the one-at-a-time loop of before, for A/B timing."""
    v = os.environ.get("DDTREE_LINEAR_REDUCE_ILP", "4")
    if v not in ("1", "2", "4"):
        raise ValueError(f"DDTREE_LINEAR_REDUCE_ILP={v!r}: use 1, 2 or 4")
    return int(v)


# linear_bf16_xres_kernel <MT, STAGES, XMODE> (8*MT-row token tile; XMODE 1 / 2 fuse rmsnorm / swiglu into the x
# load): the instances runtime/dense_kernels.py's plans may name.
XRES_INSTANCES = ((1, 4, 0), (2, 4, 0), (4, 4, 0), (8, 4, 0), (1, 2, 0), (8, 2, 0), (1, 2, 1), (1, 2, 2),
                  (2, 4, 1), (2, 4, 2), (4, 4, 1), (4, 4, 2))
# (KW, STAGES, XMODE) of linear_bf16_gemv_kernel (M <= 8, no cross-block split): runtime/dense_kernels.py
# picks among these.
GEMV_SHAPES = ((8, 2), (8, 4), (4, 4), (2, 4))
GEMV_INSTANCES = {(8, 2, 0), (8, 2, 1), (8, 2, 2), (8, 4, 0), (8, 4, 1), (8, 4, 2), (4, 4, 0), (4, 4, 1),
                  (4, 4, 2), (2, 4, 0)}
# bf16 weight-streaming linear: xres <MT, STAGES, XMODE> for M <= 64 (x slice resident in smem, W register
# ring; XMODE 1/2 fuse rmsnorm / swiglu into the x load), the chunked kernel <MT, RT> for any M (blockIdx.z
# walks token tiles of 8*MT rows; RT = 2 halves shared-memory B traffic per W byte at 64 rows; MT = 9 is the
# 72-row tile for M = 65..72, the budget-64 verify, which 64-row tiles would split into a full tile plus a
# one-row tile that re-reads W). These entries are the instantiations: NVRTC instantiates each name
# expression, the .cu file lists none. The dense families below all follow the PDL rule (pdl=True).
register(KernelFamily(
    name="dense_linear",
    source="dense_linear.cu",
    entries=("linear_bf16_kernel<1, 1>", "linear_bf16_kernel<2, 1>", "linear_bf16_kernel<4, 1>",
             "linear_bf16_kernel<8, 1>", "linear_bf16_kernel<9, 1>", "linear_bf16_kernel<8, 2>",
             *(f"linear_bf16_xres_kernel<{mt}, {st}, {xm}>" for mt, st, xm in XRES_INSTANCES),
             *(f"linear_bf16_gemv_kernel<{kw}, {st}, {xm}>" for kw, st in GEMV_SHAPES for xm in (0, 1, 2)
               if (kw, st, xm) in GEMV_INSTANCES)),
    required_ptx=_MMA_BF16_PTX,
    required_sass=_MMA_BF16_SASS,
    options=(f"-DLINEAR_REDUCE_ILP={_linear_reduce_ilp()}",),
    pdl=True,
))
# Hopper GMMA (wgmma) bf16 linear for M >= 9 (verify buckets, prefill), sm_90a only:
# linear_gmma_kernel<TN, KA, STAGES, RW, CS, NWG> (TN tokens per tile = wgmma N, KA 64-k atoms per stage,
# STAGES cp.async + mbarrier stages, 64*NWG*RW W rows per block, CS: K splits reduced in a (1, CS, 1) cluster
# through distributed shared memory, 1: workspace split-K, NWG warpgroups per block: 2 (the name leaves it
# out) or 3); runtime/dense_gmma.py plans over them. Configs are 6-tuples (TN, KA, STAGES, RW, CS, NWG).
# Token tile 136: the verify buckets 128 and 256 (M = 129, 257 = 2 x 129), which the 192 tile padded by 33%
# (H200, session 20: 5-14% faster per linear, verify b128 / b256 -5% / -9%). Tiles 176 and 208 for M = 513
# (3 x 171) and 1025 (5 x 205) measured 3-15% slower than 192 / 256 despite less padding, so none is built.
_GMMA_BASE = ((16, 2, 4, 1), (32, 2, 4, 1), (48, 2, 4, 1), (64, 2, 4, 1), (72, 2, 4, 1), (96, 1, 6, 1),
              (128, 1, 6, 1), (136, 1, 6, 1), (192, 1, 4, 1), (256, 1, 4, 1))
DENSE_GMMA_INSTANCES = tuple((*c, cs, 2) for c in _GMMA_BASE for cs in (1, 2)) + tuple((*c, 2) for c in (
    (16, 2, 4, 1, 3), (32, 2, 4, 1, 3), (64, 2, 4, 1, 3), (72, 2, 4, 1, 3),
    (16, 2, 4, 1, 4), (32, 2, 4, 1, 4), (64, 2, 4, 1, 4), (72, 2, 4, 1, 4), (128, 1, 6, 1, 4), (256, 1, 4, 1, 4),
    (64, 1, 4, 2, 1), (128, 1, 4, 2, 1))) + (
    # three warpgroups, 192 rows, one 64-k atom per stage and 6-8 stages (~200 KB: cuBLAS's nvjet shape for
    # 24576x4096 at M = 1..65 on the H200, one wave of 128 blocks); runtime/dense_gmma.py plans them where
    # unsplit blocks fill one wave
    (16, 1, 8, 1, 1, 3), (32, 1, 7, 1, 1, 3), (64, 1, 6, 1, 1, 3), (72, 1, 6, 1, 1, 3), (72, 1, 6, 1, 2, 3),
    # and the many-token tiles (the verify buckets 128..512), planned where unsplit blocks fill their waves
    (136, 1, 5, 1, 1, 3), (192, 1, 4, 1, 1, 3)) + (
    # one warpgroup, 64 rows, clusters of 2: a 4096-row W is 128 blocks, where 128-row blocks fill 64 or 96 SMs
    # (runtime/dense_gmma.py _one_full_wave_of_1wg_pairs); 7 / 6 stages the default since session 28, 4 for A/B;
    # and rings small enough for two blocks per SM (<= ~100 KB with the push's receive region: qkv's 192 blocks in
    # one wave, or a chain's next blocks resident beside the previous ones), for A/B (tools/bench_dense.py --gmma)
    (48, 2, 4, 1, 2, 1), (72, 2, 4, 1, 2, 1), (48, 2, 7, 1, 2, 1), (72, 2, 6, 1, 2, 1),
    (32, 2, 4, 1, 2, 1), (48, 2, 3, 1, 2, 1), (72, 1, 5, 1, 2, 1))


def _gmma_trigger() -> int:
    """Where linear_gmma_kernel lets the next kernel on the stream launch (PDL): DDTREE_GMMA_TRIGGER=start (the
    default) right after its dependency wait, =epilogue once its MMAs are done (as before session 23; H200, chains
    of Qwen3-8B-shaped launches: start was 2-9% faster at M = 1, 0-4.5% at M = 17, equal at M = 65)."""
    v = os.environ.get("DDTREE_GMMA_TRIGGER", "start")
    if v not in ("start", "epilogue"):
        raise ValueError(f"DDTREE_GMMA_TRIGGER={v!r}: use start or epilogue")
    return int(v == "start")


def _narrow_rewrite() -> int:
    """When linear_gmma_narrow_kernel's fused prologue rewrites a stage's x tile: DDTREE_NARROW_REWRITE=ahead (the
    default) the next stage's while this stage's MMAs run, =inline each stage's just before its own MMAs (session
    24's first version, for A/B timing)."""
    v = os.environ.get("DDTREE_NARROW_REWRITE", "ahead")
    if v not in ("ahead", "inline"):
        raise ValueError(f"DDTREE_NARROW_REWRITE={v!r}: use ahead or inline")
    return int(v == "ahead")


def gmma_entry(cfg: tuple) -> str:
    """The kernel name expression of instance (TN, KA, STAGES, RW, CS, NWG); NWG = 2 is the default argument."""
    if cfg[5] == 2:
        return "linear_gmma_kernel<%d, %d, %d, %d, %d>" % cfg[:5]
    return "linear_gmma_kernel<%d, %d, %d, %d, %d, %d>" % cfg


_GMMA_OPTIONS = (f"-DGMMA_EARLY_TRIGGER={_gmma_trigger()}",)   # every build of dense_linear_sm90.cu


def _register_gmma_family(name: str, configs, extra_options=(), checked: bool = True) -> None:
    """A build of dense_linear_sm90.cu (sm_90a): linear_gmma_kernel at `configs`, with `extra_options`; `checked`:
    its SASS / PTX must hold the wgmma (not for the measurement builds that drop the MMAs)."""
    checks = dict(required_sass={"90a": r"HGMMA"}, required_ptx={"90a": r"wgmma\.mma_async"}) if checked else {}
    register(KernelFamily(name=name, source="dense_linear_sm90.cu", entries=tuple(map(gmma_entry, configs)),
                          archs=("90a",), options=(*_GMMA_OPTIONS, *extra_options), pdl=True, **checks))


_register_gmma_family("dense_linear_sm90", DENSE_GMMA_INSTANCES)
# linear_gmma_kernel's cluster K splits with GMMA_PUSH (each rank's partials of the others' token groups st.async'd
# into their receive regions; where they do not fit, the DSMEM epilogue); runtime/dense_gmma.py takes these where
# gmma_push_smem_bytes fits and the token tile is <= GMMA_PUSH_MAX_TN.
_register_gmma_family("dense_linear_sm90_push", [c for c in DENSE_GMMA_INSTANCES if c[4] > 1], ("-DGMMA_PUSH=1",))
# linear_gmma_kernel bisected (GMMA_BISECT: 1 no MMAs, 2 no epilogue, 3 neither) at the plans of Qwen3-8B's qkv, o,
# down and gate_up at 17 / 33 / 64 / 65 rows (132 SMs), for tools/bench_w_tiles.py: where the kernel's time goes
# beside its loads alone. Wrong outputs by design; nothing in the runtime launches them.
_BISECT_CONFIGS = ((32, 2, 4, 1, 2, 2), (32, 2, 4, 1, 3, 2), (32, 1, 7, 1, 1, 3), (48, 2, 4, 1, 2, 2),
                   (48, 2, 7, 1, 2, 1), (64, 2, 4, 1, 2, 2), (64, 2, 4, 1, 3, 2), (64, 1, 6, 1, 1, 3),
                   (72, 2, 4, 1, 2, 2), (72, 2, 6, 1, 2, 1), (72, 1, 6, 1, 1, 3))
for _bisect in (1, 2, 3):
    _register_gmma_family(f"dense_linear_sm90_bisect{_bisect}", _BISECT_CONFIGS, (f"-DGMMA_BISECT={_bisect}",),
                          checked=False)
# linear_gmma_kernel with GMMA_TRACE (per-block %globaltimer stamps into its ws argument) at the plans of Qwen3-8B's
# qkv, o and down at 33 rows: with the DSMEM epilogue, with the push epilogue, and without an epilogue
# (GMMA_BISECT 2), for tools/bench_w_tiles.py --trace-m. Nothing in the runtime launches them.
TRACE_CONFIGS = ((48, 2, 4, 1, 2, 2), (48, 2, 7, 1, 2, 1))
TRACE_WORDS = 9  # u64 per block: dense_linear_sm90.cu's kTraceWords
TRACE_FAMILIES = {"dense_linear_sm90_trace": (), "dense_linear_sm90_trace_push": ("-DGMMA_PUSH=1",),
                  "dense_linear_sm90_trace_noepi": ("-DGMMA_BISECT=2",)}
for _name, _extra in TRACE_FAMILIES.items():
    _register_gmma_family(_name, TRACE_CONFIGS, ("-DGMMA_TRACE=1", *_extra), checked=False)
# Hopper GMMA bf16 linear in narrow row blocks for up to 80 token rows (W as wgmma's B operand, so a block is any
# multiple of 16 W rows and one wave of unsplit blocks can cover every SM): linear_gmma_narrow_kernel<NW, TX, KA,
# STAGES> (NW W rows per block, TX token rows per tile: one warpgroup up to 64, two for 80 = the verify bucket 64's
# 65 rows; KA 64-k atoms per stage, STAGES stages), sm_90a only;
# runtime/dense_gmma.py narrow_plan. Per (NW, TX): at most 16 KB of W per stage (KA 4, 2 or 1) and as many stages
# as fit ~200 KB (the size of linear_gmma_kernel's rings), at least 6 where a smaller KA allows it, at most 12.
NARROW_GMMA_ROWS = (32, 48, 64, 80, 96, 128, 192, 256)
NARROW_GMMA_TOKEN_TILES = (16, 32, 64, 80)
# XMODE: the op fused into the x tile (0: none, 1: rmsnorm (+ residual add), 2: SwiGLU); 1 and 2 stage a second
# x tile (the residual / up)
NARROW_XMODES = {"none": 0, "rmsnorm": 1, "swiglu": 2}


def narrow_stage_bytes(nw: int, tx: int, ka: int, xmode: int = 0, cs: int = 1) -> int:
    """Shared memory of one pipeline stage of linear_gmma_narrow_kernel<nw, tx, ka, *, xmode> (cs = 1) or
    linear_gmma_narrow_mc_kernel<nw, tx, ka, *, xmode, cs>: the x tile (two tiles, x and x2, with a prologue; KA
    swizzled 64-k atoms of 128 bytes a row, or with cs > 1 TX rows of KA * 128 + 16 bytes, rounded up to 1024), KA
    64-k atoms of the W tile (128 bytes a row), the rmsnorm weight's KA x 128 bytes; rounded up to 1024 (every
    swizzled tile starts 1024-aligned)."""
    tiles = 1 if xmode == 0 else 2
    x = ka * tx * 128 * tiles if cs == 1 else -(-tiles * tx * (ka * 128 + 16) // 1024) * 1024
    stage = x + ka * nw * 128 + (ka * 128 if xmode == 1 else 0)
    return -(-stage // 1024) * 1024


def _narrow_config(nw: int, tx: int, xmode: int = 0, cs: int = 1, budget: int = 200 * 1024) -> tuple:
    """(NW, TX, KA, STAGES, XMODE), + (CS,) for a cluster instance: KA as large as keeps 16 KB of W and 6 stages."""
    kas = [ka for ka in (4, 2, 1) if ka == 1 or ka * nw * 128 <= 16384]
    ka = next((k for k in kas if budget // narrow_stage_bytes(nw, tx, k, xmode, cs) >= 6), kas[-1])
    cfg = nw, tx, ka, min(12, budget // narrow_stage_bytes(nw, tx, ka, xmode, cs)), xmode
    return cfg if cs == 1 else cfg + (cs,)


NARROW_GMMA_INSTANCES = tuple(_narrow_config(nw, tx, xm) for xm in NARROW_XMODES.values() for nw in NARROW_GMMA_ROWS
                              for tx in NARROW_GMMA_TOKEN_TILES)
# linear_gmma_narrow_mc_kernel: the row blocks of qkv / o / down (48, 32) in clusters of 2 that read x once per
# cluster (multicast bulk copies), for the token counts where each block reading all of x costs (NARROW_X_PER_W)
NARROW_MC_ROWS = (32, 48, 64)
NARROW_MC_CS = 2
NARROW_MC_INSTANCES = tuple(_narrow_config(nw, tx, xm, NARROW_MC_CS) for xm in NARROW_XMODES.values()
                            for nw in NARROW_MC_ROWS for tx in NARROW_GMMA_TOKEN_TILES)


def narrow_entry(cfg: tuple) -> str:
    """The kernel name expression of instance (NW, TX, KA, STAGES, XMODE) (XMODE 0 is the default argument), or of
    the cluster kernel's (NW, TX, KA, STAGES, XMODE, CS)."""
    if len(cfg) == 6:
        return "linear_gmma_narrow_mc_kernel<%d, %d, %d, %d, %d, %d>" % cfg
    return "linear_gmma_narrow_kernel<%d, %d, %d, %d>" % cfg[:4] if cfg[4] == 0 else \
        "linear_gmma_narrow_kernel<%d, %d, %d, %d, %d>" % cfg


# the compile options of every narrow family (one source): where it lets the next kernel in, where a fused prologue
# rewrites the x tile
_NARROW_OPTIONS = (*_GMMA_OPTIONS, f"-DNARROW_REWRITE_AHEAD={_narrow_rewrite()}")
# one family per XMODE (the same source): each compiles on its own (~17 s for 32 instances; all in one took 52 s)
NARROW_FAMILIES = {xm: "dense_linear_narrow_sm90" + ("" if xm == "none" else "_" + xm) for xm in NARROW_XMODES}
for _prologue, _family in NARROW_FAMILIES.items():
    register(KernelFamily(
        name=_family,
        source="dense_linear_narrow_sm90.cu",
        entries=tuple(narrow_entry(c) for c in NARROW_GMMA_INSTANCES if c[4] == NARROW_XMODES[_prologue]),
        archs=("90a",),
        options=_NARROW_OPTIONS,
        pdl=True,
        required_sass={"90a": r"HGMMA"},
        required_ptx={"90a": r"wgmma\.mma_async"},
    ))
NARROW_MC_FAMILY = "dense_linear_narrow_mc_sm90"
register(KernelFamily(
    name=NARROW_MC_FAMILY,
    source="dense_linear_narrow_sm90.cu",
    entries=tuple(narrow_entry(c) for c in NARROW_MC_INSTANCES),
    archs=("90a",),
    options=_NARROW_OPTIONS,
    pdl=True,
    required_sass={"90a": r"HGMMA"},
    required_ptx={"90a": r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx::bytes\.multicast"},
))
# Embedding gather, RMSNorm (+ residual add), RoPE (+ per-head q/k norm), SwiGLU, add.
register(KernelFamily(
    name="norm_rope",
    source="norm_rope.cu",
    entries=("embedding_kernel", "rmsnorm_kernel", "rope_kernel", "rope_qkv_cache_kernel", "swiglu_kernel",
             "add_kernel"),
    pdl=True,
))
# decode_attention_kernel<D, KT, S> instances: (slots per warp tile, ring stages); runtime/dense_kernels.py picks one
# per head dim (DECODE_VARIANTS) and bench_dense --attn-decode-variants times them.
DECODE_ATTN_VARIANTS = ((32, 2), (32, 3), (16, 2), (16, 3))
# Prefix + bitmask attention (tree verify, decode, causal prefill, DFlash block); head dims 64 and 128.
register(KernelFamily(
    name="tree_attention",
    source="tree_attention.cu",
    entries=("tree_attention_kernel<64>", "tree_attention_kernel<128>",
             *(f"decode_attention_kernel<{d}, {kt}, {st}>" for d in (64, 128) for kt, st in DECODE_ATTN_VARIANTS),
             "attention_combine_kernel<64>", "attention_combine_kernel<128>"),
    required_ptx=_MMA_BF16_PTX,
    required_sass=_MMA_BF16_SASS,
    pdl=True,
))
# The same tree-verify attention on Hopper wgmma (one warpgroup per 64 packed rows; S and P V on wgmma),
# sm_90a only; its partials go through tree_attention's attention_combine_kernel. (D, STAGES) instances:
TREE_ATTN_GMMA_INSTANCES = ((64, 2), (64, 4), (128, 2), (128, 3))
register(KernelFamily(
    name="tree_attention_sm90",
    source="tree_attention_sm90.cu",
    entries=tuple(f"tree_attention_gmma_kernel<{d}, {s}>" for d, s in TREE_ATTN_GMMA_INSTANCES),
    archs=("90a",),
    required_sass={"90a": r"HGMMA"},
    required_ptx={"90a": r"wgmma\.mma_async"},
    pdl=True,
))
# Per-row top-K log-softmax, argmax, inverse-CDF sampling; KV compaction over all cache planes.
register(KernelFamily(
    name="sampling",
    source="sampling.cu",
    entries=("log_softmax_topk_kernel", "argmax_kernel", "sample_kernel", "kv_compact_kernel"),
    pdl=True,
))

# ---------------------------------------------------------------- Kimi K2.x kernels (issue 7)
# INT4 W4A16 grouped MoE GEMMs: moe_w4a16_kernel<MODE, RB, WN, KS, NTMAX, STAGES[, XS[, RG]]> (MODE 0 gate+up
# with SiLU*up, 1 down; RB row blocks of 16 per warp, WN x KS warps per block, up to 8*NTMAX tokens per weight
# pass; STAGES 0 = register prefetch, 1 = the same with two register buffers in turn, -D = with D of them, else
# a per-warp cp.async ring of that many steps; XS > 0: activations staged per block in shared memory in XS
# pieces of K; RG: row groups streamed back to back per warp).
# The curated table below is what runtime/kimi_kernels.py picks from (per token bucket); tools/bench_moe.py
# times every entry. mma.sync m16n8k16 (CuTe SM80 atom) exists on every target arch.
_MMA_SYNC_PTX = r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32"
MOE_GEMM_VARIANTS = tuple(
    f"moe_w4a16_kernel<{mode}, {rest}>" for mode in (0, 1)
    for rest in ("2, 4, 1, 1, 0", "2, 4, 1, 1, 3", "2, 2, 1, 1, 3", "2, 4, 1, 2, 0", "2, 4, 1, 2, 3", "2, 2, 1, 2, 3",
                 "2, 4, 1, 4, 3", "2, 4, 1, 1, 1",
                 # XS: activations staged once per block in shared memory (8 NTMAX x K bf16: gate_up's 7168-wide
                 # rows fit one 8-token tile)
                 "2, 4, 1, 1, 1, 1", "2, 8, 1, 1, 1, 1",
                 # ... in XS pieces along K, double-buffered (gate_up's 7168-wide rows: 2 x 1792 / 1024 / 512
                 # columns per token at XS = 4 / 7 / 14)
                 "2, 4, 1, 1, 1, 4", "2, 4, 1, 2, 1, 4", "2, 4, 1, 4, 1, 4", "2, 2, 1, 2, 1, 2", "2, 4, 1, 2, 1, 2",
                 # RG: each warp streams RG row groups back to back (one pipeline fill per RG groups)
                 "2, 4, 1, 1, 1, 0, 2") + (
        ("2, 4, 1, 2, 1, 1", "2, 4, 1, 4, 1, 1", "2, 4, 1, 2, 1, 0, 4", "2, 4, 1, 2, 1, 1, 2", "2, 4, 1, 2, 1, 1, 4",
         "2, 4, 1, 1, 1, 1, 4",
         # STAGES -3: three register buffers (two steps in flight per warp), with XS: down at T = 1; with two row
         # groups per warp (T = 1: 896 warps, all resident in one wave, 16 steps each)
         "2, 4, 1, 1, -3, 1", "2, 4, 1, 1, -3, 1, 2") if mode else
        ("2, 4, 1, 1, 1, 7", "2, 4, 1, 2, 1, 7", "2, 4, 1, 2, 1, 14", "2, 4, 1, 4, 1, 14",
         # three register buffers with the activations in shared memory (x loads off the weights' critical path)
         "2, 4, 1, 1, -3, 7",
         # FIT: the activation tile sized to min(8, T) rows (T = 2: 28 KB, 4 blocks per SM instead of 2)
         "2, 4, 1, 1, 1, 1, 1, 1")))
# Measured and dropped (H200, 2026-12-03 (7) run 3, uniform T = 16..256, % of read BW per stage): the deeper
# cp.async rings STAGES 4 / 6 (43-68%) and the two-tile ping-pong <2, 4, 1, 2, 1> (58-73%); (9) run 1, T = 1..8:
# the register rings STAGES -3 / -4 without XS (gate_up T = 1 49.0 / 49.7 us vs 43.0 for STAGES 1).
# (K split over the warps of a block, KS = 2 / 4, was measured at T = 1..16 and lost: PERF.md, 2026-12-03 (2).)
register(KernelFamily(
    name="moe_int4",
    source="moe_int4.cu",
    entries=MOE_GEMM_VARIANTS + ("moe_combine_kernel",),
    required_sass={a: r"HMMA" for a in ALL_ARCHS},
    required_ptx={a: _MMA_SYNC_PTX for a in ALL_ARCHS},
    pdl=True,
))
# The same grouped GEMMs on Hopper wgmma for experts with many tokens (weights dequantized once per stage into
# shared memory, or into wgmma A registers with PIPE 2 / 3 / 6 / 7 / 8 / 20): moe_gmma_kernel<MODE, TN, PIPE>, plus
# the slot split between it and moe_w4a16_kernel. sm_90a only.
MOE_GMMA_VARIANTS = tuple(f"moe_gmma_kernel<{mode}, {tn}, {pipe}>" for mode in (0, 1) for tn in (64, 128, 256)
                          for pipe in (0, 1, 2)) + tuple(
    f"moe_gmma_kernel<{mode}, {tn}, {pipe}>" for mode in (0, 1) for tn in (64, 128) for pipe in (3, 6, 7)) + tuple(
    f"moe_gmma_kernel<{mode}, 32, {pipe}>" for mode in (0, 1) for pipe in (6, 7)) + tuple(
    f"moe_gmma_kernel<{mode}, {tn}, 8>" for mode in (0, 1) for tn in (32, 64)) + tuple(
    f"moe_gmma_kernel<{mode}, 256, 20>" for mode in (0, 1)) + tuple(
    f"moe_gmma_ws_kernel<{mode}, {tn}, {nstep}>" for mode in (0, 1) for tn in (128, 256) for nstep in (0, 16))
register(KernelFamily(
    name="moe_int4_sm90",
    source="moe_int4_sm90.cu",
    entries=MOE_GMMA_VARIANTS + ("moe_slot_split_kernel", "moe_x_slot_kernel"),
    archs=("90a",),
    required_sass={"90a": r"HGMMA"},
    required_ptx={"90a": r"wgmma\.mma_async"},
))
# noaux_tc top-k routing (sigmoid + correction bias, group-limited) and grouping of tokens by expert:
# moe_route_kernel (both in one launch, what the layer uses), the two-kernel pair kept for A/B timing.
register(KernelFamily(
    name="moe_routing",
    source="moe_routing.cu",
    entries=("moe_route_kernel", "moe_route_one_kernel", "moe_route_blocks_kernel", "moe_route_batch_kernel",
             "moe_topk_kernel", "moe_group_kernel"),
    pdl=True,
))
# MLA absorbed attention over the 512+64 latent cache (tree mask or causal), split-KV merge, per-head GEMM.
register(KernelFamily(
    name="mla_verify",
    source="mla_verify.cu",
    entries=("mla_attention_kernel", "mla_combine_kernel", "mla_head_gemm_kernel"),
    required_sass={a: r"HMMA" for a in ALL_ARCHS},
    required_ptx={a: _MMA_SYNC_PTX for a in ALL_ARCHS},
    pdl=True,
))

# The same attention on Hopper wgmma (S from shared-memory operands, P V with P from registers), sm_90a only.
register(KernelFamily(
    name="mla_verify_sm90",
    source="mla_verify_sm90.cu",
    entries=("mla_attention_gmma_kernel<0>", "mla_attention_gmma_kernel<1>"),   # <SPLIT_S>
    archs=("90a",),
    required_sass={"90a": r"HGMMA"},
    required_ptx={"90a": r"wgmma\.mma_async"},
    pdl=True,
))

# ---------------------------------------------------------------- CUDA backend / engine (issue 6, engine on CUDA)
# Row copies with a device-resident destination offset: KV append inside captured graphs, activation concat.
register(KernelFamily(
    name="engine_ops",
    source="engine_ops.cu",
    entries=("copy_rows_kernel",),
    pdl=True,
))
