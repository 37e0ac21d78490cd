"""Logit error of a backend's three forward paths against the float32 numpy reference, position by position.

The engine's greedy AR output and its DDTree output are produced by different kernels (one-row gemv and decode
attention for an AR step; many-row GEMMs and verify attention for a tree), which round differently in bf16.
Where the reference's two best logits are closer than that rounding, the two outputs may split: this tool
measures how large the rounding is, on the same weights, so that the lossless tests' near-tie tolerance
(tests/test_cuda_engine.py NEAR_TIE) rests on a measurement.

For a prompt and the reference's greedy continuation, each row is one position p (the logits of the token after
p): the reference's best token and its top-2 gap, then for each path the largest |logit - reference| over the
vocabulary and whether its argmax is the reference's:
  prefill   the whole sequence in one forward (many rows);
  ar        the prompt, then one token per forward (the AR step's kernels);
  verify    the sequence up to VT positions before the end, then VT rows in one forward (a tree verify's kernels).
All errors are in units of the reference logits' standard deviation at that position.

    python -m tools.logit_error                          # the embedded SmolLM2-135M GGUF, CUDA backend
    python -m tools.logit_error --random smollm2-135m --layers 4 --backend numpy   # a random model, CPU
"""
from __future__ import annotations

import argparse
import sys

import numpy as np


def greedy(model, prompt, new_tokens: int) -> list[int]:
    """prompt + the model's greedy continuation (re-prefilled each step: the reference's own choices)."""
    from runtime.testing import forward_logits
    seq = list(prompt)
    for _ in range(new_tokens):
        seq.append(int(np.argmax(forward_logits(model, seq, [len(seq)])[-1])))
    return seq


def compare(ref, model, prompt, new_tokens: int = 24, verify_rows: int = 17) -> tuple[list[dict], list[int]]:
    """Per-position rows {pos, best, gap, <path>: (err, argmax)} for positions len(prompt) - 1 .. end - 1, and
    the reference's sequence."""
    from runtime.testing import forward_logits
    seq = greedy(ref, prompt, new_tokens)
    n0, n = len(prompt), len(seq)
    vt = min(verify_rows, n - 1)
    z_ref = forward_logits(ref, seq, [n])
    paths = {"prefill": (forward_logits(model, seq, [n]), 0),
             "ar": (forward_logits(model, seq, [n0] + [1] * (n - n0)), 0),
             f"verify {vt}": (forward_logits(model, seq, [n - vt, vt]), n - vt)}
    rows = []
    for p in range(n0 - 1, n - 1):
        z = z_ref[p]
        std = float(z.std())
        top = np.argsort(z)[-2:]
        row = dict(pos=p, best=int(top[1]), gap=float(z[top[1]] - z[top[0]]) / std)
        for name, (zz, first) in paths.items():
            if p >= first:   # verify rows are its last vt positions (earlier ones came from its prefill chunk)
                row[name] = (float(np.abs(zz[p] - z).max()) / std, int(np.argmax(zz[p])))
        rows.append(row)
    return rows, seq


def print_report(rows, names):
    print(f"{'pos':>4s} {'best':>6s} {'gap/std':>8s} | " + " | ".join(f"{k:>20s}" for k in names))
    for r in rows:
        cells = []
        for k in names:
            if k not in r:
                cells.append(f"{'':>20s}")
                continue
            err, am = r[k]
            cells.append(f"err {err:6.3f} {'ok' if am == r['best'] else 'argmax ' + str(am):>9s}")
        print(f"{r['pos']:4d} {r['best']:6d} {r['gap']:8.3f} | " + " | ".join(cells))
    print("\nsummary (errors in reference std units)")
    for k in names:
        errs = [r[k][0] for r in rows if k in r]
        miss = [r for r in rows if k in r and r[k][1] != r["best"]]
        gaps = ", ".join(f"pos {r['pos']} gap {r['gap']:.3f}" for r in miss) or "none"
        print(f"  {k:10s} max err {max(errs):.3f}, median {float(np.median(errs)):.3f}; argmax != reference: {gaps}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="logit_error", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a GGUF file (default: the embedded SmolLM2-135M)")
    ap.add_argument("--random", help="a random-weight model of a tools.bench_e2e shape instead of --model")
    ap.add_argument("--layers", type=int, help="with --random: override the number of layers")
    ap.add_argument("--backend", choices=("cuda", "numpy"), default="cuda")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--verify-rows", type=int, default=17, help="rows of the verify path (budget 16: 17)")
    args = ap.parse_args(argv)
    from runtime.backends.numpy_backend import NumpyBackend
    if args.backend == "cuda":
        from runtime.backends.cuda_backend import CudaBackend
        backend = CudaBackend()
    else:
        backend = NumpyBackend()
    if args.random:
        from tools.bench_e2e import RANDOM_SHAPES, random_target
        cfg = dict(RANDOM_SHAPES[args.random])
        if args.layers:
            cfg["num_hidden_layers"] = args.layers
        ref, model = random_target(cfg, NumpyBackend()), random_target(cfg, backend)
        prompt = [int(x) for x in np.random.default_rng(0).integers(16, min(32000, cfg["vocab_size"]), 8)]
        what = f"random {args.random}"
    else:
        import loader
        from runtime.models import build_model
        path = args.model or loader.default_model_path()
        g = loader.load_gguf(path)
        ref, model = build_model(g.spec, g, NumpyBackend()), build_model(g.spec, g, backend)
        prompt = list(g.tokenizer.encode(args.prompt))
        what = f"{path} prompt {args.prompt!r}"
    rows, seq = compare(ref, model, prompt, args.new_tokens, args.verify_rows)
    print(f"logit_error: {what}, backend {args.backend}; reference greedy continuation {seq[len(prompt):]}")
    print_report(rows, [k for k in rows[-1] if k not in ("pos", "best", "gap")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
