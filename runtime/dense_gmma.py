"""Hopper GMMA bf16 linear (cutlass_kernels/dense_linear_sm90.cu, family dense_linear_sm90, sm_90a only):
out[M, N] = x[M, K] @ w[N, K]^T (+ residual) for every M >= 9: the verify buckets and prefill (above 256 rows
the tokens are walked in tiles on blockIdx.z, re-reading W once per tile); and decode sizes (1..8 rows, a 16-token
tile) of weights of >= 16 MB with K >= 1024 (gmma_wanted).

Launch plan: a block is NWG warpgroups (2: 256 threads over 128 W rows; 3: 384 threads over 192 rows, planned
where their unsplit blocks fill one wave, e.g. Qwen3-8B's gate_up; 1: 128 threads over 64 rows, in clusters of 2
where those fill one wave, e.g. its o and down) and TN tokens (the wgmma N), fed by a STAGES-deep
shared-memory pipeline of KA 64-k atoms per stage. TN is the smallest instance >= M (one token tile up to
256 rows). K is split over blockIdx.y when the row blocks alone cannot fill the GPU (gmma_plan's cost
model): either inside a (1, CS, 1) thread-block cluster whose blocks sum their partial tiles through
distributed shared memory (CS = 2; 4 when forced: no workspace traffic, no tickets; with GMMA_PUSH the blocks
exchange their partials by st.async, each summing and writing its share of the tile's token groups), or through
fp32 partials in a runtime.dense_kernels.Workspace reduced by the last block of each tile
(ddtree::splitk_finish: one int32 ticket per (token tile, row block), left at zero). A stream-K schedule over all
SMs was built and measured slower at every shape (docs/PERF.md, sessions 27-28), and removed.

The narrow-row kernel (narrow_plan, launch_narrow; cutlass_kernels/dense_linear_narrow_sm90.cu) is the other
orientation for up to 80 rows: W on wgmma's N side in blocks of any multiple of 16 rows, so that one wave of unsplit
blocks covers every SM, with rmsnorm / SwiGLU fused into its x tile. On by default where linear_gmma_kernel's plan
leaves SMs idle (DDTREE_GMMA_NARROW=0: off); its fused prologues are off (DDTREE_NARROW_FUSE=1: on).
"""
from __future__ import annotations

import os

import numpy as np

from runtime.cuda import DeviceArray, get_device, get_kernel
from runtime.dense_kernels import Workspace, _i32, _need, default_workspace, linear_checks

from cutlass_kernels.registry import (DENSE_GMMA_INSTANCES, FAMILIES, NARROW_GMMA_INSTANCES, NARROW_GMMA_ROWS,
                                      NARROW_FAMILIES, NARROW_GMMA_TOKEN_TILES, NARROW_MC_CS, NARROW_MC_FAMILY,
                                      NARROW_MC_INSTANCES, NARROW_XMODES, gmma_entry, narrow_entry,
                                      narrow_stage_bytes)

