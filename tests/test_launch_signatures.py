"""Kernel arguments against the kernels' PTX signatures, without a GPU: the parser, the check every Launch
runs, and every launch the Kimi MoE layer prepares (each plan, tier and pipeline) checked against the sm_90a
build of its kernel, so a kernel parameter added on one side only fails here instead of on the device."""
import types

import numpy as np
import pytest

from fake_cuda import ptx_param_sizes
from runtime import kimi_kernels as kk
from runtime.cuda import DeviceArray
from runtime.cuda.errors import CudaError
from runtime.cuda.kernel import Launch, check_arguments
from runtime.cuda.nvrtc import ptx_entry_params

PTX = """
.visible .entry _Z3fooPKfi(
\t.param .u64 .ptr .align 1 _Z3fooPKfi_param_0,
\t.param .u32 _Z3fooPKfi_param_1,
\t.param .align 8 .b8 _Z3fooPKfi_param_2[16]
)
.maxntid 128, 1, 1
{
\tret;
}
.visible .entry noop()
{
\tret;
}
"""


def test_ptx_entry_params():
    assert ptx_entry_params(PTX) == {"_Z3fooPKfi": (8, 4, 16), "noop": ()}


def test_ptx_entry_params_of_real_kernels():
    assert ptx_param_sizes("runtime_probe", "read_sum_kernel") == (8, 8, 8)   # (const uint4*, long long, unsigned*)
    assert ptx_param_sizes("runtime_probe", "read_sum_deep_kernel<8>") == (8, 8, 8)   # tools/read_bandwidth.py
    assert ptx_param_sizes("runtime_probe", "noop_kernel") == (8, 4)
    # tools/bench_stream_rows.py: (const uint4*, int units, int streams, int step_major, unsigned*)
    for depth in (1, 6):
        assert ptx_param_sizes("runtime_probe", f"stream_rows_kernel<{depth}, 1>") == (8, 4, 4, 4, 8)


class _Kernel:
    def __init__(self, sizes):
        self.param_sizes, self.function, self.pdl, self.checked_types = sizes, None, False, set()

    def __repr__(self):
        return "k"


def test_check_arguments():
    ptr = DeviceArray(0x1000, (4,), np.float32)
    check_arguments(_Kernel((8, 4, 8)), [ptr, np.int32(1), np.int32(2)])   # narrower is zero-extended
    with pytest.raises(TypeError, match="takes 3 arguments, got 2"):
        check_arguments(_Kernel((8, 4, 8)), [ptr, np.int32(1)])
    with pytest.raises(TypeError, match="argument 1 is a 8-byte int64 for a 4-byte"):
        check_arguments(_Kernel((8, 4)), [ptr, np.int64(1)])
    with pytest.raises(TypeError, match="takes 1 arguments, got 2"):
        Launch(_Kernel((8,)), 1, 32, [ptr, ptr])
    check_arguments(types.SimpleNamespace(), [ptr])    # a kernel without a known signature: not checked
    k = _Kernel((8, 4))
    check_arguments(k, [ptr, np.int32(1)])              # passes, and is remembered by its type list
    check_arguments(k, [ptr, np.int32(7)])
    with pytest.raises(TypeError, match="argument 1 is a 8-byte"):
        check_arguments(k, [ptr, np.int64(1)])          # another type list: checked again


class _FakeArray:
    def __init__(self, shape, dtype):
        self.shape, self.dtype, self.ptr = tuple(np.atleast_1d(shape)), np.dtype(dtype), 0x7F0000000000
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize

    def fill_bytes(self, value):
        return self

    def view(self, offset_elems, shape, dtype=None):
        v = _FakeArray(shape, dtype or self.dtype)
        v.ptr = self.ptr + offset_elems * self.dtype.itemsize
        return v


