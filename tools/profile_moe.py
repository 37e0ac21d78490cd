"""One Kimi-size MoE layer forward (bench_moe's random weights and routing) for a profiler to attach to.

    ncu --clock-control none -k regex:moe_gmma_kernel -s 2 -c 2 \
        python -m tools.profile_moe --tokens 1024 --routing uniform --plan 'dict(gmma_min_tokens=1, gmma_pipe=6)'

The layer runs `--forwards` times eagerly (3 by default: skip the first forward's launches with ncu's -s to
profile a warm one). --plan is MoeLayer keyword arguments as a Python dict expression (default: the default
plan). Prints the stage names and the busiest expert's token count.
"""
from __future__ import annotations

import argparse
import ast

import numpy as np

from tools.bench_moe import make_weights, routing_logits


def parse_plan(text: str) -> dict:
    """A dict literal, or dict(key=literal, ...): MoeLayer keyword arguments."""
    node = ast.parse(text, mode="eval").body
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" and not node.args:
        return {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    value = ast.literal_eval(node)
    if not isinstance(value, dict):
        raise SystemExit(f"--plan: want a dict, got {text!r}")
    return value


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--routing", choices=("uniform", "skewed"), default="uniform")
    ap.add_argument("--plan", default="{}", help="MoeLayer keyword arguments, e.g. 'dict(gmma_pipe=6)'")
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--forwards", type=int, default=3)
    args = ap.parse_args(argv)
    plan = parse_plan(args.plan)
    from runtime import cuda
    from runtime.bf16 import to_bf16
    from runtime.kimi_kernels import MoeLayer
    cuda.get_device()
    rng = np.random.default_rng(0)
    weights = make_weights(args.experts, args.hidden, args.inter, rng)
    layer = MoeLayer(weights, args.tokens, np.zeros(args.experts, np.float32), **plan)
    layer.x.upload(to_bf16(rng.standard_normal((args.tokens, args.hidden)).astype(np.float32)))
    layer.logits.upload(routing_logits(args.tokens, args.experts, args.routing))
    stream = cuda.Stream()
    for _ in range(args.forwards):
        layer.forward(stream)
    stream.synchronize()
    print("stages", [name for name, _ in layer.stages], "max tokens per expert",
          int(layer.expert_count.download().max()))


if __name__ == "__main__":
    main()
