"""Bad input to the kernel entry points (runtime/dense_kernels.py, runtime/kimi_kernels.py) is refused with an
error naming the op and the sizes, before any device call: so these run without a GPU, on DeviceArrays that
point nowhere (nothing reads them)."""
import numpy as np
import pytest

from runtime import dense_kernels as dk
from runtime import kimi_kernels as kk
from runtime.cuda import DeviceArray

BF16 = np.uint16


class _NoDevice:
    """Stands in for runtime.cuda here: any use means a check let bad input through to the device."""

    def __getattr__(self, name):
        def refuse(*args, **kwargs):
            raise AssertionError(f"bad input reached runtime.cuda.{name}")
        return refuse


@pytest.fixture(autouse=True)
def no_device(monkeypatch):
    """Even on a GPU machine nothing here may reach the device (the arrays point nowhere)."""
    guard = _NoDevice()
    for name in ("get_device", "get_kernel", "empty"):
        monkeypatch.setattr(dk, name, getattr(guard, name))
    monkeypatch.setattr(kk, "_cuda", lambda: guard)


def fake(shape, dtype=BF16):
    return DeviceArray(0x10000, shape, dtype)


@pytest.mark.parametrize("args,kwargs,match", [
    ((fake((4, 64)), fake((8, 64)), fake((4, 8), np.float32)), {}, "out must be bf16"),
    ((fake((64,)), fake((8, 64)), fake((64, 8))), {}, r"x must be \[M, K = 64\]"),
    ((fake((4, 32)), fake((8, 64)), fake((4, 8))), {}, "does not match"),
    ((fake((4, 64)), fake((8, 64)), fake((4, 9))), {}, r"want \[M, N\] = \[4, 8\]"),
    ((fake((4, 64)), fake((8, 64)), fake((4, 8))), {"ldx": 40}, "ldx = 40 must be a multiple of 8 and >= K = 64"),
    ((fake((4, 64)), fake((8, 64)), fake((4, 8)), fake((4, 7))), {}, "residual"),
    ((fake((0, 64)), fake((8, 64)), fake((0, 8))), {}, "empty product: M = 0"),
])
def test_linear(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        dk.linear(*args, **kwargs)


def test_norms_and_elementwise():
    with pytest.raises(ValueError, match="same rows"):
        dk.rmsnorm(fake((4, 64)), fake((64,)), fake((3, 64)), 1e-6)
    with pytest.raises(ValueError, match="residual_out without residual"):
        dk.rmsnorm(fake((4, 64)), fake((64,)), fake((4, 64)), 1e-6, residual_out=fake((4, 64)))
    with pytest.raises(ValueError, match="residual must be bf16"):
        dk.rmsnorm(fake((4, 64)), fake((64,)), fake((4, 64)), 1e-6, residual=fake((4, 64), np.float32),
                   residual_out=fake((4, 64)))
    with pytest.raises(ValueError, match=r"want \[T, n_heads, head_dim\] = \[5, 2, 64\]"):
        dk.rope(fake((5, 3, 64)), fake((5,), np.int32), fake((32,), np.float32), fake((5, 2, 64)), n_heads=2,
                head_dim=64)
    with pytest.raises(ValueError, match="norm_weight has 32 elements"):
        dk.rope(fake((5, 2, 64)), fake((5,), np.int32), fake((32,), np.float32), fake((5, 2, 64)), n_heads=2,
                head_dim=64, norm_weight=fake((32,)))
    with pytest.raises(ValueError, match="gate must be bf16"):
        dk.swiglu(fake((3, 16), np.float32), fake((3, 16)), fake((3, 16)))
    with pytest.raises(ValueError, match=r"out \(3, 8\), want \[T, I\] = \[3, 16\]"):
        dk.swiglu(fake((3, 16)), fake((3, 16)), fake((3, 8)), T=3, I=16)
    with pytest.raises(ValueError, match="must be equal"):
        dk.add(fake((3, 16)), fake((3, 16)), fake((3, 8)))
    with pytest.raises(ValueError, match="ids must be int32"):
        dk.embedding(fake((10, 16)), fake((3,), np.int64), fake((3, 16)))
    with pytest.raises(ValueError, match=r"table must be \[V, H\]"):
        dk.embedding(fake((160,)), fake((3,), np.int32), fake((3, 16)))


def test_attention():
    q, k, v, vis = fake((3, 8, 128)), fake((100, 2, 128)), fake((100, 2, 128)), fake((3, 1), np.uint32)
    with pytest.raises(ValueError, match="n_prefix 98 \\+ T 3 > capacity 100"):
        dk.attention(q, k, v, 98, vis, 0.1, fake((3, 8, 128)))
    with pytest.raises(ValueError, match=r"want \[T, Hq, D\] = \[3, 8, 128\]"):
        dk.attention(q, k, v, 5, vis, 0.1, fake((3, 8, 64)))
    with pytest.raises(ValueError, match="max_keys = 200 must be in"):
        dk.attention(q, k, v, fake((1,), np.int32), vis, 0.1, fake((3, 8, 128)), max_keys=200)
    with pytest.raises(ValueError, match="pass max_keys"):
        dk.attention(q, k, v, fake((1,), np.int32), vis, 0.1, fake((3, 8, 128)))
    with pytest.raises(ValueError, match="visibility must be uint32"):
        dk.attention(q, k, v, 5, fake((3, 1), np.int32), 0.1, fake((3, 8, 128)))
    with pytest.raises(ValueError, match="n_prefix must be int32"):
        dk.attention(q, k, v, fake((1,), np.int64), vis, 0.1, fake((3, 8, 128)), max_keys=50)
    with pytest.raises(ValueError, match="k 260 and v 256 multiples of 8"):
        dk.attention(q, k, v, 5, vis, 0.1, fake((3, 8, 128)), ldk=260)
    with pytest.raises(ValueError, match="q 1025 and out 1024 must be even"):
        dk.attention(q, k, v, 5, vis, 0.1, fake((3, 8, 128)), ldq=1025)
    with pytest.raises(ValueError, match="shorter than a row"):
        dk.attention(q, k, v, 5, vis, 0.1, fake((3, 8, 128)), ldo=512)
    with pytest.raises(ValueError, match="kernel 'fast'"):
        dk.attention(q, k, v, 5, vis, 0.1, fake((3, 8, 128)), kernel="fast")
    with pytest.raises(ValueError, match=r"decode variant \(8, 8\)"):
        dk.attention(fake((1, 8, 128)), k, v, 5, vis, 0.1, fake((1, 8, 128)), decode=(8, 8))


def test_host_values_refused_while_capturing(monkeypatch):
    from runtime.cuda import graph
    monkeypatch.setitem(graph._active, 12345, object())   # as if a capture were running on some stream
    with pytest.raises(ValueError, match="being captured"):
        dk.attention(fake((3, 8, 128)), fake((100, 2, 128)), fake((100, 2, 128)), 5, fake((3, 1), np.uint32),
                     0.1, fake((3, 8, 128)))


def test_sampling_and_kv_compact():
    with pytest.raises(ValueError, match="V = 1000 is more than the row stride 992"):
        dk.argmax(fake((4, 992)), fake((4,), np.int32), V=1000)
    with pytest.raises(ValueError, match=r"k = 2000 must be in 1..min\(1024"):
        dk.log_softmax_topk(fake((4, 4096)), 2000, fake((4, 2000), np.float32), fake((4, 2000), np.int32))
    pos, key, out = fake((4,), np.int32), fake((2,), np.uint32), fake((4,), np.int32)
    with pytest.raises(ValueError, match="temperature"):
        dk.sample(fake((4, 64)), 0.0, pos, key, out)
    with pytest.raises(ValueError, match=r"positions must be an int32 device array \[rows = 4\], got float32"):
        dk.sample(fake((4, 64)), 0.8, fake((4,), np.float32), key, out)
    with pytest.raises(ValueError, match=r"positions must be an int32 device array \[rows = 4\]"):
        dk.sample(fake((4, 64)), 0.8, fake((3,), np.int32), key, out)
    with pytest.raises(ValueError, match="positions must be an int32 device array"):
        dk.sample(fake((4, 64)), 0.8, np.arange(4, dtype=np.int32), key, out)      # host array
    with pytest.raises(ValueError, match=r"key must be a uint32 device array \[2\]"):
        dk.sample(fake((4, 64)), 0.8, pos, fake((2,), np.int32), out)
    with pytest.raises(ValueError, match=r"key must be a uint32 device array \[2\]"):
        dk.sample(fake((4, 64)), 0.8, pos, np.array([1, 2], np.uint32), out)
    with pytest.raises(ValueError, match="different row sizes"):
        dk.KVPlanes([fake((10, 2, 64)), fake((10, 1, 64))])
    planes = dk.KVPlanes.__new__(dk.KVPlanes)
    planes.row_bytes, planes.capacity, planes.count = 256, 64, 1
    with pytest.raises(ValueError, match="strictly ascending"):
        dk.kv_compact(planes, [12, 11], 10)
    with pytest.raises(ValueError, match="capacity 64"):
        dk.kv_compact(planes, [10, 64], 10)
    with pytest.raises(ValueError, match="meta must be an int32 device array"):
        dk.kv_compact(planes, fake((8,), np.int32), meta=np.array([10, 2], np.int32))


def test_kimi_entry_points():
    rng = np.random.default_rng(0)
    wp = rng.integers(0, 2**31, (16, 64), dtype=np.int64).astype(np.int32)
    ws = rng.integers(0, 2**16, (16, 16), dtype=np.int64).astype(np.uint16)
    with pytest.raises(ValueError, match="bf16 bits"):
        kk.repack_int4_experts(wp, ws.astype(np.float32), (16, 512))
    with pytest.raises(ValueError, match="stacked over the same experts"):
        kk.repack_int4_experts(wp[None], ws, (16, 512))
    with pytest.raises(ValueError, match="weight_scale"):
        kk.repack_int4_experts(wp, ws[:, :8], (16, 512))
    packed, scales = kk.repack_int4_experts(wp[None], ws[None], (16, 512))
    with pytest.raises(ValueError, match="up .* does not match gate"):
        kk.MoeWeights.upload((packed, scales), (packed[:, :, :4], scales), (packed, scales))
    with pytest.raises(ValueError, match="stacked repack_int4_experts output"):
        kk.MoeWeights.upload((packed[0], scales[0]), (packed, scales), (packed, scales))
    # random scale bits (huge, tiny, NaN scales), shapes that fit together (hidden = inter = 512)
    wq = rng.integers(0, 2**31, (1, 512, 64), dtype=np.int64).astype(np.int32)
    wsq = rng.integers(0, 2**16, (1, 512, 16), dtype=np.int64).astype(np.uint16)
    sq = kk.repack_int4_experts(wq, wsq, (512, 512))
    with pytest.raises(ValueError, match="gate: .* group scales outside"):
        kk.MoeWeights.upload(sq, sq, sq)
    w = kk.MoeWeights(8, 512, 512, *(fake((1,)) for _ in range(6)))
    with pytest.raises(ValueError, match="topk=9"):
        kk.MoeLayer(w, 4, np.zeros(8, np.float32), topk=9)
    with pytest.raises(ValueError, match="bias has 7 entries"):
        kk.MoeLayer(w, 4, np.zeros(7, np.float32), topk=4)
    with pytest.raises(ValueError, match="shared expert output"):
        kk.MoeLayer(w, 4, np.zeros(8, np.float32), topk=4, shared=fake((4, 256)))
    with pytest.raises(ValueError, match="2-d bf16"):
        kk.SharedExpertMlp(fake((32, 512), np.float32), fake((512, 16)))
    with pytest.raises(ValueError, match=r"want gate_up \[2 I, H\] and down \[H, I\]"):
        kk.SharedExpertMlp(fake((32, 512)), fake((512, 8)))
    with pytest.raises(ValueError, match="I % 8 == 0"):
        kk.SharedExpertMlp(fake((12, 512)), fake((512, 6)))
    mlp = kk.SharedExpertMlp(fake((32, 256)), fake((256, 16)))
    assert (mlp.hidden, mlp.inter, mlp.nbytes) == (256, 16, (32 * 256 + 256 * 16) * 2)
    with pytest.raises(ValueError, match="hidden size 256, the routed experts 512"):
        kk.MoeLayer(w, 4, np.zeros(8, np.float32), topk=4, shared_mlp=mlp)
    with pytest.raises(ValueError, match="shared_fork='later'"):
        kk.MoeLayer(w, 4, np.zeros(8, np.float32), topk=4, shared_mlp=kk.SharedExpertMlp(fake((32, 512)),
                                                                                         fake((512, 16))),
                    shared_fork="later")
    with pytest.raises(ValueError, match="not both"):
        kk.MoeLayer(w, 4, np.zeros(8, np.float32), topk=4, shared=fake((4, 512)), shared_mlp=mlp)
    with pytest.raises(ValueError, match="gmma_tile=100"):
        kk.MoeLayer(w, 4, np.zeros(8, np.float32), topk=4, gmma_min_tokens=32, gmma_tile=100)
    with pytest.raises(ValueError, match="gmma_pipe=4 with gmma_tile=64"):
        kk.MoeLayer(w, 4, np.zeros(8, np.float32), topk=4, gmma_min_tokens=32, gmma_tile=64, gmma_pipe=4)
    with pytest.raises(ValueError, match="gmma_pipe=3 with gmma_tile=256"):
        kk.MoeLayer(w, 4, np.zeros(8, np.float32), topk=4, gmma_min_tokens=32, gmma_tile=256, gmma_pipe=3)
    with pytest.raises(ValueError, match="gmma_pipe=9"):
        kk.MoeLayer(w, 4, np.zeros(8, np.float32), topk=4, gmma_min_tokens=32, gmma_pipe=9)
    with pytest.raises(ValueError, match="gmma_pipe=8 with gmma_tile=128"):
        kk.MoeLayer(w, 4, np.zeros(8, np.float32), topk=4, gmma_min_tokens=32, gmma_tile=128, gmma_pipe=8)
    with pytest.raises(ValueError, match="gmma_tiers replaces"):
        kk.MoeLayer(w, 4, np.zeros(8, np.float32), topk=4, gmma_tiers=[(16, 64, 3)], gmma_tile=64)
    with pytest.raises(ValueError, match="same minimum"):
        kk.MoeLayer(w, 4, np.zeros(8, np.float32), topk=4, gmma_tiers=[(16, 64, 3), (16, 128, 4)])
    with pytest.raises(ValueError, match="gmma_pipe=3 with gmma_tile=256"):
        kk.MoeLayer(w, 4, np.zeros(8, np.float32), topk=4, gmma_tiers=[(64, 256, 3), (16, 64, 3)])
    with pytest.raises(ValueError, match="gmma_grid_rows=0"):
        kk.MoeLayer(w, 4, np.zeros(8, np.float32), topk=4, gmma_min_tokens=32, gmma_grid_rows=0)
    with pytest.raises(ValueError, match="gmma_grid_rows='many'"):
        kk.MoeLayer(w, 4, np.zeros(8, np.float32), topk=4, gmma_min_tokens=32, gmma_grid_rows="many")
    with pytest.raises(ValueError, match="gmma_wide_grid_rows=0"):
        kk.MoeLayer(w, 4, np.zeros(8, np.float32), topk=4, gmma_min_tokens=32, gmma_wide_grid_rows=0)
    with pytest.raises(ValueError, match="early=True"):
        kk.MoeLayer(w, 4, np.zeros(8, np.float32), topk=4, gmma_min_tokens=32, early=True)
    kv = fake((100, 576))
    with pytest.raises(ValueError, match="kernel='wgmma'"):
        kk.MlaAttention(8, 8, kv, 10, 0.1, kernel="wgmma")
    with pytest.raises(ValueError, match="kv cache"):
        kk.MlaAttention(8, 8, kv, 95, 0.1)
    with pytest.raises(ValueError, match=r"mask uint32 \(8, 1\)|want uint32"):
        kk.MlaAttention(40, 8, kv, 10, 0.1, mask=fake((40, 1), np.uint32))
    with pytest.raises(ValueError, match="heads=0"):
        kk.MlaAttention(8, 0, kv, 10, 0.1)
    for bad in (0, kk.MLA_MAX_SPLITS + 1):   # the combine's shared weight table holds MLA_MAX_SPLITS
        with pytest.raises(ValueError, match=f"splits={bad}: 1..{kk.MLA_MAX_SPLITS}"):
            kk.MlaAttention(8, 8, kv, 10, 0.1, splits=bad)
    with pytest.raises(ValueError, match="y must be bf16"):
        kk.mla_head_gemm(fake((3, 8, 192)), fake((2048, 512)), fake((3, 8, 576), np.float32), 3, 8, 512, 128, 192,
                         576, 256 * 512, 1, 512)


def test_valid_input_passes_the_checks():
    """The control: well-formed calls get past every check and reach the (guarded) device layer."""
    calls = [
        lambda: dk.linear(fake((4, 64)), fake((8, 64)), fake((4, 8)), fake((4, 8))),
        lambda: dk.rmsnorm(fake((4, 64)), fake((64,)), fake((4, 64)), 1e-6, residual=fake((4, 64)),
                           residual_out=fake((4, 64))),
        lambda: dk.attention(fake((3, 8, 128)), fake((100, 2, 128)), fake((100, 2, 128)), fake((1,), np.int32),
                             fake((3, 1), np.uint32), 0.1, fake((3, 8, 128)), max_keys=100),
        lambda: dk.argmax(fake((4, 992)), fake((4,), np.int32), V=989),
        lambda: kk.MlaAttention(40, 8, fake((100, 576)), 10, 0.1, mask=fake((40, 2), np.uint32)),
        lambda: kk.MoeLayer(kk.MoeWeights(8, 512, 512, *(fake((1,)) for _ in range(6))), 4,
                            np.zeros(8, np.float32), topk=4),
    ]
    for call in calls:
        with pytest.raises(AssertionError, match="bad input reached runtime.cuda"):
            call()


def test_gemv_warps_per_tile_follow_the_measured_winners():
    """H200, M = 1 (PERF.md): KW 4 for Qwen3-8B qkv and gate_up and SmolLM2's lm_head, KW 2 for Qwen3-8B's
    lm_head, KW 8 where KW 4 would leave block slots idle (Qwen3-8B o: 128 blocks; up: a second wave 45% full),
    KW 4 where K has fewer than 8 units of 64; the rmsnorm prologue
    has no KW 2 instance, so lm_head with it takes KW 4. Every choice is a built instance."""
    from cutlass_kernels.registry import GEMV_INSTANCES
    want = {(6144, 4096): 4, (24576, 4096): 4, (151936, 4096): 2, (4096, 4096): 8, (49152, 576): 4,
            (576, 1536): 8, (960, 576): 8, (12288, 4096): 8, (4096, 12288): 8, (3072, 576): 8, (1000, 256): 4}
    assert {nk: dk.gemv_kw(*nk, 132) for nk in want} == want
    assert dk.gemv_kw(151936, 4096, 132, xmode=1) == 4
    for (N, K) in want:
        for xmode in (0, 1, 2):
            entry = dk.linear_plan(1, N, K, 132, xmode=xmode)[0] if dk.gemv_fits(1, K) else None
            if entry is not None and "gemv" in entry:
                kw, st, xm = (int(v) for v in entry.split("<")[1].rstrip(">").split(","))
                assert (kw, st, xm) in GEMV_INSTANCES and xm == xmode, entry


def test_gemv_persistent_grid_covers_every_tile_evenly(monkeypatch):
    """The persistent gemv grid: at most 2 blocks per SM, every row tile walked by exactly one block, the blocks'
    tile counts differ by at most one; one block per tile where that already fits one wave or persist=False.
    By default it is persistent only where every warp carries its W ring into the next tile."""
    monkeypatch.setattr(dk, "GEMV_PERSIST_FORCED", "")
    for tiles in (1, 100, 264, 265, 527, 768, 2374):
        for carries in (False, True):
            blocks = dk.gemv_blocks(tiles, carries, 132, True)
            assert blocks <= max(tiles, 0) and (blocks <= 264 or blocks == tiles)
            walked = [len(range(b, tiles, blocks)) for b in range(blocks)]
            assert sum(walked) == tiles and max(walked) - min(walked) <= 1, (tiles, blocks)
            assert dk.gemv_blocks(tiles, carries, 132, False) == tiles
            assert dk.gemv_blocks(tiles, carries, 132, None) == (blocks if carries else tiles)
    # gate_up 24576 x 4096, KW 4: 16 units per warp, STAGES 4 -> 768 tiles on 256 blocks
    assert dk.linear_plan(1, 24576, 4096, 132, kernel="gemv", kw=4)[1] == (256, 1, 1)
    # K = 576: 9 units over KW 4 warps (3, 2, 2, 2) -> not every warp carries: one block per tile
    assert dk.linear_plan(1, 49152, 576, 132, kernel="gemv", kw=4)[1] == (1536, 1, 1)
    monkeypatch.setattr(dk, "GEMV_PERSIST_FORCED", "0")
    assert dk.linear_plan(1, 24576, 4096, 132, kernel="gemv", kw=4)[1] == (768, 1, 1)


def test_gemv_holds_only_the_tokens_rows_of_x():
    """x's shared-memory tile has min(M, 8) rows, so Qwen3-8B's down (K = 12288) takes the gemv up to M = 2
    (GEMV_SMEM_CAP: larger x tiles leave too little L1 for the W stream), the 4096-wide ones up to M = 8."""
    assert dk._gemv_smem(1, 12288) == (12288 + 32) * 2 and dk.gemv_fits(2, 12288) and not dk.gemv_fits(3, 12288)
    assert dk.gemv_fits(8, 4096) and "gemv" in dk.linear_plan(2, 4096, 12288, 132)[0]
    assert "xres" in dk.linear_plan(4, 4096, 12288, 132)[0]
    assert dk._gemv_smem(9, 4096) == dk._gemv_smem(8, 4096) == 8 * (4096 + 32) * 2 and not dk.gemv_fits(9, 64)
    with pytest.raises(ValueError, match="needs 73920"):
        dk.linear_plan(3, 4096, 12288, 132, kernel="gemv")


def test_linear_plan_token_tiles():
    """Every plan names a built instance; 65..72 rows (a budget-64 verify) take one 72-row tile, not 64 + 1."""
    from cutlass_kernels.registry import FAMILIES
    built = set(FAMILIES["dense_linear"].entries)
    for M in (1, 8, 9, 16, 17, 33, 64, 65, 72, 73, 129, 300):
        for N, K in ((960, 576), (49152, 576), (576, 1536), (4096, 4096)):
            entry, grid, k_per_split, _ = dk.linear_plan(M, N, K, 132)
            assert entry in built, (M, N, K, entry)
            rows = 8 * int(entry.split("<")[1].split(",")[0])
            assert grid[2] == -(-M // rows) and (M <= 8 or rows * (grid[2] - 1) < M), (M, entry, grid)
            assert k_per_split * grid[1] >= K
    assert dk.linear_plan(65, 960, 576, 132)[0] == "linear_bf16_kernel<9, 1>"
    assert dk.linear_plan(65, 960, 576, 132)[1][2] == 1
    assert dk.linear_plan(73, 960, 576, 132)[0] == "linear_bf16_kernel<8, 1>"
    assert dk.linear_plan(65, 1000, 2048, 132, rt=2)[0] == "linear_bf16_kernel<8, 2>"


def test_fused_prologue_rows(monkeypatch):
    """Fused rmsnorm / swiglu prologues: up to 8 rows by default; with FUSED_PROLOGUE_ROWS = 32 (the env knob)
    verify-size batches take the 16- / 32-row x-resident instances, which exist; never above 32 rows."""
    from cutlass_kernels.registry import FAMILIES
    built = set(FAMILIES["dense_linear"].entries)
    monkeypatch.setattr(dk, "FUSED_PROLOGUE_ROWS", {"rmsnorm": 8, "swiglu": 8})
    assert dk.fused_prologue_ok(8, 576, "rmsnorm") and not dk.fused_prologue_ok(9, 576, "rmsnorm")
    monkeypatch.setattr(dk, "FUSED_PROLOGUE_ROWS", {"rmsnorm": 32, "swiglu": 32})
    for M, mt in ((9, 2), (16, 2), (17, 4), (32, 4)):
        for prologue, xmode in (("rmsnorm", 1), ("swiglu", 2)):
            assert dk.fused_prologue_ok(M, 576, prologue)
            entry, grid, k_per_split, smem = dk.linear_plan(M, 960, 576, 132, xmode=xmode)
            assert entry == f"linear_bf16_xres_kernel<{mt}, 4, {xmode}>" and entry in built, (M, entry)
            assert grid[2] == 1 and smem <= dk.XRES_SMEM_CAP
    assert not dk.fused_prologue_ok(33, 576, "swiglu") and not dk.fused_prologue_ok(17, 4096, "rmsnorm")
    monkeypatch.setattr(dk, "FUSED_PROLOGUE_ROWS", {"rmsnorm": 64, "swiglu": 64})
    assert not dk.fused_prologue_ok(33, 576, "swiglu")      # no instance above 32 rows
    with pytest.raises(ValueError, match="M <= 32"):
        dk.linear_plan(40, 960, 576, 132, xmode=1)
    # the env knob: both, or each prologue
    assert dk._fused_prologue_rows("") == {"rmsnorm": 8, "swiglu": 8}
    assert dk._fused_prologue_rows("32") == {"rmsnorm": 32, "swiglu": 32}
    assert dk._fused_prologue_rows("swiglu:32") == {"rmsnorm": 8, "swiglu": 32}
    assert dk._fused_prologue_rows("rmsnorm:16,swiglu:32") == {"rmsnorm": 16, "swiglu": 32}
    for bad in ("x", "norm:32", "swiglu:"):
        with pytest.raises(ValueError, match="DDTREE_FUSED_PROLOGUE_ROWS"):
            dk._fused_prologue_rows(bad)


def test_moe_scale_range():
    """The INT4 MoE dequantization's scale range (kimi_kernels.check_scale_range): 0 and 2^-123 <= |s| < 2^-2 pass;
    2^-2 and above, below 2^-123, inf and NaN are refused with the count and the first offender."""
    from runtime.bf16 import to_bf16
    ok = to_bf16(np.array([0.0, -0.0, 2.0 ** -123, 0.004, -0.01, 0.248], np.float32))
    kk.check_scale_range(ok)
    for bad in (0.25, -0.3, 2.0 ** -124, np.inf, np.nan):
        with pytest.raises(ValueError, match="1 group scales outside"):
            kk.check_scale_range(to_bf16(np.array([0.004, bad], np.float32)), "gate")

