// bf16 linear y[M, N] = x[M, K] @ W[N, K]^T (+ residual), fp32 accumulation, for decode/verify sizes.
//
// Design: weight streaming. At M <= 64 the cost is reading W once, so every W byte is loaded exactly once
// with 16-byte non-caching loads straight into mma.sync A fragments (CuTe's SM80 16x8x16 bf16 atom, which
// every target arch runs): W rows are the MMA's M side (16 rows per warp tile), tokens its N side (8 per
// tile), so M = 1 wastes tensor-core lanes but no bandwidth. The activations (a few KB) go through shared
// memory and are shared by the 8 warps of a block (128*RT W rows). Two kernels:
// - linear_bf16_xres_kernel (M <= 64): the block's whole x slice is loaded once; each warp then streams its
//   W rows through a register ring with no barrier (the decode path: M <= 8 picks it).
// - linear_bf16_kernel (any M): x chunks double-buffered with cp.async, two barriers per stage, token tiles
//   on blockIdx.z (verify buckets above 8 rows and prefill until a GMMA path exists).
// runtime/dense_kernels.py linear_plan chooses; docs/PERF.md has the measurements behind the choice.
//
// K-permutation: the dot product does not care about the order of k, only that A and B agree. In each
// 64-wide k unit, lane (g = lane/4, t = lane%4) loads the 16 contiguous elements [8t, 8t+8) and
// [32+8t, 40+8t) of its rows with two 16-byte loads (4 lanes cover 64 contiguous bytes: full sectors), and
// MMA step s uses elements 4s..4s+3 of that list as "k = 2t, 2t+1, 2t+8, 2t+9". B (x) is read from shared
// memory with the same mapping, so no shuffles or ldmatrix are needed.
//
// Split-K: when N/(128*RT) blocks cannot fill the GPU, blockIdx.y splits K. Each split writes fp32
// partials to a workspace (L2-resident, a few MB at most), and the last block to finish a tile (an atomic
// ticket per tile, reset by that block so graph replays need no memset) sums them and writes bf16.
#include <cuda_bf16.h>
#include <cuda/std/cstdint>  // NVRTC has no <cstdint>
using cuda::std::uint16_t;
using cuda::std::uint32_t;
#include <cute/arch/mma_sm80.hpp>

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kXPad = 32;  // 64 B row pad of the x tile: rows g and g+1 land in different bank halves
// Outputs per thread in one pass of the split-K reduce (1: one at a time, as before; any value gives the
// same bits, only the speed differs). Override with -DLINEAR_REDUCE_ILP=1 in the registry's options.
#ifndef LINEAR_REDUCE_ILP
#define LINEAR_REDUCE_ILP 4
#endif
constexpr int kReduceIlp = LINEAR_REDUCE_ILP;

__device__ __forceinline__ uint4 load_stream(const void* p) {
  // W is read once: do not allocate it in L1 (the x tile and partials use it).
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  int n = valid ? 16 : 0;  // src-size 0 -> zero fill (tails in M and K)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

__device__ __forceinline__ uint32_t pick(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;  // i is a compile-time constant after unrolling
}

}  // namespace

