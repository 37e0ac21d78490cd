"""GPU tests of the fused decode kernels: rmsnorm / swiglu done in the linear's x load, and the llama attention
prologue (RoPE of q and k, k and v into the caches) in one launch. Each must give exactly the bits of the
unfused kernels it replaces (same rounding, same summation order) and match the float32 oracle; outputs are
poisoned with NaN first. Also: programmatic dependent launch inside a captured graph gives the same bits."""
import numpy as np
import pytest

from runtime.bf16 import from_bf16, round_bf16, to_bf16
from runtime.testing import assert_close, dev_bf16, poisoned

pytestmark = pytest.mark.gpu
ATOL = 1e-2


def bits(a):
    return a.download().view(np.uint16)


@pytest.mark.parametrize("persist", [False, True])
@pytest.mark.parametrize("M,N,K,kw", [
    (1, 960, 576, None), (1, 49152, 576, None), (8, 576, 1536, None), (3, 111, 64, None), (5, 989, 1000, 4),
    (1, 333, 136, 2), (7, 4096, 4096, None), (2, 300, 3000, 4), (1, 17, 8, None), (1, 24576, 4096, 4),
    (3, 40000, 512, 2), (1, 4096, 12288, None), (2, 2000, 12288, 8), (6, 70000, 200, 4)])
def test_linear_gemv(dk, ref, M, N, K, kw, persist):
    """The no-split decode kernel (every KW, odd sizes, K not a multiple of 64, residual; one block per row tile
    or a persistent grid, whose warps carry their W ring into the next tile or restart it) vs the oracle."""
    rng = np.random.default_rng(M * 17 + N + 3 * K)
    x = round_bf16(rng.standard_normal((M, K), dtype=np.float32))
    w = round_bf16(rng.standard_normal((N, K), dtype=np.float32) / np.sqrt(K))
    r = round_bf16(rng.standard_normal((M, N), dtype=np.float32))
    entry, grid = dk.linear_plan(M, N, K, 132, kernel="gemv", kw=kw, persist=persist)[:2]
    assert "gemv" in entry and (kw is None or f"<{kw}," in entry)
    out = poisoned((M, N))
    for residual in (None, dev_bf16(r)):
        out.fill_bytes(0xFF)
        dk.linear(dev_bf16(x), dev_bf16(w), out, residual, kernel="gemv", kw=kw, persist=persist)
        want = ref.linear(x, w) + (r if residual is not None else 0)
        assert_close(out.download(), want, f"gemv {entry} grid {grid} M={M} N={N} K={K}", dtype="bf16",
                     atol=ATOL)


@pytest.fixture
def verify_rows(dk, monkeypatch):
    """Fused prologues up to 32 rows (DDTREE_FUSED_PROLOGUE_ROWS=32): the 16- and 32-row x-resident tiles. The
    unfused reference must run the fused kernel's plan, so decode sizes stay off GMMA (DDTREE_GMMA_DECODE=0)."""
    from runtime import dense_gmma
    monkeypatch.setattr(dk, "FUSED_PROLOGUE_ROWS", {"rmsnorm": 32, "swiglu": 32})
    monkeypatch.setattr(dense_gmma, "GMMA_DECODE", False)


@pytest.mark.parametrize("M,N,K,with_add,splits", [
    (1, 960, 576, True, None), (1, 3072, 576, False, None), (3, 989, 2048, True, 5), (8, 333, 1000, True, 1),
    (5, 4096, 136, False, 3), (1, 49152, 576, False, None),
    # verify sizes (16- / 32-row tiles; the rmsnorm in chunks of 8 rows)
    (17, 960, 576, True, None), (32, 3072, 576, False, None), (12, 989, 2048, True, 3), (9, 333, 1000, True, 1),
    (25, 576, 576, True, 2)])
def test_linear_rmsnorm_prologue(dk, ref, verify_rows, M, N, K, with_add, splits):
    rng = np.random.default_rng(M * 131 + N + K)
    x = round_bf16(rng.standard_normal((M, K), dtype=np.float32) * 2)
    r = round_bf16(rng.standard_normal((M, K), dtype=np.float32))
    g = round_bf16(1 + 0.2 * rng.standard_normal(K, dtype=np.float32))
    w = round_bf16(rng.standard_normal((N, K), dtype=np.float32) / np.sqrt(K))
    xd, rd, gd, wd = dev_bf16(x), dev_bf16(r), dev_bf16(g), dev_bf16(w)
    # unfused: rmsnorm (+ residual) kernel, then the plain linear with the same plan
    normed, total = poisoned((M, K)), poisoned((M, K))
    dk.rmsnorm(xd, gd, normed, 1e-6, residual=rd if with_add else None, residual_out=total if with_add else None)
    want = poisoned((M, N))
    dk.linear(normed, wd, want, splits=splits, kernel="auto" if M <= 8 else "xres")  # the fused kernel's plan
    # fused
    out, total2 = poisoned((M, N)), poisoned((M, K))
    for _ in range(2):  # twice: split-K tickets reset
        out.fill_bytes(0xFF)
        dk.linear(xd, wd, out, splits=splits, prologue="rmsnorm", x2=rd if with_add else None, norm_weight=gd,
                  eps=1e-6, sum_out=total2 if with_add else None)
        np.testing.assert_array_equal(bits(out), bits(want), err_msg="fused rmsnorm linear != rmsnorm + linear")
    if with_add:
        np.testing.assert_array_equal(bits(total2), bits(total), err_msg="fused residual sum")
    h = round_bf16(x + r) if with_add else x
    assert_close(out.download(), ref.linear(round_bf16(ref.rmsnorm(h, g, 1e-6)), w), "rmsnorm linear vs oracle",
                 dtype="bf16", atol=ATOL)


