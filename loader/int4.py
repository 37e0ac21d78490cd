"""compressed-tensors `pack-quantized` INT4 (symmetric, group 32), as Kimi K2.x stores its routed experts.

On disk, per quantized Linear `<module>`:
  <module>.weight_packed  int32 [N, K/8]   element 8p+i of a row in bits 4i..4i+3, stored as q+8 (uint4b8)
  <module>.weight_scale   bf16  [N, K/group]
  <module>.weight_shape   int32/int64 [2] = (N, K)
Dequant: w[n, k] = (nibble - 8) * scale[n, k // group].

The INT4 MoE kernel wants its own layout. Its owner registers a repack function here
(`register_int4_repacker`); `repack_int4_for_kernel` runs it once per tensor and caches the result on disk
as a safetensors file, so later loads mmap the repacked bytes instead of redoing the work.
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from runtime.bf16 import from_bf16
from .errors import LoadError
from .spec import QuantSpec

GROUP_SIZE = 32


def _shape_of(weight_shape) -> tuple[int, int]:
    ws = np.asarray(weight_shape).reshape(-1)
    if ws.size != 2 or not np.issubdtype(ws.dtype, np.integer):
        raise ValueError(f"weight_shape should be two integers, got {weight_shape!r}")
    return int(ws[0]), int(ws[1])


def check_int4(weight_packed: np.ndarray, weight_scale: np.ndarray, weight_shape, group_size: int = GROUP_SIZE,
               path=None, name: str | None = None) -> tuple[int, int]:
    """Validate a packed INT4 tensor triple against weight_shape; returns (N, K). LoadError on mismatch."""
    try:
        n, k = _shape_of(weight_shape)
    except ValueError as e:
        raise LoadError(str(e), path, name) from None
    if n <= 0 or k <= 0 or k % 8:
        raise LoadError(f"weight_shape {(n, k)}: K must be a positive multiple of 8", path, name)
    if weight_packed.dtype not in (np.int32, np.uint32):
        raise LoadError(f"weight_packed should be int32, got {weight_packed.dtype}", path, name)
    if weight_scale.dtype != np.uint16 and weight_scale.dtype.kind != "f":
        raise LoadError(f"weight_scale should be bf16 bits (uint16) or floats, got {weight_scale.dtype}", path, name)
    if tuple(weight_packed.shape) != (n, k // 8):
        raise LoadError(f"weight_packed shape {tuple(weight_packed.shape)} disagrees with weight_shape {(n, k)} "
                        f"(expected {(n, k // 8)})", path, name)
    groups = -(-k // group_size)
    if tuple(weight_scale.shape) != (n, groups):
        raise LoadError(f"weight_scale shape {tuple(weight_scale.shape)} disagrees with weight_shape {(n, k)} "
                        f"and group {group_size} (expected {(n, groups)})", path, name)
    return n, k


def unpack_int4_codes(weight_packed: np.ndarray, k: int) -> np.ndarray:
    """int32 [N, K/8] -> int8 [N, K] signed codes in [-8, 7]."""
    words = np.ascontiguousarray(weight_packed).view(np.uint32)
    shifts = (np.arange(8, dtype=np.uint32) * 4)
    nibbles = (words[:, :, None] >> shifts) & np.uint32(0xF)        # [N, K/8, 8]: element 8p+i at [p, i]
    return (nibbles.reshape(words.shape[0], k).astype(np.int8) - np.int8(8))


def unpack_int4(weight_packed: np.ndarray, weight_scale: np.ndarray, weight_shape,
                group_size: int = GROUP_SIZE) -> np.ndarray:
    """Reference dequant -> float32 [N, K]. weight_scale: bf16 bits (uint16, as a checkpoint stores them) or
    float values (a converted f16/f32 scale); its dtype says which, so a float scale is never read as bits."""
    n, k = check_int4(weight_packed, weight_scale, weight_shape, group_size)
    codes = unpack_int4_codes(weight_packed, k).astype(np.float32)
    scale = from_bf16(weight_scale).reshape(weight_scale.shape) if weight_scale.dtype == np.uint16 \
        else np.asarray(weight_scale, np.float32)
    scale_full = np.repeat(scale, group_size, axis=1)[:, :k]
    return codes * scale_full


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """int [N, K] codes in [-8, 7] -> int32 [N, K/8] (the inverse of unpack_int4_codes)."""
    codes = np.asarray(codes)
    n, k = codes.shape
    if k % 8:
        raise ValueError(f"K={k} must be a multiple of 8")
    if codes.min(initial=0) < -8 or codes.max(initial=0) > 7:
        raise ValueError("INT4 codes must lie in [-8, 7]")
    nib = (codes.astype(np.int64) + 8).astype(np.uint32).reshape(n, k // 8, 8)
    words = np.zeros((n, k // 8), np.uint32)
    for i in range(8):
        words |= nib[:, :, i] << np.uint32(4 * i)
    return words.view(np.int32)


# ---------------------------------------------------------------------------------------------------------
# Which modules are quantized (compressed-tensors `targets` + `ignore`).

def is_quantized(quant: QuantSpec | None, module: str, module_type: str = "Linear") -> bool:
    """True if `module` (e.g. 'model.layers.3.mlp.experts.7.up_proj') of class `module_type` is quantized.
    targets: a class name, an exact module name or a 're:' pattern matching the whole name. ignore: exact module
    names or 're:' patterns matched from the start of the name (re.match, as compressed-tensors does; the
    Kimi patterns end in '.*' anyway)."""
    if quant is None:
        return False
    if not any(t == module_type or t == module or (t.startswith("re:") and re.fullmatch(t[3:], module))
               for t in quant.targets):
        return False
    for pat in quant.ignore:
        if pat.startswith("re:"):
            if re.match(pat[3:], module):
                return False
        elif pat == module:
            return False
    return True


# ---------------------------------------------------------------------------------------------------------
# Repack hook for the INT4 MoE kernel, with an on-disk cache.

@dataclass(frozen=True)
class Int4Repacker:
    """fn(weight_packed int32 [N,K/8], weight_scale uint16 bf16 [N,K/32], (N, K)) -> {name: ndarray}.
    Bump `version` whenever the produced layout changes: it is part of the cache key."""
    name: str
    version: str
    fn: Callable[[np.ndarray, np.ndarray, tuple[int, int]], Mapping[str, np.ndarray]]


_REPACKER: Int4Repacker | None = None


def register_int4_repacker(fn, name: str = "default", version: str = "1") -> None:
    """Install the kernel-layout repack function (the INT4 MoE kernel module calls this once at import)."""
    global _REPACKER
    _REPACKER = Int4Repacker(name, str(version), fn)


def int4_cache_dir() -> Path:
    env = os.environ.get("DDTREE_INT4_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "ddtree" / "int4"


def repack_int4_for_kernel(weight_packed: np.ndarray, weight_scale: np.ndarray, weight_shape,
                           cache_key: str | None = None, cache_dir: os.PathLike | str | None = None,
                           use_cache: bool = True) -> dict[str, np.ndarray]:
    """Run the registered repacker (validated input), caching its output on disk.

    cache_key: a cheap identity of the input (e.g. Checkpoint.fingerprint of weight_packed); without one the
    input bytes are hashed. The cache file is <cache_dir>/<repacker>-<version>/<sha256>.safetensors, written
    to a temp file and renamed. Returns plain numpy arrays (mmap views when read from the cache)."""
    from .checkpoint import SafetensorsFile, save_safetensors

    if _REPACKER is None:
        raise LoadError("no INT4 repacker registered: import the INT4 MoE kernel module (it calls "
                        "loader.int4.register_int4_repacker) before repacking")
    shape = check_int4(weight_packed, weight_scale, weight_shape)
    rp = _REPACKER
    if not use_cache:
        return dict(rp.fn(weight_packed, weight_scale, shape))
    h = hashlib.sha256(f"{rp.name}|{rp.version}|{shape}".encode())
    if cache_key is not None:
        h.update(cache_key.encode())
    else:
        h.update(np.ascontiguousarray(weight_packed).tobytes())
        h.update(np.ascontiguousarray(weight_scale).tobytes())
    folder = Path(cache_dir) if cache_dir is not None else int4_cache_dir()
    path = folder / f"{rp.name}-{rp.version}" / f"{h.hexdigest()}.safetensors"
    if path.is_file():
        try:
            f = SafetensorsFile(path)
            return {name: f.tensor(name) for name in f.infos}
        except LoadError:
            pass   # a damaged cache entry is rebuilt below and replaced
    out = {k: np.ascontiguousarray(v) for k, v in rp.fn(weight_packed, weight_scale, shape).items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_safetensors(path, out, metadata={"repacker": rp.name, "version": rp.version})
    return out


def read_module(ckpt, module: str, group_size: int = GROUP_SIZE):
    """(weight_packed, weight_scale, (N, K)) of one quantized Linear in a Checkpoint, validated, with errors
    naming the checkpoint file and tensor."""
    names = [f"{module}.weight_packed", f"{module}.weight_scale", f"{module}.weight_shape"]
    for n in names:
        if n not in ckpt:
            raise LoadError("missing INT4 tensor", ckpt.source, n)
    packed, scale, shape = (ckpt.tensor(n) for n in names)
    if ckpt.info(names[1])[0] != "BF16":
        raise LoadError(f"weight_scale should be BF16, got {ckpt.info(names[1])[0]}", ckpt.path_of(names[1]),
                        names[1])
    nk = check_int4(packed, scale, shape, group_size, ckpt.path_of(names[0]), names[0])
    return packed, scale, nk


def repack_module(ckpt, module: str, cache_dir: os.PathLike | str | None = None) -> dict[str, np.ndarray]:
    """repack_int4_for_kernel for one quantized Linear of a Checkpoint, keyed by the tensors' file identity
    (no hashing of the bytes)."""
    packed, scale, nk = read_module(ckpt, module)
    key = ckpt.fingerprint(f"{module}.weight_packed") + ckpt.fingerprint(f"{module}.weight_scale")
    return repack_int4_for_kernel(packed, scale, nk, cache_key=key, cache_dir=cache_dir)


def dequant_module(ckpt, module: str) -> np.ndarray:
    """float32 [N, K] of one quantized Linear of a Checkpoint (the reference dequant)."""
    packed, scale, nk = read_module(ckpt, module)
    return unpack_int4(packed, scale, nk)