// Epilogue shared by both kernels. Accumulator fragment: c0 (W row g, token 2t), c1 (row g, token 2t+1),
// c2/c3 the same for row g+8. One K split: bf16 out (+ residual). Several: fp32 partials ws[split][m][n],
// then the last block of the tile (atomic ticket) sums them, writes bf16 and resets the ticket.
template <int MT, int RT>
__device__ __forceinline__ void store_or_reduce(const float (&acc)[RT][MT][4], __nv_bfloat16* __restrict__ out,
                                                int ldo, const __nv_bfloat16* __restrict__ residual, int ldr,
                                                float* __restrict__ ws, int* __restrict__ tickets, int M, int N,
                                                int m0, int n_block, int n_warp, int g, int t) {
  constexpr int kRows = 8 * MT;
  __shared__ int last_flag;
  if (gridDim.y == 1) {
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int j = 0; j < MT; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int n = n_warp + 16 * r + g + 8 * (c >> 1);
          const int m = m0 + 8 * j + 2 * t + (c & 1);
          if (n < N && m < M) {
            float v = acc[r][j][c];
            if (residual) v += __bfloat162float(residual[(size_t)m * ldr + n]);
            out[(size_t)m * ldo + n] = __float2bfloat16(v);
          }
        }
    return;
  }

  // Split-K: fp32 partials ws[split][m][n], then the last block of this tile reduces.
  const int split = blockIdx.y;
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int n = n_warp + 16 * r + g + 8 * (c >> 1);
        const int m = m0 + 8 * j + 2 * t + (c & 1);
        if (n < N && m < M) __stcg(ws + ((size_t)split * M + m) * N + n, acc[r][j][c]);
      }
  __threadfence();
  __syncthreads();
  int* ticket = tickets + blockIdx.z * gridDim.x + blockIdx.x;
  if (threadIdx.x == 0) last_flag = atomicAdd(ticket, 1) == (int)gridDim.y - 1;
  __syncthreads();
  if (!last_flag) return;
  __threadfence();
  // Each thread sums kReduceIlp outputs at once (elements i0 + e*kThreads: still coalesced per e) and the
  // split loop is unrolled, so up to 4*kReduceIlp independent L2 loads are in flight instead of one: the
  // serial version was a chain of latencies, ~10 us per linear at 64 rows x 5 splits. Every output is
  // still summed as 0 + split 0 + split 1 + ... (+ residual), so results are bit-identical.
  constexpr int kTileN = 128 * RT;
  constexpr int kElems = kRows * kTileN;  // 1024 * MT * RT: a multiple of kReduceIlp * kThreads
  static_assert(kElems % (kReduceIlp * kThreads) == 0, "reduce tiling");
  const int splits = gridDim.y;
  for (int i0 = threadIdx.x; i0 < kElems; i0 += kReduceIlp * kThreads) {
    size_t off[kReduceIlp];
    bool ok[kReduceIlp];
    float v[kReduceIlp];
#pragma unroll
    for (int e = 0; e < kReduceIlp; ++e) {
      const int i = i0 + e * kThreads;
      const int m = m0 + i / kTileN, n = n_block + i % kTileN;
      ok[e] = m < M && n < N;
      off[e] = ok[e] ? (size_t)m * N + n : 0;
      v[e] = 0.f;
    }
#pragma unroll 4
    for (int s = 0; s < splits; ++s) {
      const float* part = ws + (size_t)s * M * N;
#pragma unroll
      for (int e = 0; e < kReduceIlp; ++e)
        if (ok[e]) v[e] += __ldcg(part + off[e]);
    }
#pragma unroll
    for (int e = 0; e < kReduceIlp; ++e) {
      if (!ok[e]) continue;
      const int i = i0 + e * kThreads;
      const int m = m0 + i / kTileN, n = n_block + i % kTileN;
      float r = v[e];
      if (residual) r += __bfloat162float(residual[(size_t)m * ldr + n]);
      out[(size_t)m * ldo + n] = __float2bfloat16(r);
    }
  }
  if (threadIdx.x == 0) *ticket = 0;  // ready for the next launch (graph replay)
}

