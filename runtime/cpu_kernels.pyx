# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""CPU kernels of the cpu backend (runtime/backends/cpu_backend.py): the bf16 linear of cpu_linear.h and the
prefix + bitmask attention of cpu_attention.h.

`linear(x, w, out=None)`: out[M, N] = bf16(x)[M, K] @ W[N, K]^T for W in bf16 bits (uint16), x float32 rounded
to bf16 on the way in (as the CUDA backend's activations are); x @ W^T in float32 for W in float32. The GIL is
released while it runs; W's rows are split over OpenMP threads where the module was built with OpenMP (`openmp()`;
OMP_NUM_THREADS sets how many). The build used is the best this CPU runs (`isa()`: "avx512bf16", "avx2+fma",
"baseline"); DDTREE_CPU_ISA=avx2|baseline caps it at import, `isa=` per call (A/B timing, tests).

`attention(q, k_cache, v_cache, n_prefix, visibility, scale)`: the backend interface's attention op in float32,
a row's result depending only on its visible keys (see cpu_attention.h).

`rmsnorm(x, weight, eps)`: x / sqrt(mean(x^2) + eps) * weight over the last axis, float32, each row on its own
(the numpy form allocates four temporaries per call: 16 us of a SmolLM2 layer's ~400).
"""
import os

from libc.math cimport sqrtf
from libc.stdint cimport uint16_t, uint32_t

import numpy as np
cimport numpy as cnp

cnp.import_array()

__all__ = ["attention", "linear", "rmsnorm", "isa", "isa_levels", "openmp", "threads"]

cdef extern from "cpu_linear.h" nogil:
    int ddt_linear_bf16(const float *x, const uint16_t *w, float *out, Py_ssize_t M, Py_ssize_t N, Py_ssize_t K,
                        int level)
    void ddt_linear_f32(const float *x, const float *w, float *out, Py_ssize_t M, Py_ssize_t N, Py_ssize_t K,
                        int level)
    int ddt_isa_level()
    const char *ddt_isa_name(int level)

cdef extern from "cpu_attention.h" nogil:
    float ddt_dot(const float *a, const float *b, Py_ssize_t n)
    int ddt_attention(const float *q, const float *k, const float *v, const uint32_t *vis, float *out, Py_ssize_t T,
                      Py_ssize_t H, Py_ssize_t Hkv, Py_ssize_t D, Py_ssize_t Dv, Py_ssize_t n_prefix, Py_ssize_t W,
                      float scale, int level)

cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    static const int ddt_openmp = 1;
    static int ddt_threads(void) { return omp_get_max_threads(); }
    #else
    static const int ddt_openmp = 0;
    static int ddt_threads(void) { return 1; }
    #endif
    """
    const int ddt_openmp
    int ddt_threads()

_NAMES = {ddt_isa_name(level).decode(): level for level in range(ddt_isa_level() + 1)}
_CAPS = {"avx2": 1, "baseline": 0}


def _default_level() -> int:
    best = ddt_isa_level()
    cap = os.environ.get("DDTREE_CPU_ISA", "")
    if cap and cap not in _CAPS:
        raise ValueError(f"DDTREE_CPU_ISA={cap!r}: one of {', '.join(_CAPS)} (or unset: the best this CPU runs)")
    return min(best, _CAPS.get(cap, best))


cdef int _level = _default_level()


cdef int _isa_level(isa) except -1:
    """The level of a build name (None: the default build)."""
    if isa is None:
        return _level
    if isa not in _NAMES:
        raise ValueError(f"isa={isa!r}: this CPU runs {', '.join(_NAMES)}")
    return _NAMES[isa]


def isa() -> str:
    """The build the linear runs with by default here."""
    return ddt_isa_name(_level).decode()


def isa_levels() -> tuple:
    """Every build this CPU can run, worst first (the `isa=` values linear and attention take)."""
    return tuple(_NAMES)


def openmp() -> bool:
    """True when this build splits the linear over OpenMP threads."""
    return bool(ddt_openmp)


def threads() -> int:
    """How many threads the linear runs on (OpenMP's count: OMP_NUM_THREADS or the CPUs; 1 without OpenMP)."""
    return ddt_threads()


def linear(x, w, out=None, isa=None):
    """x float32 [M, K], w uint16 (bf16 bits) or float32 [N, K] -> float32 [M, N] (written into `out` when given)."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2:
        raise ValueError(f"linear: x must be a 2-D float32 array, got {getattr(x, 'dtype', type(x))} "
                         f"{getattr(x, 'shape', '')}")
    if not isinstance(w, np.ndarray) or w.dtype not in (np.uint16, np.float32) or w.ndim != 2:
        raise ValueError(f"linear: w must be a 2-D uint16 (bf16) or float32 array, got "
                         f"{getattr(w, 'dtype', type(w))} {getattr(w, 'shape', '')}")
    cdef Py_ssize_t M = x.shape[0], K = x.shape[1], N = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"linear: x is [M={M}, K={K}] but w is [N={N}, K={w.shape[1]}]")
    cdef int level = _isa_level(isa)
    if out is None:
        out = np.empty((M, N), np.float32)
    elif (not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != (M, N)
          or not out.flags.c_contiguous or not out.flags.writeable):
        raise ValueError(f"linear: out must be a writeable C-contiguous float32 [M={M}, N={N}] array")
    if M == 0 or N == 0:
        return out
    if K == 0:
        out[...] = 0
        return out
    cdef const float[:, ::1] xv = np.ascontiguousarray(x)
    cdef float[:, ::1] ov = out
    cdef const uint16_t[:, ::1] wb
    cdef const float[:, ::1] wf
    cdef int rc = 0
    if w.dtype == np.uint16:
        wb = np.ascontiguousarray(w)
        with nogil:
            rc = ddt_linear_bf16(&xv[0, 0], &wb[0, 0], &ov[0, 0], M, N, K, level)
    else:
        wf = np.ascontiguousarray(w)
        with nogil:
            ddt_linear_f32(&xv[0, 0], &wf[0, 0], &ov[0, 0], M, N, K, level)
    if rc != 0:
        raise MemoryError(f"linear: no memory for the bf16 copy of x [M={M}, K={K}]")
    return out


def attention(q, k_cache, v_cache, n_prefix, visibility, scale, isa=None):
    """q float32 [T, H, D]; k_cache [cap, Hkv, D] and v_cache [cap, Hkv, Dv] float32 (slots 0..n_prefix + T - 1
    are read); visibility uint32 [T, >= ceil(T / 32)] -> float32 [T, H, Dv]. isa as for linear (the
    attention has the avx2+fma and baseline builds; avx512bf16 runs the avx2+fma one)."""
    if q.ndim != 3 or k_cache.ndim != 3 or v_cache.ndim != 3:
        raise ValueError(f"attention: q [T, H, D], k/v caches [cap, Hkv, D]; got {q.shape}, {k_cache.shape}, "
                         f"{v_cache.shape}")
    cdef Py_ssize_t T = q.shape[0], H = q.shape[1], D = q.shape[2]
    cdef Py_ssize_t Hkv = k_cache.shape[1], Dv = v_cache.shape[2], P = n_prefix
    cdef Py_ssize_t n = P + T
    if (P < 0 or n > k_cache.shape[0] or n > v_cache.shape[0] or k_cache.shape[2] != D or D == 0
            or v_cache.shape[1] != Hkv or Hkv == 0 or H % Hkv != 0):
        raise ValueError(f"attention: q {q.shape}, n_prefix {P}, k_cache {k_cache.shape}, v_cache {v_cache.shape}: "
                         f"need n_prefix + T <= cap, matching D > 0, and H a multiple of Hkv")
    vis = np.ascontiguousarray(visibility, dtype=np.uint32)
    cdef Py_ssize_t W = vis.shape[1] if vis.ndim == 2 else 0
    if vis.ndim != 2 or vis.shape[0] != T or W * 32 < T:
        raise ValueError(f"attention: visibility must be uint32 [T={T}, >= {(T + 31) // 32}], got {vis.shape}")
    out = np.empty((T, H, Dv), np.float32)
    if T == 0 or H == 0 or Dv == 0:
        return out
    cdef const float[:, :, ::1] qv = np.ascontiguousarray(q, dtype=np.float32)
    cdef const float[:, :, ::1] kv = np.ascontiguousarray(k_cache[:n], dtype=np.float32)
    cdef const float[:, :, ::1] vv = np.ascontiguousarray(v_cache[:n], dtype=np.float32)
    cdef const uint32_t[:, ::1] visv = vis
    cdef float[:, :, ::1] ov = out
    cdef float sc = scale
    cdef int rc
    cdef int level = _isa_level(isa)
    with nogil:
        rc = ddt_attention(&qv[0, 0, 0], &kv[0, 0, 0], &vv[0, 0, 0], &visv[0, 0], &ov[0, 0, 0], T, H, Hkv, D, Dv, P,
                           W, sc, level)
    if rc != 0:
        raise MemoryError("attention: no memory for the score buffers")
    return out


def rmsnorm(x, weight, eps):
    """x float32 [..., D], weight float32 [D] -> float32 [..., D]: x / sqrt(mean(x^2) + eps) * weight per row, the
    squares summed by cpu_attention.h's ddt_dot (a fixed order)."""
    xc = np.ascontiguousarray(x, dtype=np.float32)
    wc = np.ascontiguousarray(weight, dtype=np.float32)
    if xc.ndim == 0 or wc.ndim != 1 or wc.shape[0] != xc.shape[xc.ndim - 1]:    # (no [-1]: wraparound is off)
        raise ValueError(f"rmsnorm: x [..., D] and weight [D], got {xc.shape} and {wc.shape}")
    out = np.empty_like(xc)
    cdef Py_ssize_t D = xc.shape[xc.ndim - 1], rows = xc.size // D if D else 0
    if rows == 0 or D == 0:
        return out
    cdef const float[:, ::1] xv = xc.reshape(rows, D)
    cdef const float[::1] wv = wc
    cdef float[:, ::1] ov = out.reshape(rows, D)
    cdef float e = eps
    cdef float denom
    cdef Py_ssize_t r, i
    with nogil:
        for r in range(rows):
            denom = sqrtf(ddt_dot(&xv[r, 0], &xv[r, 0], D) / <float>D + e)
            for i in range(D):
                ov[r, i] = xv[r, i] / denom * wv[i]
    return out
