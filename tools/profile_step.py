"""Per-op GPU time of one AR step and one DDTree verify step of the graph-captured CUDA engine, side by side.

    python -m tools.profile_step                          # SmolLM2-135M shape, random weights, budget 64
    python -m tools.profile_step --budget 16 --prefix 512
    python -m tools.profile_step --layers 2 --fake        # CPU stand-in (tests/fake_cuda.py): plumbing only

How: a random model of a bench_e2e --random shape (weights in memory, tools.bench_e2e.random_target) is decoded for a few tokens through runtime.cuda_engine
(AR and DDTree at the bucket), which captures the real graphs. Then the captured function of each graph
(the AR step, the verify step) runs once more with every kernel-level op (runtime.dense_kernels entry, or the
backend's row copy) captured into its own small graph of `--reps` back-to-back copies of that op with the
same arguments, replayed and timed with events: GPU time per call including the graph-node cost, the op
alone on the GPU. The ops' sum is printed next to the whole graph's replay time; the gap is what running
them together adds or saves (L2 reuse, dependencies). Every op writes only its own output, so repeating it
changes nothing. The copies re-read the same weights, so an op's W comes from L2 after the first copy (a
SmolLM2 layer's largest W is 3.5 MB: < 1 us at HBM rate, small next to the per-kernel latency measured here).

A/B of the verify fixes in one session: DDTREE_LINEAR_REDUCE_ILP=1 DDTREE_LINEAR_72_ROWS=0 selects the
previous split-K reduce and the 64 + 1-row token tiling for M = 65 (runtime/dense_kernels.py, registry). On --fake the times are host seconds of numpy stand-ins: meaningless, the run only checks
that the tool works end to end.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from contextlib import contextmanager

import numpy as np

OPS = ("linear", "embedding", "rmsnorm", "rope", "rope_qkv_cache", "swiglu", "add", "attention", "argmax", "sample",
       "log_softmax_topk", "kv_compact")


class _KeepAlive:
    """Eager allocations kept referenced until the profile is done (an op graph replays into them)."""

    def __init__(self):
        self.arrays = []

    def alloc(self, shape, dtype):
        from runtime.backends.cuda_backend import CudaArray
        from runtime.cuda import empty
        a = empty(shape, dtype)
        self.arrays.append(a)
        return CudaArray(a.ptr, shape, dtype, owner=a.owner)


def _linear_names(tgt) -> dict:
    hq, hk = tgt.n_heads * tgt.head_dim, tgt.n_kv * tgt.head_dim
    H = tgt.hidden_size
    inter = tgt.layers[0].down.shape[1]
    return {(hq + 2 * hk, H): "qkv", (H, hq): "o", (2 * inter, H): "gate_up", (H, inter): "down",
            (tgt.vocab_size, H): "lm_head"}


def _label(name, args, kwargs, lin_names, sm_count) -> tuple[str, str]:
    """(op label, launch plan note) of one dense_kernels call."""
    from runtime import dense_kernels as dk
    if name == "linear":
        x, w = args[0], args[1]
        M, (N, K) = x.shape[0], w.shape
        prologue = kwargs.get("prologue", "none")
        kernel = kwargs.get("kernel", "auto")
        fused = "" if prologue == "none" else f" (+{prologue})"
        label = f"linear {lin_names.get((N, K), f'{N}x{K}')}{fused}"
        from runtime import dense_gmma as dg
        if kernel == "auto" and prologue == "none" and dg.gmma_wanted(M, N, K):  # what linear() hands over
            entry, grid, _, _ = dg.gmma_plan(M, N, K, sm_count, kwargs.get("splits"),
                                             cluster_slots=dg.device_cluster_slots)
            return label, f"{entry.replace('linear_gmma_kernel', 'gmma')} grid {grid}"
        entry, grid, kps, _ = dk.linear_plan(M, N, K, sm_count, kwargs.get("splits"), kernel,
                                             kwargs.get("stages"), kwargs.get("rt", 1), dk.PROLOGUES[prologue])
        return label, f"{entry.replace('linear_bf16_', '')} grid {grid}"
    if name == "rmsnorm":
        return ("rmsnorm+add" if kwargs.get("residual") is not None else "rmsnorm"), ""
    if name == "attention":
        q, k_cache = args[0], args[1]
        T, max_keys = kwargs.get("T") or q.shape[0], kwargs.get("max_keys")
        kernel = dk.attention_kernel_for(T, q.shape[-2], k_cache.shape[-2], q.shape[-1], kwargs.get("kernel"))
        splits = (dk.attention_grid_splits(dk.attention_split_table(T, q.shape[-2], k_cache.shape[-2], q.shape[-1],
                                                                    k_cache.shape[0], sm_count, kernel)[1], max_keys)
                  if max_keys else "?")
        return "attention", (f"{kernel} T={T} max_keys={max_keys} kv splits planned at max_keys={splits} "
                             "(+ combine when > 1)")
    return name, ""


class OpProfiler:
    """While active: each dense_kernels op (and the backend's row copy) is captured `reps` times into its own
    graph, that graph launched once (so the step's data flows on) and kept for timing."""

    def __init__(self, backend, capture, lin_names, reps: int):
        self.b, self.capture, self.lin_names, self.reps = backend, capture, lin_names, reps
        self.records: list = []          # (label, plan, graph exec)
        self._inside = False

    def _wrap(self, name, real):
        prof = self

        def run(*args, **kwargs):
            if prof._inside:
                return real(*args, **kwargs)
            if name == "_copy_rows":
                # (backend, dst, ldd, src, lds, rows, row_elems, itemsize, row0, row_offset): a device
                # row_offset is the KV append of a captured step
                offset = kwargs.get("row_offset", args[9] if len(args) > 9 else None)
                label, plan = ("kv_write" if offset is not None else "copy_rows (concat/contiguous)"), ""
            else:
                label, plan = _label(name, args, kwargs, prof.lin_names, prof.b.device.sm_count)
            prof._inside = True
            try:
                with prof.capture(prof.b.stream) as cap:
                    for _ in range(prof.reps):
                        out = real(*args, **kwargs)
            finally:
                prof._inside = False
            g = cap.instantiate()
            g.launch(prof.b.stream)
            prof.records.append((label, plan, g))
            return out
        return run

    @contextmanager
    def active(self):
        from runtime import dense_kernels as dk
        from runtime.backends.cuda_backend import CudaBackend
        saved = {n: getattr(dk, n) for n in OPS}
        saved_copy = CudaBackend._copy_rows
        for n in OPS:
            setattr(dk, n, self._wrap(n, saved[n]))
        CudaBackend._copy_rows = self._wrap("_copy_rows", saved_copy)     # a method: args[0] is the backend
        try:
            yield self
        finally:
            for n in OPS:
                setattr(dk, n, saved[n])
            CudaBackend._copy_rows = saved_copy


def _time_graph(g, stream, fake: bool, iters: int) -> float:
    """Median ms of one replay."""
    if fake:
        ts = []
        for _ in range(iters):
            t = time.perf_counter()
            g.launch(stream)
            ts.append((time.perf_counter() - t) * 1e3)
        return statistics.median(ts)
    from runtime.cuda import bench
    return bench(lambda: g.launch(stream), warmup=2, iters=iters, stream=stream)


def profile(dec, key, fn, ws, reps: int, iters: int, fake: bool, capture) -> tuple[list, float]:
    """[(label, plan, us per call)] for every op of fn, in launch order, and the whole graph's replay us."""
    b = dec.b
    prof = OpProfiler(b, capture, _linear_names(dec.target), reps)
    keep = _KeepAlive()
    gc.collect()
    gc.disable()                     # no buffer may be freed while an op graph is being captured
    try:
        with b.recording(keep, ws), prof.active():
            fn()
        b.stream.synchronize()
    finally:
        gc.enable()
    ops = [(label, plan, _time_graph(g, b.stream, fake, iters) / reps * 1e3) for label, plan, g in prof.records]
    whole = _time_graph(dec.graphs[key].exec, b.stream, fake, max(iters, 10)) * 1e3
    b.stream.synchronize()
    return ops, whole


def _table(ops) -> dict:
    out: dict = {}
    for label, plan, us in ops:
        r = out.setdefault(label, {"count": 0, "us": 0.0, "plans": []})
        r["count"] += 1
        r["us"] += us
        if plan and plan not in r["plans"]:
            r["plans"].append(plan)
    return out


def install_fake():
    """Point the CUDA layer at tests/fake_cuda.py's CPU stand-in for the rest of the process (tools' --fake)."""
    import os
    from _pytest.monkeypatch import MonkeyPatch
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from fake_cuda import install
    return install(MonkeyPatch())


@contextmanager
def remember_captures():
    """While active, every graph runtime.cuda_engine captures leaves its step function in the yielded dict
    under the graph's key (profile() re-runs it op by op)."""
    from runtime import cuda_engine as ce
    fns: dict = {}
    real_capture = ce.GraphDecoder._capture

    def remember(self, key, fn, *args, **kwargs):
        fns.setdefault(key, fn)
        return real_capture(self, key, fn, *args, **kwargs)
    ce.GraphDecoder._capture = remember
    try:
        yield fns
    finally:
        ce.GraphDecoder._capture = real_capture


def print_op_table(title: str, ar: tuple, verify: tuple, unit: str, reps: int, iters: int):
    """The per-op table of two profiled graphs; ar and verify are (name, ops, whole graph us) with ops as
    profile() returns them."""
    (na, ops_a, whole_a), (nv, ops_v, whole_v) = ar, verify
    ta, tv = _table(ops_a), _table(ops_v)
    sa, sv = sum(u for *_, u in ops_a), sum(u for *_, u in ops_v)
    labels = sorted(set(ta) | set(tv), key=lambda k: -max(ta.get(k, {}).get("us", 0), tv.get(k, {}).get("us", 0)))
    print(f"\n{title}; {unit} per step; one op = {reps} copies in a graph, median of {iters}")
    print(f"{'op':30s} | {'AR n':>5s} {'us':>8s} {'us/call':>8s} {'share':>6s} | {'verify n':>8s} {'us':>8s} "
          f"{'us/call':>8s} {'share':>6s} | {'v/AR':>6s}")
    for k in labels:
        a, v = ta.get(k, {"count": 0, "us": 0.0}), tv.get(k, {"count": 0, "us": 0.0})
        pa = a["us"] / a["count"] if a["count"] else 0.0
        pv = v["us"] / v["count"] if v["count"] else 0.0
        ratio = f"{v['us'] / a['us']:6.2f}" if a["us"] > 0 else "     -"
        print(f"{k:30s} | {a['count']:5d} {a['us']:8.1f} {pa:8.2f} {a['us'] / sa:6.1%} | {v['count']:8d} "
              f"{v['us']:8.1f} {pv:8.2f} {v['us'] / sv:6.1%} | {ratio}")
    print(f"{'sum of ops':30s} | {len(ops_a):5d} {sa:8.1f} {'':8s} {'':6s} | {len(ops_v):8d} {sv:8.1f} {'':8s} "
          f"{'':6s} | {sv / sa:6.2f}")
    print(f"{'whole graph replay':30s} | {'':5s} {whole_a:8.1f} {'':8s} {'':6s} | {'':8s} {whole_v:8.1f} {'':8s} "
          f"{'':6s} | {whole_v / whole_a:6.2f}")
    print("\nlaunch plans (kernel <template args> grid):")
    for k in labels:
        for name, t in ((na, ta), (nv, tv)):
            if k in t and t[k]["plans"]:
                print(f"  {k:18s} {name:10s} {'; '.join(t[k]['plans'][:3])}")


def random_engine(backend, shape: str, layers: int | None, prefix: int, progress=None):
    """(Engine, prompt): a random-weight target of a tools.bench_e2e --random shape (`layers` overrides its
    depth) built in memory on `backend`, a random DFlash drafter, and a `prefix`-token random prompt."""
    from runtime.engine import Engine
    from tools.bench_e2e import RANDOM_SHAPES, random_drafter, random_target
    cfg = dict(RANDOM_SHAPES[shape])
    if layers:
        cfg["num_hidden_layers"] = layers
    target = random_target(cfg, backend, progress=progress)
    engine = Engine(target, random_drafter(target, backend))
    prompt = [int(x) for x in np.random.default_rng(0).integers(16, min(32000, target.vocab_size), prefix)]
    return engine, prompt


def main(argv=None) -> int:
    from tools.bench_e2e import RANDOM_SHAPES
    ap = argparse.ArgumentParser(prog="profile_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--random", choices=sorted(RANDOM_SHAPES), default="smollm2-135m", help="model shape")
    ap.add_argument("--layers", type=int, help="override the number of layers (a quicker, smaller model)")
    ap.add_argument("--budget", type=int, default=64, help="DDTree budget (its bucket is profiled)")
    ap.add_argument("--prefix", type=int, default=64, help="prompt length (the KV prefix of the steps)")
    ap.add_argument("--reps", type=int, default=10, help="copies of each op per timing graph")
    ap.add_argument("--iters", type=int, default=5, help="timed replays per graph (median)")
    ap.add_argument("--fake", action="store_true", help="run on the CPU stand-in (tests/fake_cuda.py); "
                    "times are meaningless, checks the tool end to end")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    if args.fake:
        install_fake()

    from runtime import cuda_engine as ce
    from runtime.backends.cuda_backend import CudaBackend

    b = CudaBackend(graphs=True)
    print(f"profile_step: random {args.random} ({args.layers or RANDOM_SHAPES[args.random]['num_hidden_layers']} "
          f"layers) ...", file=sys.stderr)
    engine, prompt = random_engine(b, args.random, args.layers, args.prefix)

    with remember_captures() as fns:
        print("profile_step: capturing graphs and decoding a few tokens (AR, DDTree) ...", file=sys.stderr)
        engine.generate(prompt, mode="ar", max_new_tokens=4)
        engine.generate(prompt, mode="ddtree", budget=args.budget, max_new_tokens=8)
    dec = ce.graph_decoder(engine)
    bkt = next(k[1] for k in dec.graphs if k[0] == "verify")
    keys = {"AR": ("ar", 0.0), f"verify b{bkt}": ("verify", bkt, 0.0)}
    res = []
    for name, key in keys.items():
        print(f"profile_step: profiling {name} ...", file=sys.stderr)
        res.append((name, *profile(dec, key, fns[key], dec.graphs[key].ws, args.reps, args.iters, args.fake,
                                   ce.capture)))
    unit = "host us (fake: meaningless)" if args.fake else "GPU us"
    print_op_table(f"{args.random}, {engine.target.num_layers} layers, prefix {args.prefix}, verify bucket {bkt} "
                   f"(T = {bkt + 1})", res[0], res[1], unit, args.reps, args.iters)
    print(f"\nprofile_step: {time.perf_counter() - t_start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
