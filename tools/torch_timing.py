"""The benchmarks' one timing loop for a torch peer (torch imported by the caller's process only)."""
from __future__ import annotations


def torch_seconds(fn, iters: int, warmup: int = 3) -> float:
    """Mean seconds per call of `fn` (torch CUDA work on the current stream) over `iters` calls after `warmup`,
    between two CUDA events."""
    import torch
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3 / iters
