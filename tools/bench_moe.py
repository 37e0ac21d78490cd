"""Benchmark the INT4 W4A16 MoE layer at Kimi K2.x size (384 experts x [7168 -> 2x2048 -> 7168], top-8, g32).

Prints, per token count T and routing (uniform / skewed): distinct experts, their bytes (packed + scales),
the graph-replayed layer time, per-stage times, the GEMM bandwidth as a fraction of the read bandwidth
measured in the same run, every kernel variant of the registry table, and a torch bf16 per-expert loop
(the alternative a user has) as a ratio. Weights are random bytes in the kernel layout (any bytes are valid
INT4 codes); scales are random positive bf16 of the checkpoint's magnitude.

    python -m tools.bench_moe [--tokens 1,2,4,...] [--experts 384] [--no-variants] [--no-plans] [--torch]
    python -m tools.bench_moe --torch-only F     # time the torch loop alone (its own process), write JSON F
    --torch runs that child first (same tokens, routings and shapes) and prints the ratios; --torch-json F reads
    the times of an earlier --torch-only run instead.

Launch plans (unless --no-plans): the whole layer graph-replayed with each MoeLayer plan, in the same run:
"before" (moe_topk + moe_group, gate_up, down, moe_combine; no PDL), then one change at a time: fused
routing, combine folded into down, PDL, early weight start in down (= the default plan at small T), and the
default plan with the combine choice flipped (to place FUSE_COMBINE_MAX_TOKENS), the default plan with plain launches,
with PDL, with PDL + early start ("nopdl", "pdl", "pdl+early"); then the wgmma hot-expert
plans (gmma>=N: experts with >= N tokens on moe_int4_sm90.cu; /128, /256 token tiles; /ra, /ra2, /ws, /shallow
the pipeline; /ov the hot chain on a second stream; tiers...: pipelines split by token count).

--shared N: the layer with N shared experts' bf16 MLP computed by it (MoeLayer(shared_mlp=...)): on its side stream
beside the routing and the routed GEMMs (the default), every stage on one stream, and the sum of the two alone; the
% of the read then counts the routed experts' and the shared MLP's bytes.

The torch loop runs in its own process (torch and the runtime's CUDA wheels in one process clashed on the
device image); both processes route the same logits (seeded per routing and T), so the ratio compares the
same work, measured in the same device session.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from tools.read_bandwidth import read_bandwidth


def random_fill(arr, rng, kind: str):
    """Fill a device array with random packed words ('q') or bf16 scales ('s') from a reused host block."""
    from runtime.bf16 import to_bf16
    flat = arr.view(0, (arr.size,))
    block = (rng.integers(0, 1 << 32, size=1 << 24, dtype=np.uint32).astype(arr.dtype) if kind == "q"
             else to_bf16(rng.uniform(0.5, 1.5, size=1 << 24).astype(np.float32) * 0.004))
    for off in range(0, arr.size, block.size):
        n = min(block.size, arr.size - off)
        flat.view(off, (n,)).upload(block[:n])


def make_weights(E: int, hidden: int, inter: int, rng):
    from runtime import cuda
    from runtime.kimi_kernels import MoeWeights
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    arrays = []
    for name in ("gate", "up", "down"):
        n, k = shapes[name]
        q = cuda.empty((E, n // 16, k // 64, 32, 4), np.uint32)
        s = cuda.empty((E, n // 16, k // 512, 16, 8, 2), np.uint16)
        random_fill(q, rng, "q")
        random_fill(s, rng, "s")
        arrays += [q, s]
    return MoeWeights(E, hidden, inter, *arrays)


# --shared: MoeLayer's shared_fork placements (the default at each T: kimi_kernels.default_shared_fork; the other one
# is timed beside it)
SHARED_FORKS = {"start": "fork at start", "route": "fork after routing"}


def make_shared_mlp(hidden: int, inter: int, rng):
    """The shared expert's bf16 MLP (gate_up [2 I, H], down [H, I]) with random bf16 weights on the device."""
    from runtime import cuda
    from runtime.kimi_kernels import SharedExpertMlp
    gate_up, down = cuda.empty((2 * inter, hidden), np.uint16), cuda.empty((hidden, inter), np.uint16)
    for a in (gate_up, down):
        random_fill(a, rng, "s")
    return SharedExpertMlp(gate_up, down)


def routing_logits(T: int, E: int, kind: str) -> np.ndarray:
    rng = np.random.default_rng(1000 * T + (kind == "skewed"))
    logits = rng.standard_normal((T, E)).astype(np.float32)
    if kind == "skewed":   # Zipf-like popularity: a few experts take a large share of the tokens
        pop = -np.log1p(np.arange(E, dtype=np.float32))
        logits += pop[rng.permutation(E)][None, :]
    return logits


