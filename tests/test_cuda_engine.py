"""The CUDA backend and the graph-captured engine (runtime/backends/cuda_backend.py, runtime/cuda_engine.py):
- model logits on CUDA (bf16) vs the numpy backend (float32, same weights): tiny random Qwen3 (q/k norm) and
  Llama (llama3 rope, odd vocab: padded logits rows), prefill and a tree verify at a prefix;
- lossless on the GPU: DDTree greedy == AR greedy for every budget bucket 16..1024 (tiny random Qwen3 +
  tiny random drafter) and on SmolLM2-135M (embedded GGUF) with a random drafter; sampled DDTree == sampled
  AR for a seed (position-keyed Philox sampling);
- graphs are replayed, not re-captured, across rounds and generate calls.
Skipped with the reason when no GPU is usable (the `cuda_device` fixture)."""
import warnings

import numpy as np
import pytest

from loader import load_config, open_checkpoint
from loader.testing import write_tiny_model
from runtime.backends.base import causal_visibility
from runtime.backends.numpy_backend import NumpyBackend
from runtime.engine import Engine
from runtime.models import build_model
from runtime.models.dflash import DFlashDrafter
from runtime.philox import position_uniforms, seed_key
from runtime.testing import NEAR_TIE, first_divergence, greedy_split, reference_logits

pytestmark = pytest.mark.gpu

QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=128, hidden_size=128,
             intermediate_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=4096, tie_word_embeddings=True,
             eos_token_id=[2])
LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=131, hidden_size=256,
             intermediate_size=384, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64})
PROMPT = [3, 17, 42, 8, 91, 5, 60, 33, 12]
BUCKET_BUDGETS = (16, 32, 64, 128, 256, 512, 1024)


def drafter_config(target_cfg, taps=(0, 2), block_size=8):
    """A DFlash drafter for the target (head_dim 64: the attention kernels' size)."""
    return dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=target_cfg["hidden_size"],
                intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=4096,
                vocab_size=target_cfg["vocab_size"], block_size=block_size,
                num_target_layers=target_cfg["num_hidden_layers"],
                dflash_config=dict(target_layer_ids=list(taps), mask_token_id=target_cfg["vocab_size"] - 1))


def load(folder, backend):
    return build_model(load_config(folder), open_checkpoint(folder), backend)


@pytest.fixture(scope="module")
def cuda_backend(cuda_device):
    from runtime.backends.cuda_backend import CudaBackend
    return CudaBackend()


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda_tiny")
    for name, cfg, seed in (("qwen3", QWEN3, 0), ("llama", LLAMA, 1)):
        write_tiny_model(root / name, cfg, seed=seed)
    write_tiny_model(root / "draft", drafter_config(QWEN3), seed=2)
    return root


def _rel_err(got, want):
    assert not np.isnan(got).any(), "NaN in CUDA logits"
    return float(np.abs(got - want).max() / (np.abs(want).max() + 1e-6))


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_logits_match_numpy(cuda_backend, tiny_dirs, kind):
    """Prefill of 9 tokens, then a 6-node tree verify at that prefix (KV written at the offset, prefix +
    bitmask attention): CUDA bf16 logits within bf16 tolerance of the float32 reference."""
    ref, cu = load(tiny_dirs / kind, NumpyBackend()), load(tiny_dirs / kind, cuda_backend)
    tree_ids = np.array([7, 9, 11, 13, 4, 6], np.int32)
    parents = [-1, 0, 0, 1, 1, 3]
    depth = np.zeros(6, np.int32)
    vis = np.zeros((6, 1), np.uint32)
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
        vis[i, 0] = (1 << i) | (vis[p, 0] if p >= 0 else 0)
    logits = {}
    for name, m in (("ref", ref), ("cuda", cu)):
        b = m.backend
        cache = m.new_cache(64)
        ids = np.asarray(PROMPT, np.int32)
        h, _ = m.forward(cache, b.from_host(ids), b.from_host(np.arange(len(ids), dtype=np.int32)),
                         b.from_host(causal_visibility(len(ids))))
        cache.length = len(ids)
        h2, _ = m.forward(cache, b.from_host(tree_ids), b.from_host(len(ids) + depth), b.from_host(vis))
        logits[name] = (b.to_host(m.logits(h)), b.to_host(m.logits(h2)))
    for stage, got, want in zip(("prefill", "verify"), logits["cuda"], logits["ref"]):
        assert got.shape == want.shape
        err = _rel_err(got, want)
        assert err < 5e-2, f"{kind} {stage}: max error {err:.3g} of the logit range"
    assert np.mean(np.argmax(logits["cuda"][1], -1) == np.argmax(logits["ref"][1], -1)) >= 0.5


