# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""CPU kernels of the cpu backend (runtime/backends/cpu_backend.py): the bf16 linear of cpu_linear.h.

`linear_bf16(x, w, out=None)`: out[M, N] = bf16(x)[M, K] @ W[N, K]^T with x float32 (rounded to bf16 on the way
in, as the CUDA backend's activations are), W bf16 bits (uint16), out float32. The GIL is released while it
runs; W's rows are split over OpenMP threads where the module was built with OpenMP (`openmp()`;
OMP_NUM_THREADS sets how many). The build used is the best this CPU runs (`isa()`: "avx512bf16", "avx2+fma",
"baseline"); DDTREE_CPU_ISA=avx2|baseline caps it at import, `isa=` per call (A/B timing, tests).
"""
import os

from libc.stdint cimport uint16_t

import numpy as np
cimport numpy as cnp

cnp.import_array()

__all__ = ["linear_bf16", "isa", "isa_levels", "openmp", "threads"]

cdef extern from "cpu_linear.h" nogil:
    int ddt_linear_bf16(const float *x, const uint16_t *w, float *out, Py_ssize_t M, Py_ssize_t N, Py_ssize_t K,
                        int level)
    int ddt_isa_level()
    const char *ddt_isa_name(int level)

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


def isa() -> str:
    """The build the linear runs with by default here."""
    return ddt_isa_name(_level).decode()


def isa_levels() -> tuple:
    """Every build this CPU can run, worst first (the `isa=` values linear_bf16 takes)."""
    return tuple(_NAMES)


def openmp() -> bool:
    """True when this build splits the linear over OpenMP threads."""
    return bool(ddt_openmp)


def threads() -> int:
    """How many threads the linear runs on (OpenMP's count: OMP_NUM_THREADS or the CPUs; 1 without OpenMP)."""
    return ddt_threads()


def linear_bf16(x, w, out=None, isa=None):
    """x float32 [M, K], w uint16 (bf16 bits) [N, K] -> float32 [M, N] (written into `out` when given)."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2:
        raise ValueError(f"linear_bf16: x must be a 2-D float32 array, got {getattr(x, 'dtype', type(x))} "
                         f"{getattr(x, 'shape', '')}")
    if not isinstance(w, np.ndarray) or w.dtype != np.uint16 or w.ndim != 2:
        raise ValueError(f"linear_bf16: w must be a 2-D uint16 (bf16) array, got {getattr(w, 'dtype', type(w))} "
                         f"{getattr(w, 'shape', '')}")
    cdef Py_ssize_t M = x.shape[0], K = x.shape[1], N = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"linear_bf16: x is [M={M}, K={K}] but w is [N={N}, K={w.shape[1]}]")
    cdef int level = _level
    if isa is not None:
        if isa not in _NAMES:
            raise ValueError(f"linear_bf16: isa={isa!r}: this CPU runs {', '.join(_NAMES)}")
        level = _NAMES[isa]
    if out is None:
        out = np.empty((M, N), np.float32)
    elif (not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != (M, N)
          or not out.flags.c_contiguous or not out.flags.writeable):
        raise ValueError(f"linear_bf16: out must be a writeable C-contiguous float32 [M={M}, N={N}] array")
    if M == 0 or N == 0:
        return out
    if K == 0:
        out[...] = 0
        return out
    cdef const float[:, ::1] xv = np.ascontiguousarray(x)
    cdef const uint16_t[:, ::1] wv = np.ascontiguousarray(w)
    cdef float[:, ::1] ov = out
    cdef int rc
    with nogil:
        rc = ddt_linear_bf16(&xv[0, 0], &wv[0, 0], &ov[0, 0], M, N, K, level)
    if rc != 0:
        raise MemoryError(f"linear_bf16: no memory for the bf16 copy of x [M={M}, K={K}]")
    return out
