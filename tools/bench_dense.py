"""Dense-model kernel benchmark on the GPU: bf16 linear at SmolLM2-135M, Qwen3-8B and Kimi K2 shared-expert shapes
vs the streaming read bandwidth measured in the same run, tree-verify attention vs a one-token decode of the same
prefix, and the per-round sampling kernels.

    python tools/bench_dense.py [--quick] [--linear-only | --attention-only] [--peer]

--peer adds cuBLAS (torch.matmul, bf16, CUDA graph of the same rotating weight copies) as a row per shape and M,
timed in a child process first (torch and the runtime's CUDA wheels in one process clashed on the device image).

Timing: each measurement is a CUDA graph of `reps` launches (the engine replays graphs too), replayed and
timed with events; the time per launch is the median replay / reps. Weights and KV caches rotate through
enough copies (> 4x the 60 MB L2) that every launch streams from HBM, as successive layers do in a model.
"""
from __future__ import annotations

import argparse
import math

import numpy as np

from runtime import dense_kernels as dk
from runtime.bf16 import to_bf16
from runtime.cuda import Stream, bench, capture, empty, get_device, get_kernel, to_device
from tools.read_bandwidth import read_bandwidth, read_time_by_blocks

ROTATE_BYTES = 256 << 20  # > 4x L2: every launch reads from HBM

LINEAR_SHAPES = [  # (model, name, N, K)
    ("SmolLM2-135M", "qkv", 960, 576), ("SmolLM2-135M", "o", 576, 576),
    ("SmolLM2-135M", "gate_up", 3072, 576), ("SmolLM2-135M", "down", 576, 1536),
    ("SmolLM2-135M", "lm_head", 49152, 576),
    ("Qwen3-8B", "qkv", 6144, 4096), ("Qwen3-8B", "o", 4096, 4096),
    ("Qwen3-8B", "gate_up", 24576, 4096), ("Qwen3-8B", "up", 12288, 4096), ("Qwen3-8B", "down", 4096, 12288),
    ("Qwen3-8B", "lm_head", 151936, 4096),
    # Kimi K2.x's shared expert (bf16; runtime.kimi_kernels.SharedExpertMlp): gate_up 2 x 2048 rows, down
    ("Kimi-K2", "shared_gate_up", 4096, 7168), ("Kimi-K2", "shared_down", 7168, 2048),
]


def graph_time_us(launch_one, reps: int, stream, iters: int = 10) -> float:
    """Median microseconds per launch of a graph holding `reps` calls of launch_one(i, stream)."""
    for i in range(reps):  # eager warm-up: modules loaded, workspaces sized, outside the capture
        launch_one(i, stream)
    stream.synchronize()
    with capture(stream) as cap:
        for i in range(reps):
            launch_one(i, stream)
    g = cap.instantiate()
    ms = bench(lambda: g.launch(stream), warmup=3, iters=iters, stream=stream)
    return ms * 1e3 / reps


# --gmma: overrides of the GMMA plan timed besides the planned one, per token tile
# (nwg 3: 192-row blocks of three warpgroups, the one-wave shape cuBLAS picks for gate_up; planned where it
# fills one wave; nwg 1: 64-row blocks of one warpgroup; splits s: K split s ways through the fp32 workspace, which
# can fill one wave where the cluster splits fill 96 SMs, e.g. qkv / o / down at M = 17..72)
_WS = tuple({"splits": s} for s in (2, 3, 4, 8))
# one warpgroup with the 4-stage ring it had before session 28 (the default is now 7 / 6 stages)
_SHALLOW_1WG = {"nwg": 1, "stages": 4, "cs": 2}
# one warpgroup with a ring small enough for two blocks per SM (session 30, unmeasured)
_TWO_PER_SM_1WG = {32: {"nwg": 1, "ka": 2, "stages": 4, "cs": 2}, 48: {"nwg": 1, "stages": 3, "cs": 2},
                   72: {"nwg": 1, "ka": 1, "stages": 5, "cs": 2}}