def _checking_cuda(prepared):
    """Stands in for runtime.cuda in kimi_kernels: arrays point nowhere, and every prepared launch is a real
    Launch (its arguments checked) of a kernel carrying the sm_90a PTX signature of that entry."""
    def get_kernel(family, entry):
        k = types.SimpleNamespace(family=family, entry=entry, function=None, pdl=False,
                                  param_sizes=ptx_param_sizes(family, entry), set_max_dynamic_smem=lambda n: None)
        k.prepare = lambda grid, block, args, smem=0: prepared.append(Launch(k, grid, block, args, smem)) or \
            prepared[-1]
        k.launch = lambda grid, block, args, smem=0, stream=None: k.prepare(grid, block, args, smem)
        return k

    nothing = types.SimpleNamespace(synchronize=lambda: None, record=lambda *a: None, wait=lambda *a: None)
    return types.SimpleNamespace(
        empty=_FakeArray, to_device=lambda a: _FakeArray(np.asarray(a).shape, np.asarray(a).dtype),
        get_kernel=get_kernel,
        get_device=lambda: types.SimpleNamespace(arch="90a", sm_count=132, smem_optin_bytes=232448),
        default_stream=lambda: nothing, Stream=lambda priority=0: nothing, Event=lambda timing=True: nothing,
        priority_range=lambda: (0, -5), CudaError=CudaError,
        shared_partition=lambda sms, priorities=(0, 0): types.SimpleNamespace(
            sizes=(sms, 132 - sms), streams=(types.SimpleNamespace(priority=priorities[0], name="hot"),
                                             types.SimpleNamespace(priority=priorities[1], name="rest"))))


@pytest.mark.parametrize("T,plan", [
    (1, {}), (1, dict(routing="two")), (1, dict(routing="warp-one")), (8, dict(routing="blocks")),
    (4, dict(routing="batch")), (64, {}), (1, dict(signals=True)), (3, dict(signals=True)),
    (8, dict(signals=True)),
    (256, {}), (256, dict(gmma_min_tokens=None)), (600, {}),
    (1025, {}),
    (8, dict(routing="fused", fuse_combine=True, early=True, pdl=True, gmma_min_tokens=None)),
    (128, dict(gmma_tiers=[(64, 256, 4), (16, 64, 3)], gmma_parallel_chunks=True)),
    (300, dict(gmma_tiers=[(100, 128, 1), (60, 64, 2), (20, 64, 0)])),
    (96, dict(gmma_min_tokens=40, gmma_tile=128, gmma_pipe=4, gmma_overlap=False)),
    (256, dict(gmma_tiers=[(64, 256, 5), (8, 64, 3)])),
    (256, dict(gmma_tiers=[(64, 256, 4), (16, 64, 3)], gmma_grid_rows=8)),
    (256, dict(gmma_tiers=[(64, 256, 5), (8, 64, 6)])),
    (1025, dict(gmma_min_tokens=1, gmma_tile=64, gmma_pipe=6)),
    (1025, dict(gmma_tiers=[(64, 256, 5), (1, 32, 6)])),
    (256, dict(gmma_min_tokens=16, gmma_tile=128, gmma_pipe=6)),
    (1025, dict(gmma_tiers=[(64, 256, 5), (1, 32, 7)])),
    (128, dict(gmma_min_tokens=16, gmma_tile=64, gmma_pipe=7)),
    (128, dict(gmma_min_tokens=16, gmma_tile=64, gmma_pipe=8)),
    (1025, dict(gmma_tiers=[(64, 256, 5), (1, 32, 8)])),
    (1025, dict(gmma_tiers=[(64, 256, 20), (33, 64, 8), (9, 32, 8)], gmma_grid_rows=128)),
    (256, dict(gmma_tiers=[(64, 256, 20), (16, 64, 8)], gmma_parallel_chunks=True)),
])
def test_moe_layer_launches_match_kernel_signatures(monkeypatch, T, plan):
    prepared = []
    monkeypatch.setattr(kk, "_cuda", lambda: _checking_cuda(prepared))
    E, hidden, inter = 384, 7168, 2048
    w = kk.MoeWeights(E, hidden, inter, *(_FakeArray((1,), np.uint8) for _ in range(6)))
    layer = kk.MoeLayer(w, T, np.zeros(E, np.float32), shared=None, **plan)
    names = [name for name, _ in layer.stages]
    assert len(prepared) >= len(names) >= 3 and "gate_up" in names and "down" in names
    if plan.get("gmma_tiers"):
        assert names.count("gate_up_hot") == len(plan["gmma_tiers"])
    # one routing launch, two for moe_topk + moe_group; with hot tiers the slot split is a route stage too
    assert names.count("route") == (2 if layer.routing == "two" else 1) + bool(layer.gmma_tiers), names
    assert layer.routing == plan.get("routing", kk.default_routing(T, layer.topk))


