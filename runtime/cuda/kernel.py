"""Kernels: lazy module loading from the CUBIN cache, and launches with argument buffers packed once.

A kernel's parameters are passed to cuLaunchKernel as `void**`: an array of addresses, one per argument,
each pointing at the argument's value. Launch keeps both arrays (values in 8-byte slots, addresses to the
slots) in numpy, so a launch is one driver call and changing an argument is one store. That call goes
through cuda.bindings (3.5 us bare on the H200, vs 4.7 us for ctypes into libcuda: docs/PERF.md);
DDTREE_LAUNCH=ctypes selects the ctypes path.
Scalars must be numpy scalars of the kernel's C type (np.int32(n), np.float32(x), np.int64(...)): a bare
Python int or float is refused because its width would be a guess.
DDTREE_CUDA_SYNC=1 synchronises and checks after every launch (debugging: errors point at the kernel).

Kernels of a family registered with pdl=True launch through cuLaunchKernelEx with programmatic stream
serialization (programmatic dependent launch): the kernel may start while the previous one on the stream
finishes, and waits inside (griddepcontrol.wait) before touching its outputs. Inside a stream capture this
becomes a programmatic graph edge. DDTREE_PDL=0 launches them plainly (same results, for A/B timing); so do the
launches made inside `plain_launches()` on that thread (a launch that should start only once the work it follows
has finished, e.g. a side stream's first kernel after an event).
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading

import numpy as np

from . import graph as _graph
from .device import driver, get_device
from .errors import CudaError, check
from .nvrtc import TRACE_BUILD, compile_family, resolve_arch
from .stream import default_stream, stream_handle

_SYNC_EVERY_LAUNCH = os.environ.get("DDTREE_CUDA_SYNC") == "1"
_PDL_ENABLED = os.environ.get("DDTREE_PDL", "1") != "0"
_modules: dict[tuple, object] = {}  # (family, arch, device ordinal) -> (CUmodule, CompiledModule)
_kernels: dict[tuple, "Kernel"] = {}
# Held while a miss is filled, so two threads asking for the same kernel load (and compile) it once instead of
# each loading a module and one of them leaking it. Hits read the dicts without it.
_cache_lock = threading.RLock()


def _dim3(d) -> tuple[int, int, int]:
    if type(d) is int and d >= 1:  # the common case, kept cheap: Kernel.launch calls this twice
        return (d, 1, 1)
    d = (d,) if isinstance(d, (int, np.integer)) else tuple(d)
    if not 1 <= len(d) <= 3 or any(int(x) < 1 for x in d):
        raise ValueError(f"grid/block dims must be 1..3 positive ints, got {d}")
    return tuple(int(x) for x in d) + (1,) * (3 - len(d))


_plain = threading.local()   # .depth > 0: this thread's launches go without programmatic serialization


@contextlib.contextmanager
def plain_launches():
    """Launches made inside (this thread) are plain whatever their family's pdl: each starts when the work it
    follows has finished (in a capture: a full graph edge, not a programmatic one), so it reads and prefetches
    nothing before then."""
    _plain.depth = getattr(_plain, "depth", 0) + 1
    try:
        yield
    finally:
        _plain.depth -= 1


@contextlib.contextmanager
def _capture_relaxed():
    """Module and function loads made while this thread captures a stream (runtime.cuda.capture: thread-local
    mode) are prohibited there, and they invalidate the capture: the next launch then fails with
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED. A kernel first used inside a capture (a graph captured before any eager
    run) loads in relaxed mode instead; they put no work on a stream, so the capture loses nothing."""
    if not _graph._active:
        yield
        return
    drv = driver()
    previous = check(drv.cuThreadExchangeStreamCaptureMode(drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
                     "cuThreadExchangeStreamCaptureMode")
    try:
        yield
    finally:
        check(drv.cuThreadExchangeStreamCaptureMode(previous), "cuThreadExchangeStreamCaptureMode")


def load_module(family: str, arch: str | None = None):
    """The family's CUmodule on the current device (built or read from cache on first use)."""
    dev = get_device()
    arch = resolve_arch(arch)
    key = (family, arch, dev.ordinal)
    hit = _modules.get(key)
    if hit is None:
        with _cache_lock:
            hit = _modules.get(key)  # another thread may have loaded it while we waited
            if hit is None:
                compiled = compile_family(family, arch)
                with _capture_relaxed():
                    module = check(driver().cuModuleLoadData(compiled.cubin),
                                   f"cuModuleLoadData({family}, sm_{arch})")
                if TRACE_BUILD:
                    from . import trace
                    trace.module_loaded(module)
                hit = _modules[key] = (module, compiled)
    return hit


def loaded_modules() -> list:
    """Every CUmodule loaded so far (all devices)."""
    return [module for module, _ in list(_modules.values())]


