"""bfloat16 on the host. numpy has no bf16 dtype, so bf16 arrays live as uint16 bit patterns; these two
functions are the only conversions the project uses (loader, numpy backend, kernel tests)."""
import numpy as np


def to_bf16(x) -> np.ndarray:
    """float array -> uint16 bf16 bits, round to nearest even; NaN stays NaN (quiet)."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    bits = f.view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    out = (rounded >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return out


def from_bf16(b) -> np.ndarray:
    """uint16 bf16 bits -> float32 (exact)."""
    u = np.ascontiguousarray(b, dtype=np.uint16)
    return (u.astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_bf16(x) -> np.ndarray:
    """float32 values rounded through bf16 (what a bf16 store then load gives)."""
    return from_bf16(to_bf16(x))
