/* Prefix + bitmask attention for the CPU backend, float32: the backend interface's `attention` op.

For query row i (of T) and head h: the keys are the n_prefix cached slots, then slot n_prefix + j for every new
token j whose bit is set in row i of the visibility bitmask (uint32 [T, W]); scores q.k * scale, softmax, the
weighted sum of the values. GQA: head h reads KV head h / (H / Hkv).

Why not numpy: its batched matmuls sum a query row differently depending on how many rows share the call (BLAS
picks kernels by shape) and add the masked-out keys' zeros into pairwise sums whose grouping depends on the key
count, so a tree verify's node could round differently from the AR step of the same token. Here a row's result
depends only on its visible keys, visited in slot order with a fixed summation: the same keys an AR step sees
(a node's ancestors sit at increasing slots, as the accepted tokens do after compaction), so DDTree == AR on the
cpu backend bit for bit. (row, head) pairs are split over OpenMP threads. */
#ifndef DDTREE_CPU_ATTENTION_H
#define DDTREE_CPU_ATTENTION_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* dot(a, b) over n floats: 8 partial sums over i mod 8, then a fixed pairwise reduction; the tail in order. */
static inline float ddt_dot(const float *a, const float *b, ptrdiff_t n) {
  float p[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  ptrdiff_t n8 = n & ~(ptrdiff_t)7, i = 0;
  for (; i < n8; i += 8)
    for (int l = 0; l < 8; l++) p[l] += a[i + l] * b[i + l];
  float s = ((p[0] + p[4]) + (p[1] + p[5])) + ((p[2] + p[6]) + (p[3] + p[7]));
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

/* out[T, H, Dv]; q [T, H, D]; k [*, Hkv, D] and v [*, Hkv, Dv] cache slots; vis [T, W]. Returns 0, or -1 when
   the per-thread score buffers cannot be allocated. */
static int ddt_attention(const float *q, const float *k, const float *v, const uint32_t *vis, float *out,
                         ptrdiff_t T, ptrdiff_t H, ptrdiff_t Hkv, ptrdiff_t D, ptrdiff_t Dv, ptrdiff_t n_prefix,
                         ptrdiff_t W, float scale) {
  const ptrdiff_t group = H / Hkv, pairs = T * H, n_max = n_prefix + T;
  int failed = 0;
#pragma omp parallel if (pairs * n_max * (D + Dv) > 65536)
  {
    float *s = (float *)malloc(sizeof(float) * (size_t)n_max + 1);
    ptrdiff_t *slot = (ptrdiff_t *)malloc(sizeof(ptrdiff_t) * (size_t)T + 1);
    if (s == NULL || slot == NULL) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(static)
    for (ptrdiff_t ih = 0; ih < pairs; ih++) {
      if (s == NULL || slot == NULL) continue;
      const ptrdiff_t i = ih / H, h = ih % H, hk = h / group;
      const float *qi = q + (i * H + h) * D;
      ptrdiff_t n_new = 0;
      for (ptrdiff_t j = 0; j < T; j++)
        if ((vis[i * W + (j >> 5)] >> (j & 31)) & 1u) slot[n_new++] = n_prefix + j;
      const ptrdiff_t n = n_prefix + n_new;
      float m = -INFINITY;
      for (ptrdiff_t c = 0; c < n; c++) {
        const ptrdiff_t t = c < n_prefix ? c : slot[c - n_prefix];
        s[c] = ddt_dot(qi, k + (t * Hkv + hk) * D, D) * scale;
        if (s[c] > m) m = s[c];
      }
      float *o = out + (i * H + h) * Dv;
      for (ptrdiff_t d = 0; d < Dv; d++) o[d] = 0.0f;
      float sum = 0.0f;
      for (ptrdiff_t c = 0; c < n; c++) {
        const ptrdiff_t t = c < n_prefix ? c : slot[c - n_prefix];
        const float p = expf(s[c] - m);
        const float *vt = v + (t * Hkv + hk) * Dv;
        sum += p;
        for (ptrdiff_t d = 0; d < Dv; d++) o[d] += p * vt[d];
      }
      const float inv = n > 0 ? 1.0f / sum : NAN;   /* no visible key: NaN, as softmax over nothing */
      for (ptrdiff_t d = 0; d < Dv; d++) o[d] *= inv;
    }
    free(s);
    free(slot);
  }
  return failed ? -1 : 0;
}

#endif /* DDTREE_CPU_ATTENTION_H */