class TorchLoop:
    """bf16 per-expert loop in torch (gate+up fused weight, down weight), token lists prepared outside."""

    def __init__(self, E, hidden, inter):
        import torch
        self.torch = torch
        self.w1 = torch.empty((E, 2 * inter, hidden), dtype=torch.bfloat16, device="cuda").normal_(0, 0.02)
        self.w2 = torch.empty((E, hidden, inter), dtype=torch.bfloat16, device="cuda").normal_(0, 0.02)
        self.inter = inter

    def time_ms(self, ids, w, iters=5):
        from tools.torch_timing import torch_seconds
        torch = self.torch
        T = ids.shape[0]
        x = torch.randn((T, self.w1.shape[2]), dtype=torch.bfloat16, device="cuda")
        w_t = torch.as_tensor(w, device="cuda")
        experts = np.unique(ids)
        plan = []
        for e in experts:
            tok, j = np.nonzero(ids == e)
            plan.append((int(e), torch.as_tensor(tok, device="cuda"), w_t[torch.as_tensor(tok, device="cuda"),
                                                                          torch.as_tensor(j, device="cuda")]))

        def run():
            y = torch.zeros((T, x.shape[1]), dtype=torch.float32, device="cuda")
            for e, tok, we in plan:
                xe = x[tok]
                gu = xe @ self.w1[e].T
                h = torch.nn.functional.silu(gu[:, :self.inter]) * gu[:, self.inter:]
                y.index_add_(0, tok, (h @ self.w2[e].T).float() * we[:, None])
            return y

        return torch_seconds(run, iters, warmup=2) * 1e3, len(experts) * 3 * self.inter * x.shape[1] * 2


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512,1024")
    ap.add_argument("--routing", default="uniform,skewed")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--no-variants", action="store_true")
    ap.add_argument("--no-plans", action="store_true", help="skip the launch-plan comparison")
    ap.add_argument("--plans", default="", help="comma list of plan labels to time (default: all); a label ending in"
                    " '*' selects every label that starts with the rest")
    ap.add_argument("--shared", type=int, default=0, metavar="N", help="also time the layer with N shared experts' "
                    "bf16 MLP (N x inter wide; Kimi K2: 1) computed by it: on its side stream (the default) and "
                    "with every stage on one stream, same run; %% BW then counts the shared weights too")
    ap.add_argument("--torch-only", metavar="JSON", help="time only the torch bf16 loop, write results here")
    ap.add_argument("--torch-json", metavar="JSON", help="torch loop times from a --torch-only run")
    ap.add_argument("--torch", action="store_true", help="run the torch loop first (a --torch-only child process, "
                    "before this process touches the GPU) and print our speedup over it")
    args = ap.parse_args(argv)
    if args.torch_only:
        return torch_main(args)
    if args.torch and not args.torch_json:
        args.torch_json = run_torch_child(args)
    from cutlass_kernels.registry import MOE_GEMM_VARIANTS
    from runtime import cuda
    from runtime.bf16 import to_bf16
    from runtime.kimi_kernels import MoeLayer, default_shared_fork, default_shared_kernel, variant_params
    from runtime.dense_kernels import gemv_fits
    dev = cuda.require_device()
    print(f"device: {dev.name}, sm_{dev.arch}, {dev.sm_count} SMs", flush=True)
    bw = read_bandwidth(4 << 30)
    print(f"measured read bandwidth: {bw / 1e12:.3f} TB/s", flush=True)
    rng = np.random.default_rng(0)
    t0 = time.time()
    weights = make_weights(args.experts, args.hidden, args.inter, rng)
    per_expert = weights.bytes_per_expert
    print(f"weights: {args.experts} experts x {per_expert / 1e6:.2f} MB = {args.experts * per_expert / 1e9:.2f} GB "
          f"(packed + scales), filled in {time.time() - t0:.1f} s", flush=True)
    mlp = make_shared_mlp(args.hidden, args.shared * args.inter, rng) if args.shared else None
    if mlp is not None:
        print(f"shared expert MLP: {args.hidden} -> 2 x {mlp.inter} -> {args.hidden} bf16, {mlp.nbytes / 1e6:.1f} MB",
              flush=True)
    shared_rows = {}
    torch_times = {}
    if args.torch_json:
        try:
            torch_times = json.load(open(args.torch_json))
        except (OSError, ValueError) as e:
            print(f"no torch loop times: {e}")
    stream = cuda.Stream()
    rows = []
    plan_rows = {}
    for kind in args.routing.split(","):
        for T in (int(v) for v in args.tokens.split(",")):
            layer = MoeLayer(weights, T, np.zeros(args.experts, np.float32))
            x = rng.standard_normal((T, args.hidden)).astype(np.float32)
            layer.x.upload(to_bf16(x))
            logits = routing_logits(T, args.experts, kind)
            layer.logits.upload(logits)
            layer.forward(stream)
            stream.synchronize()
            counts = layer.expert_count.download()
            distinct = int((counts > 0).sum())
            nbytes = distinct * per_expert
            try:
                t_graph, stage_times = time_plan(weights, T, args.experts, x, logits, {}, args.iters,
                                                 without_route=True)
            except Exception as e:   # report, keep the other token counts
                print(f"{kind:8s} T={T:4d}: default plan failed ({type(e).__name__}: {e})", flush=True)
                continue
            names = [name for name, _ in layer.stages]
            st = {"route": 0.0, "gate_up_hot": 0.0, "gate_up": 0.0, "down_hot": 0.0, "down": 0.0, "combine": 0.0,
                  **dict(stage_times)}
            gemm = st["gate_up_hot"] + st["gate_up"] + st["down_hot"] + st["down"]
            line = (f"{kind:8s} T={T:4d} experts={distinct:3d} max/expert={counts.max():4d} "
                    f"bytes={nbytes / 1e9:6.3f} GB | graph {t_graph * 1e3:8.1f} us "
                    f"({nbytes / (t_graph * 1e-3) / bw * 100:5.1f}% BW) | gemms {gemm * 1e3:8.1f} us "
                    f"({nbytes / (gemm * 1e-3) / bw * 100:5.1f}% BW) | route {st['route'] * 1e3:.1f} "
                    f"gate_up {st['gate_up_hot'] * 1e3:.1f}+{st['gate_up'] * 1e3:.1f} down {st['down_hot'] * 1e3:.1f}+"
                    f"{st['down'] * 1e3:.1f} combine {st['combine'] * 1e3:.1f} us (hot + rest) "
                    f"[{layer.variants[0][16:]}, {layer.variants[1][16:]}] {len(names)} launches"
                    f"{' (combine in down)' if layer.fuse_combine else ''}"
                    f" | without routing{' (nor signals)' if layer.signals else ''} "
                    f"{st['without route'] * 1e3:.1f} us")
            tt = torch_times.get(f"{kind}/{T}")
            if tt is not None:
                line += (f" | torch bf16 loop {tt[0] * 1e3:.0f} us ({tt[1] / (tt[0] * 1e-3) / 1e12:.2f} TB/s), "
                         f"ours {tt[0] / t_graph:.1f}x faster")
            print(line, flush=True)
            if mlp is not None:
                try:
                    t_ov, st_sh = time_plan(weights, T, args.experts, x, logits, {"shared_mlp": mlp}, args.iters,
                                            one_stream=True)
                    default_fork = default_shared_fork(T)
                    forks = {SHARED_FORKS[f]: time_plan(weights, T, args.experts, x, logits,
                                                        {"shared_mlp": mlp, "shared_fork": f}, args.iters)[0]
                             for f in SHARED_FORKS if f != default_fork}
                    for kernel in ("gemv", "auto"):   # the shared linears' other kernel choice, where gemv fits
                        if kernel != default_shared_kernel(T) and gemv_fits(T, args.hidden):
                            forks[f"shared {kernel}"] = time_plan(weights, T, args.experts, x, logits,
                                                                  {"shared_mlp": mlp, "shared_kernel": kernel},
                                                                  args.iters)[0]
                    # the branch's first kernel with PDL where it is plain by default (fork "route": no weight
                    # prefetch beside the routing), else plain
                    plain = default_fork != "route"
                    forks["plain start" if plain else "PDL start"] = time_plan(
                        weights, T, args.experts, x, logits, {"shared_mlp": mlp, "shared_plain_start": plain},
                        args.iters)[0]
                except Exception as e:
                    print(f"    + shared MLP failed ({type(e).__name__}: {e})", flush=True)
                else:
                    st_sh = dict(st_sh)
                    t_one, t_alone, sb = st_sh["one stream"], st_sh["shared"], nbytes + mlp.nbytes
                    shared_rows[(kind, T)] = (t_ov, t_one, t_alone, sb)
                    print(f"    + shared MLP ({mlp.nbytes / 1e6:.0f} MB): side stream ({SHARED_FORKS[default_fork]}, "
                          f"the default) {t_ov * 1e3:.1f} us "
                          f"({sb / (t_ov * 1e-3) / bw * 100:.1f}% BW) | one stream {t_one * 1e3:.1f} us "
                          f"({sb / (t_one * 1e-3) / bw * 100:.1f}%) | shared MLP alone {t_alone * 1e3:.1f} us "
                          f"({mlp.nbytes / (t_alone * 1e-3) / bw * 100:.1f}%) | layer alone {t_graph * 1e3:.1f} us"
                          + "".join(f" | {label} {t * 1e3:.1f} us ({sb / (t * 1e-3) / bw * 100:.1f}%)"
                                    for label, t in forks.items()), flush=True)
            if not args.no_variants:
                gu_bytes = distinct * (weights.gate_q.nbytes + weights.gate_s.nbytes + weights.up_q.nbytes +
                                       weights.up_s.nbytes) / args.experts
                dn_bytes = distinct * (weights.down_q.nbytes + weights.down_s.nbytes) / args.experts
                parts = []
                # the token counts the layer's mma.sync GEMMs see: without the hot experts where they run on
                # the wgmma kernel (the % then still counts every distinct expert's bytes)
                cold = getattr(layer, "cold_count", None)
                for entry in MOE_GEMM_VARIANTS:
                    mode = variant_params(entry)[0]
                    w = weights
                    try:
                        launch = (layer._gemm_launch(entry, layer.x, w.hidden, w.gate_q, w.gate_s, w.up_q, w.up_s,
                                                     w.inter, w.hidden, layer.h, counts=cold) if mode == 0 else
                                  layer._gemm_launch(entry, layer.h, w.inter, w.down_q, w.down_s, w.down_q,
                                                     w.down_s, w.hidden, w.inter, layer.down_out, counts=cold))
                    except ValueError as e:   # a variant that does not fit these shapes: say so, time the rest
                        parts.append(f"{entry[16:]} n/a ({e})")
                        continue
                    ms = cuda.bench(lambda: launch(stream), iters=args.iters, stream=stream)
                    frac = (gu_bytes if mode == 0 else dn_bytes) / (ms * 1e-3) / bw
                    parts.append(f"{entry[16:]} {ms * 1e3:.1f}us {frac * 100:.0f}%")
                print(f"    variants{' (cold experts only)' if cold is not None else ''}: " + "; ".join(parts),
                      flush=True)
            if not args.no_plans:
                parts = []
                for label, plan in select_plans(launch_plans(layer.fuse_combine, T), args.plans):
                    try:
                        ms, stages = time_plan(weights, T, args.experts, x, logits, plan, args.iters)
                    except Exception as e:   # keep the run going: report and move on
                        parts.append(f"{label} failed ({type(e).__name__}: {e})")
                        continue
                    parts.append(f"{label} {ms * 1e3:.1f}us {nbytes / (ms * 1e-3) / bw * 100:.1f}% "
                                 f"[{' '.join(f'{n} {v * 1e3:.1f}' for n, v in stages)}]")
                    plan_rows.setdefault((kind, T), {})[label] = ms
                print("    plans (graph replay; [each stage alone, graph-replayed]):\n      " + "\n      ".join(parts),
                      flush=True)
            rows.append((kind, T, distinct, nbytes, t_graph, gemm, tt[0] if tt else float("nan")))
    print("\nsummary (graph replay of the whole layer: routing + gate_up + down + combine)")
    print(f"{'routing':8s} {'T':>4s} {'experts':>7s} {'GB':>7s} {'us':>8s} {'TB/s':>6s} {'%BW':>6s} {'gemm %BW':>8s} "
          f"{'torch us':>9s} {'speedup':>7s}")
    for kind, T, distinct, nbytes, t_graph, gemm, t_torch in rows:
        print(f"{kind:8s} {T:4d} {distinct:7d} {nbytes / 1e9:7.3f} {t_graph * 1e3:8.1f} "
              f"{nbytes / (t_graph * 1e-3) / 1e12:6.2f} {nbytes / (t_graph * 1e-3) / bw * 100:6.1f} "
              f"{nbytes / (gemm * 1e-3) / bw * 100:8.1f} {t_torch * 1e3:9.0f} {t_torch / t_graph:7.1f}")
    if shared_rows:
        print(f"\nthe layer + the shared expert's MLP ({mlp.nbytes / 1e6:.0f} MB bf16), graph replay us (% read BW of "
              f"routed + shared bytes); 'sum' = layer alone + shared MLP alone")
        print(f"{'routing':8s} {'T':>4s} {'side stream':>15s} {'one stream':>15s} {'sum':>15s} {'side/one':>8s}")
        for kind, T, distinct, nbytes, t_graph, *_ in rows:
            if (kind, T) not in shared_rows:
                continue
            t_ov, t_one, t_alone, sb = shared_rows[(kind, T)]
            cells = [f"{t * 1e3:7.1f} ({sb / (t * 1e-3) / bw * 100:4.1f})" for t in (t_ov, t_one, t_graph + t_alone)]
            print(f"{kind:8s} {T:4d} " + " ".join(f"{c:>15s}" for c in cells) + f" {t_ov / t_one:8.3f}")
    if plan_rows:
        labels = list(dict.fromkeys(label for vals in plan_rows.values() for label in vals))
        print("\nlaunch plans, graph replay us (% read BW)")
        print(f"{'routing':8s} {'T':>4s} " + " ".join(f"{lb:>16s}" for lb in labels))
        for kind, T, distinct, nbytes, *_ in rows:
            vals = plan_rows.get((kind, T), {})
            print(f"{kind:8s} {T:4d} " + " ".join(
                f"{vals[lb] * 1e3:8.1f} ({nbytes / (vals[lb] * 1e-3) / bw * 100:4.1f})" if lb in vals else f"{'-':>16s}"
                for lb in labels))


