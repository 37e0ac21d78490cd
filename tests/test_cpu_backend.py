"""The cpu backend (runtime/backends/cpu_backend.py) and its kernels (runtime/cpu_kernels.pyx: cpu_linear.h,
cpu_attention.h): each against a float64 reference at odd sizes, rows independent of how many share a call, bad
input refused; the backend against the numpy reference on tiny models; a tree verify bit-equal to the forward of
each node's path, and DDTree == AR."""
import numpy as np
import pytest

from runtime import api, cpu_kernels
from runtime.backends.cpu_backend import CpuBackend
from runtime.bf16 import from_bf16, round_bf16, to_bf16
from runtime.backends.base import causal_visibility, unpack_visibility
from runtime.testing import assert_close, random_parents, tree_visibility
from test_api import PROMPT, tiny_dirs  # noqa: F401  (the module-scoped fixture)
from test_ddtree_run import need_default_model


def _bf16_matrix(rng, n, k):
    return to_bf16(rng.standard_normal((n, k), dtype=np.float32)).reshape(n, k)


ISAS = cpu_kernels.isa_levels()      # every build this CPU runs: baseline, avx2+fma, avx512bf16 where there


def _reference(x, w):
    """float64 of what the kernel computes (bf16 weights: bf16(x) @ W^T; float32 weights: x @ W^T), and a bound on
    float32 summation error per element."""
    if w.dtype == np.uint16:
        xr, wf = round_bf16(x).astype(np.float64), from_bf16(w).reshape(w.shape).astype(np.float64)
    else:
        xr, wf = x.astype(np.float64), w.astype(np.float64)
    return xr @ wf.T, 4 * x.shape[1] * np.finfo(np.float32).eps * (np.abs(xr) @ np.abs(wf).T)


def _weight(rng, n, k, wtype):
    return _bf16_matrix(rng, n, k) if wtype == "bf16" else rng.standard_normal((n, k), dtype=np.float32)


@pytest.mark.parametrize("wtype", ["bf16", "f32"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7, 9, 17, 33])
@pytest.mark.parametrize("N,K", [(1, 8), (3, 7), (37, 64), (111, 100), (64, 576), (130, 1), (5, 33)])
def test_linear_matches_float64(wtype, isa, M, N, K):
    rng = np.random.default_rng(M * 1000 + N * 10 + K)
    x = rng.standard_normal((M, K), dtype=np.float32)
    w = _weight(rng, N, K, wtype)
    out = np.full((M, N), np.nan, np.float32)                 # poisoned: every element must be written
    got = cpu_kernels.linear(x, w, out=out, isa=isa)
    assert got is out
    want, slack = _reference(x, w)
    assert_close(got, want, f"linear {wtype} {isa} M={M} N={N} K={K}", rtol=0, atol=0, scale=None, slack=slack)


@pytest.mark.parametrize("wtype", ["bf16", "f32"])
@pytest.mark.parametrize("isa", ISAS)
def test_linear_rows_do_not_depend_on_the_batch(isa, wtype):
    """A row's result is bit-identical whether it comes alone or with up to 16 others (and in any tile position):
    what lets a tree verify on this backend score each node exactly as an AR step."""
    rng = np.random.default_rng(7)
    K, N = 583, 259                     # K: a partial last chunk for every build
    w = _weight(rng, N, K, wtype)
    x = rng.standard_normal((17, K), dtype=np.float32)
    alone = np.stack([cpu_kernels.linear(x[i:i + 1], w, isa=isa)[0] for i in range(17)])
    for M in (2, 3, 4, 5, 8, 9, 17):
        for lo in (0, 17 - M):
            assert np.array_equal(cpu_kernels.linear(x[lo:lo + M], w, isa=isa), alone[lo:lo + M]), (M, lo)