def check_lossless(ref_model, prompt, ar_tokens, dd_tokens, what) -> str | None:
    """DDTree tokens == AR tokens; or else the outputs split at a bf16 near-tie of the float32 reference (numpy
    backend, same weights; runtime.testing.greedy_split): both choices are then the target's greedy token within
    bf16 precision. Returns a note in that case; fails on any other divergence (a logic error)."""
    split = greedy_split(ref_model, prompt, ar_tokens, dd_tokens)
    if split is None:
        assert len(dd_tokens) == len(ar_tokens), what
        return None
    i, gap_std = split["index"], split["gap_std"]
    assert split["tie"], (f"{what}: ddtree != ar from token {i} (ar {split['a']}, ddtree {split['b']}); reference "
                          f"top-2 gap {gap_std:.3f} std (near-tie below {NEAR_TIE}), both its top two: {split['top2']}")
    note = f"{what}: bf16 near-tie at token {i} (reference top-2 gap {gap_std:.3f} std < {NEAR_TIE})"
    warnings.warn(note)
    return note


def test_ddtree_equals_ar_every_bucket(cuda_backend, tiny_dirs):
    target = load(tiny_dirs / "qwen3", cuda_backend)
    spec, ckpt = load_config(tiny_dirs / "draft"), open_checkpoint(tiny_dirs / "draft")
    drafter = DFlashDrafter(spec, ckpt, cuda_backend)
    engine = Engine(target, drafter)
    ar = engine.generate(PROMPT, mode="ar", max_new_tokens=48)
    assert len(ar.tokens) == 48
    ref = None
    accepted_any = moved_any = False
    for budget in BUCKET_BUDGETS:
        dd = engine.generate(PROMPT, mode="ddtree", budget=budget, max_new_tokens=48)
        if dd.tokens != ar.tokens:
            ref = ref or load(tiny_dirs / "qwen3", NumpyBackend())
            check_lossless(ref, PROMPT, ar.tokens, dd.tokens, f"budget {budget}")
        assert sum(r.committed for r in dd.rounds) == 47
        accepted_any |= dd.mean_accepted > 1.0
        moved_any |= sum(r.kv_moved for r in dd.rounds) > 0
    chain = engine.generate(PROMPT, mode="chain", max_new_tokens=48)
    if chain.tokens != ar.tokens:
        check_lossless(ref or load(tiny_dirs / "qwen3", NumpyBackend()), PROMPT, ar.tokens, chain.tokens, "chain")
    assert accepted_any and moved_any, "the tree path (accepted drafts, KV compaction) was never exercised"
    dec = engine._graph_decoder
    assert len(dec.graphs) == 1 + 2 * len(BUCKET_BUDGETS) + 1, sorted(dec.graphs)   # ar, verify+draft per bucket, chain draft
    before = dict(dec.graphs)
    first = engine.generate(PROMPT, mode="ddtree", budget=64, max_new_tokens=48)
    again = engine.generate(PROMPT, mode="ddtree", budget=64, max_new_tokens=48)
    assert again.tokens == first.tokens
    assert all(dec.graphs[k] is g for k, g in before.items()), "graphs were captured again"


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_fused_prologues_at_verify_sizes(cuda_backend, tiny_dirs, kind, monkeypatch):
    """DDTREE_FUSED_PROLOGUE_ROWS=32: rmsnorm (+ the pending residual add) and swiglu fused into the linears up
    to 32 rows (the 9-token prefill, budget-16 verify and drafter blocks): logits within bf16 tolerance of the
    reference, and DDTree still equal to AR at every bucket."""
    import runtime.dense_kernels as dk
    monkeypatch.setattr(dk, "FUSED_PROLOGUE_ROWS", {"rmsnorm": 32, "swiglu": 32})
    test_logits_match_numpy(cuda_backend, tiny_dirs, kind)
    if kind == "qwen3":
        test_ddtree_equals_ar_every_bucket(cuda_backend, tiny_dirs)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_narrow_gmma_linears_in_the_engine(cuda_backend, tiny_dirs, kind, monkeypatch, cuda_device):
    """DDTREE_GMMA_NARROW=1 with its plan limits lifted so the tiny models take it (sm_90a): every linear of up to 80
    rows on the narrow-row kernel, decode sizes included, with rmsnorm (+ the residual add) and SwiGLU fused into
    it: logits within bf16 tolerance of the reference, DDTree equal to AR at every bucket (budgets over 64 mix in
    the other GMMA plans), and the narrow kernel did run, fused."""
    from runtime import dense_gmma
    if not dense_gmma.gmma_available(cuda_device.arch):
        pytest.skip(f"the GMMA kernels are sm_90a only; device is sm_{cuda_device.arch}")
    for name, value in (("GMMA_NARROW", True), ("NARROW_MAX_BYTES_PER_SM", None), ("NARROW_FUSE", True),
                        ("NARROW_FILL", 0.0), ("NARROW_X_PER_W", 8.0),
                        ("NARROW_GMMA_IDLE", 2.0), ("GMMA_DECODE_MIN_BYTES", 0), ("GMMA_DECODE_MIN_K", 0)):
        monkeypatch.setattr(dense_gmma, name, value)
    entries = set()
    real = dense_gmma.launch_narrow
    monkeypatch.setattr(dense_gmma, "launch_narrow", lambda *a, **k: entries.add(a[-1][0]) or real(*a, **k))
    test_logits_match_numpy(cuda_backend, tiny_dirs, kind)
    if kind == "qwen3":
        test_ddtree_equals_ar_every_bucket(cuda_backend, tiny_dirs)
    xmodes = {dense_gmma.gmma_narrow_config(e)[4] for e in entries}
    tiles = {dense_gmma.gmma_narrow_config(e)[1] for e in entries}
    assert xmodes == {0, 1, 2}, entries   # plain, rmsnorm, swiglu
    assert 16 in tiles and (kind == "llama" or 80 in tiles), entries