// MT: token tiles of 8 per block (block covers 8*MT rows of x; blockIdx.z walks further token tiles).
// RT: 16-row W tiles per warp. A pipeline stage is 128/RT k (32 registers of W per thread per stage).
// MT = 9 asks for two blocks per SM (128 registers, no spills; 154 and one block without the hint); the 0
// for the others emits no hint, exactly as before.
template <int MT, int RT>
__global__ void __launch_bounds__(kThreads, MT == 9 ? 2 : 0)
linear_bf16_kernel(const __nv_bfloat16* __restrict__ x, int ldx,
                   const __nv_bfloat16* __restrict__ w,  // [N, K] row-major, K % 8 == 0
                   __nv_bfloat16* __restrict__ out, int ldo,
                   const __nv_bfloat16* __restrict__ residual, int ldr,  // nullable
                   float* __restrict__ ws, int* __restrict__ tickets,
                   int M, int N, int K, int k_per_split) {
  constexpr int kUnits = 2 / RT;         // 64-wide k units per stage
  constexpr int kChunk = 64 * kUnits;    // k per stage
  constexpr int kRows = 8 * MT;          // token rows per block
  constexpr int kLd = kChunk + kXPad;    // smem row length (elements)
  __shared__ __align__(16) __nv_bfloat16 xs[2][kRows][kLd];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int m0 = blockIdx.z * kRows;
  const int n_block = blockIdx.x * (128 * RT);
  const int n_warp = n_block + warp * 16 * RT;
  const int k_begin = blockIdx.y * k_per_split;
  const int k_end = min(K, k_begin + k_per_split);
  const int n_chunks = (k_end - k_begin + kChunk - 1) / kChunk;

  // W fragment registers of one stage: [row tile][unit][row g / g+8][first / second 16 bytes]
  uint4 wa[RT][kUnits][2][2], wb[RT][kUnits][2][2];
  float acc[RT][MT][4];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[r][j][c] = 0.f;

  auto load_w = [&](int chunk, uint4 (&dst)[RT][kUnits][2][2]) {
    const int kc = k_begin + chunk * kChunk;
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int n = n_warp + 16 * r + g + 8 * h;
#pragma unroll
        for (int u = 0; u < kUnits; ++u)
#pragma unroll
          for (int p = 0; p < 2; ++p) {
            const int k = kc + 64 * u + 32 * p + 8 * t;
            if (n < N && k < k_end) dst[r][u][h][p] = load_stream(w + (size_t)n * K + k);
            else dst[r][u][h][p] = make_uint4(0, 0, 0, 0);
          }
      }
  };
  auto load_x = [&](int chunk, int buf) {
    const int kc = k_begin + chunk * kChunk;
    constexpr int kVecs = kRows * kChunk / 8;
    for (int i = threadIdx.x; i < kVecs; i += kThreads) {
      const int row = i / (kChunk / 8), col = (i % (kChunk / 8)) * 8;
      const int m = m0 + row, k = kc + col;
      const bool ok = m < M && k < k_end;
      cp_async16(&xs[buf][row][col], ok ? (const void*)(x + (size_t)m * ldx + k) : (const void*)x, ok);
    }
    cp_async_commit();
  };
  auto compute = [&](const uint4 (&wr)[RT][kUnits][2][2], int buf) {
#pragma unroll
    for (int u = 0; u < kUnits; ++u)
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        const uint4 b_lo = *reinterpret_cast<const uint4*>(&xs[buf][8 * j + g][64 * u + 8 * t]);
        const uint4 b_hi = *reinterpret_cast<const uint4*>(&xs[buf][8 * j + g][64 * u + 32 + 8 * t]);
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          const uint4& b = s < 2 ? b_lo : b_hi;
          const int lo = (s & 1) * 2;
#pragma unroll
          for (int r = 0; r < RT; ++r) {
            const uint4& a_g = wr[r][u][0][s >> 1];
            const uint4& a_g8 = wr[r][u][1][s >> 1];
            cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(
                acc[r][j][0], acc[r][j][1], acc[r][j][2], acc[r][j][3],
                pick(a_g, lo), pick(a_g8, lo), pick(a_g, lo + 1), pick(a_g8, lo + 1),
                pick(b, lo), pick(b, lo + 1),
                acc[r][j][0], acc[r][j][1], acc[r][j][2], acc[r][j][3]);
          }
        }
      }
  };

  // Two-stage pipeline, unrolled by two so the W register buffers ping-pong without copies.
  if (n_chunks > 0) {
    load_w(0, wa);
    load_x(0, 0);
  }
  for (int c = 0; c < n_chunks; c += 2) {
    if (c + 1 < n_chunks) { load_w(c + 1, wb); load_x(c + 1, 1); cp_async_wait<1>(); }
    else cp_async_wait<0>();
    __syncthreads();
    compute(wa, 0);
    __syncthreads();
    if (c + 1 >= n_chunks) break;
    if (c + 2 < n_chunks) { load_w(c + 2, wa); load_x(c + 2, 0); cp_async_wait<1>(); }
    else cp_async_wait<0>();
    __syncthreads();
    compute(wb, 1);
    __syncthreads();
  }

  store_or_reduce<MT, RT>(acc, out, ldo, residual, ldr, ws, tickets, M, N, m0, n_block, n_warp, g, t);
}