@pytest.mark.parametrize("isa", ISAS)
def test_linear_nan_propagates_and_views_work(isa):
    rng = np.random.default_rng(3)
    w = _bf16_matrix(rng, 9, 40)
    x = rng.standard_normal((6, 80), dtype=np.float32)[:, ::2]       # a strided view: copied, not misread
    want, slack = _reference(np.ascontiguousarray(x), w)
    assert_close(cpu_kernels.linear(x, w, isa=isa), want, "strided x", rtol=0, atol=0, scale=None, slack=slack)
    x = np.ascontiguousarray(x)
    x[2, 5] = np.nan
    y = cpu_kernels.linear(x, w, isa=isa)
    assert np.isnan(y[2]).all() and np.isfinite(np.delete(y, 2, axis=0)).all()


def test_linear_refuses_bad_input():
    x, w = np.zeros((2, 8), np.float32), np.zeros((3, 8), np.uint16)
    with pytest.raises(ValueError, match=r"x is \[M=2, K=8\] but w is \[N=3, K=7\]"):
        cpu_kernels.linear(x, np.zeros((3, 7), np.uint16))
    with pytest.raises(ValueError, match="x must be a 2-D float32"):
        cpu_kernels.linear(x.astype(np.float64), w)
    with pytest.raises(ValueError, match=r"w must be a 2-D uint16 \(bf16\) or float32"):
        cpu_kernels.linear(x, w.astype(np.float64))
    with pytest.raises(ValueError, match=r"out must be a writeable C-contiguous float32 \[M=2, N=3\]"):
        cpu_kernels.linear(x, w, out=np.zeros((3, 2), np.float32))
    assert cpu_kernels.linear(np.zeros((0, 8), np.float32), w).shape == (0, 3)


