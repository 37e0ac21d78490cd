/* The linear of the CPU backend: out[M, N] = bf16(x)[M, K] @ W[N, K]^T with W in bf16 (uint16 bits), the
activations rounded to bf16 (nearest even) as the CUDA backend's GEMMs take them, products summed in float32;
or, for float32 weights (checkpoints in float32, DeepSeek's router), x @ W^T in float32 as it is.

Why: the numpy backend holds every weight in float32 and leaves small-M products to BLAS. A decode step streams
all weights once, so bf16 halves the bytes; and OpenBLAS's sgemm at 5..17 rows (the tree verify, the drafter
block) runs at a fraction of what the FMA units do. Here each weight vector is loaded once per tile of up to 4
rows of x, with the next two tiles' weights prefetched (into L1 and L2).

Three builds of the same sums, picked at run time:
- "avx512bf16": vdpbf16ps on bf16 pairs (AMD Zen 4+, Intel Sapphire Rapids+): 32 products per instruction
  (bf16 weights; float32 weights run the avx2+fma build).
- "avx2+fma": 8 float32 lanes, bf16 widened by a shift.
- "baseline": the same vector code at the compiler's default ISA (GCC/Clang vector extensions), or one scalar
  lane where there are none (e.g. MSVC).
Each (row of x, row of W) is summed by the same instruction sequence whatever the tile it falls in, so a row's
result does not depend on how many rows share the call (a tree verify and an AR step agree bit for bit); the
three builds differ from each other only in the order of the float32 sums. Rows of W are split over OpenMP
threads when the module is built with OpenMP. */
#ifndef DDTREE_CPU_LINEAR_H
#define DDTREE_CPU_LINEAR_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* What the compiler offers: DDT_VEC vector extensions with __builtin_convertvector (GCC 9+, Clang); DDT_X86 the
   AVX2+FMA build on x86; DDT_BF16DOT the AVX512-BF16 intrinsics (GCC 10+, Clang 9+). Older compilers build less. */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 9)
#define DDT_VEC 1
#endif
#if DDT_VEC && (defined(__x86_64__) || defined(__i386__))
#define DDT_X86 1
#include <immintrin.h>
#if defined(__clang__) ? (__clang_major__ >= 9) : (__GNUC__ >= 10)
#define DDT_BF16DOT 1
#endif
#endif

/* float32 -> bf16 bits, nearest even; NaN stays a quiet NaN (runtime/bf16.py to_bf16). */
static inline uint16_t ddt_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float ddt_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

#if DDT_VEC
/* Row j of the next tile into L1, row j of the one after into L2: with the next tile alone, 1..4-row calls ran
   15-32% slower than 5-row ones (the 5th row's second pass over the tile gave the prefetches time). */
#define DDT_PREFETCH_W(w0, j, K, k, NT)                                                                     \
  (__builtin_prefetch((w0) + ((NT) + (j)) * (K) + (k)), __builtin_prefetch((w0) + (2 * (NT) + (j)) * (K) + (k), 0, 2))
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi" /* vector returns of always-inline helpers: no ABI crosses a call */
#endif
/* ---- 8 float32 lanes (GCC/Clang vector extensions): the avx2+fma and baseline builds ------------------------ */
typedef float ddt_v8f __attribute__((vector_size(32)));
typedef uint32_t ddt_v8u __attribute__((vector_size(32)));
typedef uint16_t ddt_v8h __attribute__((vector_size(16)));
#define DDT_INLINE static inline __attribute__((always_inline))

DDT_INLINE ddt_v8f ddt_load8_bf16(const uint16_t *p) {
  ddt_v8h h;
  memcpy(&h, p, 16);
  ddt_v8u u = __builtin_convertvector(h, ddt_v8u) << 16;
  ddt_v8f f;
  memcpy(&f, &u, 32);
  return f;
}

DDT_INLINE ddt_v8f ddt_load8_f32(const float *p) {
  ddt_v8f f;
  memcpy(&f, p, 32);
  return f;
}

