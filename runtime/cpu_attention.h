/* Prefix + bitmask attention for the CPU backend, float32: the backend interface's `attention` op.

For query row i (of T) and head h: the keys are the n_prefix cached slots, then slot n_prefix + j for every new
token j whose bit is set in row i of the visibility bitmask (uint32 [T, W]); scores q.k * scale, softmax, the
weighted sum of the values. GQA: head h reads KV head h / (H / Hkv).

Why not numpy: its batched matmuls sum a query row differently depending on how many rows share the call (BLAS
picks kernels by shape) and add the masked-out keys' zeros into pairwise sums whose grouping depends on the key
count, so a tree verify's node could round differently from the AR step of the same token. Here a row's result
depends only on its visible keys, visited in slot order with fixed sums: the same keys an AR step sees (a node's
ancestors sit at increasing slots, as the accepted tokens do after compaction), so DDTree == AR on the cpu
backend bit for bit. Three passes per (row, head): the scores and their maximum; exp (a polynomial that
vectorizes, not libm's expf) and the sum of the weights; the weighted values. Blocks of rows x the heads of one
KV head are split over OpenMP threads. Two builds, like cpu_linear.h: AVX2+FMA where the CPU has it, else the
compiler's baseline. ddt_dot is also the sum of squares of cpu_kernels.rmsnorm. */
#ifndef DDTREE_CPU_ATTENTION_H
#define DDTREE_CPU_ATTENTION_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__)
#define DDT_ATT_INLINE static inline __attribute__((always_inline))
#else
#define DDT_ATT_INLINE static inline
#endif

/* exp(x) for x <= 0 (a score minus the row maximum): 2^n * p(r), n = round(x / ln 2), r = x - n ln 2 in two
   parts, p the degree-7 minimax polynomial of Cephes' expf (about 1 ulp). x < -87 gives exp(-87) (1.6e-38: no
   float32 sum of weights, each <= 1 and one of them 1, moves by that). NaN stays NaN. Branch-free so that
   the loop over keys vectorizes. */
DDT_ATT_INLINE float ddt_exp_nonpositive(float x) {
  float xc = x < -87.0f ? -87.0f : x;
  xc = x == x ? xc : 0.0f;                                      /* NaN: computed as 0, returned as NaN below */
  const float shifter = 12582912.0f;                            /* 1.5 * 2^23: adding it rounds to an integer */
  float n = (xc * 1.44269504088896341f + shifter) - shifter;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  int32_t e = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &e, 4);
  float y = p * scale;
  return x == x ? y : x;
}

/* dot(a, b) over n floats in a fixed order: 8 partial sums over i mod 8, a fixed pairwise reduction, the tail in
   order. (32 partial sums, four vector chains instead of one, ran the scores pass 2x slower: GCC kept them in
   memory.) */