GMMA_ALTERNATIVES = {16: ({"cs": 1}, {"cs": 2}, {"cs": 3}, {"cs": 4}, {"nwg": 3, "cs": 1}),
                     32: ({"cs": 1}, {"cs": 2}, {"cs": 3}, {"cs": 4}, {"nwg": 3, "cs": 1}, _TWO_PER_SM_1WG[32], *_WS),
                     48: ({"cs": 1}, {"cs": 2}, {"nwg": 1, "cs": 2}, _SHALLOW_1WG, _TWO_PER_SM_1WG[48], *_WS),
                     64: ({"cs": 1}, {"cs": 2}, {"cs": 3}, {"cs": 4}, {"rw": 2, "ka": 1, "cs": 1}, {"nwg": 3, "cs": 1},
                          *_WS),
                     72: ({"cs": 1}, {"cs": 2}, {"cs": 3}, {"cs": 4}, {"nwg": 3, "cs": 1}, {"nwg": 3, "cs": 2},
                          {"nwg": 1, "cs": 2}, _SHALLOW_1WG, _TWO_PER_SM_1WG[72], *_WS),
                     128: ({"cs": 1}, {"cs": 2}, {"cs": 4}, {"rw": 2, "stages": 4, "cs": 1}),
                     136: ({"cs": 1}, {"cs": 2}, {"nwg": 3, "cs": 1}, {"tn": 192}),
                     256: ({"cs": 1}, {"cs": 2}, {"cs": 4})}


def narrow_plan_ok(dg, *args, **kwargs) -> bool:
    """Whether narrow_plan takes these arguments (an instance is built, a cluster has a row per block...)."""
    try:
        return dg.narrow_plan(*args, **kwargs) is not None
    except ValueError:
        return False


def narrow_variants(dg, M, N, K):
    """The narrow-row GMMA kernel (runtime/dense_gmma.py) at every M up to its largest token tile where it has a row
    block for this N (narrow_plan at one row): that NW ("narrow": planned at this M too, "narrow nw=..": not), and
    its neighbours, the next larger row block (fewer blocks) and the next smaller (more than one wave), and that NW
    in clusters of two blocks that read x once (cs=2) where narrow_plan takes it."""
    sms = get_device().sm_count
    plan = dg.narrow_plan(1, N, K, sms)
    if plan is None or M > dg.NARROW_GMMA_TOKEN_TILES[-1]:
        return []
    nw = dg.gmma_narrow_config(plan[0])[0]
    rows = dg.NARROW_GMMA_ROWS
    i = rows.index(nw)
    planned = dg.narrow_plan(M, N, K, sms)
    cs = dg.gmma_narrow_config(planned[0])[5] if planned and planned[0].startswith("linear_gmma_narrow_mc") else 1
    out = [("narrow" if planned else f"narrow nw={nw}", {"gmma": True, "nw": "auto" if planned else nw})] + [
        (f"narrow nw={r}", {"gmma": True, "nw": r}) for r in rows[max(0, i - 1):i + 2] if r != nw]
    for c in (1, dg.NARROW_MC_CS):  # the cluster size the plan did not pick, where narrow_plan takes it
        if c != cs and (c == 1 or narrow_plan_ok(dg, M, N, K, sms, nw=nw, cs=c)):
            out.append((f"narrow nw={nw} cs={c}", {"gmma": True, "nw": nw, "cs": c}))
    return out


def linear_shapes(quick, ops):
    shapes = LINEAR_SHAPES if not quick else [s for s in LINEAR_SHAPES if s[1] in ("o", "gate_up", "down")]
    if ops:  # e.g. --ops Qwen3-8B:qkv o
        shapes = [s for s in shapes if s[1] in ops or f"{s[0]}:{s[1]}" in ops]
    return shapes


