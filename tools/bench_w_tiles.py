"""The GMMA linear's weight loads without its MMAs (issue 6): what its load pattern reaches alone, by grid size and
load path, in single launches and in PDL chains, and where the kernel's own time goes beside it.

linear_gmma_kernel leaves SMs idle at Qwen3-8B's qkv / o / down for 17..72 rows (96 of 132 blocks at qkv), and a
stream-K plan over all SMs lost (session 28). runtime_probe_sm90's read_w_tiles_kernel<LOAD, STAGES, PIECE> reads
what the linear's blocks read (32 KB stages of 32 KB / PIECE rows x PIECE bytes: the linear's are 128 x 256;
STAGES in flight, one block per SM), by LOAD 0 = per-thread 16-byte cp.async (today's kernels), 1 = one bulk copy
per row piece, 2 = one bulk copy per stage (a W repacked so that every stage's tile is contiguous).

Prints, per shape: the streaming read of the same bytes (read_sum_kernel, best grid) and of the same bytes by G
one-block SMs (read_sum_deep_kernel<8>), then (LOAD, STAGES, PIECE, G) as us of one launch, then PDL chains in a
graph (us per link, each link the next region: read_sum_pdl_kernel and read_w_tiles_kernel<LOAD, 4, 256, 1>), and
linear_gmma_kernel at --bisect-m rows in the same chain, whole (also with GMMA_PUSH's epilogue) and without its MMAs
and / or epilogue (GMMA_BISECT),
all as % of the streaming read of the whole buffer (>= 2 GiB) in the same run. Each launch reads a different region
of a buffer far above L2, as a model's layers do.

    python -m tools.bench_w_tiles [--iters 20] [--ops qkv o down] [--bisect-m 17 33 65] [--trace-m 33]
"""
from __future__ import annotations

import argparse
import itertools

import numpy as np

from cutlass_kernels.registry import TRACE_CONFIGS, TRACE_WORDS, W_TILES_CONFIGS, W_TILES_PDL_LOADS
from tools.bench_dense import graph_time_us
from tools.read_bandwidth import read_time_by_blocks, read_time_us

# Qwen3-8B (name, N rows, K): W is [N, K] bf16
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 12288), "gate_up": (24576, 4096)}
LOADS = {0: "cp.async 16 B / thread", 1: "bulk copy / row piece", 2: "bulk copy / stage"}
STAGE_BYTES, TILE_ROWS = 32768, 128  # the G columns follow linear_gmma_kernel's 128-row tiles


def block_counts(tiles: int, sm_count: int) -> list[int]:
    """One block per tile up to one per SM: the plain partition (tiles), the cluster-of-2 K split (2 x tiles),
    more K splits while they fit, and every SM."""
    gs = [tiles * s for s in (1, 2, 3, 4) if tiles * s <= sm_count]
    return gs + ([sm_count] if sm_count not in gs else [])


def family_smem(family: str, entry: str, smem: int) -> int:
    """The dynamic shared memory an instance of `family` takes: the plan's, or, built with GMMA_PUSH, the larger one
    of its receive region where that fits."""
    from cutlass_kernels.registry import FAMILIES
    from runtime import dense_gmma as dg
    push = "-DGMMA_PUSH=1" in FAMILIES[family].options
    return (dg.gmma_push_smem_bytes(*dg.gmma_config(entry)) or smem) if push else smem


def gmma_link(kern, entry: str, grid: tuple, smem: int, x, w, out, ws, m: int, n: int, k: int, k_per_split: int,
              stream) -> None:
    """One launch of linear_gmma_kernel `entry` (x [m, k] @ w^T into out, no residual; `ws` its workspace argument:
    the trace families' stamps, else unused) as a link of a bisect / trace chain."""
    from runtime import dense_gmma as dg
    kern.launch(grid, dg.gmma_threads(dg.gmma_config(entry)[5]), [
        x, np.int32(k), w, out, np.int32(n), np.uint64(0), np.int32(0), ws, out, np.int32(m), np.int32(n),
        np.int32(k), np.int32(k_per_split)], smem=smem, stream=stream)