def test_eager_cuda_engine_matches_graphs(tiny_dirs, cuda_device):
    """The generic engine loop on the CUDA backend (no graphs, host prefix) gives the graph path's tokens,
    greedy and sampled."""
    from runtime.backends.cuda_backend import CudaBackend
    eager = CudaBackend(graphs=False)
    target = load(tiny_dirs / "qwen3", eager)
    drafter = DFlashDrafter(load_config(tiny_dirs / "draft"), open_checkpoint(tiny_dirs / "draft"), eager)
    e = Engine(target, drafter).generate(PROMPT, mode="ddtree", budget=64, max_new_tokens=24)
    es = Engine(target, drafter).generate(PROMPT, mode="ddtree", budget=64, max_new_tokens=24, temperature=0.9,
                                          seed=3)
    g = Engine(target, drafter)
    eager.graphs = True
    try:
        gr = g.generate(PROMPT, mode="ddtree", budget=64, max_new_tokens=24)
        gs = g.generate(PROMPT, mode="ddtree", budget=64, max_new_tokens=24, temperature=0.9, seed=3)
    finally:
        eager.graphs = False
    ref = load(tiny_dirs / "qwen3", NumpyBackend())
    if e.tokens != gr.tokens:
        check_lossless(ref, PROMPT, e.tokens, gr.tokens, "eager vs graphs")
    check_lossless_sampled(ref, PROMPT, es.tokens, gs.tokens, 0.9, 3, "sampled eager vs graphs")


@pytest.fixture(scope="module")
def smollm2_cuda(cuda_backend):
    import os
    import loader
    path = os.environ.get("DDTREE_SMOLLM2_GGUF")
    try:
        path = path or loader.default_model_path()
    except Exception as e:
        pytest.skip(f"SmolLM2 GGUF not available: {e}")
    g = loader.load_gguf(path)
    return g, build_model(g.spec, g, cuda_backend)


def test_smollm2_ddtree_equals_ar(smollm2_cuda, tmp_path):
    g, model = smollm2_cuda
    ref = build_model(g.spec, g, NumpyBackend())
    s = model.spec
    cfg = drafter_config(dict(hidden_size=s.hidden_size, vocab_size=s.vocab_size,
                              num_hidden_layers=s.num_hidden_layers), taps=(2, 14, 26), block_size=16)
    write_tiny_model(tmp_path / "draft", cfg, seed=7)
    drafter = DFlashDrafter(load_config(tmp_path / "draft"), open_checkpoint(tmp_path / "draft"), model.backend)
    engine = Engine(model, drafter)
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        ids = g.tokenizer.encode(prompt)
        ar = engine.generate(ids, mode="ar", max_new_tokens=48)
        for budget in BUCKET_BUDGETS:
            dd = engine.generate(ids, mode="ddtree", budget=budget, max_new_tokens=48)
            check_lossless(ref, ids, ar.tokens, dd.tokens, f"{prompt!r} budget {budget}")