def torch_linear_main(args):
    """Child process of --peer: cuBLAS bf16 x @ W^T per shape and M, same timing scheme; JSON {"model:op:M": us}."""
    import json
    import torch
    times = {}
    for model, name, N, K in linear_shapes(args.quick, args.ops):
        copies = min(64, max(1, math.ceil(ROTATE_BYTES / (N * K * 2))))
        ws = [torch.empty((N, K), dtype=torch.bfloat16, device="cuda").normal_(0, 0.02) for _ in range(copies)]
        reps = max(copies, 8)
        for M in args.m:
            x = torch.randn((M, K), dtype=torch.bfloat16, device="cuda")
            out = torch.empty((M, N), dtype=torch.bfloat16, device="cuda")
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for i in range(reps):  # warm-up outside the capture (cuBLAS picks and sizes its workspace)
                    torch.matmul(x, ws[i % copies].T, out=out)
            s.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                for i in range(reps):
                    torch.matmul(x, ws[i % copies].T, out=out)
            ms = []
            with torch.cuda.stream(s):
                for it in range(13):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record(s)
                    g.replay()
                    e1.record(s)
                    e1.synchronize()
                    if it >= 3:
                        ms.append(e0.elapsed_time(e1))
            times[f"{model}:{name}:{M}"] = float(np.median(ms)) * 1e3 / reps
        del ws
        torch.cuda.empty_cache()
    with open(args.torch_linear, "w") as f:
        json.dump(times, f)


def torch_peer_times(args) -> dict:
    """Run torch_linear_main in a child process; {} (and the reason printed) when torch or its GPU is missing."""
    import json
    import os
    import subprocess
    import sys
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "torch_linear.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--torch-linear", path, "--m", *map(str, args.m)]
        cmd += ["--quick"] if args.quick else []
        cmd += ["--ops", *args.ops] if args.ops else []
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"(--peer: the torch child failed, no cuBLAS rows: {r.stderr.strip().splitlines()[-1:]})")
            return {}
        with open(path) as f:
            return json.load(f)