def bisect_rows(n: int, k: int, m: int, rs, reps: int, gs: list[int], pct, stream):
    """linear_gmma_kernel at M = m as the runtime plans it, in the same PDL chain: whole, then without its MMAs, its
    epilogue, or both (families dense_linear_sm90_bisect1..3), and with the push epilogue (dense_linear_sm90_push),
    each in the G column of its grid."""
    from runtime import cuda
    from runtime import dense_gmma as dg
    dev = cuda.get_device()
    entry, grid, k_per_split, smem = dg.gmma_plan(m, n, k, dev.sm_count, cluster_slots=dg.device_cluster_slots)
    if dg.gmma_config(entry)[4] == 1 and grid[1] > 1:
        print(f"| PDL chain (graph): {entry} M = {m} | n/a: a workspace split (the bisect is for cluster plans) |")
        return
    x = cuda.to_device(np.full((m, k), 0x3F80, np.uint16))  # bf16 1.0: MMAs on real numbers
    out = cuda.empty((m, n), np.uint16)
    blocks = grid[0] * grid[1] * grid[2]
    labels = {"dense_linear_sm90": "whole",
              "dense_linear_sm90_push": "whole, partials exchanged by st.async (GMMA_PUSH)",
              "dense_linear_sm90_bisect1": "no MMAs",
              "dense_linear_sm90_bisect2": "no epilogue", "dense_linear_sm90_bisect3": "no MMAs, no epilogue"}
    for family, label in labels.items():
        try:
            kern = cuda.get_kernel(family, entry)
        except KeyError:
            print(f"| PDL chain (graph): {entry} M = {m}, {label} | n/a: no such entry in {family} |")
            continue
        fsmem = family_smem(family, entry, smem)
        kern.set_max_dynamic_smem(fsmem)
        us = graph_time_us(lambda i, st: gmma_link(kern, entry, grid, fsmem, x, rs[i % len(rs)], out, out, m, n, k,
                                                   k_per_split, st), reps=reps, stream=stream)
        cells = [f"{us:.2f} ({pct(n * k * 2, us):.1f}%)" if g == blocks else "" for g in gs]
        if blocks not in gs:
            cells[-1] = f"G = {blocks}: {us:.2f} ({pct(n * k * 2, us):.1f}%)"
        print(f"| PDL chain (graph): {entry.replace('linear_gmma_kernel', 'gmma')} M = {m}, {label} | - | - | "
              + " | ".join(cells) + " |", flush=True)


def epilogue_segments(last) -> str:
    """Medians over links of the last-exiting block's epilogue: its loop end -> its cluster's last loop end (the
    wait for the partner's partial that no epilogue can shorten), then from one stamp to the next of loop end,
    partials in hand, staged, stores issued, exit (us; a stamp its path does not write is left out), and how often
    it was cluster rank 0."""
    ranks = [r for r, *_ in last]
    segs: dict[str, list] = {"loop end -> cluster's last loop end": []}
    for _, t2, t5, t8, t6, t3, t2_cluster in last:
        segs["loop end -> cluster's last loop end"].append((t2_cluster - t2) / 1e3)
        marks = [(label, v) for label, v in (("loop end", t2), ("partials in hand", t5), ("staged", t8),
                                             ("stores issued", t6), ("exit", t3)) if v]  # 0: no such stamp
        for (a, ta), (b, tb) in zip(marks, marks[1:]):
            segs.setdefault(f"{a} -> {b}", []).append((tb - ta) / 1e3)
    parts = [f"{name} {np.median(v):.2f}" for name, v in segs.items()]
    return ", ".join(parts) + f" (rank 0 in {ranks.count(0)} of {len(ranks)} links)"


def link_stats(stamps: np.ndarray, grid: tuple = (1, 1, 1)):
    """From GMMA_TRACE's stamps [links, blocks, TRACE_WORDS] (ns) of a launch of `grid` (clusters of (1, grid[1], 1)
    blocks when the cluster splits K): per link after the first two, relative to the previous link's last exit (us):
    link time, blocks entered before it, first / last entry, first / last wait release, median loop, last loop end,
    median / max epilogue, last exit after the last loop end; their medians over the links, and per link the last
    block out's (cluster rank, loop end, stamps 5, 8 and 6, exit, its cluster's last loop end)."""
    t = stamps[:, :, :4].astype(np.int64)
    gx, gy = grid[0], grid[1]
    rows, last = [], []
    for j in range(2, len(t)):
        prev = t[j - 1, :, 3].max()
        tj = (t[j] - prev) / 1e3
        rows.append([(t[j, :, 3].max() - prev) / 1e3, (t[j, :, 0] < prev).sum(), tj[:, 0].min(), tj[:, 0].max(),
                     tj[:, 1].min(), tj[:, 1].max(), np.median(tj[:, 2] - tj[:, 1]), tj[:, 2].max(),
                     np.median(tj[:, 3] - tj[:, 2]), (tj[:, 3] - tj[:, 2]).max(), tj[:, 3].max() - tj[:, 2].max()])
        b = int(np.argmax(t[j, :, 3]))  # the link's last block out: its epilogue, segment by segment
        x, z = b % gx, b // (gx * gy)
        cluster = [x + gx * (y + gy * z) for y in range(gy)]  # block id is x-fastest, then y, then z
        last.append((int(stamps[j, b, 7]), int(t[j, b, 2]), int(stamps[j, b, 5]), int(stamps[j, b, 8]),
                     int(stamps[j, b, 6]), int(t[j, b, 3]), int(t[j, cluster, 2].max())))
    return np.median(np.array(rows, dtype=np.float64), axis=0), last