NEAR_EDGE = 0.03    # a sampled divergence is a bf16 rounding when u is this close to both tokens' CDF intervals


def check_lossless_sampled(ref_model, prompt, ar_tokens, dd_tokens, temperature, seed, what) -> str | None:
    """Sampled DDTree tokens == sampled AR tokens for one seed (both draw the token after position p with the
    Philox uniform u of (seed, p)); or else, at the first divergence, u lies within NEAR_EDGE of the float32
    reference's CDF interval of both tokens: AR (one-row kernels) and verify (many-row kernels) round the
    logits differently in bf16 and u sits on the edge between the two. Any other divergence fails (a sample
    keyed by something other than (seed, position), or a walk error)."""
    i = first_divergence(dd_tokens, ar_tokens)
    if i is None:
        assert len(dd_tokens) == len(ar_tokens), what
        return None
    z, last_pos = reference_logits(ref_model, list(prompt) + list(ar_tokens[:i]))
    z = z.astype(np.float64) / temperature
    cdf = np.cumsum(np.exp(z - z.max()))
    cdf /= cdf[-1]
    u = float(position_uniforms(seed_key(seed), [last_pos])[0])

    def dist(t):
        lo = cdf[t - 1] if t > 0 else 0.0
        return max(lo - u, u - cdf[t], 0.0)
    far = max(dist(int(ar_tokens[i])), dist(int(dd_tokens[i])))
    assert far < NEAR_EDGE, (f"{what}: ddtree != ar from token {i} (ar {ar_tokens[i]}, ddtree {dd_tokens[i]}); "
                             f"u = {u:.5f} is {far:.4f} from a token's reference CDF interval (>= {NEAR_EDGE})")
    note = f"{what}: sampled bf16 edge at token {i} (u {far:.4f} from the reference interval)"
    warnings.warn(note)
    return note


def test_sampled_ddtree_equals_ar(cuda_backend, tiny_dirs):
    """Temperature > 0 through the graphs: the sample kernel draws u from Philox of (seed, position), reading
    the seed from the state block and the positions the forward uses. So DDTree == AR token for token for a
    seed (up to bf16 CDF-edge roundings, check_lossless_sampled), another seed samples other tokens, and a
    new seed replays the captured graphs (nothing is captured again)."""
    target = load(tiny_dirs / "qwen3", cuda_backend)
    drafter = DFlashDrafter(load_config(tiny_dirs / "draft"), open_checkpoint(tiny_dirs / "draft"), cuda_backend)
    engine = Engine(target, drafter)
    ref = load(tiny_dirs / "qwen3", NumpyBackend())
    for temperature in (0.8, 1.5):
        outputs = {}
        for seed in (5, 2**63 + 6):
            ar = engine.generate(PROMPT, mode="ar", max_new_tokens=32, temperature=temperature, seed=seed)
            assert len(ar.tokens) == 32 and all(0 <= t < QWEN3["vocab_size"] for t in ar.tokens)
            outputs[seed] = ar.tokens
            accepted_any = False
            for budget in (16, 64, 256):
                dd = engine.generate(PROMPT, mode="ddtree", budget=budget, max_new_tokens=32,
                                     temperature=temperature, seed=seed)
                check_lossless_sampled(ref, PROMPT, ar.tokens, dd.tokens, temperature, seed,
                                       f"T={temperature} seed={seed} budget={budget}")
                accepted_any |= dd.mean_accepted > 1.0
            chain = engine.generate(PROMPT, mode="chain", max_new_tokens=32, temperature=temperature, seed=seed)
            check_lossless_sampled(ref, PROMPT, ar.tokens, chain.tokens, temperature, seed,
                                   f"T={temperature} seed={seed} chain")
            assert accepted_any, f"T={temperature} seed={seed}: no drafted token accepted (tree path unexercised)"
        a, b = outputs.values()
        assert a != b, f"T={temperature}: two seeds gave the same 32 tokens"
    dec = engine._graph_decoder
    before = dict(dec.graphs)
    again = engine.generate(PROMPT, mode="ddtree", budget=64, max_new_tokens=32, temperature=1.5, seed=5)
    other = engine.generate(PROMPT, mode="ddtree", budget=64, max_new_tokens=32, temperature=1.5, seed=99)
    assert again.tokens != other.tokens
    assert dec.graphs.keys() == before.keys() and all(dec.graphs[k] is g for k, g in before.items()), \
        "a new seed captured graphs again"
