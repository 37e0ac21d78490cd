"""The per-warp timeline trace (cutlass_kernels/device_common.cuh DDTREE_TRACE, runtime/cuda/trace.py): codes and
record layout read from the header, the summaries on made-up records, the traced builds on every arch, and (GPU) the
records of a small MoE layer's graph replay, one per warp of every launch."""
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.cuda import trace

KERNELS = Path(__file__).resolve().parents[1] / "cutlass_kernels"


def test_codes_and_layout_from_the_header():
    codes = trace.trace_codes()
    assert codes[44] == "moe_gate_up" and codes[13] == "linear_gmma" and codes[1] == "embedding"
    k = trace.header_constants()
    assert trace.RECORD_DTYPE.itemsize == 8 * k["RecordWords"]
    assert k["HeaderWords"] >= 2 and k["Sms"] >= 148 and k["WarpSlots"] == 64   # B200: 148 SMs; 2048 threads / 32
    # the records start past the header and the whole table (session 35 wrote them at 2 words per slot after the
    # table had grown to 4: records over the table, caught by the GPU test only)
    assert k["RecordsAt"] == k["HeaderWords"] + k["SlotWords"] * k["Sms"] * k["WarpSlots"]
    src = (KERNELS / "device_common.cuh").read_text()
    assert "ddtree_trace_buffer + kTraceRecordsAt +" in src and "static_assert(kTraceRecordsAt ==" in src
    with pytest.raises(ValueError, match="repeat"):
        trace.trace_codes("enum TraceCode : unsigned { kTraceA = 1, kTraceB = 1, };")


def test_every_instrumented_kernel_names_a_code_and_every_code_is_used():
    names = {f"kTrace{''.join(w.title() for w in n.split('_'))}" for n in trace.trace_codes().values()}
    used = set()
    for src in sorted(KERNELS.glob("*.cu")):
        text = src.read_text()
        for arg in re.findall(r"DDTREE_TRACE_WARP\(([^;]*)\);", text):
            found = set(re.findall(r"kTrace\w+", arg))
            assert found and found <= names, f"{src.name}: DDTREE_TRACE_WARP({arg}) names no TraceCode"
            used |= found
        # every kernel of a file that traces any: a kernel left out would be a gap in its timelines
        if "DDTREE_TRACE_WARP" in text:
            assert text.count("__global__") == text.count("DDTREE_TRACE_WARP("), src.name
    assert used == names, f"codes no kernel uses: {sorted(names - used)}"


def _records(rows):
    """Records from (start, wait, end, grid, code, sm, block, warp[, stall, cycles]) rows (no stall: 0, 0)."""
    r = np.zeros(len(rows), trace.RECORD_DTYPE)
    for i, row in enumerate(rows):
        r[i] = tuple(row) + (0, 0)[:10 - len(row)]
    return r


def test_stalls_per_warp_of_a_block():
    """Two working blocks of a warp-specialized launch: warp 0 (producer) waits 10% / 30% of its cycles, warp 1
    (consumer) 60% / 80%; three blocks that left at once (no waits, few cycles) do not pull the shares to 0; a
    launch with no stall counts gets no line."""
    rows = [(0, 0, 10, 5, 49, 0, 0, 0, 100, 1000), (0, 0, 10, 5, 49, 0, 0, 1, 600, 1000),
            (0, 0, 10, 5, 49, 1, 1, 0, 300, 1000), (0, 0, 10, 5, 49, 1, 1, 1, 800, 1000),
            *[(0, 0, 1, 5, 49, 2, b, w, 0, 10) for b in (2, 3, 4) for w in (0, 1)],
            (20, 0, 30, 6, 46, 0, 0, 0)]
    traces = trace.launches(_records(rows))
    lines = trace.stalls(traces).splitlines()
    assert len(lines) == 1 and "moe_gmma_ws_gate_up" in lines[0] and lines[0].endswith("0:20% 1:69%")
    assert trace.stalls(traces[1:]) == ""


def test_peak_blocks_per_sm():
    """SM 0: blocks 0 and 1 overlap (two warps each), block 2 comes after them: peak 2. SM 1: block 4 starts the
    nanosecond block 3 ends: peak 1."""
    rows = [(0, 0, 10, 5, 44, 0, 0, 0), (1, 0, 9, 5, 44, 0, 0, 1), (5, 0, 15, 5, 44, 0, 1, 0),
            (6, 0, 14, 5, 44, 0, 1, 1), (20, 0, 30, 5, 44, 0, 2, 0),
            (0, 0, 10, 5, 44, 1, 3, 0), (10, 0, 20, 5, 44, 1, 4, 0)]
    (gate_up,) = trace.launches(_records(rows))
    assert trace.peak_blocks_per_sm(gate_up) == {2: 1, 1: 1}
    assert trace.residency([gate_up]).split()[-2:] == ["2x1", "1x1"]


