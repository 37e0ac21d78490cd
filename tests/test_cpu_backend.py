"""The cpu backend (runtime/backends/cpu_backend.py) and its bf16 linear (runtime/cpu_kernels.pyx, cpu_linear.h):
the linear against a float64 reference at odd sizes, rows independent of how many share a call, bad input refused;
the backend against the numpy reference on tiny models, and DDTree == AR on it."""
import numpy as np
import pytest

from runtime import api, cpu_kernels
from runtime.backends.cpu_backend import CpuBackend
from runtime.bf16 import from_bf16, round_bf16, to_bf16
from runtime.testing import assert_close
from test_api import PROMPT, tiny_dirs  # noqa: F401  (the module-scoped fixture)
from test_ddtree_run import need_default_model


def _bf16_matrix(rng, n, k):
    return to_bf16(rng.standard_normal((n, k), dtype=np.float32)).reshape(n, k)


ISAS = cpu_kernels.isa_levels()      # every build this CPU runs: baseline, avx2+fma, avx512bf16 where there


def _reference(x, w):
    """float64 of what the kernel computes: bf16(x) @ W^T, and a bound on float32 summation error per element."""
    xr = round_bf16(x).astype(np.float64)
    wf = from_bf16(w).reshape(w.shape).astype(np.float64)
    return xr @ wf.T, 4 * x.shape[1] * np.finfo(np.float32).eps * (np.abs(xr) @ np.abs(wf).T)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7, 9, 17, 33])
@pytest.mark.parametrize("N,K", [(1, 8), (3, 7), (37, 64), (111, 100), (64, 576), (130, 1), (5, 33)])
def test_linear_bf16_matches_float64(isa, M, N, K):
    rng = np.random.default_rng(M * 1000 + N * 10 + K)
    x = rng.standard_normal((M, K), dtype=np.float32)
    w = _bf16_matrix(rng, N, K)
    out = np.full((M, N), np.nan, np.float32)                 # poisoned: every element must be written
    got = cpu_kernels.linear_bf16(x, w, out=out, isa=isa)
    assert got is out
    want, slack = _reference(x, w)
    assert_close(got, want, f"linear_bf16 {isa} M={M} N={N} K={K}", rtol=0, atol=0, scale=None, slack=slack)


@pytest.mark.parametrize("isa", ISAS)
def test_linear_bf16_rows_do_not_depend_on_the_batch(isa):
    """A row's result is bit-identical whether it comes alone or with up to 16 others (and in any tile position):
    what lets a tree verify on this backend score each node exactly as an AR step."""
    rng = np.random.default_rng(7)
    K, N = 583, 259                     # K: a partial last chunk for every build
    w = _bf16_matrix(rng, N, K)
    x = rng.standard_normal((17, K), dtype=np.float32)
    alone = np.stack([cpu_kernels.linear_bf16(x[i:i + 1], w, isa=isa)[0] for i in range(17)])
    for M in (2, 3, 4, 5, 8, 9, 17):
        for lo in (0, 17 - M):
            assert np.array_equal(cpu_kernels.linear_bf16(x[lo:lo + M], w, isa=isa), alone[lo:lo + M]), (M, lo)


@pytest.mark.parametrize("isa", ISAS)
def test_linear_bf16_nan_propagates_and_views_work(isa):
    rng = np.random.default_rng(3)
    w = _bf16_matrix(rng, 9, 40)
    x = rng.standard_normal((6, 80), dtype=np.float32)[:, ::2]       # a strided view: copied, not misread
    want, slack = _reference(np.ascontiguousarray(x), w)
    assert_close(cpu_kernels.linear_bf16(x, w, isa=isa), want, "strided x", rtol=0, atol=0, scale=None, slack=slack)
    x = np.ascontiguousarray(x)
    x[2, 5] = np.nan
    y = cpu_kernels.linear_bf16(x, w, isa=isa)
    assert np.isnan(y[2]).all() and np.isfinite(np.delete(y, 2, axis=0)).all()


def test_linear_bf16_refuses_bad_input():
    x, w = np.zeros((2, 8), np.float32), np.zeros((3, 8), np.uint16)
    with pytest.raises(ValueError, match=r"x is \[M=2, K=8\] but w is \[N=3, K=7\]"):
        cpu_kernels.linear_bf16(x, np.zeros((3, 7), np.uint16))
    with pytest.raises(ValueError, match="x must be a 2-D float32"):
        cpu_kernels.linear_bf16(x.astype(np.float64), w)
    with pytest.raises(ValueError, match="w must be a 2-D uint16"):
        cpu_kernels.linear_bf16(x, w.astype(np.float32))
    with pytest.raises(ValueError, match=r"out must be a writeable C-contiguous float32 \[M=2, N=3\]"):
        cpu_kernels.linear_bf16(x, w, out=np.zeros((3, 2), np.float32))
    assert cpu_kernels.linear_bf16(np.zeros((0, 8), np.float32), w).shape == (0, 3)


def test_build_facts():
    assert cpu_kernels.isa() == ISAS[-1] and ISAS[0] in ("baseline", "scalar")
    assert cpu_kernels.threads() >= 1
    assert isinstance(cpu_kernels.openmp(), bool)
    with pytest.raises(ValueError, match="this CPU runs"):
        cpu_kernels.linear_bf16(np.zeros((1, 8), np.float32), np.zeros((1, 8), np.uint16), isa="sse9")


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


def test_cpu_backend_holds_matrices_in_bf16():
    b = CpuBackend()
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((5, 16), dtype=np.float32)
    w = b.dense_weight(f32)
    assert w.dtype == np.uint16 and np.array_equal(w, to_bf16(f32).reshape(5, 16))   # rounded once, as on cuda
    bits = to_bf16(f32).reshape(5, 16)
    assert np.array_equal(b.dense_weight(bits), bits)
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
