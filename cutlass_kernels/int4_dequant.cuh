// INT4 (uint4b8) -> bf16 without conversions, shared by the MoE families (moe_int4, moe_int4_sm90).
#pragma once
#include <cuda/std/cstdint>  // NVRTC has no <cstdint>

namespace ddtree {

// x's low (HI false) or high half-word in both halves. Written as a PTX unpack and repack, which ptxas folds into
// the bf16x2 instruction that takes it as an operand selector (.H0_H0 / .H1_H1), so no PRMT is issued (a
// __byte_perm broadcast stays a PRMT: 4 per scale word in moe_int4's loop, 7% of its instructions, sm_90a).
template <bool HI>
__device__ __forceinline__ cuda::std::uint32_t bf16x2_broadcast(cuda::std::uint32_t x) {
  cuda::std::uint32_t r;
  if (HI) {
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %1;\n mov.b32 %0, {h, h};\n}" : "=r"(r) : "r"(x));
  } else {
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %1;\n mov.b32 %0, {l, l};\n}" : "=r"(r) : "r"(x));
  }
  return r;
}

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

// Offset-free dequantization, exact (the mma.sync kernels and moe_int4_sm90's register-A slot pipelines).
// An 8-bit field n in bits 0-7 of a bf16 (sign and upper exponent bits zero) has the value n * 2^-133 for
// every n: n < 128 is the subnormal n * 2^-133, n >= 128 the normal 2^-126 * (1 + (n - 128) / 128), the same
// line. So q & 0x000f000f (nibbles 0, 4 in bits 0-3 of each half) is q * 2^-133 and q & 0x00f000f0 (nibbles 1,
// 5 in bits 4-7) is q * 2^-129, with no shift; one shift by 8 brings nibbles 2, 6 and 3, 7 there. bf16 arithmetic
// keeps subnormals (no flush to zero). With the row-g scale times 2^130 and the row-g+8 scale (nibbles 1, 3)
// times 2^126, one fma per pair gives q * s / 8 - s = (q - 8) * s / 8, rounded once: exactly round_bf16((q - 8)
// * s) * 2^-3 (scaling by a power of two commutes with rounding in the normal range). So the fp32 sums are
// those of the bf16 weights round((q - 8) * s) times 2^-3, bit for bit (the tensor cores' sums scale with their
// inputs), and the epilogues multiply by DEQUANT_UNDO. Per 8 weights: 4 AND (LOP3), 1 shift, 4 fma, against
// the biased form's 4 LOP3, 3 shifts, 4 fma and 4 multiplies. Needs s = 0 or 2^-123 <= |s| < 2^-2 (s * 2^130
// finite, (q - 8) * s / 8 normal): MoeWeights.upload checks.
constexpr float DEQUANT_UNDO = 8.f;

// A scale word (bf16 scales of rows g (low half) and g + 8 (high half)) as the operands of dequant_word: row g's
// times 2^130 and row g+8's times 2^126 (two exact products: 2^130 is past bf16's range), and both negated,
// each broadcast to both halves.
struct DequantScales {
  cuda::std::uint32_t pre_lo, pre_hi, neg_lo, neg_hi;
};
__device__ __forceinline__ DequantScales dequant_scales(cuda::std::uint32_t sw) {
  cuda::std::uint32_t pre;
  const cuda::std::uint32_t two61_two65 = 0x5e006000u, two65 = 0x60006000u, neg = sw ^ 0x80008000u;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(pre) : "r"(sw), "r"(two61_two65));
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(pre) : "r"(pre), "r"(two65));
  return {bf16x2_broadcast<false>(pre), bf16x2_broadcast<true>(pre), bf16x2_broadcast<false>(neg),
          bf16x2_broadcast<true>(neg)};
}

// v * pre + neg on bf16x2, rounded once.
__device__ __forceinline__ cuda::std::uint32_t dequant_fma(cuda::std::uint32_t v, cuda::std::uint32_t pre,
                                                         cuda::std::uint32_t neg) {
  cuda::std::uint32_t r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(pre), "r"(neg));
  return r;
}

// One 32-bit word of packed nibbles (the repack's order) as (q - 8) * s / 8: a[0] = nibbles 0, 4 (row g),
// a[1] = 1, 5 (row g + 8), a[2] = 2, 6 (row g), a[3] = 3, 7 (row g + 8).
__device__ __forceinline__ void dequant_word(cuda::std::uint32_t q, const DequantScales& s,
                                             cuda::std::uint32_t (&a)[4]) {
  const cuda::std::uint32_t q8 = q >> 8;
  a[0] = dequant_fma(q & 0x000f000fu, s.pre_lo, s.neg_lo);
  a[1] = dequant_fma(q & 0x00f000f0u, s.pre_hi, s.neg_hi);
  a[2] = dequant_fma(q8 & 0x000f000fu, s.pre_lo, s.neg_lo);
  a[3] = dequant_fma(q8 & 0x00f000f0u, s.pre_hi, s.neg_hi);
}

}  // namespace ddtree