def test_shared_sm_time():
    """Launch 9 (two blocks on SM 0, 0..10 and 5..15 us, merged; one on SM 1, 0..10) beside launch 8 (SM 0 12..30,
    SM 1 nothing but a block that left at once): 25 SM-us of 9's, 3 of them shared. The 1 us block is not counted."""
    us = 1000
    rows = [(0, 0, 10 * us, 9, 49, 0, 0, 0), (5 * us, 0, 15 * us, 9, 49, 0, 1, 0), (0, 0, 10 * us, 9, 49, 1, 2, 0),
            (12 * us, 0, 30 * us, 8, 44, 0, 0, 0), (0, 0, 1 * us, 8, 44, 1, 1, 0)]
    traces = trace.launches(_records(rows))
    hot = [t for t in traces if t.grid == 9]
    cold = [t for t in traces if t.grid == 8]
    assert trace.shared_sm_time(hot, cold) == (25.0, 3.0)
    assert trace.shared_sm_time(cold, hot) == (18.0, 3.0)
    assert trace.shared_sm_time(hot, cold, min_block_us=0.5) == (25.0, 4.0)


def test_launch_summaries_from_records():
    t0 = 10_000_000
    rows = [  # launch 7 (routing-like: one warp), then launch 9 waiting on it (PDL) on two SMs, then launch 8
        (t0, 0, t0 + 5_000, 7, 42, 3, 0, 0),
        (t0 + 1_000, t0 + 5_500, t0 + 20_000, 9, 44, 0, 0, 0),
        (t0 + 1_200, t0 + 5_600, t0 + 22_000, 9, 44, 0, 0, 1),
        (t0 + 1_300, t0 + 6_000, t0 + 21_000, 9, 44, 1, 1, 0),
        (t0 + 30_000, 0, t0 + 31_000, 8, 46, 2, 0, 0),
    ]
    traces = trace.launches(_records(rows))
    assert [t.name for t in traces] == ["moe_route_one", "moe_gate_up", "moe_combine"]
    route, gate_up, combine = traces
    assert (gate_up.blocks, gate_up.warps, gate_up.sms) == (2, 3, 2)
    assert gate_up.start == pytest.approx(1.0) and gate_up.end == pytest.approx(22.0)
    assert (gate_up.first_wait, gate_up.last_wait) == (pytest.approx(5.5), pytest.approx(6.0))
    assert gate_up.warp_us == pytest.approx(15.0)     # median of 14.5, 16.4, 15.0 (from each warp's wait)
    assert np.isnan(route.first_wait) and route.warp_us == pytest.approx(5.0)
    table = trace.table(traces).splitlines()
    assert len(table) == 4 and "moe_gate_up" in table[2] and table[3].split()[-1] == "8.00"   # combine's gap
    chart = trace.timeline(traces, width=31).splitlines()
    assert len(chart) == 5 and all(len(line) == len(chart[0]) for line in chart[:4])
    gu = chart[1][25:]
    assert gu[0] == " " and gu[1] == "w" and gu[6] != " " and gu[25] == " "   # 1 us a column: waits 1..5.5 us
    assert trace.launches(np.zeros(0, trace.RECORD_DTYPE)) == [] and trace.timeline([]) == ""


def test_trace_buffer_needs_the_traced_build(monkeypatch):
    monkeypatch.setattr(trace, "TRACE_BUILD", False)
    from runtime.cuda import CudaError
    with pytest.raises(CudaError, match="DDTREE_TRACE=1"):
        trace.TraceBuffer()