DDT_ATT_INLINE float ddt_dot(const float *a, const float *b, ptrdiff_t n) {
  float p[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  ptrdiff_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; l++) p[l] += a[i + l] * b[i + l];
  float s = ((p[0] + p[4]) + (p[1] + p[5])) + ((p[2] + p[6]) + (p[3] + p[7]));
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

/* The body of one build. A work item is a block of up to DDT_ATT_ROWS query rows times the `group` heads that
   share one KV head: each K and V vector is loaded once for all its (row, head) pairs (a pair per row and head
   alone re-read the whole prefix from L2 and ran at a third of the speed in a 1000-token prefill). Every pair
   still sees its own visible keys in slot order with its own scores, weights and sums, so its result is what it
   would be alone. */
#define DDT_ATT_ROWS 4

/* Inside a work item: for every key slot c in order and every (row, head) pair of the block that sees it, the
   block of code given, with c, i (the query row), h (the head) and a (the pair's index in the block) set. */
#define DDT_FOR_VISIBLE_PAIRS(...)                                                                          \
  for (ptrdiff_t c = 0; c < n_max; c++) {                                                                   \
    const ptrdiff_t j = c - n_prefix; /* the new token of this slot, or < 0 in the prefix */                \
    for (ptrdiff_t r = 0; r < rows; r++) {                                                                  \
      const ptrdiff_t i = i0 + r;                                                                           \
      if (j >= 0 && !((vis[i * W + (j >> 5)] >> (j & 31)) & 1u)) continue;                                 \
      for (ptrdiff_t g = 0; g < group; g++) {                                                               \
        const ptrdiff_t a = r * group + g, h = hk * group + g;                                              \
        __VA_ARGS__                                                                                         \
      }                                                                                                     \
    }                                                                                                       \
  }
#define DDT_ATTENTION_BODY                                                                                   \
  {                                                                                                         \
    const ptrdiff_t group = H / Hkv, n_max = n_prefix + T, row_blocks = (T + DDT_ATT_ROWS - 1) / DDT_ATT_ROWS; \
    const ptrdiff_t items = row_blocks * Hkv, pairs_max = DDT_ATT_ROWS * group;                              \
    int failed = 0;                                                                                         \
    _Pragma("omp parallel if (T * H * n_max * (D + Dv) > 65536)")                                          \
    {                                                                                                       \
      /* per pair: its scores / weights (n_max), its key count and maximum */                              \
      float *s = (float *)malloc(sizeof(float) * (size_t)(pairs_max * n_max) + 1);                         \
      ptrdiff_t *cnt = (ptrdiff_t *)malloc(sizeof(ptrdiff_t) * (size_t)pairs_max + 1);                     \
      float *mx = (float *)malloc(sizeof(float) * (size_t)pairs_max + 1);                                  \
      if (s == NULL || cnt == NULL || mx == NULL) {                                                         \
        _Pragma("omp atomic write") failed = 1;                                                             \
      }                                                                                                     \
      _Pragma("omp for schedule(static)")                                                                   \
      for (ptrdiff_t it = 0; it < items; it++) {                                                            \
        if (s == NULL || cnt == NULL || mx == NULL) continue;                                               \
        const ptrdiff_t i0 = (it / Hkv) * DDT_ATT_ROWS, hk = it % Hkv;                                      \
        const ptrdiff_t rows = T - i0 < DDT_ATT_ROWS ? T - i0 : DDT_ATT_ROWS, np_ = rows * group;           \
        for (ptrdiff_t a = 0; a < np_; a++) { cnt[a] = 0; mx[a] = -INFINITY; }                             \
        /* pass 1: scores, key by key in slot order (prefix slots, then the new slots any row sees) */      \
        DDT_FOR_VISIBLE_PAIRS({                                                                             \
          const float sc = ddt_dot(q + (i * H + h) * D, k + (c * Hkv + hk) * D, D) * scale;                 \
          s[a * n_max + cnt[a]++] = sc;                                                                     \
          mx[a] = sc > mx[a] ? sc : mx[a];                                                                  \
        })                                                                                                  \
        /* pass 2: weights and their sum, per pair */                                                       \
        for (ptrdiff_t a = 0; a < np_; a++) {                                                               \
          float *sa = s + a * n_max, m = mx[a], w8[8] = {0, 0, 0, 0, 0, 0, 0, 0};                           \
          const ptrdiff_t n = cnt[a];                                                                       \
          ptrdiff_t c = 0;                                                                                  \
          for (; c + 8 <= n; c += 8)                                                                        \
            for (int l = 0; l < 8; l++) {                                                                   \
              sa[c + l] = ddt_exp_nonpositive(sa[c + l] - m);                                               \
              w8[l] += sa[c + l];                                                                           \
            }                                                                                               \
          float sum = ((w8[0] + w8[4]) + (w8[1] + w8[5])) + ((w8[2] + w8[6]) + (w8[3] + w8[7]));            \
          for (; c < n; c++) {                                                                              \
            sa[c] = ddt_exp_nonpositive(sa[c] - m);                                                         \
            sum += sa[c];                                                                                   \
          }                                                                                                 \
          mx[a] = n > 0 ? 1.0f / sum : NAN; /* now 1 / sum; no visible key: NaN, as softmax over nothing */ \
          const ptrdiff_t i = i0 + a / group, h = hk * group + a % group;                                   \
          float *o = out + (i * H + h) * Dv;                                                                \
          for (ptrdiff_t d = 0; d < Dv; d++) o[d] = 0.0f;                                                   \
          cnt[a] = 0;                                                                                       \
        }                                                                                                   \
        /* pass 3: the weighted values, key by key in the same order */                                    \
        DDT_FOR_VISIBLE_PAIRS({                                                                             \
          const float p = s[a * n_max + cnt[a]++], *vt = v + (c * Hkv + hk) * Dv;                          \
          float *o = out + (i * H + h) * Dv;                                                                \
          for (ptrdiff_t d = 0; d < Dv; d++) o[d] += p * vt[d];                                             \
        })                                                                                                  \
        for (ptrdiff_t a = 0; a < np_; a++) {                                                               \
          float *o = out + ((i0 + a / group) * H + hk * group + a % group) * Dv;                            \
          for (ptrdiff_t d = 0; d < Dv; d++) o[d] *= mx[a];                                                 \
        }                                                                                                   \
      }                                                                                                     \
      free(s);                                                                                              \
      free(cnt);                                                                                            \
      free(mx);                                                                                             \
    }                                                                                                       \
    return failed ? -1 : 0;                                                                                 \
  }

#define DDT_ATTENTION_ARGS                                                                                   \
  const float *q, const float *k, const float *v, const uint32_t *vis, float *out, ptrdiff_t T, ptrdiff_t H,  \
      ptrdiff_t Hkv, ptrdiff_t D, ptrdiff_t Dv, ptrdiff_t n_prefix, ptrdiff_t W, float scale

static int ddt_attention_base(DDT_ATTENTION_ARGS) DDT_ATTENTION_BODY

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
__attribute__((target("avx2,fma"))) static int ddt_attention_avx2(DDT_ATTENTION_ARGS) DDT_ATTENTION_BODY
#endif

/* out[T, H, Dv]; q [T, H, D]; k [*, Hkv, D] and v [*, Hkv, Dv] cache slots; vis [T, W]; level as in
   cpu_linear.h (>= 1: the AVX2+FMA build). Returns 0, or -1 when the per-thread buffers cannot be allocated. */
static int ddt_attention(const float *q, const float *k, const float *v, const uint32_t *vis, float *out,
                         ptrdiff_t T, ptrdiff_t H, ptrdiff_t Hkv, ptrdiff_t D, ptrdiff_t Dv, ptrdiff_t n_prefix,
                         ptrdiff_t W, float scale, int level) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  if (level >= 1) return ddt_attention_avx2(q, k, v, vis, out, T, H, Hkv, D, Dv, n_prefix, W, scale);
#endif
  (void)level;
  return ddt_attention_base(q, k, v, vis, out, T, H, Hkv, D, Dv, n_prefix, W, scale);
}

#endif /* DDTREE_CPU_ATTENTION_H */
