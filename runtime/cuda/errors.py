"""The one error choke point for cuda.bindings: every driver and NVRTC call goes through `check`."""
from __future__ import annotations


class CudaError(Exception):
    """A driver call failed. .op names the call, .code / .name the CUDA error."""

    def __init__(self, op: str, code: int = -1, name: str = "", detail: str = ""):
        self.op, self.code, self.name, self.detail = op, int(code), name, detail
        msg = f"{op} failed" + (f": {name or code}" if name or code != -1 else "")
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class NoDeviceError(CudaError):
    """No usable GPU: no libcuda, cuInit failed, or no device. GPU tests skip on it."""


class OutOfMemoryError(CudaError):
    """Device or arena memory exhausted; the message says what was asked and what is held."""


class CompileError(Exception):
    """NVRTC failed to compile a kernel family; .log holds the program log."""

    def __init__(self, family: str, arch: str, log: str, kernel: str | None = None):
        self.family, self.arch, self.log, self.kernel = family, arch, log, kernel
        what = kernel or family
        super().__init__(f"NVRTC failed to compile {what} for sm_{arch}:\n{log.strip()[-8000:]}")

    def __reduce__(self):  # compile_all's worker processes send it back pickled: rebuild from the fields
        return (CompileError, (self.family, self.arch, self.log, self.kernel))


def _error_name(code) -> str:
    """CUDA enum -> its symbolic name, e.g. CUDA_ERROR_OUT_OF_MEMORY."""
    return getattr(code, "name", None) or str(code)


def check(result, op: str):
    """Take the tuple a cuda.bindings call returns, raise on error, return the rest
    (None for no values, the value for one, a tuple for several)."""
    if isinstance(result, tuple):
        code, rest = result[0], result[1:]
    else:
        code, rest = result, ()
    if int(code) != 0:
        name = _error_name(code)
        if "nvrtc" in type(code).__name__.lower():
            raise CudaError(op, int(code), name)
        if name == "CUDA_ERROR_OUT_OF_MEMORY":
            raise OutOfMemoryError(op, int(code), name)
        if name in ("CUDA_ERROR_NO_DEVICE", "CUDA_ERROR_INSUFFICIENT_DRIVER"):
            raise NoDeviceError(op, int(code), name)
        raise CudaError(op, int(code), name)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest
