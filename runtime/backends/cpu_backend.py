"""The CPU backend ddtree-run uses where no GPU is: the numpy backend's ops, with bf16 weights and C kernels.

The numpy backend (numpy_backend.py) is the float32 oracle every kernel is checked against; it widens every
weight to float32 and leaves the products to BLAS. On a CPU a decode step streams every weight once, so this
backend computes the linears of bf16 weights as the CUDA backend does: the weights held in bf16 (half the bytes
and half the memory), activations rounded to bf16 on the way in, float32 sums (runtime.cpu_kernels.linear,
cpu_linear.h: AVX512-BF16 or AVX2/FMA tiles, OpenMP over weight rows). Float32 weights (float checkpoints,
DeepSeek's router) stay float32, x too, through the same tiles.
Attention is cpu_kernels.attention (cpu_attention.h, float32), rmsnorm cpu_kernels.rmsnorm, and RoPE reads its
cos / sin from a table (numpy's values). Logits stay within bf16-activation rounding of the numpy backend's
(tests/test_cpu_backend.py). SwiGLU, sampling, MoE routing and experts and DeepSeek's per-head products are the
numpy backend's.

Every op of the llama family gives a row the same bits whatever other rows share the call, so a tree verify scores
each node exactly as the AR step of that token would: DDTree == AR here bit for bit (the numpy backend's BLAS
attention does not promise that; nor do DeepSeek's expert and per-head products, which stay on BLAS).
"""
from __future__ import annotations

import numpy as np

from runtime.bf16 import from_bf16
from runtime import cpu_kernels
from .numpy_backend import NumpyBackend


class CpuBackend(NumpyBackend):
    name = "cpu"

    def __init__(self, blas_threads: int | None = 1):
        super().__init__(blas_threads)
        self._rope_tables: dict = {}        # rope: (inv_freq bytes, scaling) -> (cos, sin) [positions, D/2]

    def describe(self) -> str:
        n = cpu_kernels.threads()
        return f"bf16 weights, linear on {n} thread{'s' if n != 1 else ''}, {cpu_kernels.isa()}"

    # ---- weights: dense matrices in bf16 (uint16 bits), the rest as in the numpy backend -------------------
    def dense_weight(self, w):
        """A 2-D bf16 weight stays bf16 bits; anything else is the numpy backend's float32 (float checkpoints, and
        weights a model widens on purpose, such as DeepSeek's router), multiplied in float32 by the same kernel."""
        w = np.asarray(w)
        if w.ndim == 2 and w.dtype == np.uint16:
            return np.ascontiguousarray(w)
        return super().dense_weight(w)

    # ---- ops with their own implementation here --------------------------------------------------------------
    def embedding(self, table, ids):
        rows = table[np.asarray(ids, dtype=np.int64)]
        return from_bf16(rows).reshape(rows.shape) if rows.dtype == np.uint16 else rows

    def rmsnorm(self, x, weight, eps):
        return cpu_kernels.rmsnorm(x, weight, eps)

    def rope(self, x, positions, inv_freq, attention_scaling, interleaved):
        """The numpy backend's rotation with cos / sin rows looked up in a per-(inv_freq, scaling) table that grows
        with the positions seen (the same float32 values numpy computes per call, without the per-call cos / sin)."""
        key = (inv_freq.tobytes(), float(attention_scaling))
        cos_t, sin_t = self._rope_tables.get(key, (None, None))
        pos = np.asarray(positions, dtype=np.int64)
        need = int(pos.max()) + 1 if pos.size else 0
        if cos_t is None or need > len(cos_t):
            n = max(need, 2 * len(cos_t) if cos_t is not None else 256)
            angle = np.arange(n, dtype=np.float32)[:, None] * inv_freq[None, :]
            cos_t = np.cos(angle) * np.float32(attention_scaling)
            sin_t = np.sin(angle) * np.float32(attention_scaling)
            self._rope_tables[key] = (cos_t, sin_t)
        return self.rotate(x, cos_t[pos], sin_t[pos], interleaved)

    def attention(self, q, k_cache, v_cache, n_prefix, visibility, scale):
        return cpu_kernels.attention(q, k_cache, v_cache, n_prefix, visibility, scale)

    def linear(self, x, w, bias=None):
        lead = x.shape[:-1]
        y = cpu_kernels.linear(np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1]), w)
        y = y.reshape(*lead, w.shape[0])
        return y if bias is None else y + bias