@pytest.mark.parametrize("M,N,K,splits", [(1, 576, 1536, None), (4, 4096, 12288, None), (8, 777, 1000, 3),
                                          (17, 576, 1536, None), (32, 777, 1000, 2), (12, 4096, 12288, None)])
def test_linear_swiglu_prologue(dk, ref, verify_rows, M, N, K, splits):
    rng = np.random.default_rng(M + N + K)
    gu = round_bf16(rng.standard_normal((M, 2 * K), dtype=np.float32) * 2)
    w = round_bf16(rng.standard_normal((N, K), dtype=np.float32) / np.sqrt(K))
    gud, wd = dev_bf16(gu), dev_bf16(w)
    gate, up = gud.view(0, (M, K)), gud.view(K, (M, K))
    act = poisoned((M, K))
    dk.swiglu(gate, up, act, T=M, I=K, ldg=2 * K, ldu=2 * K)
    want = poisoned((M, N))
    dk.linear(act, wd, want, splits=splits, kernel="auto" if M <= 8 else "xres")  # the fused kernel's plan
    out = poisoned((M, N))
    dk.linear(gate, wd, out, ldx=2 * K, splits=splits, prologue="swiglu", x2=up, ldx2=2 * K)
    np.testing.assert_array_equal(bits(out), bits(want), err_msg="fused swiglu linear != swiglu + linear")
    oracle = ref.linear(round_bf16(ref.swiglu(gu[:, :K], gu[:, K:])), w)
    assert_close(out.download(), oracle, "swiglu linear vs oracle", dtype="bf16", atol=ATOL)


def test_linear_prologue_rejects(dk):
    from runtime.cuda import empty
    x, w, o = empty((40, 64), np.uint16), empty((8, 64), np.uint16), empty((40, 8), np.uint16)
    with pytest.raises(ValueError, match="no fused"):   # above FUSED_PROLOGUE_MAX_ROWS (32)
        dk.linear(x, w, o, prologue="swiglu", x2=x)
    with pytest.raises(ValueError, match="needs norm_weight"):
        dk.linear(empty((1, 64), np.uint16), w, empty((1, 8), np.uint16), prologue="rmsnorm")
    big = empty((1, 4096), np.uint16)
    with pytest.raises(ValueError, match="no fused rmsnorm"):
        dk.linear(big, empty((8, 4096), np.uint16), empty((1, 8), np.uint16), prologue="rmsnorm",
                  norm_weight=empty((4096,), np.uint16))


@pytest.mark.parametrize("D,Hq,Hkv,T,qk_norm,device_offset", [
    (64, 9, 3, 1, False, True), (64, 9, 3, 65, False, False), (128, 32, 8, 5, True, True),
    (128, 8, 8, 17, True, False)])
