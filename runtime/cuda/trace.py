"""Per-warp timeline of the instrumented kernels (cutlass_kernels/device_common.cuh, DDTREE_TRACE).

Diagnostics only, off unless the process starts with DDTREE_TRACE=1: then every kernel family is built with
-DDDTREE_TRACE=1 (its own kernel-cache entries), and lane 0 of each warp of an instrumented kernel stamps
%globaltimer when the warp starts, after its first dependency wait and when it returns, appending one record to
the buffer installed here. One record per warp, so a launch's records show its ramp, its PDL wait, its tail and
which SMs it held, beside the launches of other streams. The stamps and one atomic per warp cost time: compare a
traced replay's time with an untraced run's before reading much into small gaps.

    buf = trace.TraceBuffer()            # installs itself into every loaded module and every one loaded later
    buf.reset(stream); graph.launch(stream); stream.synchronize()
    launches = trace.launches(buf.read())
    print(trace.table(launches)); print(trace.timeline(launches))
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .device import driver
from .errors import CudaError, check
from .nvrtc import TRACE_BUILD, TRACE_STALLS

_HEADER = Path(__file__).resolve().parents[2] / "cutlass_kernels" / "device_common.cuh"
# One record (device_common.cuh's TraceWarp): the u64 words start, wait, end, %gridid, code | SM << 32,
# block | warp << 32, stall cycles | the warp's cycles << 32, read little-endian as the u32 pairs.
RECORD_DTYPE = np.dtype([("start", "<u8"), ("wait", "<u8"), ("end", "<u8"), ("grid", "<u8"), ("code", "<u4"),
                         ("sm", "<u4"), ("block", "<u4"), ("warp", "<u4"), ("stall", "<u4"), ("cycles", "<u4")])


def _snake(camel: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower()


def header_constants(text: str | None = None) -> dict[str, int]:
    """device_common.cuh's kTraceHeaderWords / kTraceSms / kTraceWarpSlots / kTraceSlotWords / kTraceRecordWords /
    kTraceRecordsAt, by name without the kTrace prefix (HeaderWords, Sms, WarpSlots, SlotWords, RecordWords,
    RecordsAt: the word where the records start, which a static_assert there ties to the others)."""
    text = _HEADER.read_text() if text is None else text
    m = re.search(r"constexpr int (kTraceHeaderWords[^;]*);", text)
    if m is None:
        raise ValueError(f"{_HEADER}: no kTraceHeaderWords line")
    return {name: int(v) for name, v in re.findall(r"kTrace(\w+) = (\d+)", m.group(1))}


def trace_codes(text: str | None = None) -> dict[int, str]:
    """{code: kernel name} from device_common.cuh's TraceCode enum (kTraceMoeGateUp = 44 -> 44: 'moe_gate_up')."""
    text = _HEADER.read_text() if text is None else text
    m = re.search(r"enum TraceCode : unsigned \{(.*?)\};", text, re.S)
    if m is None:
        raise ValueError(f"{_HEADER}: no TraceCode enum")
    pairs = re.findall(r"kTrace(\w+) = (\d+)", m.group(1))
    codes = {int(v): _snake(name) for name, v in pairs}
    if len(codes) != len(pairs):
        raise ValueError(f"{_HEADER}: TraceCode values repeat")
    return codes


