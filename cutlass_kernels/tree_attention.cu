// Attention over a KV cache with a prefix and a block of new tokens (runtime/backends/base.py `attention`):
// queries q [T, Hq, D] at cache slots n_prefix .. n_prefix+T-1; keys/values = cache slots [0, n_prefix+T).
// Every prefix slot is visible; new slot n_prefix+j is visible to query i iff bit j of visibility row i is
// set (uint32 [T, ceil(T/32)]). One kernel serves tree verify (ancestor mask), decode (T = 1), causal
// prefill (lower-triangular mask) and the DFlash block (all ones). No dense mask is ever materialised.
//
// Design (flash-attention 2 with GQA packing): the G = Hq/Hkv query heads that share a KV head are packed
// as rows r = i*G + g of one tile, so each K/V tile read from the cache serves G*T rows. A block = 4 warps
// x 16 rows = 64 rows of one KV head; K/V tiles of 64 slots stream through shared memory (cp.async, two
// stages); S = Q K^T and O += P V use the SM80 16x8x16 bf16 MMA (ldmatrix for K, ldmatrix.trans for V);
// online softmax in fp32 in base-2. n_prefix is read from device memory so a captured graph replays at
// any prefix length. Long prefixes with few rows (decode, small trees) split the slots over blockIdx.z
// (flash-decoding); the splits write (O/l, log2 sum) partials that attention_combine_kernel merges.
// The grid's split count is sized for the largest prefix a graph will see; at replay both kernels read how
// many of them to use from split_table[key tiles] (the host's cost-model plan for every prefix length up to
// the bucket's, runtime/dense_kernels.py attention_split_table), so a graph replays at any prefix with that
// prefix's plan; one split writes O directly and the combine kernel exits at once. No table: all of them.
#include <cuda_bf16.h>
#include <cuda/std/cstdint>  // NVRTC has no <cstdint>
using cuda::std::uint16_t;
using cuda::std::uint32_t;
#include <cute/arch/mma_sm80.hpp>
#include "device_common.cuh"

namespace {

constexpr int kRowsPerWarp = 16;
constexpr int kWarps = 4;
constexpr int kTileRows = kRowsPerWarp * kWarps;  // query rows per block
constexpr int kTileKeys = 64;                      // cache slots per stage
#define NEG_INF __int_as_float(0xff800000u)

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                    uint32_t b0, uint32_t b1) {
  cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(d[0], d[1], d[2], d[3], a0, a1, a2, a3, b0, b1,
                                            d[0], d[1], d[2], d[3]);
}

// Splits in use for n_keys keys: the plan's entry for that many key tiles (clamped to the grid), else all.
__device__ __forceinline__ int active_splits(int n_keys, int grid_splits, const int* __restrict__ split_table) {
  if (split_table == nullptr) return grid_splits;
  const int n_tiles = (n_keys + kTileKeys - 1) / kTileKeys;
  return max(1, min(grid_splits, __ldg(split_table + n_tiles)));
}

}  // namespace