def test_route_batch_tokens_match_the_kernel():
    import re
    from runtime.cuda import nvrtc
    text = (nvrtc.kernel_source_dir() / "moe_routing.cu").read_text()
    assert int(re.search(r"kRouteBatchTokens = (\d+);", text).group(1)) == kk.ROUTE_BATCH_TOKENS


def test_moe_routing_choices(monkeypatch):
    monkeypatch.setattr(kk, "_cuda", lambda: _checking_cuda([]))
    E = 384
    w = kk.MoeWeights(E, 7168, 2048, *(_FakeArray((1,), np.uint8) for _ in range(6)))
    with pytest.raises(ValueError, match="warp-one"):
        kk.MoeLayer(w, 8, np.zeros(E, np.float32), routing="warp-one")
    with pytest.raises(ValueError, match="routing="):
        kk.MoeLayer(w, 8, np.zeros(E, np.float32), routing="one")
    with pytest.raises(ValueError, match="batch"):   # 5 tokens, or 4 x 16 picks: more than one block takes
        kk.MoeLayer(w, 5, np.zeros(E, np.float32), routing="batch")
    with pytest.raises(ValueError, match="batch"):
        kk.MoeLayer(w, 4, np.zeros(E, np.float32), topk=16, routing="batch")
    # signals: only the small-T plans whose kernels take the counters; down / combine never alone
    for T, plan in [(1, dict(routing="two")), (1, dict(early=False)), (kk.PDL_MAX_TOKENS + 1, {}),
                    (2, dict(fuse_combine=True)),
                    (1, dict(variants=("moe_w4a16_kernel<0, 2, 4, 1, 1, 1>", "moe_w4a16_kernel<1, 2, 4, 1, 1, 1>")))]:
        with pytest.raises(ValueError, match="signals"):
            kk.MoeLayer(w, T, np.zeros(E, np.float32), signals=True, **plan)
    # the default: on from SIGNALS_MIN_TOKENS to SIGNALS_MAX_TOKENS where the plan allows it
    ts = (1, 2, 8, 12, kk.SIGNALS_MAX_TOKENS, kk.SIGNALS_MAX_TOKENS + 1)
    assert [kk.MoeLayer(w, T, np.zeros(E, np.float32)).signals for T in ts] == [
        kk.SIGNALS_MIN_TOKENS <= T <= kk.SIGNALS_MAX_TOKENS for T in ts]
    assert not kk.MoeLayer(w, 4, np.zeros(E, np.float32), routing="two").signals
    assert not kk.MoeLayer(w, 4, np.zeros(E, np.float32), pdl=False).signals
    layer = kk.MoeLayer(w, 2, np.zeros(E, np.float32), signals=True)
    for stages in [("down",), ("combine",), ("route", "gate_up", "down")]:
        with pytest.raises(ValueError, match="signals"):
            layer.forward(stages=stages)
    # the defaults: the batch block from 2 tokens while tokens x topk fits its warp, a block per token up to 64
    assert [kk.default_routing(T) for T in (1, 2, 4, 5, 64, 65)] == ["blocks", "batch", "batch", "blocks",
                                                                     "blocks", "two"]
    assert [kk.default_routing(T, topk=16) for T in (2, 3)] == ["batch", "blocks"]
    assert kk.MoeLayer(w, 4, np.zeros(E, np.float32), topk=16).routing == "blocks"


