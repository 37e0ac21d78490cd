// bf16 linear y[M, N] = x[M, K] @ W[N, K]^T (+ residual), fp32 accumulation, for decode/verify sizes.
//
// Design: weight streaming. At M <= 64 the cost is reading W once, so every W byte is loaded exactly once
// with 16-byte non-caching loads straight into mma.sync A fragments (CuTe's SM80 16x8x16 bf16 atom, which
// every target arch runs): W rows are the MMA's M side (16 rows per warp tile), tokens its N side (8 per
// tile), so M = 1 wastes tensor-core lanes but no bandwidth. The activations (a few KB) go through shared
// memory and are shared by the 8 warps of a block. Three kernels:
// - linear_bf16_gemv_kernel (M <= 8, x's whole K in smem): no split across blocks; the warps of a block
//   share each 16-row W tile's K and reduce in shared memory (the decode path).
// - linear_bf16_xres_kernel (M <= 64): the block's x slice is loaded once; each warp then streams its
//   W rows through a register ring with no barrier; K split over blocks (decode sizes gemv cannot take).
// - linear_bf16_kernel (any M): x chunks double-buffered with cp.async, two barriers per stage, token tiles
//   on blockIdx.z (verify and prefill where the GMMA kernel of dense_linear_sm90.cu does not run).
// Both decode kernels can fuse the op that makes x (rmsnorm, SwiGLU) into the x load (XMODE), and all of
// them issue their first weight loads before the programmatic-dependent-launch wait.
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
#include "device_common.cuh"
#include "linear_splitk.cuh"
using ddtree::cp_async16;
using ddtree::cp_async_commit;
using ddtree::cp_async_wait;
using ddtree::load_stream;
using ddtree::pack8;
using ddtree::unpack8;

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

constexpr int kXPlain = 0, kXRmsNorm = 1, kXSwiGLU = 2;  // linear_bf16_xres_kernel's XMODE

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
  ddtree::splitk_finish<kRows, 128 * RT, kThreads, kReduceIlp>(out, ldo, residual, ldr, ws,
                                                               tickets + blockIdx.z * gridDim.x + blockIdx.x,
                                                               M, N, m0, n_block);
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
  DDTREE_TRACE_WARP(ddtree::kTraceLinearChunked);
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
  ddtree::zero_fragments(acc);

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
  if (n_chunks > 0) load_w(0, wa);  // weights: before the wait (programmatic dependent launch)
  ddtree::grid_dependency_wait();
  ddtree::launch_dependents();
  if (n_chunks > 0) load_x(0, 0);
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

// The x tile of a decode-size linear into shared memory: rows m0..m0+x_rows-1 (x_rows <= kRows; zeros past
// M), columns k_begin..k_begin+width-1 (zeros past k_end), row stride xs_ld; XMODE says how x is made (see
// linear_bf16_xres_kernel). Ends with a block barrier. The rmsnorm weights come prefetched (NormWeights).
template <int XMODE>
struct NormWeights {  // this thread's 16-byte vector of the rmsnorm weight (only XMODE == kXRmsNorm holds one)
  float v[XMODE == kXRmsNorm ? 8 : 1];
  __device__ __forceinline__ void prefetch(const __nv_bfloat16* __restrict__ norm_w, int K) {
    if constexpr (XMODE == kXRmsNorm) {
      if ((int)threadIdx.x < K / 8) unpack8(ddtree::load_stream(norm_w + 8 * threadIdx.x), v);
    }
  }
};

// kXRmsNorm rows c0..c0+kChunk-1 of the x tile (those below `rows`): each thread's 16-byte vector of every row,
// the row's sum of squares over the block, then the normalised slice k_begin..k_end-1 into xs.
template <int kChunk, int XMODE>
__device__ __forceinline__ void rmsnorm_rows(__nv_bfloat16* xs, int xs_ld,
                                             const __nv_bfloat16* __restrict__ x, int ldx,
                                             const __nv_bfloat16* __restrict__ x2, int ldx2,
                                             const NormWeights<XMODE>& nw, float eps,
                                             __nv_bfloat16* __restrict__ sum_out, int ldsum, int K, int m0, int c0,
                                             int rows, int k_begin, int k_end) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __shared__ float partial[kChunk][kWarps];
  const int vec = threadIdx.x;  // this thread's 16-byte vector of each row
  const bool active = vec < K / 8;
  uint4 hv[kChunk];  // each row's h as bf16 (exact: x is bf16 and the residual sum is rounded to bf16)
