"""AR decoding in the graph-captured CUDA engine at several prompt lengths, attention configurations side by
side (issue 6): tok/s over --new-tokens greedy tokens (host work included) and the AR graph's replay time.

    python -m tools.bench_ar                                          # SmolLM2-135M shape: tree vs decode
    python -m tools.bench_ar --attn tree,decode:16x2,decode:32x3 --prompts 8,512,1024
    python -m tools.bench_ar --random qwen3-8b --new-tokens 48 --prompts 8,512,1024,1536
    python -m tools.bench_ar --random qwen3-8b --layers 12 --prompts 1024 --new-tokens 8 \
        --verify-budgets 128,256,512 --configs decode,decode+3wg0     # the GMMA plan's knobs in the verify graph
    python -m tools.bench_ar --random qwen3-tiny --fake --prompts 8,40 --new-tokens 4   # CPU stand-in

A configuration is one or more terms joined by "+", each setting one of runtime.dense_kernels' launch choices
(the rest keep their defaults):
  tree          tree_attention_kernel for every shape (as DDTREE_ATTN_DECODE=0)
  decode        decode_attention_kernel where the rule takes it (the default), its default instance per head dim
  decode:KTxS   that decode instance for every head dim
  kw8, kw4, kw2 every gemv launch with that many warps per W tile (as DDTREE_GEMV_KW)
  persist0/1    gemv grids one block per row tile / persistent (as DDTREE_GEMV_PERSIST)
  gemv0         decode-size linears on the split-K x-resident kernel instead of the gemv (as DDTREE_LINEAR_GEMV=0)
  gmma0         verify-size linears on the mma.sync chunked kernel instead of GMMA (as DDTREE_LINEAR_GMMA=0)
  agmma0        tree_attention_kernel where the wgmma tree kernel would run (as DDTREE_ATTN_GMMA=0)
  3wg0          GMMA linear: two-warpgroup blocks at the token tiles 136 / 192 (as DDTREE_GMMA_THREE_WG=0)
  1wg0          GMMA linear: no one-warpgroup blocks in clusters of 2 (as DDTREE_GMMA_ONE_WG=0); 1wgs4: those
                blocks with the 4-stage ring of before session 28
  push0/1       GMMA linear: cluster K splits with the DSMEM epilogue / partials exchanged by st.async, at every
                token tile (DDTREE_GMMA_PUSH_MAX_TN: the tiles that push by default)
  gmmadec0      decode-size linears (1..8 rows) on the gemv / x-resident kernels for every weight (as
                DDTREE_GMMA_DECODE=0); gmma1: every unfused linear of any size on GMMA
  fuse0         no rmsnorm / swiglu fused into a linear (as DDTREE_FUSED_PROLOGUE_ROWS=0)
  narrow0       GMMA linear: no narrow-row kernel (as DDTREE_GMMA_NARROW=0; narrow1: on for any device, where the
                default takes it only at a slow memory rate per SM, NARROW_MAX_BYTES_PER_SM); nfuse1:
                rmsnorm / SwiGLU fused into it (as DDTREE_NARROW_FUSE=1; nfuse0: not, the default); nmc1: clusters
                that share x past the one-block x limit (as DDTREE_NARROW_MC=1; nmc0: not, the default)
  drowsN        the decode kernel up to N packed rows per KV head at every head dim (DECODE_MAX_ROWS)
  fuse16/fuse32 rmsnorm and swiglu fused into the linears up to 16 / 32 rows (as DDTREE_FUSED_PROLOGUE_ROWS):
                verify b16 and drafter blocks as six launches per layer, on the x-resident kernel; norm32 /
                swiglu32 only the one prologue
With --verify-budgets the same configurations also decode with DDTree at those budgets (the random drafter) and
the verify graph of each budget's bucket is timed after them.
e.g. `--configs decode,decode+kw4,decode+kw8,decode+persist0`. Each configuration gets its own Engine, whose
graphs are captured with it, on the same target weights. The replay is timed after each generate, so at
prefix = prompt + new tokens.

Why a tool: per-op timings (bench_dense, profile_step) did not rank the decode kernel's instances the way the
AR graph does (docs/PERF.md, session of 2026-12-04 (15)). On --fake the times are host seconds of numpy
stand-ins: meaningless; the run checks that the tool works end to end.
"""
from __future__ import annotations

import argparse
import sys


