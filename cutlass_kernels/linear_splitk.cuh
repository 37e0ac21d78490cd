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

namespace ddtree {

// Stream-K partition of a linear's (row tile, K stage) units over the grid: `units_per_tile` K stages per row
// tile, `tiles` row tiles, U = tiles * units_per_tile units in tile-major order; block b of G takes units
// [b U / G, (b + 1) U / G). The host (runtime/dense_gmma.py gmma_sk_plan) launches it only where every block
// has at most units_per_tile units, so a block touches at most two tiles and the segment that starts a tile
// (the tile's head, which sums the others' partials and writes the output) is always the block's last.
// The other contributors of a tile start inside it; contributor c >= 1 (blocks after the head's) writes its
// fp32 partial to slot c - 1 of the tile, then counts itself on the tile's ticket. `slots` bounds the
// contributors after the head (their starts lie >= floor(U / G) apart inside the tile); the host sizes the
// workspace with the same expression.
struct StreamK {
  long long U;
  int G, units_per_tile;
  __device__ __forceinline__ StreamK(int tiles, int units_per_tile_, int grid)
      : U((long long)tiles * units_per_tile_), G(grid), units_per_tile(units_per_tile_) {}
  __device__ __forceinline__ long long start(int b) const { return (long long)b * U / G; }
  __device__ __forceinline__ int block_of(long long u) const {  // the block whose range holds unit u
    int b = (int)(u * G / U);
    while (b + 1 < G && start(b + 1) <= u) ++b;
    while (b > 0 && start(b) > u) --b;
    return b;
  }
  __device__ __forceinline__ int head_of(int tile) const { return block_of((long long)tile * units_per_tile); }
  __device__ __forceinline__ int contributors(int tile) const {
    return block_of((long long)(tile + 1) * units_per_tile - 1) - head_of(tile) + 1;
  }
  __device__ __forceinline__ int slots() const { return (units_per_tile - 1) / (int)(U / G) + 1; }
};

// A thread's kAcc fp32 accumulators as float4s at slot `slot` of the tile's partials: [slot][kAcc / 4][threads]
// float4 (coalesced per float4 index), through L2.
template <int kAcc, int kThreads>
__device__ __forceinline__ float4* streamk_partial(float* ws, int tile_index, int slots, int slot) {
  return reinterpret_cast<float4*>(ws) + ((size_t)tile_index * slots + slot) * (kAcc / 4) * kThreads + threadIdx.x;
}

// A non-head contributor: its partial into the workspace, then one count on the tile's ticket
// tickets[tile_index] (every thread).
template <int kAcc, int kThreads>
__device__ __forceinline__ void streamk_publish(const float (&acc)[kAcc], float* ws, int* tickets, int tile_index,
                                                int slots, int contributor) {
  float4* dst = streamk_partial<kAcc, kThreads>(ws, tile_index, slots, contributor - 1);
#pragma unroll
  for (int v = 0; v < kAcc / 4; ++v)
    __stcg(dst + v * kThreads, make_float4(acc[4 * v], acc[4 * v + 1], acc[4 * v + 2], acc[4 * v + 3]));
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(tickets + tile_index, 1);
}

// The head: waits for the tile's other contributors, adds their partials to its own in contributor order (the
// same sum whichever block finished last), leaves the ticket at zero for the next launch (every thread).
template <int kAcc, int kThreads>
__device__ __forceinline__ void streamk_gather(float (&acc)[kAcc], const float* ws, int* tickets, int tile_index,
                                               int slots, int contributors) {
  if (contributors <= 1) return;
  int* ticket = tickets + tile_index;
  if (threadIdx.x == 0) {
    // The contributors are resident (the plan's condition) and take microseconds; a wait of seconds means a
    // broken plan or a block that cannot run, and a trap (a launch error) says so where a spin would hang.
    int seen;
    for (unsigned spins = 0;; ++spins) {
      asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(seen) : "l"(ticket) : "memory");
      if (seen >= contributors - 1) break;
      if (spins > (1u << 26)) __trap();
      if (spins > 64) __nanosleep(128);
    }
    *ticket = 0;  // every other contributor has counted itself: none touches it again this launch
  }
  __syncthreads();
  __threadfence();
  for (int c = 1; c < contributors; ++c) {
    const float4* src = streamk_partial<kAcc, kThreads>(const_cast<float*>(ws), tile_index, slots, c - 1);
    float4 p[kAcc / 4];
#pragma unroll
    for (int v = 0; v < kAcc / 4; ++v) p[v] = __ldcg(src + v * kThreads);
#pragma unroll
    for (int v = 0; v < kAcc / 4; ++v) {
      acc[4 * v] += p[v].x;
      acc[4 * v + 1] += p[v].y;
      acc[4 * v + 2] += p[v].z;
      acc[4 * v + 3] += p[v].w;
    }
  }
}

}  // namespace ddtree