#pragma unroll
  for (int row = 0; row < kChunk; ++row) {
    const int m = m0 + c0 + row;
    hv[row] = make_uint4(0, 0, 0, 0);
    if (c0 + row >= rows) continue;
    float h[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (active) {
      hv[row] = *reinterpret_cast<const uint4*>(x + (size_t)m * ldx + 8 * vec);
      unpack8(hv[row], h);
      if (x2) {
        float r[8];
        unpack8(*reinterpret_cast<const uint4*>(x2 + (size_t)m * ldx2 + 8 * vec), r);
#pragma unroll
        for (int j = 0; j < 8; ++j) h[j] += r[j];
        hv[row] = pack8(h);
        unpack8(hv[row], h);  // the rounded value, as stored
        if (sum_out) *reinterpret_cast<uint4*>(sum_out + (size_t)m * ldsum + 8 * vec) = hv[row];
      }
    }
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) ss += h[j] * h[j];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) partial[row][warp] = ss;
  }
  __syncthreads();
#pragma unroll
  for (int row = 0; row < kChunk; ++row) {
    if (c0 + row >= rows) break;
    // the cross-warp sum of rmsnorm_kernel's block_sum: a butterfly over lanes holding the warp partials
    float v = lane < kWarps ? partial[row][lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const float inv = rsqrtf(v / (float)K + eps);
    const int col = 8 * vec - k_begin;
    if (active && col >= 0 && 8 * vec < k_end) {
      float h[8];
      unpack8(hv[row], h);
#pragma unroll
      for (int j = 0; j < 8; ++j) h[j] = h[j] * inv * nw.v[j];
      *reinterpret_cast<uint4*>(xs + (c0 + row) * xs_ld + col) = pack8(h);
    }
  }
}

template <int kRows, int XMODE>
__device__ __forceinline__ void load_x_tile(__nv_bfloat16* xs, int xs_ld,
                                            const __nv_bfloat16* __restrict__ x, int ldx,
                                            const __nv_bfloat16* __restrict__ x2, int ldx2,
                                            const NormWeights<XMODE>& nw, float eps,
                                            __nv_bfloat16* __restrict__ sum_out, int ldsum, int M, int K, int m0,
                                            int k_begin, int k_end, int width, int x_rows = kRows) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int vecs_per_row = width / 8;
  if constexpr (XMODE == kXPlain) {
    for (int i = threadIdx.x; i < x_rows * vecs_per_row; i += kThreads) {
      const int row = i / vecs_per_row, col = (i % vecs_per_row) * 8;
      const int m = m0 + row, k = k_begin + col;
      const bool ok = m < M && k < k_end;
      cp_async16(xs + row * xs_ld + col, ok ? (const void*)(x + (size_t)m * ldx + k) : (const void*)x, ok);
    }
    cp_async_commit();
    cp_async_wait<0>();
  } else if constexpr (XMODE == kXSwiGLU) {
    for (int i = threadIdx.x; i < x_rows * vecs_per_row; i += kThreads) {
      const int row = i / vecs_per_row, col = (i % vecs_per_row) * 8;
      const int m = m0 + row, k = k_begin + col;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (m < M && k < k_end) {
        float gf[8], uf[8];
        unpack8(*reinterpret_cast<const uint4*>(x + (size_t)m * ldx + k), gf);
        unpack8(*reinterpret_cast<const uint4*>(x2 + (size_t)m * ldx2 + k), uf);
#pragma unroll
        for (int j = 0; j < 8; ++j) gf[j] = ddtree::silu(gf[j]) * uf[j];
        v = pack8(gf);
      }
      *reinterpret_cast<uint4*>(xs + row * xs_ld + col) = v;
    }
  } else {  // kXRmsNorm: every block normalises whole rows (K <= 8 * kThreads), keeps its k slice
    const int rows = min(kRows, M - m0);
    if constexpr (kRows <= 8) {
      rmsnorm_rows<kRows>(xs, xs_ld, x, ldx, x2, ldx2, nw, eps, sum_out, ldsum, K, m0, 0, rows, k_begin, k_end);
    } else {  // 8 rows at a time: each thread holds a chunk's h in registers
      for (int c0 = 0; c0 < rows; c0 += 8) {
        if (c0 > 0) __syncthreads();  // the previous chunk has read the warp partials
        rmsnorm_rows<8>(xs, xs_ld, x, ldx, x2, ldx2, nw, eps, sum_out, ldsum, K, m0, c0, rows, k_begin, k_end);
      }
    }
    // rows past M and the columns past K (the width rounds up to 64) must read as zeros
    for (int i = threadIdx.x; i < x_rows * vecs_per_row; i += kThreads) {
      const int row = i / vecs_per_row, col = (i % vecs_per_row) * 8;
      if (row >= rows || k_begin + col >= k_end) *reinterpret_cast<uint4*>(xs + row * xs_ld + col) = make_uint4(0, 0, 0, 0);
    }
  }
  __syncthreads();
}