def configure(spec: str, defaults: dict) -> None:
    """Set runtime.dense_kernels' launch choices for the engines built from now on: `defaults` (the module's
    values at start), then each "+"-joined term of `spec` (see above)."""
    import runtime.dense_kernels as dk
    from runtime import dense_gmma
    for name, value in defaults.items():
        setattr(knob_owner(name), name, dict(value) if isinstance(value, dict) else value)
    for term in spec.split("+"):
        kernel, _, variant = term.partition(":")
        if kernel in ("tree", "decode") and (not variant or kernel == "decode"):
            dk.ATTN_DECODE = kernel == "decode"
            if variant:
                kt_s = tuple(int(x) for x in variant.split("x"))
                dk.DECODE_VARIANTS = {d: kt_s for d in defaults["DECODE_VARIANTS"]}
                for d in dk.DECODE_VARIANTS:
                    dk.decode_variant(d)             # an instance that exists, or a clear error now
        elif term in ("kw8", "kw4", "kw2"):
            dk.GEMV_KW_FORCED = int(term[2:])
        elif term in ("persist0", "persist1"):
            dk.GEMV_PERSIST_FORCED = term[-1]
        elif term == "gemv0":
            dk.LINEAR_GEMV = False
        elif term == "gmma0":
            dense_gmma.GMMA_ENABLED = False
        elif term == "agmma0":
            dk.ATTN_GMMA = False
        elif term == "3wg0":
            dense_gmma.GMMA_THREE_WG_MANY = False
        elif term == "1wg0":
            dense_gmma.GMMA_ONE_WG = False
        elif term in ("push0", "push1"):
            dense_gmma.GMMA_PUSH_MAX_TN = 256 if term == "push1" else 0
        elif term == "1wgs4":
            dense_gmma.GMMA_ONE_WG_CONFIG = {tn: (ka, 4, rw) for tn, (ka, _, rw) in
                                             dense_gmma.GMMA_ONE_WG_CONFIG.items()}
        elif term == "gmmadec0":
            dense_gmma.GMMA_DECODE = False
        elif term == "gmma1":
            dense_gmma.GMMA_MIN_M = 1
        elif term in ("narrow0", "narrow1"):
            dense_gmma.GMMA_NARROW = term == "narrow1"
            if term == "narrow1":   # on any device (the default takes it only where the memory per SM is slow)
                dense_gmma.NARROW_MAX_BYTES_PER_SM = None
        elif term in ("nfuse0", "nfuse1"):
            dense_gmma.NARROW_FUSE = term == "nfuse1"
        elif term in ("nmc0", "nmc1"):
            dense_gmma.NARROW_MC = term == "nmc1"
        elif term == "fuse0":
            dk.FUSED_PROLOGUE_ROWS = {p: 0 for p in defaults["FUSED_PROLOGUE_ROWS"]}
        elif term.startswith("drows") and term[5:].isdigit():
            dk.DECODE_MAX_ROWS = {d: int(term[5:]) for d in defaults["DECODE_MAX_ROWS"]}
        elif term[:-2] in FUSE_TERMS and term[-2:] in ("16", "32"):
            for prologue in FUSE_TERMS[term[:-2]]:
                dk.FUSED_PROLOGUE_ROWS[prologue] = int(term[-2:])
        else:
            raise SystemExit(f"bench_ar: configuration term {term!r}: tree, decode, decode:KTxS, kw8, kw4, kw2, "
                             "persist0, persist1, gemv0, gmma0, agmma0, 3wg0, 1wg0, 1wgs4, push0/1, gmmadec0, gmma1, "
                             "fuse0, narrow0/1, nfuse0/1, nmc0/1, drowsN, fuse16/32, norm16/32 or swiglu16/32")


FUSE_TERMS = {"fuse": ("rmsnorm", "swiglu"), "norm": ("rmsnorm",), "swiglu": ("swiglu",)}
# the launch choices a configuration may change, restored before each one
GMMA_KNOBS = ("GMMA_ENABLED", "GMMA_THREE_WG_MANY", "GMMA_ONE_WG", "GMMA_DECODE", "GMMA_MIN_M", "GMMA_NARROW",
              "NARROW_MAX_BYTES_PER_SM", "NARROW_FUSE", "NARROW_MC", "GMMA_ONE_WG_CONFIG",
              "GMMA_PUSH_MAX_TN")   # held by runtime.dense_gmma
KNOBS = ("ATTN_DECODE", "DECODE_VARIANTS", "GEMV_KW_FORCED", "GEMV_PERSIST_FORCED", "LINEAR_GEMV",
         "FUSED_PROLOGUE_ROWS", "ATTN_GMMA", "DECODE_MAX_ROWS") + GMMA_KNOBS   # the rest: runtime.dense_kernels


def knob_owner(name: str):
    """The module that holds launch choice `name` (runtime.dense_gmma for GMMA_KNOBS, else dense_kernels)."""
    import runtime.dense_kernels as dk
    from runtime import dense_gmma
    return dense_gmma if name in GMMA_KNOBS else dk


