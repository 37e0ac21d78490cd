"""End-to-end decoding benchmark: tokens/s and acceptance for AR, DFlash chain and DDTree (several budgets),
measured in one run and printed as a table with speed ratios against AR. Also checks that every greedy
output equals the AR output (the lossless property) and marks any row that differs.

    python -m tools.bench_e2e                                  # SmolLM2-135M default, random drafter, numpy
    python -m tools.bench_e2e --model DIR --draft DFLASH_DIR --backend cuda --budgets 16,64,256
    python -m tools.bench_e2e --backend cuda --hf --max-new-tokens 256   # + host us/round, replays, HF peer
    python -m tools.bench_e2e --backend cpu --draft DFLASH_DIR --budgets 4,8 --hf   # CPU, HF on torch CPU
    python -m tools.bench_e2e --backend cuda --random qwen3-8b --budgets 16,64   # 16 GB random bf16, in memory

--random builds the weights in memory (loader.testing.RandomWeights); only with --hf on CUDA, for a small
shape, are they written to a temporary directory, so that transformers loads the same weights.

Without --draft a random-weight drafter is used: acceptance is then near 1 and the table measures the cost of
drafting and verifying, not a speedup.
"""
from __future__ import annotations

import argparse
import math
import sys

import numpy as np


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a short poem about the sea."]


