"""Benchmark MLA absorbed tree-verify attention (runtime.kimi_kernels.MlaAttention) at Kimi K2.x sizes.

For prefix lengths and tree budgets (Tq = budget + 1 queries: root + nodes) and heads 64 (full) / 8 (a TP-8
shard): the time of a plain launch and of a graph replay, the bytes read at least once (cache + q + out) and
the FLOPs (scores over 576 + values over 512, all positions), each against its floor from the read bandwidth
and the bf16 matrix rate measured in the same run (torch matmul, when torch is there; otherwise 790 TFLOP/s,
the rate KINDS.md recorded on this machine).

    python -m tools.bench_mla [--prefix 4096,32768] [--budgets 1,16,64,256,1024] [--heads 64,8]
"""
from __future__ import annotations

import argparse

import numpy as np

from runtime import cuda
from runtime.bf16 import to_bf16
from runtime.kimi_kernels import MLA_D, MlaAttention
from runtime.testing import random_tree_visibility
from tools.read_bandwidth import read_bandwidth


def bf16_matmul_rate() -> float:
    try:
        import torch
        from tools.torch_timing import torch_seconds
        a = torch.randn((8192, 8192), dtype=torch.bfloat16, device="cuda")
        b = torch.randn((8192, 8192), dtype=torch.bfloat16, device="cuda")
        return 2 * 8192 ** 3 / torch_seconds(lambda: a @ b, 10)
    except Exception as ex:
        print(f"(torch matmul rate not measured: {type(ex).__name__}; using 790 TFLOP/s)")
        return 790e12


IN_GRAPH_REPS = 10


def in_graph_us(fn, stream, iters: int) -> float:
    """us per call of fn(stream) captured IN_GRAPH_REPS times back to back in one graph (0 when fn is None: no
    combine with one split)."""
    if fn is None:
        return 0.0
    with cuda.capture(stream) as g:
        for _ in range(IN_GRAPH_REPS):
            fn(stream)
    graph = g.instantiate()
    return cuda.bench(lambda: graph.launch(stream), iters=iters, stream=stream) * 1e3 / IN_GRAPH_REPS


def chain_mask(n: int) -> np.ndarray:
    """A tree of n nodes with random parents among the 8 nodes before each (deep, like a real draft tree)."""
    return random_tree_visibility(np.random.default_rng(n), n, window=8)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix", default="4096,32768")
    ap.add_argument("--budgets", default="1,16,64,256,1024")
    ap.add_argument("--heads", default="64,8")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--splits", default="0", help="comma list of KV split counts to time; 0 = the planned one")
    ap.add_argument("--kernel", default="auto",
                    help="comma list: auto (gmma-split on sm_90a, else mma), mma (mma.sync), gmma / gmma-split "
                         "(wgmma, sm_90a)")
    args = ap.parse_args(argv)
    dev = cuda.require_device()
    bw = read_bandwidth()
    rate = bf16_matmul_rate()
    print(f"device: {dev.name}; read bandwidth {bw / 1e12:.2f} TB/s; bf16 matmul {rate / 1e12:.0f} TFLOP/s")
    rng = np.random.default_rng(0)
    stream = cuda.Stream()
    print(f"(launch / graph: one forward per launch or graph, its launch latency included; in-graph: {IN_GRAPH_REPS} "
          "forwards back to back in one graph, per forward, and each kernel's share; x floor: in-graph)")
    print(f"{'kern':4s} {'H':>3s} {'prefix':>6s} {'budget':>6s} {'splits':>6s} {'launch us':>9s} {'graph us':>9s} "
          f"{'in-graph':>8s} {'attn':>7s} {'combine':>7s} "
          f"{'MB':>7s} {'GFLOP':>8s} {'bytes floor':>11s} {'flop floor':>10s} {'x floor':>7s}")
    for heads in (int(v) for v in args.heads.split(",")):
        for prefix in (int(v) for v in args.prefix.split(",")):
            kv_max = prefix + max(int(b) for b in args.budgets.split(",")) + 1
            kv = cuda.to_device(to_bf16(rng.standard_normal((kv_max, MLA_D)).astype(np.float32)))
            for budget, splits, kernel in ((int(b), int(s), k) for b in args.budgets.split(",")
                                           for s in args.splits.split(",") for k in args.kernel.split(",")):
                tq = budget + 1
                mask = cuda.to_device(chain_mask(tq))
                attn = MlaAttention(tq, heads, kv, prefix, 1.0 / np.sqrt(192.0), mask=mask, splits=splits or None,
                                    kernel=kernel)
                attn.q.upload(to_bf16(rng.standard_normal((tq, heads, MLA_D)).astype(np.float32)))
                t_launch = cuda.bench(lambda: attn.forward(stream), iters=args.iters, stream=stream)
                with cuda.capture(stream) as g:
                    attn.forward(stream)
                graph = g.instantiate()
                t_graph = cuda.bench(lambda: graph.launch(stream), iters=args.iters, stream=stream)
                # back to back inside one graph (as in a model's step): per forward, and each kernel's share
                per = {name: in_graph_us(fn, stream, args.iters) for name, fn in (
                    ("fwd", attn.forward), ("attn", attn.attn), ("combine", attn.combine))}
                kv_len = prefix + tq
                nbytes = kv_len * MLA_D * 2 + tq * heads * (MLA_D + 512) * 2 + mask.nbytes
                flops = 2.0 * tq * heads * kv_len * (MLA_D + 512)
                fb, ff = nbytes / bw, flops / rate
                print(f"{attn.kernel:4s} {heads:3d} {prefix:6d} {budget:6d} {attn.splits:6d} {t_launch * 1e3:9.1f} "
                      f"{t_graph * 1e3:9.1f} {per['fwd']:8.1f} {per['attn']:7.1f} {per['combine']:7.1f} "
                      f"{nbytes / 1e6:7.2f} {flops / 1e9:8.2f} {fb * 1e6:9.1f}us "
                      f"{ff * 1e6:8.1f}us {per['fwd'] * 1e-6 / max(fb, ff):7.2f}", flush=True)


if __name__ == "__main__":
    main()