def test_rope_qkv_cache(dk, ref, D, Hq, Hkv, T, qk_norm, device_offset):
    from runtime.cuda import to_device
    rng = np.random.default_rng(D + Hq + T)
    width = (Hq + 2 * Hkv) * D
    qkv = round_bf16(rng.standard_normal((T, width), dtype=np.float32))
    pos = rng.integers(0, 30000, T).astype(np.int32)
    inv = (1.0 / 1e6 ** (np.arange(0, D, 2) / D)).astype(np.float32)
    qn = round_bf16(1 + 0.2 * rng.standard_normal(D, dtype=np.float32)) if qk_norm else None
    kn = round_bf16(1 + 0.2 * rng.standard_normal(D, dtype=np.float32)) if qk_norm else None
    qkvd = dev_bf16(qkv)
    q = qkvd.view(0, (T, Hq, D))
    k = qkvd.view(Hq * D, (T, Hkv, D))
    v = qkvd.view((Hq + Hkv) * D, (T, Hkv, D))
    posd, invd = to_device(pos), to_device(inv)
    cap, start = 128, 23
    # unfused: rope q, rope k into the cache (the cache write through rope's out stride); v is the input itself
    q_want, kc_want = poisoned((T, Hq, D)), poisoned((cap, Hkv, D))
    dk.rope(q, posd, invd, q_want, n_heads=Hq, head_dim=D, norm_weight=dev_bf16(qn) if qk_norm else None,
            ldx=width)
    dk.rope(k, posd, invd, kc_want.view(start * Hkv * D, (T, Hkv, D)), n_heads=Hkv, head_dim=D,
            norm_weight=dev_bf16(kn) if qk_norm else None, ldx=width)
    # fused
    q_out, kc, vc = poisoned((T, Hq, D)), poisoned((cap, Hkv, D)), poisoned((cap, Hkv, D))
    kw = dict(row0=0, row_offset=to_device(np.array([start], np.int32))) if device_offset else dict(row0=start)
    dk.rope_qkv_cache(q, k, v, posd, invd, q_out, kc, vc, n_heads=Hq, n_kv_heads=Hkv, head_dim=D,
                      q_norm=dev_bf16(qn) if qk_norm else None, k_norm=dev_bf16(kn) if qk_norm else None,
                      ldq=width, ldk=width, ldv=width, **kw)
    np.testing.assert_array_equal(bits(q_out), bits(q_want), err_msg="q")
    got_k, got_v = bits(kc), bits(vc)
    np.testing.assert_array_equal(got_k[start:start + T], bits(kc_want)[start:start + T], err_msg="k rows")
    want_v = to_bf16(qkv[:, (Hq + Hkv) * D:]).reshape(T, Hkv, D)
    np.testing.assert_array_equal(got_v[start:start + T], want_v, err_msg="v rows")
    for c in (got_k, got_v):  # nothing written outside the T rows
        assert np.isnan(from_bf16(np.concatenate([c[:start], c[start + T:]]))).all()
    # and the oracle
    qs = qkv[:, :Hq * D].reshape(T, Hq, D)
    if qk_norm:
        qs = round_bf16(ref.rmsnorm(qs, qn, 1e-6))
    assert_close(q_out.download(), ref.rope(qs, pos, inv, 1.0, False), "rope q vs oracle", dtype="bf16", atol=ATOL)


def test_pdl_graph_matches_plain_launches(dk):
    """A chain of PDL kernels (norm-fused linear -> rope/cache -> swiglu-fused linear) captured in a graph and
    replayed gives the bits of the same chain launched one by one, several times over."""
    from runtime.cuda import capture, get_kernel
    assert get_kernel("dense_linear", "linear_bf16_xres_kernel<1, 2, 1>").pdl == dk_pdl_enabled()
    rng = np.random.default_rng(7)
    K, N1, N2 = 576, 3072, 576
    x = dev_bf16(round_bf16(rng.standard_normal((1, K), dtype=np.float32)))
    g = dev_bf16(round_bf16(1 + 0.1 * rng.standard_normal(K, dtype=np.float32)))
    w1 = dev_bf16(round_bf16(rng.standard_normal((N1, K), dtype=np.float32) / 24))
    w2 = dev_bf16(round_bf16(rng.standard_normal((N2, N1 // 2), dtype=np.float32) / 40))
    h, y = poisoned((1, N1)), poisoned((1, N2))
    from runtime.cuda import Stream
    s = Stream()

    def chain():
        dk.linear(x, w1, h, prologue="rmsnorm", norm_weight=g, stream=s)
        dk.linear(h.view(0, (1, N1 // 2)), w2, y, ldx=N1, prologue="swiglu", x2=h.view(N1 // 2, (1, N1 // 2)),
                  ldx2=N1, stream=s)
    from runtime.cuda import default_stream
    default_stream().synchronize()  # the poisoned fills
    chain()
    s.synchronize()
    want = bits(y)
    with capture(s) as cap:
        chain()
    exe = cap.instantiate()
    for _ in range(3):
        y.fill_bytes(0xFF, stream=s)
        exe.launch(s)
        s.synchronize()
        np.testing.assert_array_equal(bits(y), want)


def dk_pdl_enabled():
    import os
    return os.environ.get("DDTREE_PDL", "1") != "0"


@pytest.mark.parametrize("rows,V", [(1, 49152), (5, 151936), (3, 2056), (130, 4096)])
def test_argmax_split_rows(dk, rows, V):
    """Rows split over blocks (merged with atomics in-kernel): the first index of the maximum, ties across
    chunks included; launched three times (the slots and tickets must reset themselves)."""
    from runtime.cuda import empty, to_device
    rng = np.random.default_rng(rows + V)
    logits = rng.standard_normal((rows, V), dtype=np.float32)
    for r in range(rows):  # the same top value at two columns, usually in different chunks
        a, b = sorted(rng.choice(V, 2, replace=False))
        logits[r, a] = logits[r, b] = 9.0
    bits16 = to_bf16(logits)
    want = np.argmax(from_bf16(bits16).reshape(rows, V), axis=1)
    d = to_device(bits16)
    out = empty((rows,), np.int32)
    for _ in range(3):
        out.fill_bytes(0xFF)
        dk.argmax(d, out)
        np.testing.assert_array_equal(out.download(), want)
