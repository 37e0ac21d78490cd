/* bf16-weight linear for the CPU backend: out[M, N] = x[M, K] @ W[N, K]^T, x and out float32, W bf16 (uint16 bits).

Why: the numpy backend holds every weight in float32 and leaves small-M products to BLAS. On CPUs a decode or
verify step streams all weights once, so bf16 halves the bytes; and OpenBLAS's sgemm at 5..17 rows runs at a
fraction of what the FMA units do. Here each weight vector is loaded and widened once per tile of up to 4 rows
of x (the tree verify and the drafter block have 5..17 rows), with the next tile's weights prefetched.

The product of two floats widened from bf16/fp32 is exact in float32 before rounding, so the only difference
from the float32 backend is the order of the sums (8 lanes, then a fixed pairwise reduction), as between BLASes.

Vectors are GCC/Clang vector extensions (8 x float32: one AVX2 register, two SSE/NEON ones). On x86-64 the
entry point picks an AVX2+FMA build of the same loops at run time; elsewhere the compiler's baseline is used.
Rows of W are split over OpenMP threads when the module is built with OpenMP. */
#ifndef DDTREE_CPU_LINEAR_H
#define DDTREE_CPU_LINEAR_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define DDT_ROWS_X 4   /* rows of x per tile: 4 x 2 accumulators + 2 weight + 1 x vector fit 16 AVX2 registers */
#define DDT_ROWS_W 2   /* rows of W per tile */

static inline float ddt_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

#if defined(__GNUC__)
typedef float ddt_v8f __attribute__((vector_size(32)));
typedef uint32_t ddt_v8u __attribute__((vector_size(32)));
typedef uint16_t ddt_v8h __attribute__((vector_size(16)));
#define DDT_INLINE static inline __attribute__((always_inline))

DDT_INLINE ddt_v8f ddt_load_bf16(const uint16_t *p) {
  ddt_v8h h;
  memcpy(&h, p, 16);
  ddt_v8u u = __builtin_convertvector(h, ddt_v8u) << 16;
  ddt_v8f f;
  memcpy(&f, &u, 32);
  return f;
}

DDT_INLINE ddt_v8f ddt_load_f32(const float *p) {
  ddt_v8f f;
  memcpy(&f, p, 32);
  return f;
}

DDT_INLINE float ddt_hsum(ddt_v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* One tile: rows m..m+MT-1 of x against rows n..n+NT-1 of W; K8 = K rounded down to 8, the rest in scalars. */
#define DDT_TILE(MT, NT)                                                                                    \
  DDT_INLINE void ddt_tile_##MT##_##NT(const float *x, const uint16_t *w, float *out, ptrdiff_t N,         \
                                       ptrdiff_t K, ptrdiff_t n, ptrdiff_t m) {                            \
    ddt_v8f acc[MT][NT];                                                                                    \
    for (int i = 0; i < MT; i++)                                                                            \
      for (int j = 0; j < NT; j++) acc[i][j] = (ddt_v8f){0, 0, 0, 0, 0, 0, 0, 0};                         \
    const uint16_t *w0 = w + n * K;                                                                         \
    const float *x0 = x + m * K;                                                                            \
    const ptrdiff_t K8 = K & ~(ptrdiff_t)7;                                                                 \
    for (ptrdiff_t k = 0; k < K8; k += 8) {                                                                 \
      if ((k & 31) == 0) /* one 64-byte line of each of the next tile's rows */                            \
        for (int j = 0; j < NT; j++) __builtin_prefetch(w0 + (NT + j) * K + k);                            \
      ddt_v8f wv[NT];                                                                                       \
      for (int j = 0; j < NT; j++) wv[j] = ddt_load_bf16(w0 + j * K + k);                                  \
      for (int i = 0; i < MT; i++) {                                                                        \
        ddt_v8f xv = ddt_load_f32(x0 + i * K + k);                                                         \
        for (int j = 0; j < NT; j++) acc[i][j] += xv * wv[j];                                              \
      }                                                                                                     \
    }                                                                                                       \
    for (int i = 0; i < MT; i++)                                                                            \
      for (int j = 0; j < NT; j++) {                                                                        \
        float s = ddt_hsum(acc[i][j]);                                                                      \
        for (ptrdiff_t k = K8; k < K; k++) s += x0[i * K + k] * ddt_bf16_to_f32(w0[j * K + k]);            \
        out[(m + i) * N + n + j] = s;                                                                       \
      }                                                                                                     \
  }