def time_plan(weights, T, E, x, logits, plan, iters, one_stream=False, without_route=False):
    """Graph-replay ms of a MoeLayer built with `plan`, and of each of its stages captured alone (a stage's
    eager launch time would be the host's launch overhead for the small kernels); one_stream: also every stage in
    order on one stream, as the stage "one stream" (no side-stream branches); without_route: also the stages after
    the routing in one graph, on the routing outputs of an earlier forward, as the stage "without route" (what the
    layer would take if its routing cost nothing: a bound for moving the routing into the GEMMs; from the plan
    without signals where it has them, as the stages alone). Own stream; the runtime holds back frees and graph
    destroys while a capture is open (they would invalidate it), and garbage collection is off around the captures
    besides, so that no other finalizer runs inside one."""
    import gc
    from runtime import cuda
    from runtime.bf16 import to_bf16
    from runtime.kimi_kernels import MoeLayer, default_variants
    if "gate_up" in plan or "down" in plan:   # one GEMM's variant by its parameters, the other T's default
        plan = dict(plan)
        gate_up, down = default_variants(T, weights.hidden)
        variants = (f"moe_w4a16_kernel<{plan.pop('gate_up')}>" if "gate_up" in plan else gate_up,
                    f"moe_w4a16_kernel<{plan.pop('down')}>" if "down" in plan else down)
        plan["variants"] = variants
    layer = MoeLayer(weights, T, np.zeros(E, np.float32), **plan)
    # the stages alone: with signals (down / combine wait for arrivals the stages before them bring) from the
    # same plan without them (the same kernels, each waiting for the previous grid)
    parts = MoeLayer(weights, T, np.zeros(E, np.float32), **{**plan, "signals": False}) if layer.signals else layer
    stream = cuda.Stream()
    for lay in [layer] if parts is layer else [layer, parts]:
        lay.x.upload(to_bf16(x))
        lay.logits.upload(logits)
        lay.forward(stream)
    stream.synchronize()
    names = list(dict.fromkeys(name for name, _ in layer.stages))
    gc.collect()
    gc.disable()
    try:
        graphs = []
        after_route = tuple(n for n in names if n != "route")
        for lay, stages in ([(layer, None)] + [(parts, (n,)) for n in names]
                            + ([(layer, tuple(names))] if one_stream else [])
                            + ([(parts, after_route)] if without_route else [])):
            with cuda.capture(stream) as g:
                lay.forward(stream, stages=stages)
            graphs.append(g.instantiate())
    finally:
        gc.enable()
    times = [cuda.bench(lambda ge=ge: ge.launch(stream), iters=iters, stream=stream) for ge in graphs]
    stream.synchronize()
    extra = (["one stream"] if one_stream else []) + (["without route"] if without_route else [])
    return times[0], list(zip(names + extra, times[1:]))


