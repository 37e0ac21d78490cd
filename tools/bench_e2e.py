"""End-to-end decoding benchmark: tokens/s and acceptance for AR, DFlash chain and DDTree (several budgets),
measured in one run and printed as a table with speed ratios against AR. Also checks that every greedy
output equals the AR output (the lossless property) and marks any row that differs.

    python -m tools.bench_e2e                                  # SmolLM2-135M default, random drafter, numpy
    python -m tools.bench_e2e --model DIR --draft DFLASH_DIR --backend cuda --budgets 16,64,256

Without --draft a random-weight drafter is used: acceptance is then near 1 and the table measures the cost of
drafting and verifying, not a speedup.
"""
from __future__ import annotations

import argparse
import sys


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a short poem about the sea."]


def main(argv=None) -> int:
    from tools.ddtree_run import CliError, load_drafter, load_target, select_backend
    from runtime.engine import Engine
    from runtime.models.dflash import DFlashDrafter, random_checkpoint
    import loader

    ap = argparse.ArgumentParser(prog="bench_e2e", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--backend", choices=("auto", "cuda", "numpy"), default="numpy")
    ap.add_argument("--budgets", default="4,16,64", help="comma-separated DDTree budgets")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    args = ap.parse_args(argv)
    try:
        budgets = [int(b) for b in args.budgets.split(",")]
        if min(budgets) < 1:
            raise ValueError
    except ValueError:
        print(f"bench_e2e: error: --budgets must be positive integers, got {args.budgets!r}", file=sys.stderr)
        return 2

    try:
        backend = select_backend(args.backend)
        target, tok, _, _ = load_target(args.model, backend)
        if args.draft:
            drafter = load_drafter(args.draft, target, backend)
        else:
            n = target.num_layers
            config, weights = random_checkpoint(target.hidden_size, n, target.vocab_size,
                                                taps=(1, n // 2, n - 3) if n > 4 else (0,), block_size=16)
            drafter = DFlashDrafter(loader.load_config(config), weights, backend)
            print("bench_e2e: no --draft: random-weight drafter (acceptance ~1; measures overhead, not speedup)",
                  file=sys.stderr)
    except CliError as e:
        print(f"bench_e2e: error: {e}", file=sys.stderr)
        return e.code

    engine = Engine(target, drafter)
    prompts = [tok.encode(p) for p in PROMPTS[:args.prompts]]
    engine.generate(prompts[0], mode="ar", max_new_tokens=2)           # warm-up (allocations, BLAS)
    configs = [("ar", 1), ("chain", 1)] + [("ddtree", b) for b in budgets]
    rows, reference = [], {}
    for mode, budget in configs:
        tokens = decode_s = rounds = 0
        lossless = True
        stage = {}
        for i, ids in enumerate(prompts):
            r = engine.generate(ids, mode=mode, budget=budget, max_new_tokens=args.max_new_tokens)
            if mode == "ar":
                reference[i] = r.tokens
            lossless &= r.tokens == reference[i]
            tokens += len(r.tokens) - 1                 # the first token comes from the prefill
            decode_s += r.decode_s
            rounds += len(r.rounds)
            for k, v in r.stage_times().items():
                stage[k] = stage.get(k, 0.0) + v
            print(f"  {mode:6s} budget {budget:4d} prompt {i}: {len(r.tokens)} tokens", file=sys.stderr)
        rows.append((mode, budget, tokens / decode_s, tokens / max(rounds, 1),
                     {k: v / max(rounds, 1) * 1e3 for k, v in stage.items()}, lossless))

    ar_tps = rows[0][2]
    print(f"\nbackend {backend.name}, {len(prompts)} prompts x {args.max_new_tokens} new tokens, greedy")
    print(f"{'mode':8s} {'budget':>6s} {'tok/s':>8s} {'vs AR':>6s} {'acc/round':>9s} "
          f"{'draft ms':>8s} {'tree ms':>7s} {'verify ms':>9s} {'commit ms':>9s}  lossless")
    for mode, budget, tps, acc, st, ok in rows:
        print(f"{mode:8s} {budget if mode == 'ddtree' else '-':>6} {tps:8.2f} {tps / ar_tps:6.2f} {acc:9.2f} "
              f"{st.get('draft', 0):8.2f} {st.get('tree', 0):7.2f} {st.get('verify', 0):9.2f} "
              f"{st.get('commit', 0):9.2f}  {'yes' if ok else 'NO: differs from AR'}")
    return 0 if all(r[5] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