FAMILY = "dense_linear_sm90"
# The cluster K splits (CS > 1) with the ranks' partial sums exchanged by st.async (GMMA_PUSH in
# dense_linear_sm90.cu; family FAMILY_PUSH, where the receive region fits: gmma_push_smem_bytes) instead of the
# DSMEM epilogue between two cluster barriers, at token tiles up to GMMA_PUSH_MAX_TN (DDTREE_GMMA_PUSH_MAX_TN;
# 0: never). Session 30 (each rank sums its share of the token groups), graph chain per op, DSMEM -> push, us:
# H100 qkv 17 / 33 / 65 rows 20.63 -> 19.64 / 21.32 -> 20.19 / 22.24 -> 21.18, o 14.72 -> 13.81 / 14.31 -> 13.59 /
# 15.00 -> 14.57, down 37.23 -> 36.20 / 37.17 -> 36.42 / 39.02 -> 38.18; H200 qkv 15.53 -> 15.24 / 16.14 -> 15.92 /
# 17.25 -> 17.05, o 11.15 -> 10.67 / 11.07 -> 10.95, down even; 12-layer verify b32 -1.0% (H200), -2.3% (H100).
FAMILY_PUSH = "dense_linear_sm90_push"
GMMA_PUSH_MAX_TN = int(os.environ.get("DDTREE_GMMA_PUSH_MAX_TN", "256"))
GMMA_ARCHS = FAMILIES[FAMILY].archs
GMMA_ROWS_PER_WARPGROUP = 64     # W rows per warpgroup (x RW); a block has NWG warpgroups of 128 threads
GMMA_NWG = 2                     # warpgroups per block the planner uses by default
# Three warpgroups (192 rows, one 64-k atom x 6-8 stages) where their unsplit blocks fill one wave: H200,
# Qwen3-8B gate_up 24576x4096 (128 blocks on 132 SMs) M = 17 49.7 vs 53.8 us (cluster split of 2), M = 65
# 53.2 vs 58.5 (cuBLAS 49.3 / 51.4), 2026-12-03 (3) run 1.
GMMA_NWG_ONE_WAVE = 3
GMMA_MIN_M = 9                   # runtime.dense_kernels.linear hands M >= this to this kernel, and (GMMA_DECODE):
# Decode sizes (1..8 rows) of large weights too, where the gemv kernel ran before. H200, session 23, M = 1 (token
# tile 16) vs the gemv: Qwen3-8B qkv 14.7 vs 16.3 us, o 10.5 vs 10.9, gate_up 46.7 vs 52.5, down 25.8 vs 27.5,
# lm_head 273.4 vs 307.4; its 12-layer AR step with every projection and lm_head on GMMA (rmsnorm / SwiGLU as
# their own launches) 1662.5 vs 1806.7 us. Not for weights under 16 MB nor K < 1024 (every SmolLM2-135M
# weight): its lm_head (49152x576) ran 17.1 vs 18.7 us alone but its AR step 2% slower with it on GMMA.
# DDTREE_GMMA_DECODE=0: off.
GMMA_DECODE = os.environ.get("DDTREE_GMMA_DECODE", "1") != "0"
GMMA_DECODE_MIN_BYTES = 16 << 20
GMMA_DECODE_MIN_K = 1024
SMEM_PER_SM = 228 * 1024         # H100/H200: 228 KB per SM, 227 KB per block, 1 KB reserved per block
SMEM_PER_BLOCK_MAX = 227 * 1024
# Cost model of gmma_plan, fitted to H200 runs of tools/bench_dense.py --gmma (2026-12-02): one block
# streams W at up to ~45 GB/s and computes at ~3.6 TFLOP/s; all blocks together read at most ~3.9 TB/s; a
# block costs ~2 us beyond that (ramp, epilogue); a workspace split-K adds ~2.5 us + 0.03 us * M * splits
# (partials written, the last block's reduction). Cluster splits count waves by the clusters the device
# holds at once (device_cluster_slots: 30 of 4 on the H200, so 32 row blocks x 4 take two waves), and
# workspace splits (3..64) are tried only where two splits would leave two thirds of the SMs idle: on the
# Qwen3-8B shapes a workspace split of 4 lost to the cluster split of 2 (o: 18.6 vs 15.1 us at M = 64).
GMMA_SM_BYTES_PER_US = 45e3
GMMA_SM_FLOP_PER_US = 3.6e6
GMMA_HBM_BYTES_PER_US = 3.9e6
GMMA_BLOCK_US = 2.0
# Cluster sizes the planner considers, in order of preference where the model ties (DDTREE_GMMA_CLUSTERS, for
# A/B timing). Clusters of 3 fill 96 SMs where 32 row blocks of 2 fill 64 and 32 of 4 need two waves (the
# H200 holds 30): Qwen3-8B-shaped verify b64 5934 us with 3 vs 6391 us without (1.16x / 1.25x AR, run 19).
GMMA_CLUSTER_SIZES = tuple(int(c) for c in os.environ.get("DDTREE_GMMA_CLUSTERS", "2,4,3").split(","))
GMMA_INSTANCES = frozenset(DENSE_GMMA_INSTANCES)  # (TN, KA, STAGES, RW, CS, NWG)
TOKEN_TILES = tuple(sorted({c[0] for c in DENSE_GMMA_INSTANCES if c[5] == GMMA_NWG}))
# default (KA, STAGES, RW) per token tile: one block per SM with 3-5 stages in flight
_DEFAULT_CONFIG = {16: (2, 4, 1), 32: (2, 4, 1), 48: (2, 4, 1), 64: (2, 4, 1), 72: (2, 4, 1),
                   96: (1, 6, 1), 128: (1, 6, 1), 136: (1, 6, 1), 192: (1, 4, 1), 256: (1, 4, 1)}
# three warpgroups (192 rows): one 64-k atom per stage, as deep as ~200 KB allows
_DEFAULT_CONFIG_3WG = {16: (1, 8, 1), 32: (1, 7, 1), 64: (1, 6, 1), 72: (1, 6, 1), 136: (1, 5, 1), 192: (1, 4, 1)}
# one warpgroup (64 rows): as deep as ~200 KB allows. H100, session 28 (graph of rotating weights), against 4
# stages: o 14.26 vs 14.73 us at M = 33, 15.06 vs 15.48 at M = 65; down 37.41 vs 38.41, 39.01 vs 39.58
GMMA_ONE_WG_CONFIG = {48: (2, 7, 1), 72: (2, 6, 1)}


def gmma_smem_bytes(tn: int, ka: int, stages: int, rw: int = 1, nwg: int = GMMA_NWG) -> int:
    """Dynamic shared memory of linear_gmma_kernel<tn, ka, stages, rw, *, nwg>: the stages (W 8 KB * nwg * rw +
    x tn*128 bytes per 64-k atom) or the fp32 epilogue staging [tn][64 nwg + 4], whichever is larger, plus 1 KB
    to align."""
    return 1024 + max(stages * ka * (8192 * nwg * rw + tn * 128), tn * (64 * nwg + 4) * 4)


