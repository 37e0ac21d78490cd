"""The device's streaming-read bandwidth: the 100% of every benchmark's "% of read BW" column.

runtime_probe's read_sum_kernel sums a buffer far larger than L2, 16 bytes per load; the best of a few grid
shapes counts. One place for it, so that every benchmark's percentages mean the same thing.
"""
from __future__ import annotations

import itertools

import numpy as np

# (blocks per SM, threads per block) tried; the best one counts
CONFIGS = ((4, 512), (8, 256), (8, 512), (16, 256), (2, 1024))


def read_time_us(regions, configs=CONFIGS, iters: int = 20, stream=None) -> tuple[float, tuple[int, int]]:
    """Best median microseconds of reading one region (device arrays of one size, a multiple of 16 bytes) and
    the (blocks per SM, threads) that got it. Launches take the regions in turn, so regions that together
    exceed L2 are never read from it."""
    from runtime import cuda
    dev = cuda.get_device()
    kernel = cuda.get_kernel("runtime_probe", "read_sum_kernel")
    sink = cuda.empty((4,), np.uint32)
    nbytes = regions[0].nbytes
    if nbytes % 16 or any(r.nbytes != nbytes for r in regions):
        raise ValueError(f"regions must share one size, a multiple of 16 bytes: {[r.nbytes for r in regions]}")
    best = (float("inf"), configs[0])
    for blocks_per_sm, threads in configs:
        launches = itertools.cycle([kernel.prepare((dev.sm_count * blocks_per_sm,), (threads,),
                                                   [r, np.int64(nbytes // 16), sink]) for r in regions])
        us = cuda.bench(lambda: next(launches)(stream), warmup=3, iters=iters, stream=stream) * 1e3
        best = min(best, (us, (blocks_per_sm, threads)))
    return best


def read_bandwidth(nbytes: int = 2 << 30, configs=CONFIGS, iters: int = 20, stream=None,
                   with_config: bool = False):
    """Bytes per second of a streaming read of `nbytes` (default 2 GiB, far above the 50 MB of L2; whole
    16-byte loads), best of `configs`; with_config: (bytes/s, (blocks per SM, threads))."""
    from runtime import cuda
    nbytes = nbytes // 16 * 16
    buf = cuda.empty((nbytes // 4,), np.uint32).fill_bytes(0x5A)
    us, cfg = read_time_us([buf], configs, iters, stream)
    bw = nbytes / (us * 1e-6)
    return (bw, cfg) if with_config else bw


def read_time_by_blocks(regions, blocks, threads: int = 1024, iters: int = 20, stream=None) -> list[float]:
    """Median microseconds of reading one region with each grid size in `blocks` (of `threads` threads; at 1024
    threads no two blocks share an SM while the grid is at most the SM count), 8 loads in flight per thread
    (read_sum_deep_kernel<8>): how the read scales with the SMs that stream, the question behind a linear whose row
    blocks leave SMs idle."""
    from runtime import cuda
    kernel = cuda.get_kernel("runtime_probe", "read_sum_deep_kernel<8>")
    sink = cuda.empty((4,), np.uint32)
    nbytes = regions[0].nbytes
    out = []
    for g in blocks:
        launches = itertools.cycle([kernel.prepare((g,), (threads,), [r, np.int64(nbytes // 16), sink])
                                    for r in regions])
        out.append(cuda.bench(lambda: next(launches)(stream), warmup=3, iters=iters, stream=stream) * 1e3)
    return out