@pytest.mark.parametrize("family", ["norm_rope", "moe_routing", "moe_int4_sm90"])
def test_traced_build_compiles_on_every_arch(family):
    """The stamps compile wherever the family does (moe_int4_sm90: with the ring-wait counts, sm_90a); the untraced
    build holds none of them."""
    from cutlass_kernels.registry import FAMILIES
    from runtime.cuda import nvrtc
    f = FAMILIES[family]
    if family == "moe_int4_sm90":   # the warp-specialized kernels alone (the ones that count waits; the whole family
        f = dataclasses.replace(f, entries=tuple(e for e in f.entries if "ws_kernel" in e))   # takes minutes)
    traced = dataclasses.replace(f, options=(*f.options, "-DDDTREE_TRACE=1"))
    for arch in f.archs:
        for fam, want in ((f, False), (traced, True)):
            _, ptx, _, _ = nvrtc.nvrtc_compile(fam.source_path.read_text(), fam.source, fam.entries,
                                               nvrtc.build_options(fam, arch), fam.name, arch)
            assert ("%globaltimer" in ptx and "ddtree_trace_buffer" in ptx) == want, (family, arch, want)
            assert ("%clock64" in ptx) == want, (family, arch, want)
    if family == "moe_int4_sm90":   # every span site counted: more clock reads, still compiles
        every = dataclasses.replace(traced, options=(*traced.options, "-DDDTREE_TRACE_STALLS=63"))
        _, ptx_every, _, _ = nvrtc.nvrtc_compile(every.source_path.read_text(), every.source, every.entries,
                                                 nvrtc.build_options(every, "90a"), every.name, "90a")
        assert ptx_every.count("%clock64") > ptx.count("%clock64")


def test_ws_probe_builds(monkeypatch):
    """DDTREE_WS_PROBE reaches NVRTC (and the cache key) for any build, 0 as unset; each probe of moe_gmma_ws_kernel compiles for
    sm_90a and leaves its part out of the PTX (no wgmma with kProbeNoMma, no cp.async with kProbeNoX)."""
    from cutlass_kernels.registry import FAMILIES
    from runtime.cuda import nvrtc
    f = FAMILIES["moe_int4_sm90"]
    f = dataclasses.replace(f, entries=("moe_gmma_ws_kernel<0, 256, 16>",))
    monkeypatch.setattr(nvrtc, "WS_PROBE", 0)
    key = nvrtc.cache_key(f, "90a")
    ptx = {}
    for mask in (0, 1, 2, 4):
        monkeypatch.setattr(nvrtc, "WS_PROBE", mask)
        opts = nvrtc.build_options(f, "90a")
        assert (f"-DDDTREE_WS_PROBE={mask}" in opts) == bool(mask) and (nvrtc.cache_key(f, "90a") == key) != bool(mask)
        _, ptx[mask], _, _ = nvrtc.nvrtc_compile(f.source_path.read_text(), f.source, f.entries, opts, f.name, "90a")
    assert "wgmma.mma_async" in ptx[0] and "wgmma.mma_async" not in ptx[4]
    assert "cp.async.cg.shared" in ptx[0] and "cp.async.cg.shared" not in ptx[2]
    assert ptx[1].count("st.shared.v4") < ptx[0].count("st.shared.v4")
    assert not any("PROBE" in o for o in nvrtc.build_options(FAMILIES["moe_int4"], "90a"))   # its family alone
    monkeypatch.setenv("DDTREE_WS_PROBE", "0")   # "0" is the real kernel: no option, the unset build's cache entry
    monkeypatch.setattr(nvrtc, "WS_PROBE", int(nvrtc._env_mask("DDTREE_WS_PROBE", "") or 0))
    assert nvrtc.cache_key(f, "90a") == key


def _ptx_by_probe(monkeypatch, entry: str, masks) -> dict:
    """mask -> the sm_90a PTX of one moe_int4_sm90 entry built under DDTREE_WS_PROBE = mask."""
    from cutlass_kernels.registry import FAMILIES
    from runtime.cuda import nvrtc
    f = dataclasses.replace(FAMILIES["moe_int4_sm90"], entries=(entry,))
    ptx = {}
    for mask in masks:
        monkeypatch.setattr(nvrtc, "WS_PROBE", mask)
        _, ptx[mask], _, _ = nvrtc.nvrtc_compile(f.source_path.read_text(), f.source, f.entries,
                                                 nvrtc.build_options(f, "90a"), f.name, "90a")
    return ptx


