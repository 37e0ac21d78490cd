"""runtime.cuda: a thin, explicit layer over cuda.bindings (driver + NVRTC). See notes/CUDA_API.md.
Importing it needs no GPU; the first call that needs one raises NoDeviceError when there is none."""
from .errors import CompileError, CudaError, NoDeviceError, OutOfMemoryError, check
from .device import Device, get_device, require_device
from .memory import Arena, DeviceArray, PinnedBuffer, empty, to_device, upload_chunked
from .stream import Event, Stream, bench, default_stream, priority_range
from .nvrtc import ARCHS, CompiledModule, cache_dir, compile_all, compile_family, resolve_arch
from .kernel import Kernel, Launch, get_kernel, load_module, plain_launches
from .graph import Capture, GraphCache, GraphExec, bucket_for, capture
from .green import SmPartition, shared_partition

__all__ = [
    "CompileError", "CudaError", "NoDeviceError", "OutOfMemoryError", "check",
    "Device", "get_device", "require_device",
    "Arena", "DeviceArray", "PinnedBuffer", "empty", "to_device", "upload_chunked",
    "Event", "Stream", "bench", "default_stream", "priority_range",
    "ARCHS", "CompiledModule", "cache_dir", "compile_all", "compile_family", "resolve_arch",
    "Kernel", "Launch", "get_kernel", "load_module", "plain_launches",
    "Capture", "GraphCache", "GraphExec", "bucket_for", "capture",
    "SmPartition", "shared_partition",
]
