"""Verify step time vs budget on a random bf16 model (issue 6; DESIGN.md: "tree verify of budget 64 on a
bandwidth-bound model: <= 1.25x the time of a one-token decode step"), measured in one run.

    python -m tools.bench_verify                          # Qwen3-8B shape (16 GB), prefix 1024, budgets 16..256
    python -m tools.bench_verify --per-op 64              # + per-op table of AR vs verify at budget 64
    python -m tools.bench_verify --random qwen3-tiny --fake --prefix 32 --budgets 16,32   # CPU stand-in

How: a random-weight target of a tools.bench_e2e --random shape is built in memory (tools.bench_e2e.random_target:
one shared random pool, no checkpoint on disk) with a random DFlash drafter, and runtime.cuda_engine decodes a
few tokens in AR mode and in DDTree mode at each budget, which captures the real graphs (the largest budget
first, so the KV cache is sized once). Then the state block's prefix is set to --prefix and each graph (the
one-token AR step; the verify step of each budget's bucket: target forward over bucket + 1 slots, lm_head,
argmax, tap hidden states) is replayed and timed with events (median of --iters). Weight bytes per step are
the layers' weights plus lm_head and the final norm (the embedding is only gathered); "of read BW" compares
weights / step time with the streaming-read bandwidth measured in the same run (tools.bench_dense).
--per-op B re-runs the AR and budget-B verify steps op by op (tools.profile_step). On --fake the times are
host seconds of numpy stand-ins: meaningless; the run checks that the tool works end to end.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

TARGET_BUDGET, TARGET_RATIO = 64, 1.25          # DESIGN.md, "Numbers we hold ourselves to"


def main(argv=None) -> int:
    from tools.bench_e2e import RANDOM_SHAPES
    ap = argparse.ArgumentParser(prog="bench_verify", description=__doc__.split("\n\n")[0])
    ap.add_argument("--random", choices=sorted(RANDOM_SHAPES), default="qwen3-8b", help="model shape")
    ap.add_argument("--layers", type=int, help="override the number of layers (a quicker, smaller model)")
    ap.add_argument("--prefix", type=int, default=1024, help="KV prefix of the timed steps (prompt length)")
    ap.add_argument("--budgets", default="16,32,64,128,256", help="comma-separated DDTree budgets")
    ap.add_argument("--iters", type=int, default=20, help="timed replays per graph (median)")
    ap.add_argument("--per-op", type=int, default=0, metavar="B",
                    help="also profile the AR step and the verify step of budget B op by op (tools.profile_step)")
    ap.add_argument("--reps", type=int, default=10, help="--per-op: copies of each op per timing graph")
    ap.add_argument("--strict", action="store_true", help=f"exit 1 when verify at budget {TARGET_BUDGET} is over "
                    f"{TARGET_RATIO}x AR")
    ap.add_argument("--fake", action="store_true", help="run on the CPU stand-in (tests/fake_cuda.py); "
                    "times are meaningless, checks the tool end to end")
    args = ap.parse_args(argv)
    try:
        budgets = sorted({int(x) for x in args.budgets.split(",")}, reverse=True)
        if min(budgets) < 1 or args.prefix < 1:
            raise ValueError
    except ValueError:
        print(f"bench_verify: error: --budgets must be positive integers (got {args.budgets!r}) and --prefix "
              f"positive", file=sys.stderr)
        return 2
    if args.per_op and args.per_op not in budgets:
        budgets = sorted(set(budgets) | {args.per_op}, reverse=True)
    t0 = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t0:6.1f} s] bench_verify: {msg}", file=sys.stderr, flush=True)

    from tools.profile_step import (_time_graph, install_fake, print_op_table, profile, random_engine,
                                    remember_captures)
    if args.fake:
        install_fake()
    from runtime import cuda_engine as ce
    from runtime.backends.cuda_backend import CudaBackend
    from runtime.cuda import bucket_for

    b = CudaBackend(graphs=True)
    dev = b.device
    if args.fake:
        read_bw = None
    else:
        from tools.read_bandwidth import read_bandwidth
        log("measuring the streaming read bandwidth (2 GiB) ...")
        read_bw = read_bandwidth(stream=b.stream)

    n_layers = args.layers or RANDOM_SHAPES[args.random]["num_hidden_layers"]
    log(f"building a random {args.random} ({n_layers} layers) in memory and uploading it ...")
    every = max(1, n_layers // 6)

    def progress(i, n):
        if i % every == 0 and i:
            log(f"  layer {i}/{n}")
    engine, prompt = random_engine(b, args.random, args.layers, args.prefix, progress)
    target = engine.target
    b.stream.synchronize()
    w_bytes = weight_bytes(target)
    kv_bytes = n_layers * 2 * args.prefix * target.n_kv * target.head_dim * 2
    log(f"target uploaded: {w_bytes / 1e9:.2f} GB of weights read per step")

    with remember_captures() as fns:
        for bgt in budgets:                      # largest first: the KV cache is sized once for all graphs
            log(f"capturing the DDTree graphs of budget {bgt} (prefill {args.prefix}, a few rounds) ...")
            engine.generate(prompt, mode="ddtree", budget=bgt, max_new_tokens=4)
        log("capturing the AR graph (prefill, a few steps) ...")
        engine.generate(prompt, mode="ar", max_new_tokens=4)
    dec = ce.graph_decoder(engine)
    buckets = {bgt: bucket_for(bgt, ce.BUCKETS) for bgt in budgets}
    keys = {"AR": ("ar", 0.0), **{bgt: ("verify", bkt, 0.0) for bgt, bkt in buckets.items()}}
    missing = [k for k in keys.values() if k not in dec.graphs]
    if missing:
        raise RuntimeError(f"graphs {missing} were not captured (or were dropped when the KV cache grew)")

    # every step at the same prefix: start (and the AR step's position) = --prefix; each bucket keeps the
    # tree its last round wrote (its positions are a few tokens off, which changes no timing)
    S = dec.state
    S.h("start")[0] = S.h("ar_pos")[0] = args.prefix
    S.upload(0, S.head_words)
    b.stream.synchronize()
    times = {}
    for name, key in keys.items():
        log(f"timing {'AR' if name == 'AR' else f'verify budget {name}'} ({args.iters} replays) ...")
        times[name] = _time_graph(dec.graphs[key].exec, b.stream, args.fake, args.iters) * 1e3    # us

    ar = times["AR"]
    unit = "host us (fake: meaningless)" if args.fake else "GPU us"
    params = sum(int(np.prod(s)) for s in _shapes(target.spec))
    print(f"\n{args.random}, {n_layers} layers, {params / 1e9:.2f} B params, random bf16 weights, prefix "
          f"{args.prefix}, greedy; graph replay, median of {args.iters}, {unit}")
    print(f"device: {getattr(dev, 'name', dev)} ({dev.sm_count} SMs); streaming read "
          + ("- (fake)" if read_bw is None else f"{read_bw / 1e12:.3f} TB/s (tools.read_bandwidth)"))
    print(f"bytes per step: weights {w_bytes / 1e9:.2f} GB (layers + lm_head + norm; the embedding is gathered), "
          f"KV prefix {kv_bytes / 1e9:.3f} GB")
    print(f"{'step':16s} {'T':>5s} {'us':>10s} {'x AR':>6s} {'weights/t':>11s} {'of read BW':>10s}")
    for name in ["AR", *sorted(budgets)]:
        us = times[name]
        label, T = ("AR (1 token)", 1) if name == "AR" else (f"verify b{name}", buckets[name] + 1)
        if name != "AR" and buckets[name] != name:
            label += f" (bucket {buckets[name]})"
        rate = w_bytes / (us * 1e-6)
        frac = "-" if read_bw is None else f"{rate / read_bw:.1%}"
        print(f"{label:16s} {T:5d} {us:10.1f} {us / ar:6.2f} {rate / 1e12:8.3f} TB/s {frac:>10s}")
    ok = None
    if TARGET_BUDGET in times:
        r = times[TARGET_BUDGET] / ar
        ok = r <= TARGET_RATIO
        print(f"target: verify budget {TARGET_BUDGET} <= {TARGET_RATIO}x AR: {r:.2f}x "
              f"{'MET' if ok else 'MISSED'}{' (fake: meaningless)' if args.fake else ''}")
    else:
        print(f"target: verify budget {TARGET_BUDGET} <= {TARGET_RATIO}x AR: not measured (add {TARGET_BUDGET} to "
              f"--budgets)")

    if args.per_op:
        res = []
        for name, key in (("AR", keys["AR"]), (f"verify b{buckets[args.per_op]}", keys[args.per_op])):
            log(f"per-op profile of {name} ({args.reps} copies per op) ...")
            S.h("start")[0] = S.h("ar_pos")[0] = args.prefix
            S.upload(0, S.head_words)
            res.append((name, *profile(dec, key, fns[key], dec.graphs[key].ws, args.reps, 5, args.fake, ce.capture)))
        print_op_table(f"per op: {args.random}, {n_layers} layers, prefix {args.prefix}, verify bucket "
                       f"{buckets[args.per_op]} (T = {buckets[args.per_op] + 1})", res[0], res[1], unit, args.reps, 5)
        print("  (each op's copies re-read its weights: those under the 60 MB L2 (qkv, o at Qwen3-8B) come from L2 "
              "after the first copy, so the op rows can be faster than inside the step)")
    log(f"done in {time.perf_counter() - t0:.1f} s")
    return 1 if args.strict and ok is False else 0


def weight_bytes(target) -> int:
    """Bytes of weights one target step reads: every layer weight, the final norm and lm_head (not the
    embedding table, of which a step gathers T rows; a tied lm_head is the table and is read whole)."""
    total = target.norm.nbytes + target.lm_head.nbytes
    for L in target.layers:
        total += sum(getattr(L, f).nbytes for f in vars(L) if getattr(L, f) is not None)
    return total


def _shapes(spec):
    from loader.names import expected_tensors
    return [e.shape for e in expected_tensors(spec).values() if not e.optional]


if __name__ == "__main__":
    sys.exit(main())
