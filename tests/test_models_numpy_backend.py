"""The numpy backend's ops, one by one, against float64 / torch / HF references on fresh random data: these
are the semantics the CUDA kernels are checked against."""
import numpy as np
import pytest

from runtime.backends.base import causal_visibility, unpack_visibility
from runtime.backends.numpy_backend import NumpyBackend
from runtime.testing import assert_close

B = NumpyBackend()


def test_attention_with_bitmask_matches_float64_reference():
    rng = np.random.default_rng(0)
    t, h, hkv, dk, dv, n_prefix, cap = 19, 8, 2, 24, 16, 13, 40
    q = rng.normal(size=(t, h, dk)).astype(np.float32)
    k = rng.normal(size=(cap, hkv, dk)).astype(np.float32)
    v = rng.normal(size=(cap, hkv, dv)).astype(np.float32)
    dense = rng.random((t, t)) < 0.4
    np.fill_diagonal(dense, True)
    vis = np.packbits(np.pad(dense, ((0, 0), (0, 32 - t))), axis=1, bitorder="little").view("<u4")
    assert (unpack_visibility(vis, t) == dense).all()
    out = B.attention(q, k, v, n_prefix, vis, 0.3)
    n = n_prefix + t
    ref = np.zeros((t, h, dv))
    for i in range(t):
        for j in range(h):
            s = k[:n, j // (h // hkv)].astype(np.float64) @ q[i, j] * 0.3
            s[n_prefix:][~dense[i]] = -np.inf
            p = np.exp(s - s.max())
            ref[i, j] = (p / p.sum()) @ v[:n, j // (h // hkv)]
    assert_close(out, ref, "attention vs float64", rtol=0, atol=1e-5)


def test_causal_visibility_equals_triangle():
    for t in (1, 31, 32, 33, 100):
        assert (unpack_visibility(causal_visibility(t), t) == np.tril(np.ones((t, t), bool))).all()


def test_kv_compact_moves_overlapping_rows():
    rng = np.random.default_rng(1)
    cache = rng.normal(size=(20, 1, 5)).astype(np.float32)
    before = cache.copy()
    src = np.array([7, 9, 10, 14])           # accepted nodes 2, 4, 5, 9 of a tree rooted at slot 5
    B.kv_compact(cache, src, 7)
    assert (cache[7:11] == before[src]).all()
    assert (cache[:7] == before[:7]).all()


def test_log_softmax_topk_sorted_with_id_tiebreak():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(5, 300)).astype(np.float32)
    logits[0, [3, 7, 200]] = 9.0                 # a three-way tie at the top
    vals, ids = B.log_softmax_topk(logits, 10)
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    for r in range(5):
        order = sorted(range(300), key=lambda i: (-ref[r, i], i))[:10]
        assert ids[r].tolist() == order
        assert_close(vals[r], ref[r, order], f"top-k row {r}", rtol=0, atol=1e-6)
    assert ids.dtype == np.int32 and vals.dtype == np.float32


@pytest.mark.parametrize("k", [1, 7, 64, 299, 300])
def test_log_softmax_topk_ties_at_the_cut(k):
    """Rows of a few distinct values: the k-th value is tied with values past the cut, and the lower ids must
    be the ones kept (the kernels' contract; argpartition alone keeps an arbitrary subset of a tie)."""
    rng = np.random.default_rng(k)
    logits = rng.integers(0, 4, (6, 300)).astype(np.float32)
    vals, ids = B.log_softmax_topk(logits, k)
    for r in range(6):
        want = sorted(range(300), key=lambda i: (-logits[r, i], i))[:k]
        assert ids[r].tolist() == want, f"row {r}"
        assert (np.diff(vals[r]) <= 0).all()


def test_sample_is_inverse_cdf():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(64, 50)).astype(np.float32) * 3
    u = rng.random(64).astype(np.float32)
    u[0], u[1] = 0.0, np.nextafter(np.float32(1), np.float32(0))
    tok = B.sample_with_uniforms(logits, 0.8, u)
    z = logits.astype(np.float64) / 0.8
    p = np.exp(z - z.max(-1, keepdims=True))
    cdf = np.cumsum(p / p.sum(-1, keepdims=True), -1)
    for r in range(64):
        lo = cdf[r, tok[r] - 1] if tok[r] > 0 else 0.0
        assert lo - 1e-9 <= u[r] <= cdf[r, tok[r]] + 1e-9


