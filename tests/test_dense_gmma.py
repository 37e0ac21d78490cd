"""The Hopper GMMA bf16 linear (runtime/dense_gmma.py, cutlass_kernels/dense_linear_sm90.cu).

GPU tests (sm_90a only; skipped elsewhere) against the numpy backend on fresh random data with odd sizes,
output poisoned with NaN bits before each launch, every instance and forced split counts, launched twice
(the split-K tickets must reset), residual and strides, a back-to-back chain that exercises the PDL waits,
and a captured graph replayed with new inputs. CPU tests: the plan, and the family's SASS."""
import itertools
import re
import types

import numpy as np
import pytest

from runtime.bf16 import from_bf16, round_bf16, to_bf16
from runtime.testing import assert_close, dev_bf16, poisoned, recorded_graph

ATOL = 1e-2  # plus the bf16 rtol: as tests/test_dense_kernels.py


@pytest.fixture(scope="module")
def dg(cuda_device):
    import runtime.dense_gmma as dg
    if not dg.gmma_available(cuda_device.arch):
        pytest.skip(f"GMMA kernel is sm_90a only; device is sm_{cuda_device.arch}")
    return dg


def _data(M, N, K, seed):
    rng = np.random.default_rng(seed)
    x = round_bf16(rng.standard_normal((M, K), dtype=np.float32))
    w = round_bf16(rng.standard_normal((N, K), dtype=np.float32) / np.sqrt(K))
    return rng, x, w


# ---------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,kw", [
    # default plans (token tile = smallest instance >= M), K tails (136, 1000: not multiples of 64/128)
    (9, 111, 64, {}), (17, 333, 136, {}), (33, 989, 1000, {}), (64, 4096, 4096, {}), (65, 989, 1000, {}),
    (72, 4096, 1000, {}), (100, 333, 4096, {}), (256, 4096, 136, {}), (256, 989, 4096, {}),
    # forced split counts: one split, several (uneven), many
    (9, 989, 4096, {"splits": 1}), (33, 333, 1000, {"splits": 3}), (65, 4096, 136, {"splits": 2}),
    (72, 111, 4096, {"splits": 1}), (72, 989, 4096, {"splits": 7}), (100, 4096, 1000, {"splits": 1}),
    (256, 333, 4096, {"splits": 5}), (17, 111, 4096, {"splits": 32}),
    # more than one token tile (blockIdx.z), one split and several
    (300, 333, 1000, {}), (300, 989, 136, {"splits": 1}), (300, 989, 1000, {"cs": 2}),
    # the verify buckets 128 and 256 (token tile 136: one tile, two)
    (129, 989, 1000, {}), (257, 4096, 1000, {}),
    # a wide W at those sizes: three warpgroups, unsplit (one wave at M = 129, two at 257)
    (129, 24576, 200, {}), (257, 24576, 200, {}),
    # cluster splits: trailing splits without any k (K = 64 is one stage), forced sizes
    (60, 333, 64, {"cs": 4}), (65, 4096, 136, {"cs": 2}), (13, 989, 4096, {"cs": 4}), (256, 333, 4096, {"cs": 2}),
    (150, 4096, 1000, {"tn": 64, "ka": 2, "stages": 4, "rw": 1, "cs": 1, "splits": 3}),
    # decode sizes (token tile 16 with 1..8 live rows: dense_kernels.linear hands large weights here)
    (1, 4096, 2048, {}), (1, 989, 1000, {"cs": 3}), (5, 333, 4096, {"splits": 3}), (8, 24576, 136, {}),
    (3, 4096, 12288, {}),
])
def test_linear_gmma(dg, ref, M, N, K, kw):
    _, x, w = _data(M, N, K, M * 7919 + N * 31 + K)
    want = ref.linear(x, w)
    xd, wd = dev_bf16(x), dev_bf16(w)
    out = poisoned((M, N))
    dg.linear_gmma(xd, wd, out, **kw)
    assert_close(out.download(), want, f"linear_gmma M={M} N={N} K={K} {kw}", dtype="bf16", atol=ATOL)
    out.fill_bytes(0xFF)  # again: the split-K tickets must have reset themselves
    dg.linear_gmma(xd, wd, out, **kw)
    assert_close(out.download(), want, f"linear_gmma (second launch) M={M} N={N} K={K} {kw}", dtype="bf16",
                 atol=ATOL)


def _instances():
    from cutlass_kernels.registry import DENSE_GMMA_INSTANCES
    return DENSE_GMMA_INSTANCES


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", _instances(), ids=lambda c: "<%d,%d,%d,%d,%d>" % c[:5] + ("" if c[5] == 2 else
                                                                                         "x%dwg" % c[5]))
def test_linear_gmma_every_instance(dg, ref, cfg):
    """Every built instance at an M just over the next smaller tile, odd N and K: workspace instances (CS = 1)
    with one split and three, cluster instances (CS > 1) plain and with a residual."""
    tn, rw, cs, nwg = cfg[0], cfg[3], cfg[4], cfg[5]
    M = max(9, tn - 7)
    N, K = 333 + 64 * nwg * rw, 1000
    rng, x, w = _data(M, N, K, sum(cfg) * 101 + cs)
    r = round_bf16(rng.standard_normal((M, N), dtype=np.float32))
    want = ref.linear(x, w)
    xd, wd, rd = dev_bf16(x), dev_bf16(w), dev_bf16(r)
    kw = dict(zip(("tn", "ka", "stages", "rw", "cs", "nwg"), cfg))
    runs = ([({"splits": 1}, None), ({"splits": 3}, None)] if cs == 1 and nwg == 2 else  # workspace split
            [({"splits": 1}, None), ({"splits": 1}, rd)] if cs == 1 else [({}, None), ({}, rd)])
    for extra, res in runs:
        out = poisoned((M, N))
        dg.linear_gmma(xd, wd, out, res, **kw, **extra)
        assert_close(out.download(), want + (r if res is not None else 0),
                     f"linear_gmma {cfg} M={M} N={N} K={K} {extra} residual={res is not None}", dtype="bf16",
                     atol=ATOL)


@pytest.mark.gpu
@pytest.mark.parametrize("kw,ldr", [({"splits": 1}, 1011), ({"splits": 4}, 1011), ({"cs": 2}, 1011),
                                    ({"nw": 48}, 1011), ({"nw": 48}, 1012)], ids=str)
def test_linear_gmma_residual_and_strides(dg, ref, kw, ldr):
    """x rows ldx apart, out rows ldo apart (the columns between are never written), residual rows ldr apart (the
    narrow kernel: odd ldr takes its single-element stores, even its bf16 pairs)."""
    rng = np.random.default_rng(5 + sum(kw.values()) + ldr)
    M, N, K, ldx, ldo = 37, 989, 1000, 1032, 1000
    x_wide = round_bf16(rng.standard_normal((M, ldx), dtype=np.float32))
    w = round_bf16(rng.standard_normal((N, K), dtype=np.float32) / np.sqrt(K))
    r_wide = round_bf16(rng.standard_normal((M, ldr), dtype=np.float32))
    want = ref.linear(x_wide[:, :K], w) + r_wide[:, :N]
    xd, rd = dev_bf16(x_wide), dev_bf16(r_wide)
    out = poisoned((M, ldo))
    dg.linear_gmma(xd.view(0, (M, K)), dev_bf16(w), out.view(0, (M, N)), rd.view(0, (M, N)),
                   ldx=ldx, ldo=ldo, ldr=ldr, **kw)
    got = out.download()
    assert_close(got[:, :N], want, f"linear_gmma + residual, strided ({kw})", dtype="bf16", atol=ATOL)
    assert np.all(got[:, N:] == 0xFFFF), "wrote outside [M, N] of the strided output"


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [c for c in _instances() if c[4] > 1],
                         ids=lambda c: "<%d,%d,%d,%d,%d>" % c[:5] + ("" if c[5] == 2 else "x%dwg" % c[5]))
