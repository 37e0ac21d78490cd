"""Pieces every model shares: where weights come from, RoPE frequencies (default, linear, llama3, YaRN), and
the KV cache container."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from loader.spec import RopeScaling


class Weights:
    """Named host tensors in HF naming (float32, or uint16 bf16 bits), from any source: a dict (a state dict
    in tests), a loader Checkpoint (.names() / .tensor(name)), or a GGUFModel (.tensors dict).
    on_layer(i) is called at the first read of a tensor of layer i (HF names '...layers.{i}....'): a big model's
    load is slow, and the caller can show how far it got."""

    def __init__(self, source: Any, on_layer: Callable[[int], None] | None = None):
        self._on_layer, self._last_layer = on_layer, -1
        if isinstance(source, Weights):
            self._get, self._names = source._get, source._names
            self._on_layer = on_layer or source._on_layer
        elif isinstance(source, Mapping):
            self._get, self._names = source.__getitem__, lambda: list(source.keys())
        elif hasattr(source, "tensors") and isinstance(source.tensors, Mapping):        # GGUFModel
            self._get, self._names = source.tensors.__getitem__, lambda: list(source.tensors.keys())
        elif hasattr(source, "tensor") and hasattr(source, "names"):                     # Checkpoint
            self._get, self._names = source.tensor, lambda: list(source.names())
        else:
            raise TypeError(f"cannot read weights from {type(source).__name__}")
        self._cache: set[str] | None = None

    def names(self) -> set[str]:
        if self._cache is None:
            self._cache = set(self._names())
        return self._cache

    def has(self, name: str) -> bool:
        return name in self.names()

    def get(self, name: str) -> np.ndarray:
        if not self.has(name):
            raise KeyError(f"checkpoint has no tensor {name!r}")
        if self._on_layer is not None and ".layers." in name:
            i = int(name.split(".layers.", 1)[1].split(".", 1)[0])
            if i > self._last_layer:
                self._last_layer = i
                self._on_layer(i)
        a = np.asarray(self._get(name))
        if a.dtype.kind == "f" and a.dtype != np.float32:
            a = a.astype(np.float32)      # f16 / f64 sources; ints (INT4 packs, shapes) and bf16 bits stay
        return a


def as_f32(a: np.ndarray) -> np.ndarray:
    from runtime.bf16 import from_bf16
    return from_bf16(a).reshape(a.shape) if a.dtype == np.uint16 else np.asarray(a, np.float32)


def rope_parameters(dim: int, theta: float, rs: RopeScaling) -> tuple[np.ndarray, float]:
    """(inv_freq float32 [dim/2], attention_scaling) as HF computes them for each rope type."""
    inv_freq = (1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))).astype(np.float32)
    if rs.type == "default":
        return inv_freq, 1.0
    if rs.type == "linear":
        return (inv_freq / np.float32(rs.factor)).astype(np.float32), 1.0
    if rs.type == "llama3":
        old = rs.original_max_position_embeddings
        low_wl, high_wl = old / rs.low_freq_factor, old / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wl, inv_freq / rs.factor, inv_freq)
        smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    if rs.type == "yarn":
        return _yarn(dim, theta, rs)
    raise ValueError(f"unsupported rope type {rs.type!r}")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, rs: RopeScaling) -> tuple[np.ndarray, float]:
    factor = rs.factor
    if rs.mscale and rs.mscale_all_dim:
        attention_factor = yarn_mscale(factor, rs.mscale) / yarn_mscale(factor, rs.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor)

    def correction_dim(rotations):
        return dim * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(rs.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rs.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    pos_freqs = (theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))).astype(np.float32)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (np.float32(factor) * pos_freqs)
    extra_factor = 1 - ramp
    inv_freq = interpolation * (1 - extra_factor) + extrapolation * extra_factor
    return inv_freq.astype(np.float32), float(attention_factor)


@dataclass
class KVCache:
    """Per-layer static buffers [capacity, heads, dim] (`k`, `v`; for MLA `v` is a view of `k`). `length` is
    the number of committed slots; a forward writes its tokens at slots length..length+T-1 and the engine
    advances `length` only over what it keeps."""
    k: list
    v: list
    capacity: int
    length: int = 0
    v_is_view_of_k: bool = False    # MLA: compacting k already moved v

    def compact(self, backend, src_slots, dst_start: int) -> None:
        """Move the KV of slots src_slots[i] to dst_start + i in every layer (after an accept walk)."""
        for k, v in zip(self.k, self.v):
            backend.kv_compact(k, src_slots, dst_start)
            if not self.v_is_view_of_k:
                backend.kv_compact(v, src_slots, dst_start)


def build_kv_cache(backend, n_layers: int, capacity: int, k_shape: tuple, v_shape: tuple | None,
                   v_from_k: Callable | None = None) -> KVCache:
    ks, vs = [], []
    for _ in range(n_layers):
        k = backend.empty((capacity, *k_shape))
        ks.append(k)
        vs.append(v_from_k(k) if v_from_k is not None else backend.empty((capacity, *v_shape)))
    return KVCache(k=ks, v=vs, capacity=capacity, v_is_view_of_k=v_from_k is not None)