def _attention_reference(q, k, v, n_prefix, vis, scale):
    """float64 softmax attention over the prefix and the visible new slots (GQA by head // group)."""
    t, h, _ = q.shape
    group = h // k.shape[1]
    dense = unpack_visibility(vis, t)
    out = np.zeros((t, h, v.shape[2]))
    for i in range(t):
        keys = np.concatenate([np.arange(n_prefix), n_prefix + np.flatnonzero(dense[i])])
        for j in range(h):
            s = k[keys, j // group].astype(np.float64) @ q[i, j].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[i, j] = (p / p.sum()) @ v[keys, j // group]
    return out


@pytest.mark.parametrize("t,h,hkv,d,dv,n_prefix", [(1, 4, 2, 64, 64, 0), (1, 9, 3, 64, 64, 37), (17, 9, 3, 64, 64, 5),
                                                   (40, 4, 1, 24, 24, 13), (33, 4, 4, 40, 32, 0),
                                                   (6, 8, 2, 7, 5, 3), (9, 8, 2, 16, 16, 0)])
@pytest.mark.parametrize("isa", ISAS)
def test_attention_matches_float64(t, h, hkv, d, dv, n_prefix, isa):
    rng = np.random.default_rng(t * 100 + d)
    q = rng.standard_normal((t, h, d), dtype=np.float32)
    cap = n_prefix + t + 5
    k = rng.standard_normal((cap, hkv, d), dtype=np.float32)
    v = rng.standard_normal((cap, hkv, dv), dtype=np.float32)
    vis = tree_visibility(random_parents(rng, t))
    got = cpu_kernels.attention(q, k, v, n_prefix, vis, 0.3, isa=isa)
    assert_close(got, _attention_reference(q, k, v, n_prefix, vis, 0.3), f"attention {isa} t={t} d={d}", rtol=0,
                 atol=2e-6)
    if n_prefix == 0:                # a row that sees no key at all: NaN (softmax over nothing), not garbage
        blind = vis.copy()
        blind[0] = 0
        assert np.isnan(cpu_kernels.attention(q, k, v, 0, blind, 0.3, isa=isa)[0]).all()
    causal = cpu_kernels.attention(q, k, v, n_prefix, causal_visibility(t), 0.3, isa=isa)
    assert_close(causal, _attention_reference(q, k, v, n_prefix, causal_visibility(t), 0.3), "causal", rtol=0,
                 atol=2e-6)


def test_attention_row_equals_its_path_alone():
    """A tree node's row, computed in a 23-node verify, is bit-identical to one query over a cache holding the
    prefix and then the node's ancestors contiguously (what the AR steps of those tokens leave behind)."""
    rng = np.random.default_rng(5)
    t, h, hkv, d, n_prefix = 23, 9, 3, 64, 31
    parents = random_parents(rng, t, window=3)
    vis = tree_visibility(parents)
    q = rng.standard_normal((t, h, d), dtype=np.float32)
    k = rng.standard_normal((n_prefix + t, hkv, d), dtype=np.float32)
    v = rng.standard_normal((n_prefix + t, hkv, d), dtype=np.float32)
    tree = cpu_kernels.attention(q, k, v, n_prefix, vis, 0.125)
    dense = unpack_visibility(vis, t)
    for node in range(t):
        path = np.flatnonzero(dense[node])               # ancestors in slot order, the node last
        slots = np.concatenate([np.arange(n_prefix), n_prefix + path])
        alone = cpu_kernels.attention(q[node:node + 1], k[slots], v[slots], len(slots) - 1, causal_visibility(1),
                                      0.125)
        assert np.array_equal(alone[0], tree[node]), node


def test_attention_refuses_bad_input():
    q, kv = np.zeros((3, 4, 8), np.float32), np.zeros((10, 2, 8), np.float32)
    with pytest.raises(ValueError, match="need n_prefix"):
        cpu_kernels.attention(q, kv, kv, 8, causal_visibility(3), 1.0)            # 8 + 3 > 10 slots
    with pytest.raises(ValueError, match="H a multiple of Hkv"):
        cpu_kernels.attention(np.zeros((3, 3, 8), np.float32), kv, kv, 0, causal_visibility(3), 1.0)
    with pytest.raises(ValueError, match="visibility must be uint32"):
        cpu_kernels.attention(q, kv, kv, 0, np.zeros((2, 1), np.uint32), 1.0)


def _bf16_tiny(kind, tmp_path):
    """A tiny HF model of test_models saved in bf16 (so the cpu backend holds its matrices in bf16 and runs its own
    linear; float32 checkpoints stay on BLAS), loaded on the cpu backend; and its folder."""
    import torch
    from loader import load_config, open_checkpoint
    from runtime.models import build_model
    from test_models import hf_tiny
    hf, _ = hf_tiny(kind, tmp_path)
    folder = tmp_path / f"{kind}-bf16"
    hf.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    model = build_model(load_config(folder), open_checkpoint(folder), CpuBackend())
    assert any(getattr(w, "dtype", None) == np.uint16 for w in vars(model.layers[0]).values())
    return model, folder


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_tree_verify_bit_equal_to_path_forward(kind, tmp_path):
    """On the cpu backend a tree verify's logits at each node are bit-identical to the last row of a forward over
    the prefix and that node's path (llama family: every op is row-wise or one of the two kernels)."""
    from runtime.testing import tree_depths
    from test_models import VOCAB, forward_logits
    model, _ = _bf16_tiny(kind, tmp_path)
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, VOCAB, 11)
    parents = random_parents(rng, 40, window=4)
    tokens, vis = rng.integers(0, VOCAB, 40).astype(np.int32), tree_visibility(parents)
    cache = model.new_cache(128)
    forward_logits(model, prefix, cache=cache)
    cache.length = len(prefix)
    tree_logits = forward_logits(model, tokens, positions=len(prefix) + tree_depths(parents), visibility=vis,
                                 cache=cache)
    dense = unpack_visibility(vis, 40)
    for node in range(40):
        path = np.flatnonzero(dense[node])
        ref = forward_logits(model, np.concatenate([prefix, tokens[path]]))[-1]
        assert np.array_equal(tree_logits[node], ref), (kind, node)


