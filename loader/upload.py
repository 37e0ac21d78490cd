"""Streaming upload of checkpoint tensors into a device arena (runtime.cuda).

Tensors go from the read-only mmap through a pair of pinned staging buffers to their arena buffers: while
one staging buffer's copies run on the stream, the next is filled on the host, so the host never holds a
second full copy and small tensors (Kimi has ~100k) are batched into large staging fills instead of one
pinned round trip each. Host-side fills are split over a few threads (numpy copies release the GIL), since
one core's memcpy out of the page cache is below the H2D bandwidth. Progress on stderr: GB done, GB/s.

`plan_staging` (pure, CPU-tested) decides which bytes go through which staging fill; `upload_checkpoint`
executes the plan with runtime.cuda."""
from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, NamedTuple, Sequence

import numpy as np

from .checkpoint import STORAGE_DTYPES, Checkpoint
from .errors import LoadError

COPY_SLICE = 8 << 20      # host copies are split into slices of this size across threads


class Piece(NamedTuple):
    tensor: int      # index into the tensor list
    src_off: int     # byte offset inside that tensor
    stage_off: int   # byte offset inside the staging buffer
    nbytes: int


def plan_staging(sizes: Sequence[int], chunk_bytes: int) -> list[list[Piece]]:
    """Split tensors of `sizes` bytes, in order, into staging fills of at most chunk_bytes each. Every byte
    appears in exactly one piece; a tensor larger than a chunk spans several fills."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    fills: list[list[Piece]] = []
    cur: list[Piece] = []
    used = 0
    for t, size in enumerate(sizes):
        off = 0
        while off < size:
            n = min(chunk_bytes - used, size - off)
            cur.append(Piece(t, off, used, n))
            used += n
            off += n
            if used == chunk_bytes:
                fills.append(cur)
                cur, used = [], 0
    if cur:
        fills.append(cur)
    return fills


class Progress:
    """'upload  1.23 / 4.00 GB ( 30.7%)  11.52 GB/s' on one updating stderr line."""

    def __init__(self, total: int, enabled: bool = True, label: str = "upload", stream=None):
        self.total, self.enabled, self.label = total, enabled, label
        self.stream = stream or sys.stderr
        self.done = 0
        self.t0 = time.perf_counter()
        self._last = 0.0

    def update(self, nbytes: int):
        self.done += nbytes
        now = time.perf_counter()
        if self.enabled and now - self._last > 0.25:
            self._last = now
            self._write(now)

    def _write(self, now):
        rate = self.done / max(now - self.t0, 1e-9) / 1e9
        pct = 100.0 * self.done / max(self.total, 1)
        self.stream.write(f"\r{self.label} {self.done / 1e9:7.2f} / {self.total / 1e9:.2f} GB ({pct:5.1f}%) "
                          f"{rate:6.2f} GB/s")
        self.stream.flush()

    def finish(self) -> float:
        """Seconds since start; prints the final line."""
        now = time.perf_counter()
        if self.enabled:
            self._write(now)
            self.stream.write("\n")
            self.stream.flush()
        return now - self.t0


def upload_arrays_to(dsts: Sequence, srcs: Sequence[np.ndarray], progress: bool = True,
                     chunk_bytes: int = 64 << 20, threads: int | None = None, stream=None) -> float:
    """Copy each host array srcs[i] (C-contiguous; a mmap view is fine) into device array dsts[i] through
    double-buffered pinned staging. Returns the seconds taken (all copies complete)."""
    from runtime.cuda import Event, PinnedBuffer, check
    from runtime.cuda.device import driver
    from runtime.cuda.stream import stream_handle

    if len(dsts) != len(srcs):
        raise ValueError(f"{len(dsts)} destinations for {len(srcs)} source arrays")
    flats = []
    for d, s in zip(dsts, srcs):
        s = np.asarray(s)
        if s.nbytes != d.nbytes:
            raise ValueError(f"source has {s.nbytes} bytes, {d!r} has {d.nbytes}")
        if not s.flags.c_contiguous:
            s = np.ascontiguousarray(s)
        flats.append(s.reshape(-1).view(np.uint8))
    total = sum(f.size for f in flats)
    chunk = max(1, min(chunk_bytes, total))
    fills = plan_staging([f.size for f in flats], chunk)
    bar = Progress(total, progress)
    if not fills:
        return bar.finish()
    drv, s = driver(), stream_handle(stream)
    staging = [PinnedBuffer(chunk), PinnedBuffer(chunk)]
    views = [b.array(np.uint8) for b in staging]
    done: list = [None, None]
    pool = ThreadPoolExecutor(threads or min(8, os.cpu_count() or 1))
    try:
        for i, fill in enumerate(fills):
            k = i % 2
            if done[k] is not None:
                done[k].synchronize()          # its previous copies have left the staging buffer
            jobs = []
            for p in fill:
                for o in range(0, p.nbytes, COPY_SLICE):
                    n = min(COPY_SLICE, p.nbytes - o)
                    jobs.append((views[k][p.stage_off + o: p.stage_off + o + n],
                                 flats[p.tensor][p.src_off + o: p.src_off + o + n]))
            list(pool.map(lambda j: np.copyto(j[0], j[1]), jobs))
            for p in fill:
                check(drv.cuMemcpyHtoDAsync(dsts[p.tensor].ptr + p.src_off, staging[k].ptr + p.stage_off,
                                            p.nbytes, s), "cuMemcpyHtoDAsync")
            done[k] = Event(timing=False).record(stream)
            bar.update(sum(p.nbytes for p in fill))
        check(drv.cuStreamSynchronize(s), "cuStreamSynchronize")
    except BaseException:
        drv.cuStreamSynchronize(s)      # no DMA may still read the staging buffers when they are freed
        raise
    finally:
        pool.shutdown()
    return bar.finish()


def upload_checkpoint(checkpoint: Checkpoint, names: Iterable[str] | None, arena, progress: bool = True,
                      chunk_bytes: int = 64 << 20, prefix: str = "", threads: int | None = None,
                      stream=None) -> dict:
    """Allocate each named tensor in `arena` (runtime.cuda.Arena; buffer name = prefix + tensor name) and
    upload it. names=None uploads every tensor. Returns {tensor name: DeviceArray}; bf16 lands as uint16,
    fp8 as uint8 (bit patterns unchanged)."""
    names = checkpoint.names() if names is None else list(names)
    for n in names:
        if n not in checkpoint:
            raise LoadError("tensor not in checkpoint", checkpoint.source, n)
    checkpoint.advise_sequential()
    out = {}
    for n in names:
        dtype, shape = checkpoint.info(n)
        out[n] = arena.alloc(prefix + n, shape, STORAGE_DTYPES[dtype])
    upload_arrays_to([out[n] for n in names], [checkpoint.tensor(n) for n in names], progress=progress,
                     chunk_bytes=chunk_bytes, threads=threads, stream=stream)
    return out


def upload_arrays(arrays: dict[str, np.ndarray], arena, progress: bool = True, chunk_bytes: int = 64 << 20,
                  prefix: str = "", threads: int | None = None, stream=None) -> dict:
    """The same for in-memory arrays (GGUF dequantized weights, repacked INT4)."""
    out = {n: arena.alloc(prefix + n, a.shape, a.dtype) for n, a in arrays.items()}
    upload_arrays_to(list(out.values()), list(arrays.values()), progress=progress, chunk_bytes=chunk_bytes,
                     threads=threads, stream=stream)
    return out