def trace_rows(n: int, k: int, m: int, rs, reps: int, stream):
    """linear_gmma_kernel at M = m (its plan) with per-block %globaltimer stamps (families TRACE_FAMILIES), in a PDL
    chain of `reps` launches in a graph, each link the next W region: where each link's time goes, relative to the
    previous link's last block exit (prev), medians over the links after the first two."""
    from runtime import cuda
    from runtime import dense_gmma as dg
    dev = cuda.get_device()
    entry, grid, k_per_split, smem = dg.gmma_plan(m, n, k, dev.sm_count, cluster_slots=dg.device_cluster_slots)
    if dg.gmma_config(entry) not in TRACE_CONFIGS:
        print(f"(trace: {entry} at M = {m} has no trace instance; TRACE_CONFIGS: {TRACE_CONFIGS})")
        return
    blocks = grid[0] * grid[1] * grid[2]
    x = cuda.to_device(np.full((m, k), 0x3F80, np.uint16))
    out = cuda.empty((m, n), np.uint16)
    words = blocks * TRACE_WORDS
    trace = cuda.empty((reps * words,), np.uint64)
    print(f"\n### trace: {entry.replace('linear_gmma_kernel', 'gmma')}, M = {m}, {blocks} blocks, chain of {reps}; us "
          "from the previous link's last exit (prev), medians over links 3..")
    print("| epilogue | link | blocks in before prev | first entry | last entry | wait released (first / last) | "
          "loop (median block) | last loop end | epilogue (median / max block) | last exit after last loop end |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for family, label in (("dense_linear_sm90_trace", "DSMEM"), ("dense_linear_sm90_trace_push", "push"),
                          ("dense_linear_sm90_trace_noepi", "none (bisect)")):
        kern = cuda.get_kernel(family, entry)
        fsmem = family_smem(family, entry, smem)
        kern.set_max_dynamic_smem(fsmem)
        graph_time_us(lambda i, st: gmma_link(kern, entry, grid, fsmem, x, rs[i % len(rs)], out,
                                              trace.view(i * words, (words,)), m, n, k, k_per_split, st),
                      reps=reps, stream=stream, iters=3)
        stream.synchronize()
        stamps = trace.download().reshape(reps, blocks, TRACE_WORDS)
        r, last = link_stats(stamps, grid)
        print(f"| {label} | {r[0]:.2f} | {r[1]:.0f} of {blocks} | {r[2]:.2f} | {r[3]:.2f} | {r[4]:.2f} / {r[5]:.2f} | "
              f"{r[6]:.2f} | {r[7]:.2f} | {r[8]:.2f} / {r[9]:.2f} | {r[10]:.2f} |", flush=True)
        print(f"|   last block out: {epilogue_segments(last)} |")
    steps = np.diff(np.unique(stamps[:, :, :4].astype(np.int64)))
    print(f"(%globaltimer step seen: {steps[steps > 0].min() if (steps > 0).any() else 0} ns)")


