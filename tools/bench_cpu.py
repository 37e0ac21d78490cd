"""CPU benchmark of the cpu backend's bf16 linear (runtime/cpu_kernels.linear) at SmolLM2-135M shapes.

Per shape and row count M: ours (every build this CPU runs but the baseline, the default one first: the ratio
columns compare against it); the numpy backend's float32 product (BLAS, one thread as that backend runs it);
torch's bf16 matmul on the CPU (the peer a user has; skipped when torch is missing); and the memory floor (bf16
weight bytes over the read bandwidth measured in the same run, with as many threads as the linear uses). Weights
rotate through copies bigger than the caches, so every call streams them from memory as a decode step does.

    python -m tools.bench_cpu [--m 1,5,9,17,64] [--reps 20]
"""
from __future__ import annotations

import argparse
import math
import threading
import time

import numpy as np

SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("lm_head", 49152, 576)]
ROTATE_BYTES = 256 << 20     # > any CPU cache here


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def read_bandwidth(threads: int, nbytes: int = 1 << 30) -> float:
    """Bytes/s of summing a buffer (uint64 words) split over `threads` Python threads (numpy drops the GIL)."""
    data = np.ones(nbytes // 8, np.uint64)
    parts = np.array_split(data, threads)

    def run():
        ts = [threading.Thread(target=np.add.reduce, args=(p,)) for p in parts]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    return nbytes / (median_ms(run, 5) * 1e-3)


def torch_peer():
    try:
        import torch
    except ImportError:
        return None
    return torch


def main(argv=None) -> int:
    from runtime import cpu_kernels
    from runtime.backends.numpy_backend import set_blas_threads
    from runtime.bf16 import from_bf16, to_bf16

    ap = argparse.ArgumentParser(prog="bench_cpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", default="1,5,9,17,64", help="comma-separated row counts")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    ms_list = [int(v) for v in args.m.split(",")]
    threads = cpu_kernels.threads()
    set_blas_threads(1)
    torch = torch_peer()
    if torch is not None:
        torch.set_num_threads(threads)
    bw = read_bandwidth(threads)
    print(f"cpu linear: {cpu_kernels.isa()}, {threads} thread(s), OpenMP {'on' if cpu_kernels.openmp() else 'off'}; "
          f"read bandwidth ({threads} thread(s), 1 GiB sum): {bw / 1e9:.1f} GB/s")
    builds = [cpu_kernels.isa()] + [b for b in reversed(cpu_kernels.isa_levels()) if b not in ("baseline",
                                                                                              cpu_kernels.isa())]
    print("| op | N x K | M | build | ours ms | GB/s | % floor | GFLOP/s | numpy f32 ms (x ours) | torch bf16 ms "
          "(x ours) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for name, N, K in SHAPES:
        wbytes = N * K * 2
        copies = max(1, min(32, math.ceil(ROTATE_BYTES / wbytes)))
        block = to_bf16(rng.standard_normal((min(N, 1024), K), dtype=np.float32)).reshape(-1, K)
        wb = [np.ascontiguousarray(np.resize(block, (N, K))) for _ in range(copies)]
        wf = [from_bf16(w).reshape(N, K) for w in wb[:max(1, copies // 2)]]     # float32: twice the bytes
        wt = [torch.from_numpy(w.view(np.int16)).view(torch.bfloat16) for w in wb] if torch is not None else None
        for M in ms_list:
            x = rng.standard_normal((M, K), dtype=np.float32)
            out = np.empty((M, N), np.float32)
            i = [0]

            def ours(isa):
                i[0] = (i[0] + 1) % copies
                cpu_kernels.linear(x, wb[i[0]], out=out, isa=isa)

            def ref():
                i[0] = (i[0] + 1) % len(wf)
                np.ascontiguousarray((wf[i[0]] @ x.T).T)
            t_builds = {b: median_ms(lambda: ours(b), args.reps) for b in builds}
            t_ours, t_ref = t_builds[builds[0]], median_ms(ref, args.reps)
            peer = "-"
            if torch is not None:
                xt = torch.from_numpy(x).to(torch.bfloat16)

                def tpeer():
                    i[0] = (i[0] + 1) % copies
                    torch.matmul(xt, wt[i[0]].T)
                t_peer = median_ms(tpeer, args.reps)
                peer = f"{t_peer:.3f} ({t_peer / t_ours:.2f}x)"
            floor_ms = wbytes / bw * 1e3
            for b, t in t_builds.items():
                others = f"{t_ref:.3f} ({t_ref / t_ours:.2f}x) | {peer}" if b == builds[0] else \
                    f"({t / t_ours:.2f}x the {builds[0]} time) | "
                print(f"| {name} | {N}x{K} | {M} | {b} | {t:.3f} | {wbytes / t / 1e6:.1f} | "
                      f"{100 * floor_ms / t:.0f} | {2 * M * N * K / t / 1e6:.1f} | {others} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