def main(argv=None) -> int:
    from tools.bench_e2e import RANDOM_SHAPES
    ap = argparse.ArgumentParser(prog="bench_ar", description=__doc__.split("\n\n")[0])
    ap.add_argument("--random", choices=sorted(RANDOM_SHAPES), default="smollm2-135m", help="model shape")
    ap.add_argument("--layers", type=int, help="override the number of layers (a quicker, smaller model)")
    ap.add_argument("--configs", "--attn", dest="configs", default="tree,decode",
                    help="comma-separated configurations (see above)")
    ap.add_argument("--prompts", default="8,128,256,512,1024,1536", help="comma-separated prompt lengths")
    ap.add_argument("--new-tokens", type=int, default=128, help="greedy tokens generated per prompt")
    ap.add_argument("--iters", type=int, default=20, help="timed replays of the AR graph (median)")
    ap.add_argument("--verify-budgets", default="", help="comma-separated DDTree budgets whose verify graph is "
                    "timed too (after a DDTree generate at each prompt)")
    ap.add_argument("--fake", action="store_true", help="run on the CPU stand-in (tests/fake_cuda.py); "
                    "times are meaningless, checks the tool end to end")
    args = ap.parse_args(argv)
    specs = [s for s in args.configs.split(",") if s]
    prompts = [int(p) for p in args.prompts.split(",") if p]
    budgets = [int(x) for x in args.verify_budgets.split(",") if x]

    from tools.profile_step import _time_graph, install_fake, random_engine
    if args.fake:
        install_fake()
    from runtime import cuda_engine as ce
    from runtime.backends.cuda_backend import CudaBackend
    from runtime.engine import Engine
    from runtime.cuda import bucket_for
    defaults = {name: getattr(knob_owner(name), name) for name in KNOBS}
    for spec in specs:              # every configuration valid before the model is built
        configure(spec, defaults)
    b = CudaBackend(graphs=True)
    print(f"bench_ar: building a random {args.random} in memory ...", file=sys.stderr, flush=True)
    # one target and drafter for every configuration; prompt n = the first n tokens of one random prompt
    built, prompt = random_engine(b, args.random, args.layers, max(prompts))
    target, drafter = built.target, built.drafter
    del built
    rows, verify = [], {}
    for i, spec in enumerate(specs):  # a configuration may repeat (its rows then show the run-to-run noise)
        configure(spec, defaults)
        engine = Engine(target, drafter)
        cells = []
        for n in prompts:
            r = engine.generate(prompt[:n], mode="ar", max_new_tokens=args.new_tokens)
            graph = ce.graph_decoder(engine).graphs[("ar", 0.0)]
            replay_us = _time_graph(graph.exec, b.stream, args.fake, args.iters) * 1e3
            cells.append(((len(r.tokens) - 1) / r.decode_s, replay_us))
            print(f"  {spec:14s} prompt {n:5d}: {cells[-1][0]:8.1f} tok/s, AR replay {replay_us:8.1f} us",
                  file=sys.stderr, flush=True)
            for budget in budgets:
                engine.generate(prompt[:n], mode="ddtree", budget=budget, max_new_tokens=args.new_tokens)
                bkt = bucket_for(budget, ce.BUCKETS)
                g = ce.graph_decoder(engine).graphs[("verify", bkt, 0.0)]
                verify[(i, n, budget)] = _time_graph(g.exec, b.stream, args.fake, args.iters) * 1e3
                print(f"  {spec:14s} prompt {n:5d}: verify b{budget} replay {verify[(i, n, budget)]:8.1f} us",
                      file=sys.stderr, flush=True)
        rows.append((spec, cells))
        del engine
    configure("decode", defaults)

    unit = "host us (fake: meaningless)" if args.fake else "us"
    print(f"\n{args.random}, AR, {args.new_tokens} new tokens per prompt; tok/s and AR graph replay ({unit}) after "
          "them; x = replay / the first configuration's")
    print(f"| configuration | " + " | ".join(f"prompt {n}" for n in prompts) + " |")
    print("|---|" + "---|" * len(prompts))
    base = rows[0][1]
    for spec, cells in rows:
        print(f"| {spec} | " + " | ".join(f"{tps:.0f} tok/s, {us:.1f} ({us / b0[1]:.2f}x)"
                                          for (tps, us), b0 in zip(cells, base)) + " |")
    for budget in budgets:
        print(f"\nverify graph replay at budget {budget} ({unit}) after a DDTree generate; x = / the first "
              "configuration's")
        print(f"| configuration | " + " | ".join(f"prompt {n}" for n in prompts) + " |")
        print("|---|" + "---|" * len(prompts))
        for i, spec in enumerate(specs):
            print(f"| {spec} | " + " | ".join(
                f"{verify[(i, n, budget)]:.1f} ({verify[(i, n, budget)] / verify[(0, n, budget)]:.2f}x)"
                for n in prompts) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
