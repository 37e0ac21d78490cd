"""Benchmark the MoE layer's wgmma hot-expert GEMMs against cuBLAS's batched bf16 GEMM of the same shapes.

The ceiling the hot tier is measured against (docs/PERF.md, session 43): T tokens on each of 8 experts of the Kimi
K2.x shape (top-8 of 8: every token picks every expert), so the layer's gate_up_hot stage is 8 INT4 W4A16 GEMMs
[T, 7168] x [7168 -> 2 x 2048] (+ SiLU(gate) * up) and down_hot 8 GEMMs [T, 2048] x [2048 -> 7168], each stage
graph-replayed alone (tools/bench_moe.time_plan); 8 experts give 256 / 448 column blocks, enough to fill the GPU
as a skewed layer's hot experts do (one expert alone gives 32 / 56). Per plan: the hot tier forced onto one
pipeline (PIPE 20 / PIPE 5 at 256-token tiles, PIPE 8 at 64). The peer: torch.bmm of the same 8 bf16 GEMMs (cuBLAS),
timed in a child process (torch and the runtime's CUDA wheels clash in one process on the device image), in the
same device session. Prints per T: time and TFLOP/s of each, ours / cuBLAS as a rate ratio, and the read floor of
the 8 experts' INT4 weights.

    python -m tools.bench_hot_gemm [--tokens 64,128,256,512,1024,2048] [--plans p20,ws5,p8] [--no-torch]
    python -m tools.bench_hot_gemm --torch-only F    # the torch GEMMs alone (the child), JSON into F
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

HIDDEN, INTER, EXPERTS = 7168, 2048, 8
# label -> the hot tier (min tokens, token tile, PIPE) that every expert of >= its minimum runs on
PLANS = {"p20": (64, 256, 20), "ws5": (64, 256, 5), "p8": (16, 64, 8)}


def gemm_flops(T: int) -> dict[str, float]:
    """Multiply-adds x 2 of each stage's 8 GEMMs at T tokens an expert (gate_up: both halves)."""
    return {"gate_up": 2.0 * EXPERTS * T * HIDDEN * 2 * INTER, "down": 2.0 * EXPERTS * T * INTER * HIDDEN}


def torch_main(tokens: list[int], path: str, iters: int) -> int:
    """cuBLAS (torch.bmm, bf16) at the hot stages' shapes, 8 experts: {T: {gemm: seconds}} into `path`."""
    import torch
    from tools.torch_timing import torch_seconds
    w_gu = torch.randn((EXPERTS, 2 * INTER, HIDDEN), dtype=torch.bfloat16, device="cuda") * 0.02
    w_dn = torch.randn((EXPERTS, HIDDEN, INTER), dtype=torch.bfloat16, device="cuda") * 0.02
    out = {}
    for T in tokens:
        x = torch.randn((EXPERTS, T, HIDDEN), dtype=torch.bfloat16, device="cuda")
        h = torch.randn((EXPERTS, T, INTER), dtype=torch.bfloat16, device="cuda")
        row = {}
        for name, fn in (("gate_up", lambda: torch.bmm(x, w_gu.transpose(1, 2))),
                         ("down", lambda: torch.bmm(h, w_dn.transpose(1, 2)))):
            row[name] = torch_seconds(fn, iters, warmup=5)
        out[str(T)] = row
    with open(path, "w") as f:
        json.dump(out, f)
    return 0