def bench_linear(stream, read_bw, ms_list, quick, gmma=False, ops=None, peer=None):
    rng = np.random.default_rng(0)
    rows = []
    print(f"\n## bf16 linear (W streamed from HBM; % = of the {read_bw / 1e12:.2f} TB/s read measured above)")
    print("| model | op | N x K | M | variant | us | W GB/s | % read | % same-size read | TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    shapes = linear_shapes(quick, ops)
    if gmma:
        from runtime import dense_gmma as dg
        gmma = dg.gmma_available()
        if not gmma:
            print("(--gmma: the GMMA kernel is sm_90a only; not timed on this device)")
    for model, name, N, K in shapes:
        w_bytes = N * K * 2
        copies = max(1, math.ceil(ROTATE_BYTES / w_bytes))
        # random bf16 rows, tiled: generating 600M fresh normals for the 151936-row lm_head takes too long
        block = to_bf16(rng.standard_normal((min(N, 1024), K), dtype=np.float32) * 0.02)
        wb = np.resize(block, (N, K))
        weights = [to_device(wb) for _ in range(min(copies, 64))]
        copies = len(weights)
        # the streaming-read kernel over the same bytes and copies: what a launch of this size can reach ("same-size
        # read"); then the same reads chained with programmatic dependent launch, each under the previous one's tail
        sink = empty((4,), np.uint32)
        n_vec = w_bytes // 16
        same_us = None
        probes = (("streaming read of W", get_kernel("runtime_probe", "read_sum_kernel")),
                  ("streaming read of W, PDL chain", get_kernel("runtime_probe_pdl", "read_sum_pdl_kernel")))
        for label, probe in probes:  # (probe is used within its iteration: graph_time_us runs the lambda at once)
            us = graph_time_us(lambda i, s: probe.launch(4 * get_device().sm_count, 512,
                                                         [weights[i % copies], np.int64(n_vec), sink], stream=s),
                               reps=max(copies, 8), stream=stream)
            same_us = same_us or us
            print(f"| {model} | {name} | {N}x{K} | - | {label} | {us:.2f} | {w_bytes / us / 1e3:.0f} | "
                  f"{100 * w_bytes / (us * 1e-6) / read_bw:.1f} | {100 * same_us / us:.1f} | - |")
        for M in ms_list:
            x = to_device(to_bf16(rng.standard_normal((M, K), dtype=np.float32)))
            out = empty((M, N), np.uint16)
            variants = [("auto", {})]
            if M <= 64 and model == "Qwen3-8B":
                variants += [("chunked", {"kernel": "chunked"}), ("xres", {"kernel": "xres"})]
                if M in (1, 64):
                    variants += [("xres stages=4", {"kernel": "xres", "stages": 4})]
            if M <= 8 and dk.gemv_fits(M, K):  # the no-split decode kernel (each KW) vs the split-K one
                if ("xres", {"kernel": "xres"}) not in variants:
                    variants.append(("xres", {"kernel": "xres"}))
                variants += [(f"gemv kw={k}{' persist' if p else ''}", {"kernel": "gemv", "kw": k, "persist": p})
                             for k in (8, 4, 2) for p in (False, True)]
            if gmma:  # the sm_90a GMMA kernel (runtime/dense_gmma.py), every model's shapes
                # base: the mma.sync kernel the auto plan picked for M >= 9 before the GMMA hook (chunked); below
                # 9 rows the planned gemv / x-resident kernel.
                # workspace splits only where the unsplit two-warpgroup blocks leave SMs idle (to fill one wave)
                tn = dg.token_tile(M)
                unsplit_blocks = -(-N // (dg.GMMA_ROWS_PER_WARPGROUP * dg.GMMA_NWG)) * -(-M // tn)
                base = ("mma.sync", {"kernel": "chunked"}) if M >= 9 else ("auto", {})
                variants = [base, ("gmma", {"gmma": True})] + [
                    (f"gmma {c}", {"gmma": True, **c}) for c in GMMA_ALTERNATIVES.get(tn, ())
                    if "splits" not in c or unsplit_blocks < get_device().sm_count] + narrow_variants(dg, M, N, K)
            base_us = None
            timed = {}  # variant name -> us, for the peer's ratio
            for vname, kw in variants:
                try:
                    if "nw" in kw:
                        gkw = {"nw": kw["nw"], "cs": kw.get("cs")}
                        plan = dg.narrow_plan(M, N, K, get_device().sm_count,
                                              None if kw["nw"] == "auto" else kw["nw"], cs=kw.get("cs"))
                    elif kw.get("gmma"):
                        gkw = {k: v for k, v in kw.items() if k != "gmma"}
                        plan = dg.gmma_plan(M, N, K, get_device().sm_count, gkw.get("splits"), gkw.get("tn"),
                                            gkw.get("ka"), gkw.get("stages"), gkw.get("rw"), gkw.get("cs"),
                                            cluster_slots=dg.device_cluster_slots, nwg=gkw.get("nwg"))
                    else:
                        plan = dk.linear_plan(M, N, K, get_device().sm_count, kw.get("splits"),
                                              kw.get("kernel", "auto"), kw.get("stages"), kw=kw.get("kw"),
                                              persist=kw.get("persist"))
                except ValueError as e:
                    print(f"| {model} | {name} | {N}x{K} | {M} | {vname} | n/a: {e} |||||")
                    continue
                if not kw.get("gmma") and kw.get("kernel", "auto") == "auto" and not kw.get("splits"):
                    from runtime import dense_gmma as dg
                    if dg.gmma_wanted(M, N, K):  # linear() hands this shape to a GMMA kernel: show its plan
                        plan = dg.gmma_plan(M, N, K, get_device().sm_count, cluster_slots=dg.device_cluster_slots)
                        plan = dg.narrow_instead(M, N, K, get_device().sm_count, plan[1],
                                                 get_device().mem_peak_bytes_per_s) or plan
                if kw.get("gmma"):
                    # "gmma" rows: linear_gmma_kernel's plan, not the narrow kernel that an unforced call may take
                    narrow_default, dg.GMMA_NARROW = dg.GMMA_NARROW, False
                    try:
                        us = graph_time_us(lambda i, s: dg.linear_gmma(x, weights[i % copies], out, stream=s, **gkw),
                                           reps=max(copies, 8), stream=stream)
                    finally:
                        dg.GMMA_NARROW = narrow_default
                    kind = plan[0].replace("linear_gmma_narrow_mc_kernel", "narrow_mc").replace(
                        "linear_gmma_narrow_kernel", "narrow").replace("linear_gmma_kernel", "gmma")
                else:
                    us = graph_time_us(lambda i, s: dk.linear(x, weights[i % copies], out, stream=s, **kw),
                                       reps=max(copies, 8), stream=stream)
                    kind = next(k for k in ("linear_gmma_narrow_kernel", "linear_gmma_kernel", "gemv", "xres",
                                            "chunked") if k in plan[0] or k == "chunked")
                    kind = {"linear_gmma_narrow_kernel": "narrow", "linear_gmma_kernel": "gmma"}.get(kind, kind)
                base_us = base_us or us  # the first variant: "auto", or with --gmma the mma.sync kernel
                bw = w_bytes / (us * 1e-6)
                tflops = 2 * M * N * K / (us * 1e-6) / 1e12
                vs = f" ({base_us / us:.2f}x {variants[0][0]})" if kw.get("gmma") and base_us != us else ""
                print(f"| {model} | {name} | {N}x{K} | {M} | {vname}: {kind} grid {plan[1]}{vs} | {us:.2f} | "
                      f"{bw / 1e9:.0f} | {100 * bw / read_bw:.1f} | {100 * same_us / us:.1f} | {tflops:.1f} |",
                      flush=True)
                rows.append((model, name, N, K, M, vname, us, bw / read_bw))
                timed[vname] = us
            ours = timed.get("auto") or timed.get("gmma")
            peer_us = (peer or {}).get(f"{model}:{name}:{M}")
            if peer_us and ours:
                bw = w_bytes / (peer_us * 1e-6)
                print(f"| {model} | {name} | {N}x{K} | {M} | peer: cuBLAS (torch.matmul; ours {peer_us / ours:.2f}x "
                      f"faster) | {peer_us:.2f} | {bw / 1e9:.0f} | {100 * bw / read_bw:.1f} | "
                      f"{100 * same_us / peer_us:.1f} | {2 * M * N * K / (peer_us * 1e-6) / 1e12:.1f} |", flush=True)
        del weights
    return rows


ATTN_HEADS = {"qwen3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}  # (q heads, kv heads, head dim)


def bench_attention(stream, quick, split_counts=(0,), prefixes=(1024, 8192, 32768), model="qwen3-8b", capacity=None,
                    budgets=None, kernels=(None,), decode_variants=(None,), gmma_stages=(None,)):
    from runtime.backends.base import causal_visibility
    rng = np.random.default_rng(1)
    Hq, Hkv, D = ATTN_HEADS[model]
    default_stages = dk.ATTN_GMMA_STAGES[D]
    print(f"\n## tree-verify attention, {model} heads ({Hq} q / {Hkv} kv, d {D}); one layer; ratio vs the first row "
          "of the prefix (T = 1 decode)")
    print("| prefix | budget | T | kernel | splits | us | x decode | KV GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    budgets = budgets or ([0, 16, 32, 64, 128, 256, 512, 1024] if not quick else [0, 16, 64, 256, 1024])
    for prefix in prefixes:
        cap = max(prefix + 1025 + 64, capacity or 0)
        kv_bytes = 2 * cap * Hkv * D * 2
        copies = max(1, min(16, math.ceil(ROTATE_BYTES / kv_bytes)))
        kv = []
        for _ in range(copies):
            k = empty((cap, Hkv, D), np.uint16)
            v = empty((cap, Hkv, D), np.uint16)
            k.upload(to_bf16(rng.standard_normal((cap, Hkv, D), dtype=np.float32)))
            v.upload(to_bf16(rng.standard_normal((cap, Hkv, D), dtype=np.float32)))
            kv.append((k, v))
        n_prefix = to_device(np.array([prefix], np.int32))
        base_us = None
        runs = []   # (budget, kernel, decode variant or None, forced splits): the decode kernel once per variant
        for budget, kernel_ask in ((b, k) for b in budgets for k in kernels):
            T = budget + 1
            kernel = dk.attention_kernel_for(T, Hq, Hkv, D, kernel_ask, get_device().arch)
            variants = {"decode": decode_variants, "gmma": gmma_stages}.get(kernel, [None])
            runs += [(budget, kernel, v, f) for v in variants for f in split_counts]
        for budget, kernel, variant, forced in runs:
            T = budget + 1
            decode = dk.decode_variant(D, variant) if kernel == "decode" else None
            label = kernel if decode is None else f"decode {decode[0]}x{decode[1]}"
            if kernel == "gmma":   # the ring depth: the instance attention() launches and the split plan's
                dk.ATTN_GMMA_STAGES[D] = variant or default_stages
                label = f"gmma {dk.gmma_stages(D, T * (Hq // Hkv))} stages"
            q = to_device(to_bf16(rng.standard_normal((T, Hq, D), dtype=np.float32)))
            vis = to_device(causal_visibility(T))  # a chain: the densest tree mask
            out = empty((T, Hq, D), np.uint16)
            # planned (forced 0): the grid sized for max_keys (the engine's KV capacity with --attn-capacity),
            # of which the kernels use what this prefix fills ("a/b": active / grid); forced: exactly that many
            max_keys = max(prefix + T, capacity or 0)
            if forced:
                splits = str(forced)
            else:
                plan = dk.attention_split_table(T, Hq, Hkv, D, cap, get_device().sm_count, kernel, decode)[1]
                splits = f"{plan[-(-(prefix + T) // dk.ATTN_TILE_KEYS)]}/{dk.attention_grid_splits(plan, max_keys)}"
            us = graph_time_us(lambda i, s: dk.attention(q, kv[i % copies][0], kv[i % copies][1], n_prefix, vis,
                                                         D ** -0.5, out, T=T, max_keys=max_keys, splits=forced or None,
                                                         kernel=kernel, decode=decode, stream=s),
                               reps=max(copies, 4), stream=stream)
            if base_us is None:
                base_us = us
            gbs = 2 * (prefix + T) * Hkv * D * 2 / (us * 1e-6) / 1e9
            print(f"| {prefix} | {budget} | {T} | {label} | {splits} | {us:.2f} | {us / base_us:.2f} | {gbs:.0f} |",
                  flush=True)
        del kv
    dk.ATTN_GMMA_STAGES[D] = default_stages


def bench_sampling(stream):
    rng = np.random.default_rng(2)
    print("\n## per-round sampling kernels")
    print("| kernel | rows x vocab | k | us |")
    print("|---|---|---|---|")
    for V in (49152, 151936):
        for L, k in ((15, 64), (15, 1024)):
            logits = to_device(to_bf16(rng.standard_normal((L, V), dtype=np.float32) * 3))
            lp, ids = empty((L, k), np.float32), empty((L, k), np.int32)
            us = graph_time_us(lambda i, s: dk.log_softmax_topk(logits, k, lp, ids, stream=s), reps=8, stream=stream)
            print(f"| log_softmax_topk | {L} x {V} | {k} | {us:.2f} |", flush=True)
        for rows in (65, 1025):
            logits = to_device(to_bf16(rng.standard_normal((rows, V), dtype=np.float32) * 3))
            out = empty((rows,), np.int32)
            us = graph_time_us(lambda i, s: dk.argmax(logits, out, stream=s), reps=8, stream=stream)
            print(f"| argmax | {rows} x {V} | - | {us:.2f} |", flush=True)
            pos = to_device(np.arange(1000, 1000 + rows, dtype=np.int32))
            key = to_device(np.array([12345, 678], np.uint32))
            us = graph_time_us(lambda i, s: dk.sample(logits, 0.8, pos, key, out, stream=s), reps=8, stream=stream)
            print(f"| sample (T=0.8) | {rows} x {V} | - | {us:.2f} |", flush=True)


FUSED_OPS = {"qkv": "rmsnorm", "gate_up": "rmsnorm", "down": "swiglu",   # the op that makes each linear's x
             "shared_down": "swiglu"}


def bench_fused(stream, read_bw, ms_list, ops=None):
    """--fused: the linears whose x an rmsnorm (with the residual add, sum written) or a SwiGLU makes, at Qwen3-8B
    shapes: the two ops as separate launches (the planned linear; the narrow-row kernel) against one fused launch
    (the narrow-row kernel's prologue; the gemv's where fused_prologue_ok). Same graph timing as bench_linear; %
    read = W bytes over the time, of the measured read."""
    from runtime import dense_gmma as dg
    if not dg.gmma_available():
        print("(--fused: the narrow-row kernel is sm_90a only; not timed on this device)")
        return
    rng = np.random.default_rng(2)
    sms = get_device().sm_count
    print(f"\n## fused prologues (rmsnorm + residual add / SwiGLU into the linear's x; % = of {read_bw / 1e12:.2f} "
          "TB/s; x = separate planned / this)")
    print("| op | N x K | M | prologue | variant | us | % read | x separate |")
    print("|---|---|---|---|---|---|---|---|")
    for model, name, N, K in linear_shapes(False, ops):
        prologue = FUSED_OPS.get(name)
        if model == "SmolLM2-135M" or prologue is None:
            continue
        w_bytes = N * K * 2
        copies = max(1, min(64, math.ceil(ROTATE_BYTES / w_bytes)))
        block = to_bf16(rng.standard_normal((min(N, 1024), K), dtype=np.float32) * 0.02)
        weights = [to_device(np.resize(block, (N, K))) for _ in range(copies)]
        plan1 = dg.narrow_plan(1, N, K, sms)
        nw = dg.gmma_narrow_config(plan1[0])[0] if plan1 else None
        for M in ms_list:
            x = to_device(to_bf16(rng.standard_normal((M, K), dtype=np.float32)))
            x2 = to_device(to_bf16(rng.standard_normal((M, K), dtype=np.float32)))
            g = to_device(to_bf16(1 + 0.1 * rng.standard_normal(K, dtype=np.float32)))
            mid, total, out = empty((M, K), np.uint16), empty((M, K), np.uint16), empty((M, N), np.uint16)

            def pre(s):  # the separate prologue launch
                if prologue == "rmsnorm":
                    dk.rmsnorm(x, g, mid, 1e-6, residual=x2, residual_out=total, stream=s)
                else:
                    dk.swiglu(x, x2, mid, stream=s)
            fused_kw = dict(prologue=prologue, x2=x2, **({"norm_weight": g, "eps": 1e-6, "sum_out": total}
                                                           if prologue == "rmsnorm" else {}))
            variants = [("separate: planned linear", lambda i, s: (pre(s), dk.linear(mid, weights[i % copies],
                                                                                      out, stream=s)))]
            if nw is not None and M <= dg.NARROW_GMMA_TOKEN_TILES[-1]:
                variants += [
                    (f"separate: narrow nw={nw}", lambda i, s: (pre(s), dg.linear_gmma(mid, weights[i % copies],
                                                                                        out, nw=nw, stream=s))),
                    (f"fused: narrow nw={nw}", lambda i, s: dg.linear_gmma(x, weights[i % copies], out, nw=nw,
                                                                            stream=s, **fused_kw))]
                if narrow_plan_ok(dg, M, N, K, sms, nw=nw, prologue=prologue, cs=dg.NARROW_MC_CS):
                    variants.append((f"fused: narrow nw={nw} cs=2", lambda i, s: dg.linear_gmma(
                        x, weights[i % copies], out, nw=nw, cs=2, stream=s, **fused_kw)))
            if dk.fused_prologue_ok(M, K, prologue):
                variants.append(("fused: gemv", lambda i, s: dk.linear(x, weights[i % copies], out, kernel="gemv",
                                                                        stream=s, **fused_kw)))
            base = None
            for vname, launch in variants:
                us = graph_time_us(launch, reps=max(copies, 8), stream=stream)
                base = base or us
                print(f"| {name} | {N}x{K} | {M} | {prologue} | {vname} | {us:.2f} | "
                      f"{100 * w_bytes / (us * 1e-6) / read_bw:.1f} | {base / us:.2f} |", flush=True)
        del weights


def bench_read_by_sms(stream, read_bw):
    """The streaming read with one 1024-thread block (8 loads in flight per thread, 128 KB per SM) on each of G SMs:
    GB/s per streaming SM, and % of the best read. If the per-SM rate stays flat as G falls, idle SMs are what a
    plan gives up; if it rises, fewer SMs can still pull the bandwidth and the linears lose elsewhere."""
    sms = get_device().sm_count
    grids = sorted({g for g in (32, 64, 96, 112, 128, sms) if g <= sms})
    print(f"\n## streaming read by SMs (one 1024-thread block per SM, 8 loads in flight a thread; % = of the "
          f"{read_bw / 1e12:.2f} TB/s read)")
    print("| bytes | blocks (SMs) | us | GB/s | GB/s per SM | % read |")
    print("|---|---|---|---|---|---|")
    for label, nbytes, copies in (("2 GiB", 2 << 30, 1), ("qkv 6144x4096 (50 MB)", 6144 * 4096 * 2, 8),
                                  ("o 4096x4096 (34 MB)", 4096 * 4096 * 2, 8),
                                  ("gate_up 24576x4096 (201 MB)", 24576 * 4096 * 2, 2)):
        regions = [empty((nbytes // 4,), np.uint32).fill_bytes(0x5A) for _ in range(copies)]
        for g, us in zip(grids, read_time_by_blocks(regions, grids, stream=stream)):
            bw = nbytes / (us * 1e-6)
            print(f"| {label} | {g} | {us:.2f} | {bw / 1e9:.0f} | {bw / 1e9 / g:.1f} | {100 * bw / read_bw:.1f} |",
                  flush=True)
        del regions


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer shapes and budgets")
    ap.add_argument("--linear-only", action="store_true")
    ap.add_argument("--attention-only", action="store_true")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--gmma", action="store_true", help="also time the sm_90a GMMA linear (and its alternative "
                    "instances) against mma.sync (M >= 9) or the planned gemv / x-resident kernel (M < 9)")
    ap.add_argument("--ops", nargs="+", help="linear shapes to time: op names or model:op")
    ap.add_argument("--read-by-sms", action="store_true", help="also time the streaming read of 2 GiB and of the "
                    "Qwen3-8B weights with one 1024-thread block on each of 32..all SMs (how it scales with SMs)")
    ap.add_argument("--fused", action="store_true", help="also time rmsnorm / SwiGLU fused into the linear against "
                    "separate launches (Qwen3-8B qkv, gate_up, down; sm_90a)")
    ap.add_argument("--peer", action="store_true", help="add cuBLAS rows (torch, in a child process)")
    ap.add_argument("--attn-prefix", type=int, nargs="+", default=[1024, 8192, 32768],
                    help="attention: prefix lengths")
    ap.add_argument("--attn-capacity", type=int, help="attention: KV capacity the planned grid is sized for "
                    "(as the engine does; default prefix + T)")
    ap.add_argument("--attn-model", choices=sorted(ATTN_HEADS), default="qwen3-8b", help="attention: head shape")
    ap.add_argument("--attn-splits", type=int, nargs="+", default=[0],
                    help="attention: KV split counts to time per budget (0 = the planned one)")
    ap.add_argument("--attn-budgets", type=int, nargs="+", help="attention: tree budgets (T = budget + 1; 0 = decode)")
    ap.add_argument("--attn-kernels", nargs="+", choices=("auto", "tree", "decode", "gmma"), default=["auto"],
                    help="attention: kernels to time (auto = the one attention() picks)")
    ap.add_argument("--attn-decode-variants", nargs="+", metavar="KTxS",
                    help="attention: decode kernel instances to time, e.g. 32x2 16x3 (default: the planned one)")
    ap.add_argument("--attn-gmma-stages", type=int, nargs="+",
                    help="attention: K/V ring depths of the gmma kernel to time (default: ATTN_GMMA_STAGES)")
    ap.add_argument("--torch-linear", metavar="JSON", help=argparse.SUPPRESS)  # the --peer child
    args = ap.parse_args()
    if args.torch_linear:
        return torch_linear_main(args)
    peer = torch_peer_times(args) if args.peer and not args.attention_only else None
    dev = get_device()
    print(f"# {dev}  (sm_{dev.arch}, {dev.sm_count} SMs)")
    stream = Stream()
    if not args.attention_only:
        read_bw = read_bandwidth(stream=stream)
        print(f"streaming read: {read_bw / 1e12:.3f} TB/s (runtime_probe read_sum_kernel, 2 GiB, best config)")
        if args.read_by_sms:
            bench_read_by_sms(stream, read_bw)
        bench_linear(stream, read_bw, args.m, args.quick, args.gmma, args.ops, peer)
        if args.fused:
            bench_fused(stream, read_bw, args.m, args.ops)
    if not args.linear_only:
        bench_attention(stream, args.quick, args.attn_splits, args.attn_prefix, args.attn_model, args.attn_capacity,
                        args.attn_budgets, [None if k == "auto" else k for k in args.attn_kernels],
                        [tuple(int(x) for x in v.split("x")) for v in args.attn_decode_variants or []] or [None],
                        args.attn_gmma_stages or [None])
        bench_sampling(stream)


if __name__ == "__main__":
    main()