def test_sample_is_keyed_by_seed_and_position():
    """sample(logits, T, positions, key) == a direct reference: u from Philox of (key, position) (checked against
    known answers in test_philox.py), then searchsorted on the float64 CDF. A row's token depends on its
    position and the key, not on its row index or its neighbours."""
    from runtime.philox import position_uniforms, seed_key
    rng = np.random.default_rng(4)
    rows, V, T = 97, 333, 1.3
    logits = rng.normal(size=(rows, V)).astype(np.float32) * 2
    positions = rng.integers(0, 1 << 20, rows).astype(np.int32)
    key = seed_key(0x0123456789ABCDEF)
    tok = B.sample(logits, T, positions, key)
    assert tok.dtype == np.int32 and tok.shape == (rows,)
    u = position_uniforms(key, positions).astype(np.float64)
    z = logits.astype(np.float64) / T
    p = np.exp(z - z.max(-1, keepdims=True))
    for r in range(rows):
        cdf = np.cumsum(p[r])
        assert tok[r] == min(np.searchsorted(cdf, u[r] * cdf[-1], side="right"), V - 1), f"row {r}"
    perm = rng.permutation(rows)
    np.testing.assert_array_equal(B.sample(logits[perm], T, positions[perm], key), tok[perm])
    same_pos = np.full(rows, 12345, np.int32)
    again = B.sample(np.repeat(logits[:1], rows, 0), T, same_pos, key)
    assert (again == again[0]).all(), "one position, one key, one row of logits: one token"
    other = B.sample(logits, T, positions, seed_key(1))
    assert (other != tok).mean() > 0.5, "another key drew mostly the same tokens"


def test_moe_route_matches_transformers_router():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    cfg = transformers.DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                        topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(cfg)
    rng = np.random.default_rng(4)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(rng.normal(size=(16, 32)).astype(np.float32)))
        router.e_score_correction_bias.copy_(torch.from_numpy(rng.normal(0, 0.3, 16).astype(np.float32)))
    x = rng.normal(size=(23, 32)).astype(np.float32)
    with torch.no_grad():
        logits, w_ref, ids_ref = router(torch.from_numpy(x))
    ids, w = B.moe_route(logits.numpy(), router.e_score_correction_bias.numpy(), 4, 2, 4, True, 2.5)
    for r in range(23):
        ref = dict(zip(ids_ref[r].tolist(), w_ref[r].tolist()))
        got = dict(zip(ids[r].tolist(), w[r].tolist()))
        assert ref.keys() == got.keys(), f"token {r}: experts {sorted(got)} != {sorted(ref)}"
        assert max(abs(ref[e] - got[e]) for e in ref) < 1e-5


def test_rope_interleaved_matches_transformers():
    torch = pytest.importorskip("torch")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave
    rng = np.random.default_rng(5)
    x = rng.normal(size=(9, 3, 16)).astype(np.float32)
    pos = np.array([0, 1, 2, 5, 8, 13, 100, 1000, 4095])
    inv = (1.0 / 10000 ** (np.arange(0, 16, 2, dtype=np.float32) / 16)).astype(np.float32)
    ang = torch.from_numpy(pos[:, None].astype(np.float32) * inv)
    emb = torch.cat([ang, ang], -1)[None]                            # [1, T, D] as HF builds it
    xt = torch.from_numpy(x).transpose(0, 1)[None]                   # [1, H, T, D]
    ref, _ = apply_rotary_pos_emb_interleave(xt, xt, emb.cos() * 1.3, emb.sin() * 1.3)
    ours = B.rope(x, pos, inv, 1.3, True)
    assert_close(ours, ref[0].transpose(0, 1).numpy(), "interleaved rope vs transformers", rtol=0, atol=1e-6)