DDT_TILE(1, 2) DDT_TILE(2, 2) DDT_TILE(3, 2) DDT_TILE(4, 2)
DDT_TILE(1, 1) DDT_TILE(2, 1) DDT_TILE(3, 1) DDT_TILE(4, 1)

/* Rows n..n+nt-1 of W (nt = 1 or 2) against every row of x. */
#define DDT_ROW_BLOCK(NT)                                                                                   \
  DDT_INLINE void ddt_row_block_##NT(const float *x, const uint16_t *w, float *out, ptrdiff_t M,           \
                                     ptrdiff_t N, ptrdiff_t K, ptrdiff_t n) {                              \
    ptrdiff_t m = 0;                                                                                        \
    for (; m + 4 <= M; m += 4) ddt_tile_4_##NT(x, w, out, N, K, n, m);                                     \
    switch (M - m) {                                                                                        \
      case 3: ddt_tile_3_##NT(x, w, out, N, K, n, m); break;                                               \
      case 2: ddt_tile_2_##NT(x, w, out, N, K, n, m); break;                                               \
      case 1: ddt_tile_1_##NT(x, w, out, N, K, n, m); break;                                               \
    }                                                                                                       \
  }
DDT_ROW_BLOCK(2) DDT_ROW_BLOCK(1)

#define DDT_LINEAR_BODY                                                                                     \
  {                                                                                                         \
    const ptrdiff_t pairs = N / 2;                                                                          \
    _Pragma("omp parallel for schedule(static) if (pairs > 64)")                                           \
    for (ptrdiff_t p = 0; p < pairs; p++) ddt_row_block_2(x, w, out, M, N, K, 2 * p);                     \
    if (N & 1) ddt_row_block_1(x, w, out, M, N, K, N - 1);                                                 \
  }

#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("avx2,fma"))) static void ddt_linear_bf16_avx2(const float *x, const uint16_t *w,
                                                                       float *out, ptrdiff_t M, ptrdiff_t N,
                                                                       ptrdiff_t K)
DDT_LINEAR_BODY
#endif

static void ddt_linear_bf16_base(const float *x, const uint16_t *w, float *out, ptrdiff_t M, ptrdiff_t N,
                                 ptrdiff_t K)
DDT_LINEAR_BODY

/* Which build runs here: "avx2+fma" or "baseline". */
static const char *ddt_linear_bf16_isa(void) {
#if defined(__x86_64__) || defined(__i386__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "avx2+fma";
#endif
  return "baseline";
}

static void ddt_linear_bf16(const float *x, const uint16_t *w, float *out, ptrdiff_t M, ptrdiff_t N,
                            ptrdiff_t K) {
#if defined(__x86_64__) || defined(__i386__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    ddt_linear_bf16_avx2(x, w, out, M, N, K);
    return;
  }
#endif
  ddt_linear_bf16_base(x, w, out, M, N, K);
}

#else /* no vector extensions (e.g. MSVC): the same sums, one lane */

static const char *ddt_linear_bf16_isa(void) { return "scalar"; }

static void ddt_linear_bf16(const float *x, const uint16_t *w, float *out, ptrdiff_t M, ptrdiff_t N,
                            ptrdiff_t K) {
  for (ptrdiff_t n = 0; n < N; n++)
    for (ptrdiff_t m = 0; m < M; m++) {
      float s = 0.0f;
      for (ptrdiff_t k = 0; k < K; k++) s += x[m * K + k] * ddt_bf16_to_f32(w[n * K + k]);
      out[m * N + n] = s;
    }
}
#endif

#endif /* DDTREE_CPU_LINEAR_H */