// The decode/verify kernel (M <= 64, one token tile): the block's whole x slice [8*MT, k_per_split] is
// loaded into shared memory once, then each warp streams its 16 W rows through a STAGES-deep register
// ring of 64-wide k units with no block barrier in the loop, so warps drift freely and keep
// STAGES * 2 KB of W in flight each. Dynamic smem = 8*MT * (k_per_split + 32) * 2 bytes.
template <int MT, int STAGES>
__global__ void __launch_bounds__(kThreads, 2)
linear_bf16_xres_kernel(const __nv_bfloat16* __restrict__ x, int ldx,
                        const __nv_bfloat16* __restrict__ w,  // [N, K] row-major, K % 8 == 0
                        __nv_bfloat16* __restrict__ out, int ldo,
                        const __nv_bfloat16* __restrict__ residual, int ldr,  // nullable
                        float* __restrict__ ws, int* __restrict__ tickets,
                        int M, int N, int K, int k_per_split) {
  constexpr int kRows = 8 * MT;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  const int xs_ld = k_per_split + kXPad;  // k_per_split % 64 == 0: rows g, g+1 in different bank halves

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n_block = blockIdx.x * 128;
  const int n_warp = n_block + warp * 16;
  const int k_begin = blockIdx.y * k_per_split;
  const int k_end = min(K, k_begin + k_per_split);
  const int n_units = (k_end - k_begin + 63) / 64;

  uint4 wr[STAGES][2][2];  // [ring slot][row g / g+8][first / second 16 bytes of the unit]
  float acc[1][MT][4];
#pragma unroll
  for (int j = 0; j < MT; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[0][j][c] = 0.f;

  auto load_unit = [&](int u, uint4 (&dst)[2][2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = n_warp + g + 8 * h;
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const int k = k_begin + 64 * u + 32 * p + 8 * t;
        dst[h][p] = (n < N && k < k_end) ? load_stream(w + (size_t)n * K + k) : make_uint4(0, 0, 0, 0);
      }
    }
  };
  auto compute_unit = [&](const uint4 (&a)[2][2], int u) {
#pragma unroll
    for (int j = 0; j < MT; ++j) {
      const __nv_bfloat16* row = xs + (8 * j + g) * xs_ld + 64 * u + 8 * t;
      const uint4 b_lo = *reinterpret_cast<const uint4*>(row);
      const uint4 b_hi = *reinterpret_cast<const uint4*>(row + 32);
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const uint4& b = s < 2 ? b_lo : b_hi;
        const int lo = (s & 1) * 2;
        cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(
            acc[0][j][0], acc[0][j][1], acc[0][j][2], acc[0][j][3],
            pick(a[0][s >> 1], lo), pick(a[1][s >> 1], lo), pick(a[0][s >> 1], lo + 1), pick(a[1][s >> 1], lo + 1),
            pick(b, lo), pick(b, lo + 1),
            acc[0][j][0], acc[0][j][1], acc[0][j][2], acc[0][j][3]);
      }
    }
  };

  // W first (it has the long latency), then the x slice, one barrier.