def gmma_push_smem_bytes(tn: int, ka: int, stages: int, rw: int, cs: int, nwg: int) -> int | None:
    """Dynamic shared memory of the push family's instance (dense_linear_sm90.cu GMMA_PUSH: each rank receives the
    others' fp32 partials of its share of the tile's 8-token groups past its ring and staging: CS - 1 slots of
    ceil(TN / 8 / CS) groups), or None where it keeps the DSMEM epilogue."""
    slot = -(-(tn // 8) // cs) * gmma_threads(nwg) * 16
    smem = gmma_smem_bytes(tn, ka, stages, rw, nwg) + (cs - 1) * slot
    return smem if cs > 1 and rw == 1 and smem <= SMEM_PER_BLOCK_MAX else None


def gmma_threads(nwg: int = GMMA_NWG) -> int:
    return 128 * nwg


_CONFIG_OF_ENTRY = {gmma_entry(c): c for c in DENSE_GMMA_INSTANCES}


def gmma_config(entry: str) -> tuple:
    """(TN, KA, STAGES, RW, CS, NWG) of a built linear_gmma_kernel instance name (registry.gmma_entry's inverse)."""
    return _CONFIG_OF_ENTRY[entry]


def gmma_blocks_per_sm(tn: int, ka: int, stages: int, rw: int = 1, nwg: int = GMMA_NWG) -> int:
    static = 2 * stages * 8 + 16  # mbarriers + splitk_finish's flag
    return max(1, min(2, SMEM_PER_SM // (gmma_smem_bytes(tn, ka, stages, rw, nwg) + static + 1024)))


def token_tile(M: int) -> int:
    """The smallest token tile >= M; above the largest, the smallest that covers M in as few tiles as the
    largest does (M = 257: two tiles of 192, not 256 + a 1-row tile of 256)."""
    tiles = -(-M // TOKEN_TILES[-1])
    per_tile = -(-M // tiles)
    return next(tn for tn in TOKEN_TILES if per_tile <= tn)


# runtime.dense_kernels.linear (kernel="auto", no fused prologue) hands these shapes to linear_gmma:
# DDTREE_LINEAR_GMMA=0 turns that off (A/B timing). Measured faster than the mma.sync chunked kernel on the
# H200 at every Qwen3-8B projection (M = 16..256, 1.14-2.28x) and at SmolLM2's (M = 17 / 65: qkv, o, gate_up,
# down 1.35-1.89x; lm_head 49152x576 0.95x / 1.07x), so every size of that M range takes it.
GMMA_ENABLED = os.environ.get("DDTREE_LINEAR_GMMA", "1") != "0"
GMMA_MIN_N, GMMA_MIN_K = 1, 8


def gmma_wanted(M: int, N: int, K: int) -> bool:
    """Whether runtime.dense_kernels.linear should use this kernel for [M, K] x [N, K]^T on this device."""
    decode = GMMA_DECODE and 1 <= M < GMMA_MIN_M and N * K * 2 >= GMMA_DECODE_MIN_BYTES and K >= GMMA_DECODE_MIN_K
    return (GMMA_ENABLED and (M >= GMMA_MIN_M or decode) and N >= GMMA_MIN_N and K >= GMMA_MIN_K
            and gmma_available())


def gmma_available(arch: str | None = None) -> bool:
    """True when the current device (or `arch`) runs this family."""
    if arch is None:
        arch = get_device().arch
    return arch in GMMA_ARCHS


def _cluster_slots(cs: int, bps: int, sm_count: int) -> int:
    """Estimated blocks of (1, cs, 1) clusters resident at once (plans made without a device): clusters live
    inside one GPC, so GPCs whose SM count is not a multiple of cs leave SMs idle. The H200 holds 66 clusters
    of 2 and only 30 of 4 (cuOccupancyMaxActiveClusters, 2026-12-03): a grid of 32 clusters of 4 runs in two
    waves. On a device, launch_gmma asks the driver (device_cluster_slots)."""
    return cs * ((bps * sm_count) // cs - (0 if cs <= 2 else 3))


_resident_clusters: dict = {}


def device_cluster_slots(cfg: tuple, smem: int) -> int:
    """Blocks of instance cfg's (1, CS, 1) clusters resident at once on the current device, from the driver
    (cuOccupancyMaxActiveClusters); cached per device and instance."""
    from runtime.cuda.device import driver
    from runtime.cuda.errors import check
    dev = get_device()
    key = (dev.ordinal, cfg)
    n = _resident_clusters.get(key)
    if n is None:
        entry = gmma_entry(cfg)
        kern = get_kernel(FAMILY, entry)
        kern.set_max_dynamic_smem(smem)
        drv = driver()
        conf = drv.CUlaunchConfig()
        conf.gridDimX, conf.gridDimY, conf.gridDimZ = 1, cfg[4], 1
        conf.blockDimX, conf.blockDimY, conf.blockDimZ = gmma_threads(cfg[5]), 1, 1
        conf.sharedMemBytes = smem
        n = _resident_clusters[key] = cfg[4] * check(drv.cuOccupancyMaxActiveClusters(kern.function, conf),
                                                     f"cuOccupancyMaxActiveClusters({kern})")
    return n


# Three warpgroups at the many-token tiles (M = 129..512, where two warpgroups issue too few MMAs per block to reach
# either the bytes or the FLOPs floor): unsplit 192-row blocks wherever they fill their waves to >= 70%. H200,
# session 20, against the two-warpgroup plan: gate_up 24576x4096 at M = 129 / 257 / 513 80.3 -> 66.1 / 159.5 ->
# 130.6 / 257.8 -> 231.7 us, lm_head 151936x4096 -10 / -18 / -18%, qkv 6144x4096 at M = 513 (96 blocks) -15%; where
# they fill less they lost (qkv at M = 257, 64 blocks: +18%; o and down, 22-66 blocks: +15..140%), and a 256-token
# tile (three stages) lost at M = 1025 (gate_up +6%), so it is not built. Measured per op only (the whole-step A/B
# was not run): DDTREE_GMMA_THREE_WG=0 turns it off.
_THREE_WG_MANY_TOKEN_TILES = (136, 192)
GMMA_THREE_WG_MANY = os.environ.get("DDTREE_GMMA_THREE_WG", "1") != "0"


def _three_wg_unsplit(M: int, N: int, tn: int, sm_count: int) -> bool:
    """Whether to plan unsplit 192-row blocks (three warpgroups, cs = 1) for token tile tn. At the tiles up to 72
    where they fill one wave to >= 90%: each SM streams one long K run with 6-8 stages in flight and nothing ramps
    twice (cuBLAS's shape for 24576x4096). At the many-token tiles where they fill >= 70% of one wave and of their
    waves."""
    cfg = (tn, *_DEFAULT_CONFIG_3WG.get(tn, (0, 0, 0)), 1, GMMA_NWG_ONE_WAVE)
    if cfg not in GMMA_INSTANCES:
        return False
    slots = gmma_blocks_per_sm(tn, cfg[1], cfg[2], cfg[3], GMMA_NWG_ONE_WAVE) * sm_count
    blocks = -(-N // (GMMA_ROWS_PER_WARPGROUP * GMMA_NWG_ONE_WAVE)) * -(-M // tn)
    if tn in _THREE_WG_MANY_TOKEN_TILES:
        waves = -(-blocks // slots)
        return GMMA_THREE_WG_MANY and blocks >= 0.7 * slots and blocks >= 0.7 * waves * slots
    return 0.9 * slots <= blocks <= slots


# One-warpgroup blocks (64 rows) in clusters of 2 where they fill one wave and 128-row blocks cannot: Qwen3-8B's o
# (4096x4096) and down (4096x12288), 128 blocks where clusters of 3 of 128 rows fill 96 SMs. H200, session 19:
# o 12.12 vs 12.97 us at M = 65, 11.23 vs 12.27 at M = 33; down 29.96 vs 30.13, 28.33 vs 30.27. At M = 17 (token
# tile 32) it lost by 1.5-2% and has no instance. DDTREE_GMMA_ONE_WG=0 turns it off (A/B).
GMMA_ONE_WG = os.environ.get("DDTREE_GMMA_ONE_WG", "1") != "0"


def _one_full_wave_of_1wg_pairs(M: int, N: int, tn: int, sm_count: int) -> bool:
    """Whether one-warpgroup blocks in clusters of 2 (an instance for token tile tn) fill one wave to >= 90%."""
    cfg = (tn, *GMMA_ONE_WG_CONFIG.get(tn, (0, 0, 0)), 2, 1)
    blocks = 2 * -(-N // GMMA_ROWS_PER_WARPGROUP) * -(-M // tn)
    return GMMA_ONE_WG and cfg in GMMA_INSTANCES and 0.9 * sm_count <= blocks <= sm_count


def gmma_plan(M: int, N: int, K: int, sm_count: int, splits: int | None = None, tn: int | None = None,
              ka: int | None = None, stages: int | None = None, rw: int | None = None, cs: int | None = None,
              cluster_slots=None, nwg: int | None = None):
    """(entry, grid, k_per_split, dynamic smem bytes) of linear_gmma; blocks are gmma_threads(nwg) threads.

    The K split: CS > 1 instances split K over a (1, CS, 1) cluster and reduce through distributed shared
    memory (grid y = CS); CS = 1 splits over grid y through the fp32 workspace (any count), or not at all.
    Unless forced (splits: a workspace split count; cs: a cluster size), the cost model picks among no split,
    cluster splits and workspace splits: per-SM bytes of W in the slowest wave, a fixed per-block cost, and
    for workspace splits the fp32 partials written and read back. tn/ka/stages/rw pick an instance.
    cluster_slots(cfg, smem): resident blocks of an instance's clusters (device_cluster_slots on a device);
    None: the estimate _cluster_slots. nwg: warpgroups per block (unforced: 3 where unsplit 192-row blocks fill
    one wave, or at the token tiles 136 / 192 fill their waves to 70%; 1 (in clusters of 2) where 64-row blocks
    fill one wave; else 2; forcing any of splits/cs/ka/stages/rw keeps 2 unless nwg says otherwise)."""
    op = "linear_gmma"
    tn = tn or token_tile(M)
    if nwg is None and splits is None and cs is None and ka is None and stages is None and rw is None:
        if _three_wg_unsplit(M, N, tn, sm_count):
            nwg, cs = GMMA_NWG_ONE_WAVE, 1  # unsplit (the cluster split of 2 measured slower: 55.3 us at M = 65)
        elif _one_full_wave_of_1wg_pairs(M, N, tn, sm_count):
            nwg, cs = 1, 2
    nwg = nwg or GMMA_NWG
    d_ka, d_st, d_rw = {3: _DEFAULT_CONFIG_3WG, 1: GMMA_ONE_WG_CONFIG}.get(nwg, _DEFAULT_CONFIG).get(tn, (1, 4, 1))
    ka, stages, rw = ka or d_ka, stages or d_st, rw or d_rw
    _need(splits is None or cs is None or cs == 1 or splits == cs, op,
          f"splits={splits} with cs={cs}: a cluster split has exactly cs splits")
    _need(nwg == GMMA_NWG or splits is None or splits == 1 or (cs or 1) > 1, op,
          f"nwg={nwg}: blocks of one or three warpgroups split K only inside a cluster (cs > 1), not through the "
          "workspace")
    atom_k = 64 * ka
    units = -(-K // atom_k)  # pipeline stages over the whole K
    rows = GMMA_ROWS_PER_WARPGROUP * nwg * rw
    row_blocks = -(-N // rows)
    z = -(-M // tn)
    bps = gmma_blocks_per_sm(tn, ka, stages, rw, nwg)
    if cs is None and splits is None:
        def est_us(c: int, s: int) -> float:
            per = -(-units // s)
            blocks = row_blocks * z * s
            if c == 1:
                slots = bps * sm_count
            elif cluster_slots is not None:
                slots = cluster_slots((tn, ka, stages, rw, c, nwg), gmma_smem_bytes(tn, ka, stages, rw, nwg))
            else:
                slots = _cluster_slots(c, bps, sm_count)
            waves = -(-blocks // slots)
            stream = per * atom_k * rows * 2 / GMMA_SM_BYTES_PER_US
            compute = 2 * rows * tn * per * atom_k / GMMA_SM_FLOP_PER_US
            t = max(waves * bps * (max(stream, compute) + GMMA_BLOCK_US), z * N * K * 2 / GMMA_HBM_BYTES_PER_US)
            if c == 1 and s > 1:
                t += 2.5 + 0.03 * M * s
            return t

        # The first candidate stands unless another is >= 2% faster. Up to two waves of unsplit blocks that
        # is a cluster split of 2 (the model ties the two where the HBM floor binds, and the split measured
        # faster: gate_up 24576x4096 at M = 72 59.5 vs 67.5 us, M = 64 57.8 vs 60.9, M = 16 equal); with
        # more waves, no split (lm_head 151936x4096 at M = 65: 332 vs 356 us). H200, 2026-12-03 (PERF.md).
        best = None
        clusters = [(c, c) for c in GMMA_CLUSTER_SIZES
                    if (tn, ka, stages, rw, c, nwg) in GMMA_INSTANCES and c <= units]
        few_waves = row_blocks * z <= 2 * bps * sm_count
        candidates = clusters + [(1, 1)] if few_waves else [(1, 1)] + clusters
        if nwg == GMMA_NWG and row_blocks * z * 2 < bps * sm_count // 3:  # workspace splits only where 2
            # splits would leave most SMs idle (and only with two warpgroups)
            candidates += [(1, s) for s in range(3, min(units, 64) + 1)]
        for c, s in candidates:
            if c == 1 and s > 1 and -(-units // -(-units // s)) != s:
                continue  # a count that leaves the last split short: another s covers it
            t = est_us(c, s)
            if best is None or t < 0.98 * best[0]:
                best = (t, c, s)
        _, cs, splits = best
    elif cs is None:
        cs = 1
    elif cs > 1:
        splits = cs
    cfg = (tn, ka, stages, rw, cs, nwg)
    _need(cfg in GMMA_INSTANCES, op, f"no instance <TN, KA, STAGES, RW, CS, NWG> = <{', '.join(map(str, cfg))}>; "
          f"built: {sorted(GMMA_INSTANCES)}")
    if cs > 1:
        per = -(-units // cs)  # trailing splits may get no k at all (they add zeros)
    else:
        per = -(-units // max(1, min(int(splits or 1), units)))
        splits = -(-units // per)
    smem = gmma_smem_bytes(tn, ka, stages, rw, nwg)
    _need(smem <= SMEM_PER_BLOCK_MAX, op, f"{cfg} needs {smem} bytes of shared memory")
    return gmma_entry(cfg), (row_blocks, splits, z), per * atom_k, smem


# Narrow row blocks (cutlass_kernels/dense_linear_narrow_sm90.cu, families NARROW_FAMILIES): W as wgmma's B
# operand, NW rows per block (any multiple of 16), x's <= 80 rows as its A side from registers (one warpgroup per
# 64 rows), so the op that makes x (rmsnorm (+ residual add), SwiGLU) can be fused into its x tile.
# NW is the smallest instance whose unsplit blocks fit one wave, taken where they fill it to >= 90%: Qwen3-8B qkv
# 6144 / 48, o and down 4096 / 32, gate_up 24576 / 192: 128 blocks each on the H200's 132 SMs, where
# linear_gmma_kernel's 64- and 128-row blocks leave 36..68 SMs idle at qkv, o and down (or split K in clusters).
# runtime.dense_kernels.linear takes it wherever narrow_plan has a plan and linear_gmma_kernel's leaves SMs idle
# (NARROW_GMMA_IDLE). H100, 2026-12-05 (25), per op (graph of rotating weights): qkv M = 1 17.8 vs 19.8 us, M = 17
# 20.2 vs 20.6; o 12.7 vs 14.0, 13.6 vs 14.7; down 35.0 vs 36.1, 36.2 vs 37.3; the 12-layer Qwen3-8B step (bench_ar):
# AR 2306 vs 2320 us, verify b16 / b32 / b64 2435 / 2541 / 2712 vs 2422 / 2536 / 2713 (equal within noise).
# But on the H200 (session 29, per op at M = 1) linear_gmma_kernel was the faster: qkv 14.57 vs 16.16 us, o 10.34
# vs 11.82, down 25.89 vs 28.47: so the plain hand-off is kept to devices like the H100 (NARROW_MAX_BYTES_PER_SM).
# DDTREE_GMMA_NARROW=0: off.
GMMA_NARROW = os.environ.get("DDTREE_GMMA_NARROW", "1") != "0"
NARROW_FILL = 0.9
# Every narrow block reads all of x (and x2 with a prologue) for only NW rows of W: from L2, every block the same
# lines at once. The plan takes it only while a block's x rows stay within NARROW_X_PER_W times its W rows
# (M * tiles <= NARROW_X_PER_W * NW). H100, 2026-12-05 (25), Qwen3-8B, narrow vs linear_gmma_kernel's plan: qkv
# (NW 48) M = 17 20.2 vs 20.6 us, M = 33 22.6 vs 21.3; o (NW 32) M = 17 13.6 vs 14.7, M = 33 17.9 vs 14.8; down
# M = 17 36.2 vs 37.3, M = 33 48.1 vs 38.4: wins up to x / W = 0.53, loses from 0.69.
NARROW_X_PER_W = 0.6
# A plain linear goes to the narrow kernel only where linear_gmma_kernel's plan runs fewer blocks than this share of
# the SMs (qkv, o, down: 96 of 132): gate_up's 128 blocks of 192 rows measured 70.2 vs 71.6 us at M = 1 and
# 72.7 vs 73.9 at M = 17 against the narrow kernel's (H100, 2026-12-05 (25)).
NARROW_GMMA_IDLE = 0.9
# ... and only on devices whose peak memory rate per SM is at most this (bytes/s; None: any device). The narrow
# kernel's stages are small (12-16 KB of W), and where each SM's share of the read is high they turn over too fast
# for its pipeline. Per op at M = 1, narrow vs linear_gmma_kernel's plan, us: H100 (3.35 TB/s peak, 25.4 GB/s per
# SM; 2026-12-05 (25)) qkv 17.8 vs 19.8, o 12.7 vs 14.0, down 35.0 vs 36.1; H200 (4.9 TB/s, 37 GB/s per SM; (29))
# qkv 16.16 vs 14.57, o 11.82 vs 10.34, down 28.47 vs 25.89, and (31) Kimi's shared gate_up (4096 x 7168) at M = 1 /
# 8 18.09 / 18.22 vs 15.73 / 15.99.
NARROW_MAX_BYTES_PER_SM = 30e9
# Past that limit, clusters of NARROW_MC_CS row blocks that read x once per cluster (linear_gmma_narrow_mc_kernel,
# multicast bulk copies), while M * tiles <= NARROW_X_PER_W * NW * NARROW_MC_CS. Off (DDTREE_NARROW_MC=1: on): H100,
# 2026-12-05 (25), slower than the one-block kernel and than linear_gmma_kernel: qkv M = 1 19.5 vs 17.9 us, M = 33
# 31.4 vs 22.8 (linear_gmma_kernel 21.3); o M = 33 39.4 vs 19.3 (14.8); verify b32 of the 12-layer step 2660 vs
# 2539 us. (Its first version, whose cross-block arrivals released at cluster scope = MEMBAR.ALL.GPU, was 2-2.5x
# slower still.)
NARROW_MC = os.environ.get("DDTREE_NARROW_MC", "0") == "1"
# DDTREE_NARROW_FUSE=1: the narrow kernel also takes rmsnorm / SwiGLU into its x load wherever it takes the linear.
# Off: H100, 2026-12-05 (25), fused against the two launches, qkv (rmsnorm + residual) M = 1 24.5 vs 20.8 us, M = 17
# 41.5 vs 23.2, M = 33 75 vs 26; down (SwiGLU) M = 17 107 vs 40; gate_up even only up to 17 rows (73.1 vs 73.6 at
# M = 1, 109 vs 82 at 65); the AR step 2358 vs 2299 us with it. The cost grows with the rows rewritten per stage,
# with the rewrite ahead of the MMAs or not (bench_dense --fused).
NARROW_FUSE = os.environ.get("DDTREE_NARROW_FUSE", "0") == "1"
_NARROW_CONFIG = {(c[0], c[1], c[4], 1): c for c in NARROW_GMMA_INSTANCES}  # (NW, TX, XMODE, CS) -> instance
_NARROW_CONFIG.update({(c[0], c[1], c[4], c[5]): c for c in NARROW_MC_INSTANCES})
_NARROW_CONFIG_OF_ENTRY = {narrow_entry(c): c for c in _NARROW_CONFIG.values()}
_NARROW_FAMILY_OF_XMODE = {NARROW_XMODES[p]: family for p, family in NARROW_FAMILIES.items()}


def narrow_threads(tx: int) -> int:
    """Threads of linear_gmma_narrow_kernel<*, tx, ...>: a warpgroup per 64 token rows."""
    return 128 * -(-tx // 64)


def gmma_narrow_config(entry: str) -> tuple:
    """(NW, TX, KA, STAGES, XMODE) of a built linear_gmma_narrow_kernel instance name, (.., CS) of a
    linear_gmma_narrow_mc_kernel one (registry.narrow_entry's inverse)."""
    return _NARROW_CONFIG_OF_ENTRY[entry]


def narrow_smem_bytes(nw: int, tx: int, ka: int, stages: int, xmode: int = 0, cs: int = 1) -> int:
    """Dynamic shared memory of linear_gmma_narrow_kernel<nw, tx, ka, stages, xmode> (or the _mc_ kernel's with
    cs): the stages (registry.narrow_stage_bytes) plus 1 KB to align."""
    return 1024 + stages * narrow_stage_bytes(nw, tx, ka, xmode, cs)


def narrow_plan(M: int, N: int, K: int, sm_count: int, nw: int | None = None, prologue: str = "none",
                cs: int | None = None):
    """(entry, grid, dynamic smem bytes) of linear_gmma_narrow for [M, K] x [N, K]^T with `prologue` fused into the
    x load, or None where it has no plan (M over the largest token tile; no NW whose unsplit blocks fill one wave
    to NARROW_FILL; more x than NARROW_X_PER_W allows, in clusters of NARROW_MC_CS where NARROW_MC). nw forces the
    row block (any built NW; M over the largest token tile then walks tiles of it on blockIdx.z), cs the cluster
    (1, or NARROW_MC_CS for the kernel that shares x; forced, the x limit is not applied)."""
    op = "linear_gmma_narrow"
    _need(prologue in NARROW_XMODES, op, f"prologue {prologue!r}: one of {', '.join(NARROW_XMODES)}")
    _need(cs in (None, 1, NARROW_MC_CS), op, f"cs = {cs}: 1 or {NARROW_MC_CS} (blocks sharing x)")
    tx = next((t for t in NARROW_GMMA_TOKEN_TILES if M <= t), None)
    if nw is None:
        if tx is None:
            return None
        nw = next((r for r in NARROW_GMMA_ROWS if -(-N // r) <= sm_count), None)
        if nw is None or -(-N // nw) < NARROW_FILL * sm_count:
            return None
        x_rows = M * (1 if prologue == "none" else 2)
        if cs is None:
            cs = 1 if x_rows <= NARROW_X_PER_W * nw else (
                NARROW_MC_CS if NARROW_MC and x_rows <= NARROW_X_PER_W * nw * NARROW_MC_CS else None)
            if cs is None or (nw, tx, NARROW_XMODES[prologue], cs) not in _NARROW_CONFIG:
                return None
    cs = cs or 1
    tx = tx or NARROW_GMMA_TOKEN_TILES[-1]
    key = (nw, tx, NARROW_XMODES[prologue], cs)
    _need(key in _NARROW_CONFIG, op, f"no instance with NW = {nw} W rows per block" + (
        f" in clusters of {cs}" if cs > 1 else "") + f"; built: {sorted({k[0] for k in _NARROW_CONFIG if k[3] == cs})}")
    # Each block of a cluster copies every cs-th x row of a token tile, so each must have a row to copy: a block
    # without one never writes into the others' tiles, and its empty barrier (which also gates its own W refills)
    # could then take a warp's arrival for stage s + STAGES before another warp's for stage s.
    tail = (M - 1) % tx + 1   # rows in the last token tile
    _need(cs == 1 or tail >= cs, op, f"M = {M} leaves {tail} token row(s) in the last tile of {tx}: clusters of {cs} "
          f"need >= {cs} (every block copies x rows)")
    cfg = _NARROW_CONFIG[key]
    blocks = -(-N // nw)
    return narrow_entry(cfg), (-(-blocks // cs) * cs, 1, -(-M // tx)), narrow_smem_bytes(*cfg)


def narrow_fused_plan(M: int, N: int, K: int, prologue: str):
    """The narrow_plan runtime.dense_kernels.linear runs this linear with `prologue` on (GMMA_NARROW and NARROW_FUSE
    on, the GMMA kernels take the shape, narrow_plan has a plan), else None."""
    if not (GMMA_NARROW and NARROW_FUSE and prologue in NARROW_XMODES and gmma_wanted(M, N, K)):
        return None
    return narrow_plan(M, N, K, get_device().sm_count, prologue=prologue)


def narrow_fuses(M: int, N: int, K: int, prologue: str) -> bool:
    """Whether runtime.dense_kernels.linear fuses `prologue` into this linear on the narrow-row kernel."""
    return narrow_fused_plan(M, N, K, prologue) is not None


def launch_narrow(x: DeviceArray, w: DeviceArray, out: DeviceArray, residual: DeviceArray | None, M: int, N: int,
                  K: int, ldx: int, ldo: int, ldr: int | None, plan, stream=None, *, x2: DeviceArray | None = None,
                  ldx2: int | None = None, norm_weight: DeviceArray | None = None, eps: float = 1e-6,
                  sum_out: DeviceArray | None = None, ldsum: int | None = None):
    """linear_gmma_narrow_kernel with a plan of narrow_plan (its instance names the prologue), after
    runtime.dense_kernels.linear_checks and prologue_checks."""
    entry, grid, smem = plan
    null = np.uint64(0)
    cfg = gmma_narrow_config(entry)
    kern = get_kernel(NARROW_MC_FAMILY if len(cfg) == 6 else _NARROW_FAMILY_OF_XMODE[cfg[4]], entry)
    kern.set_max_dynamic_smem(smem)
    kern.launch(grid, narrow_threads(cfg[1]),
                [x, _i32(ldx), x2 if x2 is not None else null, _i32(ldx2 or 0),
                 norm_weight if norm_weight is not None else null, np.float32(eps),
                 sum_out if sum_out is not None else null, _i32(ldsum or 0),
                 w, out, _i32(ldo), residual if residual is not None else null,
                 _i32(ldr or 0), _i32(M), _i32(N), _i32(K)], smem=smem, stream=stream)
    return out


def _need_gmma_device(op: str):
    """The current device, after a clear error unless the GMMA kernels are built for its arch."""
    dev = get_device()
    _need(gmma_available(dev.arch), op, f"the GMMA kernel is built for {GMMA_ARCHS}, this device is sm_{dev.arch}")
    return dev


def linear_gmma(x: DeviceArray, w: DeviceArray, out: DeviceArray, residual: DeviceArray | None = None, *,
                ldx: int | None = None, ldo: int | None = None, ldr: int | None = None,
                ws: Workspace | None = None, splits: int | None = None, tn: int | None = None,
                ka: int | None = None, stages: int | None = None, rw: int | None = None,
                cs: int | None = None, nwg: int | None = None, nw: int | str | None = None,
                prologue: str = "none", x2: DeviceArray | None = None, ldx2: int | None = None,
                norm_weight: DeviceArray | None = None, eps: float = 1e-6, sum_out: DeviceArray | None = None,
                ldsum: int | None = None, stream=None) -> DeviceArray:
    """out[M, N] = x[M, K] @ w[N, K]^T (+ residual[M, N]), bf16, fp32 accumulation, on sm_90a GMMA.
    Same contract as runtime.dense_kernels.linear; splits/tn/ka/stages/rw/cs/nwg override the plan; nw runs the
    narrow-row kernel instead (an int: that many W rows per block; "auto": narrow_plan's; with it cs is the cluster
    of row blocks sharing x), which also takes prologue / x2 / norm_weight / eps / sum_out as dense_kernels.linear
    does."""
    from runtime.dense_kernels import prologue_checks
    M, N, K, ldx, ldo, ldr = linear_checks("linear_gmma", x, w, out, residual, ldx, ldo, ldr)
    ldx2, ldsum = prologue_checks("linear_gmma", prologue, M, K, x2, ldx2, norm_weight, sum_out, ldsum)
    if prologue != "none" or nw is not None:
        _need_gmma_device("linear_gmma")
        _need(nw is not None, "linear_gmma", "a fused prologue needs the narrow-row kernel (nw)")
        _need((splits, tn, ka, stages, rw, nwg) == (None,) * 6, "linear_gmma",
              "nw (the narrow-row kernel) takes none of splits/tn/ka/stages/rw/nwg")
        plan = narrow_plan(M, N, K, get_device().sm_count, None if nw == "auto" else int(nw), prologue, cs)
        _need(plan is not None, "linear_gmma", f"no narrow-row plan for M={M} N={N} on {get_device().sm_count} SMs")
        return launch_narrow(x, w, out, residual, M, N, K, ldx, ldo, ldr, plan, stream=stream, x2=x2, ldx2=ldx2,
                             norm_weight=norm_weight, eps=eps, sum_out=sum_out, ldsum=ldsum)
    return launch_gmma(x, w, out, residual, M, N, K, ldx, ldo, ldr, ws=ws, splits=splits, tn=tn, ka=ka,
                       stages=stages, rw=rw, cs=cs, nwg=nwg, stream=stream)


def narrow_instead(M: int, N: int, K: int, sm_count: int, gmma_grid: tuple, mem_bytes_per_s: float = 0.0):
    """The narrow_plan an unforced linear_gmma runs instead of linear_gmma_kernel's plan (whose grid is gmma_grid):
    with GMMA_NARROW, where that plan leaves SMs idle (NARROW_GMMA_IDLE), the device's peak memory rate
    (mem_bytes_per_s; 0: unknown, taken as low) per SM is at most NARROW_MAX_BYTES_PER_SM, and narrow_plan has one;
    else None."""
    if not GMMA_NARROW or gmma_grid[0] * gmma_grid[1] * gmma_grid[2] >= NARROW_GMMA_IDLE * sm_count:
        return None
    if NARROW_MAX_BYTES_PER_SM is not None and mem_bytes_per_s / sm_count > NARROW_MAX_BYTES_PER_SM:
        return None
    return narrow_plan(M, N, K, sm_count)


def launch_gmma(x: DeviceArray, w: DeviceArray, out: DeviceArray, residual: DeviceArray | None, M: int, N: int,
                K: int, ldx: int, ldo: int, ldr: int | None, *, ws: Workspace | None = None,
                splits: int | None = None, tn: int | None = None, ka: int | None = None,
                stages: int | None = None, rw: int | None = None, cs: int | None = None, nwg: int | None = None,
                stream=None):
    """linear_gmma after runtime.dense_kernels.linear_checks (which dense_kernels.linear has already run); with
    GMMA_NARROW and no forced plan, the narrow-row kernel wherever narrow_plan has a plan and this one leaves SMs
    idle (NARROW_GMMA_IDLE)."""
    dev = _need_gmma_device("linear_gmma")
    entry, grid, k_per_split, smem = gmma_plan(M, N, K, dev.sm_count, splits, tn, ka, stages, rw, cs,
                                               cluster_slots=device_cluster_slots, nwg=nwg)
    if (splits, tn, ka, stages, rw, cs, nwg) == (None,) * 7:
        plan = narrow_instead(M, N, K, dev.sm_count, grid, dev.mem_peak_bytes_per_s)
        if plan is not None:
            return launch_narrow(x, w, out, residual, M, N, K, ldx, ldo, ldr, plan, stream=stream)
    cfg = gmma_config(entry)
    ws = ws or default_workspace()
    if grid[1] > 1 and cfg[4] == 1:  # workspace split-K (cluster splits reduce in smem)
        scratch = ws.scratch(grid[1] * M * N * 4)
        tickets = ws.tickets(grid[0] * grid[2])
    else:
        scratch = tickets = out  # unused by the kernel
    push_smem = gmma_push_smem_bytes(*cfg) if cfg[0] <= GMMA_PUSH_MAX_TN else None
    family = FAMILY_PUSH if push_smem else FAMILY
    smem = push_smem or smem
    kern = get_kernel(family, entry)
    kern.set_max_dynamic_smem(smem)
    kern.launch(grid, gmma_threads(cfg[5]),
                [x, _i32(ldx), w, out, _i32(ldo), residual if residual is not None else np.uint64(0),
                 _i32(ldr or 0), scratch, tickets, _i32(M), _i32(N), _i32(K), _i32(k_per_split)],
                smem=smem, stream=stream)
    return out
