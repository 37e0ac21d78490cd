"""Driver init, the device's primary context, and the properties kernels are tuned by."""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from .errors import CudaError, NoDeviceError, check

# compute capability -> the arch-specific target we build for (sm_XXa: all the arch's instructions)
_CC_TO_ARCH = {(9, 0): "90a", (10, 0): "100a", (10, 3): "103a", (12, 0): "120a"}

_lock = threading.Lock()
_devices: dict[int, "Device"] = {}
_init_error: NoDeviceError | None = None


_driver_module = None


def driver():
    """cuda.bindings.driver (imported once); NoDeviceError if cuda-bindings itself is missing."""
    global _driver_module
    if _driver_module is None:
        try:
            from cuda.bindings import driver as drv
        except ImportError as e:
            raise NoDeviceError("import cuda.bindings", detail=f"cuda-bindings not installed: {e}") from e
        _driver_module = drv
    return _driver_module


def _init():
    """cuInit once; remember a failure so every later call raises the same clear NoDeviceError."""
    global _init_error
    if _init_error is not None:
        raise _init_error
    drv = driver()
    try:
        result = drv.cuInit(0)
    except Exception as e:  # no libcuda.so: the bindings raise while loading the driver library
        _init_error = NoDeviceError("cuInit", detail=f"no CUDA driver: {type(e).__name__}: {e}")
        raise _init_error from None
    if int(result[0]) != 0:
        _init_error = NoDeviceError("cuInit", int(result[0]), getattr(result[0], "name", str(result[0])),
                                    "the CUDA driver failed to initialise (no GPU visible?)")
        raise _init_error
    count = check(drv.cuDeviceGetCount(), "cuDeviceGetCount")
    if count == 0:
        _init_error = NoDeviceError("cuDeviceGetCount", detail="no CUDA device visible")
        raise _init_error
    return drv, count


@dataclass
class Device:
    ordinal: int
    handle: object
    context: object
    name: str
    cc: tuple[int, int]
    arch: str | None  # None: a compute capability we have no build target for (DDTREE_CUDA_ARCH overrides)
    sm_count: int
    l2_bytes: int
    smem_optin_bytes: int
    total_mem_bytes: int
    mem_peak_bytes_per_s: float = 0.0  # memory clock x bus width x 2 (DDR): the data sheet's peak; 0 if not reported

    def make_current(self):
        check(driver().cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

    def synchronize(self):
        check(driver().cuCtxSynchronize(), "cuCtxSynchronize")

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes on the device."""
        return check(driver().cuMemGetInfo(), "cuMemGetInfo")

    def __str__(self):
        return (f"{self.name} (cc {self.cc[0]}.{self.cc[1]}, sm_{self.arch}, {self.sm_count} SMs, "
                f"L2 {self.l2_bytes >> 20} MiB, smem opt-in {self.smem_optin_bytes >> 10} KiB, "
                f"{self.total_mem_bytes / 2**30:.1f} GiB)")


def get_device(ordinal: int = 0) -> Device:
    """The device's primary context, made current on this thread; cached per ordinal."""
    with _lock:
        dev = _devices.get(ordinal)
        if dev is None:
            dev = _open(ordinal)
            _devices[ordinal] = dev
    dev.make_current()
    return dev


def _open(ordinal: int) -> Device:
    drv, count = _init()
    if not 0 <= ordinal < count:
        raise NoDeviceError("cuDeviceGet", detail=f"device {ordinal} asked, {count} visible")
    handle = check(drv.cuDeviceGet(ordinal), "cuDeviceGet")
    context = check(drv.cuDevicePrimaryCtxRetain(handle), "cuDevicePrimaryCtxRetain")
    check(drv.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    attr = drv.CUdevice_attribute

    def get(a):
        return check(drv.cuDeviceGetAttribute(a, handle), f"cuDeviceGetAttribute({a.name})")

    cc = (get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
          get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))
    name = check(drv.cuDeviceGetName(256, handle), "cuDeviceGetName")
    name = name.split(b"\0")[0].decode() if isinstance(name, bytes) else str(name)
    return Device(
        ordinal=ordinal, handle=handle, context=context, name=name, cc=cc,
        arch=os.environ.get("DDTREE_CUDA_ARCH") or _CC_TO_ARCH.get(cc),
        sm_count=get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        l2_bytes=get(attr.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
        smem_optin_bytes=get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
        total_mem_bytes=check(drv.cuDeviceTotalMem(handle), "cuDeviceTotalMem"),
        mem_peak_bytes_per_s=_peak_memory_rate(get, attr),
    )


def _peak_memory_rate(get, attr) -> float:
    """Bytes/s from the memory clock (kHz) and bus width (bits), double data rate; 0.0 where the driver reports
    neither (the attribute is informational: plans that use it fall back to their defaults)."""
    try:
        khz = get(attr.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)
        bits = get(attr.CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)
    except Exception:
        return 0.0
    return 2.0 * khz * 1e3 * bits / 8


def require_device(ordinal: int = 0) -> Device:
    """The device, or NoDeviceError with the reason (what GPU tests skip on)."""
    try:
        return get_device(ordinal)
    except NoDeviceError:
        raise
    except CudaError as e:
        raise NoDeviceError(e.op, e.code, e.name, "device unusable") from e
