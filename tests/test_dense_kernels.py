"""GPU tests of the dense-model kernels (runtime/dense_kernels.py) against the numpy backend, the float32
oracle, on fresh random data with odd sizes. Every output buffer is poisoned (NaN bits) before the launch,
so a kernel that skips an element fails; NaN or inf never passes the comparison."""
import numpy as np
import pytest

from cutlass_kernels.registry import DECODE_ATTN_VARIANTS
from runtime.backends.base import causal_visibility, full_visibility
from runtime.bf16 import from_bf16, round_bf16, to_bf16
from runtime.testing import RTOL, assert_close, dev_bf16, poisoned, random_tree_visibility, recorded_graph

pytestmark = pytest.mark.gpu

BF16_RTOL = RTOL["bf16"]  # one bf16 rounding of the output is 2^-8 relative; allow two
ATOL = 1e-2               # plus 1% of the largest reference value (sums of many bf16 products)


# ---------------------------------------------------------------- linear
@pytest.mark.parametrize("M,N,K,kw", [
    # auto: x-resident <1, 2> for M <= 8, chunked <MT, 1> above
    (1, 111, 64, {}), (1, 989, 1000, {}), (3, 4096, 512, {}), (16, 576, 576, {}), (17, 1536, 576, {}),
    (37, 333, 264, {}), (64, 1000, 2048, {}), (111, 989, 136, {}), (300, 200, 136, {}),
    (8, 777, 4096, {"splits": 1}), (8, 777, 4096, {"splits": 7}), (64, 512, 640, {"splits": 1}),
    # every x-resident instance
    (1, 300, 3000, {"stages": 4}), (16, 989, 1000, {"kernel": "xres"}), (25, 700, 1000, {"kernel": "xres"}),
    (33, 700, 4096, {"kernel": "xres", "stages": 4}), (64, 1000, 2048, {"kernel": "xres"}),
    (64, 512, 640, {"kernel": "xres", "splits": 1}),
    # chunked at small M, its RT=2 tile, heavy split-K
    (5, 989, 1000, {"kernel": "chunked"}), (64, 1000, 2048, {"kernel": "chunked", "rt": 2}),
    (64, 256, 4096, {"kernel": "chunked", "splits": 32}),
    # the 72-row tile (M = 65..72: a budget-64 verify) with and without split-K, odd split counts
    (65, 960, 576, {}), (72, 989, 1000, {"splits": 7}), (65, 576, 1536, {"splits": 1}), (69, 3072, 576, {}),
])
def test_linear(dk, ref, M, N, K, kw):
    rng = np.random.default_rng(M * 7919 + N * 31 + K)
    x = round_bf16(rng.standard_normal((M, K), dtype=np.float32))
    w = round_bf16(rng.standard_normal((N, K), dtype=np.float32) / np.sqrt(K))
    want = ref.linear(x, w)
    out = poisoned((M, N))
    dk.linear(dev_bf16(x), dev_bf16(w), out, **kw)
    assert_close(out.download(), want, f"linear M={M} N={N} K={K} {kw}", dtype="bf16", atol=ATOL)
    # again into a fresh poison: the split-K tickets must have reset themselves
    out.fill_bytes(0xFF)
    dk.linear(dev_bf16(x), dev_bf16(w), out, **kw)
    assert_close(out.download(), want, f"linear (second launch) M={M} N={N} K={K} {kw}", dtype="bf16", atol=ATOL)


def test_linear_residual_and_strided_input(dk, ref):
    rng = np.random.default_rng(5)
    M, N, K, ld = 13, 640, 384, 400
    x_wide = round_bf16(rng.standard_normal((M, ld), dtype=np.float32))
    w = round_bf16(rng.standard_normal((N, K), dtype=np.float32) / np.sqrt(K))
    r = round_bf16(rng.standard_normal((M, N), dtype=np.float32))
    want = ref.linear(x_wide[:, :K], w) + r
    out = poisoned((M, N))
    xd = dev_bf16(x_wide)
    dk.linear(xd.view(0, (M, K)), dev_bf16(w), out, residual=dev_bf16(r), ldx=ld, splits=3)
    assert_close(out.download(), want, "linear + residual, strided x", dtype="bf16", atol=ATOL)


