"""Streams, events and the timing helper."""
from __future__ import annotations

import statistics
import threading

from .device import driver, get_device
from .errors import check


def priority_range() -> tuple[int, int]:
    """(least, greatest) stream priority of the current context: numerically lower is higher (e.g. (0, -5)). A
    stream's priority orders the block scheduler's pick among grids queued at once; captured kernels keep it
    (graphs here are instantiated to use it)."""
    get_device()
    least, greatest = check(driver().cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
    return int(least), int(greatest)


def check_priority(priority: int) -> int:
    least, greatest = priority_range()
    if not greatest <= int(priority) <= least:
        raise ValueError(f"stream priority {priority}: want {greatest} (highest) .. {least} (lowest, the default)")
    return int(priority)


class Stream:
    """A non-blocking stream on the current device (never the legacy default stream, which graphs
    cannot capture)."""

    def __init__(self, priority: int = 0):
        get_device()
        drv = driver()
        flags = int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
        self.handle = check(drv.cuStreamCreateWithPriority(flags, check_priority(priority)),
                            "cuStreamCreateWithPriority")
        self.ptr = int(self.handle)  # the raw CUstream, for the ctypes launch path

    def synchronize(self):
        check(driver().cuStreamSynchronize(self.handle), "cuStreamSynchronize")

    def wait(self, event: "Event"):
        wait_event(self, event)

    def close(self):
        if getattr(self, "handle", None) is not None:
            check(driver().cuStreamDestroy(self.handle), "cuStreamDestroy")
            self.handle = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the driver may be gone
            pass


_default: Stream | None = None
_default_lock = threading.Lock()


def default_stream() -> Stream:
    """One process-wide stream the runtime uses when a call gets stream=None (created once, even when two
    threads ask first: work queued on one stream and waited for on another would be read too early)."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = Stream()
    return _default


def stream_handle(stream) -> object:
    """Stream | raw CUstream | None -> the CUstream to pass to the driver (None -> default_stream())."""
    if stream is None:
        return default_stream().handle
    return getattr(stream, "handle", stream)


def wait_event(stream, event: "Event"):
    """Work queued on `stream` (a Stream, a raw CUstream or None = default_stream()) after this call waits for
    `event`; inside a capture this is a graph edge (how a forked branch joins back)."""
    check(driver().cuStreamWaitEvent(stream_handle(stream), event.handle, 0), "cuStreamWaitEvent")


class Event:
    def __init__(self, timing: bool = True):
        get_device()
        drv = driver()
        flags = drv.CUevent_flags.CU_EVENT_DEFAULT if timing else drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.handle = check(drv.cuEventCreate(int(flags)), "cuEventCreate")

    def record(self, stream=None) -> "Event":
        check(driver().cuEventRecord(self.handle, stream_handle(stream)), "cuEventRecord")
        return self

    def synchronize(self):
        check(driver().cuEventSynchronize(self.handle), "cuEventSynchronize")

    def elapsed_ms(self, other: "Event") -> float:
        """Milliseconds from this event to `other` (both recorded; waits for `other`)."""
        other.synchronize()
        return check(driver().cuEventElapsedTime(self.handle, other.handle), "cuEventElapsedTime")

    def __del__(self):
        try:
            driver().cuEventDestroy(self.handle)
        except Exception:
            pass


def bench(fn, warmup: int = 5, iters: int = 50, stream=None) -> float:
    """Median milliseconds of fn() over `iters` calls, each bracketed by events on `stream`."""
    for _ in range(warmup):
        fn()
    starts = [Event() for _ in range(iters)]
    ends = [Event() for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record(stream)
        fn()
        e.record(stream)
    ends[-1].synchronize()
    return statistics.median(s.elapsed_ms(e) for s, e in zip(starts, ends))