class Kernel:
    def __init__(self, family: str, entry: str, function, arch: str, pdl: bool = False,
                 param_sizes: tuple[int, ...] | None = None):
        self.family, self.entry, self.function, self.arch = family, entry, function, arch
        self.pdl = bool(pdl) and _PDL_ENABLED  # launched with programmatic stream serialization
        self.param_sizes = param_sizes  # bytes per parameter (PTX signature); Launch checks the arguments
        self.checked_types: set = set()  # argument type lists already checked against param_sizes
        self.max_dynamic_smem = 0        # the largest dynamic shared memory opt-in made so far

    def __repr__(self):
        return f"Kernel({self.family}:{self.entry}, sm_{self.arch})"

    def set_max_dynamic_smem(self, nbytes: int):
        """Opt in to more than 48 KiB of dynamic shared memory for this kernel. A value at or below one already set
        makes no driver call, so launch paths may call it before every launch."""
        if nbytes <= self.max_dynamic_smem:
            return
        drv = driver()
        with _capture_relaxed():
            check(drv.cuFuncSetAttribute(self.function,
                                         drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                         int(nbytes)), f"cuFuncSetAttribute(max dynamic smem, {self})")
        self.max_dynamic_smem = int(nbytes)

    def attribute(self, name: str) -> int:
        """e.g. attribute("NUM_REGS"), "MAX_THREADS_PER_BLOCK", "LOCAL_SIZE_BYTES"."""
        drv = driver()
        attr = getattr(drv.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{name}")
        return check(drv.cuFuncGetAttribute(attr, self.function), f"cuFuncGetAttribute({name}, {self})")

    def blocks_per_sm(self, block: int, smem: int = 0) -> int:
        """Resident blocks per SM at this block size and dynamic shared memory (the driver's occupancy)."""
        return check(driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(self.function, int(block), int(smem)),
                     f"cuOccupancyMaxActiveBlocksPerMultiprocessor({self})")

    def prepare(self, grid, block, args, smem: int = 0) -> "Launch":
        return Launch(self, grid, block, args, smem)

    def launch(self, grid, block, args, smem: int = 0, stream=None):
        Launch(self, grid, block, args, smem)(stream)


def _family_pdl(family: str) -> bool:
    from cutlass_kernels.registry import FAMILIES
    f = FAMILIES.get(family)
    return bool(f is not None and f.pdl)


def get_kernel(family: str, entry: str, arch: str | None = None) -> Kernel:
    """A kernel of a registered family, its module loaded lazily on the current device."""
    dev = get_device()
    arch = resolve_arch(arch)
    key = (family, entry, arch, dev.ordinal)
    k = _kernels.get(key)
    if k is None:
        with _cache_lock:
            k = _kernels.get(key)
            if k is None:
                module, compiled = load_module(family, arch)
                if entry not in compiled.lowered:
                    raise KeyError(f"kernel family {family!r} has no entry {entry!r}; entries: "
                                   f"{', '.join(compiled.lowered)}")
                with _capture_relaxed():
                    fn = check(driver().cuModuleGetFunction(module, compiled.lowered[entry].encode()),
                               f"cuModuleGetFunction({family}:{entry})")
                    # loaded now, not at its first launch (lazy loading), which may fall inside a capture
                    check(driver().cuFuncLoad(fn), f"cuFuncLoad({family}:{entry})")
                k = _kernels[key] = Kernel(family, entry, fn, arch, pdl=_family_pdl(family),
                                           param_sizes=compiled.entry_param_sizes(entry))
    return k


def _slot_bytes(arg, i: int) -> bytes:
    """One argument -> its value as 8 little-endian bytes (pointers, and numpy scalars of up to 8 bytes)."""
    ptr = getattr(arg, "ptr", None)
    if ptr is not None:  # DeviceArray, PinnedBuffer, ...
        return int(ptr).to_bytes(8, "little")
    if isinstance(arg, np.generic):
        raw = arg.tobytes()
        if len(raw) > 8:
            raise TypeError(f"kernel argument {i}: {type(arg).__name__} is {len(raw)} bytes; at most 8")
        return raw.ljust(8, b"\0")
    if isinstance(arg, (bool, int, float)):
        raise TypeError(f"kernel argument {i}: bare Python {type(arg).__name__} {arg!r}; wrap it in the numpy "
                        f"type of the kernel parameter (np.int32, np.int64, np.float32, np.uint64 ...)")
    raise TypeError(f"kernel argument {i}: cannot pass {type(arg).__name__}")


def check_arguments(kernel, args):
    """The arguments against the kernel's parameter list (sizes in bytes, from its PTX signature): the count
    must match (the driver reads exactly that many slots) and no value may be wider than its parameter (it
    would be cut). Narrower is allowed: the 8-byte slot is zero-extended (np.int32 counts into a long long).
    Widths follow from the argument types, so each kernel remembers the type lists it has passed (an eager
    launch pays ~0.5 us for the lookup, not the full check)."""
    sizes = getattr(kernel, "param_sizes", None)
    if sizes is None:
        return
    types = tuple(map(type, args))
    passed = getattr(kernel, "checked_types", None)
    if passed is not None and types in passed:
        return
    if len(args) != len(sizes):
        raise TypeError(f"{kernel}: takes {len(sizes)} arguments, got {len(args)}")
    for i, (arg, size) in enumerate(zip(args, sizes)):
        width = 8 if getattr(arg, "ptr", None) is not None else getattr(arg, "itemsize", 8)
        if width > size:
            raise TypeError(f"{kernel}: argument {i} is a {width}-byte {type(arg).__name__} for a {size}-byte "
                            f"parameter")
    if passed is not None:
        passed.add(types)


def _slot_value(arg, i: int) -> np.ndarray:
    """One argument as a 1-element uint64 array (tests read it back through .view)."""
    return np.frombuffer(_slot_bytes(arg, i), np.uint64).copy()


_ctypes_launch = None  # libcuda's cuLaunchKernel through ctypes, bound on first use (None: not decided yet)


def _launcher():
    """libcuda's cuLaunchKernel bound through ctypes when DDTREE_LAUNCH=ctypes (and libcuda opens by
    name), else False: launches then go through cuda.bindings, measured faster (docs/PERF.md)."""
    global _ctypes_launch
    if _ctypes_launch is None:
        _ctypes_launch = False
        if os.environ.get("DDTREE_LAUNCH", "bindings") == "ctypes":
            try:
                import ctypes
                fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
                fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
                fn.restype = ctypes.c_int
                _ctypes_launch = fn
            except (OSError, AttributeError) as e:
                import warnings
                warnings.warn(f"DDTREE_LAUNCH=ctypes: cannot bind libcuda.so.1 ({e}); launching through "
                              "cuda.bindings instead", stacklevel=3)
    return _ctypes_launch


def _pdl_config(grid, block, smem):
    """A CUlaunchConfig with the programmatic-stream-serialization attribute (stream set per launch)."""
    drv = driver()
    attr = drv.CUlaunchAttribute()
    attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    cfg = drv.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
    cfg.sharedMemBytes = smem
    cfg.attrs = [attr]
    cfg.numAttrs = 1
    return cfg


class Launch:
    """A kernel launch with its argument buffer packed once; calling it is a single driver call.
    `values` holds one 8-byte slot per argument, `addresses` the address of each slot (the void** that
    cuLaunchKernel reads); set_arg rewrites a slot in place, so the addresses never change."""

    def __init__(self, kernel: Kernel, grid, block, args, smem: int = 0):
        self.kernel, self.grid, self.block, self.smem = kernel, _dim3(grid), _dim3(block), int(smem)
        self.args = list(args)
        check_arguments(kernel, self.args)
        n = len(self.args)
        # one array: n value slots, then the n addresses of those slots (the void** the driver reads)
        packed = np.empty(2 * max(n, 1), np.uint64)
        base = packed.__array_interface__["data"][0]
        if n:
            packed[:n] = np.frombuffer(b"".join([_slot_bytes(a, i) for i, a in enumerate(self.args)]), np.uint64)
            packed[n:] = [base + 8 * i for i in range(n)]
        self._packed = packed
        self.values, self.addresses = packed[:n], packed[n:2 * n]
        self.params = base + 8 * n if n else 0
        self._bind()

    def _bind(self):
        """Pre-bind everything but the stream, so a launch is one call with two arguments."""
        g, b, fn = self.grid, self.block, self.kernel.function
        self._config = None
        if getattr(self.kernel, "pdl", False) and not getattr(_plain, "depth", 0):
            self._config = _pdl_config(g, b, self.smem)
            self._ctypes = None
            return
        ct = _launcher() if fn is not None else None
        if ct:
            self._ctypes = functools.partial(ct, int(fn), *g, *b, self.smem)
        else:
            self._ctypes = None
            self._bindings = functools.partial(driver().cuLaunchKernel, fn, *g, *b, self.smem)

    def set_arg(self, i: int, value):
        """Change argument i in place (the next launch, or a graph update, uses it)."""
        self.values[i] = int.from_bytes(_slot_bytes(value, i), "little")
        self.args[i] = value

    def __call__(self, stream=None):
        if stream is None:
            stream = default_stream()
        if self._config is not None:
            self._config.hStream = stream_handle(stream)
            err = driver().cuLaunchKernelEx(self._config, self.kernel.function, self.params, 0)[0]
        elif self._ctypes is not None:
            ptr = getattr(stream, "ptr", None)
            err = self._ctypes(int(stream) if ptr is None else ptr, self.params, None)
        else:
            err = self._bindings(getattr(stream, "handle", stream), self.params, 0)[0]
        if err:
            code = int(err)
            raise CudaError("cuLaunchKernel", code, driver().CUresult(code).name, str(self.kernel))
        if _SYNC_EVERY_LAUNCH:
            s = stream_handle(stream)
            try:
                check(driver().cuStreamSynchronize(s), "cuStreamSynchronize")
            except CudaError as e:
                raise CudaError(f"{self.kernel} (DDTREE_CUDA_SYNC)", e.code, e.name) from e
        if _graph._active:  # record the node for later argument updates
            _graph._note_launch(stream_handle(stream), self)

    launch = __call__