def test_linear_rejects_bad_shapes(dk):
    from runtime.cuda import empty
    with pytest.raises(ValueError, match="K = 12"):
        dk.linear(empty((2, 12), np.uint16), empty((8, 12), np.uint16), empty((2, 8), np.uint16))
    with pytest.raises(ValueError, match="does not match"):
        dk.linear(empty((2, 16), np.uint16), empty((8, 24), np.uint16), empty((2, 8), np.uint16))


# ---------------------------------------------------------------- norms, rope, elementwise
@pytest.mark.parametrize("rows,H", [(1, 576), (111, 576), (7, 4096), (989, 128), (3, 8192)])
def test_rmsnorm(dk, ref, rows, H):
    rng = np.random.default_rng(rows + H)
    x = round_bf16(rng.standard_normal((rows, H), dtype=np.float32) * 3)
    r = round_bf16(rng.standard_normal((rows, H), dtype=np.float32))
    w = round_bf16(1 + 0.1 * rng.standard_normal(H, dtype=np.float32))
    out = poisoned((rows, H))
    dk.rmsnorm(dev_bf16(x), dev_bf16(w), out, 1e-6)
    assert_close(out.download(), ref.rmsnorm(x, w, 1e-6), f"rmsnorm {rows}x{H}", dtype="bf16", atol=ATOL)
    # fused residual add: h = bf16(x + r) is the new residual stream
    h = round_bf16(x + r)
    out.fill_bytes(0xFF)
    res_out = poisoned((rows, H))
    dk.rmsnorm(dev_bf16(x), dev_bf16(w), out, 1e-6, residual=dev_bf16(r), residual_out=res_out)
    assert_close(res_out.download(), h, "residual_out", dtype="bf16", rtol=0, atol=0)
    assert_close(out.download(), ref.rmsnorm(h, w, 1e-6), f"add+rmsnorm {rows}x{H}", dtype="bf16", atol=ATOL)