def test_linear_gmma_push_every_cluster_instance(dg, ref, cfg, monkeypatch):
    """The cluster K split with its partials exchanged by st.async (GMMA_PUSH, family dense_linear_sm90_push): against
    the reference, with and without a residual, and the same bits as the DSMEM epilogue (both add the partials in
    rank order). Row counts that leave some 8-token groups of the tile dead (so the ranks share fewer groups, at one
    row all but one rank own none), a second token tile, and widths with and without 16-byte stores. Instances
    whose exchange does not fit keep the DSMEM epilogue in that family."""
    tn, cs, nwg = cfg[0], cfg[4], cfg[5]
    K = 1000 + 512 * cs
    kw = dict(zip(("tn", "ka", "stages", "rw", "cs", "nwg"), cfg))
    # N % 8 == 0: 16-byte stores (a last row block cut short); N % 8 == 5: element stores
    for M, N in itertools.product(sorted({1, tn // 2 + 1, max(9, tn - 7), tn + 9}), (328 + 64 * nwg, 333 + 64 * nwg)):
        rng, x, w = _data(M, N, K, sum(cfg) * 37 + cs + M)
        r = round_bf16(rng.standard_normal((M, N), dtype=np.float32))
        xd, wd, rd = dev_bf16(x), dev_bf16(w), dev_bf16(r)
        for res in (None, rd):
            got = {}
            for push in (False, True):
                monkeypatch.setattr(dg, "GMMA_PUSH_MAX_TN", 256 if push else 0)
                out = poisoned((M, N))
                dg.linear_gmma(xd, wd, out, res, **kw)
                got[push] = out.download()
            assert_close(got[True], ref.linear(x, w) + (r if res is not None else 0),
                         f"push {cfg} M={M} N={N} K={K} residual={res is not None}", dtype="bf16", atol=ATOL)
            assert np.array_equal(got[True], got[False]), f"push {cfg} M={M}: other bits than the DSMEM epilogue"


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["dsmem", "push"])
def test_linear_gmma_chain_read_after_write(dg, ref, variant, monkeypatch):
    """Back-to-back launches on one stream without a sync (launched with PDL): the second reads what the
    first writes (y), and writes the buffer the first reads (x): both need the dependency wait."""
    from runtime.cuda import Stream
    monkeypatch.setattr(dg, "GMMA_PUSH_MAX_TN", 256 if variant == "push" else 0)
    rng = np.random.default_rng(11)
    M, N, K = 65, 1536, 2048
    stream = Stream()
    plans = [({"splits": 1}, {"cs": 4}), ({"cs": 2}, {"splits": 2}), ({"splits": 3}, {"splits": 1}),
             ({"nwg": 1, "cs": 2}, {"cs": 3})]
    for it, (kw1, kw2) in enumerate(plans):
        x = round_bf16(rng.standard_normal((M, K), dtype=np.float32))
        w1 = round_bf16(rng.standard_normal((N, K), dtype=np.float32) / np.sqrt(K))
        w2 = round_bf16(rng.standard_normal((K, N), dtype=np.float32) / np.sqrt(N))
        xd, w1d, w2d = dev_bf16(x), dev_bf16(w1), dev_bf16(w2)
        y = poisoned((M, N))
        stream.synchronize()
        dg.linear_gmma(xd, w1d, y, stream=stream, **kw1)  # y = x @ w1^T
        dg.linear_gmma(y, w2d, xd, stream=stream, **kw2)  # x <- y @ w2^T (overwrites the input)
        stream.synchronize()
        y_got = y.download()
        assert_close(y_got, ref.linear(x, w1), f"chain step 1 (it {it})", dtype="bf16", atol=ATOL)
        assert_close(xd.download(), ref.linear(from_bf16(y_got), w2), f"chain step 2 (it {it})", dtype="bf16",
                     atol=ATOL)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["dsmem", "push"])
def test_linear_gmma_graph_replay(dg, ref, variant, monkeypatch):
    """Captured once, replayed with new inputs: the split-K tickets reset, so every replay is right. The cluster
    splits: one of 4 (its exchange does not fit a receive region: the DSMEM epilogue either way) and one-warpgroup
    pairs (partials exchanged by st.async in the push variant)."""
    from runtime.cuda import Stream
    monkeypatch.setattr(dg, "GMMA_PUSH_MAX_TN", 256 if variant == "push" else 0)
    assert dg.gmma_push_smem_bytes(72, 2, 6, 1, 2, 1) and not dg.gmma_push_smem_bytes(72, 2, 4, 1, 4, 2)
    rng = np.random.default_rng(17)
    M, N, K = 72, 1000, 2048
    xd, wd, yd, rd = poisoned((M, K)), poisoned((N, K)), poisoned((M, N)), poisoned((M, N))
    y2 = poisoned((M, N))
    stream = Stream()

    y3, y4 = poisoned((M, N)), poisoned((M, N))

    def record():
        dg.linear_gmma(xd, wd, yd, splits=4, stream=stream)
        dg.linear_gmma(xd, wd, y2, rd, splits=1, stream=stream)
        dg.linear_gmma(xd, wd, y3, rd, cs=4, stream=stream)
        dg.linear_gmma(xd, wd, y4, rd, nwg=1, cs=2, stream=stream)   # <72, 2, 6, 1, 2, 1>

    for a in (xd, wd, rd):
        a.fill_bytes(0, stream=stream)
    graph = recorded_graph(stream, record)
    for rep in range(3):
        x = round_bf16(rng.standard_normal((M, K), dtype=np.float32))
        w = round_bf16(rng.standard_normal((N, K), dtype=np.float32) / np.sqrt(K))
        r = round_bf16(rng.standard_normal((M, N), dtype=np.float32))
        xd.upload(to_bf16(x))
        wd.upload(to_bf16(w))
        rd.upload(to_bf16(r))
        yd.fill_bytes(0xFF, stream=stream)
        y2.fill_bytes(0xFF, stream=stream)
        y3.fill_bytes(0xFF, stream=stream)
        y4.fill_bytes(0xFF, stream=stream)
        graph.launch(stream)
        stream.synchronize()
        want = ref.linear(x, w)
        assert_close(yd.download(), want, f"graph replay {rep} (split-K)", dtype="bf16", atol=ATOL)
        assert_close(y2.download(), want + r, f"graph replay {rep} (+ residual)", dtype="bf16", atol=ATOL)
        assert_close(y3.download(), want + r, f"graph replay {rep} (cluster split)", dtype="bf16", atol=ATOL)
        assert_close(y4.download(), want + r, f"graph replay {rep} (one-warpgroup pairs, {variant})", dtype="bf16",
                     atol=ATOL)


@pytest.mark.gpu
def test_dense_linear_hands_verify_sizes_to_gmma(dg, ref, monkeypatch):
    """runtime.dense_kernels.linear (kernel="auto") routes M >= 9 here, and decode sizes of weights >= 16 MB with
    K >= 1024 (and the result is right); other shapes, DDTREE_LINEAR_GMMA=0 (GMMA_ENABLED) and explicit kernels
    stay."""
    import runtime.dense_kernels as dk
    calls = []
    real = dg.launch_gmma
    monkeypatch.setattr(dg, "launch_gmma", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    for M, N, K, kw, routed in [(65, 4096, 1024, {}, True), (9, 4096, 2048, {}, True), (8, 4096, 1024, {}, False),
                                (1, 4096, 2048, {}, True), (4, 40000, 256, {}, False), (2, 40000, 1024, {}, True),
                                (257, 4096, 1024, {}, True), (64, 1000, 1024, {}, True), (65, 960, 576, {}, True),
                                (64, 4096, 1024, {"kernel": "chunked"}, False), (64, 4096, 1024, {}, True)]:
        _, x, w = _data(M, N, K, M + N + K)
        out = poisoned((M, N))
        calls.clear()
        dk.linear(dev_bf16(x), dev_bf16(w), out, **kw)
        assert bool(calls) == routed, (M, N, K, kw)
        assert_close(out.download(), ref.linear(x, w), f"dense_kernels.linear M={M} N={N} K={K}", dtype="bf16",
                     atol=ATOL)
    monkeypatch.setattr(dg, "GMMA_ENABLED", False)
    calls.clear()
    dk.linear(dev_bf16(x), dev_bf16(w), poisoned((M, N)))  # (64, 4096, 1024): routed above when enabled
    assert not calls


_SHORT_SMEM_SCRIPT = r"""
import os, sys, numpy as np
from runtime import cuda
import runtime.dense_gmma as dg
from runtime.cuda import CudaError
push = sys.argv[1] == "push"
cfg = (48, 2, 4, 1, 2, 2) if push else (64, 2, 4, 1, 1, 2)   # (TN, KA, STAGES, RW, CS, NWG)
M, N, K = 33, 256, 1024
smem = dg.gmma_push_smem_bytes(*cfg) if push else dg.gmma_smem_bytes(*cfg[:4], cfg[5])
kern = cuda.get_kernel(dg.FAMILY_PUSH if push else dg.FAMILY, dg.gmma_entry(cfg))
kern.set_max_dynamic_smem(smem)
x, w, out = cuda.empty((M, K), np.uint16), cuda.empty((N, K), np.uint16), cuda.empty((M, N), np.uint16)
for a in (x, w):
    a.fill_bytes(0x3c)
grid = (N // (64 * cfg[3] * cfg[5]), cfg[4], 1)
args = [x, np.int32(K), w, out, np.int32(N), np.uint64(0), np.int32(0), out, out, np.int32(M), np.int32(N),
        np.int32(K), np.int32(K // cfg[4])]
for extra, want_ok in ((0, True), (-16, False)):   # the planned size runs; 16 bytes short traps
    try:
        kern.launch(grid, 128 * cfg[5], args, smem=smem + extra)
        cuda.default_stream().synchronize()
        ok = True
    except CudaError:
        ok = False
    print("launch", smem + extra, "ok" if ok else "trapped", flush=True)
    if ok != want_ok:
        os._exit(1)
os._exit(0)   # no finalizers on the context the trap ended
"""


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["plain", "push"])
def test_linear_gmma_traps_when_shared_memory_is_short(dg, variant):
    """The kernel compares its dynamic shared memory with its own layout (the Python formulas restate it): the
    planned size runs, 16 bytes less traps. In a child process: a trap ends the CUDA context."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", _SHORT_SMEM_SCRIPT, variant], cwd=root, env=dict(os.environ),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert out.stdout.split().count("trapped") == 1, out.stdout


@pytest.mark.gpu
def test_linear_gmma_rejects_bad_shapes(dg):
    from runtime.cuda import empty
    with pytest.raises(ValueError, match="K = 12"):
        dg.linear_gmma(empty((16, 12), np.uint16), empty((8, 12), np.uint16), empty((16, 8), np.uint16))
    with pytest.raises(ValueError, match="no instance"):
        dg.linear_gmma(empty((16, 64), np.uint16), empty((8, 64), np.uint16), empty((16, 8), np.uint16), tn=40)
    with pytest.raises(ValueError, match="cluster split"):
        dg.linear_gmma(empty((16, 64), np.uint16), empty((8, 64), np.uint16), empty((16, 8), np.uint16), cs=2,
                       splits=3)


# ---------------------------------------------------------------- GPU: the narrow-row kernel
@pytest.fixture
def narrow_launches(dg, monkeypatch):
    """The instance names of every launch_narrow call from here on (the calls still run)."""
    entries = []
    real = dg.launch_narrow
    monkeypatch.setattr(dg, "launch_narrow", lambda *a, **k: entries.append(a[-1][0]) or real(*a, **k))
    return entries


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,nw", [
    # N and K tails (N not a multiple of NW; K not of the stage's k), 1..64 token rows over every token tile
    (1, 333, 1000, 32), (1, 989, 4096, 48), (3, 4096, 136, 64), (8, 1000, 1000, 80), (16, 777, 1000, 96),
    (17, 989, 1000, 128), (33, 333, 4096, 192), (64, 1000, 1000, 256), (40, 4096, 12288, 32), (2, 24, 64, 32),
    # two warpgroups (token tile 80): the verify bucket 64's 65 rows, and 80
    (65, 4096, 4096, 48), (65, 989, 1000, 32), (80, 777, 4096, 192), (72, 1000, 1000, 256),
    # more rows than one token tile: blockIdx.z walks tiles of 80
    (100, 333, 1000, 48), (257, 1000, 2048, 32),
])
def test_linear_gmma_narrow(dg, ref, M, N, K, nw):
    _, x, w = _data(M, N, K, M * 7919 + N * 31 + K + nw)
    want = ref.linear(x, w)
    xd, wd = dev_bf16(x), dev_bf16(w)
    for rep in range(2):  # twice: nothing left over from one launch may change the next
        out = poisoned((M, N))
        dg.linear_gmma(xd, wd, out, nw=nw)
        assert_close(out.download(), want, f"linear_gmma narrow nw={nw} M={M} N={N} K={K} (launch {rep})",
                     dtype="bf16", atol=ATOL)


def _narrow_instances():
    from cutlass_kernels.registry import NARROW_GMMA_INSTANCES, NARROW_MC_INSTANCES
    return NARROW_GMMA_INSTANCES + NARROW_MC_INSTANCES


def _narrow_id(cfg):
    return "<%d,%d,%d,%d>" % cfg[:4] + ("", "rmsnorm", "swiglu")[cfg[4]] + (f"cs{cfg[5]}" if len(cfg) == 6 else "")


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", _narrow_instances(), ids=_narrow_id)
def test_linear_gmma_narrow_every_instance(dg, ref, cfg):
    """Every built (NW, TX, prologue) instance at M just over the next smaller token tile, an even N with a tail
    (bf16 pair stores), K with a tail; plain and with a residual. SwiGLU: bit for bit swiglu_kernel then the plain
    narrow kernel. RMSNorm (with and without the residual add, whose bf16 sum must come out exact in sum_out):
    within bf16 tolerance of the float32 oracle (it rounds h * norm_w, not the normalised row: no bit match).
    Cluster instances (x multicast): an odd M (the two blocks of a cluster copy unequal shares), three row blocks (the
    fourth of the last cluster only copies), K's tail never copied (masked in the fragments)."""
    import runtime.dense_kernels as dk
    nw, tx, xmode = cfg[0], cfg[1], cfg[4]
    cs = cfg[5] if len(cfg) == 6 else None
    M, N, K = tx - 7, (2 if cs else 3) * nw + 14, 1000
    rng, x, w = _data(M, N, K, sum(cfg) * 131)
    r = round_bf16(rng.standard_normal((M, N), dtype=np.float32))
    x2 = round_bf16(rng.standard_normal((M, K), dtype=np.float32))
    g = round_bf16(1 + 0.2 * rng.standard_normal(K, dtype=np.float32))
    xd, wd, rd, x2d, gd = dev_bf16(x), dev_bf16(w), dev_bf16(r), dev_bf16(x2), dev_bf16(g)
    runs = {0: [("none", {}, x)],
            2: [("swiglu", {"x2": x2d}, round_bf16(ref.swiglu(x, x2)))],
            1: [("rmsnorm", {"norm_weight": gd}, ref.rmsnorm(x, g, 1e-6)),
                ("rmsnorm", {"norm_weight": gd, "x2": x2d}, ref.rmsnorm(round_bf16(x + x2), g, 1e-6))]}[xmode]
    for prologue, extra, x_eff in runs:
        want = ref.linear(x_eff, w)
        for res in (None, rd):
            out = poisoned((M, N))
            total = poisoned((M, K)) if "x2" in extra and prologue == "rmsnorm" else None
            dg.linear_gmma(xd, wd, out, res, nw=nw, cs=cs, prologue=prologue, eps=1e-6, sum_out=total, **extra)
            what = f"linear_gmma narrow {cfg} {prologue} {sorted(extra)} M={M} N={N} K={K} residual={res is not None}"
            assert_close(out.download(), want + (r if res is not None else 0), what, dtype="bf16", atol=ATOL)
            if total is not None:
                np.testing.assert_array_equal(total.download(), to_bf16(round_bf16(x + x2)), err_msg=what)
            if prologue == "swiglu":  # bit for bit: the unfused swiglu then the plain narrow kernel
                act, plain = poisoned((M, K)), poisoned((M, N))
                dk.swiglu(xd, x2d, act)
                dg.linear_gmma(act, wd, plain, res, nw=nw)
                np.testing.assert_array_equal(out.download(), plain.download(),
                                              err_msg=what + ": fused != swiglu + linear")


@pytest.mark.gpu
def test_dense_linear_fuses_prologues_into_narrow(dg, ref, monkeypatch, cuda_device, narrow_launches):
    """With GMMA_NARROW on, dense_kernels.linear(prologue=...) runs on the narrow kernel where it takes the linear
    (N = 32 x the SM count: up to 32 rows with the second x tile), at decode and verify sizes alike, and the CUDA
    backend's fusion rule agrees."""
    import runtime.dense_kernels as dk
    from runtime.backends.cuda_backend import CudaBackend
    monkeypatch.setattr(dg, "GMMA_NARROW", True)
    monkeypatch.setattr(dg, "NARROW_FUSE", True)
    monkeypatch.setattr(dg, "NARROW_MC", False)
    monkeypatch.setattr(dg, "NARROW_X_PER_W", 2.0)  # the routing, not the measured limit (test_narrow_plan)
    calls = narrow_launches
    N, K = 32 * cuda_device.sm_count, 2048
    assert not dg.narrow_fuses(33, N, K, "swiglu")  # x and up: 66 rows of x per 32 rows of W
    for M in (1, 17, 32):
        rng, x, w = _data(M, N, K, M + 5)
        up = round_bf16(rng.standard_normal((M, K), dtype=np.float32))
        g = round_bf16(1 + 0.2 * rng.standard_normal(K, dtype=np.float32))
        assert dg.narrow_fuses(M, N, K, "swiglu") and dg.narrow_fuses(M, N, K, "rmsnorm")
        for prologue, extra, x_eff in (("swiglu", {"x2": dev_bf16(up)}, round_bf16(ref.swiglu(x, up))),
                                       ("rmsnorm", {"norm_weight": dev_bf16(g)}, ref.rmsnorm(x, g, 1e-5))):
            calls.clear()
            out = poisoned((M, N))
            dk.linear(dev_bf16(x), dev_bf16(w), out, prologue=prologue, eps=1e-5, **extra)
            assert calls and "linear_gmma_narrow_kernel" in calls[0], (M, prologue, calls)
            assert_close(out.download(), ref.linear(x_eff, w), f"fused {prologue} on narrow, M={M}", dtype="bf16",
                         atol=ATOL)
    # the backend's rule: fuse where the narrow kernel takes the linear; not where another GMMA plan does (half a
    # wave of 32-row blocks at 17 rows); the gemv's decode sizes where no GMMA plan does (a small weight at 1 row)
    rule = types.SimpleNamespace(fuse=True)
    weight = lambda n, k: types.SimpleNamespace(shape=(n, k))  # noqa: E731 (the rule reads only the shape)
    assert CudaBackend._fuses(rule, 17, weight(N, K), "swiglu")
    assert not CudaBackend._fuses(rule, 17, weight(N // 2, K), "swiglu")
    assert CudaBackend._fuses(rule, 1, weight(576, 1536), "swiglu")
    monkeypatch.setattr(dg, "GMMA_NARROW", False)
    assert not CudaBackend._fuses(rule, 17, weight(N, K), "swiglu")


@pytest.mark.gpu
@pytest.mark.parametrize("cs", [1, 2], ids=["one_block", "cluster"])
def test_linear_gmma_narrow_chain_and_graph(dg, ref, cs):
    """Back-to-back narrow launches with PDL (the second reads what the first writes and overwrites the first's
    input; the first, with cs = 2, in clusters that multicast x), eagerly and captured in a graph replayed with new
    inputs."""
    from runtime.cuda import Stream, capture
    rng = np.random.default_rng(23)
    M, N, K = 17, 1536, 2048
    stream = Stream()
    xd, w1d, w2d, y = poisoned((M, K)), poisoned((N, K)), poisoned((K, N)), poisoned((M, N))

    def record():
        dg.linear_gmma(xd, w1d, y, nw=48, cs=cs, stream=stream)  # y = x @ w1^T
        dg.linear_gmma(y, w2d, xd, nw=32, stream=stream)  # x <- y @ w2^T (overwrites the input)

    def check(run):
        x = round_bf16(rng.standard_normal((M, K), dtype=np.float32))
        w1 = round_bf16(rng.standard_normal((N, K), dtype=np.float32) / np.sqrt(K))
        w2 = round_bf16(rng.standard_normal((K, N), dtype=np.float32) / np.sqrt(N))
        for d, a in ((xd, x), (w1d, w1), (w2d, w2)):
            d.upload(to_bf16(a))
        y.fill_bytes(0xFF, stream=stream)
        stream.synchronize()
        run()
        stream.synchronize()
        y_got = y.download()
        assert_close(y_got, ref.linear(x, w1), "narrow chain step 1", dtype="bf16", atol=ATOL)
        assert_close(xd.download(), ref.linear(from_bf16(y_got), w2), "narrow chain step 2", dtype="bf16",
                     atol=ATOL)

    check(record)
    with capture(stream) as g:
        record()
    graph = g.instantiate()
    for _ in range(2):
        check(lambda: graph.launch(stream))


@pytest.mark.gpu
def test_dense_linear_hands_decode_sizes_to_narrow(dg, ref, monkeypatch, cuda_device, narrow_launches):
    """With GMMA_NARROW on, runtime.dense_kernels.linear runs the narrow kernel where narrow_plan has a plan (N =
    32 x the SM count: one full wave of 32-row blocks, up to 64 rows; twice that N: 64-row blocks, up to 80 rows),
    and the planned kernel elsewhere; forcing a plan of the other kernel (splits) keeps that kernel. With the
    measured limits: only where linear_gmma_kernel's plan leaves SMs idle (NARROW_GMMA_IDLE)."""
    import runtime.dense_kernels as dk
    monkeypatch.setattr(dg, "GMMA_NARROW", True)
    monkeypatch.setattr(dg, "NARROW_MAX_BYTES_PER_SM", None)   # whatever this device's memory rate per SM
    calls = narrow_launches
    sms = cuda_device.sm_count
    for M, N, K in ((1, 32 * sms, 4096), (1, 192 * (sms - 4), 4096), (17, 48 * (sms - 4), 4096)):
        grid = dg.gmma_plan(M, N, K, sms, cluster_slots=dg.device_cluster_slots)[1]
        routed = grid[0] * grid[1] * grid[2] < dg.NARROW_GMMA_IDLE * sms and dg.narrow_plan(M, N, K, sms) is not None
        _, x, w = _data(M, N, K, M + N)
        out = poisoned((M, N))
        calls.clear()
        dk.linear(dev_bf16(x), dev_bf16(w), out)
        assert bool(calls) == routed, (M, N, K, grid, calls)
        assert_close(out.download(), ref.linear(x, w), f"dense_kernels.linear narrow={routed} M={M} N={N}",
                     dtype="bf16", atol=ATOL)
    monkeypatch.setattr(dg, "NARROW_X_PER_W", 2.0)  # the routing mechanics, not the measured limits
    monkeypatch.setattr(dg, "NARROW_GMMA_IDLE", 2.0)
    monkeypatch.setattr(dg, "NARROW_MC", False)
    n_full = 32 * cuda_device.sm_count
    for M, N, K, kw, routed in [(1, n_full, 4096, {}, True), (17, n_full, 2048, {}, True),
                                (64, n_full, 2048, {}, True), (65, n_full, 2048, {}, False),  # x > 2 x W a block
                                (65, 2 * n_full, 2048, {}, True), (81, 2 * n_full, 2048, {}, False),
                                (17, n_full // 2, 2048, {}, False),
                                (17, n_full, 2048, {"splits": 2}, False)]:
        _, x, w = _data(M, N, K, M + N + K)
        out = poisoned((M, N))
        calls.clear()
        dk.linear(dev_bf16(x), dev_bf16(w), out, **kw)
        assert bool(calls) == routed, (M, N, K, kw, calls)
        assert_close(out.download(), ref.linear(x, w), f"dense_kernels.linear narrow={routed} M={M} N={N}",
                     dtype="bf16", atol=ATOL)


@pytest.mark.gpu
def test_linear_gmma_narrow_rejects(dg):
    from runtime.cuda import empty
    x, w, out = empty((16, 64), np.uint16), empty((8, 64), np.uint16), empty((16, 8), np.uint16)
    with pytest.raises(ValueError, match="NW = 40"):
        dg.linear_gmma(x, w, out, nw=40)
    with pytest.raises(ValueError, match="takes none of"):
        dg.linear_gmma(x, w, out, nw=32, splits=2)
    with pytest.raises(ValueError, match="no narrow-row plan"):
        dg.linear_gmma(x, w, out, nw="auto")  # 8 rows of W: no full wave


# ---------------------------------------------------------------- CPU


def test_push_family_covers_the_cluster_instances():
    """dense_gmma may launch any CS > 1 plan from the push family (GMMA_PUSH_MAX_TN): it must hold them all."""
    from cutlass_kernels.registry import DENSE_GMMA_INSTANCES, FAMILIES, gmma_entry
    from runtime.dense_gmma import FAMILY_PUSH
    assert set(FAMILIES[FAMILY_PUSH].entries) == {gmma_entry(c) for c in DENSE_GMMA_INSTANCES if c[4] > 1}
    assert "-DGMMA_PUSH=1" in FAMILIES[FAMILY_PUSH].options


def test_push_epilogue_layout():
    """GMMA_PUSH's exchange (dense_linear_sm90.cu, expression for expression) on every cluster instance and every
    count of live 8-token groups: rank r owns groups [r L / CS, (r + 1) L / CS); sender q writes its float4 of
    thread i for group j of rank r at r's byte kRecvOff + (q - (q > r)) * kSlotBytes + ((j - first) * kThreads + i)
    * 16, and r reads the same place for (q, j, i) (slot q - (q > r) holds sender q). Every group is owned once,
    every byte a receiver reads is written once and is what its gather barrier expects (within an mbarrier's tx-count
    range), the slots lie past the ring and the epilogue staging (the receiver still streams while they land) and
    within the shared memory dense_gmma launches the push family with; only exchanges that do not fit keep the DSMEM
    epilogue."""
    from cutlass_kernels.registry import DENSE_GMMA_INSTANCES
    from runtime.dense_gmma import SMEM_PER_BLOCK_MAX, gmma_push_smem_bytes
    kept_dsmem = []
    for tn, ka, stages, rw, cs, nwg in (c for c in DENSE_GMMA_INSTANCES if c[4] > 1):
        threads, groups = 128 * nwg, tn // 8
        slot_bytes = (groups + cs - 1) // cs * threads * 16
        recv_off = max(stages * ka * (8192 * nwg * rw + tn * 128), tn * (64 * nwg + 4) * 4)
        fits = rw == 1 and 1024 + recv_off + (cs - 1) * slot_bytes <= 227 * 1024
        smem = gmma_push_smem_bytes(tn, ka, stages, rw, cs, nwg)
        assert (smem is not None) == fits
        if not fits:
            kept_dsmem.append((tn, ka, stages, rw, cs, nwg))
            continue
        assert smem == 1024 + recv_off + (cs - 1) * slot_bytes <= SMEM_PER_BLOCK_MAX
        tid = np.arange(threads)
        for live in range(1, groups + 1):  # min(TN / 8, ceil(live rows / 8))
            owner = np.full(groups, -1)
            for r in range(cs):
                g_lo, g_hi = r * live // cs, (r + 1) * live // cs
                assert (owner[g_lo:g_hi] == -1).all()
                owner[g_lo:g_hi] = r
                written = np.zeros((cs - 1) * slot_bytes // 16, np.int32)
                for q in range(cs):  # the sender's loop
                    if q == r:
                        continue
                    for j in range(g_lo, g_hi):
                        write = (q - (q > r)) * slot_bytes + ((j - g_lo) * threads + tid) * 16  # sender q's
                        read = ((q - (q > r)) * (slot_bytes // 16) + (j - g_lo) * threads + tid) * 16  # receiver's
                        assert np.array_equal(write, read)
                        np.add.at(written, write // 16, 1)
                expected = (cs - 1) * (g_hi - g_lo) * threads * 16  # the receiver's expect_tx
                assert written.sum() * 16 == expected < 1 << 20 and written.max(initial=0) <= 1
            assert (owner[:live] >= 0).all(), (tn, cs, live)
    assert kept_dsmem == [(136, 1, 6, 1, 2, 2), (256, 1, 4, 1, 2, 2), (72, 2, 4, 1, 4, 2), (128, 1, 6, 1, 4, 2),
                          (256, 1, 4, 1, 4, 2), (72, 1, 6, 1, 2, 3)], kept_dsmem


def test_plan_covers_every_shape():
    from runtime.dense_gmma import (GMMA_INSTANCES, SMEM_PER_BLOCK_MAX, gmma_config, gmma_plan, gmma_smem_bytes,
                                    token_tile)
    for tn, ka, st, rw, _, nwg in GMMA_INSTANCES:
        assert gmma_smem_bytes(tn, ka, st, rw, nwg) <= SMEM_PER_BLOCK_MAX
    # H200 / H100 SXM (132 SMs), H100 PCIe (114), H20 (78), and a larger part (144)
    for sms, M, (N, K) in itertools.product(
        (132, 114, 78, 144), (9, 16, 17, 33, 64, 65, 72, 100, 129, 256, 257, 300, 513, 1000, 1025),
        ((111, 64), (333, 136), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096))):
        entry, grid, kps, smem = gmma_plan(M, N, K, sms)
        cfg = gmma_config(entry)
        tn, ka, st, rw, cs, nwg = cfg
        assert cfg in GMMA_INSTANCES
        blocks = grid[0] * grid[2]
        assert nwg == 2 or (nwg == 3 and grid[1] == 1 and 0.9 * sms <= blocks <= sms) or (
            nwg == 3 and grid[1] == 1 and tn in (136, 192) and blocks >= 0.7 * sms) or (
            nwg == 1 and grid[1] == cs == 2 and 0.9 * sms <= 2 * blocks <= sms), (sms, M, N, K, entry, grid)
        assert tn == token_tile(M) and (tn >= M if M <= 256 else grid[2] == -(-M // 256)), (M, tn)
        assert grid[0] * 64 * nwg * rw >= N and grid[2] * tn >= M
        assert kps % (64 * ka) == 0 and grid[1] * kps >= K
        assert grid[1] == cs if cs > 1 else (grid[1] - 1) * kps < K  # workspace splits: none empty
        assert smem == gmma_smem_bytes(tn, ka, st, rw, nwg)


def test_family_builds_for_sm90a_with_hgmma():
    from cutlass_kernels.registry import FAMILIES
    from runtime.cuda import compile_family, nvrtc
    fam = FAMILIES["dense_linear_sm90"]
    assert fam.archs == ("90a",) and fam.pdl
    mod = compile_family("dense_linear_sm90", "90a")
    assert set(mod.lowered) == set(fam.entries)
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16", mod.ptx)
    assert "griddepcontrol.wait" in mod.ptx
    if nvrtc.find_disassembler() is None:
        pytest.skip("no nvdisasm/cuobjdump: the PTX check ran instead")
    sass = mod.sass()
    assert re.search(r"HGMMA\.64x\d+x16\.F32\.BF16", sass)
    for body in re.split(r"\n\s*\.text\.", sass)[1:]:  # per kernel: at most the ticket pointer spilled once
        assert len(re.findall(r"\bSTL", body)) <= 1, f"register spills in {body.split(':')[0]}"


def test_gmma_wanted_range(monkeypatch):
    import runtime.dense_gmma as dg
    monkeypatch.setattr(dg, "gmma_available", lambda arch=None: True)
    monkeypatch.setattr(dg, "GMMA_ENABLED", True)
    assert dg.gmma_wanted(9, 4096, 1024) and dg.gmma_wanted(256, 151936, 4096) and dg.gmma_wanted(72, 6144, 4096)
    assert not dg.gmma_wanted(8, 4096, 1024) and dg.gmma_wanted(1025, 4096, 4096)
    assert dg.gmma_wanted(65, 960, 576) and dg.gmma_wanted(17, 576, 1536)  # SmolLM2 verify sizes too
    monkeypatch.setattr(dg, "gmma_available", lambda arch=None: False)
    assert not dg.gmma_wanted(64, 4096, 4096)
    monkeypatch.setattr(dg, "gmma_available", lambda arch=None: True)
    monkeypatch.setattr(dg, "GMMA_ENABLED", False)
    assert not dg.gmma_wanted(64, 4096, 4096)
    monkeypatch.setattr(dg, "GMMA_ENABLED", True)
    # decode sizes: weights of >= 16 MB with K >= 1024 (Qwen3-8B's projections and lm_head), not SmolLM2's
    assert dg.gmma_wanted(1, 4096, 4096) and dg.gmma_wanted(8, 24576, 4096) and dg.gmma_wanted(1, 4096, 12288)
    assert dg.gmma_wanted(1, 151936, 4096) and not dg.gmma_wanted(1, 3072, 576) and not dg.gmma_wanted(1, 4096, 1024)
    assert not dg.gmma_wanted(1, 49152, 576) and not dg.gmma_wanted(0, 4096, 4096)
    monkeypatch.setattr(dg, "GMMA_DECODE", False)
    assert not dg.gmma_wanted(1, 4096, 4096) and not dg.gmma_wanted(8, 24576, 4096) and dg.gmma_wanted(9, 4096, 4096)


def test_plan_picks_the_measured_best():
    """The H200 winners of tools/bench_dense.py --gmma (2026-12-02 run 3, 2026-12-03) and of the whole
    Qwen3-8B-shaped verify step (tools/bench_verify.py, 2026-12-03 run 19: clusters of 3 for o and down took
    b64 from 6391 to 5934 us, b16 from 5118 to 4996): Qwen3-8B: a cluster split of 2 for qkv and gate_up at
    every M, of 3 for o and down up to 72 rows (2 above: no CS = 3 instance), up (12288 rows) and lm_head
    unsplit; gate_up unsplit in three-warpgroup blocks up to 72 rows (2026-12-03 (3) run 1: M = 17 49.7 vs
    53.8 us, M = 65 53.2 vs 58.5), a cluster split of 2 above; SmolLM2-135M at the verify sizes: clusters
    of 4 for its small grids, lm_head unsplit. Session 19: o and down at token tiles 48 and 72 (M = 33..48,
    65..72) in one-warpgroup blocks, clusters of 2 (128 blocks)."""
    from runtime.dense_gmma import gmma_config, gmma_plan
    one_wg = {33: 2, 48: 2, 65: 2, 72: 2}
    for N, K, want in [(6144, 4096, {m: 2 for m in (16, 64, 72, 128, 256)}),
                       (4096, 4096, {16: 3, 17: 3, 64: 3, 128: 2, 256: 2, **one_wg}),
                       (4096, 12288, {16: 3, 17: 3, 64: 3, 128: 2, 256: 2, **one_wg}),
                       (24576, 4096, {16: 1, 17: 1, 64: 1, 65: 1, 72: 1, 128: 2, 256: 2}),
                       (12288, 4096, {17: 1, 65: 1}),
                       (151936, 4096, {16: 1, 64: 1, 65: 1, 256: 1}),
                       (960, 576, {17: 4, 65: 4}), (576, 576, {17: 4, 65: 4}), (576, 1536, {17: 4, 65: 4}),
                       (49152, 576, {17: 1, 65: 1})]:
        for M, splits in want.items():
            entry, grid, _, _ = gmma_plan(M, N, K, 132)
            assert grid[1] == splits and (splits == 1 or gmma_config(entry)[4] == splits), (N, K, M, entry, grid)
            nwg = 3 if N == 24576 and M <= 72 else 1 if N == 4096 and M in one_wg else 2
            assert gmma_config(entry)[5] == nwg, (N, K, M, entry)


def test_three_warpgroup_plans():
    """nwg=3 (192-row blocks, cuBLAS's one-wave shape for 24576x4096): planned unforced only where the
    unsplit blocks fill one wave to >= 90% (128 of 132 SMs: yes; on 144 SMs: no), two warpgroups when any
    other knob is forced, and never a workspace split (the kernel traps on one)."""
    from runtime.dense_gmma import GMMA_INSTANCES, gmma_config, gmma_plan
    entry, grid, kps, _ = gmma_plan(65, 24576, 4096, 132)
    assert gmma_config(entry) == (72, 1, 6, 1, 1, 3) and grid == (128, 1, 1) and kps == 4096
    assert gmma_config(gmma_plan(17, 24576, 4096, 132, nwg=3)[0]) in GMMA_INSTANCES
    for M in (9, 17, 65, 72):
        assert gmma_config(gmma_plan(M, 24576, 4096, 132)[0])[5] == 3
        assert gmma_config(gmma_plan(M, 24576, 4096, 144)[0])[5] == 2  # 128 blocks on 144 SMs: 89%
        assert gmma_config(gmma_plan(M, 24576, 4096, 127)[0])[5] == 2  # two waves
        assert gmma_config(gmma_plan(M, 24576, 4096, 132, cs=2)[0])[5] == 2
    # the many-token tiles 136 / 192 (session 20): wherever unsplit 192-row blocks fill their waves to 70%
    for M, N, nwg in ((129, 24576, 3), (257, 24576, 3), (513, 24576, 3), (129, 151936, 3), (513, 6144, 3),
                      (257, 6144, 2), (513, 4096, 2), (1025, 24576, 2), (129, 152 * 192, 2)):
        entry, grid, _, _ = gmma_plan(M, N, 4096, 132)
        assert gmma_config(entry)[5] == nwg, (M, N, entry)
        assert nwg == 2 or grid[1] == 1
    with pytest.raises(ValueError, match="only inside a cluster"):
        gmma_plan(65, 24576, 4096, 132, nwg=3, splits=3)


def test_gmma_trigger_option(monkeypatch):
    """DDTREE_GMMA_TRIGGER picks where the GMMA linear lets the next kernel launch (the NVRTC option); a bad value
    is a ValueError naming the choices."""
    from cutlass_kernels import registry
    for value, want in (("start", 1), ("epilogue", 0)):
        monkeypatch.setenv("DDTREE_GMMA_TRIGGER", value)
        assert registry._gmma_trigger() == want
    monkeypatch.delenv("DDTREE_GMMA_TRIGGER")
    assert registry._gmma_trigger() == 1
    # the family is built with the value the environment held at import
    assert set(registry.FAMILIES["dense_linear_sm90"].options) & {"-DGMMA_EARLY_TRIGGER=0", "-DGMMA_EARLY_TRIGGER=1"}
    monkeypatch.setenv("DDTREE_GMMA_TRIGGER", "early")
    with pytest.raises(ValueError, match="use start or epilogue"):
        registry._gmma_trigger()


def test_narrow_plan(monkeypatch):
    """The narrow-row plan: the smallest NW whose unsplit blocks fit one wave, where they fill it to >= 90%; the
    token tile is the smallest >= M; shared memory within a block's; no plan past 80 rows (unless NW is forced)
    or where no NW fills a wave."""
    from cutlass_kernels.registry import NARROW_GMMA_INSTANCES
    from cutlass_kernels.registry import NARROW_MC_INSTANCES, NARROW_MC_ROWS
    from runtime.dense_gmma import NARROW_X_PER_W, SMEM_PER_BLOCK_MAX, narrow_plan, narrow_smem_bytes
    monkeypatch.setattr("runtime.dense_gmma.NARROW_MC", True)  # clusters past the one-block x limit (off by default)
    for cfg in NARROW_GMMA_INSTANCES + NARROW_MC_INSTANCES:
        nw, tx, ka, stages = cfg[:4]
        assert narrow_smem_bytes(*cfg) <= SMEM_PER_BLOCK_MAX and 3 <= stages <= 12
        assert ka * nw * 128 <= 16384 or ka == 1
    qwen3 = {"qkv": (6144, 4096, 48), "o": (4096, 4096, 32), "gate_up": (24576, 4096, 192), "down": (4096, 12288, 32)}
    for name, (N, K, nw) in qwen3.items():
        for M, tx in ((1, 16), (16, 16), (17, 32), (33, 64), (64, 64), (65, 80)):
            plan = narrow_plan(M, N, K, 132)
            kernel = "linear_gmma_narrow_kernel"
            if M > NARROW_X_PER_W * nw:  # more x rows per block than the plan takes: clusters of 2 that share x
                if M > 2 * NARROW_X_PER_W * nw or nw not in NARROW_MC_ROWS:
                    assert plan is None, (name, M)
                    continue
                kernel = "linear_gmma_narrow_mc_kernel"
                assert plan[0].endswith(", 0, 2>"), plan
            entry, grid, smem = plan
            assert entry.startswith(f"{kernel}<{nw}, {tx}, "), (name, M, entry)
            assert grid == (-(-N // nw), 1, 1) and 0.9 * 132 <= grid[0] <= 132, (name, M, grid)
            with pytest.MonkeyPatch.context() as off:  # DDTREE_NARROW_MC=0: none past the one-block limit
                off.setattr("runtime.dense_gmma.NARROW_MC", False)
                assert (narrow_plan(M, N, K, 132) is None) == (kernel != "linear_gmma_narrow_kernel")
        # x and x2 (the residual, SwiGLU's up) count twice
        plan = narrow_plan(17, N, K, 132, prologue="swiglu")
        if 34 <= NARROW_X_PER_W * nw:
            assert plan[0].startswith("linear_gmma_narrow_kernel<") and plan[0].endswith(", 2>")
        elif 34 <= 2 * NARROW_X_PER_W * nw:
            assert plan[0].startswith("linear_gmma_narrow_mc_kernel<") and plan[0].endswith(", 2, 2>")
        else:
            assert plan is None
        assert narrow_plan(81, N, K, 132) is None
        assert narrow_plan(81, N, K, 132, nw=nw)[1] == (-(-N // nw), 1, 2)
    assert narrow_plan(1, 151936, 4096, 132) is None  # lm_head: no NW <= 256 fits one wave
    assert narrow_plan(1, 1024, 4096, 132) is None    # 32 blocks of 32 rows: a quarter of the SMs
    assert narrow_plan(1, 6144, 4096, 114) is None    # H100 PCIe: 96 blocks of 64 rows fill 84% of 114 SMs
    assert narrow_plan(1, 6144, 4096, 78)[0].startswith("linear_gmma_narrow_kernel<80, 16, ")  # H20: 77 blocks
    with pytest.raises(ValueError, match="NW = 40"):
        narrow_plan(1, 4096, 4096, 132, nw=40)
    for prologue, xmode in (("swiglu", 2), ("rmsnorm", 1)):  # the prologue's own instance, same row block
        entry = narrow_plan(1, 4096, 12288, 132, prologue=prologue)[0]
        assert entry.startswith("linear_gmma_narrow_kernel<32, 16, ") and entry.endswith(f", {xmode}>")
    with pytest.raises(ValueError, match="prologue 'gelu'"):
        narrow_plan(1, 4096, 4096, 132, prologue="gelu")
    # a forced cluster: grid x rounded up to whole clusters (the extra block only copies its share of x)
    entry, grid, _ = narrow_plan(65, 4096 - 32, 4096, 132, nw=32, cs=2)
    assert entry.startswith("linear_gmma_narrow_mc_kernel<32, 80, ") and grid == (128, 1, 1)
    with pytest.raises(ValueError, match="cs = 3"):
        narrow_plan(1, 4096, 4096, 132, nw=32, cs=3)
    with pytest.raises(ValueError, match="in clusters of 2"):
        narrow_plan(1, 24576, 4096, 132, nw=192, cs=2)
    # every block of a cluster copies x rows: M = 1, or a last token tile of one row, has none for the second
    for M in (1, 81):
        with pytest.raises(ValueError, match="clusters of 2 need >= 2"):
            narrow_plan(M, 4096, 4096, 132, nw=32, cs=2)
    assert narrow_plan(82, 4096, 4096, 132, nw=32, cs=2)[1] == (128, 1, 2)


def test_narrow_instead_by_memory_rate_per_sm(monkeypatch):
    """An unforced linear takes the narrow kernel instead of linear_gmma_kernel's plan only where that plan leaves
    SMs idle and the device's peak memory rate per SM is at most NARROW_MAX_BYTES_PER_SM (the H100's 3.35 TB/s on 132
    SMs, not the H200's 4.9 TB/s); an unreported rate (0) counts as slow; None takes it on any device."""
    from runtime import dense_gmma as dg
    monkeypatch.setattr(dg, "GMMA_NARROW", True)
    monkeypatch.setattr(dg, "NARROW_MAX_BYTES_PER_SM", 30e9)
    qkv = (1, 6144, 4096, 132, (48, 2, 1))   # Qwen3-8B qkv at one row: 96 GMMA blocks on 132 SMs
    h100, h200 = 2 * 2619e6 * 5120 / 8, 2 * 3201e6 * 6144 / 8
    assert dg.narrow_instead(*qkv, h100) == dg.narrow_plan(1, 6144, 4096, 132) is not None
    assert dg.narrow_instead(*qkv, 0.0) is not None
    assert dg.narrow_instead(*qkv, h200) is None
    assert dg.narrow_instead(1, 6144, 4096, 132, (66, 2, 1), h100) is None   # the GMMA plan fills the SMs
    monkeypatch.setattr(dg, "NARROW_MAX_BYTES_PER_SM", None)
    assert dg.narrow_instead(*qkv, h200) is not None
    monkeypatch.setattr(dg, "GMMA_NARROW", False)
    assert dg.narrow_instead(*qkv, h100) is None


def test_narrow_launch_arguments_match_the_kernel(monkeypatch):
    """launch_narrow's argument list against the sm_90a PTX signature of the instance it plans, with and without
    each prologue's operands (no GPU)."""
    import runtime.dense_gmma as dg
    from cutlass_kernels.registry import NARROW_FAMILIES, NARROW_MC_FAMILY
    from fake_cuda import ptx_param_sizes
    from runtime.cuda import DeviceArray
    from runtime.cuda.kernel import check_arguments

    launched = []

    class _Stub:
        def set_max_dynamic_smem(self, n):
            pass

        def launch(self, grid, block, args, smem=0, stream=None):
            launched.append((grid, block, args, smem))

    monkeypatch.setattr(dg, "get_kernel", lambda family, entry: launched.append((family, entry)) or _Stub())
    M, N, K = 13, 6144, 4096  # x and x2 within the plan's NARROW_X_PER_W of qkv's 48 rows
    x, w, out, x2, nw, s = (DeviceArray(0x10000 * (i + 1), shape, np.uint16) for i, shape in enumerate(
        ((M, K), (N, K), (M, N), (M, K), (K,), (M, K))))
    cases = [(p, e, cs) for p, e in (("none", {}), ("swiglu", {"x2": x2}), ("rmsnorm", {"norm_weight": nw}),
                                      ("rmsnorm", {"norm_weight": nw, "x2": x2, "sum_out": s})) for cs in (1, 2)]
    for prologue, extra, cs in cases:
        plan = dg.narrow_plan(M, N, K, 132, nw=48, prologue=prologue, cs=cs)
        for residual in (None, DeviceArray(0x200000, (M, N), np.uint16)):
            launched.clear()
            dg.launch_narrow(x, w, out, residual, M, N, K, K, N, N if residual is not None else None, plan, **extra)
            (family, entry), (grid, block, args, smem) = launched
            want_family = NARROW_FAMILIES[prologue] if cs == 1 else NARROW_MC_FAMILY
            assert (family, entry, grid, block, smem) == (want_family, plan[0], plan[1], 128, plan[2])

            class _K:
                param_sizes = ptx_param_sizes(family, entry)
                function, pdl, checked_types = None, True, set()

            check_arguments(_K(), args)


@pytest.mark.parametrize("nw,tx,xmode,cs", [(48, 16, 0, 1), (32, 80, 0, 1), (192, 32, 0, 1), (48, 16, 1, 1),
                                            (32, 80, 1, 1), (64, 32, 2, 1), (48, 80, 2, 1),
                                            (48, 64, 0, 2), (32, 80, 1, 2), (32, 16, 2, 2)])
def test_narrow_kernel_emulated(nw, tx, xmode, cs):
    """tests/narrow_emulation.py replays the kernel's copies, prologue, ldmatrix and swizzled B reads on the CPU for
    a registered instance (its KA, STAGES and stage size), from NaN-filled shared memory: every output within bf16
    tolerance of the float32 oracle (so no read of an unwritten byte, no misplaced chunk); the residual sum exact.
    Two row blocks with an N tail, K with a tail of 8, M just over the next smaller tile (and over the tile: z).
    cs = 2: the cluster kernel's row-per-thread bulk copies into the unswizzled pitched tile, its k tail left stale
    (NaN here) and masked in the fragments."""
    from narrow_emulation import emulate_narrow
    from cutlass_kernels.registry import NARROW_GMMA_INSTANCES, NARROW_MC_INSTANCES, narrow_stage_bytes
    from runtime.backends.numpy_backend import NumpyBackend
    ref = NumpyBackend()
    cfg = next(c for c in NARROW_GMMA_INSTANCES + NARROW_MC_INSTANCES
               if (c[0], c[1], c[4], c[5] if len(c) == 6 else 1) == (nw, tx, xmode, cs))
    for M in ((tx - 7,) if xmode else (tx - 7, tx + 3)):
        N, K = nw + 14, 200
        rng, x, w = _data(M, N, K, nw + tx + xmode + M)
        x2 = round_bf16(rng.standard_normal((M, K), dtype=np.float32))
        g = round_bf16(1 + 0.2 * rng.standard_normal(K, dtype=np.float32))
        r = round_bf16(rng.standard_normal((M, N), dtype=np.float32))
        stage = narrow_stage_bytes(nw, tx, cfg[2], xmode, cs)
        if xmode == 0:
            runs = [({}, x)]
        elif xmode == 2:
            runs = [({"x2": x2}, round_bf16(ref.swiglu(x, x2)))]
        else:
            runs = [({"norm_w": g}, ref.rmsnorm(x, g, 1e-6)), ({"norm_w": g, "x2": x2},
                                                                ref.rmsnorm(round_bf16(x + x2), g, 1e-6))]
        for extra, x_eff in runs:
            got, total = emulate_narrow(x, w, cfg, stage, residual=r, eps=1e-6, **extra)
            assert_close(to_bf16(got), ref.linear(x_eff, w) + r, f"emulated {cfg} M={M} {sorted(extra)}",
                         dtype="bf16", atol=ATOL)
            if total is not None:
                np.testing.assert_array_equal(total, round_bf16(x + x2))


def test_narrow_a_fragments_emulated():
    """dense_linear_narrow_sm90.cu's x path in numpy: rows written into the 128-byte-swizzled tile as load_x does
    (chunk c of row r at chunk c ^ (r % 8)), read back by ldmatrix.x4 with the lane addresses the kernel computes;
    every thread must get the wgmma / mma.sync m16k16 A fragment of its warp's 16 rows (register c: row g + 8 (c % 2),
    k 16 j + 2 t + 8 (c / 2) and the next; g = lane / 4, t = lane % 4), for each k16 step j and warp."""
    TX = 80
    x = np.arange(TX * 64, dtype=np.int32).reshape(TX, 64)  # x[r, k] = 64 r + k: every element distinct
    tile = np.zeros(TX * 64, np.int32)                       # the tile in 2-byte elements
    for r in range(TX):
        for c in range(8):
            pos = (r * 128 + ((c ^ (r & 7)) << 4)) // 2
            tile[pos:pos + 8] = x[r, 8 * c:8 * c + 8]
    for warp in range(TX // 16):
        for j in range(4):
            rows = []  # the 16-byte row each lane points ldmatrix at
            for lane in range(32):
                lm_row = 16 * warp + 8 * ((lane >> 3) & 1) + (lane & 7)
                addr = lm_row * 128 + ((((2 * j + (lane >> 4)) ^ (lm_row & 7))) << 4)
                rows.append(tile[addr // 2:addr // 2 + 8])
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for c in range(4):
                    got = rows[8 * c + g][2 * t:2 * t + 2]            # matrix c, row g, elements 2t, 2t + 1
                    m, k = 16 * warp + g + 8 * (c & 1), 16 * j + 2 * t + 8 * (c >> 1)
                    assert list(got) == [x[m, k], x[m, k + 1]], (warp, j, lane, c)


def test_trace_words_match_the_kernel():
    """tools/bench_w_tiles.py reads GMMA_TRACE's stamps as registry.TRACE_WORDS u64 per block: the kernel's stride."""
    from pathlib import Path
    from cutlass_kernels.registry import TRACE_WORDS
    src = (Path(__file__).resolve().parents[1] / "cutlass_kernels" / "dense_linear_sm90.cu").read_text()
    assert int(re.search(r"constexpr int kTraceWords = (\d+);", src).group(1)) == TRACE_WORDS
