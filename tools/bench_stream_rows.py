"""The MoE weight stream's access pattern without its arithmetic: how much of the read bandwidth the grid
shapes of moe_w4a16_kernel can reach at all (issue 7: the small-T layer is at 55-80%).

runtime_probe's stream_rows_kernel<DEPTH, HINT>: every warp streams two rows of 512-byte units, 2 KB per row
per step, DEPTH steps in flight (the MoE kernels keep 1-2), as the GEMMs read their two row blocks; HINT adds
the L2::256B prefetch hint of moe_int4.cu's loads; the step-major layout interleaves the rows at 2 KB instead of
keeping each row contiguous (the repacked weight layout). Shapes are the MoE grids under uniform routing:
T = 1 gate_up (8 experts x 2 x 128 row blocks of 112 units, 1024 warps), T = 1 down (8 x 448 rows of 32
units, 1792 warps), and T = 64 gate_up (284 experts). Each launch reads a different region of a buffer far
larger than L2 (no reuse between timed launches), as the layer's weights do.

Prints per shape: the streaming read of the same bytes (runtime_probe read_sum_kernel), then every
(DEPTH, HINT, layout, warps per block) as us and % of the 4 GiB streaming read measured in the same run.

    python -m tools.bench_stream_rows [--iters 20]
"""
from __future__ import annotations

import argparse
import itertools

import numpy as np

from tools.read_bandwidth import read_time_us

# (label, rows, 512-byte units per row)
SHAPES = [("T=1 gate_up", 8 * 2 * 128, 112), ("T=1 down", 8 * 448, 32), ("T=64 gate_up", 284 * 2 * 128, 112)]
DEPTHS = (1, 2, 3, 4, 6)


def main(argv=None):
    from runtime import cuda
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    dev = cuda.get_device()
    print(f"device: {dev.name}, sm_{dev.arch}, {dev.sm_count} SMs")
    region_max = max(rows * units * 512 for _, rows, units in SHAPES)
    regions = max(2, -(-(2 << 30) // region_max))          # >= 2 GiB cycled through: no L2 reuse
    buf = cuda.empty((regions * region_max // 4,), np.uint32).fill_bytes(0x5A)

    def region(r: int, nbytes: int):
        return buf.view(r * region_max // 4, (nbytes // 4,))
    sink = cuda.empty((1,), np.uint32)

    def timed(launches) -> float:
        """Median us of one launch, each call taking the next region."""
        it = itertools.cycle(launches)
        return cuda.bench(lambda: next(it)(), warmup=3, iters=args.iters) * 1e3

    def read_us(nbytes: int) -> float:
        return read_time_us([region(r, nbytes) for r in range(regions)], ((4, 256), (8, 512), (16, 256)),
                            args.iters)[0]

    big = region_max     # one region per launch, cycled
    bw = big / (read_us(big) * 1e-6)
    print(f"streaming read, {big / 2**30:.1f} GiB per launch over {regions} regions: {bw / 1e12:.3f} TB/s "
          f"(the 100% below)")
    rows_out = []
    for label, rows, units in SHAPES:
        nbytes = rows * units * 512
        same = read_us(nbytes)
        print(f"\n{label}: {rows} rows x {units} units = {nbytes / 1e6:.1f} MB, {rows // 2} warps; streaming read "
              f"of the same bytes {same:.1f} us ({nbytes / (same * 1e-6) / bw * 100:.1f}%)")
        print(f"  {'depth':>5} {'hint':>4} {'layout':>10} {'warps/blk':>9} {'us':>8} {'% read':>7}")
        for depth, hint, step_major, wpb in itertools.product(DEPTHS, (0, 1), (0, 1), (2, 4)):
            k = cuda.get_kernel("runtime_probe", f"stream_rows_kernel<{depth}, {hint}>")
            grid = -(-(rows // 2) // wpb)
            launches = [k.prepare((grid,), (32 * wpb,), [region(r, nbytes), np.int32(units), np.int32(rows),
                                                         np.int32(step_major), sink]) for r in range(regions)]
            us = timed(launches)
            pct = nbytes / (us * 1e-6) / bw * 100
            layout = "step-major" if step_major else "rows"
            print(f"  {depth:>5} {hint:>4} {layout:>10} {wpb:>9} {us:8.1f} {pct:6.1f}%", flush=True)
            rows_out.append((label, depth, hint, layout, wpb, us, pct))
    print("\nbest per shape:")
    for label, _, _ in SHAPES:
        best = max((r for r in rows_out if r[0] == label), key=lambda r: r[6])
        print(f"  {label:<14} depth {best[1]} hint {best[2]} {best[3]} {best[4]} warps/block: {best[5]:.1f} us "
              f"({best[6]:.1f}%)")


if __name__ == "__main__":
    main()