def test_ra_probe_builds(monkeypatch):
    """The register-A probes (DDTREE_WS_PROBE 8 / 16 / 32 / 64) of moe_gmma_kernel's PIPE 8 compile for sm_90a and leave
    their part out of the PTX: no wgmma, no x cp.async (the weights' 16-byte copies stay), fewer global stores, and
    no dequantization's bf16x2 fma; each probe build leaves the others' parts in."""
    ptx = _ptx_by_probe(monkeypatch, "moe_gmma_kernel<1, 32, 8>", (0, 8, 16, 32, 64))
    wgmma, fma = "wgmma.mma_async", "fma.rn.bf16x2"
    stores = {m: ptx[m].count("st.global") for m in ptx}
    assert ptx[0].count(wgmma) and not ptx[32].count(wgmma) and ptx[8].count(wgmma) == ptx[0].count(wgmma)
    assert ptx[0].count(fma) and not ptx[8].count(fma) and ptx[16].count(fma) == ptx[0].count(fma)
    assert 0 < ptx[16].count("cp.async.cg") < ptx[0].count("cp.async.cg")
    assert stores[64] < stores[0] == stores[8] == stores[16] == stores[32]


def test_ra_probe_builds_weight_ring_and_barrier(monkeypatch):
    """The register-A probes 128 (no weight-ring cp.async), 512 / 1024 (no scale / no packed-weight cp.async) and
    256 (no block barrier between stages) of PIPE 20 compile for sm_90a and leave exactly that out of the PTX: 128
    drops the 16- and 4-byte weight copies (the x copies stay), 512 the 4-byte ones, 1024 the 16-byte weight ones,
    256 drops barriers (the copies stay)."""
    ptx = _ptx_by_probe(monkeypatch, "moe_gmma_kernel<1, 256, 20>", (0, 128, 256, 512, 1024))
    copies16 = {m: ptx[m].count("cp.async.cg.shared.global") for m in ptx}
    copies4 = {m: ptx[m].count("cp.async.ca.shared.global") for m in ptx}
    bars = {m: ptx[m].count("bar.sync") + ptx[m].count("barrier.sync") for m in ptx}
    assert 0 < copies16[128] < copies16[0] == copies16[256], copies16   # the x copies stay
    assert copies4[128] < copies4[0] == copies4[256], copies4
    assert copies16[512] == copies16[0] and copies4[512] == copies4[128], (copies16, copies4)
    assert copies16[1024] == copies16[128] and copies4[1024] == copies4[0], (copies16, copies4)
    assert bars[256] < bars[0] == bars[128] == bars[512] == bars[1024], bars
    assert ptx[0].count("wgmma.mma_async") == ptx[128].count("wgmma.mma_async") == ptx[256].count("wgmma.mma_async")


def test_ra_trace_spans():
    """The register-A kernel's traced spans (kStallRaFill = 64, kStallRaEpilogue = 128) each add clock reads to PIPE 8's
    traced build over the default mask (ring waits, which it has none of); sm_90a."""
    from cutlass_kernels.registry import FAMILIES
    from runtime.cuda import nvrtc
    f = dataclasses.replace(FAMILIES["moe_int4_sm90"], entries=("moe_gmma_kernel<1, 32, 8>",))
    clocks = {}
    for mask in (1, 64, 128):
        fam = dataclasses.replace(f, options=(*f.options, "-DDDTREE_TRACE=1", f"-DDDTREE_TRACE_STALLS={mask}"))
        _, ptx, _, _ = nvrtc.nvrtc_compile(fam.source_path.read_text(), fam.source, fam.entries,
                                           nvrtc.build_options(fam, "90a"), fam.name, "90a")
        clocks[mask] = ptx.count("%clock64")
    assert clocks[64] > clocks[1] and clocks[128] > clocks[1], clocks


def test_trace_stalls_option(monkeypatch):
    """DDTREE_TRACE_STALLS reaches NVRTC only with the traced build; the mask is in the cache key through it."""
    from cutlass_kernels.registry import FAMILIES
    from runtime.cuda import nvrtc
    f = FAMILIES["moe_routing"]
    monkeypatch.setattr(nvrtc, "TRACE_BUILD", True)
    monkeypatch.setattr(nvrtc, "TRACE_STALLS", "14")
    assert "-DDDTREE_TRACE_STALLS=14" in nvrtc.build_options(f, "90a")
    key14 = nvrtc.cache_key(f, "90a")
    monkeypatch.setattr(nvrtc, "TRACE_STALLS", "")
    assert not any("STALLS" in o for o in nvrtc.build_options(f, "90a")) and nvrtc.cache_key(f, "90a") != key14
    monkeypatch.setattr(nvrtc, "TRACE_BUILD", False)
    monkeypatch.setattr(nvrtc, "TRACE_STALLS", "14")
    assert not any("TRACE" in o for o in nvrtc.build_options(f, "90a"))


