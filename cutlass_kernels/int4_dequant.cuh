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

}  // namespace ddtree
