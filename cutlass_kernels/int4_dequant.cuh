// INT4 (uint4b8) -> bf16 without conversions, shared by the MoE families (moe_int4, moe_int4_sm90).
#pragma once
#include <cuda/std/cstdint>  // NVRTC has no <cstdint>

namespace ddtree {

// (q & 0x000f000f) | 0x43004300: two bf16 values 128 + nibble (low and high half-word).
__device__ __forceinline__ cuda::std::uint32_t nib_to_bf16x2_biased(cuda::std::uint32_t q) {
  cuda::std::uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(q), "n"(0x000f000f), "n"(0x43004300));
  return r;
}

// (v - 136) * s on bf16x2: v - 136 = q - 8 is exact, the product is rounded once (round to nearest).
__device__ __forceinline__ cuda::std::uint32_t dequant_bf16x2(cuda::std::uint32_t v, cuda::std::uint32_t s2) {
  cuda::std::uint32_t r;
  const cuda::std::uint32_t one = 0x3f803f80u, minus136 = 0xc308c308u;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(one), "r"(minus136));
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(r), "r"(s2));
  return r;
}

// The offset-free form (moe_int4_sm90's register-A slot pipelines). q & 0x000f000f read as bf16x2 is the
// subnormal pair q * 2^-133 (bf16 arithmetic keeps subnormals: no flush to zero). With the group scale s
// pre-multiplied by 2^130 (prescale_2p130), one fma gives q * s / 8 - s = (q - 8) * s / 8, rounded once: the
// bf16 value dequant_bf16x2 gives, times 2^-3 exactly (scaling by a power of two commutes with rounding in the
// normal range). So the MMA sums times 8 are the biased form's, bit for bit: one bf16x2 op per pair instead of
// two. Needs 2^-123 <= |s| < 2^-2 (s * 2^130 finite, (q - 8) * s / 8 normal) or s = 0: MoeWeights checks.
__device__ __forceinline__ cuda::std::uint32_t nib_to_bf16x2_subnormal(cuda::std::uint32_t q) {
  return q & 0x000f000fu;
}

// s * 2^130 on bf16x2 (2^130 is past bf16's range: two products by 2^65, both exact).
__device__ __forceinline__ cuda::std::uint32_t prescale_2p130(cuda::std::uint32_t s2) {
  cuda::std::uint32_t r;
  const cuda::std::uint32_t two65 = 0x60006000u;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(s2), "r"(two65));
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(r), "r"(two65));
  return r;
}

// v * (s * 2^130) - s = (q - 8) * s / 8 on bf16x2 (v = nib_to_bf16x2_subnormal, neg_s2 = -s).
__device__ __forceinline__ cuda::std::uint32_t dequant_bf16x2_offset_free(cuda::std::uint32_t v,
                                                                        cuda::std::uint32_t s2_prescaled,
                                                                        cuda::std::uint32_t neg_s2) {
  cuda::std::uint32_t r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(s2_prescaled), "r"(neg_s2));
  return r;
}

// The offset-free form for a whole scale word (the mma.sync kernels, moe_int4.cu): its two scales (rows g,
// g + 8) times 2^130 and negated, broadcast to both halves, then each 32-bit word of nibbles as its four pairs.
constexpr float DEQUANT_UNDO = 8.f;   // the offset-free form's weights are the true bf16 ones times 2^-3
struct DequantScales {
  cuda::std::uint32_t pre_lo, pre_hi, neg_lo, neg_hi;
};
__device__ __forceinline__ DequantScales dequant_scales(cuda::std::uint32_t sw) {
  const cuda::std::uint32_t pre = prescale_2p130(sw), neg = sw ^ 0x80008000u;
  return {__byte_perm(pre, 0, 0x1010), __byte_perm(pre, 0, 0x3232), __byte_perm(neg, 0, 0x1010),
          __byte_perm(neg, 0, 0x3232)};
}
// a[0] = nibbles 0, 4 (row g), a[1] = 1, 5 (row g + 8), a[2] = 2, 6 (row g), a[3] = 3, 7 (row g + 8).
__device__ __forceinline__ void dequant_word(cuda::std::uint32_t q, const DequantScales& s,
                                             cuda::std::uint32_t (&a)[4]) {
  a[0] = dequant_bf16x2_offset_free(nib_to_bf16x2_subnormal(q), s.pre_lo, s.neg_lo);
  a[1] = dequant_bf16x2_offset_free(nib_to_bf16x2_subnormal(q >> 4), s.pre_hi, s.neg_hi);
  a[2] = dequant_bf16x2_offset_free(nib_to_bf16x2_subnormal(q >> 8), s.pre_lo, s.neg_lo);
  a[3] = dequant_bf16x2_offset_free(nib_to_bf16x2_subnormal(q >> 12), s.pre_hi, s.neg_hi);
}

}  // namespace ddtree