@pytest.mark.parametrize("T,plan", [(1, {}), (2, {}), (5, {}), (8, {}), (12, {}), (24, {}),
                                    (31, dict(pdl=True, early=True))])
def test_moe_signals_wiring(monkeypatch, T, plan):
    """MoeLayer(signals=True): the routing zeroes the slot counters and down's; gate_up arrives per slot; down waits
    for gate_up's blocks per slot and the combine for every down block, on down's counter (the last one). T = 31:
    above the default range, with PDL and down's early start asked for."""
    monkeypatch.setattr(kk, "_cuda", lambda: _checking_cuda([]))
    E = 384
    w = kk.MoeWeights(E, 7168, 2048, *(_FakeArray((1,), np.uint8) for _ in range(6)))
    layer = kk.MoeLayer(w, T, np.zeros(E, np.float32), signals=True, **plan)
    st = dict(layer.stages)
    base, n = layer.signal_counts.ptr, layer.num_slots
    assert layer.signal_counts.shape == (n + 1,)
    assert [int(a) if not hasattr(a, "ptr") else a.ptr for a in st["route"].args[-2:]] == [base, n + 1]
    gate_up, down, combine = st["gate_up"], st["down"], st["combine"]
    assert gate_up.args[-2].ptr == base and down.args[-2].ptr == base
    assert int(down.args[-1]) == gate_up.grid[0] and int(down.args[13]) == 1   # and down starts early
    assert combine.args[-2].ptr == base + 4 * n and int(combine.args[-1]) == down.grid[0] * down.grid[1]


@pytest.mark.parametrize("T", [1, 24, 25, 31, 32, 64, 255, 256, 767, 768, 1025])
def test_moe_layer_default_hot_tiers(monkeypatch, T):
    """The default plan's hot tiers are GMMA_AUTO's for T (most tokens first), none below GMMA_AUTO_TOKENS; a
    pipeline asked for alone gets one tier at the first auto tier's minimum, on a tile that pipeline takes."""
    monkeypatch.setattr(kk, "_cuda", lambda: _checking_cuda([]))
    E, hidden, inter = 384, 7168, 2048
    w = kk.MoeWeights(E, hidden, inter, *(_FakeArray((1,), np.uint8) for _ in range(6)))
    auto = kk.gmma_auto_tiers(T)
    assert kk.EARLY_MAX_TOKENS < kk.GMMA_AUTO_TOKENS   # the hot path takes no early start: the ranges must not meet
    layer = kk.MoeLayer(w, T, np.zeros(E, np.float32))
    assert layer.gmma_tiers == (sorted(auto, reverse=True) if T >= kk.GMMA_AUTO_TOKENS else [])
    if T >= kk.GMMA_AUTO_TOKENS:
        assert layer.gmma_grid_rows == kk.gmma_auto_grid_rows(T)
        assert layer.gmma_wide_grid_rows == kk.GMMA_AUTO_WIDE_GRID_ROWS
        asked = kk.MoeLayer(w, T, np.zeros(E, np.float32), gmma_pipe=7)
        (m, tile, pipe), = asked.gmma_tiers
        assert (m, pipe) == (auto[0][0], 7) and kk._pipe_takes_tile(7, tile)
        # the row caps belong to GMMA_AUTO's tiers
        assert asked.gmma_grid_rows is None and asked.gmma_wide_grid_rows is None
        named = kk.MoeLayer(w, T, np.zeros(E, np.float32), gmma_tiers=auto)
        assert named.gmma_grid_rows is None and named.gmma_wide_grid_rows is None