class TraceBuffer:
    """The device buffer the instrumented kernels append to (capacity records; later ones are counted, dropped).
    Installed into every loaded kernel module on creation and into every module loaded after (kernel.load_module);
    close() uninstalls it, install() again. Needs DDTREE_TRACE=1 in the environment before the first kernel is
    built."""

    def __init__(self, capacity: int = 1 << 20):
        from . import memory
        if not TRACE_BUILD:
            raise CudaError("trace", detail="kernels are built without the trace; start the process with "
                            "DDTREE_TRACE=1 (runtime/cuda/trace.py)")
        k = header_constants()
        self.capacity = int(capacity)
        self._records_at = k["RecordsAt"]
        self._record_words = k["RecordWords"]
        self.words = memory.empty((self._records_at + self._record_words * self.capacity,), np.uint64)
        header = np.zeros(self._records_at, np.uint64)
        header[1] = self.capacity
        self.words.view(0, (self._records_at,)).upload(header)
        _install(self)

    def reset(self, stream=None):
        """Forget the records so far (queued on `stream`: the next launches on it append from the start)."""
        self.words.view(0, (1,)).fill_bytes(0, stream)

    def count(self) -> int:
        """Records appended since the last reset (more than the capacity when some were dropped)."""
        return int(self.words.view(0, (1,)).download()[0])

    def read(self) -> np.ndarray:
        """The records since the last reset (RECORD_DTYPE), in append order; raises if any were dropped."""
        n = self.count()
        if n > self.capacity:
            raise CudaError("trace", detail=f"{n} warp records, capacity {self.capacity}: make the TraceBuffer larger")
        raw = self.words.view(self._records_at, (n * self._record_words,)).download() if n else np.zeros(0, np.uint64)
        return raw.view(RECORD_DTYPE)

    def install(self):
        """Point every loaded module (and every one loaded later) at this buffer (done on creation)."""
        _install(self)

    def close(self):
        """Point them at nothing: the stamps are skipped (the traced code still runs its checks)."""
        _install(None)


_active: TraceBuffer | None = None


def _set_module_buffer(module, address: int) -> bool:
    """Point one module's ddtree_trace_buffer at `address` (0: off); False where the module has no such global."""
    drv = driver()
    err, dptr, size = drv.cuModuleGetGlobal(module, b"ddtree_trace_buffer")
    if err == drv.CUresult.CUDA_ERROR_NOT_FOUND:
        return False
    check(err, "cuModuleGetGlobal(ddtree_trace_buffer)")
    value = np.array([address], np.uint64)
    check(drv.cuMemcpyHtoD(dptr, value.ctypes.data, 8), "cuMemcpyHtoD(ddtree_trace_buffer)")
    return True


def _install(buffer: TraceBuffer | None):
    global _active
    from .kernel import loaded_modules
    _active = buffer
    for module in loaded_modules():
        _set_module_buffer(module, buffer.words.ptr if buffer is not None else 0)


def module_loaded(module):
    """kernel.load_module's hook: a module loaded while a buffer is installed appends to it too."""
    if _active is not None:
        _set_module_buffer(module, _active.words.ptr)


# ------------------------------------------------------------------------------------------------ summaries
@dataclass
class LaunchTrace:
    """One launch's warps (times in us from the trace's first stamp)."""
    name: str
    grid: int            # %gridid
    blocks: int
    warps: int
    sms: int
    start: float         # first warp started
    first_wait: float    # first / last warp through its dependency wait (nan: no warp waited)
    last_wait: float
    end: float           # last warp returned
    warp_us: float       # median warp time, start (or wait, where it waited) to end
    records: np.ndarray  # this launch's records


def launches(records: np.ndarray, codes: dict[int, str] | None = None) -> list[LaunchTrace]:
    """The records grouped by launch (%gridid), in order of their first warp's start."""
    codes = trace_codes() if codes is None else codes
    if len(records) == 0:
        return []
    t0 = int(records["start"].min())

    def us(t):
        return (np.asarray(t, np.float64) - t0) / 1e3
    out = []
    for grid in np.unique(records["grid"]):
        r = records[records["grid"] == grid]
        waited = r["wait"] != 0
        begin = np.where(waited, r["wait"], r["start"])
        code = int(r["code"][0])
        out.append(LaunchTrace(
            name=codes.get(code, f"code{code}"), grid=int(grid),
            blocks=len(np.unique(r["block"])), warps=len(r), sms=len(np.unique(r["sm"])),
            start=float(us(r["start"].min())),
            first_wait=float(us(r["wait"][waited].min())) if waited.any() else float("nan"),
            last_wait=float(us(r["wait"][waited].max())) if waited.any() else float("nan"),
            end=float(us(r["end"].max())),
            warp_us=float(np.median((r["end"].astype(np.int64) - begin.astype(np.int64)) / 1e3)),
            records=r))
    out.sort(key=lambda lt: (lt.start, lt.grid))
    return out