def run_torch_child(tokens: str, iters: int) -> dict:
    """The torch matmuls in their own process; {} (the peer columns print as nan) when it fails."""
    import os
    import subprocess
    import tempfile
    path = os.path.join(tempfile.mkdtemp(prefix="bench_hot_gemm_"), "torch.json")
    rc = subprocess.run([sys.executable, "-m", "tools.bench_hot_gemm", "--torch-only", path, "--tokens", tokens,
                         "--iters", str(iters)]).returncode
    if rc != 0:
        print(f"torch child failed (exit {rc}): no cuBLAS columns", flush=True)
        return {}
    with open(path) as f:
        return json.load(f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="64,128,256,512,1024,2048")
    ap.add_argument("--plans", default=",".join(PLANS), help=f"comma list of {', '.join(PLANS)}")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--no-torch", action="store_true", help="skip the cuBLAS peer")
    ap.add_argument("--torch-only", metavar="JSON", help="time only the torch matmuls, write results here")
    args = ap.parse_args(argv)
    tokens = [int(v) for v in args.tokens.split(",")]
    if args.torch_only:
        return torch_main(tokens, args.torch_only, args.iters)
    plans = args.plans.split(",")
    unknown = [p for p in plans if p not in PLANS]
    if unknown:
        raise SystemExit(f"--plans: unknown {unknown}; known: {', '.join(PLANS)}")
    peer = {} if args.no_torch else run_torch_child(args.tokens, args.iters)

    from runtime import cuda
    from tools.bench_moe import make_weights, time_plan
    from tools.read_bandwidth import read_bandwidth
    dev = cuda.get_device()
    print(f"device: {dev.name}, sm_{dev.arch}, {dev.sm_count} SMs")
    bw = read_bandwidth()
    print(f"measured read bandwidth: {bw / 1e12:.3f} TB/s")
    rng = np.random.default_rng(0)
    weights = make_weights(EXPERTS, HIDDEN, INTER, rng)
    # the 8 experts' INT4 weights + scales of each stage: what it reads at least once
    w_bytes = {"gate_up": weights.gate_q.nbytes + weights.gate_s.nbytes + weights.up_q.nbytes + weights.up_s.nbytes,
               "down": weights.down_q.nbytes + weights.down_s.nbytes}
    rows = []
    for T in tokens:
        x = rng.standard_normal((T, HIDDEN)).astype(np.float32)
        logits = np.random.default_rng(T).standard_normal((T, EXPERTS)).astype(np.float32)   # top-8 of 8: all
        times = {}
        for label in plans:
            tier = PLANS[label]
            if T < tier[0]:
                continue
            try:
                _, stages = time_plan(weights, T, EXPERTS, x, logits, dict(topk=EXPERTS, gmma_tiers=[tier]), args.iters)
            except Exception as e:   # report, keep the other plans
                print(f"T={T} {label}: failed ({type(e).__name__}: {e})", flush=True)
                continue
            stages = dict(stages)
            times[label] = {"gate_up": stages["gate_up_hot"], "down": stages["down_hot"]}
        rows.append((T, times))
    flops_unit = 1e12
    print(f"\nhot stages, T tokens on each of {EXPERTS} experts, graph replay of the stage alone: us (TFLOP/s); "
          f"'vs cuBLAS' = our rate / cuBLAS's (torch.bmm, bf16) at the same shapes; 'floor' = the experts' INT4 weights "
          f"read once at the measured bandwidth")
    for gemm in ("gate_up", "down"):
        print(f"\n{gemm}: {EXPERTS} x [T, {HIDDEN if gemm == 'gate_up' else INTER}] -> "
              f"{2 * INTER if gemm == 'gate_up' else HIDDEN}, weights {w_bytes[gemm] / 1e6:.1f} MB, "
              f"floor {w_bytes[gemm] / bw * 1e6:.1f} us")
        print(f"{'T':>5s} {'cuBLAS bf16':>18s} " + " ".join(f"{p:>18s} {'vs cuBLAS':>9s}" for p in plans))
        for T, times in rows:
            fl = gemm_flops(T)[gemm]
            t_peer = peer.get(str(T), {}).get(gemm, float("nan"))
            cells = [f"{t_peer * 1e6:8.1f} ({fl / t_peer / flops_unit:6.1f})"]
            for p in plans:
                t = times.get(p, {}).get(gemm)
                if t is None:
                    cells.append(f"{'-':>18s} {'-':>9s}")
                    continue
                t = t * 1e-3   # time_plan's milliseconds
                cells.append(f"{t * 1e6:8.1f} ({fl / t / flops_unit:6.1f}) {t_peer / t:9.2f}")
            print(f"{T:5d} " + " ".join(f"{c:>18s}" if i == 0 else c for i, c in enumerate(cells)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
