// int4 -> bf16 dequant for compressed-tensors `pack-quantized` weights (DESIGN.md, Formats):
// weight_packed int32 [N, K/8] with element 8p+i at bits 4i stored as q+8 ("uint4b8"), weight_scale bf16
// [N, K/32], w = (nibble - 8) * scale. Row-major [N, K] makes word p = outputs 8p..8p+7 and group
// g = words 4g..4g+3 = scale g, so both kernels are flat loops and need no N or K.
#include <cuda_bf16.h>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

// CUTLASS's uint4b_t -> bf16 array converter (prmt/lop3 bit tricks, no int->float instructions) yields
// the stored nibble 0..15 exactly; x - 8 is exact in bf16 and (x - 8) * s rounds once, so the result is
// bit-identical to the fp32 reference round_bf16((q - 8) * s), signed zeros included.
template <int N>
__device__ __forceinline__ void dequant(const cutlass::Array<cutlass::uint4b_t, N>& q, __nv_bfloat16 s,
                                        cutlass::Array<cutlass::bfloat16_t, N>& out) {
  out = cutlass::NumericArrayConverter<cutlass::bfloat16_t, cutlass::uint4b_t, N>::convert(q);
  const __nv_bfloat162 s2 = __bfloat162bfloat162(s);
  const __nv_bfloat162 eight = __float2bfloat162_rn(8.0f);
  __nv_bfloat162* x2 = reinterpret_cast<__nv_bfloat162*>(out.data());
#pragma unroll
  for (int i = 0; i < N / 2; ++i) x2[i] = __hmul2(__hsub2(x2[i], eight), s2);
}

// One 32-bit word (8 values) per thread per step, kUnroll independent steps in flight: a warp loads 128
// contiguous bytes and stores 512, both fully coalesced. n_words = N*K/8.
template <int kThreads, int kUnroll = 4>
__global__ void __launch_bounds__(kThreads)
int4_to_bf16_kernel(const uint32_t* __restrict__ packed, const __nv_bfloat16* __restrict__ scales,
                    uint4* __restrict__ out, long long n_words) {
  const long long stride = (long long)gridDim.x * kThreads;
  for (long long base = (long long)blockIdx.x * kThreads + threadIdx.x; base < n_words;
       base += stride * kUnroll) {
    uint32_t w[kUnroll];
    __nv_bfloat16 s[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // all loads first: kUnroll requests in flight per thread
      long long p = base + u * stride;
      if (p < n_words) { w[u] = __ldg(packed + p); s[u] = scales[p >> 2]; }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      long long p = base + u * stride;
      if (p < n_words) {
        cutlass::Array<cutlass::bfloat16_t, 8> x;
        dequant(reinterpret_cast<const cutlass::Array<cutlass::uint4b_t, 8>&>(w[u]), s[u], x);
        out[p] = reinterpret_cast<const uint4&>(x);
      }
    }
  }
}

// Variant kept for the benchmark: one whole group (16-byte load, 64 bytes out) per thread. Fewer
// instructions, but a warp's 16-byte stores land 64 bytes apart (4 partial-sector passes per store).
// n_groups = N*K/32.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
int4_to_bf16_group_kernel(const uint4* __restrict__ packed, const __nv_bfloat16* __restrict__ scales,
                          uint4* __restrict__ out, long long n_groups) {
  const long long stride = (long long)gridDim.x * kThreads;
  for (long long g = (long long)blockIdx.x * kThreads + threadIdx.x; g < n_groups; g += stride) {
    uint4 words = packed[g];
    cutlass::Array<cutlass::bfloat16_t, 32> x;
    dequant(reinterpret_cast<const cutlass::Array<cutlass::uint4b_t, 32>&>(words), scales[g], x);
    const uint4* v = reinterpret_cast<const uint4*>(x.data());
#pragma unroll
    for (int i = 0; i < 4; ++i) out[4 * g + i] = v[i];
  }
}