// The decode/verify kernel (M <= 64, one token tile): the block's whole x slice [8*MT, k_per_split] is
// loaded into shared memory once, then each warp streams its 16 W rows through a STAGES-deep register
// ring of 64-wide k units with no block barrier in the loop, so warps drift freely and keep
// STAGES * 2 KB of W in flight each. Dynamic smem = 8*MT * (k_per_split + 32) * 2 bytes.
//
// XMODE fuses the op that produces x into the x load (one launch instead of two, at decode sizes):
//   kXPlain:   x as given.
//   kXRmsNorm: x <- rmsnorm(x (+ x2)) * norm_w, exactly as rmsnorm_kernel (norm_rope.cu) computes it (same
//              rounding and summation order: thread i owns the 16-byte vector i of a row, so K <= 8 * 256).
//              With x2 the residual sum bf16(x + x2) is formed first and, when sum_out is given, written there
//              by the blocks with blockIdx.x == blockIdx.y == 0 (the new residual stream).
//   kXSwiGLU:  x <- silu(x) * x2 elementwise (x = gate, x2 = up), exactly as swiglu_kernel.
template <int MT, int STAGES, int XMODE>
__global__ void __launch_bounds__(kThreads, 2)
linear_bf16_xres_kernel(const __nv_bfloat16* __restrict__ x, int ldx,
                        const __nv_bfloat16* __restrict__ x2, int ldx2,        // XMODE operands (nullable)
                        const __nv_bfloat16* __restrict__ norm_w, float eps,
                        __nv_bfloat16* __restrict__ sum_out, int ldsum,
                        const __nv_bfloat16* __restrict__ w,  // [N, K] row-major, K % 8 == 0
                        __nv_bfloat16* __restrict__ out, int ldo,
                        const __nv_bfloat16* __restrict__ residual, int ldr,  // nullable
                        float* __restrict__ ws, int* __restrict__ tickets,
                        int M, int N, int K, int k_per_split) {
  DDTREE_TRACE_WARP(ddtree::kTraceLinearXres);
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
  ddtree::zero_fragments(acc);

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

  // W first (it has the long latency, and weights are never written inside a graph: these loads may run
  // before the previous kernel has finished), then wait for it, then the x slice, one barrier.
#pragma unroll
  for (int s = 0; s < STAGES; ++s)
    if (s < n_units) load_unit(s, wr[s]);
  NormWeights<XMODE> nw;
  nw.prefetch(norm_w, K);
  ddtree::grid_dependency_wait();
  ddtree::launch_dependents();
  load_x_tile<kRows, XMODE>(xs, xs_ld, x, ldx, x2, ldx2, nw, eps,
                            blockIdx.x == 0 && blockIdx.y == 0 ? sum_out : nullptr, ldsum, M, K,
                            blockIdx.z * kRows, k_begin, k_end, k_per_split);

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

// The small-matrix decode kernel (M <= 8): no split-K across blocks. A block owns 16 * (8 / KW) W rows (a row
// tile) over the whole K; its KW warps per 16-row group take every KW-th 64-wide k unit and sum their
// accumulators through shared memory in a fixed order. So there is no fp32 workspace, ticket or second pass:
// what is left of the critical path is the W prefetch (issued before the grid dependency wait), the x tile
// (L2) and one block reduction per row tile. A block walks row tiles blockIdx.x, + gridDim.x, ...: with a grid
// smaller than the tile count (persistent, ~2 blocks per SM) and each warp's unit count a multiple of STAGES,
// the W ring runs on into the next tile, so a block's load ramp and x tile are paid once, not per tile.
// Dynamic smem = min(M, 8) * (ceil64(K) + 32) * 2 bytes (x's rows; the token rows past M read as zeros).
template <int KW, int STAGES, int XMODE>
__global__ void __launch_bounds__(kThreads, 2)
linear_bf16_gemv_kernel(const __nv_bfloat16* __restrict__ x, int ldx,
                        const __nv_bfloat16* __restrict__ x2, int ldx2,
                        const __nv_bfloat16* __restrict__ norm_w, float eps,
                        __nv_bfloat16* __restrict__ sum_out, int ldsum,
                        const __nv_bfloat16* __restrict__ w,  // [N, K] row-major, K % 8 == 0
                        __nv_bfloat16* __restrict__ out, int ldo,
                        const __nv_bfloat16* __restrict__ residual, int ldr,  // nullable
                        int M, int N, int K) {
  DDTREE_TRACE_WARP(ddtree::kTraceLinearGemv);
  static_assert(kWarps % KW == 0, "KW divides the block's warps");
  constexpr int kRows = 8;                    // one token tile
  constexpr int kRowTiles = kWarps / KW;      // 16-row W groups per block (row tile)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ float4 red[2][kWarps][32];       // the K reduction, double-buffered: one barrier per row tile
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  const int n_units = (K + 63) / 64;
  const int xs_ld = 64 * n_units + kXPad;
  const int x_rows = min(M, kRows);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wk = warp % KW, wr_tile = warp / KW;
  const int n_tiles = (N + 16 * kRowTiles - 1) / (16 * kRowTiles);
  const int my_units = n_units > wk ? (n_units - wk + KW - 1) / KW : 0;  // units wk, wk + KW, ...
  const bool carry = my_units % STAGES == 0;  // ring slot s always holds unit i0 + s: it can run on
  auto rows_of = [&](int tile) { return (tile * kRowTiles + wr_tile) * 16; };

  uint4 wr[STAGES][2][2];
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  auto load_unit = [&](int n_warp, int i, uint4 (&dst)[2][2]) {
    const int u = wk + KW * i;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = n_warp + g + 8 * h;
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const int k = 64 * u + 32 * p + 8 * t;
        dst[h][p] = (n < N && k < K) ? load_stream(w + (size_t)n * K + k) : make_uint4(0, 0, 0, 0);
      }
    }
  };
  auto compute_unit = [&](const uint4 (&a)[2][2], int i) {
    uint4 b_lo = make_uint4(0, 0, 0, 0), b_hi = b_lo;
    if (g < x_rows) {
      const __nv_bfloat16* row = xs + g * xs_ld + 64 * (wk + KW * i) + 8 * t;
      b_lo = *reinterpret_cast<const uint4*>(row);
      b_hi = *reinterpret_cast<const uint4*>(row + 32);
    }
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const uint4& b = s < 2 ? b_lo : b_hi;
      const int lo = (s & 1) * 2;
      cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(
          acc[0], acc[1], acc[2], acc[3],
          pick(a[0][s >> 1], lo), pick(a[1][s >> 1], lo), pick(a[0][s >> 1], lo + 1), pick(a[1][s >> 1], lo + 1),
          pick(b, lo), pick(b, lo + 1), acc[0], acc[1], acc[2], acc[3]);
    }
  };

  int tile = blockIdx.x;
  int n_warp = rows_of(tile);