@pytest.mark.parametrize("T", [24, 25, 127, 128, 255, 256, 511, 512, 1024])
def test_moe_layer_default_hot_placement(monkeypatch, T):
    """hot_sms / hot_priority "auto": GMMA_AUTO_HOT_PLACEMENT by T with GMMA_AUTO's tiers (the hot chain on a green
    partition's stream at the top priority, the cold chain on the layer's), nothing with tiers asked for or without
    the overlap; asked for without a hot chain, an error."""
    monkeypatch.setattr(kk, "_cuda", lambda: _checking_cuda([]))
    E, hidden, inter = 384, 7168, 2048
    w = kk.MoeWeights(E, hidden, inter, *(_FakeArray((1,), np.uint8) for _ in range(6)))
    sms, prio = kk.gmma_auto_hot_placement(T) if T >= kk.GMMA_AUTO_TOKENS else (None, False)
    layer = kk.MoeLayer(w, T, np.zeros(E, np.float32))
    assert (layer.hot_sms, layer.hot_priority) == (sms, prio)
    if sms is not None:
        assert layer._side.name == "hot" and layer._side.priority == -5 * prio and layer._cold is None
    named = kk.MoeLayer(w, T, np.zeros(E, np.float32), gmma_tiers=[(64, 256, 20)] if T >= 256 else [(16, 64, 8)])
    assert (named.hot_sms, named.hot_priority) == (None, False)
    plain = kk.MoeLayer(w, T, np.zeros(E, np.float32), gmma_overlap=False)
    assert (plain.hot_sms, plain.hot_priority) == (None, False)
    with pytest.raises(ValueError, match="hot_sms / hot_priority"):
        kk.MoeLayer(w, T, np.zeros(E, np.float32), gmma_overlap=False, hot_sms=64)
    with pytest.raises(ValueError, match="cold_sms"):
        kk.MoeLayer(w, T, np.zeros(E, np.float32), hot_sms=64, cold_sms="some")
    rest = kk.MoeLayer(w, T, np.zeros(E, np.float32), gmma_tiers=[(16, 64, 8)], hot_sms=64, cold_sms="rest")
    assert rest.hot_sms == 64 and rest._cold.name == "rest"


@pytest.mark.parametrize("T,rows", [(255, None), (256, 32), (511, 32), (512, 64), (767, 64), (768, 128),
                                    (1024, 128)])
