"""Device memory: a bump/first-fit arena of named buffers, standalone allocations, pinned host buffers,
and chunked weight uploads.

Ordering: every copy and memset here runs on a stream (stream=None -> default_stream(), the stream kernels
also default to). Calls that hand data back to the host (download, upload without a stream) synchronise
that stream, so a result is never read before the kernels queued before it have finished.
"""
from __future__ import annotations

import bisect
import ctypes
import math
import weakref

import numpy as np

from .device import driver, get_device
from .errors import OutOfMemoryError, check
from .graph import release
from .stream import Event, stream_handle

_live_standalone_bytes = 0  # bytes held by empty()/to_device() allocations, for OOM messages


def _fmt(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _mem_alloc(nbytes: int, what: str) -> int:
    """cuMemAlloc that turns out-of-memory into an error saying what was asked and what is held."""
    get_device()
    drv = driver()
    try:
        return int(check(drv.cuMemAlloc(max(nbytes, 1)), "cuMemAlloc"))
    except OutOfMemoryError as e:
        free, total = check(drv.cuMemGetInfo(), "cuMemGetInfo")
        raise OutOfMemoryError("cuMemAlloc", e.code, e.name,
                               f"{what}: asked {_fmt(nbytes)}; device free {_fmt(free)} of {_fmt(total)}, "
                               f"this process holds {_fmt(_live_standalone_bytes + Arena.held_bytes)} "
                               f"in ddtree allocations") from None


def _mem_free(ptr: int):
    """cuMemFree, held back while a stream capture is in progress (graph.release)."""
    release(driver().cuMemFree, ptr)


class DeviceArray:
    """A typed window on device memory. Owns nothing itself: the arena or the standalone allocation does
    (`owner` keeps that alive). bf16 is stored as np.uint16."""

    def __init__(self, ptr: int, shape, dtype, owner=None, name: str = ""):
        self.ptr = int(ptr)
        self.shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        self.dtype = np.dtype(dtype)
        self.size = math.prod(self.shape)
        self.nbytes = self.size * self.dtype.itemsize
        self.owner = owner
        self.name = name

    def __repr__(self):
        return f"DeviceArray({self.name or hex(self.ptr)}, shape={self.shape}, dtype={self.dtype})"

    def _check_host(self, host: np.ndarray):
        if host.shape != self.shape or host.dtype != self.dtype:
            raise ValueError(f"{self!r}: host array has shape {host.shape}, dtype {host.dtype}")

    def upload(self, host, stream=None):
        """Copy a host array of the same shape and dtype in. Without a stream it is done on return."""
        host = np.ascontiguousarray(host)
        self._check_host(host)
        s = stream_handle(stream)
        check(driver().cuMemcpyHtoDAsync(self.ptr, host.ctypes.data, self.nbytes, s), "cuMemcpyHtoDAsync")
        if stream is None:
            check(driver().cuStreamSynchronize(s), "cuStreamSynchronize")
        return self

    def download(self, stream=None, out: np.ndarray | None = None) -> np.ndarray:
        """Copy out to a new (or the given) host array; waits for the stream."""
        if out is None:
            out = np.empty(self.shape, self.dtype)
        elif not out.flags.c_contiguous:
            raise ValueError("download: `out` must be C-contiguous")
        self._check_host(out)
        s = stream_handle(stream)
        check(driver().cuMemcpyDtoHAsync(out.ctypes.data, self.ptr, self.nbytes, s), "cuMemcpyDtoHAsync")
        check(driver().cuStreamSynchronize(s), "cuStreamSynchronize")
        return out

    def copy_from(self, src: "DeviceArray", stream=None):
        if src.nbytes != self.nbytes:
            raise ValueError(f"copy_from: {src!r} has {src.nbytes} bytes, {self!r} has {self.nbytes}")
        check(driver().cuMemcpyDtoDAsync(self.ptr, src.ptr, self.nbytes, stream_handle(stream)),
              "cuMemcpyDtoDAsync")
        return self

    def fill_bytes(self, value: int, stream=None):
        """Set every byte to `value` (poison before a kernel test, or zero)."""
        check(driver().cuMemsetD8Async(self.ptr, int(value) & 0xFF, self.nbytes, stream_handle(stream)),
              "cuMemsetD8Async")
        return self

    def view(self, offset_elems: int, shape, dtype=None) -> "DeviceArray":
        """A sub-array starting `offset_elems` elements in (optionally reinterpreted as another dtype)."""
        dtype = np.dtype(dtype or self.dtype)
        start = offset_elems * self.dtype.itemsize
        v = DeviceArray(self.ptr + start, _checked_shape(shape, "view"), dtype,
                        owner=self.owner or self, name=self.name)
        if offset_elems < 0 or start + v.nbytes > self.nbytes:
            raise ValueError(f"view of {v.nbytes} bytes at element {offset_elems} overruns {self!r}")
        return v


class _Allocation:
    """A standalone cuMemAlloc, freed when the last DeviceArray using it goes away."""

    def __init__(self, nbytes: int, what: str):
        global _live_standalone_bytes
        self.ptr = _mem_alloc(nbytes, what)
        self.nbytes = nbytes
        _live_standalone_bytes += nbytes
        weakref.finalize(self, _Allocation._release, self.ptr, nbytes)

    @staticmethod
    def _release(ptr, nbytes):
        global _live_standalone_bytes
        _live_standalone_bytes -= nbytes
        _mem_free(ptr)


def _checked_shape(shape, what: str) -> tuple[int, ...]:
    """shape as a tuple of ints >= 0 (a negative size would otherwise become a 1-byte allocation)."""
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValueError(f"{what}: shape {shape} must be non-negative integers")
    return tuple(int(d) for d in shape)


def empty(shape, dtype) -> DeviceArray:
    """A standalone device array (its own cuMemAlloc). Contents undefined."""
    shape = _checked_shape(shape, "empty")
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    alloc = _Allocation(nbytes, f"empty({shape}, {np.dtype(dtype)})")
    return DeviceArray(alloc.ptr, shape, dtype, owner=alloc)


def to_device(host, stream=None) -> DeviceArray:
    host = np.ascontiguousarray(host)
    return empty(host.shape, host.dtype).upload(host, stream)


class Arena:
    """One large device allocation carved into named, aligned buffers. A buffer goes into the first gap left
    by freed buffers that fits it (address order), else after the last buffer; the few bytes of alignment
    padding are not reused. Bookkeeping is a sorted block list and a list of freed gaps, so allocating the
    ~100k tensors of a Kimi checkpoint stays linear (a gap scan over every block per allocation took ~30 min).
    Buffers live until free(name) or reset(); the arena's memory until close() or garbage collection."""

    held_bytes = 0  # all arenas of the process, for OOM messages

    def __init__(self, nbytes: int, name: str = "arena"):
        self.name = name
        self.capacity = int(nbytes)
        self.base = _mem_alloc(self.capacity, f"Arena({name!r})")
        Arena.held_bytes += self.capacity
        self._finalizer = weakref.finalize(self, Arena._release, self.base, self.capacity)
        self.reset()

    @staticmethod
    def _release(base, capacity):
        Arena.held_bytes -= capacity
        _mem_free(base)

    def close(self):
        """Free the device memory now. Arrays handed out before become invalid; alloc() refuses afterwards."""
        self.reset()
        self._finalizer()

    @property
    def used(self) -> int:
        return self._used

    def _largest_gap(self) -> int:
        return max([size for _, size in self._holes] + [self.capacity - self._tail])

    def alloc(self, name: str, shape, dtype, align: int = 256) -> DeviceArray:
        if not self._finalizer.alive:
            raise ValueError(f"arena {self.name!r} is closed: its memory was freed")
        if name in self._blocks:
            raise ValueError(f"arena {self.name!r}: buffer {name!r} already allocated")
        if align <= 0 or align & (align - 1):
            raise ValueError(f"alignment must be a power of two, got {align}")
        shape = _checked_shape(shape, f"arena {self.name!r}: buffer {name!r}")
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize

        def aligned(off):
            return -(-(self.base + off) // align) * align - self.base

        start = None
        for i, (off, size) in enumerate(self._holes):
            a = aligned(off)
            if a + nbytes <= off + size:
                start = a
                rest = [(o, n) for o, n in ((off, a - off), (a + nbytes, off + size - a - nbytes)) if n > 0]
                self._holes[i:i + 1] = rest
                break
        if start is None:
            a = aligned(self._tail)
            if a + nbytes > self.capacity:
                raise OutOfMemoryError("Arena.alloc", -1, "ARENA_OUT_OF_MEMORY",
                                       f"arena {self.name!r}: buffer {name!r} asked {_fmt(nbytes)} "
                                       f"(shape {shape}, {np.dtype(dtype)}, align {align}); capacity "
                                       f"{_fmt(self.capacity)}, used {_fmt(self.used)} in {len(self._blocks)} "
                                       f"buffers, largest free gap {_fmt(self._largest_gap())}\n{self.report()}")
            start = a
        self._tail = max(self._tail, start + nbytes)
        arr = DeviceArray(self.base + start, shape, dtype, owner=self, name=name)
        self._blocks[name] = (start, nbytes, arr)
        bisect.insort(self._order, (start, start + nbytes, name))
        self._used += nbytes
        return arr

    def __getitem__(self, name: str) -> DeviceArray:
        return self._blocks[name][2]

    def __contains__(self, name: str) -> bool:
        return name in self._blocks

    def free(self, name: str):
        if name not in self._blocks:
            raise KeyError(f"arena {self.name!r}: no buffer {name!r}")
        start, nbytes, _ = self._blocks.pop(name)
        self._used -= nbytes
        i = bisect.bisect_left(self._order, (start, start + nbytes, name))
        del self._order[i]
        lo = self._order[i - 1][1] if i > 0 else 0          # the free space around it: previous end ...
        if i == len(self._order):                           # ... to the next start, or the tail gap
            self._tail = lo
            self._holes = [(o, n) for o, n in self._holes if o < lo]
            return
        hi = self._order[i][0]
        self._holes = [(o, n) for o, n in self._holes if not lo <= o < hi]
        if hi > lo:
            bisect.insort(self._holes, (lo, hi - lo))

    def reset(self):
        """Forget every buffer (the memory stays allocated for new ones)."""
        self._blocks: dict[str, tuple[int, int, DeviceArray]] = {}  # name -> (offset, nbytes, array)
        self._order: list[tuple[int, int, str]] = []  # (start, end, name) of every buffer, by address
        self._holes: list[tuple[int, int]] = []  # (offset, size) of gaps left by freed buffers, by address
        self._tail = 0  # end of the last buffer
        self._used = 0

    def report(self, top: int = 20) -> str:
        lines = [f"arena {self.name!r}: {_fmt(self.used)} used of {_fmt(self.capacity)} "
                 f"in {len(self._blocks)} buffers"]
        biggest = sorted(self._blocks.items(), key=lambda kv: -kv[1][1])
        for name, (off, n, arr) in biggest[:top]:
            lines.append(f"  {name:<32} {_fmt(n):>12}  @+{off:#x}  {arr.shape} {arr.dtype}")
        if len(biggest) > top:
            lines.append(f"  ... {len(biggest) - top} more")
        return "\n".join(lines)


class PinnedBuffer:
    """Page-locked host memory (fast, truly asynchronous uploads)."""

    def __init__(self, nbytes: int):
        get_device()
        self.nbytes = int(nbytes)
        self.ptr = int(check(driver().cuMemHostAlloc(max(self.nbytes, 1), 0), "cuMemHostAlloc"))
        self._finalizer = weakref.finalize(self, PinnedBuffer._release, self.ptr)

    @staticmethod
    def _release(ptr):
        release(driver().cuMemFreeHost, ptr)

    def array(self, dtype=np.uint8, shape=None) -> np.ndarray:
        """A numpy view of the buffer. The view keeps this PinnedBuffer alive (until close(), which frees the
        memory regardless), so a view that outlives its last named reference never reads freed memory."""
        dtype = np.dtype(dtype)
        count = self.nbytes // dtype.itemsize if shape is None else math.prod(
            shape if isinstance(shape, (tuple, list)) else (shape,))
        if count * dtype.itemsize > self.nbytes:
            raise ValueError(f"pinned buffer of {self.nbytes} bytes cannot hold {count} x {dtype}")
        raw = (ctypes.c_char * self.nbytes).from_address(self.ptr)
        raw._owner = self  # numpy's view holds `raw`, and `raw` holds the owner of the memory
        arr = np.frombuffer(raw, dtype=dtype, count=count)
        return arr.reshape(shape) if shape is not None else arr

    def close(self):
        self._finalizer()


def upload_chunked(dst: DeviceArray, src, chunk_bytes: int = 64 << 20, progress=None, stream=None):
    """Upload a large host array (a np.memmap is fine) through two pinned staging buffers, so the host
    never holds a second full copy: while one chunk is copied to the device the next is staged.
    progress(done_bytes, total_bytes) is called after each chunk is queued. Returns when all is done."""
    src = np.asarray(src)
    if src.nbytes != dst.nbytes:
        raise ValueError(f"upload_chunked: source has {src.nbytes} bytes, {dst!r} has {dst.nbytes}")
    if not src.flags.c_contiguous:
        raise ValueError("upload_chunked: source must be C-contiguous")
    flat = src.reshape(-1).view(np.uint8)
    total = flat.size
    chunk = max(1, min(chunk_bytes, total))
    staging = [PinnedBuffer(chunk), PinnedBuffer(chunk)] if total else []
    done_events = [None, None]
    s = stream_handle(stream)
    drv = driver()
    try:
        for i, off in enumerate(range(0, total, chunk)):
            n = min(chunk, total - off)
            k = i % 2
            if done_events[k] is not None:
                done_events[k].synchronize()  # that buffer's previous copy has left the host
            staging[k].array(np.uint8)[:n] = flat[off:off + n]
            check(drv.cuMemcpyHtoDAsync(dst.ptr + off, staging[k].ptr, n, s), "cuMemcpyHtoDAsync")
            done_events[k] = Event(timing=False).record(stream)
            if progress is not None:
                progress(off + n, total)
        check(drv.cuStreamSynchronize(s), "cuStreamSynchronize")
    except BaseException:  # (e.g. Ctrl-C, a failing progress callback) no copy may still read the staging
        drv.cuStreamSynchronize(s)  # buffers when they are freed on the way out
        raise
    return dst