def main(argv=None):
    from runtime import cuda
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--ops", nargs="+", choices=sorted(SHAPES), default=["qkv", "o", "down"])
    ap.add_argument("--bisect-m", type=int, nargs="*", default=[33], help="also time linear_gmma_kernel at these M in "
                    "the PDL chain, whole and bisected (no MMAs / no epilogue; none given: not)")
    ap.add_argument("--trace-m", type=int, nargs="*", default=[], help="also trace linear_gmma_kernel's blocks at these "
                    "M in the PDL chain (per-block timer stamps: entry, dependency wait, loop end, exit)")
    args = ap.parse_args(argv)
    dev = cuda.get_device()
    if dev.arch != "90a":
        raise SystemExit(f"bench_w_tiles needs sm_90a (bulk copies into the GMMA ring layout); this is sm_{dev.arch}")
    print(f"# {dev.name}, sm_{dev.arch}, {dev.sm_count} SMs")
    region_max = max(n * k * 2 for n, k in (SHAPES[o] for o in args.ops))
    regions = max(2, -(-(2 << 30) // region_max))  # >= 2 GiB cycled: no L2 reuse between timed launches
    buf = cuda.empty((regions * region_max // 4,), np.uint32).fill_bytes(0x5A)
    sink = cuda.empty((4,), np.uint32)
    stream = cuda.Stream()

    def region(r: int, nbytes: int):
        return buf.view(r * region_max // 4, (nbytes // 4,))

    read_bw = buf.nbytes / (read_time_us([buf], iters=args.iters)[0] * 1e-6)
    print(f"streaming read of {buf.nbytes / 2**30:.2f} GiB: {read_bw / 1e12:.3f} TB/s (the 100% below)")

    def pct(nbytes: int, us: float) -> float:
        return 100 * nbytes / (us * 1e-6) / read_bw

    def single_us(kern, stages: int, g: int, rs, n: int, k: int) -> float:
        """Median us of one launch on G blocks, each launch reading the next region."""
        smem = stages * STAGE_BYTES + 1024
        kern.set_max_dynamic_smem(smem)
        launches = itertools.cycle([kern.prepare((g,), (256,), [r, np.int32(n), np.int32(2 * k), sink], smem)
                                    for r in rs])
        return cuda.bench(lambda: next(launches)(stream), warmup=3, iters=args.iters, stream=stream) * 1e3

    for op in args.ops:
        n, k = SHAPES[op]
        nbytes = n * k * 2
        rs = [region(r, nbytes) for r in range(regions)]
        tiles = n // TILE_ROWS
        gs = block_counts(tiles, dev.sm_count)
        same = read_time_us(rs, iters=args.iters)[0]
        print(f"\n## {op}: W {n} x {k} bf16, {nbytes / 1e6:.1f} MB, {tiles} tiles of {TILE_ROWS} rows")
        print(f"streaming read of the same bytes: {same:.2f} us ({pct(nbytes, same):.1f}%)")
        by_sms = read_time_by_blocks(rs, gs, iters=args.iters)
        print("| load | stages | rows x piece | " + " | ".join(f"G = {g}" for g in gs) + " |")
        print("|---|---|---|" + "---|" * len(gs))
        print("| read_sum_deep<8>, 1024 threads | - | - | " + " | ".join(
            f"{us:.2f} ({pct(nbytes, us):.1f}%)" for us in by_sms) + " |")
        for load, stages, piece in W_TILES_CONFIGS:
            kern = cuda.get_kernel("runtime_probe_sm90", f"read_w_tiles_kernel<{load}, {stages}, {piece}>")
            cells = [f"{us:.2f} ({pct(nbytes, us):.1f}%)" for us in
                     (single_us(kern, stages, g, rs, n, k) for g in gs)]
            print(f"| {LOADS[load]} | {stages} | {STAGE_BYTES // piece} x {piece} | " + " | ".join(cells) + " |",
                  flush=True)
        # chains: what a launch costs when each starts under the previous one's tail (a model's step)
        reps = max(8, len(rs))
        probe = cuda.get_kernel("runtime_probe_pdl", "read_sum_pdl_kernel")
        us = graph_time_us(lambda i, st: probe.launch(4 * dev.sm_count, 512, [rs[i % len(rs)],
                                                                                np.int64(nbytes // 16), sink],
                                                      stream=st), reps=reps, stream=stream)
        cells = [f"{us:.2f} ({pct(nbytes, us):.1f}%)"] * len(gs)
        print("| PDL chain (graph): read_sum_pdl, best grid | - | - | " + " | ".join(cells) + " |")
        for load in W_TILES_PDL_LOADS:
            kern = cuda.get_kernel("runtime_probe_sm90_pdl", f"read_w_tiles_kernel<{load}, 4, 256, 1>")
            kern.set_max_dynamic_smem(4 * STAGE_BYTES + 1024)
            cells = []
            for g in gs:
                us = graph_time_us(lambda i, st: kern.launch((g,), (256,), [rs[i % len(rs)], np.int32(n),
                                                                            np.int32(2 * k), sink],
                                                             smem=4 * STAGE_BYTES + 1024, stream=st),
                                   reps=reps, stream=stream)
                cells.append(f"{us:.2f} ({pct(nbytes, us):.1f}%)")
            print(f"| PDL chain (graph): {LOADS[load]} | 4 | 128 x 256 | " + " | ".join(cells) + " |", flush=True)
        for m in args.bisect_m:
            bisect_rows(n, k, m, rs, reps, gs, pct, stream)
        for m in args.trace_m:
            trace_rows(n, k, m, rs, reps, stream)

if __name__ == "__main__":
    main()