// grid (ceil(T*G / 64), Hkv, splits), block 128, dynamic smem = tree_attention_smem_bytes(D).
// q/o token strides in elements (head stride D); k/v token strides in elements (head stride D).
template <int D>
__global__ void __launch_bounds__(kWarps * 32)
tree_attention_kernel(const __nv_bfloat16* __restrict__ q, int ldq,
                      const __nv_bfloat16* __restrict__ k_cache, int ldk,
                      const __nv_bfloat16* __restrict__ v_cache, int ldv,
                      const uint32_t* __restrict__ visibility, int vis_words,
                      const int* __restrict__ n_prefix_ptr,
                      __nv_bfloat16* __restrict__ o, int ldo,
                      float* __restrict__ ws_o, float* __restrict__ ws_lse,
                      int T, int Hq, int Hkv, float scale_log2, const int* __restrict__ split_table) {
  ddtree::grid_dependency_wait();  // PDL: nothing global is touched before it
  ddtree::launch_dependents();
  constexpr int kLd = D + 8;  // 16 B row pad: the 8 rows of an ldmatrix hit 8 different bank groups
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16(*ks)[kTileKeys][kLd] = reinterpret_cast<__nv_bfloat16(*)[kTileKeys][kLd]>(smem_raw);
  __nv_bfloat16(*vs)[kTileKeys][kLd] =
      reinterpret_cast<__nv_bfloat16(*)[kTileKeys][kLd]>(smem_raw + 2 * kTileKeys * kLd * sizeof(__nv_bfloat16));

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int G = Hq / Hkv;
  const int kvh = blockIdx.y;
  const int n_prefix = *n_prefix_ptr;
  const int n_keys = n_prefix + T;
  const int n_tiles = (n_keys + kTileKeys - 1) / kTileKeys;
  const int splits = active_splits(n_keys, gridDim.z, split_table);
  if ((int)blockIdx.z >= splits) return;
  const int per_split = (n_tiles + splits - 1) / splits;
  const int tile_begin = blockIdx.z * per_split;
  const int tile_end = min(n_tiles, tile_begin + per_split);

  // This thread's two query rows (g and g+8 of the warp's 16).
  const int row_base = blockIdx.x * kTileRows + warp * kRowsPerWarp;
  int qi[2], head[2];
  bool valid[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row_base + g + 8 * h;
    valid[h] = r < T * G;
    qi[h] = valid[h] ? r / G : 0;
    head[h] = kvh * G + (valid[h] ? r % G : 0);
  }
  const bool warp_active = row_base < T * G;

  // Q fragments for all of D, loaded once (A operand: rows g / g+8, k = 2t.. and 2t+8..).
  uint32_t qa[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int h = c & 1, d = kk * 16 + 2 * t + 8 * (c >> 1);
      qa[kk][c] = valid[h] ? *reinterpret_cast<const uint32_t*>(q + (size_t)qi[h] * ldq + head[h] * D + d) : 0u;
    }

  float oacc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) oacc[j][c] = 0.f;
  float row_max[2] = {NEG_INF, NEG_INF}, row_sum[2] = {0.f, 0.f};

  auto load_tile = [&](int tile, int buf) {
    const int key0 = tile * kTileKeys;
    constexpr int kVecsPerRow = D / 8;
    for (int i = threadIdx.x; i < kTileKeys * kVecsPerRow; i += kWarps * 32) {
      const int r = i / kVecsPerRow, c = (i % kVecsPerRow) * 8;
      const int key = key0 + r;
      const bool ok = key < n_keys;
      const size_t slot = ok ? (size_t)key : 0;
      cp_async16(&ks[buf][r][c], k_cache + slot * ldk + kvh * D + c, ok);
      cp_async16(&vs[buf][r][c], v_cache + slot * ldv + kvh * D + c, ok);
    }
    cp_async_commit();
  };

  if (tile_begin < tile_end) load_tile(tile_begin, 0);
  for (int tile = tile_begin; tile < tile_end; ++tile) {
    const int buf = (tile - tile_begin) & 1;
    if (tile + 1 < tile_end) { load_tile(tile + 1, buf ^ 1); cp_async_wait<1>(); }
    else cp_async_wait<0>();
    __syncthreads();

    if (warp_active) {
      // S = Q K^T for 16 rows x 64 keys: 8 n-tiles of 8 keys.
      float s[8][4];
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) s[j][c] = 0.f;
      const int mi = lane >> 3, rr = lane & 7;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
        for (int n2 = 0; n2 < 4; ++n2) {
          uint32_t b[4];  // matrices: keys +0..7 | d lo, keys +0..7 | d hi, keys +8..15 | d lo, d hi
          ldmatrix_x4(b, &ks[buf][n2 * 16 + rr + 8 * (mi >> 1)][kk * 16 + 8 * (mi & 1)]);
          mma(s[2 * n2], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b[0], b[1]);
          mma(s[2 * n2 + 1], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b[2], b[3]);
        }

      // Mask + scale, then the online softmax update per row (the 4 lanes of a row hold its 64 keys).
      const int key0 = tile * kTileKeys;
      float tile_max[2] = {NEG_INF, NEG_INF};
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int h = c >> 1;
          const int key = key0 + j * 8 + 2 * t + (c & 1);
          bool vis = key < n_keys;
          if (vis && key >= n_prefix) {
            const int nj = key - n_prefix;
            vis = valid[h] && ((visibility[(size_t)qi[h] * vis_words + (nj >> 5)] >> (nj & 31)) & 1u);
          }
          s[j][c] = vis ? s[j][c] * scale_log2 : NEG_INF;
          tile_max[h] = fmaxf(tile_max[h], s[j][c]);
        }
      float alpha[2], base[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
        const float new_max = fmaxf(row_max[h], tile_max[h]);
        base[h] = new_max == NEG_INF ? 0.f : new_max;  // a fully masked row so far: avoid inf - inf
        alpha[h] = exp2f(row_max[h] - base[h]);
        row_max[h] = new_max;
      }
      float tile_sum[2] = {0.f, 0.f};
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          s[j][c] = exp2f(s[j][c] - base[c >> 1]);
          tile_sum[c >> 1] += s[j][c];
        }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        tile_sum[h] += __shfl_xor_sync(0xffffffffu, tile_sum[h], 1);
        tile_sum[h] += __shfl_xor_sync(0xffffffffu, tile_sum[h], 2);
        row_sum[h] = row_sum[h] * alpha[h] + tile_sum[h];
      }
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        oacc[j][0] *= alpha[0]; oacc[j][1] *= alpha[0];
        oacc[j][2] *= alpha[1]; oacc[j][3] *= alpha[1];
      }
      // O += P V: the S accumulators of key n-tiles 2kk, 2kk+1 are exactly the A fragment of k-step kk.
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint32_t a0 = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
        const uint32_t a1 = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
        const uint32_t a2 = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        const uint32_t a3 = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
        for (int n2 = 0; n2 < D / 16; ++n2) {
          uint32_t b[4];  // matrices: keys +0..7 | d lo, keys +8..15 | d lo, keys +0..7 | d hi, +8..15 | d hi
          ldmatrix_x4_trans(b, &vs[buf][kk * 16 + rr + 8 * (mi & 1)][n2 * 16 + 8 * (mi >> 1)]);
          mma(oacc[2 * n2], a0, a1, a2, a3, b[0], b[1]);
          mma(oacc[2 * n2 + 1], a0, a1, a2, a3, b[2], b[3]);
        }
      }
    }
    __syncthreads();  // the buffer is refilled next iteration
  }

  // Epilogue: O / l per row. Splits write fp32 partials and the base-2 log-sum-exp.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (!valid[h]) continue;
    const float inv = row_sum[h] > 0.f ? 1.f / row_sum[h] : 0.f;
    const size_t qh = (size_t)qi[h] * Hq + head[h];
    if (splits == 1) {
      __nv_bfloat16* dst = o + (size_t)qi[h] * ldo + head[h] * D;
#pragma unroll
      for (int j = 0; j < D / 8; ++j)
        *reinterpret_cast<__nv_bfloat162*>(dst + j * 8 + 2 * t) =
            __floats2bfloat162_rn(oacc[j][2 * h] * inv, oacc[j][2 * h + 1] * inv);
    } else {
      const size_t part = (size_t)blockIdx.z * T * Hq + qh;
      float* dst = ws_o + part * D;
#pragma unroll
      for (int j = 0; j < D / 8; ++j)
        *reinterpret_cast<float2*>(dst + j * 8 + 2 * t) = make_float2(oacc[j][2 * h] * inv, oacc[j][2 * h + 1] * inv);
      if (t == 0) ws_lse[part] = row_sum[h] > 0.f ? row_max[h] + log2f(row_sum[h]) : NEG_INF;
    }
  }
}

