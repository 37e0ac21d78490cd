// Pieces shared by the MLA attention kernels (mla_verify.cu: mma.sync, every arch; mla_verify_sm90.cu: wgmma); the
// online-softmax steps also serve the tree kernels (tree_attention_sm90.cu; tree_attention.cu's 64-slot tiles).
#pragma once
#include <cuda_bf16.h>
#include "device_common.cuh"

namespace mla_common {

constexpr int DV = 512;   // output (latent) width

// Which of the cache positions p0 .. p0 + 63 query token tok sees (tok < 0: a padding row, none), bit i = position
// p0 + i: positions < prefix_len all; tree node p - prefix_len through bit (node) of the token's mask row, or
// causally (node <= tok) when mask == nullptr (prefill); nothing at or past kv_end (the split's end). The row's
// (at most three) mask words are loaded once per tile, not once per position.
__device__ __forceinline__ uint64_t visible64(int p0, int tok, int kv_end, int prefix_len,
                                              const unsigned* __restrict__ mask, int mask_words) {
  if (tok < 0) return 0ull;
  const int np = prefix_len - p0;   // positions below this bit are prefix ones
  const uint64_t tree = mask != nullptr
      ? ddtree::bit_window64(mask + (long long)tok * mask_words, mask_words, -np)
      : ddtree::low_bits64(tok + np + 1) & ~ddtree::low_bits64(np);   // causal: node i - np <= tok
  return ddtree::window_visible64(p0, prefix_len, kv_end, tree);
}

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&v);
}

// Online-softmax steps the MLA kernels and the tree kernels run per KV tile, in base 2 on the raw scores (masked
// ones -inf): scaling by scale > 0 (softmax scale x log2 e) keeps their order, so a tile's row maxima are taken raw
// and the scale folds into one FFMA per score in front of the exponential.

// A thread's raw S values as NJ groups of 4 reached through s_at(j, e) (element e is row e >> 1, column 8 j + 2 t +
// (e & 1): the m16n8 / wgmma accumulator layout); mraw = each row's largest over them. With vis, first set -inf
// where the row's visibility bit is clear: vis[ri] = the tile's bits for row ri (visible64 / tile_visible64)
// already shifted right by 2 t, so column 8 j + 2 t + b is bit 8 j + b.
template <int NJ, class SAt>
__device__ __forceinline__ void row_max_raw(SAt s_at, float (&mraw)[2]) {
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) mraw[e >> 1] = fmaxf(mraw[e >> 1], s_at(j, e));
}
template <int NJ, class SAt>
__device__ __forceinline__ void mask_row_max_raw(SAt s_at, const uint64_t (&vis)[2], float (&mraw)[2]) {
  const float NEG_INF = __int_as_float(0xff800000);
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int ri = e >> 1;
      if (!((vis[ri] >> (8 * j + (e & 1))) & 1u)) s_at(j, e) = NEG_INF;
      mraw[ri] = fmaxf(mraw[ri], s_at(j, e));
    }
}

// Over the 4 lanes of a quad (the threads that share a row).
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// The running row maxima m move to max(m, mraw x scale), mraw = the row's largest raw score of the tile (each
// already the max over its quad): corr = 2^(m - new m) for the sums l (multiplied here) and the caller's O, 1
// where the max held (so also for a row that has seen nothing visible yet).
__device__ __forceinline__ void rescale_rows(const float (&mraw)[2], float scale, float (&m)[2], float (&l)[2],
                                             float (&corr)[2]) {
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) {
    const float mnew = fmaxf(m[ri], mraw[ri] * scale);
    corr[ri] = mnew == m[ri] ? 1.f : ddtree::exp2_approx(m[ri] - mnew);
    m[ri] = mnew;
    l[ri] *= corr[ri];
  }
}

// A thread's raw S values as NJ groups of 4 reached through s_at(j, e): element (j, e) is row ri = e >> 1 (the
// m16n8 / wgmma accumulator layout). P = 2^(s scale - m) (0 where masked: a row with nothing visible yet takes 0
// for m, so -inf gives 0, not NaN), added to the row sums l, packed bf16 as the A registers of NJ / 2 k16 steps.
template <int NJ, class SAt>
__device__ __forceinline__ void exp_pack(SAt s_at, float scale, const float (&m)[2], float (&l)[2],
                                         unsigned (&pa)[NJ / 2][4]) {
  const float NEG_INF = __int_as_float(0xff800000);
  const float base[2] = {m[0] == NEG_INF ? 0.f : m[0], m[1] == NEG_INF ? 0.f : m[1]};
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    float e4[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int ri = e >> 1;
      e4[e] = ddtree::exp2_approx(fmaf(s_at(j, e), scale, -base[ri]));
      l[ri] += e4[e];
    }
    pa[j >> 1][(j & 1) * 2 + 0] = pack_bf16(e4[0], e4[1]);   // row g
    pa[j >> 1][(j & 1) * 2 + 1] = pack_bf16(e4[2], e4[3]);   // row g + 8
  }
}

// O's rows times corr, as NJ groups of 4 accumulators reached through o_at(j, e) (element e is row e >> 1); skipped
// when every row of the warp kept its max, which is most tiles once a long prefix has been seen.
template <int NJ, class OAt>
__device__ __forceinline__ void rescale_o(OAt o_at, const float (&corr)[2]) {
  if (!__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) return;
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) o_at(j, e) *= corr[e >> 1];
}

// One row's result, NJ pairs of columns NJ * 8 * group + 8 j + 2 t (+ 1) with values o_of(j, 0 / 1): normalised
// bf16 into out when the KV range is not split; else the unnormalised fp32 partial of this split, and (m, l)
// from the group-0 thread with t == 0.
template <int NJ, class ValueOf>
__device__ __forceinline__ void store_row(int row, int group, int t, ValueOf o_of, float m, float l,
                                          int split, int rows_total, unsigned short* __restrict__ out,
                                          float* __restrict__ part_o, float* __restrict__ part_ml) {
  if (gridDim.z == 1) {
    const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int col = group * (NJ * 8) + j * 8 + 2 * t;
      *reinterpret_cast<unsigned*>(out + (long long)row * DV + col) = pack_bf16(o_of(j, 0) * inv, o_of(j, 1) * inv);
    }
  } else {
    float* po = part_o + ((long long)split * rows_total + row) * DV;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int col = group * (NJ * 8) + j * 8 + 2 * t;
      *reinterpret_cast<float2*>(po + col) = make_float2(o_of(j, 0), o_of(j, 1));
    }
    if (group == 0 && t == 0) {
      part_ml[((long long)split * rows_total + row) * 2 + 0] = m;
      part_ml[((long long)split * rows_total + row) * 2 + 1] = l;
    }
  }
}

}  // namespace mla_common