DDT_INLINE float ddt_hsum8(ddt_v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

#define DDT_SAME(v) (v)

/* Rows m..m+mt-1 (mt <= MT) of x against rows n..n+NT-1 of W (element type WT, read 8 at a time by LOAD8, one by
   ONE); K8 = K rounded down to 8, the rest in scalars. The loops over i and j unroll; i >= mt are skipped, so every
   (i, j) runs the same code, and a row sums in the same order whatever tile holds it. SUF names the weight type:
   bf16 (x holds bf16 values then) or f32. */
#define DDT_TILE8(SUF, WT, LOAD8, ONE, NT, MT)                                                              \
  DDT_INLINE void ddt_tile8_##SUF##_##NT##x##MT(const float *x, const WT *w, float *out, ptrdiff_t N,      \
                                                ptrdiff_t K, ptrdiff_t n, ptrdiff_t m, int mt) {            \
    ddt_v8f acc[MT][NT];                                                                                    \
    for (int i = 0; i < MT; i++)                                                                            \
      for (int j = 0; j < NT; j++) acc[i][j] = (ddt_v8f){0, 0, 0, 0, 0, 0, 0, 0};                         \
    const WT *w0 = w + n * K;                                                                               \
    const float *x0 = x + m * K;                                                                            \
    const ptrdiff_t K8 = K & ~(ptrdiff_t)7;                                                                 \
    for (ptrdiff_t k = 0; k < K8; k += 8) {                                                                 \
      if ((k & (64 / sizeof(WT) - 1)) == 0) /* a 64-byte line of each row of the next two tiles */         \
        for (int j = 0; j < NT; j++) DDT_PREFETCH_W(w0, j, K, k, NT);                                      \
      ddt_v8f wv[NT];                                                                                       \
      for (int j = 0; j < NT; j++) wv[j] = LOAD8(w0 + j * K + k);                                          \
      for (int i = 0; i < MT; i++) {                                                                        \
        if (i >= mt) break;                                                                                 \
        ddt_v8f xv = ddt_load8_f32(x0 + i * K + k);                                                        \
        for (int j = 0; j < NT; j++) acc[i][j] += xv * wv[j];                                              \
      }                                                                                                     \
    }                                                                                                       \
    for (int i = 0; i < mt; i++)                                                                            \
      for (int j = 0; j < NT; j++) {                                                                        \
        float s = ddt_hsum8(acc[i][j]);                                                                     \
        for (ptrdiff_t k = K8; k < K; k++) s += x0[i * K + k] * ONE(w0[j * K + k]);                        \
        out[(m + i) * N + n + j] = s;                                                                       \
      }                                                                                                     \
  }
DDT_TILE8(bf16, uint16_t, ddt_load8_bf16, ddt_bf16_to_f32, 2, 4)
DDT_TILE8(bf16, uint16_t, ddt_load8_bf16, ddt_bf16_to_f32, 1, 4)
DDT_TILE8(bf16, uint16_t, ddt_load8_bf16, ddt_bf16_to_f32, 2, 6)
DDT_TILE8(bf16, uint16_t, ddt_load8_bf16, ddt_bf16_to_f32, 1, 6)
DDT_TILE8(f32, float, ddt_load8_f32, DDT_SAME, 2, 4)
DDT_TILE8(f32, float, ddt_load8_f32, DDT_SAME, 1, 4)
DDT_TILE8(f32, float, ddt_load8_f32, DDT_SAME, 2, 6)
DDT_TILE8(f32, float, ddt_load8_f32, DDT_SAME, 1, 6)

/* x against W: pairs of W rows over the threads, then the odd row; a baseline and an AVX2+FMA build. Tiles of 4 x
   rows up to 4 rows, of 6 from 5 (12 accumulators + 2 W + 1 x vector fill AVX2's 16 registers; a 5-row DDTree verify
   at budget 4 is then one pass). 6-row tiles against 4 (dev VM, avx2+fma, bench_cpu, builds alternated): lm_head
   49152x576 at 5 rows 3.65-4.18 -> 2.87-3.27 ms, 17 rows 9.6-11.6 -> 7.6-9.5; at one row a 6-row tile ran 7-15%
   slower, so up to 4 rows keep the 4-row tile. */
#define DDT_LINEAR8_TILES(SUF, NT, MT, n)                                                                   \
  for (ptrdiff_t m = 0; m < M; m += MT)                                                                     \
    ddt_tile8_##SUF##_##NT##x##MT(x, w, out, N, K, (n), m, M - m < MT ? (int)(M - m) : MT);
/* All of x against NT W rows from row n: 4-row tiles up to 4 rows, 6-row tiles from 5. */
#define DDT_LINEAR8_ROWS(SUF, NT, n)                                                                        \
  if (M <= 4) {                                                                                             \
    DDT_LINEAR8_TILES(SUF, NT, 4, n)                                                                        \
  } else {                                                                                                  \
    DDT_LINEAR8_TILES(SUF, NT, 6, n)                                                                        \
  }