// Merge the split partials: o = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M). grid T*Hq, block D.
template <int D>
__global__ void __launch_bounds__(D)
attention_combine_kernel(const float* __restrict__ ws_o, const float* __restrict__ ws_lse, int grid_splits,
                         __nv_bfloat16* __restrict__ o, int ldo, int T, int Hq, const int* __restrict__ n_prefix_ptr,
                         const int* __restrict__ split_table) {
  ddtree::grid_dependency_wait();  // PDL: nothing global is touched before it
  ddtree::launch_dependents();
  const int splits = active_splits(*n_prefix_ptr + T, grid_splits, split_table);
  if (splits == 1) return;  // the attention kernel wrote o itself
  const int qh = blockIdx.x;
  const int qi = qh / Hq, head = qh % Hq;
  const size_t stride = (size_t)T * Hq;
  float m = NEG_INF;
  // Loops unrolled so several splits' L2 loads are in flight (not a chain of latencies); same order, same bits.
#pragma unroll 4
  for (int s = 0; s < splits; ++s) m = fmaxf(m, ws_lse[s * stride + qh]);
  float num = 0.f, den = 0.f;
  if (m != NEG_INF) {
#pragma unroll 4
    for (int s = 0; s < splits; ++s) {
      const float lse = ws_lse[s * stride + qh];
      if (lse == NEG_INF) continue;
      const float w = exp2f(lse - m);
      num += w * ws_o[(s * stride + qh) * D + threadIdx.x];
      den += w;
    }
  }
  o[(size_t)qi * ldo + head * D + threadIdx.x] = __float2bfloat16(den > 0.f ? num / den : 0.f);
}

template __global__ void tree_attention_kernel<64>(const __nv_bfloat16*, int, const __nv_bfloat16*, int,
    const __nv_bfloat16*, int, const uint32_t*, int, const int*, __nv_bfloat16*, int, float*, float*, int, int,
    int, float, const int*);
template __global__ void tree_attention_kernel<128>(const __nv_bfloat16*, int, const __nv_bfloat16*, int,
    const __nv_bfloat16*, int, const uint32_t*, int, const int*, __nv_bfloat16*, int, float*, float*, int, int,
    int, float, const int*);
template __global__ void attention_combine_kernel<64>(const float*, const float*, int, __nv_bfloat16*, int, int,
    int, const int*, const int*);
template __global__ void attention_combine_kernel<128>(const float*, const float*, int, __nv_bfloat16*, int, int,
    int, const int*, const int*);