def select_plans(plans, spec: str):
    """The plans named in spec ("a,b,gmma*"), all when spec is empty; an unknown name is an error."""
    if not spec:
        return plans
    keep = []
    for name in spec.split(","):
        hit = [p for p in plans if (p[0].startswith(name[:-1]) if name.endswith("*") else p[0] == name)]
        if not hit:
            raise SystemExit(f"--plans: no plan {name!r}; known: {', '.join(p[0] for p in plans)}")
        keep += [p for p in hit if p not in keep]
    return keep


def launch_plans(default_fused_combine: bool, T: int):
    """(label, MoeLayer keyword arguments) at T tokens: the plan before issue 7's launch work, then one change at a
    time."""
    from runtime.kimi_kernels import gmma_auto_grid_rows, gmma_auto_tiers
    rows = gmma_auto_grid_rows(T)   # the default plan's grid cap for T, given to tiers named below where noted
    before = dict(routing="two", fuse_combine=False, early=False, pdl=False, gmma_min_tokens=None)
    return [
        ("before", before),
        ("+route1", dict(before, routing="fused")),
        ("+foldcomb", dict(before, routing="fused", fuse_combine=True)),
        ("+pdl", dict(routing="fused", fuse_combine=True, early=False, pdl=True, gmma_min_tokens=None)),
        ("+early", dict(routing="fused", fuse_combine=True, early=True, pdl=True, gmma_min_tokens=None)),
        ("flip-comb",
         dict(fuse_combine=not default_fused_combine)),
        # today's default plan with plain launches, with programmatic dependent launch, then also with down's
        # weights started before its wait (each kernel's ramp under the previous one's tail)
        ("nopdl", dict(pdl=False, early=False)),
        ("pdl", dict(pdl=True, early=False)),
        ("pdl+early", dict(pdl=True, early=True)),
        # the default tiers with each tile-token chunk of a hot expert on its own blocks (a skewed T = 1024's busiest
        # expert has ~4 chunks of 256 tokens that one block row would run in turn)
        ("par", dict(gmma_parallel_chunks=True)),
        ("no-gmma", dict(gmma_min_tokens=None)),   # the default plan without its wgmma hot-expert path
        # experts with >= 16 / 32 / 64 tokens on the wgmma kernel (sm_90a; elsewhere the row reads "failed")
        ("gmma>=16", dict(gmma_min_tokens=16, gmma_tile=64)),
        ("gmma>=32", dict(gmma_min_tokens=32, gmma_tile=128)),
        ("gmma>=64", dict(gmma_min_tokens=64, gmma_tile=128)),
        ("gmma>=16/par", dict(gmma_min_tokens=16, gmma_tile=64, gmma_parallel_chunks=True)),
        ("gmma>=16/shallow", dict(gmma_min_tokens=16, gmma_tile=64, gmma_pipe=0)),
        ("gmma>=64/shallow", dict(gmma_min_tokens=64, gmma_tile=128, gmma_pipe=0)),
        # the register-A pipeline (PIPE 2) at the default thresholds and with 256-token passes
        ("gmma>=16/ra", dict(gmma_min_tokens=16, gmma_tile=64, gmma_pipe=2)),
        ("gmma>=16/128/ra", dict(gmma_min_tokens=16, gmma_tile=128, gmma_pipe=2)),
        ("gmma>=64/ra", dict(gmma_min_tokens=64, gmma_tile=128, gmma_pipe=2)),
        ("gmma>=64/256/ra", dict(gmma_min_tokens=64, gmma_tile=256, gmma_pipe=2)),
        ("gmma>=32/256/ra", dict(gmma_min_tokens=32, gmma_tile=256, gmma_pipe=2)),
        ("gmma>=64/64/ra", dict(gmma_min_tokens=64, gmma_tile=64, gmma_pipe=2)),
        # register A with two blocks per SM (64-token tiles)
        ("gmma>=16/ra2", dict(gmma_min_tokens=16, gmma_tile=64, gmma_pipe=3)),
        ("gmma>=32/ra2", dict(gmma_min_tokens=32, gmma_tile=64, gmma_pipe=3)),
        ("gmma>=64/64/ra2", dict(gmma_min_tokens=64, gmma_tile=64, gmma_pipe=3)),
        # the hot chain on a second stream beside the cold one (parallel graph branches)
        ("gmma>=16/ra2/ov", dict(gmma_min_tokens=16, gmma_tile=64, gmma_pipe=3, gmma_overlap=True)),
        ("gmma>=32/ra2/ov", dict(gmma_min_tokens=32, gmma_tile=64, gmma_pipe=3, gmma_overlap=True)),
        ("gmma>=16/ra/ov", dict(gmma_min_tokens=16, gmma_tile=64, gmma_pipe=2, gmma_overlap=True)),
        ("gmma>=64/ra/ov", dict(gmma_min_tokens=64, gmma_tile=128, gmma_pipe=2, gmma_overlap=True)),
        ("gmma>=16/ov", dict(gmma_min_tokens=16, gmma_tile=64, gmma_overlap=True)),
        ("gmma>=16/128/ra2", dict(gmma_min_tokens=16, gmma_tile=128, gmma_pipe=3)),
        # warp-specialized (PIPE 4): 128- / 256-token tiles, with and without the second stream
        ("gmma>=16/128/ws", dict(gmma_min_tokens=16, gmma_tile=128, gmma_pipe=4, gmma_overlap=False)),
        ("gmma>=16/128/ws/ov", dict(gmma_min_tokens=16, gmma_tile=128, gmma_pipe=4)),
        ("gmma>=32/128/ws/ov", dict(gmma_min_tokens=32, gmma_tile=128, gmma_pipe=4)),
        ("gmma>=64/256/ws/ov", dict(gmma_min_tokens=64, gmma_tile=256, gmma_pipe=4)),
        ("gmma>=96/256/ws/ov", dict(gmma_min_tokens=96, gmma_tile=256, gmma_pipe=4)),
        # tiers: the warp-specialized kernel for the largest experts, register A (2 blocks / SM) below
        ("tiers64ws/16ra2", dict(gmma_tiers=[(64, 256, 4), (16, 64, 3)])),
        ("tiers128ws/16ra2", dict(gmma_tiers=[(128, 256, 4), (16, 64, 3)])),
        ("tiers64ws128/16ra2", dict(gmma_tiers=[(64, 128, 4), (16, 64, 3)])),
        # PIPE 5: the warp-specialized kernel with the wgmma N cut to each half's token count
        ("gmma>=64/256/wsn", dict(gmma_min_tokens=64, gmma_tile=256, gmma_pipe=5)),
        ("tiers64wsn/16ra2", dict(gmma_tiers=[(64, 256, 5), (16, 64, 3)])),
        ("tiers32wsn/8ra2", dict(gmma_tiers=[(32, 256, 5), (8, 64, 3)])),
        ("gmma>=8/ra2", dict(gmma_min_tokens=8, gmma_tile=64, gmma_pipe=3)),
        # hot grids capped at 8 / 16 block rows walking the slots (fewer blocks that find a cold slot and exit)
        ("gmma>=16/ra2/rows8", dict(gmma_min_tokens=16, gmma_tile=64, gmma_pipe=3, gmma_grid_rows=8)),
        ("tiers64wsn/16ra2/rows16", dict(gmma_tiers=[(64, 256, 5), (16, 64, 3)], gmma_grid_rows=16)),
        ("gmma>=64/128/ra2", dict(gmma_min_tokens=64, gmma_tile=128, gmma_pipe=3)),
        ("gmma>=64/128/ra2/ov", dict(gmma_min_tokens=64, gmma_tile=128, gmma_pipe=3, gmma_overlap=True)),
        ("gmma>=8", dict(gmma_min_tokens=8, gmma_tile=64)),
        ("gmma>=16/128", dict(gmma_min_tokens=16, gmma_tile=128)),
        ("gmma>=16/256", dict(gmma_min_tokens=16, gmma_tile=256)),
        ("gmma>=32/256", dict(gmma_min_tokens=32, gmma_tile=256)),
        # one GEMM's variant replaced ("down"/"gate_up" = the moe_w4a16_kernel parameters; the other stays T's
        # default): staged activations (XS), row groups (RG)
        ("dn-pp", dict(down="1, 2, 4, 1, 1, 1")),
        ("dn-xs", dict(down="1, 2, 4, 1, 1, 1, 1")),
        ("dn-xs2", dict(down="1, 2, 4, 1, 2, 1, 1")),
        ("dn-xs-rg4", dict(down="1, 2, 4, 1, 1, 1, 1, 4")),
        ("dn-x3-rg2", dict(down="1, 2, 4, 1, 1, -3, 1, 2")),
        # T = 1 with down's early start: a down block beside two gate_up blocks on one SM (registers: 2 x 155 + 148,
        # 2 x 141 + 200; today's 2 x 155 + 225 does not fit, so its early blocks wait for gate_up blocks to leave)
        ("gu-r2+dn-x3-rg2", dict(gate_up="0, 2, 4, 1, 1, 1, 1", down="1, 2, 4, 1, 1, -3, 1, 2")),
        ("gu-r2+dn-xs", dict(gate_up="0, 2, 4, 1, 1, 1, 1", down="1, 2, 4, 1, 1, 1, 1")),
        ("dn-xs2-rg2", dict(down="1, 2, 4, 1, 2, 1, 1, 2")),
        ("dn-xs2-rg4", dict(down="1, 2, 4, 1, 2, 1, 1, 4")),
        ("dn-rg4", dict(down="1, 2, 4, 1, 2, 1, 0, 4")),
        ("gu-rg2", dict(gate_up="0, 2, 4, 1, 1, 1, 0, 2")),
        ("gu-xs4", dict(gate_up="0, 2, 4, 1, 1, 1, 4")),
        ("gu-xs4-2", dict(gate_up="0, 2, 4, 1, 2, 1, 4")),
        ("gu-xs4-4", dict(gate_up="0, 2, 4, 1, 4, 1, 4")),
        ("gu-xs2-2", dict(gate_up="0, 2, 4, 1, 2, 1, 2")),
        ("gu-xs2-2w2", dict(gate_up="0, 2, 2, 1, 2, 1, 2")),
        ("gu-xs7", dict(gate_up="0, 2, 4, 1, 1, 1, 7")),
        # the T = 2 gate_up with its activation tile sized to min(8, T) rows (4 blocks per SM, one wave)
        ("gu-fit", dict(gate_up="0, 2, 4, 1, 1, 1, 1, 1, 1")),
        ("gu-nofit", dict(gate_up="0, 2, 4, 1, 1, 1, 1")),   # the T = 2 default before FIT (session 34)
        ("gu-x3-xs7", dict(gate_up="0, 2, 4, 1, 1, -3, 7")),
        ("gu-xs7-2", dict(gate_up="0, 2, 4, 1, 2, 1, 7")),
        ("gu-xs14-2", dict(gate_up="0, 2, 4, 1, 2, 1, 14")),
        ("gu-xs14-4", dict(gate_up="0, 2, 4, 1, 4, 1, 14")),
        ("dn-old", dict(down="1, 2, 4, 1, 1, 0")),
        ("dn-old256", dict(down="1, 2, 4, 1, 4, 3")),
        ("dn-xs2p2", dict(down="1, 2, 4, 1, 2, 1, 2")),
        # T = 129..768, down with 32-token chunks (experts of 17..32 tokens in one pass instead of two, 33..64 in two
        # instead of 3-4): the activations staged whole (128 KB) or in 4 K pieces (64 KB, as the default's 16-token tile)
        ("dn-xs4", dict(down="1, 2, 4, 1, 4, 1, 1")),
        ("dn-xs4-4", dict(down="1, 2, 4, 1, 4, 1, 4")),
        # session 40: the cold chain under the T >= 256 hot tiers (cold experts of <= 15 tokens, <= 8 from T = 512)
        ("gu-xs7-2+dn-xs-rg4", dict(gate_up="0, 2, 4, 1, 2, 1, 7", down="1, 2, 4, 1, 1, 1, 1, 4")),
        ("gu-xs7+dn-xs-rg4", dict(gate_up="0, 2, 4, 1, 1, 1, 7", down="1, 2, 4, 1, 1, 1, 1, 4")),
        ("gu-xs7-2+dn-xs2-rg2", dict(gate_up="0, 2, 4, 1, 2, 1, 7", down="1, 2, 4, 1, 2, 1, 1, 2")),
        ("gu-s0", dict(gate_up="0, 2, 4, 1, 1, 0")),
        ("gu-s1", dict(gate_up="0, 2, 4, 1, 1, 1")),
        ("gu-ring1", dict(gate_up="0, 2, 2, 1, 1, 3")),
        ("gu-ring2", dict(gate_up="0, 2, 2, 1, 2, 3")),
        ("gu-ring2w4x4", dict(gate_up="0, 2, 4, 1, 4, 3")),   # the T > 128 default at T = 32..128 (skewed)
        # the register ring of 3 buffers (2 steps in flight per warp) with XS, and XS on the two-buffer ring
        ("dn-xs-r3", dict(down="1, 2, 4, 1, 1, -3, 1")),
        ("dn-xs-r2", dict(down="1, 2, 4, 1, 1, 1, 1")),
        # T = 256: the T <= 128 chunk sizes (more warps per SM; experts over 8 / 16 tokens read twice), and the
        # warp-specialized hot path from 32 / 48 tokens (shorter cold chain under skewed routing)
        ("ring2+xs-rg4", dict(gate_up="0, 2, 2, 1, 2, 3", down="1, 2, 4, 1, 1, 1, 1, 4")),
        ("wsn>=32", dict(gmma_min_tokens=32, gmma_tile=256, gmma_pipe=5)),
        ("wsn>=48", dict(gmma_min_tokens=48, gmma_tile=256, gmma_pipe=5)),
        # T = 512 / 1024: most experts hold 10-40 tokens, below the >= 64 of GMMA_AUTO there
        ("wsn>=16/128", dict(gmma_min_tokens=16, gmma_tile=128, gmma_pipe=5)),
        ("wsn>=16/256", dict(gmma_min_tokens=16, gmma_tile=256, gmma_pipe=5)),
        ("tiers32wsn/16ra2", dict(gmma_tiers=[(32, 256, 5), (16, 64, 3)])),
        # PIPE 6: register A in slot order (no fragment shuffles), against the ra2 rows above
        ("gmma>=16/ra6", dict(gmma_min_tokens=16, gmma_tile=64, gmma_pipe=6)),
        ("gmma>=16/128/ra6", dict(gmma_min_tokens=16, gmma_tile=128, gmma_pipe=6)),
        ("gmma>=8/ra6", dict(gmma_min_tokens=8, gmma_tile=64, gmma_pipe=6)),
        ("gmma>=1/ra6", dict(gmma_min_tokens=1, gmma_tile=64, gmma_pipe=6)),
        ("tiers64wsn/16ra6", dict(gmma_tiers=[(64, 256, 5), (16, 64, 6)])),
        ("tiers64wsn/8ra6", dict(gmma_tiers=[(64, 256, 5), (8, 64, 6)])),
        ("gmma>=1/32/ra6", dict(gmma_min_tokens=1, gmma_tile=32, gmma_pipe=6)),
        ("tiers40ra6/8ra6-32", dict(gmma_tiers=[(40, 64, 6), (8, 32, 6)])),
        # T >= 256: PIPE 6 in 128-token passes beside or instead of the warp-specialized tier; the old default
        ("gmma>=64/128/ra6", dict(gmma_min_tokens=64, gmma_tile=128, gmma_pipe=6)),
        ("tiers128wsn/16ra6-128", dict(gmma_tiers=[(128, 256, 5), (16, 128, 6)])),
        ("tiers256wsn/16ra6-128", dict(gmma_tiers=[(256, 256, 5), (16, 128, 6)])),
        ("tiers64wsn/32ra6", dict(gmma_tiers=[(64, 256, 5), (32, 64, 6)])),
        # T >= 512: the warp-specialized tier, every other expert on PIPE 6's 32-token tiles (no mma.sync)
        ("tiers64wsn/1ra6-32", dict(gmma_tiers=[(64, 256, 5), (1, 32, 6)])),
        # PIPE 7: PIPE 6 with unchecked steady-state stages (~24% fewer instructions per stage in SASS)
        ("gmma>=16/ra7", dict(gmma_min_tokens=16, gmma_tile=64, gmma_pipe=7)),
        ("gmma>=1/32/ra7", dict(gmma_min_tokens=1, gmma_tile=32, gmma_pipe=7)),
        ("tiers64wsn/1ra7-32", dict(gmma_tiers=[(64, 256, 5), (1, 32, 7)])),
        ("tiers64wsn/16ra7", dict(gmma_tiers=[(64, 256, 5), (16, 64, 7)])),
        # experts of 33..63 tokens in one 64-token pass instead of two 32-token ones
        ("tiers64wsn/33ra7/1ra7-32", dict(gmma_tiers=[(64, 256, 5), (33, 64, 7), (1, 32, 7)])),
        # T >= 512: PIPE 7's 32-token tiles for the middle experts only, mma.sync below (few-token experts)
        ("tiers64wsn/9ra7-32", dict(gmma_tiers=[(64, 256, 5), (9, 32, 7)])),
        ("tiers64wsn/17ra7-32", dict(gmma_tiers=[(64, 256, 5), (17, 32, 7)])),
        ("tiers64wsn/25ra7-32", dict(gmma_tiers=[(64, 256, 5), (25, 32, 7)])),
        ("gmma>=17/32/ra7", dict(gmma_min_tokens=17, gmma_tile=32, gmma_pipe=7)),
        # T = 32..255: less token padding on the hot experts (16-32-token experts in 32-token passes)
        ("tiers33ra7/16ra7-32", dict(gmma_tiers=[(33, 64, 7), (16, 32, 7)])),
        ("tiers49ra7/16ra7-32", dict(gmma_tiers=[(49, 64, 7), (16, 32, 7)])),
        ("gmma>=16/32/ra7", dict(gmma_min_tokens=16, gmma_tile=32, gmma_pipe=7)),
        ("gmma>=16/32/ra7/par", dict(gmma_min_tokens=16, gmma_tile=32, gmma_pipe=7, gmma_parallel_chunks=True)),
        # T >= 256: the experts of >= 64 tokens on the warp-specialized PIPE 5 (the default there before PIPE 20,
        # session 42), the other tiers and the grid cap as the default's
        *([("ws5", dict(gmma_tiers=[(64, 256, 5), *gmma_auto_tiers(T)[1:]], gmma_grid_rows=rows))]
          if T >= 256 else []),
        # the default's tiers without the cap on the 256-token tier's rows (GMMA_AUTO_WIDE_GRID_ROWS; the default
        # before session 43): one block row per possibly hot slot up to GMMA_AUTO_GRID_ROWS
        *([("wide-rows-all", dict(gmma_tiers=gmma_auto_tiers(T), gmma_grid_rows=rows))] if T >= 256 else []),
        ("wide-rows8", dict(gmma_wide_grid_rows=8)),
        ("wide-rows16", dict(gmma_wide_grid_rows=16)),
        # the hot chain on 64 SMs only and the cold one on the others (green contexts, MoeLayer hot_sms, cold_sms
        # "rest"): side by side instead of in turn (48 / 56 / 80 / 96 / 112 lost to it, and it to sms80-all-prio under
        # uniform routing: session 46)
        ("sms64", dict(hot_sms=64, cold_sms="rest")),
        # the hot chain on N SMs at the top priority, the cold chain on every SM (under uniform routing, with no hot
        # work, it keeps the whole GPU; the default's form by T). Without the priority (the cold grid, queued first,
        # takes the hot SMs too) and at 48 SMs it lost (session 46).
        *[(f"sms{n}-all-prio", dict(hot_sms=n, cold_sms="all", hot_priority=True)) for n in (64, 72, 80, 88, 96)],
        ("hot-prio", dict(hot_sms=None, hot_priority=True)),
        # the hot chain on every SM at the default priority (the default before session 46)
        ("shared-sms", dict(hot_sms=None, hot_priority=False)),
        # the routing (kimi_kernels.ROUTINGS) against the default: moe_topk + moe_group (two kernels); one warp
        # (T = 1); a block per token, the last one grouping; up to 4 tokens in one block that groups them (T <= 4);
        # a warp per token, the last block grouping
        ("route-two", dict(routing="two")),
        ("route-warp", dict(routing="warp-one")),
        ("route-blocks", dict(routing="blocks")),
        ("route-batch", dict(routing="batch")),
        ("route-fused", dict(routing="fused")),
        # the combine reads the routing's weights and positions before its dependency wait (the default up to
        # kimi_kernels.COMBINE_EARLY_MAX_TOKENS), or after it
        ("comb-early", dict(combine_early=True)),
        ("comb-late", dict(combine_early=False)),
        # down waits for its slot's gate_up blocks, the combine for down's blocks, through counters (the default at
        # kimi_kernels.SIGNALS_MIN_TOKENS..SIGNALS_MAX_TOKENS), or for the whole previous grid
        ("signals", dict(signals=True)),
        ("no-signals", dict(signals=False)),
        # T = 9..16: PDL and down's early start (off by default there), with and without the hand-offs
        ("pdl+early+signals", dict(pdl=True, early=True, signals=True)),
        # signals with down in fewer waves (each block's arrival fence delays its exit, and so the next wave's start):
        # T = 1 one wave (224 blocks, two per SM); two / four row groups per warp (T = 2: 448 / 224 blocks)
        ("signals+dn-x3-rg2", dict(signals=True, down="1, 2, 4, 1, 1, -3, 1, 2")),
        ("signals+dn-xs2-rg2", dict(signals=True, down="1, 2, 4, 1, 2, 1, 1, 2")),
        ("signals+dn-xs-rg4", dict(signals=True, down="1, 2, 4, 1, 1, 1, 1, 4")),
        ("gmma>=16/ra7/par", dict(gmma_min_tokens=16, gmma_tile=64, gmma_pipe=7, gmma_parallel_chunks=True)),
        # PIPE 8: PIPE 7 with the weights 8 stages ahead in a shared-memory ring (4 in registers before)
        ("gmma>=16/ra8", dict(gmma_min_tokens=16, gmma_tile=64, gmma_pipe=8)),
        ("gmma>=1/32/ra8", dict(gmma_min_tokens=1, gmma_tile=32, gmma_pipe=8)),
        # experts of >= 16 tokens on PIPE 8's 32-token tiles: GMMA_AUTO's tier at T = 25..31 since session 37; below
        # GMMA_AUTO_TOKENS an A/B against the signals and the early start, which it gives up
        ("gmma>=16/32/ra8", dict(gmma_min_tokens=16, gmma_tile=32, gmma_pipe=8)),
        ("tiers64wsn/17ra8-32", dict(gmma_tiers=[(64, 256, 5), (17, 32, 8)])),
        ("tiers64wsn/9ra8-32", dict(gmma_tiers=[(64, 256, 5), (9, 32, 8)])),
        ("tiers64wsn/1ra8-32", dict(gmma_tiers=[(64, 256, 5), (1, 32, 8)])),
        ("gmma>=8/ra8", dict(gmma_min_tokens=8, gmma_tile=64, gmma_pipe=8)),
        # T = 256..1024: the warp-specialized tier for the experts of many tokens, PIPE 8 for 16..63 / 127
        ("tiers64wsn/16ra8", dict(gmma_tiers=[(64, 256, 5), (16, 64, 8)])),
        ("tiers128wsn/16ra8", dict(gmma_tiers=[(128, 256, 5), (16, 64, 8)])),
        ("tiers64wsn/33ra8/17ra8-32", dict(gmma_tiers=[(64, 256, 5), (33, 64, 8), (17, 32, 8)])),
        # T = 64..255: experts of > 64 tokens in one 128-token PIPE 7 pass instead of two 64-token PIPE 8 ones
        ("tiers65ra7-128/16ra8", dict(gmma_tiers=[(65, 128, 7), (16, 64, 8)])),
        # the hot grids capped at 16 / 32 block rows, each walking every 16th / 32nd slot: fewer empty blocks
        # where few of the P // min possible hot slots are hot (uniform routing)
        ("gmma>=16/ra8/rows16", dict(gmma_min_tokens=16, gmma_tile=64, gmma_pipe=8, gmma_grid_rows=16)),
        ("gmma>=16/ra8/rows32", dict(gmma_min_tokens=16, gmma_tile=64, gmma_pipe=8, gmma_grid_rows=32)),
        ("tiers64wsn/16ra8/rows32", dict(gmma_tiers=[(64, 256, 5), (16, 64, 8)], gmma_grid_rows=32)),
        ("tiers128wsn/16ra8/rows32", dict(gmma_tiers=[(128, 256, 5), (16, 64, 8)], gmma_grid_rows=32)),
        ("tiers64wsn/17ra8-32/rows32", dict(gmma_tiers=[(64, 256, 5), (17, 32, 8)], gmma_grid_rows=32)),
        # T = 256..1024 (session 40): experts of 16..63 tokens in 64-token PIPE 8 tiles, 9..15 (or 9..32) in 32-token ones
        ("tiers64wsn/16ra8/9ra8-32/rows32", dict(gmma_tiers=[(64, 256, 5), (16, 64, 8), (9, 32, 8)], gmma_grid_rows=32)),
        ("tiers64wsn/33ra8/9ra8-32/rows32", dict(gmma_tiers=[(64, 256, 5), (33, 64, 8), (9, 32, 8)], gmma_grid_rows=32)),
        ("tiers64wsn/9ra8-32/rows32", dict(gmma_tiers=[(64, 256, 5), (9, 32, 8)], gmma_grid_rows=32)),
        ("tiers64wsn/16ra8/rows64", dict(gmma_tiers=[(64, 256, 5), (16, 64, 8)], gmma_grid_rows=64)),
        # T = 32..255: a 32-token PIPE 8 tier for experts of 9..15 tokens below GMMA_AUTO's (16, 64, 8)
        ("gmma>=16/ra8/9ra8-32", dict(gmma_tiers=[(16, 64, 8), (9, 32, 8)])),
        ("gmma>=16/ra8/9ra8-32/rows32", dict(gmma_tiers=[(16, 64, 8), (9, 32, 8)], gmma_grid_rows=32)),
        # T >= 512: the warp-specialized tier from 96 / 128 tokens above GMMA_AUTO's PIPE 8 tiers
        ("tiers96wsn/33ra8/9ra8-32/rows64", dict(gmma_tiers=[(96, 256, 5), (33, 64, 8), (9, 32, 8)], gmma_grid_rows=64)),
        ("tiers128wsn/33ra8/9ra8-32/rows64",
         dict(gmma_tiers=[(128, 256, 5), (33, 64, 8), (9, 32, 8)], gmma_grid_rows=64)),
        ("tiers64wsn/33ra8/9ra8-32", dict(gmma_tiers=[(64, 256, 5), (33, 64, 8), (9, 32, 8)])),
        ("tiers64wsn/33ra8/9ra8-32/rows64", dict(gmma_tiers=[(64, 256, 5), (33, 64, 8), (9, 32, 8)], gmma_grid_rows=64)),
        ("tiers64wsn/33ra8/9ra8-32/rows128",
         dict(gmma_tiers=[(64, 256, 5), (33, 64, 8), (9, 32, 8)], gmma_grid_rows=128)),
        ("gmma>=16/ra8/rows64", dict(gmma_min_tokens=16, gmma_tile=64, gmma_pipe=8, gmma_grid_rows=64)),
        # T >= 256: the warp-specialized tier from 128 tokens, PIPE 8 below it (64- and / or 32-token tiles)
        ("tiers128wsn/17ra8-32", dict(gmma_tiers=[(128, 256, 5), (17, 32, 8)])),
        ("tiers128wsn/40ra8/17ra8-32", dict(gmma_tiers=[(128, 256, 5), (40, 64, 8), (17, 32, 8)])),
        ("tiers128wsn/24ra8", dict(gmma_tiers=[(128, 256, 5), (24, 64, 8)])),
        # gate_up with 16-token weight passes (NTMAX 2, WN 2): T = 9..24's default before session 38 (still 25..31's)
        ("gu-nt2", dict(gate_up="0, 2, 2, 1, 2, 3")),
        ("gu-nt4", dict(gate_up="0, 2, 4, 1, 4, 3")),
    ]