def table(traces: list[LaunchTrace]) -> str:
    """One line per launch: name, blocks, warps, SMs, start / waits / end (us from the first stamp), span,
    median warp time, and the gap from the previous launch's end."""
    lines = [f"{'#':>3s} {'kernel':24s} {'blocks':>6s} {'warps':>6s} {'SMs':>4s} {'start':>8s} {'wait0':>8s} "
             f"{'wait1':>8s} {'end':>8s} {'span':>7s} {'warp':>7s} {'gap':>7s}"]
    prev_end = None
    for i, t in enumerate(traces):
        gap = "" if prev_end is None else f"{t.start - prev_end:7.2f}"
        lines.append(f"{i:3d} {t.name:24s} {t.blocks:6d} {t.warps:6d} {t.sms:4d} {t.start:8.2f} {t.first_wait:8.2f} "
                     f"{t.last_wait:8.2f} {t.end:8.2f} {t.end - t.start:7.2f} {t.warp_us:7.2f} {gap:>7s}")
        prev_end = t.end
    return "\n".join(lines)


def block_lives(trace: LaunchTrace) -> dict[int, list[tuple[int, int]]]:
    """{SM: the (start, end) ns of each of this launch's blocks there}: a block lives from its first warp's start to
    its last warp's end."""
    r = trace.records
    lives: dict[int, list[tuple[int, int]]] = {}
    for sm in np.unique(r["sm"]):
        on = r[r["sm"] == sm]
        for block in np.unique(on["block"]):
            b = on[on["block"] == block]
            lives.setdefault(int(sm), []).append((int(b["start"].min()), int(b["end"].max())))
    return lives


def peak_blocks_per_sm(trace: LaunchTrace) -> dict[int, int]:
    """{the most blocks of this launch on one SM at once: how many SMs had that} (block_lives); where another kernel
    shares the SMs, this shows how many of the launch's blocks fit beside it (session 33: one routed gate_up block
    beside each narrow shared-MLP block, not three)."""
    peaks: dict[int, int] = {}
    for lives in block_lives(trace).values():
        # (time, +1 block starts / -1 block ends); ends first at a tie
        events = [(start, 1) for start, _ in lives] + [(end, -1) for _, end in lives]
        events.sort(key=lambda ev: (ev[0], ev[1]))
        live = peak = 0
        for _, step in events:
            live += step
            peak = max(peak, live)
        peaks[peak] = peaks.get(peak, 0) + 1
    return dict(sorted(peaks.items(), reverse=True))


