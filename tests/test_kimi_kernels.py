"""Kimi K2.x kernels: INT4 repack (CPU), a CPU emulation of the MoE kernel's fragment math, and GPU tests of
routing, the INT4 MoE layer and MLA attention against the float32 numpy references (skip without a GPU)."""
import numpy as np
import pytest

from cutlass_kernels.registry import MOE_GEMM_VARIANTS
from loader.int4 import pack_int4, unpack_int4
from runtime import kimi_reference as ref
from runtime.bf16 import from_bf16, round_bf16, to_bf16
from runtime.kimi_kernels import _pipe_takes_tile, repack_int4_experts, unrepack_int4_experts
from runtime.testing import assert_close, random_tree_visibility


def random_int4(rng, n, k, scale=0.02):
    codes = rng.integers(-8, 8, size=(n, k), dtype=np.int8)
    wp = pack_int4(codes)
    ws = to_bf16(rng.uniform(0.5, 1.5, size=(n, k // 32)).astype(np.float32) * scale)
    return wp, ws


# Tolerance of these tests (runtime.testing.assert_close): |got - want| <= r |want| + r mean|want|, r = RTOL
# (bf16 outputs of long fp32 sums; a relative-only bound would fail on the near-zero outputs).
RTOL = 2e-2


# ------------------------------------------------------------------------------------------------ CPU


@pytest.mark.parametrize("n,k", [(16, 512), (48, 1024), (32, 2048)])
def test_repack_round_trip(n, k):
    rng = np.random.default_rng(n + k)
    wp, ws = random_int4(rng, n, k)
    packed, scales = repack_int4_experts(wp, ws, (n, k))
    assert packed.shape == (n // 16, k // 64, 32, 4) and packed.dtype == np.uint32
    assert scales.shape == (n // 16, k // 512, 16, 8, 2) and scales.dtype == np.uint16
    assert packed.nbytes == wp.nbytes and scales.nbytes == ws.nbytes   # nothing stored twice
    wp2, ws2 = unrepack_int4_experts(packed, scales, (n, k))
    np.testing.assert_array_equal(wp2, wp)
    np.testing.assert_array_equal(ws2, ws)


def test_repack_stacked_and_errors():
    rng = np.random.default_rng(0)
    pairs = [random_int4(rng, 32, 512) for _ in range(3)]
    packed, scales = repack_int4_experts(np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs]),
                                         (32, 512))
    assert packed.shape == (3, 2, 8, 32, 4) and scales.shape == (3, 2, 1, 16, 8, 2)
    one = repack_int4_experts(*pairs[1], (32, 512))
    np.testing.assert_array_equal(packed[1], one[0])
    with pytest.raises(ValueError, match="K % 512"):
        repack_int4_experts(*random_int4(rng, 16, 256), (16, 256))


def test_loader_hook_uses_this_layout(tmp_path):
    """loader.int4.repack_int4_for_kernel runs the repacker this module registers, and caches it."""
    from loader.int4 import repack_int4_for_kernel
    rng = np.random.default_rng(1)
    wp, ws = random_int4(rng, 32, 1024)
    out = repack_int4_for_kernel(wp, ws, (32, 1024), cache_dir=tmp_path)
    packed, scales = repack_int4_experts(wp, ws, (32, 1024))
    np.testing.assert_array_equal(out["packed"], packed)
    np.testing.assert_array_equal(out["scales"], scales)
    again = repack_int4_for_kernel(wp, ws, (32, 1024), cache_dir=tmp_path)   # from the disk cache
    np.testing.assert_array_equal(np.asarray(again["packed"]), packed)


def emulate_kernel_gemv(packed, scales, x, n, k):
    """What one lane sequence of moe_w4a16_kernel computes for a single token, in numpy: decode each lane's
    16-byte word into mma A fragments, gather the lane's B fragments with the permuted K order, and apply
    the m16n8k16 semantics. Checks the layout contract independently of the GPU."""
    y = np.zeros(n, np.float32)
    sc = from_bf16(scales).reshape(scales.shape)
    for rb in range(n // 16):
        for u in range(k // 64):
            for s in range(4):
                A = np.zeros((16, 16), np.float32)   # [row, logical k]
                B = np.zeros(16, np.float32)         # [logical k] of token 0 (lanes g = 0)
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    word = int(packed[rb, u, lane, s])
                    s_row = sc[rb, u // 8, 2 * g + (t >> 1), u % 8]          # (row g, row g+8)
                    vals = []
                    for reg in range(4):
                        lo = (word >> (4 * reg)) & 0xF
                        hi = (word >> (4 * reg + 16)) & 0xF
                        r = reg & 1
                        vals += [(lo - 8) * s_row[r], (hi - 8) * s_row[r]]
                    vals = round_bf16(np.array(vals, np.float32))     # the kernel's bf16 multiply
                    A[g, 2 * t], A[g, 2 * t + 1] = vals[0], vals[1]
                    A[g + 8, 2 * t], A[g + 8, 2 * t + 1] = vals[2], vals[3]
                    A[g, 2 * t + 8], A[g, 2 * t + 9] = vals[4], vals[5]
                    A[g + 8, 2 * t + 8], A[g + 8, 2 * t + 9] = vals[6], vals[7]
                    if g == 0:
                        base = 64 * u + 16 * t + 4 * s
                        B[2 * t], B[2 * t + 1] = x[base], x[base + 1]
                        B[2 * t + 8], B[2 * t + 9] = x[base + 2], x[base + 3]
                y[16 * rb:16 * rb + 16] += A @ B
    return y


def test_layout_matches_mma_fragment_math():
    rng = np.random.default_rng(7)
    n, k = 32, 512
    wp, ws = random_int4(rng, n, k)
    packed, scales = repack_int4_experts(wp, ws, (n, k))
    x = round_bf16(rng.standard_normal(k).astype(np.float32))
    want = unpack_int4(wp, ws, (n, k)) @ x
    got = emulate_kernel_gemv(packed, scales, x, n, k)
    assert_close(got, want, "emulated kernel GEMV", rtol=1e-2, atol=1e-2, scale="mean")


def repacked_with_dense(rng, n, k):
    """Random INT4 weights [n, k] in the kernel layout (packed, scales) and as the bf16 matrix they stand for."""
    wp, ws = random_int4(rng, n, k)
    packed, scales = repack_int4_experts(wp, ws, (n, k))
    return packed, scales, round_bf16(unpack_int4(wp, ws, (n, k)))


def emulate_gmma_w_tile(packed, scales, rb0, u):
    """The bf16 W tile [128 rows][64 columns] that moe_gmma_kernel's dequant_store writes for 16-row blocks
    rb0 .. rb0 + 7 and 64-k unit u, read back through the 128-byte swizzle: each lane (g, t) of warp w decodes
    its 16 bytes into rows 16w + g / + 8, columns 16t .. 16t + 15, and stores them at 16-byte units
    (2t + h) ^ (row % 8) of the row."""
    sc = from_bf16(scales).reshape(scales.shape)
    smem = np.zeros(128 * 64, np.float32)   # the swizzled tile, in bf16 elements
    for w in range(8):
        for lane in range(32):
            g, t = lane // 4, lane % 4
            s_row = sc[rb0 + w, u // 8, 2 * g + (t >> 1), u % 8]      # (row g, row g + 8)
            lo, hi = [], []                                            # columns 16t .. 16t + 15
            for s in range(4):
                q = int(packed[rb0 + w, u, lane, s])
                nib = [(q >> (4 * i)) & 0xF for i in range(8)]
                lo += [(nib[0] - 8) * s_row[0], (nib[4] - 8) * s_row[0], (nib[2] - 8) * s_row[0], (nib[6] - 8) * s_row[0]]
                hi += [(nib[1] - 8) * s_row[1], (nib[5] - 8) * s_row[1], (nib[3] - 8) * s_row[1], (nib[7] - 8) * s_row[1]]
            for vals, row in ((lo, 16 * w + g), (hi, 16 * w + g + 8)):
                for h in range(2):
                    unit = (2 * t + h) ^ (row % 8)
                    smem[row * 64 + unit * 8: row * 64 + unit * 8 + 8] = vals[8 * h: 8 * h + 8]
    tile = np.zeros((128, 64), np.float32)
    for row in range(128):
        for unit in range(8):
            tile[row, unit * 8: unit * 8 + 8] = smem[row * 64 + (unit ^ (row % 8)) * 8: row * 64 + (unit ^ (row % 8)) * 8 + 8]
    return round_bf16(tile)


def test_gmma_dequant_tile_matches_weights():
    """moe_gmma_kernel's dequantize-to-shared-memory mapping gives the plain weight rows at their physical
    columns (so x is read unpermuted), for every unit of a superblock and a second superblock."""
    packed, scales, dense = repacked_with_dense(np.random.default_rng(8), 256, 1024)
    for rb0 in (0, 8):
        for u in (0, 3, 7, 9, 15):
            got = emulate_gmma_w_tile(packed, scales, rb0, u)
            np.testing.assert_array_equal(got, dense[16 * rb0:16 * rb0 + 128, 64 * u:64 * u + 64],
                                          err_msg=f"row blocks {rb0}.., unit {u}")


def _byte_perm(x, y, sel):
    """__byte_perm: byte i of the result = byte (sel >> 4i) & 7 of the 8 bytes y:x (x the low four)."""
    src = x | (y << 32)
    return sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def emulate_gmma_a_fragments(packed, scales, rb, u):
    """moe_gmma_kernel<_, _, 2>'s dequant_frag for one warp (16-row block rb, 64-k unit u): the prmt's, the two
    xor-shuffle rounds over each quad and the dequantization, lane by lane. Returns the [16, 64] block the A
    fragments say: a[j][i] of lane (g, t) = rows g (i even) / g + 8 (i odd), columns 16j + 2t (+ 8 for i >= 2)."""
    sc = from_bf16(scales).reshape(scales.shape)
    d = {}
    for lane in range(32):
        w = [int(v) for v in packed[rb, u, lane]]
        d[lane] = [_byte_perm(w[0], w[2], 0x6240), _byte_perm(w[0], w[2], 0x7351),
                   _byte_perm(w[1], w[3], 0x6240), _byte_perm(w[1], w[3], 0x7351)]
    sel = lambda c, a, b: a if c else b
    stage1 = {}
    for lane in range(32):
        t, b0 = lane % 4, lane & 1
        dd, pd = d[lane], d[lane ^ 1]
        pb0 = (lane ^ 1) & 1
        r0, r1 = sel(pb0, pd[0], pd[1]), sel(pb0, pd[2], pd[3])   # what the partner sends
        k0, k1 = sel(b0, dd[1], dd[0]), sel(b0, dd[3], dd[2])
        stage1[lane] = (sel(b0, r0, k0), sel(b0, k0, r0), sel(b0, r1, k1), sel(b0, k1, r1))
    block = np.full((16, 64), np.nan, np.float32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        b1 = t & 2
        xe, xo, ye, yo = stage1[lane]
        pxe, pxo, pye, pyo = stage1[lane ^ 2]
        pb1 = (lane ^ 2) & 2
        s0, s1 = sel(pb1, pxe, pye), sel(pb1, pxo, pyo)
        m0, m1 = sel(b1, ye, xe), sel(b1, yo, xo)
        q = [sel(b1, s0, m0), sel(b1, s1, m1), sel(b1, m0, s0), sel(b1, m1, s1)]
        for j in range(4):
            s_row = sc[rb, u // 8, 2 * g + (j >> 1), u % 8]             # (row g, row g + 8), group j // 2
            for i in range(4):
                nib = (q[j] >> (4 * i)) & 0xF, (q[j] >> (4 * i + 16)) & 0xF
                row, col = g + 8 * (i & 1), 16 * j + 2 * t + 8 * (i >> 1)
                for e in range(2):
                    assert np.isnan(block[row, col + e]), "written twice"
                    block[row, col + e] = (nib[e] - 8) * s_row[i & 1]
    return round_bf16(block)


def test_gmma_register_fragments_match_weights():
    """moe_gmma_kernel's register-A path (PIPE 2): every lane's fragments, after the quad transpose, hold the
    plain weights at physical columns, so x is read unpermuted, for several units and row blocks."""
    packed, scales, dense = repacked_with_dense(np.random.default_rng(9), 64, 1024)
    for rb in (0, 3):
        for u in (0, 5, 8, 15):
            got = emulate_gmma_a_fragments(packed, scales, rb, u)
            np.testing.assert_array_equal(got, dense[16 * rb:16 * rb + 16, 64 * u:64 * u + 64],
                                          err_msg=f"row block {rb}, unit {u}")


def test_mla_split_s_p_tile_mapping():
    """mla_attention_gmma_kernel<1>: each warpgroup stores its half of P from the S accumulator layout
    (pa[kk][2h + ri] = rows g / g + 8, positions 32 wg + 16 kk + 8 h + 2t, + 1) into 16-byte units
    (4 wg + 2 kk + h) ^ (row % 8); read back as the K-major 128-byte-swizzled A operand of P V, every
    (row, position) of the 64 x 64 tile is written once, with its own value."""
    P = np.arange(64 * 64, dtype=np.int64).reshape(64, 64)            # a distinct value per (row, position)
    smem = np.full(64 * 64, -1, np.int64)                              # the tile, in bf16 elements
    for wg in range(2):
        for warp in range(4):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for kk in range(2):
                    for h in range(2):
                        for ri in range(2):
                            row = warp * 16 + g + 8 * ri
                            pos = 32 * wg + 16 * kk + 8 * h + 2 * t
                            unit = (4 * wg + 2 * kk + h) ^ (row % 8)
                            at = row * 64 + unit * 8 + t * 2                # byte offset t * 4 = element t * 2
                            assert (smem[at:at + 2] == -1).all(), "written twice"
                            smem[at:at + 2] = P[row, pos:pos + 2]
    for row in range(64):
        for pos in range(64):   # the wgmma K-major swizzled read of element (row, k = pos)
            assert smem[row * 64 + ((pos // 8) ^ (row % 8)) * 8 + pos % 8] == P[row, pos], (row, pos)


def test_moe_reference_rounding_slack():
    """The expert outputs are rounded through bf16 (as the kernels store them); the reference's slack is what one
    rounding flip per pick can move an output by, and assert_close's slack argument admits exactly that."""
    np.testing.assert_array_equal(ref.bf16_ulp(np.array([1.0, 1.99, 0.75, -3.0, 96.0], np.float32)),
                                  np.array([2.0 ** -7, 2.0 ** -7, 2.0 ** -8, 2.0 ** -6, 0.5], np.float32))
    rng = np.random.default_rng(5)
    E, K, I, T, topk = 4, 64, 32, 3, 2
    gate, up, down = (rng.standard_normal(shape).astype(np.float32) for shape in ((E, I, K), (E, I, K), (E, K, I)))
    x = round_bf16(rng.standard_normal((T, K)).astype(np.float32))
    ids = np.array([[0, 1], [2, 3], [1, 2]], np.int32)
    w = rng.uniform(0.1, 1.0, (T, topk)).astype(np.float32)
    y, slack = ref.moe(x, ids, w, gate, up, down, with_slack=True)
    np.testing.assert_array_equal(y, ref.moe(x, ids, w, gate, up, down))
    outs = [[round_bf16(down[e] @ round_bf16(ref.silu(gate[e] @ x[t]) * (up[e] @ x[t]))) for e in ids[t]]
            for t in range(T)]
    for t in range(T):   # each output is already a bf16 value; slack = sum_j |w| ulp(out_j)
        for out in outs[t]:
            np.testing.assert_array_equal(out, round_bf16(out))
        np.testing.assert_allclose(slack[t], sum(abs(w[t, j]) * ref.bf16_ulp(outs[t][j]) for j in range(topk)),
                                   rtol=1e-6)
    # every pick's output one ulp off (the worst flip) stays inside the slack, and fails without it
    flipped = np.stack([sum(w[t, j] * (outs[t][j] + ref.bf16_ulp(outs[t][j])) for j in range(topk))
                        for t in range(T)]).astype(np.float32)
    got = to_bf16(flipped)
    tight = dict(dtype="bf16", rtol=0.0, atol=0.0, scale=None)
    assert_close(got, y, "flip within slack", **tight, slack=slack * 1.01 + ref.bf16_ulp(y))
    with pytest.raises(AssertionError):
        assert_close(got, y, "flip without slack", **tight, slack=ref.bf16_ulp(y) / 4)


def test_slot_order_is_the_repacked_fragment_order():
    """PIPE 6 uses each lane's repacked word s as its wgmma A fragment of k16 step s, unshuffled (mma.sync
    m16n8k16 layout: register pair h of row g holds k = 2t + 8h, + 1; nibbles i = 4b + 2h + r, r the row half).
    Decoded that way, slot c of each unit must hold the weight of physical column slot_order_source(c), the map
    moe_x_slot_kernel and the PIPE 6 epilogue apply to x and h."""
    from runtime.kimi_kernels import slot_order_source
    rng = np.random.default_rng(11)
    n, k = 32, 512
    codes = rng.integers(-8, 8, size=(n, k), dtype=np.int8)
    packed, _ = repack_int4_experts(pack_int4(codes), np.ones((n, k // 32), np.uint16), (n, k))
    slots = np.empty((n, k), np.int64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for s in range(4):
            word = packed[:, :, lane, s].astype(np.int64)   # [row block, unit]
            for i in range(8):
                r, h, b = i & 1, (i >> 1) & 1, i >> 2
                rows = np.arange(n // 16) * 16 + 8 * r + g
                cols = np.arange(k // 64) * 64 + 16 * s + 8 * h + 2 * t + b
                slots[np.ix_(rows, cols)] = ((word >> (4 * i)) & 0xF) - 8
    src = (np.arange(k) // 64) * 64 + slot_order_source(np.arange(k) % 64)
    assert sorted(slot_order_source(np.arange(64))) == list(range(64))
    np.testing.assert_array_equal(slots, codes[:, src])


def test_moe_launch_defaults():
    """PDL, the early down start and the combine's early reads default on up to their token bounds only; neither
    early choice without PDL, nor the early start where a hot-expert tier is asked for (that combination is
    refused); explicit values pass through."""
    from runtime.kimi_kernels import COMBINE_EARLY_MAX_TOKENS, EARLY_MAX_TOKENS, PDL_MAX_TOKENS, launch_defaults
    for T in (1, 2, EARLY_MAX_TOKENS, EARLY_MAX_TOKENS + 1, PDL_MAX_TOKENS, PDL_MAX_TOKENS + 1,
              COMBINE_EARLY_MAX_TOKENS, COMBINE_EARLY_MAX_TOKENS + 1, 1025):
        pdl, early, comb = launch_defaults(T, None, None, hot_asked=False)
        assert pdl == (T <= PDL_MAX_TOKENS) and early == (pdl and T <= EARLY_MAX_TOKENS), T
        assert comb == (pdl and T <= COMBINE_EARLY_MAX_TOKENS), T
        assert launch_defaults(T, None, None, hot_asked=True) == (pdl, False, comb), T
        assert launch_defaults(T, False, None, hot_asked=False) == (False, False, False), T
        assert launch_defaults(T, True, True, hot_asked=True, combine_early=False) == (True, True, False), T
    assert launch_defaults(1, None, None, hot_asked=False) == (
        PDL_MAX_TOKENS >= 1, EARLY_MAX_TOKENS >= 1, COMBINE_EARLY_MAX_TOKENS >= 1)
    from runtime.kimi_kernels import SHARED_FORK_ROUTE_MAX_TOKENS, default_shared_fork
    assert [default_shared_fork(T) for T in (1, SHARED_FORK_ROUTE_MAX_TOKENS, SHARED_FORK_ROUTE_MAX_TOKENS + 1)] == [
        "route", "route", "start"]


def test_default_variants_take_gate_up_pieces_where_hidden_splits():
    """T = 3..8 and 25..511 take GATE_UP_PIECES' gate_up where hidden splits into its pieces (Kimi's 7168), the table's
    elsewhere; every default is a compiled variant that fits its K."""
    from runtime import kimi_kernels as kk
    for T in (*range(1, 60), 127, 128, 129, 255, 256, 511, 512, 767, 768, 1024, 1025):
        table = kk.default_variants(T)
        kimi = kk.default_variants(T, 7168)
        assert kk.default_variants(T, 1024) == table   # 1024 is no whole number of 7 x 256
        pieces = kk.GATE_UP_PIECES[8] if 3 <= T <= 8 else kk.GATE_UP_PIECES[511] if 25 <= T <= 511 else None
        assert kimi == ((pieces, table[1]) if pieces else table)
        for entry, k in zip(kimi, (7168, 2048)):
            assert entry in MOE_GEMM_VARIANTS and kk.variant_fits(entry, k)
    assert not kk.variant_fits(kk.GATE_UP_PIECES[8], 2560) and kk.variant_fits(kk.GATE_UP_PIECES[8], 3584)


def test_route_reference_matches_plain_topk_and_groups():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((5, 64)).astype(np.float32)
    bias = (rng.standard_normal(64) * 0.1).astype(np.float32)
    ids, w = ref.route(logits, bias, topk=4, routed_scaling_factor=2.5)
    choice = ref.sigmoid(logits) + bias
    np.testing.assert_array_equal(ids, np.argsort(-choice, axis=1, kind="stable")[:, :4])
    assert_close(w.sum(axis=1), np.full(5, 2.5, np.float32), "normalised routing weights", rtol=1e-5)
    ids_g, _ = ref.route(logits, bias, topk=4, n_group=8, topk_group=2)
    assert all(len(set(row // 8)) <= 2 for row in ids_g)        # experts from at most topk_group groups
    counts, offsets, sorted_token, pos = ref.group_by_expert(ids, 64)
    assert counts.sum() == ids.size
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            p = pos[t, j]
            assert sorted_token[p] == t and offsets[ids[t, j]] <= p < offsets[ids[t, j]] + counts[ids[t, j]]


# ------------------------------------------------------------------------------------------------ GPU


def make_moe(rng, E, hidden, inter):
    """Random INT4 experts: (numpy dequantized gate, up, down float32, MoeWeights on the device)."""
    from runtime.kimi_kernels import MoeWeights
    mats = {}
    dense = {}
    for name, (n, k) in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
        pairs = [random_int4(rng, n, k, scale=0.5 / np.sqrt(k)) for _ in range(E)]
        wp = np.stack([p[0] for p in pairs])
        ws = np.stack([p[1] for p in pairs])
        mats[name] = repack_int4_experts(wp, ws, (n, k))
        dense[name] = np.stack([unpack_int4(p[0], p[1], (n, k)) for p in pairs])
    return dense, MoeWeights.upload(mats["gate"], mats["up"], mats["down"])


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,topk,n_group,topk_group", [(1, 384, 8, 1, 1), (37, 384, 8, 1, 1),
                                                         (256, 384, 8, 1, 1), (19, 256, 8, 8, 4),
                                                         (1025, 384, 8, 1, 1)])
def test_routing_matches_reference(cuda_device, T, E, topk, n_group, topk_group):
    rng = np.random.default_rng(T + E)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    bias = (rng.standard_normal(E) * 0.05).astype(np.float32)
    layer = _routing_layer(E, T, bias, topk, n_group, topk_group)
    layer.logits.upload(logits)
    for a in (layer.topk_ids, layer.topk_w, layer.slot_expert, layer.sorted_token, layer.assign_pos):
        a.fill_bytes(0xFF)
    layer.forward(stages=("route",))
    ids_ref, w_ref = ref.route(logits, bias, topk, n_group, topk_group)
    np.testing.assert_array_equal(layer.topk_ids.download(), ids_ref)
    assert_close(layer.topk_w.download(), w_ref, "routing weights", rtol=1e-5, atol=1e-5, scale="mean")
    counts, offsets, sorted_token, pos = ref.group_by_expert(ids_ref, E)
    np.testing.assert_array_equal(layer.expert_count.download(), counts)
    np.testing.assert_array_equal(layer.sorted_token.download(), sorted_token)
    np.testing.assert_array_equal(layer.assign_pos.download(), pos)
    se, so, sc = layer.slot_expert.download(), layer.slot_offset.download(), layer.slot_count.download()
    active = np.flatnonzero(counts)
    order = sorted(active, key=lambda e: (-counts[e], e))
    np.testing.assert_array_equal(se[:len(order)], order)
    assert (se[len(order):] == -1).all()
    np.testing.assert_array_equal(so[:len(order)], offsets[order])
    np.testing.assert_array_equal(sc[:len(order)], counts[order])


def _routing_layer(E, T, bias, topk, n_group, topk_group, **plan):
    """MoeLayer whose GEMMs are never run: expert weights are uninitialised buffers of the right shapes."""
    from runtime import cuda
    from runtime.kimi_kernels import MoeWeights, MoeLayer
    hidden, inter = 512, 512
    gq = cuda.empty((E, inter // 16, hidden // 64, 32, 4), np.uint32)
    gs = cuda.empty((E, inter // 16, hidden // 512, 16, 8, 2), np.uint16)
    dq = cuda.empty((E, hidden // 16, inter // 64, 32, 4), np.uint32)
    ds = cuda.empty((E, hidden // 16, inter // 512, 16, 8, 2), np.uint16)
    w = MoeWeights(E, hidden, inter, gq, gs, gq, gs, dq, ds)
    plan.setdefault("gmma_min_tokens", None)   # routing stages only: no wgmma slot split
    return MoeLayer(w, T, bias, topk=topk, n_group=n_group, topk_group=topk_group, **plan)


ROUTE_OUTPUTS = ("topk_ids", "topk_w", "expert_count", "slot_expert", "slot_offset", "slot_count", "sorted_token",
                 "assign_pos")


@pytest.mark.gpu
@pytest.mark.parametrize("routing,T,E,topk,n_group,topk_group", [
    ("fused", 1, 384, 8, 1, 1), ("fused", 64, 384, 8, 1, 1), ("fused", 65, 384, 8, 8, 4), ("fused", 300, 384, 8, 1, 1),
    ("warp-one", 1, 384, 8, 1, 1), ("warp-one", 1, 384, 8, 8, 4),
    ("blocks", 1, 384, 8, 1, 1), ("blocks", 1, 384, 8, 8, 4), ("blocks", 1, 256, 8, 8, 4), ("blocks", 1, 300, 6, 1, 1),
    ("blocks", 1, 64, 16, 4, 2), ("blocks", 2, 384, 8, 1, 1), ("blocks", 5, 384, 8, 8, 4), ("blocks", 8, 300, 6, 1, 1),
    ("blocks", 16, 384, 8, 1, 1), ("blocks", 64, 384, 8, 1, 1), ("blocks", 40, 64, 16, 4, 2),
    ("batch", 1, 384, 8, 1, 1), ("batch", 1, 384, 8, 8, 4), ("batch", 2, 384, 8, 1, 1), ("batch", 4, 384, 8, 8, 4),
    ("batch", 3, 300, 6, 1, 1), ("batch", 2, 64, 16, 4, 2), ("batch", 3, 64, 8, 32, 8), ("batch", 1, 64, 16, 4, 2)])
def test_routing_same_bits_as_two_kernels(cuda_device, routing, T, E, topk, n_group, topk_group):
    """Each one-launch routing (moe_route_kernel: a warp per token; moe_route_one_kernel: one warp, T = 1;
    moe_route_blocks_kernel: a block per token; moe_route_batch_kernel: up to 4 tokens in one block, which groups
    them) against moe_topk + moe_group: every output bit-identical, ties included, over three launches with new
    logits (the grid tickets reset themselves); E not a multiple of 32 (a part warp), topk 16, and more (token,
    group) pairs than threads included."""
    rng = np.random.default_rng(T + E + topk + n_group + 17)
    bias = (rng.standard_normal(E) * 0.05).astype(np.float32)
    bias[9] = bias[5]
    one = _routing_layer(E, T, bias, topk, n_group, topk_group, routing=routing)
    two = _routing_layer(E, T, bias, topk, n_group, topk_group, routing="two")
    assert one.routing == routing and two.routing == "two"
    _assert_same_routing_bits(one, two, rng, T, E, bias, topk, n_group, topk_group)


def _assert_same_routing_bits(a, b, rng, T, E, bias, topk, n_group, topk_group):
    """Both layers' route stages on the same logits, three launches (the last with an exact tie in the scores),
    outputs poisoned before each: the reference's experts, and every output of `a` bit-identical to `b`'s."""
    assert [n for n, _ in a.stages].count("route") == 1 and [n for n, _ in b.stages].count("route") == 2
    for trial in range(3):
        logits = rng.standard_normal((T, E)).astype(np.float32)
        if trial == 2:
            logits[:, 5] = logits[:, 9]   # exact ties in the scores: the lower expert id must win
        for layer in (a, b):
            layer.logits.upload(logits)
            for name in ROUTE_OUTPUTS:
                getattr(layer, name).fill_bytes(0xFF)
            layer.forward(stages=("route",))
        ids_ref, _ = ref.route(logits, bias, topk, n_group, topk_group)
        np.testing.assert_array_equal(a.topk_ids.download(), ids_ref)
        for name in ROUTE_OUTPUTS:
            got, want = getattr(a, name).download(), getattr(b, name).download()
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=f"{name}, launch {trial}")


MOE_CASES = [
    # (T, E, hidden, inter, variants or None); None: the defaults, one case per token bucket up to 768
    (1, 16, 512, 512, None),
    (2, 16, 512, 512, None),
    (5, 16, 1024, 512, None),
    (8, 16, 1024, 512, None),
    (20, 8, 1024, 512, None),
    (33, 8, 1024, 512, None),
    (200, 8, 512, 512, None),   # many tokens per expert: several token chunks
    # FIT: the activation tile of min(8, T) rows (lanes of the rows past it read row 0)
    (2, 16, 1024, 512, ("moe_w4a16_kernel<0, 2, 4, 1, 1, 1, 1, 1, 1>", "moe_w4a16_kernel<1, 2, 4, 1, 1, 1, 1>")),
    (5, 4, 1024, 512, ("moe_w4a16_kernel<0, 2, 4, 1, 1, 1, 1, 1, 1>", "moe_w4a16_kernel<1, 2, 4, 1, 1, 1, 1>")),
]


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,hidden,inter,variants", MOE_CASES)
def test_moe_layer_small(cuda_device, T, E, hidden, inter, variants):
    _check_moe(T, E, hidden, inter, variants, topk=4)


def _variant_pairs():
    """(gate_up, down) pairs covering every registry variant: each gate_up with the down of the same
    parameters, each down without such a twin with the first gate_up."""
    gate_up = [v for v in MOE_GEMM_VARIANTS if v.startswith("moe_w4a16_kernel<0")]
    down = [v for v in MOE_GEMM_VARIANTS if v.startswith("moe_w4a16_kernel<1")]
    twin = {v: v.replace("<0", "<1", 1) for v in gate_up}
    return ([(g, twin[g] if twin[g] in down else down[0]) for g in gate_up] +
            [(gate_up[0], d) for d in down if d not in twin.values()])


@pytest.mark.gpu
@pytest.mark.parametrize("variants", _variant_pairs(), ids=lambda p: f"{p[0][16:]}+{p[1][16:]}")
def test_moe_layer_variants(cuda_device, variants):
    """Every gate_up and down variant of the registry table, with tokens per expert spanning 1..4 tiles (a
    3584-wide hidden size where a variant's activation pieces do not split 1024)."""
    from runtime.kimi_kernels import variant_params
    pieces = max(variant_params(v)[6] for v in variants)
    _check_moe(45, 8, 1024 if 1024 % (256 * max(pieces, 1)) == 0 else 3584, 1024, variants, topk=4)


@pytest.mark.gpu
@pytest.mark.parametrize("T,variants", [(9, None), (6, None), (40, ("moe_w4a16_kernel<0, 2, 4, 1, 1, 1, 1>",
                                                                   "moe_w4a16_kernel<1, 2, 4, 1, 4, 1, 1>")),
                                        (40, ("moe_w4a16_kernel<0, 2, 4, 1, 4, 1, 4>",
                                              "moe_w4a16_kernel<1, 2, 4, 1, 2, 1, 1, 4>")),
                                        (20, ("moe_w4a16_kernel<0, 2, 4, 1, 2, 1, 7>",
                                              "moe_w4a16_kernel<1, 2, 4, 1, 2, 1, 1>"))])
def test_moe_layer_real_shape_subset(cuda_device, T, variants):
    """Kimi K2 shapes (7168 -> 2048) on 10 experts, top-8, with a shared-expert term; the defaults (at T = 6 the
    gate_up of GATE_UP_PIECES, x in 7 pieces), and the staged-activation variants at their largest tiles (gate_up's
    8 x 7168 and 16 x 7168 in 7 pieces, down's 32 x 2048 bf16), in K pieces and with row groups."""
    _check_moe(T, 10, 7168, 2048, variants, topk=8, shared=True)


@pytest.mark.gpu
def test_moe_layer_real_shape_default_with_hot_tier(cuda_device):
    """Kimi K2 shapes at T = 64, top-2 of 10 experts (~13 tokens each): the default plan splits them between the hot
    tier (>= 16 tokens, wgmma where it runs) and the mma.sync chain, whose gate_up stages x in 7 pieces
    (GATE_UP_PIECES at T = 25..511) in chunks of up to 16 tokens."""
    from runtime.kimi_kernels import GATE_UP_PIECES, default_variants
    assert default_variants(64, 7168)[0] == GATE_UP_PIECES[511]
    _check_moe(64, 10, 7168, 2048, None, topk=2, shared=True)


@pytest.mark.gpu
@pytest.mark.parametrize("gmma", [None, "auto"])
def test_moe_layer_largest_bucket(cuda_device, gmma):
    """T = 1025 (the top of the layer's range, the T > 768 defaults) on 64 experts, top-8: ~128 tokens per
    expert, every chunk size; all on mma.sync, or the busiest experts on the wgmma path where it runs."""
    _check_moe(1025, 64, 1024, 512, None, topk=8, gmma_min_tokens=gmma)


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,min_tokens,tile,parallel,pipe,overlap", [
    (T, E, m, tile, parallel, pipe, overlap)
    for T, E, m, tile in [(200, 8, 64, 64), (200, 8, 90, 128), (300, 16, 40, 256), (3, 8, 2, 64), (200, 8, 8, 32)]
    for parallel, pipe, overlap in [(False, 1, False), (True, 1, False), (False, 0, False), (False, 2, False),
                                    (True, 2, False), (False, 3, False), (False, 3, True), (True, 2, True),
                                    (False, 4, False), (True, 4, False), (False, 4, True), (False, 5, False),
                                    (True, 5, True), (False, 6, False), (True, 6, True), (False, 7, False),
                                    (True, 7, True), (False, 8, False), (True, 8, True), (False, 20, False),
                                    (True, 20, True)]
    if _pipe_takes_tile(pipe, tile)])
def test_moe_layer_gmma_hot_experts(cuda_device, T, E, min_tokens, tile, parallel, pipe, overlap):
    """Experts with >= min_tokens tokens on the wgmma kernel (several token chunks of `tile` at T = 200 / 64,
    hot and cold slots mixed; the chunks on blocks side by side or in turn; each pipeline; the hot chain on
    its own stream beside the cold one or not), the rest on mma.sync: the layer vs the float32 reference,
    twice."""
    from runtime import cuda
    if cuda.get_device().arch != "90a":
        pytest.skip("the wgmma MoE kernel is built for sm_90a only")
    _check_moe(T, E, 1024, 512, None, topk=4, gmma_min_tokens=min_tokens, gmma_tile=tile, runs=2,
               gmma_parallel_chunks=parallel, gmma_pipe=pipe, gmma_overlap=overlap)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [25, 31])
def test_moe_layer_default_hot_tier_below_32(cuda_device, T):
    """The default plan at T = 25..31 (GMMA_AUTO's first tier: experts of >= 16 tokens on PIPE 8's 32-token tiles, no
    PDL): 8 experts, top-4, so some experts pass 16 tokens and some do not: the layer vs the float32 reference,
    twice."""
    from runtime import cuda
    from runtime.kimi_kernels import gmma_auto_tiers
    if cuda.get_device().arch != "90a":
        pytest.skip("the wgmma MoE kernel is built for sm_90a only")
    assert gmma_auto_tiers(T) == ((16, 32, 8),)
    _check_moe(T, 8, 1024, 512, None, topk=4, runs=2)


@pytest.mark.gpu
@pytest.mark.parametrize("T,E", [(300, 64), (600, 64), (800, 96)])
def test_moe_layer_default_hot_tiers_from_256(cuda_device, T, E):
    """The default plan from T = 256 (GMMA_AUTO: PIPE 20 for experts of >= 64 tokens, PIPE 8 below in two or three
    tiers, its grids capped at GMMA_AUTO_GRID_ROWS block rows): top-4 of 64 / 96 experts puts slots in every tier; the
    layer vs the float32 reference, twice."""
    from runtime import cuda
    from runtime.kimi_kernels import gmma_auto_grid_rows, gmma_auto_tiers
    if cuda.get_device().arch != "90a":
        pytest.skip("the wgmma MoE kernel is built for sm_90a only")
    assert len(gmma_auto_tiers(T)) >= 2 and gmma_auto_grid_rows(T) is not None
    _check_moe(T, E, 1024, 512, None, topk=4, runs=2)


@pytest.mark.gpu
@pytest.mark.parametrize("pipe,tile", [(7, 32), (7, 64), (7, 128), (8, 32), (8, 64), (20, 256)])
def test_moe_layer_gmma_pipe7_steady_state(cuda_device, pipe, tile):
    """PIPE 7 / 8 / 20 at K = 2048 / 1024 (32 / 16 units): both GEMMs run unchecked steady-state stage groups before
    the checked tail (at the other tests' K = 512 down has no steady group), every expert hot: the layer vs the
    float32 reference, twice."""
    from runtime import cuda
    if cuda.get_device().arch != "90a":
        pytest.skip("the wgmma MoE kernel is built for sm_90a only")
    _check_moe(150, 8, 2048, 1024, None, topk=4, gmma_min_tokens=1, gmma_tile=tile, gmma_pipe=pipe, runs=2)


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,tiers,parallel,overlap", [
    (200, 16, [(64, 128, 4), (16, 64, 3)], False, True),
    (200, 16, [(64, 128, 4), (16, 64, 3)], True, False),
    (300, 16, [(90, 256, 4), (40, 128, 2)], False, True),
    (300, 16, [(100, 128, 1), (60, 64, 3), (20, 64, 0)], False, False),
    (300, 16, [(64, 256, 5), (16, 64, 3)], False, True),
    (200, 16, [(64, 128, 7), (16, 64, 8)], False, True),
    (300, 16, [(64, 256, 5), (17, 32, 8)], False, True),
    (300, 16, [(128, 256, 5), (40, 64, 8), (17, 32, 8)], False, True),
    (600, 64, [(64, 256, 5), (33, 64, 8), (9, 32, 8)], False, True),
    (300, 16, [(64, 256, 5), (17, 32, 8)], True, True),
    (600, 64, [(64, 256, 20), (33, 64, 8), (9, 32, 8)], False, True),
    (300, 16, [(64, 256, 20), (17, 32, 8)], True, True)])
@pytest.mark.parametrize("grid_rows", [None, 3])
def test_moe_layer_gmma_tiers(cuda_device, T, E, tiers, parallel, overlap, grid_rows):
    """Hot slots split between pipelines by token count (each slot in the tier with the largest minimum it
    reaches, the rest on mma.sync; with grid_rows, the non-WS tiers' blocks each walk every third slot or
    item): the layer vs the float32 reference, twice."""
    from runtime import cuda
    if cuda.get_device().arch != "90a":
        pytest.skip("the wgmma MoE kernel is built for sm_90a only")
    _check_moe(T, E, 1024, 512, None, topk=4, gmma_tiers=tiers, runs=2, gmma_parallel_chunks=parallel,
               gmma_overlap=overlap, gmma_grid_rows=grid_rows)


@pytest.mark.gpu
@pytest.mark.parametrize("parallel", [False, True])
def test_moe_layer_gmma_pipe20_chunk_widths(cuda_device, parallel):
    """PIPE 20 cuts each chunk's wgmma N to its tokens rounded up to 32: skewed routing at T = 1000 (16 experts, top-4,
    ~60..600 tokens each) gives last chunks of many widths. Every expert on PIPE 20 against the float32 reference,
    and bit for bit against PIPE 8's 64-token tiles (the same products summed in the same order)."""
    from runtime import cuda
    if cuda.get_device().arch != "90a":
        pytest.skip("the wgmma MoE kernel is built for sm_90a only")
    y20 = _check_moe(1000, 16, 1024, 512, None, topk=4, skew=True, gmma_tiers=[(1, 256, 20)],
                     gmma_parallel_chunks=parallel)
    y8 = _check_moe(1000, 16, 1024, 512, None, topk=4, skew=True, gmma_tiers=[(1, 64, 8)])
    np.testing.assert_array_equal(y20, y8, err_msg="PIPE 20 differs from PIPE 8")


@pytest.mark.gpu
def test_moe_layer_hot_sms(cuda_device):
    """The hot chain on half the SMs and the cold one on the rest (hot_sms: green contexts): the same kernels on
    other SMs, so the same bits as the default placement; against the float32 reference, twice."""
    from runtime import cuda
    if cuda.get_device().arch != "90a":
        pytest.skip("the wgmma MoE kernel is built for sm_90a only")
    tiers = [(64, 256, 20), (17, 32, 8)]
    y_split = _check_moe(300, 16, 1024, 512, None, topk=4, skew=True, gmma_tiers=tiers, runs=2,
                         hot_sms=cuda.get_device().sm_count // 2, cold_sms="rest")
    y_all = _check_moe(300, 16, 1024, 512, None, topk=4, skew=True, gmma_tiers=tiers)
    np.testing.assert_array_equal(y_split, y_all, err_msg="hot_sms changed the layer's output")
    # the cold chain on every SM (its own stream: the layer's), the hot one on its partition at the top priority
    y_cold_all = _check_moe(300, 16, 1024, 512, None, topk=4, skew=True, gmma_tiers=tiers,
                            hot_sms=cuda.get_device().sm_count // 2, cold_sms="all", hot_priority=True)
    np.testing.assert_array_equal(y_cold_all, y_all, err_msg="cold_sms='all' / hot_priority changed the output")


@pytest.mark.gpu
@pytest.mark.parametrize("plan", [dict(), dict(gmma_pipe=3, gmma_overlap=True),
                                  dict(gmma_pipe=4, gmma_tile=128, gmma_overlap=True),
                                  dict(gmma_pipe=8, gmma_overlap=True, hot_sms=64, cold_sms="rest"),
                                  dict(gmma_pipe=8, gmma_overlap=True, hot_sms=48, cold_sms="all", hot_priority=True)])
def test_moe_graph_replay_gmma_hot_experts(cuda_device, plan):
    """The layer with wgmma hot experts captured once and replayed with new inputs (the overlapped plan's
    hot chain is a parallel branch of the graph)."""
    from runtime import cuda
    from runtime.kimi_kernels import MoeLayer
    if cuda.get_device().arch != "90a":
        pytest.skip("the wgmma MoE kernel is built for sm_90a only")
    rng = np.random.default_rng(14)
    dense, w = make_moe(rng, 8, 512, 512)
    layer = MoeLayer(w, 96, np.zeros(8, np.float32), topk=4, **{"gmma_min_tokens": 40, "gmma_tile": 64, **plan})
    _check_graph_replay(layer, dense, rng, T=96, E=8, hidden=512, topk=4, trials=2)


def _moe_case(rng, T, E, hidden, inter, shared):
    """A random MoE layer's inputs: (dense weights, device weights, x, logits, bias, shared output or None, its
    device copy or None)."""
    from runtime import cuda
    dense, w = make_moe(rng, E, hidden, inter)
    x = round_bf16(rng.standard_normal((T, hidden)).astype(np.float32))
    logits = rng.standard_normal((T, E)).astype(np.float32)
    bias = (rng.standard_normal(E) * 0.05).astype(np.float32)
    sh = round_bf16(rng.standard_normal((T, hidden)).astype(np.float32)) if shared else None
    sh_dev = cuda.to_device(to_bf16(sh)) if shared else None
    return dense, w, x, logits, bias, sh, sh_dev


def _check_moe(T, E, hidden, inter, variants, topk, shared=False, runs=1, skew=False, **layer_options):
    """The layer vs the float32 reference on fresh random data, outputs NaN-poisoned before each of `runs` forwards,
    every run the same bits; returns the output. skew: Zipf-like expert popularity added to the logits (experts
    from a few tokens to several hundred)."""
    from runtime.kimi_kernels import MoeLayer
    rng = np.random.default_rng(T * 1000 + E + hidden)
    dense, w, x, logits, bias, sh, sh_dev = _moe_case(rng, T, E, hidden, inter, shared)
    if skew:
        logits += -np.log1p(np.arange(E, dtype=np.float32))[rng.permutation(E)][None, :]
    layer = MoeLayer(w, T, bias, topk=topk, shared=sh_dev, variants=variants, **layer_options)
    layer.x.upload(to_bf16(x))
    layer.logits.upload(logits)
    ids, wts = ref.route(logits, bias, topk)
    want, slack = ref.moe(x, ids, wts, dense["gate"], dense["up"], dense["down"], sh, with_slack=True)
    outs = []
    for run in range(runs):
        for a in (layer.h, layer.down_out, layer.y):
            a.fill_bytes(0xFF)      # NaN poison
        layer.forward()
        outs.append(layer.y.download())
        assert_close(outs[-1], want, f"MoE T={T} E={E} {layer.variants} {layer_options} run {run}", dtype="bf16",
                     rtol=RTOL, atol=RTOL, scale="mean", slack=slack)
        np.testing.assert_array_equal(outs[-1], outs[0], err_msg=f"run {run} differs from run 0")
    return outs[0]


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,shared", [(1, 16, True), (3, 16, False), (12, 8, True)])
def test_moe_launch_plans_same_bits(cuda_device, T, E, shared):
    """Every launch plan (fused or two-kernel routing, combine folded into down or separate, early weight
    start, PDL on or off) gives the same output bits, and matches the float32 reference."""
    from runtime.kimi_kernels import MoeLayer, default_variants
    hidden, inter, topk = 1024, 512, 8
    rng = np.random.default_rng(T * 31 + E)
    dense, w, x, logits, bias, sh, sh_dev = _moe_case(rng, T, E, hidden, inter, shared)
    plans = [dict(), dict(routing="two", fuse_combine=False, early=False, pdl=False),
             dict(fuse_combine=True), dict(fuse_combine=False), dict(early=False), dict(pdl=False, fuse_combine=True),
             dict(routing="fused", fuse_combine=True, early=True, pdl=True), dict(pdl=True),
             dict(pdl=True, early=True), dict(pdl=True, early=True, combine_early=True)]
    if T <= 8:   # block-level hand-offs (the small-T plans)
        plans += [dict(signals=True), dict(signals=True, routing="blocks"), dict(signals=True, combine_early=False),
                  dict(signals=True, variants=(default_variants(T, hidden)[0],   # down: two row groups per warp
                                               "moe_w4a16_kernel<1, 2, 4, 1, 1, -3, 1, 2>"))]
    else:   # the hand-offs above T = 8 (with PDL and down's early start: the default up to T = 24 since session 36)
        plans += [dict(pdl=True, early=True, signals=True)]
    outs = []
    for plan in plans:
        layer = MoeLayer(w, T, bias, topk=topk, shared=sh_dev, **plan)
        layer.x.upload(to_bf16(x))
        layer.logits.upload(logits)
        for a in (layer.h, layer.down_out, layer.y):
            a.fill_bytes(0xFF)      # NaN poison
        for _ in range(2):          # twice: the folded combine's tickets reset themselves
            layer.forward()
        outs.append(layer.y.download())
    ids, wts = ref.route(logits, bias, topk)
    want, slack = ref.moe(x, ids, wts, dense["gate"], dense["up"], dense["down"], sh, with_slack=True)
    assert_close(outs[0], want, f"MoE T={T} default plan", dtype="bf16", rtol=RTOL, atol=RTOL, scale="mean",
                 slack=slack)
    for plan, out in zip(plans[1:], outs[1:]):
        np.testing.assert_array_equal(out, outs[0], err_msg=f"plan {plan}")


@pytest.mark.gpu
def test_moe_graph_replay_folded_combine(cuda_device):
    """T = 1 with the fused options: one routing kernel, combine in the down GEMM (3 launches), replayed."""
    from runtime.kimi_kernels import MoeLayer
    rng = np.random.default_rng(12)
    dense, w = make_moe(rng, 16, 1024, 512)
    layer = MoeLayer(w, 1, np.zeros(16, np.float32), topk=8, routing="fused", fuse_combine=True, early=True,
                     pdl=True)
    assert [name for name, _ in layer.stages] == ["route", "gate_up", "down"]
    _check_graph_replay(layer, dense, rng, T=1, E=16, hidden=1024, topk=8, trials=3)


@pytest.mark.gpu
def test_moe_graph_replay(cuda_device):
    from runtime.kimi_kernels import MoeLayer
    rng = np.random.default_rng(11)
    dense, w = make_moe(rng, 8, 512, 512)
    layer = MoeLayer(w, 6, np.zeros(8, np.float32), topk=4)
    _check_graph_replay(layer, dense, rng, T=6, E=8, hidden=512, topk=4, trials=2)


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,early,combine_early,signals", [
    (1, 16, True, False, False), (5, 16, True, False, False), (40, 8, False, False, False),
    (1, 16, True, True, False), (40, 8, False, True, False),
    (1, 16, True, True, True), (2, 16, True, False, True), (6, 16, True, True, True), (12, 16, True, False, True),
    (24, 16, True, False, True)])
def test_moe_graph_replay_pdl(cuda_device, T, E, early, combine_early, signals):
    """Programmatic dependent launch between the layer's kernels, captured in a graph (programmatic edges, not
    the eager launches of test_moe_launch_plans_same_bits): with down's early weight start at small T, and at
    T = 40 with the hot chain (sm_90a) on its own stream beside the cold one; the combine reading the routing
    before its wait; the block-level hand-offs (signals), whose counters the routing zeroes at each replay (T = 12 / 24:
    the range where they came with PDL and the early start in session 36)."""
    from runtime.kimi_kernels import MoeLayer
    rng = np.random.default_rng(13 + T)
    dense, w = make_moe(rng, E, 1024, 512)
    layer = MoeLayer(w, T, np.zeros(E, np.float32), topk=4, pdl=True, early=early, combine_early=combine_early,
                     signals=signals)
    _check_graph_replay(layer, dense, rng, T=T, E=E, hidden=1024, topk=4, trials=3)


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,plan", [
    (1, 16, dict()), (5, 16, dict()), (40, 8, dict()), (3, 8, dict(fuse_combine=True, early=False)),
    (1, 16, dict(shared_fork="start")), (4, 16, dict(shared_fork="route")), (1, 16, dict(shared_kernel="auto")),
    (6, 16, dict(shared_kernel="gemv", shared_fork="start")), (1, 16, dict(shared_plain_start=False)),
    (1, 16, dict(signals=True)), (4, 16, dict(signals=True, shared_fork="route")),
    (20, 16, dict()),   # the T = 5..24 default since session 37: the fork after the routing, PDL, early start, signals
    # gate_up's 32-token ring pinned (the default there since session 38): its earlier combine read the shared
    # output before the shared MLP had written it in graph replay (NaN, H100) until the combine's grid wait for it
    (20, 16, dict(variants=("moe_w4a16_kernel<0, 2, 4, 1, 4, 3>", "moe_w4a16_kernel<1, 2, 4, 1, 2, 1, 1>"))),
    (96, 8, dict(gmma_min_tokens=40, gmma_tile=64, gmma_pipe=3, gmma_overlap=True))])
def test_moe_layer_shared_mlp(cuda_device, T, E, plan):
    """The shared expert's MLP run by the layer on its side stream (joined before the combine, or before down
    where the combine is folded into it; beside the hot chain's own side stream at T = 96):
    - .shared bit-equal to the 'shared' stage run alone, and .y to a layer given that output;
    - both vs the float32 reference, eager and graph-replayed with new inputs (outputs poisoned first)."""
    from runtime import cuda
    from runtime.kimi_kernels import MoeLayer, SharedExpertMlp
    if "gmma_min_tokens" in plan and cuda.get_device().arch != "90a":
        pytest.skip("the wgmma MoE kernel is built for sm_90a only")
    hidden, inter, shared_inter, topk = 1024, 512, 1024, 4
    rng = np.random.default_rng(31 + T)
    dense, w = make_moe(rng, E, hidden, inter)
    gate_up = round_bf16(rng.standard_normal((2 * shared_inter, hidden)).astype(np.float32) / np.sqrt(hidden))
    down = round_bf16(rng.standard_normal((hidden, shared_inter)).astype(np.float32) / np.sqrt(shared_inter))
    mlp = SharedExpertMlp(cuda.to_device(to_bf16(gate_up)), cuda.to_device(to_bf16(down)))
    bias = np.zeros(E, np.float32)
    layer = MoeLayer(w, T, bias, topk=topk, shared_mlp=mlp, **plan)
    alone = MoeLayer(w, T, bias, topk=topk, shared_mlp=mlp, **plan)
    stream = cuda.Stream()
    with cuda.capture(stream) as g:
        layer.forward(stream)
    graph = g.instantiate()
    for trial in range(2):
        x = round_bf16(rng.standard_normal((T, hidden)).astype(np.float32))
        logits = rng.standard_normal((T, E)).astype(np.float32)
        ids, wts = ref.route(logits, bias, topk)
        sh_want = ref.shared_mlp(x, gate_up, down)
        want, slack = ref.moe(x, ids, wts, dense["gate"], dense["up"], dense["down"], sh_want, with_slack=True)
        slack += ref.bf16_ulp(sh_want)   # the shared output's own rounding
        got = {}
        for how in ("eager", "graph"):
            for a in (layer.shared, layer.h, layer.down_out, layer.y):
                a.fill_bytes(0xFF)      # NaN poison
            layer.x.upload(to_bf16(x))
            layer.logits.upload(logits)
            if how == "eager":
                layer.forward(stream)
            else:
                graph.launch(stream)
            stream.synchronize()
            got[how] = layer.shared.download(), layer.y.download()
            assert_close(got[how][0], sh_want, f"shared MLP, T={T} {plan} {how} {trial}", dtype="bf16", rtol=RTOL,
                         atol=RTOL, scale="mean")
            assert_close(got[how][1], want, f"MoE + shared MLP, T={T} {plan} {how} {trial}", dtype="bf16",
                         rtol=RTOL, atol=RTOL, scale="mean", slack=slack)
        for a, b in zip(got["eager"], got["graph"]):
            np.testing.assert_array_equal(a, b, err_msg="graph replay differs from the eager layer")
    # the 'shared' stage alone on one stream: the same bits; a layer given that output: the same .y
    alone.x.upload(to_bf16(x))
    alone.shared.fill_bytes(0xFF)
    alone.forward(stream, stages=("shared",))
    stream.synchronize()
    np.testing.assert_array_equal(alone.shared.download(), got["eager"][0])
    given = MoeLayer(w, T, bias, topk=topk, shared=alone.shared, **plan)
    given.x.upload(to_bf16(x))
    given.logits.upload(logits)
    given.y.fill_bytes(0xFF)
    given.forward(stream)
    stream.synchronize()
    np.testing.assert_array_equal(given.y.download(), got["eager"][1])


def _check_graph_replay(layer, dense, rng, *, T, E, hidden, topk, trials):
    """Capture layer.forward once, replay it with new inputs each time (the graph reads the buffers'
    contents), output poisoned before each replay and compared with the float32 reference."""
    from runtime import cuda
    stream = cuda.Stream()
    with cuda.capture(stream) as g:
        layer.forward(stream)
    graph = g.instantiate()
    for trial in range(trials):
        x = round_bf16(rng.standard_normal((T, hidden)).astype(np.float32))
        logits = rng.standard_normal((T, E)).astype(np.float32)
        layer.x.upload(to_bf16(x))
        layer.logits.upload(logits)
        layer.y.fill_bytes(0xFF)
        graph.launch(stream)
        stream.synchronize()
        ids, wts = ref.route(logits, np.zeros(E, np.float32), topk)
        want, slack = ref.moe(x, ids, wts, dense["gate"], dense["up"], dense["down"], with_slack=True)
        assert_close(layer.y.download(), want, f"graph replay {trial}", dtype="bf16", rtol=RTOL, atol=RTOL,
                     scale="mean", slack=slack)


MLA_CASES = [
    # (Tq, H, prefix, tree?, splits)
    (1, 64, 100, True, None),
    (17, 64, 300, True, None),
    (65, 8, 1000, True, None),
    (40, 8, 77, False, None),      # prefill (causal)
    (33, 64, 2048, True, 1),       # single split: direct bf16 output
    (128, 16, 4000, True, None),
    (2, 64, 3000, True, 2),        # the merge with fewer splits than its 8 warps
    (1, 8, 9000, True, 283),       # many short splits (9 rows each), some warps with one split more
]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["mma", "gmma", "gmma-split"])
@pytest.mark.parametrize("tq,heads,prefix,tree,splits", MLA_CASES)
def test_mla_attention(cuda_device, tq, heads, prefix, tree, splits, kernel):
    from runtime import cuda
    from runtime.kimi_kernels import MlaAttention
    rng = np.random.default_rng(tq * 7 + prefix)
    kv = round_bf16(rng.standard_normal((prefix + tq, 576)).astype(np.float32))
    q = round_bf16(rng.standard_normal((tq, heads, 576)).astype(np.float32))
    mask = random_tree_visibility(rng, tq) if tree else None
    scale = 1.0 / np.sqrt(192.0)
    kv_dev = cuda.to_device(to_bf16(kv))
    mask_dev = cuda.to_device(mask) if tree else None
    if kernel.startswith("gmma") and cuda.get_device().arch != "90a":
        pytest.skip("the wgmma MLA kernel is built for sm_90a only")
    attn = MlaAttention(tq, heads, kv_dev, prefix, scale, mask=mask_dev, splits=splits, kernel=kernel)
    attn.q.upload(to_bf16(q))
    attn.out.fill_bytes(0xFF)
    attn.forward()
    want = ref.mla_attention(q, kv, prefix, scale, mask)
    assert_close(attn.out.download(), want, f"MLA {kernel} tq={tq} H={heads} prefix={prefix}", dtype="bf16",
                 rtol=3e-2, atol=3e-2, scale="mean")


@pytest.mark.gpu
def test_mla_head_gemm(cuda_device):
    from runtime import cuda
    from runtime.kimi_kernels import mla_head_gemm
    rng = np.random.default_rng(5)
    T, H = 3, 8
    kvb = round_bf16(rng.standard_normal((H * 256, 512)).astype(np.float32) * 0.05)   # kv_b_proj [H*(128+128), 512]
    q_nope = round_bf16(rng.standard_normal((T, H, 192)).astype(np.float32))          # nope 128 + rope 64
    o_lat = round_bf16(rng.standard_normal((T, H, 512)).astype(np.float32))
    w_dev = cuda.to_device(to_bf16(kvb))
    qn_dev, ol_dev = cuda.to_device(to_bf16(q_nope)), cuda.to_device(to_bf16(o_lat))
    q_lat = cuda.empty((T, H, 576), np.uint16).fill_bytes(0xFF)
    out = cuda.empty((T, H, 128), np.uint16).fill_bytes(0xFF)
    mla_head_gemm(qn_dev, w_dev, q_lat, T, H, 512, 128, 192, 576, 256 * 512, 1, 512)
    mla_head_gemm(ol_dev, w_dev.view(128 * 512, (H * 256 - 128, 512)), out, T, H, 128, 512, 512, 128,
                  256 * 512, 512, 1)
    wk = kvb.reshape(H, 256, 512)[:, :128]           # W_UK [H, 128, 512]
    wv = kvb.reshape(H, 256, 512)[:, 128:]           # W_UV [H, 128, 512]
    want_q = np.einsum("thd,hdc->thc", q_nope[:, :, :128], wk)
    want_o = np.einsum("thc,hdc->thd", o_lat, wv)
    assert_close(q_lat.download()[:, :, :512], want_q, "absorb", dtype="bf16", rtol=RTOL, atol=RTOL, scale="mean")
    assert_close(out.download(), want_o, "W_UV", dtype="bf16", rtol=RTOL, atol=RTOL, scale="mean")


# tools/bench_mla.py --splits on the H200 (2026-12-03 (3) run 3, graph us per split count): the plan's
# pick must be within 5% of the fastest count measured.
MLA_SPLIT_SWEEPS = {
    # (H, prefix, budget): {splits: us}
    (64, 4096, 1): {7: 82.8, 15: 44.4, 33: 27.0, 43: 24.6, 66: 24.1, 132: 35.8},
    (64, 4096, 16): {7: 85.8, 15: 90.9, 33: 124.5, 66: 156.3, 132: 242.8},
    (64, 32768, 1): {7: 572.2, 15: 266.6, 33: 130.5, 65: 74.8, 66: 74.4, 132: 87.7},
    (64, 32768, 16): {7: 536.6, 15: 513.5, 33: 620.1, 66: 598.3, 132: 644.4},
    (8, 4096, 1): {7: 76.8, 15: 41.8, 33: 23.1, 66: 16.4, 129: 16.5, 132: 16.1},
    (8, 4096, 16): {7: 81.4, 15: 43.3, 33: 26.4, 43: 24.8, 66: 31.8, 132: 42.1},
    (8, 32768, 1): {7: 532.2, 15: 272.5, 33: 126.9, 66: 68.2, 129: 41.7, 132: 40.6},
    (8, 32768, 16): {7: 570.6, 15: 264.1, 33: 126.5, 43: 98.9, 66: 131.4, 132: 118.8},
}


# The same for the default sm_90a kernel, gmma-split (64-position KV tiles; 2026-12-03 (5) run 2, graph us per
# split count after rounding to whole tiles): the mma.sync-fitted model picks within 6% of the best here too.
MLA_GMMA_SPLIT_SWEEPS = {
    (8, 4096, 1): {2: 136.2, 4: 73.9, 8: 42.6, 13: 27.6, 22: 20.3, 33: 16.1, 65: 13.6},
    (8, 4096, 16): {2: 138.0, 4: 75.7, 8: 44.6, 13: 29.8, 22: 22.7, 33: 19.3, 65: 25.7},
    (8, 4096, 64): {2: 140.8, 4: 77.1, 8: 45.6, 14: 33.8, 22: 42.6, 33: 48.3, 66: 70.4},
    (8, 4096, 256): {2: 153.3, 4: 88.1, 8: 95.5, 14: 121.0, 23: 138.8, 35: 160.6, 69: 234.6},
    (8, 32768, 1): {8: 263.1, 16: 138.3, 33: 71.4, 43: 56.0, 65: 40.8, 86: 34.3, 129: 28.0, 171: 40.1, 257: 36.3},
    (8, 32768, 16): {8: 265.6, 16: 133.8, 33: 72.2, 43: 59.7, 65: 79.2, 86: 68.6, 129: 78.5, 257: 108.4},
    (8, 32768, 64): {4: 520.6, 8: 258.4, 14: 152.8, 16: 265.6, 24: 187.6, 43: 168.6, 65: 198.9, 129: 222.0},
    (8, 32768, 256): {2: 1037.2, 4: 511.5, 8: 513.1, 16: 537.7, 33: 578.8, 65: 643.4, 130: 775.9},
    (64, 4096, 1): {2: 139.2, 4: 76.3, 8: 44.9, 13: 29.8, 22: 22.6, 33: 18.7, 65: 19.5},
    (64, 4096, 16): {2: 142.0, 4: 79.7, 7: 55.2, 8: 52.1, 13: 62.3, 22: 72.9, 33: 91.5, 65: 130.9},
    (64, 4096, 64): {2: 153.7, 4: 159.7, 8: 186.4, 14: 211.6, 22: 242.7, 33: 288.3, 66: 432.4},
    (64, 4096, 256): {1: 549.2, 2: 605.5, 4: 631.2, 8: 692.4, 14: 784.5, 23: 933.4},
    (64, 32768, 1): {8: 265.6, 16: 140.4, 33: 73.8, 43: 58.9, 65: 48.5, 86: 68.4, 129: 60.8, 257: 92.3},
    (64, 32768, 16): {4: 521.7, 8: 473.4, 15: 291.9, 16: 294.6, 24: 314.8, 33: 354.7, 65: 360.2, 129: 422.0},
    (64, 32768, 64): {2: 986.8, 4: 995.4, 8: 1003.8, 16: 1054.8, 33: 1092.2, 65: 1226.0, 129: 1472.0},
    (64, 32768, 256): {1: 3806.6, 2: 3871.4, 4: 3854.4, 8: 3940.9, 16: 4032.7, 33: 4234.0, 65: 4766.0},
}


def test_mla_gmma_split_plan_near_measured_best():
    from runtime.kimi_kernels import MLA_GMMA_BN, mla_split_plan, mla_splits
    for (heads, prefix, budget), times in MLA_GMMA_SPLIT_SWEEPS.items():
        tq = budget + 1
        s, _ = mla_split_plan(mla_splits(tq * heads, prefix + tq, 132), prefix + tq, MLA_GMMA_BN)
        assert s in times and times[s] <= 1.06 * min(times.values()), (heads, prefix, budget, s, times)


def test_mla_splits_plan_near_measured_best():
    from runtime.kimi_kernels import mla_splits
    for (heads, prefix, budget), times in MLA_SPLIT_SWEEPS.items():
        tq = budget + 1
        s = mla_splits(tq * heads, prefix + tq, 132)
        assert s in times and times[s] <= 1.05 * min(times.values()), (heads, prefix, budget, s, times)


def test_moe_bits_compare(tmp_path):
    """tools/moe_bits.py compare: identical files pass; one flipped bit or a NaN output fails, per plan."""
    from tools.moe_bits import compare
    rng = np.random.default_rng(5)
    a = {"T=4 {}": to_bf16(rng.standard_normal((4, 8)).astype(np.float32)),
         "T=9 {}": to_bf16(rng.standard_normal((9, 8)).astype(np.float32))}
    np.savez(tmp_path / "a.npz", **a)
    flipped = {k: v.copy() for k, v in a.items()}
    flipped["T=9 {}"][3, 1] ^= 1
    np.savez(tmp_path / "b.npz", **flipped)
    nan = {k: v.copy() for k, v in a.items()}
    nan["T=4 {}"][0, 0] = 0x7FC0
    np.savez(tmp_path / "c.npz", **nan)
    assert compare(str(tmp_path / "a.npz"), str(tmp_path / "a.npz")) == 0
    assert compare(str(tmp_path / "a.npz"), str(tmp_path / "b.npz")) == 1
    assert compare(str(tmp_path / "c.npz"), str(tmp_path / "c.npz")) == 1


def test_offset_free_dequant_is_exact():
    """The arithmetic of int4_dequant.cuh's offset-free form, modelled exactly on the CPU: a nibble masked into
    bits 0-3 of a bf16 reads as q * 2^-133 (a subnormal), one masked into bits 4-7 as q * 2^-129 (across the
    subnormal / normal line: the same line); one fma with the scale times 2^130 (2^126 for bits 4-7) and -s,
    rounded once to bf16, equals the bf16 weight round((q - 8) * s) times 2^-3 for every nibble and scales over
    the whole range check_scale_range allows."""
    rng = np.random.default_rng(3)
    s = np.concatenate([rng.uniform(-1, 1, 4000) * 2.0 ** rng.integers(-123, -2, 4000),
                        [2.0 ** -123, -2.0 ** -123, 0.2490234375, -0.2490234375, 0.004, 0.0]])
    s = from_bf16(to_bf16(s.astype(np.float32))).astype(np.float64)
    s = s[(s == 0) | ((np.abs(s) >= 2.0 ** -123) & (np.abs(s) < 0.25))]
    q = np.arange(16)
    want = from_bf16(to_bf16((q[:, None] - 8) * s[None, :])).astype(np.float64) / 8   # the biased form / 8
    for shift, exponent in ((0, 130), (4, 126)):
        bits = (q << shift).astype(np.uint16)                        # the masked field, one bf16 half
        v = from_bf16(bits).astype(np.float64)                       # its value as the hardware reads it
        np.testing.assert_array_equal(v, q * 2.0 ** (-133 + shift))
        pre = s * 2.0 ** exponent                                     # exact (a power of two), finite in bf16
        assert np.all(np.abs(pre) < 2.0 ** 128)
        exact = v[:, None] * pre[None, :] - s[None, :]                 # the fma's exact sum (float64 holds it)
        got = from_bf16(to_bf16(exact.astype(np.float32))).astype(np.float64)   # rounded once to bf16
        np.testing.assert_array_equal(got, want)