def test_moe_layer_default_grid_rows(monkeypatch, T, rows):
    """GMMA_AUTO_GRID_ROWS by T bucket, and the hot grids it caps: each non-WS tier's grid has at most that many block
    rows (the 256-token tier at most GMMA_AUTO_WIDE_GRID_ROWS), the warp-specialized tier one row per possibly hot
    slot."""
    prepared = []
    monkeypatch.setattr(kk, "_cuda", lambda: _checking_cuda(prepared))
    E, hidden, inter = 384, 7168, 2048
    w = kk.MoeWeights(E, hidden, inter, *(_FakeArray((1,), np.uint8) for _ in range(6)))
    layer = kk.MoeLayer(w, T, np.zeros(E, np.float32))
    assert kk.gmma_auto_grid_rows(T) == rows and layer.gmma_grid_rows == rows
    P = T * kk.KIMI_TOPK
    hot = [launch for name, launch in layer.stages if name in ("gate_up_hot", "down_hot")]
    assert len(hot) == 2 * len(layer.gmma_tiers)
    for launch, (m, tile, pipe) in zip(hot, 2 * list(layer.gmma_tiers)):
        possible = min(layer.num_slots, P // m)
        want = possible if pipe in kk.GMMA_WS_PIPES or rows is None else min(possible, rows)
        if tile == 256 and pipe not in kk.GMMA_WS_PIPES:
            want = min(want, kk.GMMA_AUTO_WIDE_GRID_ROWS)
        assert launch.grid[1] == want, (T, m, pipe, launch.grid)
    if T >= 512:   # P // 64 possible slots of the 256-token tier, more than its cap
        assert hot[0].grid[1] == kk.GMMA_AUTO_WIDE_GRID_ROWS < min(layer.num_slots, P // 64)
        prepared.clear()
        asked = kk.MoeLayer(w, T, np.zeros(E, np.float32), gmma_wide_grid_rows=8)   # only the 256-token tier
        hot_asked = [launch for name, launch in asked.stages if name in ("gate_up_hot", "down_hot")]
        n = len(asked.gmma_tiers)   # gate_up_hot per tier, then down_hot per tier; the 256-token tier first
        assert [launch.grid[1] for launch in hot_asked] == [8 if i % n == 0 else hot[i].grid[1] for i in range(2 * n)]


@pytest.mark.parametrize("variants", [
    ("moe_w4a16_kernel<0, 2, 4, 1, 2, 1, 14>", "moe_w4a16_kernel<1, 2, 4, 1, 1, 1, 1, 4>"),
    ("moe_w4a16_kernel<0, 2, 4, 1, 1, 1, 0, 2>", "moe_w4a16_kernel<1, 2, 4, 1, 2, 1, 2>"),
    ("moe_w4a16_kernel<0, 2, 4, 1, 1, 1>", "moe_w4a16_kernel<1, 2, 4, 1, 1, -3, 1>"),   # 3-buffer register ring
    ("moe_w4a16_kernel<0, 2, 4, 1, 1, 1, 1, 1, 1>", "moe_w4a16_kernel<1, 2, 4, 1, 1, 1, 1>"),   # FIT
])
@pytest.mark.parametrize("T", [2, 64])
def test_moe_staged_variants_launch_with_their_shared_memory(monkeypatch, variants, T):
    """The XS / RG / register-ring variants at the Kimi shapes: grids shrink by the row groups, the dynamic shared
    memory is the staged activation tile (two pieces side by side with XS > 1; FIT: min(8, T) rows), none without
    XS."""
    prepared = []
    monkeypatch.setattr(kk, "_cuda", lambda: _checking_cuda(prepared))
    E, hidden, inter = 384, 7168, 2048
    w = kk.MoeWeights(E, hidden, inter, *(_FakeArray((1,), np.uint8) for _ in range(6)))
    layer = kk.MoeLayer(w, T, np.zeros(E, np.float32), variants=variants, gmma_min_tokens=None)
    launches = {launch.kernel.entry: launch for launch in prepared}
    for entry, k, rows in ((variants[0], hidden, inter), (variants[1], inter, hidden)):
        _, rb, wn, _, _, _, xs, rg, _ = kk.variant_params(entry)
        rbm = rb // 2 if entry.startswith("moe_w4a16_kernel<0") else rb
        assert launches[entry].grid[0] == rows // (16 * rbm * wn * rg)
        assert launches[entry].smem == kk.moe_smem_bytes(entry, k, T)
        assert (launches[entry].smem > 0) == (xs > 0)
    fit_entry = "moe_w4a16_kernel<0, 2, 4, 1, 1, 1, 1, 1, 1>"
    if fit_entry in variants:   # 2 rows of 7168 bf16 at T = 2, all 8 from T = 8
        assert launches[fit_entry].smem == min(8, T) * hidden * 2
    assert layer.variants == variants


@pytest.mark.parametrize("variants,message", [
    (("moe_w4a16_kernel<0, 2, 4, 1, 1, 3, 1>", None), "need a register ring"),       # XS on the cp.async ring
    ((None, "moe_w4a16_kernel<1, 2, 4, 1, 1, 1, 7>"), "does not split into 7 pieces"),  # K = 2048 into 7
    (("moe_w4a16_kernel<0, 2, 4, 1, 4, 1, 1>", None), "bytes of shared memory"),       # 32 x 7168 bf16
])
def test_moe_variant_that_does_not_fit_is_refused(monkeypatch, variants, message):
    monkeypatch.setattr(kk, "_cuda", lambda: _checking_cuda([]))
    E, hidden, inter = 384, 7168, 2048
    w = kk.MoeWeights(E, hidden, inter, *(_FakeArray((1,), np.uint8) for _ in range(6)))
    gate_up, down = kk.default_variants(64)
    variants = (variants[0] or gate_up, variants[1] or down)
    with pytest.raises(ValueError, match=message):
        kk.MoeLayer(w, 64, np.zeros(E, np.float32), variants=variants, gmma_min_tokens=None)


@pytest.mark.parametrize("kernel", ["mma", "gmma", "gmma-split"])
@pytest.mark.parametrize("tq,heads,prefix,masked,splits", [(1, 64, 4000, True, None), (65, 8, 300, True, 1),
                                                           (40, 8, 77, False, 4)])
def test_mla_launches_match_kernel_signatures(monkeypatch, kernel, tq, heads, prefix, masked, splits):
    prepared = []
    monkeypatch.setattr(kk, "_cuda", lambda: _checking_cuda(prepared))
    kv = _FakeArray((prefix + tq, kk.MLA_D), np.uint16)
    mask = _FakeArray((tq, (tq + 31) // 32), np.uint32) if masked else None
    attn = kk.MlaAttention(tq, heads, kv, prefix, 0.1, mask=mask, splits=splits, kernel=kernel)
    assert len(prepared) == (2 if attn.splits > 1 else 1)
    x, w, y = (_FakeArray((4096,), np.uint16) for _ in range(3))
    kk.mla_head_gemm(x, w, y, tq, heads, 512, 128, 128, 512, 512 * 128, 128, 1)
    assert len(prepared) == (3 if attn.splits > 1 else 2)


def test_two_block_moe_gmma_pipelines_fit_two_blocks_per_sm():
    """PIPE 3 / 6 / 7 / 8 are built for two blocks per SM (__launch_bounds__(256, 2)): their dynamic shared memory
    plus the 1 KB the driver reserves per block must fit twice into an sm_90 SM's 228 KB, or the launch would
    silently run at half the occupancy it was tuned for."""
    sm_smem, reserved = 228 * 1024, 1024
    for pipe in (3, 6, 7, 8):
        for tile in (32, 64, 128, 256):
            if kk._pipe_takes_tile(pipe, tile):
                need = kk.moe_gmma_smem_bytes(tile, pipe) + reserved
                assert 2 * need <= sm_smem, f"PIPE {pipe}, {tile}-token tile: 2 x {need} bytes > {sm_smem}"


@pytest.mark.parametrize("plan", ["p20", "ws5", "p8"])
def test_bench_hot_gemm_plans_put_every_token_on_every_expert(monkeypatch, plan):
    """tools/bench_hot_gemm.py: top-8 of 8 experts puts all T tokens on each expert (the numpy reference routing), and
    each plan's tier builds one hot gate_up and one hot down launch at the Kimi shapes, a block row per expert."""
    from runtime.kimi_reference import route
    from tools import bench_hot_gemm as bh
    T = 512
    logits = np.random.default_rng(T).standard_normal((T, bh.EXPERTS)).astype(np.float32)
    ids, _ = route(logits, np.zeros(bh.EXPERTS, np.float32), topk=bh.EXPERTS)
    assert (np.sort(ids, axis=1) == np.arange(bh.EXPERTS)).all()
    prepared = []
    monkeypatch.setattr(kk, "_cuda", lambda: _checking_cuda(prepared))
    w = kk.MoeWeights(bh.EXPERTS, bh.HIDDEN, bh.INTER, *(_FakeArray((1,), np.uint8) for _ in range(6)))
    layer = kk.MoeLayer(w, T, np.zeros(bh.EXPERTS, np.float32), topk=bh.EXPERTS, gmma_tiers=[bh.PLANS[plan]])
    hot = [(name, launch) for name, launch in layer.stages if name in ("gate_up_hot", "down_hot")]
    assert [name for name, _ in hot] == ["gate_up_hot", "down_hot"]
    assert all(launch.grid[1] == bh.EXPERTS for _, launch in hot)