def _block_spans(traces: list[LaunchTrace], min_block_ns: int) -> dict[int, list[list[int]]]:
    """{SM: the merged [start, end) ns spans when a block of these launches lived there}, blocks shorter than
    min_block_ns left out."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for t in traces:
        for sm, lives in block_lives(t).items():
            spans.setdefault(sm, []).extend((start, end) for start, end in lives if end - start >= min_block_ns)
    merged: dict[int, list[list[int]]] = {}
    for sm, iv in spans.items():
        out: list[list[int]] = []
        for start, end in sorted(iv):
            if out and start <= out[-1][1]:
                out[-1][1] = max(out[-1][1], end)
            else:
                out.append([start, end])
        merged[sm] = out
    return merged


def shared_sm_time(first: list[LaunchTrace], second: list[LaunchTrace], min_block_us: float = 2.0):
    """(SM-us with a block of `first` resident, of those the SM-us with a block of `second` resident too): how much
    of one set of launches ran beside the other on the same SMs (session 39: the MoE hot tier's blocks beside the
    cold GEMMs'). Blocks shorter than min_block_us (those that find no work and leave) are not counted."""
    a, b = _block_spans(first, int(min_block_us * 1e3)), _block_spans(second, int(min_block_us * 1e3))
    total = sum(end - start for iv in a.values() for start, end in iv)
    both = 0
    for sm, ia in a.items():
        ib, i, j = b.get(sm, []), 0, 0
        while i < len(ia) and j < len(ib):
            both += max(0, min(ia[i][1], ib[j][1]) - max(ia[i][0], ib[j][0]))
            if ia[i][1] < ib[j][1]:
                i += 1
            else:
                j += 1
    return total / 1e3, both / 1e3


def residency(traces: list[LaunchTrace]) -> str:
    """One line per launch: its peak blocks per SM, as 'blocks x SMs' pairs (peak_blocks_per_sm)."""
    return "\n".join(f"{i:3d} {t.name:24s} " + " ".join(f"{n}x{sms}" for n, sms in peak_blocks_per_sm(t).items())
                     for i, t in enumerate(traces))


def stalls(traces: list[LaunchTrace]) -> str:
    """For each launch whose kernel counts spans (trace_stall_begin / _end: moe_gmma_ws_kernel's waits,
    moe_gmma_kernel's item fill and epilogue), one line: per warp of a block (by its index), the counted cycles
    summed over the launch's blocks, as a share of its cycles summed the same way. Which spans count is the build's
    DDTREE_TRACE_STALLS mask (device_common.cuh TraceStallSite; the ring waits unless set), printed in the line.
    Summed, not a median over blocks: most blocks of a hot grid find a cold slot and leave at once (skewed T = 256:
    10 of 32 block rows work), and their zeros made every median 0 (session 36). A producer warp that waits for free
    buffers is paced by its consumers; consumers that wait for filled ones, by their producer."""
    sites = f"DDTREE_TRACE_STALLS={TRACE_STALLS or 1}"
    lines = []
    for i, t in enumerate(traces):
        r = t.records
        if not r["stall"].any():
            continue
        warps = np.unique(r["warp"])
        share = [r["stall"][r["warp"] == w].sum(dtype=np.float64) /
                 max(r["cycles"][r["warp"] == w].sum(dtype=np.float64), 1.0) for w in warps]
        per_warp = " ".join(f"{int(w)}:{100 * v:.0f}%" for w, v in zip(warps, share))
        lines.append(f"{i:3d} {t.name:24s} spans {sites}, % of each warp's cycles over the blocks (warp: share) "
                     f"{per_warp}")
    return "\n".join(lines)


_SHADES = " .:-=+*#%@"


def _shade(count: int, peak: int) -> str:
    """count out of peak as one of ten shades (a blank for none)."""
    return _SHADES[min(9, int(np.ceil(9 * count / peak)))] if count else " "


def timeline(traces: list[LaunchTrace], width: int = 100) -> str:
    """A text chart, one row per launch and a last row for the SMs in use: per time column, the launch's warps
    running (past their wait) as a share of its most at once, in ten shades; 'w' where warps only wait."""
    if not traces:
        return ""
    t1 = max(t.end for t in traces)
    edges = np.linspace(0.0, t1, width + 1)
    mids = (edges[:-1] + edges[1:]) / 2
    t0 = min(int(t.records["start"].min()) for t in traces)
    rows, busy_sm = [], np.zeros((width, 1024), bool)
    for t in traces:
        r = t.records
        start = (r["start"].astype(np.float64) - t0) / 1e3
        waited = r["wait"] != 0
        run = (np.where(waited, r["wait"], r["start"]).astype(np.float64) - t0) / 1e3
        end = (r["end"].astype(np.float64) - t0) / 1e3
        running = (run[None, :] <= mids[:, None]) & (mids[:, None] < end[None, :])
        waiting = (start[None, :] <= mids[:, None]) & (mids[:, None] < run[None, :])
        n = running.sum(1)
        peak = max(int(n.max()), 1)
        row = "".join(_shade(c, peak) if c or not waiting[i].any() else "w" for i, c in enumerate(n))
        rows.append(f"{t.name[:24]:24s}|{row}|")
        for i in range(width):
            busy_sm[i, r["sm"][running[i]] % 1024] = True
    sms = busy_sm.sum(1)
    peak = max(int(sms.max()), 1)
    rows.append(f"{'SMs in use (peak ' + str(peak) + ')':24s}|" + "".join(_shade(c, peak) for c in sms) + "|")
    rows.append(f"{'':24s} 0 us{'':{max(0, width - 12)}s}{t1:7.1f} us")
    return "\n".join(rows)