_GPU_SCRIPT = r"""
import json, numpy as np
from runtime import cuda
from runtime.bf16 import to_bf16
from runtime.cuda import trace
from runtime.kimi_kernels import MoeLayer
from tests.test_kimi_kernels import make_moe
rng = np.random.default_rng(5)
E, hidden, inter, T = 16, 1024, 512, 6
_, w = make_moe(rng, E, hidden, inter)
layer = MoeLayer(w, T, np.zeros(E, np.float32), topk=4)
layer.x.upload(to_bf16(rng.standard_normal((T, hidden)).astype(np.float32)))
layer.logits.upload(rng.standard_normal((T, E)).astype(np.float32))
stream = cuda.Stream()
buf = trace.TraceBuffer(1 << 16)       # installed into the modules the layer already loaded
layer.forward(stream); stream.synchronize()
with cuda.capture(stream) as g:
    layer.forward(stream)
ge = g.instantiate()
buf.reset(stream); ge.launch(stream); stream.synchronize()
r = buf.read()
launches = [(name, l.grid, l.block) for name, l in layer.stages]
# the warp-specialized hot tier (sm_90a only), which counts its ring waits: every expert of this one is hot
r2 = np.zeros(0, trace.RECORD_DTYPE)
T2 = 300
hot = cuda.get_device().arch == "90a" and MoeLayer(w, T2, np.zeros(E, np.float32), gmma_tiers=[(64, 256, 5)])
if hot:
    hot.x.upload(to_bf16(rng.standard_normal((T2, hidden)).astype(np.float32)))
    hot.logits.upload(rng.standard_normal((T2, E)).astype(np.float32))
    buf.reset(stream); hot.forward(stream); stream.synchronize()
    r2 = buf.read()
print(json.dumps({"launches": launches, "records": r.tolist(), "dtype": str(r.dtype), "hot_records": r2.tolist()}))
"""


@pytest.mark.gpu
def test_moe_layer_graph_replay_traced(cuda_device, tmp_path):
    """A traced process (DDTREE_TRACE=1): one record per warp of every launch of the layer's graph, each launch's
    warps under one %gridid, stamps in order, the codes of the layer's kernels; and the warp-specialized hot tier's
    ring-wait counts (sm_90a), each within its warp's cycles."""
    env = dict(os.environ, DDTREE_TRACE="1")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", _GPU_SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    r = np.array([tuple(x) for x in got["records"]], trace.RECORD_DTYPE)
    traces = trace.launches(r)
    assert len(traces) == len(got["launches"])
    names = {"route": {"moe_route_blocks", "moe_route_one", "moe_route", "moe_topk", "moe_group"},
             "gate_up": {"moe_gate_up"},
             "down": {"moe_down"}, "combine": {"moe_combine"}}
    by_start = sorted(traces, key=lambda t: t.start)
    for (stage, grid, block), t in zip(got["launches"], by_start):
        assert t.name in names[stage], (stage, t.name)
        blocks = grid[0] * grid[1] * grid[2]
        warps = -(-block[0] * block[1] * block[2] // 32)
        assert (t.blocks, t.warps) == (blocks, blocks * warps), (stage, t.blocks, t.warps, blocks, warps)
        assert len(set(zip(t.records["block"].tolist(), t.records["warp"].tolist()))) == t.warps
    assert (r["start"] <= r["end"]).all() and (r["start"] > 0).all()
    waited = r["wait"] != 0
    assert ((r["start"][waited] <= r["wait"][waited]) & (r["wait"][waited] <= r["end"][waited])).all()
    assert (r["cycles"] > 0).all() and not r["stall"].any()   # these kernels count no ring waits
    # the hot tier's records (sm_90a): its warps' ring waits counted, each within the warp's cycles
    r2 = np.array([tuple(x) for x in got["hot_records"]], trace.RECORD_DTYPE)
    if not len(r2):
        pytest.skip("the wgmma MoE kernels (ring-wait counts) are built for sm_90a only; the rest passed")
    ws = np.isin(r2["code"], [49, 50])   # moe_gmma_ws_gate_up / _down
    assert ws.any() and r2["stall"][ws].any() and (r2["stall"] <= r2["cycles"]).all()
    assert not r2["stall"][~ws].any()


def test_trace_timeline_cli():
    """The tool parses its subcommands without a GPU (it sets DDTREE_TRACE for itself, so only as a child process)."""
    root = Path(__file__).resolve().parents[1]
    for what in ("moe", "step"):
        out = subprocess.run([sys.executable, "tools/trace_timeline.py", what, "--help"], cwd=root,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "--out" in out.stdout, out.stderr[-2000:]
