"""SM partitions: streams whose kernels run only on a chosen set of the device's SMs (green contexts).

A kernel launched on an ordinary stream takes whatever SMs free up first, so two chains on two streams share the
SMs in the order their blocks were queued. SmPartition splits the SMs into two disjoint sets, each with its own
green context and a non-blocking stream in it: work on `streams[0]` runs on `sizes[0]` SMs, work on `streams[1]` on
the other `sizes[1]`, whatever either has queued. Events join them to ordinary streams as usual (inside a capture
too: a fork / join of graph branches).
"""
from __future__ import annotations

import threading

from .device import driver, get_device
from .errors import CudaError, check
from .stream import Stream, check_priority


class GreenStream(Stream):
    """A non-blocking stream of a green context (made by SmPartition)."""

    def __init__(self, green_ctx, priority: int = 0):
        drv = driver()
        flags = int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
        self.handle = check(drv.cuGreenCtxStreamCreate(green_ctx, flags, check_priority(priority)),
                            "cuGreenCtxStreamCreate")
        self.ptr = int(self.handle)


class SmPartition:
    """The device's SMs in two disjoint sets: at least `sms` of them (rounded up to the driver's partition
    granularity, reported in `sizes[0]`) and the rest (`sizes[1]`), each with a stream (`streams`) of the given
    priorities (runtime.cuda.stream.priority_range)."""

    def __init__(self, sms: int, priorities: tuple[int, int] = (0, 0)):
        dev = get_device()
        drv = driver()
        sm_type = drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM
        whole = check(drv.cuDeviceGetDevResource(dev.handle, sm_type), "cuDeviceGetDevResource(SM)")
        total = int(whole.sm.smCount)
        if not 0 < int(sms) < total:
            raise ValueError(f"SmPartition: sms={sms}: want 1 .. {total - 1} of the device's {total} SMs")
        groups, n_groups, rest = check(drv.cuDevSmResourceSplitByCount(1, whole, 0, int(sms)),
                                       "cuDevSmResourceSplitByCount")
        if n_groups != 1 or int(rest.sm.smCount) == 0:
            raise CudaError("cuDevSmResourceSplitByCount", detail=f"{sms} of {total} SMs gave {n_groups} group(s) "
                            f"and a remainder of {int(rest.sm.smCount)} SMs (granularity: at least "
                            f"{int(whole.sm.minSmPartitionSize)}, in steps of {int(whole.sm.smCoscheduledAlignment)})")
        self.sizes = (int(groups[0].sm.smCount), int(rest.sm.smCount))
        self.green_contexts, self.streams = [], []
        for part, priority in zip((groups[0], rest), priorities):
            desc = check(drv.cuDevResourceGenerateDesc([part], 1), "cuDevResourceGenerateDesc")
            green = check(drv.cuGreenCtxCreate(desc, dev.handle,
                                               int(drv.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM)),
                          "cuGreenCtxCreate")
            self.green_contexts.append(green)
            self.streams.append(GreenStream(green, priority))   # (neither call changes this thread's current context)

    def close(self):
        """Destroy the streams, then the green contexts (their work must be done)."""
        for stream in self.streams:
            stream.close()
        for green in self.green_contexts:
            check(driver().cuGreenCtxDestroy(green), "cuGreenCtxDestroy")
        self.streams, self.green_contexts = [], []

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the driver may be gone
            pass

    def __repr__(self):
        return f"SmPartition({self.sizes[0]} + {self.sizes[1]} SMs)"


_shared: dict = {}
_shared_lock = threading.Lock()


def shared_partition(sms: int, priorities: tuple[int, int] = (0, 0)) -> SmPartition:
    """One SmPartition per (sms, priorities) for the process, made on first use: the MoE layers of a model share its
    green contexts and streams (each layer's own events fork and join them, so the layers' work stays in order)."""
    key = (int(sms), tuple(int(p) for p in priorities))
    with _shared_lock:
        if key not in _shared:
            _shared[key] = SmPartition(*key)
        return _shared[key]