def test_deepseek_runs_on_the_cpu_backend(tmp_path):
    """DeepSeek-V3 (MLA, MoE) on the cpu backend against the same backend with numpy in place of its two kernels
    (bf16-rounded inputs of the bf16 linears, float64 products; numpy attention): within bf16 rounding (an input
    that differs in its last float32 bit can round to the next bf16; 0.3% of the logit range here). Against the
    float32 numpy backend no such bound holds: bf16 activations move this tiny random MoE's router logits by ~1%
    and flip its expert choices (64% of the logit range at the output)."""
    from loader import load_config, open_checkpoint
    from runtime.backends.numpy_backend import NumpyBackend
    from runtime.models import build_model
    from test_models import VOCAB, forward_logits

    class NumpyKernels(CpuBackend):
        def linear(self, x, w, bias=None):
            if w.dtype != np.uint16:
                return super().linear(x, w, bias)
            y = (round_bf16(x).astype(np.float64) @ from_bf16(w).reshape(w.shape).T.astype(np.float64)).astype(
                np.float32)
            return y if bias is None else y + bias

        def attention(self, *args):
            return NumpyBackend.attention(self, *args)
    _, folder = _bf16_tiny("deepseek", tmp_path)
    ids = np.random.default_rng(1).integers(0, VOCAB, 21)
    logits = [forward_logits(build_model(load_config(folder), open_checkpoint(folder), b), ids)
              for b in (CpuBackend(), NumpyKernels())]
    _assert_bf16_close(logits[0], logits[1], "tiny deepseek, cpu kernels vs numpy in their place")


@pytest.mark.parametrize("shape", [(1, 576), (17, 64), (5, 9, 24), (3, 13)])
def test_rmsnorm_matches_float64(shape):
    rng = np.random.default_rng(len(shape) * 100 + shape[-1])
    x = rng.standard_normal(shape, dtype=np.float32) * 3
    w = rng.standard_normal(shape[-1], dtype=np.float32)
    got = cpu_kernels.rmsnorm(x, w, 1e-5)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64 ** 2, axis=-1, keepdims=True) + 1e-5) * w
    assert_close(got, want, f"rmsnorm {shape}", rtol=1e-6, atol=1e-6)
    rows = got.reshape(-1, shape[-1])
    alone = np.stack([cpu_kernels.rmsnorm(r, w, 1e-5) for r in x.reshape(-1, shape[-1])])
    assert np.array_equal(rows, alone)                          # a row alone: the same bits
    x.reshape(-1, shape[-1])[0, 1] = np.nan
    assert np.isnan(cpu_kernels.rmsnorm(x, w, 1e-5).reshape(-1, shape[-1])[0]).all()
    with pytest.raises(ValueError, match=r"rmsnorm: x \[..., D\] and weight \[D\]"):
        cpu_kernels.rmsnorm(x, w[:-1], 1e-5)


def test_rope_table_equals_numpy():
    """The cpu backend's rope (cos / sin rows from a table that grows with the positions) gives the numpy backend's
    values exactly, before and after the table grows, for both pairings."""
    from runtime.backends.numpy_backend import NumpyBackend
    cpu, ref = CpuBackend(), NumpyBackend()
    rng = np.random.default_rng(9)
    inv = (1.0 / (10000 ** (np.arange(0, 64, 2, dtype=np.float32) / 64))).astype(np.float32)
    for positions in ([0, 1, 2], [250, 251, 3], [700, 5, 4000, 9], [0, 4001, 12000]):
        x = rng.standard_normal((len(positions), 3, 64), dtype=np.float32)
        for interleaved in (False, True):
            for scaling in (1.0, 1.3):
                pos = np.array(positions)
                assert np.array_equal(cpu.rope(x, pos, inv, scaling, interleaved),
                                      ref.rope(x, pos, inv, scaling, interleaved)), (positions, interleaved)


def test_build_facts():
    assert cpu_kernels.isa() == ISAS[-1] and ISAS[0] in ("baseline", "scalar")
    assert cpu_kernels.threads() >= 1
    assert isinstance(cpu_kernels.openmp(), bool)
    with pytest.raises(ValueError, match="this CPU runs"):
        cpu_kernels.linear(np.zeros((1, 8), np.float32), np.zeros((1, 8), np.uint16), isa="sse9")


def test_cpu_backend_logits_match_numpy(tiny_dirs):  # noqa: F811
    """Same tiny model on both backends: prefill logits within what rounding the activations to bf16 at every linear
    moves them (the weights are the same bf16 values on both)."""
    target_dir, _ = tiny_dirs
    ref, cpu = api.load(target_dir, backend="numpy"), api.load(target_dir, backend="cpu")
    assert isinstance(cpu.backend, CpuBackend) and cpu.backend.name == "cpu"
    ids = ref.encode(PROMPT)
    logits = []
    for llm in (ref, cpu):
        t = llm.engine.target
        cache = t.new_cache(64)
        h_last, _ = _prefill(llm, cache, ids)
        logits.append(llm.backend.to_host(t.logits(h_last)))
    _assert_bf16_close(logits[1], logits[0], "tiny llama prefill")


