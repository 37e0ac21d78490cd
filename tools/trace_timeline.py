"""Per-warp timeline of one graph replay (runtime/cuda/trace.py): where a chain of launches spends the time between
kernels and beside a side stream. Sets DDTREE_TRACE=1 for itself, so its kernels are the traced builds (their own
cache entries: a cold cache compiles every family used once more).

    python3 tools/trace_timeline.py moe --tokens 1,2 --shared 1          # Kimi MoE layer + shared expert MLP
    python3 tools/trace_timeline.py moe --tokens 4 --routing skewed --plan 'dict(shared_fork="route")'
    python3 tools/trace_timeline.py step --random qwen3-8b --layers 2 --prefix 1024 --budgets 0,64   # 0: AR

For each graph: its replay time with the buffer detached and with the stamps written (medians of --iters; the
untraced build's own time comes from the benches), then a table of its launches in start order (blocks, warps, SMs held, first start / first and last dependency wait
/ last end in us from the first stamp, median warp time, gap after the previous launch), for kernels that count
their ring waits (the warp-specialized MoE hot tier) each warp's share of cycles spent waiting, and a text chart: per
launch the share of its warps running (shades) or waiting in their PDL wait (w), and the SMs in use. --out DIR
saves the records (runtime.cuda.trace.RECORD_DTYPE) as .npy per graph.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("DDTREE_TRACE", "1")   # before runtime.cuda is imported: the kernels' build options

import numpy as np  # noqa: E402


# the families each subcommand's graphs may launch (built up front, in parallel)
_MODEL = ("norm_rope", "dense_linear", "dense_linear_sm90", "dense_linear_narrow_sm90")
TRACED_FAMILIES = {"moe": (*_MODEL, "moe_routing", "moe_int4", "moe_int4_sm90"),
                   "step": (*_MODEL, "tree_attention", "tree_attention_sm90", "sampling", "engine_ops")}


def trace_replay(graph_exec, stream, buffer, iters: int):
    """(median us of a replay with the buffer detached (the traced build skipping its stamps), the same with the
    stamps written, the records of one more replay)."""
    from runtime import cuda
    times = []
    for stamps in (False, True):
        if stamps:
            buffer.install()
        else:
            buffer.close()
        buffer.reset(stream)
        times.append(cuda.bench(lambda: graph_exec.launch(stream), warmup=2, iters=iters, stream=stream) * 1e3)
    buffer.reset(stream)
    graph_exec.launch(stream)
    stream.synchronize()
    return times[0], times[1], buffer.read()


def report(label: str, us_off: float, us: float, records: np.ndarray, width: int, out: Path | None):
    from runtime.cuda import trace
    traces = trace.launches(records)
    span = max(t.end for t in traces) if traces else 0.0
    print(f"\n## {label}: replay {us_off:.1f} us without the stamps, {us:.1f} us with them (medians; the untraced "
          f"build's time comes from the benches), one replay's stamps span {span:.1f} us, {len(traces)} launches, "
          f"{len(records)} warps")
    print(trace.table(traces))
    print("peak blocks per SM at once (blocks x SMs):")
    print(trace.residency(traces))
    waits = trace.stalls(traces)
    if waits:
        print(waits)
    hot = [t for t in traces if t.name.startswith("moe_gmma")]
    cold = [t for t in traces if t.name in ("moe_gate_up", "moe_down")]
    if hot and cold:   # the MoE layer's two chains: do their blocks share SMs (session 39)?
        total, both = trace.shared_sm_time(hot, cold)
        print(f"hot tier (moe_gmma*) blocks: {total:.0f} SM-us, {both:.0f} of them beside a cold GEMM block "
              f"({100 * both / total:.1f}%)")
    print(trace.timeline(traces, width))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        name = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)
        np.save(out / f"{name}.npy", records)


def moe_main(args) -> None:
    from runtime import cuda
    from runtime.bf16 import to_bf16
    from runtime.cuda import trace
    from runtime.kimi_kernels import MoeLayer
    from tools.bench_moe import make_shared_mlp, make_weights, routing_logits
    from tools.profile_moe import parse_plan
    plan = parse_plan(args.plan)
    cuda.get_device()
    rng = np.random.default_rng(0)
    print(f"trace_timeline: random Kimi MoE weights ({args.experts} experts) ...", file=sys.stderr, flush=True)
    weights = make_weights(args.experts, args.hidden, args.inter, rng)
    shared = make_shared_mlp(args.hidden, args.inter * args.shared, rng) if args.shared else None
    buffer = trace.TraceBuffer(args.capacity)
    stream = cuda.Stream()
    for T in (int(t) for t in args.tokens.split(",")):
        for kind in args.routing.split(","):
            layer = MoeLayer(weights, T, np.zeros(args.experts, np.float32), shared_mlp=shared, **plan)
            layer.x.upload(to_bf16(rng.standard_normal((T, args.hidden)).astype(np.float32)))
            layer.logits.upload(routing_logits(T, args.experts, kind))
            layer.forward(stream)
            stream.synchronize()
            with cuda.capture(stream) as g:
                layer.forward(stream)
            ge = g.instantiate()
            us_off, us, records = trace_replay(ge, stream, buffer, args.iters)
            report(f"moe T={T} {kind}{' +shared' if shared else ''}", us_off, us, records, args.width, args.out)
            del ge, g, layer


def step_main(args) -> None:
    from runtime import cuda_engine as ce
    from runtime.backends.cuda_backend import CudaBackend
    from runtime.cuda import bucket_for, trace
    from tools.profile_step import random_engine
    b = CudaBackend(graphs=True)
    print(f"trace_timeline: building a random {args.random} ...", file=sys.stderr, flush=True)
    engine, prompt = random_engine(b, args.random, args.layers, args.prefix)
    buffer = trace.TraceBuffer(args.capacity)
    for budget in (int(x) for x in args.budgets.split(",")):
        if budget == 0:
            engine.generate(prompt, mode="ar", max_new_tokens=args.new_tokens)
            graph, label = ce.graph_decoder(engine).graphs[("ar", 0.0)], "AR"
        else:
            engine.generate(prompt, mode="ddtree", budget=budget, max_new_tokens=args.new_tokens)
            bucket = bucket_for(budget, ce.BUCKETS)
            graph, label = ce.graph_decoder(engine).graphs[("verify", bucket, 0.0)], f"verify b{bucket}"
        us_off, us, records = trace_replay(graph.exec, b.stream, buffer, args.iters)
        report(f"{args.random} {label} prefix {args.prefix}", us_off, us, records, args.width, args.out)


def main(argv=None) -> int:
    from tools.bench_e2e import RANDOM_SHAPES
    ap = argparse.ArgumentParser(prog="trace_timeline", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    moe = sub.add_parser("moe", help="one Kimi MoE layer's graph (random weights, bench_moe's routing)")
    moe.add_argument("--tokens", default="1", help="comma-separated T")
    moe.add_argument("--routing", default="uniform", help="uniform, skewed or both (comma-separated)")
    moe.add_argument("--shared", type=int, default=0, metavar="N", help="with N shared experts' bf16 MLP (0: none)")
    moe.add_argument("--plan", default="{}", help="MoeLayer keyword arguments, e.g. 'dict(shared_fork=\"start\")'")
    moe.add_argument("--experts", type=int, default=384)
    moe.add_argument("--hidden", type=int, default=7168)
    moe.add_argument("--inter", type=int, default=2048)
    step = sub.add_parser("step", help="the CUDA engine's AR / verify graph of a random model")
    step.add_argument("--random", choices=sorted(RANDOM_SHAPES), default="smollm2-135m", help="model shape")
    step.add_argument("--layers", type=int, help="override the number of layers")
    step.add_argument("--prefix", type=int, default=64, help="prompt length")
    step.add_argument("--budgets", default="0", help="comma-separated: 0 = the AR graph, else the verify graph of "
                      "that budget's bucket")
    step.add_argument("--new-tokens", type=int, default=4, help="tokens generated before the graph is traced")
    for p in (moe, step):
        p.add_argument("--iters", type=int, default=20, help="timed traced replays (median)")
        p.add_argument("--width", type=int, default=100, help="columns of the chart")
        p.add_argument("--capacity", type=int, default=1 << 20, help="warp records the buffer holds")
        p.add_argument("--out", type=Path, help="save each graph's records here (.npy)")
    args = ap.parse_args(argv)
    from runtime import cuda
    from runtime.cuda.nvrtc import TRACE_BUILD
    if not TRACE_BUILD:
        raise SystemExit("trace_timeline: DDTREE_TRACE is set to something other than 1 in the environment")
    cuda.get_device()
    from cutlass_kernels.registry import FAMILIES   # the traced builds in parallel first (a no-op once cached)
    cuda.compile_all([n for n in TRACED_FAMILIES[args.what] if n in FAMILIES], jobs=os.cpu_count())
    (moe_main if args.what == "moe" else step_main)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
