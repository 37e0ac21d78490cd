// Pieces shared by the MLA attention kernels (mla_verify.cu: mma.sync, every arch; mla_verify_sm90.cu: wgmma).
#pragma once
#include <cuda_bf16.h>

namespace mla_common {

constexpr int DV = 512;   // output (latent) width

// Whether cache position p is visible to query token tok (tok < 0: a padding row): positions < prefix_len
// to every query, tree node p - prefix_len through bit (node) of the token's mask row, or causally when
// mask == nullptr (prefill); nothing at or past kv_end (this split's end).
__device__ __forceinline__ bool visible(int p, int tok, int kv_end, int prefix_len, const unsigned* __restrict__ mask,
                                        int mask_words) {
  bool vis = p < kv_end && tok >= 0;
  if (vis && p >= prefix_len) {
    const int node = p - prefix_len;
    vis = mask != nullptr ? ((mask[(long long)tok * mask_words + (node >> 5)] >> (node & 31)) & 1u) != 0
                          : node <= tok;
  }
  return vis;
}

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned*>(&v);
}

// Online-softmax steps both kernels run per KV tile. (The mask-and-scale loop stays in each kernel: as a
// shared helper it compiled differently, branches turned into predicated selects, and that is unmeasured.)

// Over the 4 lanes of a quad (the threads that share a row).
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// The running row maxima m move to mnew (each already the row's max over its quad): corr = 2^(m - mnew) for the
// sums l (multiplied here) and the caller's O; a row that has seen nothing visible yet keeps corr = 1.
__device__ __forceinline__ void rescale_rows(const float (&mnew)[2], float (&m)[2], float (&l)[2], float (&corr)[2]) {
  const float NEG_INF = __int_as_float(0xff800000);
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) {
    corr[ri] = mnew[ri] == NEG_INF ? 1.f : exp2f(m[ri] - mnew[ri]);
    m[ri] = mnew[ri];
    l[ri] *= corr[ri];
  }
}

// A thread's S values as NJ groups of 4 reached through s_at(j, e): element (j, e) is row ri = e >> 1 (the m16n8
// / wgmma accumulator layout). P = 2^(s - m) (0 where masked), added to the row sums l, packed bf16 as the A
// registers of NJ / 2 k16 steps.
template <int NJ, class SAt>
__device__ __forceinline__ void exp_pack(SAt s_at, const float (&m)[2], float (&l)[2], unsigned (&pa)[NJ / 2][4]) {
  const float NEG_INF = __int_as_float(0xff800000);
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    float e4[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int ri = e >> 1;
      const float x = s_at(j, e);
      e4[e] = x == NEG_INF ? 0.f : exp2f(x - m[ri]);
      l[ri] += e4[e];
    }
    pa[j >> 1][(j & 1) * 2 + 0] = pack_bf16(e4[0], e4[1]);   // row g
    pa[j >> 1][(j & 1) * 2 + 1] = pack_bf16(e4[2], e4[3]);   // row g + 8
  }
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
