// The end of a split-K linear tile, shared by the bf16 linear kernels (dense_linear.cu, dense_linear_sm90.cu).
// Each split has written its fp32 partials to ws[split][m][n] (M x N per split, split = blockIdx.y); the last
// block of the tile to arrive (an atomic ticket per tile, reset by that block so graph replays need no
// memset) sums them in split order, adds the residual, writes bf16.
#pragma once
#include <cuda_bf16.h>

namespace ddtree {

// kRows x kTileN: the tile at (m0, n0). Call from every thread of the block after its partial stores.
template <int kRows, int kTileN, int kThreads, int kIlp>
__device__ __forceinline__ void splitk_finish(__nv_bfloat16* __restrict__ out, int ldo,
                                              const __nv_bfloat16* __restrict__ residual, int ldr,
                                              const float* __restrict__ ws, int* __restrict__ ticket,
                                              int M, int N, int m0, int n0) {
  __shared__ int last_flag;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last_flag = atomicAdd(ticket, 1) == (int)gridDim.y - 1;
  __syncthreads();
  if (!last_flag) return;
  __threadfence();
  // Each thread sums kIlp outputs at once (elements i0 + e*kThreads: still coalesced per e) and the split
  // loop is unrolled, so up to 4*kIlp independent L2 loads are in flight instead of a chain of latencies.
  // Every output is summed as 0 + split 0 + split 1 + ... (+ residual) whatever kIlp is: same bits.
  constexpr int kElems = kRows * kTileN;
  static_assert(kElems % (kIlp * kThreads) == 0, "reduce tiling");
  const int splits = gridDim.y;
  for (int i0 = threadIdx.x; i0 < kElems; i0 += kIlp * kThreads) {
    size_t off[kIlp];
    bool ok[kIlp];
    float v[kIlp];
#pragma unroll
    for (int e = 0; e < kIlp; ++e) {
      const int i = i0 + e * kThreads;
      const int m = m0 + i / kTileN, n = n0 + i % kTileN;
      ok[e] = m < M && n < N;
      off[e] = ok[e] ? (size_t)m * N + n : 0;
      v[e] = 0.f;
    }
#pragma unroll 4
    for (int s = 0; s < splits; ++s) {
      const float* part = ws + (size_t)s * M * N;
#pragma unroll
      for (int e = 0; e < kIlp; ++e)
        if (ok[e]) v[e] += __ldcg(part + off[e]);
    }
#pragma unroll
    for (int e = 0; e < kIlp; ++e) {
      if (!ok[e]) continue;
      const int i = i0 + e * kThreads;
      const int m = m0 + i / kTileN, n = n0 + i % kTileN;
      float r = v[e];
      if (residual) r += __bfloat162float(residual[(size_t)m * ldr + n]);
      out[(size_t)m * ldo + n] = __float2bfloat16(r);
    }
  }
  if (threadIdx.x == 0) *ticket = 0;  // ready for the next launch (graph replay)
}

}  // namespace ddtree