def _inv_freq(D, theta=1e6, yarn_factor=None):
    inv = 1.0 / theta ** (np.arange(0, D, 2, dtype=np.float64) / D)
    if yarn_factor:  # a YaRN-like ramp: any per-frequency scaling goes through the same table
        ramp = np.clip(np.linspace(-0.5, 1.5, D // 2), 0, 1)
        inv = inv / yarn_factor * (1 - ramp) + inv * ramp
    return inv.astype(np.float32)


@pytest.mark.parametrize("D,interleaved,qk_norm,yarn", [(128, False, True, None), (64, False, False, None),
                                                        (128, True, False, 40.0), (64, True, True, 4.0)])
def test_rope(dk, ref, D, interleaved, qk_norm, yarn):
    from runtime.cuda import to_device
    rng = np.random.default_rng(D + 3 * interleaved + qk_norm)
    T, Hn, extra = 37, 5, 3  # x is a slice of a wider fused buffer (token stride (Hn + extra) * D)
    ld = (Hn + extra) * D
    x = round_bf16(rng.standard_normal((T, ld), dtype=np.float32))
    pos = rng.integers(0, 40000, T).astype(np.int32)
    inv = _inv_freq(D, yarn_factor=yarn)
    scaling = 1.0 + 0.1 * np.log(yarn) if yarn else 1.0
    nw = round_bf16(1 + 0.2 * rng.standard_normal(D, dtype=np.float32)) if qk_norm else None
    xs = x[:, :Hn * D].reshape(T, Hn, D)
    if qk_norm:
        xs = round_bf16(ref.rmsnorm(xs, nw, 1e-6))  # HF rounds the normed q/k to bf16 before RoPE
    want = ref.rope(xs, pos, inv, scaling, interleaved)
    # write into a "cache" [cap, Hn, D] at slot 11: rope is also the kv_write
    cache = poisoned((64, Hn, D))
    xd = dev_bf16(x)
    dk.rope(xd.view(0, (T, Hn, D)), to_device(pos), to_device(inv), cache.view(11 * Hn * D, (T, Hn, D)),
            n_heads=Hn, head_dim=D, attention_scaling=scaling, interleaved=interleaved,
            norm_weight=dev_bf16(nw) if qk_norm else None, ldx=ld)
    got = cache.download()
    assert_close(got[11:11 + T], want, f"rope D={D} interleaved={interleaved} qk_norm={qk_norm}", dtype="bf16",
                 atol=ATOL)
    outside = from_bf16(np.concatenate([got[:11], got[11 + T:]]))
    assert np.isnan(outside).all(), "rope wrote outside its slots"


def test_swiglu_add_embedding(dk, ref):
    from runtime.cuda import to_device
    rng = np.random.default_rng(9)
    T, I = 111, 1536
    gu = round_bf16(rng.standard_normal((T, 2 * I), dtype=np.float32) * 2)
    out = poisoned((T, I))
    gud = dev_bf16(gu)
    dk.swiglu(gud, gud.view(I, (T, I)), out, T=T, I=I, ldg=2 * I, ldu=2 * I)
    assert_close(out.download(), ref.swiglu(gu[:, :I], gu[:, I:]), "swiglu (fused gate_up halves)", dtype="bf16",
                 atol=ATOL)

    a = round_bf16(rng.standard_normal((T, 576), dtype=np.float32))
    b = round_bf16(rng.standard_normal((T, 576), dtype=np.float32))
    out = poisoned((T, 576))
    dk.add(dev_bf16(a), dev_bf16(b), out)
    assert_close(out.download(), ref.add(a, b), "add", dtype="bf16", atol=ATOL)

    V, H = 989, 576
    table = round_bf16(rng.standard_normal((V, H), dtype=np.float32))
    ids = rng.integers(0, V, 37).astype(np.int32)
    out = poisoned((37, H))
    dk.embedding(dev_bf16(table), to_device(ids), out)
    assert_close(out.download(), ref.embedding(table, ids), "embedding", dtype="bf16", rtol=0, atol=0)


# ---------------------------------------------------------------- attention
@pytest.mark.parametrize("case", [
    dict(T=1, prefix=1000, Hq=8, Hkv=2, D=128, mask="tree"),             # decode (decode kernel)
    dict(T=1, prefix=1000, Hq=8, Hkv=2, D=128, mask="tree", kernel="tree"),
    dict(T=1, prefix=5000, Hq=32, Hkv=8, D=128, mask="tree", splits=1),  # decode without KV split
    dict(T=1, prefix=5000, Hq=32, Hkv=8, D=128, mask="tree", splits=1, kernel="tree"),
    dict(T=1, prefix=40, Hq=9, Hkv=3, D=64, mask="tree"),                 # fewer keys than warps x 32
    dict(T=1, prefix=3001, Hq=9, Hkv=3, D=64, mask="tree", splits=7),     # splits of uneven tile counts
    dict(T=1, prefix=130, Hq=16, Hkv=1, D=64, mask="tree", splits=40),    # G = 16; splits without tiles
    *(dict(T=2, prefix=1500, Hq=8, Hkv=1, D=D, mask="tree", splits=3, decode=v)   # every decode instance
      for D in (64, 128) for v in DECODE_ATTN_VARIANTS),
    dict(T=3, prefix=700, Hq=8, Hkv=2, D=128, mask="tree"),               # 12 rows: decode kernel
    dict(T=3, prefix=700, Hq=8, Hkv=2, D=128, mask="tree", kernel="tree"),
    dict(T=4, prefix=190, Hq=12, Hkv=3, D=64, mask="causal", splits=1),   # 16 rows: decode kernel
    dict(T=5, prefix=190, Hq=12, Hkv=3, D=64, mask="tree", splits=2),     # 20 rows: tree kernel
    dict(T=5, prefix=190, Hq=12, Hkv=3, D=64, mask="tree", splits=2, kernel="decode"),   # 20 rows: 2 blocks
    dict(T=17, prefix=300, Hq=9, Hkv=3, D=64, mask="tree", kernel="decode"),  # budget-16 verify, SmolLM2 heads
    dict(T=65, prefix=2000, Hq=32, Hkv=8, D=128, mask="tree", kernel="decode"),  # 260 rows, planned splits
    dict(T=17, prefix=300, Hq=9, Hkv=3, D=64, mask="tree"),               # small tree, SmolLM2 heads
    dict(T=65, prefix=300, Hq=9, Hkv=3, D=64, mask="tree", splits=11),    # budget-64 verify; idle splits
    dict(T=65, prefix=0, Hq=4, Hkv=4, D=128, mask="causal"),              # prefill
    dict(T=111, prefix=77, Hq=9, Hkv=3, D=64, mask="causal", splits=3),
    dict(T=33, prefix=129, Hq=8, Hkv=1, D=128, mask="full"),              # DFlash block
    dict(T=257, prefix=2000, Hq=32, Hkv=8, D=128, mask="tree", device_prefix=True),
    # the wgmma kernel (sm_90a): both head dims and ring depths, planned / forced / idle splits, every mask
    dict(T=1, prefix=1000, Hq=8, Hkv=2, D=128, mask="tree", kernel="gmma"),
    dict(T=17, prefix=300, Hq=9, Hkv=3, D=64, mask="tree", kernel="gmma"),
    dict(T=17, prefix=300, Hq=9, Hkv=3, D=64, mask="tree", kernel="gmma", stages=4),
    dict(T=65, prefix=2000, Hq=32, Hkv=8, D=128, mask="tree", kernel="gmma"),
    dict(T=65, prefix=2000, Hq=32, Hkv=8, D=128, mask="tree", kernel="gmma", stages=2, splits=5),
    dict(T=65, prefix=300, Hq=9, Hkv=3, D=64, mask="tree", splits=11, kernel="gmma"),
    dict(T=65, prefix=0, Hq=4, Hkv=4, D=128, mask="causal", kernel="gmma"),
    dict(T=111, prefix=77, Hq=9, Hkv=3, D=64, mask="causal", splits=3, kernel="gmma"),
    dict(T=33, prefix=129, Hq=8, Hkv=1, D=128, mask="full", kernel="gmma"),
    dict(T=257, prefix=2000, Hq=32, Hkv=8, D=128, mask="tree", device_prefix=True, kernel="gmma"),
    dict(T=2, prefix=130, Hq=16, Hkv=1, D=64, mask="tree", splits=40, kernel="gmma"),   # splits without tiles
])
def test_attention(dk, ref, case, monkeypatch):
    from runtime.cuda import get_device, to_device
    if case.get("kernel") == "gmma":
        if get_device().arch not in dk.ATTN_GMMA_ARCHS:
            pytest.skip(f"the gmma attention kernel is sm_90a only (device sm_{get_device().arch})")
        if "stages" in case:
            monkeypatch.setitem(dk.ATTN_GMMA_STAGES, case["D"], case["stages"])
    rng = np.random.default_rng(case["T"] * 1000 + case["prefix"])
    T, P, Hq, Hkv, D = case["T"], case["prefix"], case["Hq"], case["Hkv"], case["D"]
    cap = P + T + 5
    q = round_bf16(rng.standard_normal((T, Hq, D), dtype=np.float32))
    k = round_bf16(rng.standard_normal((cap, Hkv, D), dtype=np.float32))
    v = round_bf16(rng.standard_normal((cap, Hkv, D), dtype=np.float32))
    vis = {"tree": lambda: random_tree_visibility(rng, T), "causal": lambda: causal_visibility(T),
           "full": lambda: full_visibility(T)}[case["mask"]]()
    scale = 1.0 / np.sqrt(D)
    want = ref.attention(q, k, v, P, vis, scale)
    out = poisoned((T, Hq, D))
    n_prefix = to_device(np.array([P], np.int32)) if case.get("device_prefix") else P
    ws = dk.Workspace()
    if case.get("splits", 1) > 1:
        ws.scratch(case["splits"] * T * Hq * (D + 1) * 4).fill_bytes(0xFF)  # stale partials must not be read
    dk.attention(dev_bf16(q), dev_bf16(k), dev_bf16(v), n_prefix, to_device(vis), scale, out,
                 max_keys=cap, splits=case.get("splits"), kernel=case.get("kernel"), decode=case.get("decode"), ws=ws)
    assert_close(out.download(), want, f"attention {case}", dtype="bf16", rtol=2 * BF16_RTOL, atol=2e-2)


# ---------------------------------------------------------------- sampling, KV commit
def _exact_topk(logits, k):
    """log_softmax top-k with ties broken by lower id, over the full row (the kernel's contract)."""
    m = logits.max(axis=-1, keepdims=True)
    logp = logits - m - np.log(np.sum(np.exp(logits - m), axis=-1, keepdims=True))
    ids = np.stack([np.lexsort((np.arange(row.size), -row))[:k] for row in logits]).astype(np.int32)
    return np.take_along_axis(logp, ids, axis=-1), ids


@pytest.mark.parametrize("L,V,k", [(15, 49152, 64), (15, 49152, 1024), (3, 989, 989), (7, 151936, 512),
                                   (2, 1000, 1)])
def test_log_softmax_topk(dk, ref, L, V, k):
    rng = np.random.default_rng(V + k)
    logits = round_bf16(rng.standard_normal((L, V), dtype=np.float32) * 4)  # bf16: many exact ties
    logits[0, 5:9] = logits[0].max()  # a tie at the very top
    want_lp, want_ids = _exact_topk(logits, k)
    ref_lp, ref_ids = ref.log_softmax_topk(logits, k)  # our exact reference agrees with the oracle
    np.testing.assert_array_equal(ref_ids, want_ids)
    assert_close(ref_lp, want_lp, "numpy oracle top-k", rtol=0, atol=1e-5, scale=None)
    lp, ids = poisoned((L, k), np.float32), poisoned((L, k), np.int32)
    ld = -(-V // 8) * 8
    padded = np.full((L, ld), -30.0, np.float32)
    padded[:, :V] = logits
    dk.log_softmax_topk(dev_bf16(padded), k, lp, ids, V=V)
    np.testing.assert_array_equal(ids.download(), want_ids, err_msg=f"topk ids L={L} V={V} k={k}")
    assert_close(lp.download(), want_lp, "topk logp", rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [5, 65])
def test_argmax_large_vocab(dk, ref, rows):
    """Many 16-byte loads per thread (SmolLM2's 49152 and a ragged tail), ties across threads and iterations;
    65 rows (a verify bucket) take dense_kernels.argmax_chunk's multi-unit chunks (8192 columns, 7 per row)."""
    rng = np.random.default_rng(12)
    V, ld = 49157, 49160
    logits = round_bf16(rng.standard_normal((rows, V), dtype=np.float32) * 3)
    logits[0, [40000, 7, 30000]] = 60.0     # tie: lowest index (7) wins
    logits[1, V - 1] = 60.0                 # max in the ragged tail
    logits[2, [2048 * 8 + 3, 2048 * 8 + 2]] = 60.0
    padded = np.zeros((rows, ld), np.float32)
    padded[:, :V] = logits
    out = poisoned((rows,), np.int32)
    dk.argmax(dev_bf16(padded), out, V=V)
    np.testing.assert_array_equal(out.download(), ref.argmax(logits))
    assert out.download()[:3].tolist() == [7, V - 1, 2048 * 8 + 2]


def test_argmax_and_sample(dk, ref):
    from runtime.cuda import to_device
    from runtime.philox import position_uniforms, seed_key
    rng = np.random.default_rng(11)
    rows, V = 111, 989
    logits = round_bf16(rng.standard_normal((rows, V), dtype=np.float32) * 3)
    logits[3, [10, 500]] = 50.0  # tie: lowest index wins
    out = poisoned((rows,), np.int32)
    ld = 992
    padded = np.zeros((rows, ld), np.float32)
    padded[:, :V] = logits
    lg = dev_bf16(padded)
    dk.argmax(lg, out, V=V)
    np.testing.assert_array_equal(out.download(), ref.argmax(logits))

    positions = rng.integers(0, 2**31 - 1, rows).astype(np.int32)
    positions[:3] = (0, 1, 2**31 - 1)
    for temperature, seed in ((0.7, 3), (1.3, 2**64 - 1)):
        key = seed_key(seed)
        u = position_uniforms(key, positions)
        out.fill_bytes(0xFF)
        dk.sample(lg, temperature, to_device(positions), to_device(key), out, V=V)
        got = out.download()
        z = logits.astype(np.float64) / temperature
        p = np.exp(z - z.max(axis=-1, keepdims=True))
        cdf = np.cumsum(p, axis=-1) / p.sum(axis=-1, keepdims=True)
        assert ((got >= 0) & (got < V)).all(), got
        lo = np.where(got > 0, cdf[np.arange(rows), np.maximum(got - 1, 0)], 0.0)
        hi = cdf[np.arange(rows), got]
        ok = (lo <= u + 1e-5) & (u <= hi + 1e-5)  # u falls in the chosen token's CDF interval
        assert ok.all(), f"sample T={temperature}: rows {np.flatnonzero(~ok)[:5]}"
        exact = ref.sample(logits, temperature, positions, key)
        assert (got == exact).mean() > 0.97, "sample disagrees with the oracle beyond rounding at CDF edges"


def test_sample_philox_bits(dk, ref):
    """The device Philox, bit for bit: with all-equal logits over V = 2^16 every p is exactly 1 and every sum
    an exact integer, so the sample is floor(u * 2^16) = the top 16 bits of the first Philox word of
    (key, position) (runtime/philox.py, checked against Random123's known answers in test_philox.py)."""
    from runtime.cuda import to_device
    from runtime.philox import philox4x32_10, seed_key
    rng = np.random.default_rng(12)
    rows, V = 300, 1 << 16
    positions = rng.integers(0, 2**31 - 1, rows).astype(np.int32)
    positions[:4] = (0, 1, 2, 2**31 - 1)
    lg = dev_bf16(np.zeros((rows, V), np.float32))
    out = poisoned((rows,), np.int32)
    for seed in (0, 0x0123456789ABCDEF, 2**64 - 1):
        key = seed_key(seed)
        out.fill_bytes(0xFF)
        dk.sample(lg, 0.9, to_device(positions), to_device(key), out)
        ctr = np.zeros((rows, 4), np.uint32)
        ctr[:, 0] = positions
        want = (philox4x32_10(ctr, key)[:, 0] >> 16).astype(np.int32)
        np.testing.assert_array_equal(out.download(), want, err_msg=f"seed {seed:#x}")
        np.testing.assert_array_equal(ref.sample(np.zeros((rows, V), np.float32), 0.9, positions, key), want)


def test_kv_compact(dk, ref):
    from runtime.cuda import to_device
    rng = np.random.default_rng(13)
    cap, Hkv, D, n_layers = 300, 2, 128, 3
    hosts = [to_bf16(rng.standard_normal((cap, Hkv, D), dtype=np.float32)) for _ in range(2 * n_layers)]
    caches = [to_device(h) for h in hosts]
    planes = dk.KVPlanes(caches)
    start = 201
    src = start + np.array([0, 2, 3, 7, 8, 30], np.int64)  # accepted nodes: overlapping moves
    dk.kv_compact(planes, src, start)
    for h, c in zip(hosts, caches):
        want = h.copy()
        ref.kv_compact(want, src, start)
        np.testing.assert_array_equal(c.download(), want)
    # graph path: device slots + meta
    slots = to_device(np.array([start + 0, start + 1, start + 5, 0, 0], np.int32))
    meta = to_device(np.array([start, 3], np.int32))
    before = [c.download() for c in caches]
    dk.kv_compact(planes, slots, meta=meta)
    for b, c in zip(before, caches):
        want = b.copy()
        ref.kv_compact(want, [start, start + 1, start + 5], start)
        np.testing.assert_array_equal(c.download(), want)


@pytest.mark.parametrize("kernel", ["tree", "decode", "gmma"])
def test_attention_split_plan_follows_the_replayed_prefix(dk, ref, kernel):
    """The split grid is sized for max_keys; at replay both kernels take the count planned for the actual
    prefix from the device split table: one split writes O itself and the combine kernel exits, several
    merge only their own partials. Output and stale partials poisoned before every replay."""
    from runtime.cuda import Stream, capture, get_device, to_device
    from runtime.dense_kernels import ATTN_TILE_KEYS, Workspace, attention_split_table
    if kernel == "gmma" and get_device().arch not in dk.ATTN_GMMA_ARCHS:
        pytest.skip(f"the gmma attention kernel is sm_90a only (device sm_{get_device().arch})")
    rng = np.random.default_rng(23)
    T, Hq, Hkv, D, cap = 2, 9, 3, 64, 4096
    plan = attention_split_table(T, Hq, Hkv, D, cap, get_device().sm_count, kernel)[1]
    assert plan[1] == 1 and plan.max() >= 4, plan
    # prefixes whose plan is 1 split, a middle count, the largest
    picks = [1, int(np.argmax(plan >= plan.max() // 2)), int(np.argmax(plan == plan.max()))]
    prefixes = sorted({min(cap - T, n * ATTN_TILE_KEYS - T - 3) for n in picks if n * ATTN_TILE_KEYS - T - 3 >= 0})
    assert len(prefixes) == 3, (plan, picks)
    k = round_bf16(rng.standard_normal((cap, Hkv, D), dtype=np.float32))
    v = round_bf16(rng.standard_normal((cap, Hkv, D), dtype=np.float32))
    vis = causal_visibility(T)
    qd, kd, vd, visd = poisoned((T, Hq, D)), dev_bf16(k), dev_bf16(v), to_device(vis)
    n_prefix = to_device(np.array([100], np.int32))
    out = poisoned((T, Hq, D))
    ws = Workspace()
    stream = Stream()
    dk.attention(qd, kd, vd, n_prefix, visd, D ** -0.5, out, T=T, max_keys=cap, kernel=kernel, ws=ws, stream=stream)
    stream.synchronize()
    with capture(stream) as g:
        dk.attention(qd, kd, vd, n_prefix, visd, D ** -0.5, out, T=T, max_keys=cap, kernel=kernel, ws=ws,
                     stream=stream)
    graph = g.instantiate()
    for prefix in prefixes:
        q = round_bf16(rng.standard_normal((T, Hq, D), dtype=np.float32))
        qd.upload(to_bf16(q))
        n_prefix.upload(np.array([prefix], np.int32))
        out.fill_bytes(0xFF, stream=stream)
        ws.scratch(0).fill_bytes(0xFF, stream=stream)  # stale partials must not be read
        graph.launch(stream)
        stream.synchronize()
        splits = plan[-(-(prefix + T) // ATTN_TILE_KEYS)]
        assert_close(out.download(), ref.attention(q, k, v, prefix, vis, D ** -0.5),
                     f"{kernel} attention replay prefix={prefix} ({splits} of {plan.max()} splits)", dtype="bf16",
                     rtol=2 * BF16_RTOL, atol=2e-2)


def test_attention_occupancy_matches_the_split_plan(dk):
    """The split plan assumes ATTN_BLOCKS_PER_SM resident attention blocks per SM; a kernel change that moves
    the register count changes that, and the plan must follow. (The decode kernel's plan asks the driver.)"""
    from runtime.cuda import get_kernel
    for D, want in dk.ATTN_BLOCKS_PER_SM.items():
        kern = get_kernel("tree_attention", f"tree_attention_kernel<{D}>")
        smem = dk.attention_smem_bytes(D)
        if smem > 48 * 1024:
            kern.set_max_dynamic_smem(smem)
        got = kern.blocks_per_sm(128, smem)
        assert got == want, f"D = {D}: {got} resident blocks per SM ({kern.attribute('NUM_REGS')} registers), " \
                            f"the plan assumes {want}"


def test_attention_split_plan_model():
    """The plan (CPU): one split for a short prefix or many rows, more splits as the prefix grows for few
    rows, never more splits than key tiles, and the fewest within 2% of the model's best."""
    from runtime.dense_kernels import ATTN_TILE_KEYS, attention_splits
    assert attention_splits(1, 32, 8, 64, 132) == 1
    decode = [attention_splits(1, 32, 8, n, 132) for n in (1024, 8192, 32768)]
    assert decode == sorted(decode) and decode[-1] >= 16, decode
    assert attention_splits(1025, 32, 8, 2048, 132) <= 2
    for n in (100, 1000, 5000):
        assert attention_splits(1, 9, 3, n, 132, 64) <= -(-n // ATTN_TILE_KEYS)
    # the decode kernel: four 32-slot tiles a round per block, so a short prefix is one block per KV head
    from runtime.dense_kernels import attention_kernel_for
    assert attention_kernel_for(1, 32, 8, 128) == "decode" and attention_kernel_for(5, 12, 3, 128) == "tree"
    # D = 64: the decode kernel up to 256 rows (SmolLM2's b64 verify: 65 x 3), the tree kernel above
    assert attention_kernel_for(65, 9, 3, 64) == "decode" and attention_kernel_for(129, 9, 3, 64) == "tree"
    # sm_90a: the wgmma kernel where the tree kernel would run (unless DDTREE_ATTN_GMMA=0); elsewhere refused
    from runtime import dense_kernels as dk
    want = "gmma" if dk.ATTN_GMMA else "tree"
    assert attention_kernel_for(65, 32, 8, 128, arch="90a") == want
    assert attention_kernel_for(129, 9, 3, 64, arch="90a") == want     # both head dims (session 18)
    assert attention_kernel_for(65, 9, 3, 64, arch="90a") == "decode"
    # the gmma kernel's ring: 3 stages for few rows at D = 128, 2 from 256 rows (three blocks per SM), 4 at D = 64
    assert [dk.gmma_stages(128, r) for r in (4, 68, 255, 256, 1028)] == [3, 3, 3, 2, 2]
    assert dk.gmma_stages(64, 1028) == 4
    assert attention_kernel_for(1, 32, 8, 128, arch="90a") == "decode"
    assert attention_kernel_for(65, 32, 8, 128, arch="120a") == "tree"
    with pytest.raises(ValueError, match="sm_90a"):
        attention_kernel_for(65, 32, 8, 128, "gmma", arch="120a")
    assert attention_splits(65, 32, 8, 8192, 132, 128, "gmma", blocks_per_sm=2) >= 1
    assert attention_splits(1, 9, 3, 128, 132, 64, "decode", (32, 2), 3) == 1
    decode = [attention_splits(1, 32, 8, n, 132, 128, "decode", (32, 2), 1) for n in (1024, 8192, 32768)]
    assert decode == sorted(decode) and decode[-1] > 1, decode
    for n in (100, 1000, 5000):
        for kt, stages in DECODE_ATTN_VARIANTS:
            assert attention_splits(1, 9, 3, n, 132, 64, "decode", (kt, stages), 3) <= -(-n // kt)


def test_graph_replay_with_new_prefix_and_inputs(dk, ref):
    """Captured once, replayed with new buffer contents: attention reads n_prefix from the device and the
    split-K linear's tickets reset themselves, so every replay is right."""
    from runtime.cuda import Stream, to_device
    rng = np.random.default_rng(17)
    T, Hq, Hkv, D, cap = 9, 8, 2, 128, 3000
    k = round_bf16(rng.standard_normal((cap, Hkv, D), dtype=np.float32))
    v = round_bf16(rng.standard_normal((cap, Hkv, D), dtype=np.float32))
    vis = random_tree_visibility(rng, T)
    qd, kd, vd, visd = poisoned((T, Hq, D)), dev_bf16(k), dev_bf16(v), to_device(vis)
    n_prefix = to_device(np.array([100], np.int32))
    out = poisoned((T, Hq, D))
    M, N, K = 9, 1000, 2048
    xd, wd, yd = poisoned((M, K)), poisoned((N, K)), poisoned((M, N))
    stream = Stream()

    def record():
        dk.attention(qd, kd, vd, n_prefix, visd, D ** -0.5, out, T=T, max_keys=cap, splits=5, stream=stream)
        dk.linear(xd, wd, yd, splits=4, stream=stream)

    for a in (qd, xd, wd):
        a.fill_bytes(0, stream=stream)
    graph = recorded_graph(stream, record)
    for prefix in (1500, 37, 2900):
        q = round_bf16(rng.standard_normal((T, Hq, D), dtype=np.float32))
        x = round_bf16(rng.standard_normal((M, K), dtype=np.float32))
        w = round_bf16(rng.standard_normal((N, K), dtype=np.float32) / np.sqrt(K))
        qd.upload(to_bf16(q))
        xd.upload(to_bf16(x))
        wd.upload(to_bf16(w))
        n_prefix.upload(np.array([prefix], np.int32))
        out.fill_bytes(0xFF, stream=stream)
        yd.fill_bytes(0xFF, stream=stream)
        graph.launch(stream)
        stream.synchronize()
        assert_close(out.download(), ref.attention(q, k, v, prefix, vis, D ** -0.5),
                     f"graph attention prefix={prefix}", dtype="bf16", rtol=2 * BF16_RTOL, atol=2e-2)
        assert_close(yd.download(), ref.linear(x, w), f"graph linear replay (prefix={prefix})", dtype="bf16",
                     atol=ATOL)