#pragma unroll
  for (int s = 0; s < STAGES; ++s)
    if (s < n_units) load_unit(s, wr[s]);
  const int vecs_per_row = k_per_split / 8;
  for (int i = threadIdx.x; i < kRows * vecs_per_row; i += kThreads) {
    const int row = i / vecs_per_row, col = (i % vecs_per_row) * 8;
    const int m = blockIdx.z * kRows + row, k = k_begin + col;
    const bool ok = m < M && k < k_end;
    cp_async16(xs + row * xs_ld + col, ok ? (const void*)(x + (size_t)m * ldx + k) : (const void*)x, ok);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  for (int u0 = 0; u0 < n_units; u0 += STAGES) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      const int u = u0 + s;
      if (u < n_units) {
        compute_unit(wr[s], u);
        if (u + STAGES < n_units) load_unit(u + STAGES, wr[s]);
      }
    }
  }
  store_or_reduce<MT, 1>(acc, out, ldo, residual, ldr, ws, tickets, M, N, blockIdx.z * kRows, n_block, n_warp, g, t);
}

// The curated instantiations. linear_bf16_kernel: token tiles of 8..64 rows, any M through blockIdx.z (RT=2
// halves shared-memory B traffic per W byte at 64 rows); 72 rows for M = 65..72, the verify of budget 64
// (root + 64 nodes), which 64-row tiles would split into a full tile plus a one-row tile that re-reads W.
// linear_bf16_xres_kernel: the M <= 64 path, a 4-deep W ring (2-deep variants for the benchmark).
template __global__ void linear_bf16_kernel<1, 1>(const __nv_bfloat16*, int, const __nv_bfloat16*,
    __nv_bfloat16*, int, const __nv_bfloat16*, int, float*, int*, int, int, int, int);
template __global__ void linear_bf16_kernel<2, 1>(const __nv_bfloat16*, int, const __nv_bfloat16*,
    __nv_bfloat16*, int, const __nv_bfloat16*, int, float*, int*, int, int, int, int);
template __global__ void linear_bf16_kernel<4, 1>(const __nv_bfloat16*, int, const __nv_bfloat16*,
    __nv_bfloat16*, int, const __nv_bfloat16*, int, float*, int*, int, int, int, int);
template __global__ void linear_bf16_kernel<8, 1>(const __nv_bfloat16*, int, const __nv_bfloat16*,
    __nv_bfloat16*, int, const __nv_bfloat16*, int, float*, int*, int, int, int, int);
template __global__ void linear_bf16_kernel<9, 1>(const __nv_bfloat16*, int, const __nv_bfloat16*,
    __nv_bfloat16*, int, const __nv_bfloat16*, int, float*, int*, int, int, int, int);
template __global__ void linear_bf16_kernel<8, 2>(const __nv_bfloat16*, int, const __nv_bfloat16*,
    __nv_bfloat16*, int, const __nv_bfloat16*, int, float*, int*, int, int, int, int);
template __global__ void linear_bf16_xres_kernel<1, 4>(const __nv_bfloat16*, int, const __nv_bfloat16*,
    __nv_bfloat16*, int, const __nv_bfloat16*, int, float*, int*, int, int, int, int);
template __global__ void linear_bf16_xres_kernel<2, 4>(const __nv_bfloat16*, int, const __nv_bfloat16*,
    __nv_bfloat16*, int, const __nv_bfloat16*, int, float*, int*, int, int, int, int);
template __global__ void linear_bf16_xres_kernel<4, 4>(const __nv_bfloat16*, int, const __nv_bfloat16*,
    __nv_bfloat16*, int, const __nv_bfloat16*, int, float*, int*, int, int, int, int);
template __global__ void linear_bf16_xres_kernel<8, 4>(const __nv_bfloat16*, int, const __nv_bfloat16*,
    __nv_bfloat16*, int, const __nv_bfloat16*, int, float*, int*, int, int, int, int);
template __global__ void linear_bf16_xres_kernel<1, 2>(const __nv_bfloat16*, int, const __nv_bfloat16*,
    __nv_bfloat16*, int, const __nv_bfloat16*, int, float*, int*, int, int, int, int);
template __global__ void linear_bf16_xres_kernel<8, 2>(const __nv_bfloat16*, int, const __nv_bfloat16*,
    __nv_bfloat16*, int, const __nv_bfloat16*, int, float*, int*, int, int, int, int);