#pragma unroll
  for (int s = 0; s < STAGES; ++s)
    if (s < my_units) load_unit(n_warp, s, wr[s]);
  NormWeights<XMODE> nw;
  nw.prefetch(norm_w, K);
  ddtree::grid_dependency_wait();
  ddtree::launch_dependents();
  load_x_tile<kRows, XMODE>(xs, xs_ld, x, ldx, x2, ldx2, nw, eps, blockIdx.x == 0 ? sum_out : nullptr, ldsum,
                            M, K, 0, 0, K, 64 * n_units, x_rows);

  for (int parity = 0; tile < n_tiles; tile += gridDim.x, parity ^= 1) {
    const bool has_next = tile + (int)gridDim.x < n_tiles;
    const int n_next = rows_of(tile + gridDim.x);
    for (int i0 = 0; i0 < my_units; i0 += STAGES) {
#pragma unroll
      for (int s = 0; s < STAGES; ++s) {
        const int i = i0 + s;
        if (i < my_units) {
          compute_unit(wr[s], i);
          if (i + STAGES < my_units) load_unit(n_warp, i + STAGES, wr[s]);
          else if (carry && has_next) load_unit(n_next, i + STAGES - my_units, wr[s]);
        }
      }
    }

    // In-block K reduction: warp wk of each row group leaves its fragment; the wk == 0 warp sums 0..KW-1.
    if constexpr (KW > 1) {
      red[parity][warp][lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      __syncthreads();
      if (wk == 0) {
        acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
#pragma unroll
        for (int j = 0; j < KW; ++j) {
          const float4 v = red[parity][warp + j][lane];
          acc[0] += v.x; acc[1] += v.y; acc[2] += v.z; acc[3] += v.w;
        }
      }
    }
    if (wk == 0) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int n = n_warp + g + 8 * (c >> 1);
        const int m = 2 * t + (c & 1);
        if (n < N && m < M) {
          float v = acc[c];
          if (residual) v += __bfloat162float(residual[(size_t)m * ldr + n]);
          out[(size_t)m * ldo + n] = __float2bfloat16(v);
        }
      }
    }
    acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
    if (!carry && has_next) {
#pragma unroll
      for (int s = 0; s < STAGES; ++s)
        if (s < my_units) load_unit(n_next, s, wr[s]);
    }
    n_warp = n_next;
  }
}
