"""The CPU backend ddtree-run uses where no GPU is: the numpy backend's ops, with bf16 weights and its own linear.

The numpy backend (numpy_backend.py) is the float32 oracle every kernel is checked against; it widens every
weight to float32 and leaves the products to BLAS. On a CPU a decode step streams every weight once, so this
backend holds weight matrices in bf16, as the CUDA backend does (half the bytes and half the memory), and
multiplies them with runtime.cpu_kernels.linear_bf16 (cpu_linear.h: AVX2/FMA tiles of up to 4 rows, OpenMP
over weight rows). For bf16 checkpoints the values are the numpy backend's (bf16 widens exactly) and only the
order of the sums differs, so logits agree to float32 rounding; float32 checkpoints are rounded to bf16 once.
The linear gives a row the same bits whatever other rows share the call (a tree verify and an AR step sum a
token's products alike). Everything else (attention, norms, sampling, INT4 MoE experts) is the numpy backend's.
"""
from __future__ import annotations

import numpy as np

from runtime.bf16 import from_bf16, to_bf16
from runtime import cpu_kernels
from runtime.cpu_kernels import linear_bf16
from .numpy_backend import NumpyBackend


class CpuBackend(NumpyBackend):
    name = "cpu"

    def describe(self) -> str:
        n = cpu_kernels.threads()
        return f"bf16 weights, linear on {n} thread{'s' if n != 1 else ''}, {cpu_kernels.isa()}"

    # ---- weights: dense matrices in bf16 (uint16 bits), the rest as in the numpy backend -------------------
    def dense_weight(self, w):
        """A 2-D weight as bf16 bits: bf16 checkpoints as they are, float ones rounded once, as the CUDA backend
        does (exact for values that were bf16, such as the widened ones models pass). Vectors stay float32."""
        w = np.asarray(w)
        if w.ndim != 2:
            return super().dense_weight(w)
        bits = w if w.dtype == np.uint16 else to_bf16(np.asarray(w, np.float32)).reshape(w.shape)
        return np.ascontiguousarray(bits)

    # ---- ops that read a weight matrix ---------------------------------------------------------------------
    def embedding(self, table, ids):
        rows = table[np.asarray(ids, dtype=np.int64)]
        return from_bf16(rows).reshape(rows.shape) if rows.dtype == np.uint16 else rows

    def linear(self, x, w, bias=None):
        if w.dtype != np.uint16:
            return super().linear(x, w, bias)
        lead = x.shape[:-1]
        y = linear_bf16(np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1]), w)
        y = y.reshape(*lead, w.shape[0])
        return y if bias is None else y + bias