#define DDT_LINEAR8_BODY(SUF)                                                                               \
  {                                                                                                         \
    const ptrdiff_t pairs = N / 2;                                                                          \
    _Pragma("omp parallel for schedule(static) if (pairs > 64)")                                           \
    for (ptrdiff_t p = 0; p < pairs; p++) {                                                                 \
      DDT_LINEAR8_ROWS(SUF, 2, 2 * p)                                                                       \
    }                                                                                                       \
    if (N & 1) {                                                                                            \
      DDT_LINEAR8_ROWS(SUF, 1, N - 1)                                                                       \
    }                                                                                                       \
  }
#if DDT_X86
#define DDT_LINEAR8_FUNCS(SUF, WT)                                                                          \
  static void ddt_linear8_##SUF##_base(const float *x, const WT *w, float *out, ptrdiff_t M, ptrdiff_t N,   \
                                       ptrdiff_t K) DDT_LINEAR8_BODY(SUF)                                   \
  __attribute__((target("avx2,fma"))) static void ddt_linear8_##SUF##_avx2(                                \
      const float *x, const WT *w, float *out, ptrdiff_t M, ptrdiff_t N, ptrdiff_t K) DDT_LINEAR8_BODY(SUF)
#else
#define DDT_LINEAR8_FUNCS(SUF, WT)                                                                          \
  static void ddt_linear8_##SUF##_base(const float *x, const WT *w, float *out, ptrdiff_t M, ptrdiff_t N,   \
                                       ptrdiff_t K) DDT_LINEAR8_BODY(SUF)
#endif
DDT_LINEAR8_FUNCS(bf16, uint16_t)
DDT_LINEAR8_FUNCS(f32, float)

#if DDT_BF16DOT
/* ---- bf16 pairs, vdpbf16ps (AVX512-BF16) ------------------------------------------------------------------- */
#define DDT_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

/* One 32-k step of the tile below; LOAD(p) reads 32 bf16 at p. */
#define DDT_BF16_STEP(NT, LOAD)                                                                             \
  {                                                                                                         \
    __m512bh wv[NT];                                                                                        \
    for (int j = 0; j < NT; j++) {                                                                          \
      DDT_PREFETCH_W(w0, j, K, k, NT);                                                                      \
      wv[j] = (__m512bh)LOAD(w0 + j * K + k);                                                               \
    }                                                                                                       \
    for (int i = 0; i < 4; i++) {                                                                           \
      if (i >= mt) break;                                                                                   \
      __m512bh xv = (__m512bh)LOAD(x0 + i * K + k);                                                         \
      for (int j = 0; j < NT; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);                    \
    }                                                                                                       \
  }

/* Rows m..m+mt-1 of xb (bf16) against rows n..n+NT-1 of W, 32 k at a time with plain loads (masked loads in the
   main loop ran at half speed), then the last partial chunk masked (zeros past K). */
#define DDT_LOAD_FULL(p) _mm512_loadu_si512(p)
#define DDT_LOAD_TAIL(p) _mm512_maskz_loadu_epi16(tail, (p))
#define DDT_TILE_BF16(NT)                                                                                   \
  DDT_BF16_TARGET static inline __attribute__((always_inline)) void ddt_tile_bf16_##NT(                    \
      const uint16_t *xb, const uint16_t *w, float *out, ptrdiff_t N, ptrdiff_t K, ptrdiff_t n, ptrdiff_t m, \
      int mt) {                                                                                             \
    __m512 acc[4][NT];                                                                                      \
    for (int i = 0; i < 4; i++)                                                                             \
      for (int j = 0; j < NT; j++) acc[i][j] = _mm512_setzero_ps();                                         \
    const uint16_t *w0 = w + n * K;                                                                         \
    const uint16_t *x0 = xb + m * K;                                                                        \
    const ptrdiff_t K32 = K & ~(ptrdiff_t)31;                                                               \
    ptrdiff_t k = 0;                                                                                        \
    for (; k < K32; k += 32) DDT_BF16_STEP(NT, DDT_LOAD_FULL)                                               \
    if (k < K) {                                                                                            \
      const __mmask32 tail = (__mmask32)((1u << (K - k)) - 1u);                                            \
      DDT_BF16_STEP(NT, DDT_LOAD_TAIL)                                                                      \
    }                                                                                                       \
    for (int i = 0; i < mt; i++)                                                                            \
      for (int j = 0; j < NT; j++) out[(m + i) * N + n + j] = _mm512_reduce_add_ps(acc[i][j]);             \
  }