def run_torch_child(args) -> str | None:
    """Time the torch loop in its own process (torch and our CUDA wheels clash in one) on the same tokens,
    routings and shapes; returns its JSON path, or None (the ratios then print as nan) when it fails."""
    import os
    import subprocess
    import sys
    import tempfile
    path = os.path.join(tempfile.mkdtemp(prefix="bench_moe_torch_"), "torch.json")
    cmd = [sys.executable, "-m", "tools.bench_moe", "--torch-only", path, "--tokens", args.tokens, "--routing",
           args.routing, "--experts", str(args.experts), "--hidden", str(args.hidden), "--inter", str(args.inter)]
    print("torch loop child:", " ".join(cmd[1:]), flush=True)
    rc = subprocess.run(cmd).returncode
    if rc != 0:
        print(f"torch loop child failed (exit {rc}): no torch ratios", flush=True)
        return None
    return path


def torch_main(args):
    """The torch bf16 per-expert loop on the same routing as the main run (numpy reference routing)."""
    from runtime.kimi_reference import route
    loop = TorchLoop(args.experts, args.hidden, args.inter)
    out = {}
    for kind in args.routing.split(","):
        for T in (int(v) for v in args.tokens.split(",")):
            ids, w = route(routing_logits(T, args.experts, kind), np.zeros(args.experts, np.float32))
            ms, nbytes = loop.time_ms(ids, w)
            out[f"{kind}/{T}"] = (ms, nbytes)
            print(f"torch bf16 loop {kind:8s} T={T:4d}: {ms * 1e3:9.1f} us, {nbytes / (ms * 1e-3) / 1e12:.2f} TB/s "
                  f"on its bf16 bytes", flush=True)
    with open(args.torch_only, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
