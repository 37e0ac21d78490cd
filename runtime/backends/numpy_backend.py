"""float32 numpy implementation of the backend interface: the reference every CUDA and CPU kernel is checked
against (ddtree-run's CPU backend is cpu_backend.py: these ops with bf16 weights and C kernels). Weights are held
in float32 (bf16 bits widened exactly, INT4 dequantised once at load); every op is vectorised over tokens and
heads."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.bf16 import from_bf16
from runtime.philox import position_uniforms
from .base import Backend, unpack_visibility


def _f32(w: np.ndarray) -> np.ndarray:
    if w.dtype == np.uint16:
        return from_bf16(w).reshape(w.shape)
    return np.ascontiguousarray(w, dtype=np.float32)


@dataclass
class Experts:
    gate_up: np.ndarray   # [E, 2I, hidden]: gate rows then up rows, one matmul per expert
    down: np.ndarray      # [E, hidden, I]


def set_blas_threads(n: int) -> bool:
    """Limit the OpenBLAS that numpy loaded to n threads (process-wide). Returns False when no OpenBLAS with a
    known setter is loaded. Why: decode/verify matmuls are small, and waking BLAS worker threads between
    them costs more than they save (SmolLM2-135M decode on a 2-core VM: 52 ms/token with 1 thread, 256 ms
    with 2)."""
    import ctypes
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "openblas" in line.lower() and ".so" in line}
    except OSError:
        return False
    for path in libs:
        lib = ctypes.CDLL(path)
        for sym in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads"):
            fn = getattr(lib, sym, None)
            if fn is not None:
                fn(ctypes.c_int(n))
                return True
    return False


class NumpyBackend(Backend):
    """blas_threads: passed to set_blas_threads at construction (None leaves numpy's BLAS as it is)."""
    name = "numpy"

    def __init__(self, blas_threads: int | None = 1):
        if blas_threads is not None:
            set_blas_threads(blas_threads)

    # ---- memory -------------------------------------------------------------------------------------------
    def empty(self, shape, dtype=np.float32):
        return np.empty(tuple(shape), dtype=dtype)

    def from_host(self, x):
        return np.array(x, copy=True)

    def to_host(self, x):
        return np.array(x, copy=True)

    # ---- weights ------------------------------------------------------------------------------------------
    def dense_weight(self, w):
        return _f32(w)

    def int4_weight(self, weight_packed, weight_scale, weight_shape):
        from loader.int4 import unpack_int4
        return _f32(unpack_int4(weight_packed, weight_scale, weight_shape))

    def stack_experts(self, gate, up, down):
        gate_up = np.stack([np.concatenate([g, u], axis=0) for g, u in zip(gate, up)])
        return Experts(gate_up=np.ascontiguousarray(gate_up), down=np.ascontiguousarray(np.stack(down)))

    def head_weight(self, w):
        return _f32(w)

    # ---- ops ----------------------------------------------------------------------------------------------
    def embedding(self, table, ids):
        return table[np.asarray(ids, dtype=np.int64)]

    def rmsnorm(self, x, weight, eps):
        var = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
        return (x / np.sqrt(var + np.float32(eps))) * weight

    def linear(self, x, w, bias=None):
        # W @ x^T, not x @ W^T: BLAS runs the former 1.5-2.3x faster at 5..17 rows (the verify and draft sizes) and
        # 1.1-1.3x at 65..256 on this project's CPU machine (OpenBLAS, 2 cores; PERF.md session (21))
        y = np.ascontiguousarray((w @ x.T).T) if x.ndim == 2 else x @ w.T
        return y if bias is None else y + bias

    def head_linear(self, x, w):
        return np.matmul(x.transpose(1, 0, 2), w).transpose(1, 0, 2)

    def add(self, a, b):
        return a + b

    def concat(self, parts, axis=-1):
        return np.concatenate(parts, axis=axis)

    def swiglu(self, gate, up):
        return gate / (np.float32(1.0) + np.exp(-gate)) * up

    def rope(self, x, positions, inv_freq, attention_scaling, interleaved):
        angle = np.asarray(positions, dtype=np.float32)[:, None] * inv_freq[None, :]      # [T, D/2]
        cos = np.cos(angle) * np.float32(attention_scaling)
        sin = np.sin(angle) * np.float32(attention_scaling)
        return self.rotate(x, cos, sin, interleaved)

    @staticmethod
    def rotate(x, cos, sin, interleaved):
        """rope's rotation of x [T, H, D] by cos / sin [T, D/2] (already scaled)."""
        cos, sin = cos[:, None, :], sin[:, None, :]
        half = x.shape[-1] // 2
        if interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def kv_write(self, cache, start, values):
        cache[start:start + values.shape[0]] = values

    def attention(self, q, k_cache, v_cache, n_prefix, visibility, scale):
        t, h, dk = q.shape
        hkv = k_cache.shape[1]
        g = h // hkv
        n = n_prefix + t
        k = k_cache[:n].transpose(1, 2, 0)                            # [Hkv, Dk, n]
        v = v_cache[:n].transpose(1, 0, 2)                            # [Hkv, n, Dv]
        qg = q.reshape(t, hkv, g, dk).transpose(1, 2, 0, 3).reshape(hkv, g * t, dk)
        s = np.matmul(qg, k) * np.float32(scale)                     # [Hkv, g*t, n]
        s = s.reshape(hkv, g, t, n)
        visible = unpack_visibility(np.asarray(visibility), t)        # [t, t]
        s[..., n_prefix:] = np.where(visible, s[..., n_prefix:], -np.inf)
        s -= s.max(axis=-1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=-1, keepdims=True)
        o = np.matmul(p.reshape(hkv, g * t, n), v)                   # [Hkv, g*t, Dv]
        return o.reshape(hkv, g, t, -1).transpose(2, 0, 1, 3).reshape(t, h, -1)

    def kv_compact(self, cache, src_slots, dst_start):
        src = np.asarray(src_slots, dtype=np.int64)
        cache[dst_start:dst_start + len(src)] = cache[src]          # fancy indexing copies first

    def moe_route(self, router_logits, bias, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor):
        t, e = router_logits.shape
        scores = 1.0 / (1.0 + np.exp(-router_logits.astype(np.float32)))
        choice = scores + bias if bias is not None else scores
        grouped = choice.reshape(t, n_group, e // n_group)
        group_scores = -np.sort(-grouped, axis=-1)[..., :2].sum(axis=-1)                   # [T, G]
        keep_groups = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_group]
        group_mask = np.zeros((t, n_group), dtype=bool)
        np.put_along_axis(group_mask, keep_groups, True, axis=-1)
        masked = np.where(np.repeat(group_mask, e // n_group, axis=-1), choice, -np.inf)
        ids = np.argsort(-masked, axis=-1, kind="stable")[:, :top_k]
        weights = np.take_along_axis(scores, ids, axis=-1)
        if norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + np.float32(1e-20))
        return ids.astype(np.int32), (weights * np.float32(routed_scaling_factor)).astype(np.float32)

    def moe_experts(self, x, expert_ids, expert_weights, experts):
        out = np.zeros_like(x)
        inter = experts.down.shape[2]
        for e in np.unique(expert_ids):
            rows, slot = np.nonzero(expert_ids == e)
            gu = x[rows] @ experts.gate_up[e].T
            y = self.swiglu(gu[:, :inter], gu[:, inter:]) @ experts.down[e].T
            np.add.at(out, rows, y * expert_weights[rows, slot][:, None])
        return out

    def log_softmax_topk(self, logits, k):
        logits = np.asarray(logits, dtype=np.float32)
        m = logits.max(axis=-1, keepdims=True)
        logp = logits - m - np.log(np.sum(np.exp(logits - m), axis=-1, keepdims=True))
        rows, v = logp.shape
        if not 1 <= k <= v:
            raise ValueError(f"log_softmax_topk: k = {k} must be in 1..V = {v}")
        # Candidates: every entry >= a threshold at or below the k-th largest value, then sorted by (value desc,
        # id asc), which keeps the lower ids among entries tied with the k-th as the contract says. The threshold
        # is the k-th largest of the maxima of >= k chunks of the row: at least k entries reach it, and far fewer
        # than V pass it (a partition of the whole row cost 0.3 ms per row of 49152 on the CPU).
        chunk = max(1, v // max(k, 256))
        n_chunks = -(-v // chunk)
        padded = np.full((rows, n_chunks * chunk), -np.inf, np.float32)
        padded[:, :v] = logp
        maxima = padded.reshape(rows, n_chunks, chunk).max(axis=-1)
        threshold = np.partition(maxima, n_chunks - k, axis=-1)[:, n_chunks - k]
        ids = np.empty((rows, k), np.int64)
        for r in range(rows):
            cand = np.flatnonzero(logp[r] >= threshold[r])
            ids[r] = cand[np.lexsort((cand, -logp[r, cand]))[:k]]
        return np.take_along_axis(logp, ids, axis=-1).astype(np.float32), ids.astype(np.int32)

    def argmax(self, logits):
        return np.argmax(logits, axis=-1).astype(np.int32)

    def sample(self, logits, temperature, positions, key):
        return self.sample_with_uniforms(logits, temperature, position_uniforms(key, positions))

    @staticmethod
    def sample_with_uniforms(logits, temperature, uniforms):
        """The inverse CDF of `sample` with explicit uniforms [T] in [0, 1)."""
        z = np.asarray(logits, dtype=np.float64) / float(temperature)
        p = np.exp(z - z.max(axis=-1, keepdims=True))
        cdf = np.cumsum(p, axis=-1)
        target = np.asarray(uniforms, dtype=np.float64)[:, None] * cdf[:, -1:]
        idx = np.sum(cdf <= target, axis=-1)                        # first index with cdf > u * total
        return np.minimum(idx, logits.shape[-1] - 1).astype(np.int32)