def _assert_bf16_close(got, want, what):
    """Largest error within 1% of the reference logits' range; the same top token at 90% of the positions at least
    (bf16 activations: the CUDA tests allow 5% against the same float32 reference)."""
    err = np.max(np.abs(got - want)) / (np.max(want) - np.min(want))
    assert np.isfinite(got).all() and err < 1e-2, f"{what}: max error {err:.3g} of the logit range"
    assert np.mean(np.argmax(got, -1) == np.argmax(want, -1)) >= 0.9, what


def _prefill(llm, cache, ids):
    from runtime.engine import prefill
    t = llm.engine.target
    return prefill(llm.backend, t, cache, ids, 512, None, None)


def test_cpu_backend_ddtree_equals_ar(tiny_dirs):  # noqa: F811
    target_dir, draft_dir = tiny_dirs
    llm = api.load(target_dir, draft=draft_dir, backend="cpu")
    ar = llm.generate(PROMPT, mode="ar", max_new_tokens=24)
    for mode, budget in (("chain", None), ("ddtree", 1), ("ddtree", 4), ("ddtree", 16)):
        got = llm.generate(PROMPT, mode=mode, budget=budget, max_new_tokens=24)
        assert got.tokens == ar.tokens, (mode, budget)
    assert llm.default_budget() == 4
    sampled = [llm.generate(PROMPT, mode=m, max_new_tokens=16, temperature=0.8, seed=11).tokens
               for m in ("ar", "ddtree")]
    assert sampled[0] == sampled[1]


def test_cpu_backend_holds_bf16_matrices_in_bf16():
    b = CpuBackend()
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((5, 16), dtype=np.float32)
    bits = to_bf16(f32).reshape(5, 16)
    w = b.dense_weight(bits)
    assert w.dtype == np.uint16 and np.array_equal(w, bits)
    kept = b.dense_weight(f32)                                       # float32 stays float32 (BLAS, no rounding)
    assert kept.dtype == np.float32 and np.array_equal(kept, f32)
    x32 = rng.standard_normal((3, 16), dtype=np.float32)
    assert_close(b.linear(x32, kept), x32.astype(np.float64) @ f32.T.astype(np.float64), "float32 weight",
                 rtol=1e-5, atol=1e-6)
    norm = b.dense_weight(bits[0])
    assert norm.dtype == np.float32 and np.array_equal(norm, from_bf16(bits[0]))     # vectors: float32
    emb = b.embedding(w, np.array([4, 0, 4]))
    assert emb.dtype == np.float32 and np.array_equal(emb, from_bf16(bits).reshape(5, 16)[[4, 0, 4]])
    x = rng.standard_normal((2, 3, 16), dtype=np.float32)                               # 3-D activations
    y = b.linear(x, w, bias=np.ones(5, np.float32))
    want = round_bf16(x).astype(np.float64) @ from_bf16(bits).reshape(5, 16).T.astype(np.float64) + 1
    assert_close(y, want, "3-D linear + bias", rtol=1e-5, atol=1e-5)


def test_default_model_on_cpu_matches_numpy():
    """SmolLM2-135M (bf16 weights from the GGUF): the cpu backend's prefill logits stay within bf16-activation
    rounding of the numpy reference's, and both complete the prompt alike."""
    need_default_model()
    ref, cpu = api.load(backend="numpy"), api.load(backend="cpu")
    ids = ref.encode("The capital of France is", chat=False)
    cache_ref, cache_cpu = ref.engine.target.new_cache(64), cpu.engine.target.new_cache(64)
    h_ref, _ = _prefill(ref, cache_ref, ids)
    h_cpu, _ = _prefill(cpu, cache_cpu, ids)
    _assert_bf16_close(cpu.engine.target.logits(h_cpu), ref.engine.target.logits(h_ref), "SmolLM2 prefill")
    assert "Paris" in cpu.generate(ids, max_new_tokens=3).text