def main(argv=None) -> int:
    from runtime.api import BACKENDS, BackendUnavailable, load_drafter, load_target, select_backend
    from runtime.engine import Engine
    from runtime.testing import first_divergence, greedy_split
    from runtime.models.dflash import DFlashDrafter, random_checkpoint
    import loader

    ap = argparse.ArgumentParser(prog="bench_e2e", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--draft")
    ap.add_argument("--backend", choices=BACKENDS, default="numpy")
    ap.add_argument("--budgets", default="4,16,64", help="comma-separated DDTree budgets")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    ap.add_argument("--random", choices=sorted(RANDOM_SHAPES),
                    help="a random-weight model of this shape instead of --model (prompts become token ids)")
    ap.add_argument("--hf", action="store_true",
                    help="also time HF transformers generate (torch bf16, on the GPU for cuda, else on the CPU)")
    ap.add_argument("--hf-tokens", type=int, default=256, help="tokens for the HF peer (default 256)")
    args = ap.parse_args(argv)
    try:
        budgets = [int(b) for b in args.budgets.split(",")]
        if min(budgets) < 1:
            raise ValueError
    except ValueError:
        print(f"bench_e2e: error: --budgets must be positive integers, got {args.budgets!r}", file=sys.stderr)
        return 2

    hf_peer = False
    try:
        backend = select_backend(args.backend)
        if args.random:
            # in memory (no disk), unless the HF peer will run: it loads a directory, the same weights as ours
            hf_peer = args.hf and random_shape_bytes(args.random) <= HF_PEER_MAX_BYTES
            if args.hf and not hf_peer:
                print(f"bench_e2e: no HF peer for random {args.random} (it would need the weights on disk; "
                      f"only shapes <= {HF_PEER_MAX_BYTES >> 30} GiB are written)", file=sys.stderr)
                args.hf = False
            if hf_peer:
                args.model = random_model_dir(args.random)
                target = build_random_target(args.model, backend)
            else:
                target = random_target(RANDOM_SHAPES[args.random], backend)
            tok = IdTokenizer()
        else:
            target, tok, _, _ = load_target(args.model, backend)
        if args.draft:
            drafter = load_drafter(args.draft, target, backend)
        elif backend.name == "cuda":
            drafter = random_drafter(target, backend)
            print("bench_e2e: no --draft: random-weight drafter (acceptance ~1; measures overhead, not speedup)",
                  file=sys.stderr)
        else:
            n = target.num_layers
            config, weights = random_checkpoint(target.hidden_size, n, target.vocab_size,
                                                taps=(1, n // 2, n - 3) if n > 4 else (0,), block_size=16)
            drafter = DFlashDrafter(loader.load_config(config), weights, backend)
            print("bench_e2e: no --draft: random-weight drafter (acceptance ~1; measures overhead, not speedup)",
                  file=sys.stderr)
    except BackendUnavailable as e:
        print(f"bench_e2e: error: --backend {args.backend}: {e}", file=sys.stderr)
        return 3
    except loader.LoadError as e:
        print(f"bench_e2e: error: cannot load: {e}", file=sys.stderr)
        return 2

    engine = Engine(target, drafter)
    prompts = [tok.encode(p) for p in PROMPTS[:args.prompts]]
    engine.generate(prompts[0], mode="ar", max_new_tokens=2)           # warm-up (allocations, BLAS)
    configs = [("ar", 1), ("chain", 1)] + [("ddtree", b) for b in budgets]
    rows, reference = [], {}
    checker = {}     # the float32 reference that tells a bf16 near-tie from a real split, built on first need

    def split_note(i, ids, ar_tokens, tokens):
        j = first_divergence(tokens, ar_tokens)
        j = min(len(tokens), len(ar_tokens)) if j is None else j      # one output stops early
        if backend.name == "cuda" and "ref" not in checker:
            checker["ref"] = reference_target(args, hf_peer)
        ref = checker.get("ref")
        split = greedy_split(ref, ids, ar_tokens, tokens) if ref is not None else None
        if split is not None and split["tie"]:
            return f"near-tie: prompt {i} token {j} (reference top-2 gap {split['gap_std']:.3f} std)"
        why = (f" (reference top-2 gap {split['gap_std']:.3f} std, both its top two: {split['top2']})"
               if split is not None else "")
        return f"NO: prompt {i} differs from AR at token {j}{why}"

    for mode, budget in configs:
        tokens = decode_s = rounds = 0
        lossless = True
        stage = {}
        for i, ids in enumerate(prompts):
            r = engine.generate(ids, mode=mode, budget=budget, max_new_tokens=args.max_new_tokens)
            if mode == "ar":
                reference[i] = r.tokens
            if lossless is True and r.tokens != reference[i]:
                lossless = split_note(i, ids, reference[i], r.tokens)
            tokens += len(r.tokens) - 1                 # the first token comes from the prefill
            decode_s += r.decode_s
            rounds += len(r.rounds)
            for k, v in r.stage_times().items():
                stage[k] = stage.get(k, 0.0) + v
            print(f"  {mode:6s} budget {budget:4d} prompt {i}: {len(r.tokens)} tokens", file=sys.stderr)
        rows.append((mode, budget, tokens / decode_s, tokens / max(rounds, 1),
                     {k: v / max(rounds, 1) * 1e3 for k, v in stage.items()}, lossless))

    if backend.name == "cuda":
        rows_host = host_overhead(engine, prompts[0], budgets, args.max_new_tokens)
    ar_tps = rows[0][2]
    print(f"\nbackend {backend.name}, {len(prompts)} prompts x {args.max_new_tokens} new tokens, greedy")
    print(f"{'mode':8s} {'budget':>6s} {'tok/s':>8s} {'vs AR':>6s} {'acc/round':>9s} "
          f"{'draft ms':>8s} {'tree ms':>7s} {'verify ms':>9s} {'commit ms':>9s}  lossless")
    for mode, budget, tps, acc, st, ok in rows:
        print(f"{mode:8s} {budget if mode == 'ddtree' else '-':>6} {tps:8.2f} {tps / ar_tps:6.2f} {acc:9.2f} "
              f"{st.get('draft', 0):8.2f} {st.get('tree', 0):7.2f} {st.get('verify', 0):9.2f} "
              f"{st.get('commit', 0):9.2f}  {'yes' if ok is True else ok}")
    strict = backend.name != "cuda"
    if not strict and not all(r[5] is True for r in rows):
        print("  (bf16 on the GPU: the one-token AR kernels and the many-token verify kernels round differently, "
              "so greedy outputs may split where the two best logits nearly tie. near-tie: the float32 reference "
              "(numpy, same weights) agrees, runtime.testing.greedy_split; NO: it does not, or it was not built "
              f"(models over {REFERENCE_MAX_BYTES >> 30} GiB))")
    if backend.name == "cuda":
        print(f"\nCUDA graphs: per-round host work (tree build + walk + uploads/reads + launches, outside GPU "
              f"waits) and graph replay time")
        print(f"{'mode':8s} {'budget':>6s} {'host us/round':>13s} {'median':>7s} {'tree us':>8s} {'walk us':>8s}")
        for mode, budget, host_us, host_median, tree_us, walk_us in rows_host:
            print(f"{mode:8s} {budget:>6} {host_us:13.1f} {host_median:7.1f} {tree_us:8.1f} {walk_us:8.1f}")
        for name, ms in sorted(engine._graph_decoder.replay_ms().items()):
            print(f"  replay {name:24s} {ms * 1e3:9.1f} us")
    if args.hf:
        device = "cuda" if backend.name == "cuda" else "cpu"
        hf_tps = hf_generate_tps(args.model, tok, PROMPTS[0], args.hf_tokens, device)
        if hf_tps is not None:
            best = max(r[2] for r in rows[1:])
            print(f"\nHF transformers generate (torch {device} bf16, greedy, {args.hf_tokens} tokens): "
                  f"{hf_tps:.1f} tok/s; ours AR {ar_tps:.1f} tok/s = {ar_tps / hf_tps:.1f}x, best speculative mode "
                  f"{best:.1f} tok/s = {best / hf_tps:.1f}x")
    return 0 if not strict or all(r[5] is True for r in rows) else 1


RANDOM_SHAPES = {
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                     tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645),
    # Qwen3-8B's layer layout (head_dim 128, GQA 4:1, q/k norm, untied) at toy size: CPU runs of the tools
    # (--fake) and quick checks; vocab > 32016 for IdTokenizer's ids
    "qwen3-tiny": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=32768, hidden_size=256,
                       intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                       head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
}
# Shapes the HF peer (--hf) may write to disk for transformers to load (bigger ones run without the peer).
HF_PEER_MAX_BYTES = 2 << 30
REFERENCE_MAX_BYTES = 2 << 30   # the float32 numpy reference that classifies a greedy split, up to this checkpoint


def reference_target(args, hf_peer: bool):
    """The float32 numpy model of the benchmarked weights (to classify greedy splits), or None (with a notice)
    where the checkpoint is over REFERENCE_MAX_BYTES."""
    import os
    from pathlib import Path
    import loader
    from runtime.backends.numpy_backend import NumpyBackend
    from runtime.api import load_target
    if args.random:
        size = random_shape_bytes(args.random)
    else:
        path = Path(args.model) if args.model else loader.default_model_path()
        size = (os.path.getsize(path) if path.is_file() else
                sum(f.stat().st_size for f in path.rglob("*") if f.is_file()))
    if size > REFERENCE_MAX_BYTES:
        print(f"bench_e2e: no float32 reference for the lossless column ({size / 2**30:.1f} GiB > "
              f"{REFERENCE_MAX_BYTES >> 30} GiB): a split is marked NO", file=sys.stderr)
        return None
    print("bench_e2e: building the float32 reference (numpy) to classify a greedy split", file=sys.stderr)
    if args.random:
        return (build_random_target(args.model, NumpyBackend()) if hf_peer else
                random_target(RANDOM_SHAPES[args.random], NumpyBackend()))
    return load_target(args.model, NumpyBackend())[0]


class IdTokenizer:
    """Prompts of a random model: text -> fixed token ids (no vocabulary to speak of)."""

    def encode(self, text, add_special_tokens=True):
        return [(ord(c) * 131) % 32000 + 16 for c in text]


def random_model_dir(shape: str) -> str:
    """Random bf16 weights of a known shape in a temporary directory (kept for the HF peer to load)."""
    import tempfile
    from loader.testing import write_tiny_model
    d = tempfile.mkdtemp(prefix=f"ddtree-{shape}-")
    print(f"bench_e2e: writing a random {shape} to {d}", file=sys.stderr)
    write_tiny_model(d, RANDOM_SHAPES[shape], seed=0)
    return d


def build_random_target(path, backend):
    import loader
    from runtime.models import build_model
    spec, weights = loader.load_model(path)
    return build_model(spec, weights, backend)


def random_shape_bytes(shape: str) -> int:
    """Checkpoint bytes (bf16) of a random shape."""
    import loader
    from loader.names import expected_tensors
    spec = loader.load_config(RANDOM_SHAPES[shape])
    return sum(2 * math.prod(e.shape) for e in expected_tensors(spec).values() if not e.optional)


def random_target(config: dict, backend, seed: int = 0, progress=None):
    """A random-weight target of an HF config, built in memory (loader.testing.RandomWeights: no disk, the host
    holds one pool as large as the largest tensor). progress(layer, layers) is called as each layer is read."""
    import loader
    from loader.testing import RandomWeights
    from runtime.models import build_model
    from runtime.models.common import Weights
    spec = loader.load_config(config)
    weights = RandomWeights(spec, seed=seed)
    if progress is not None:
        weights = Weights(weights, on_layer=lambda i: progress(i, spec.num_hidden_layers))
    return build_model(spec, weights, backend)


def random_drafter(target, backend, seed: int = 0, block_size: int = 16):
    """A random-weight DFlash drafter with head_dim 64 (the CUDA attention kernels' size), taps spread over the
    target's layers; random weights in memory (loader.testing.RandomWeights), no checkpoint on disk."""
    import loader
    from loader.testing import RandomWeights
    from runtime.models.dflash import DFlashDrafter
    n = target.num_layers
    taps = [1, n // 2, n - 3] if n > 4 else [0]
    cfg = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=target.hidden_size,
               intermediate_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
               head_dim=64, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=4096,
               vocab_size=target.vocab_size, block_size=block_size, num_target_layers=n,
               dflash_config=dict(target_layer_ids=taps, mask_token_id=target.vocab_size - 1))
    spec = loader.load_config(cfg)
    return DFlashDrafter(spec, RandomWeights(spec, seed=seed), backend)


def host_overhead(engine, ids, budgets, max_new_tokens):
    """Host microseconds per round of the graph-captured loop (RoundStats.times['host']): the mean, the median (the
    device machine's host stalls swing single means by up to 2x), and the means of its tree and walk parts."""
    out = []
    for mode, budget in [("ar", 1)] + [("ddtree", b) for b in budgets]:
        r = engine.generate(ids, mode=mode, budget=budget, max_new_tokens=max_new_tokens)
        n = max(len(r.rounds), 1)
        mean = lambda k: sum(x.times.get(k, 0.0) for x in r.rounds) / n * 1e6
        median = float(np.median([x.times.get("host", 0.0) for x in r.rounds] or [0.0])) * 1e6
        out.append((mode, budget if mode == "ddtree" else "-", mean("host"), median, mean("tree"), mean("walk")))
    return out


def hf_generate_tps(model_arg, tok, prompt, new_tokens, device="cuda"):
    """HF transformers `generate` on the same weights (torch on `device`, bf16, greedy): tokens/s, or None with the
    reason on stderr. Llama-architecture GGUF (the default SmolLM2) or an HF directory. On the CPU torch uses its
    default thread count; bf16 ran 1.5x faster than float32 there (27 vs 18 tok/s, SmolLM2, 2 cores)."""
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"bench_e2e: no HF peer: {e}", file=sys.stderr)
        return None
    if device == "cuda" and not torch.cuda.is_available():
        print("bench_e2e: no HF peer: torch has no CUDA device", file=sys.stderr)
        return None
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    import time
    from pathlib import Path
    import loader
    path = Path(model_arg) if model_arg else loader.default_model_path()
    if path.is_dir():
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16)
    else:
        from tools.hf_reference import llama_from_gguf
        hf = llama_from_gguf(loader.load_gguf(path))
    hf = hf.to(device, torch.bfloat16).eval()
    ids = torch.tensor([tok.encode(prompt)], device=device)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=new_tokens)
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=8, **{**kw, "min_new_tokens": 8})          # warm-up
        sync()
        t = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=new_tokens, **kw)
        sync()
        dt = time.perf_counter() - t
    return (out.shape[1] - ids.shape[1]) / dt


if __name__ == "__main__":
    sys.exit(main())