DDT_TILE_BF16(2)
DDT_TILE_BF16(1)

DDT_BF16_TARGET static void ddt_linear_avx512bf16(const uint16_t *xb, const uint16_t *w, float *out, ptrdiff_t M,
                                                  ptrdiff_t N, ptrdiff_t K) {
  const ptrdiff_t pairs = N / 2;
#pragma omp parallel for schedule(static) if (pairs > 64)
  for (ptrdiff_t p = 0; p < pairs; p++)
    for (ptrdiff_t m = 0; m < M; m += 4) ddt_tile_bf16_2(xb, w, out, N, K, 2 * p, m, M - m < 4 ? (int)(M - m) : 4);
  if (N & 1)
    for (ptrdiff_t m = 0; m < M; m += 4) ddt_tile_bf16_1(xb, w, out, N, K, N - 1, m, M - m < 4 ? (int)(M - m) : 4);
}
#endif /* DDT_BF16DOT */

#else /* no vector extensions: one lane, the same per-element order as a sum over k */
#define DDT_LINEAR1(SUF, WT, ONE)                                                                           \
  static void ddt_linear8_##SUF##_base(const float *x, const WT *w, float *out, ptrdiff_t M, ptrdiff_t N,   \
                                       ptrdiff_t K) {                                                       \
    for (ptrdiff_t n = 0; n < N; n++)                                                                       \
      for (ptrdiff_t m = 0; m < M; m++) {                                                                   \
        float s = 0.0f;                                                                                     \
        for (ptrdiff_t k = 0; k < K; k++) s += x[m * K + k] * ONE(w[n * K + k]);                           \
        out[m * N + n] = s;                                                                                 \
      }                                                                                                     \
  }
#define DDT_SAME(v) (v)
DDT_LINEAR1(bf16, uint16_t, ddt_bf16_to_f32)
DDT_LINEAR1(f32, float, DDT_SAME)
#endif

/* The best build this CPU runs: 2 = avx512bf16, 1 = avx2+fma, 0 = baseline. */
static int ddt_isa_level(void) {
  int level = 0;
#if DDT_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) level = 1;
#if DDT_BF16DOT
  if (level == 1 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16"))
    level = 2;
#endif
#endif
  return level;
}

static const char *ddt_isa_name(int level) {
#if !DDT_VEC
  return "scalar";
#else
  return level == 2 ? "avx512bf16" : level == 1 ? "avx2+fma" : "baseline";
#endif
}

/* out[M, N] = bf16(x) @ W^T with the build of `level` (at most ddt_isa_level()). Returns 0, or -1 when the bf16
   copy of x cannot be allocated. */
static int ddt_linear_bf16(const float *x, const uint16_t *w, float *out, ptrdiff_t M, ptrdiff_t N, ptrdiff_t K,
                           int level) {
  const size_t n_x = (size_t)M * (size_t)K;
#if DDT_BF16DOT
  if (level == 2) {
    uint16_t *xb = (uint16_t *)malloc(n_x * sizeof(uint16_t) + 1);
    if (xb == NULL) return -1;
    for (size_t i = 0; i < n_x; i++) xb[i] = ddt_f32_to_bf16(x[i]);
    ddt_linear_avx512bf16(xb, w, out, M, N, K);
    free(xb);
    return 0;
  }
#endif
  float *xr = (float *)malloc(n_x * sizeof(float) + 1);
  if (xr == NULL) return -1;
  for (size_t i = 0; i < n_x; i++) xr[i] = ddt_bf16_to_f32(ddt_f32_to_bf16(x[i]));
#if DDT_X86
  if (level >= 1)
    ddt_linear8_bf16_avx2(xr, w, out, M, N, K);
  else
#endif
    ddt_linear8_bf16_base(xr, w, out, M, N, K);
  free(xr);
  return 0;
}

/* out[M, N] = x @ W^T with W in float32 (x as it is): the AVX2+FMA build from level 1 up, else the baseline. */
static void ddt_linear_f32(const float *x, const float *w, float *out, ptrdiff_t M, ptrdiff_t N, ptrdiff_t K,
                           int level) {
#if DDT_X86
  if (level >= 1) {
    ddt_linear8_f32_avx2(x, w, out, M, N, K);
    return;
  }
#endif
  (void)level;
  ddt_linear8_f32_base(x, w, out, M, N, K);
}

#endif /* DDTREE_CPU_LINEAR_H */
