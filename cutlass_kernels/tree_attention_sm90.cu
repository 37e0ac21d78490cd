// GQA tree-verify attention on Hopper GMMA (wgmma), sm_90a only: the contract of tree_attention.cu's
// tree_attention_kernel (same arguments, grid, split table and fp32 partials for attention_combine_kernel),
// with the tensor-core work on wgmma instead of mma.sync. What bounds it is the instructions a warp issues per KV
// tile (ncu, H200: DRAM 20% busy, 0.3-0.5 issued warps per scheduler with two blocks per SM). The tile copies
// (TileCopy: one pointer and one swizzled offset per thread) and the softmax (mla_common: raw row maxima, one
// FFMA + ex2.approx per score, O rescaled only when a row's max moved) cut a 64-slot prefix tile from ~1100 to
// ~350 instructions per thread: 1.3-1.7x at Qwen3-8B heads from prefix 8k (docs/PERF.md, session 18).
//
// Block: one warpgroup (128 threads) over 64 packed (query, head-in-group) rows of one KV head, KV tiles of 64
// cache slots. Per tile: S = Q K^T (wgmma m64n64k16, Q from registers as the A fragments, K K-major in shared
// memory, D / 16 steps), mask (prefix visible, tree slots through the uint32 visibility rows; none on tiles of
// prefix slots only) and the online softmax in base 2 on the S registers, then O += P V with P straight from the
// S registers (the accumulator layout is the A-register layout: wgmma RS) and V read MN-major (m64nDk16, 4 k16
// steps). O stays in registers (D / 2 fp32 per thread).
//
// Shared memory (dynamic, 1024-aligned): STAGES x (K tile, V tile), each [D / 64 chunks][64 rows][128 B] with
// the 128-byte swizzle (16-byte unit u of row r at unit u ^ (r % 8)), filled by cp.async; STAGES - 1 tiles are
// in flight while the current one is computed. (Q in registers keeps 3 stages at D = 128 in 97 KB: two blocks
// per SM.)
#include <cuda_bf16.h>
#include <cuda/std/cstdint>  // NVRTC has no <cstdint>
#include <cuda/std/utility>
using cuda::std::uint16_t;
using cuda::std::uint32_t;
using cuda::std::uint64_t;
#include "gmma_sm90.cuh"
#include "device_common.cuh"
#include "mla_common.cuh"
#include "tree_attention_common.cuh"

namespace ta90 {
constexpr int BM = 64;                 // packed query rows per block
constexpr int BN = tree_attention::kTileKeys;   // cache slots per KV tile
constexpr int THREADS = 128;
constexpr int CHUNK_BYTES = 64 * 128;  // 64 rows x 64 bf16 columns
template <int D>
constexpr int tile_bytes() { return (D / 64) * CHUNK_BYTES; }

// O += P V for a D-wide V tile read MN-major, A (P) from registers.
template <int D> struct OpPV;
template <> struct OpPV<64> {
  using type = cute::SM90::GMMA::MMA_64x64x16_F32BF16BF16_RS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::MN>;
};
template <> struct OpPV<128> {
  using type = cute::SM90::GMMA::MMA_64x128x16_F32BF16BF16_RS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::MN>;
};

// This thread's share of copying a 64-row tile of D bf16 into the swizzled layout: 16-byte unit u = tid % U of
// rows r0 + RPI j (r0 = tid / U, j < 64 / RPI). RPI is a multiple of 8, so every one of those rows has the same
// swizzled unit position (u & 7) ^ (r0 & 7): one shared offset and one global pointer per tile, stepped by a
// constant per copy. (A loop over i = tid, tid + 128, .. with the row, unit and swizzle worked out per copy cost
// ~25 instructions per cp.async, ~400 per thread per K/V tile.)
template <int D>
struct TileCopy {
  static constexpr int U = D / 8;            // 16-byte units per row
  static constexpr int RPI = THREADS / U;    // rows per pass of the block
  static_assert(RPI % 8 == 0 && 64 % RPI == 0, "whole passes that keep r & 7");
  int r0, col;
  uint32_t dst;   // offset in the tile of this thread's unit in row r0

  __device__ __forceinline__ TileCopy() {
    const int u = threadIdx.x % U;
    r0 = threadIdx.x / U;
    col = u * 8;
    dst = (u >> 3) * CHUNK_BYTES + r0 * 128 + (((u & 7) ^ (r0 & 7)) << 4);
  }
  // Cache rows key0 .. key0 + 63 (row stride ld, this head's columns from `head_col`) into `tile`; rows at or
  // past n_keys zero-filled (their source is the cache's first row, never read).
  __device__ __forceinline__ void load(uint32_t tile, const uint16_t* __restrict__ cache, int ld, int head_col,
                                       int key0, int n_keys) const {
    const uint16_t* src = cache + (size_t)(key0 + r0) * ld + head_col + col;
    const size_t step = (size_t)RPI * ld;
    if (key0 + 64 <= n_keys) {
#pragma unroll
      for (int j = 0; j < 64 / RPI; ++j) ddtree::cp_async16_s(tile + dst + j * RPI * 128, src + j * step, true);
    } else {
#pragma unroll
      for (int j = 0; j < 64 / RPI; ++j) {
        const bool in = key0 + r0 + j * RPI < n_keys;
        ddtree::cp_async16_s(tile + dst + j * RPI * 128, in ? src + j * step : cache, in);
      }
    }
  }
};
}  // namespace ta90

// grid (ceil(T * G / 64), Hkv, splits), block 128, dynamic smem = tree_attention_gmma_smem_bytes(D, STAGES)
// (runtime/dense_kernels.py). Arguments as tree_attention_kernel's.
template <int D, int STAGES>
__global__ void __launch_bounds__(ta90::THREADS)
tree_attention_gmma_kernel(const uint16_t* __restrict__ q, int ldq,
                           const uint16_t* __restrict__ k_cache, int ldk,
                           const uint16_t* __restrict__ v_cache, int ldv,
                           const uint32_t* __restrict__ visibility, int vis_words,
                           const int* __restrict__ n_prefix_ptr,
                           __nv_bfloat16* __restrict__ o, int ldo,
                           float* __restrict__ ws_o, float* __restrict__ ws_lse,
                           int T, int Hq, int Hkv, float scale_log2, const int* __restrict__ split_table) {
  DDTREE_TRACE_WARP(ddtree::kTraceTreeAttentionGmma);
  using namespace ta90;
  static_assert(D == 64 || D == 128, "head dims 64 and 128");
  static_assert(STAGES >= 2, "at least double-buffered");
  constexpr int TB = tile_bytes<D>();
  using OpS = ddtree::GmmaRsOp<BN>::type;
  using OpO = typename OpPV<D>::type;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t smem = (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) + 1023u) & ~1023u;
  auto k_stage = [&](int s) { return smem + 2 * s * TB; };   // V of stage s follows its K
  const float NEG_INF = __int_as_float(0xff800000);

  ddtree::grid_dependency_wait();  // PDL: q and the cache are earlier kernels' outputs
  ddtree::launch_dependents();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int G = Hq / Hkv;
  const int kvh = blockIdx.y;
  const int n_prefix = *n_prefix_ptr;
  const int n_keys = n_prefix + T;
  const int n_tiles = (n_keys + BN - 1) / BN;
  const int splits = tree_attention::active_splits(n_keys, gridDim.z, split_table);
  if ((int)blockIdx.z >= splits) return;
  const int per_split = (n_tiles + splits - 1) / splits;
  const int tile_begin = blockIdx.z * per_split;
  const int tile_end = min(n_tiles, tile_begin + per_split);
  const int ntiles = max(0, tile_end - tile_begin);

  // This thread's rows of the S / O accumulators (wgmma m64nN: warp w holds rows 16 w .. 16 w + 15; element
  // 4 j + 2 i + b is row 16 w + g + 8 i, column 8 j + 2 t + b), as (query, head).
  const int row0 = blockIdx.x * BM;
  int qi[2], head[2];
  bool valid[2];
  tree_attention::query_rows(row0 + warp * 16 + g, T, G, kvh, qi, head, valid);

  uint32_t qa[D / 16][4];   // Q as the A registers of the D / 16 k16 steps of S
  tree_attention::load_q_fragments<D>(qa, reinterpret_cast<const __nv_bfloat16*>(q), ldq, qi, head, valid, t);
  const TileCopy<D> copy;
  auto load_kv = [&](int it) {   // tile tile_begin + it into stage it % STAGES
    const int key0 = (tile_begin + it) * BN;
    const uint32_t sk = k_stage(it % STAGES);
    copy.load(sk, k_cache, ldk, kvh * D, key0, n_keys);
    copy.load(sk + TB, v_cache, ldv, kvh * D, key0, n_keys);
  };
  // Prologue: the first STAGES - 1 tiles, one commit group each.
#pragma unroll
  for (int it = 0; it < STAGES - 1; ++it) {
    if (it < ntiles) load_kv(it);
    ddtree::cp_async_commit();
  }

  float oacc[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) {
    oacc[i] = 0.f;
    cute::warpgroup_fence_operand(oacc[i]);
  }
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};

  for (int it = 0; it < ntiles; ++it) {
    const uint32_t sk = k_stage(it % STAGES), sv = sk + TB;
    ddtree::cp_async_wait<STAGES - 2>();   // tile it landed for this thread's copies
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // cp.async (generic) -> wgmma (async proxy)
    __syncthreads();   // ... for everyone's copies; and every warp is done with the stage refilled below
    if (it + STAGES - 1 < ntiles) load_kv(it + STAGES - 1);
    ddtree::cp_async_commit();   // (an empty group past the end keeps the wait count uniform)

    // S = Q K^T over D: D / 64 chunks x 4 k16 steps.
    float s[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
      s[i] = 0.f;
      cute::warpgroup_fence_operand(s[i]);
    }
    cute::warpgroup_arrive();
#pragma unroll
    for (int c = 0; c < D / 64; ++c) {
      const uint64_t db = ddtree::sw128_desc(sk + c * CHUNK_BYTES, 16);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        ddtree::gmma_rs<OpS>(qa[4 * c + kk], db + 2 * kk, s, cuda::std::make_integer_sequence<int, BN / 2>{});
    }
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<0>();
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) cute::warpgroup_fence_operand(s[i]);

    // Mask (masked slots -inf) and the row maxima of the raw scores.
    const int key0 = (tile_begin + it) * BN;
    auto s_at = [&](int j, int e) -> float& { return s[4 * j + e]; };
    float mraw[2] = {NEG_INF, NEG_INF};
    if (key0 + BN <= n_prefix) {   // a tile of prefix slots only: every slot visible to every row (the common
      mla_common::row_max_raw<BN / 8>(s_at, mraw);   // case at long prefixes: no visibility test)
    } else {
      uint64_t vis[2];
#pragma unroll
      for (int ri = 0; ri < 2; ++ri)
        vis[ri] = tree_attention::tile_visible64(key0, n_keys, n_prefix, valid[ri], qi[ri], visibility, vis_words)
                  >> (2 * t);
      mla_common::mask_row_max_raw<BN / 8>(s_at, vis, mraw);
    }
    // Online softmax (mla_common: base 2, the scale folded into the exponent's FFMA).
    float corr[2];
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) mraw[ri] = mla_common::quad_max(mraw[ri]);
    mla_common::rescale_rows(mraw, scale_log2, m, l, corr);
    uint32_t pa[BN / 16][4];   // P as the A registers of the k16 steps (slots 16 kk .. 16 kk + 15)
    mla_common::exp_pack<BN / 8>(s_at, scale_log2, m, l, pa);
    mla_common::rescale_o<D / 8>([&](int j, int e) -> float& { return oacc[4 * j + e]; }, corr);

    // O += P V: V tile MN-major (D columns: D / 64 chunks CHUNK_BYTES apart), 16 slots per k16 step.
#pragma unroll
    for (int i = 0; i < D / 2; ++i) cute::warpgroup_fence_operand(oacc[i]);
    cute::warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      ddtree::gmma_rs<OpO>(pa[kk], ddtree::sw128_desc(sv + kk * 16 * 128, CHUNK_BYTES), oacc,
                           cuda::std::make_integer_sequence<int, D / 2>{});
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<0>();
#pragma unroll
    for (int i = 0; i < D / 2; ++i) cute::warpgroup_fence_operand(oacc[i]);
  }
  ddtree::cp_async_wait<0>();   // (only empty groups can be left: nothing lands after the exit)

  // Epilogue: O / l per row; several splits write fp32 partials and the base-2 log-sum-exp.
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) {
    const float lsum = mla_common::quad_sum(l[ri]);
    if (!valid[ri]) continue;
    const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
    const size_t qh = (size_t)qi[ri] * Hq + head[ri];
    if (splits == 1) {
      __nv_bfloat16* dst = o + (size_t)qi[ri] * ldo + head[ri] * D;
#pragma unroll
      for (int j = 0; j < D / 8; ++j)
        *reinterpret_cast<__nv_bfloat162*>(dst + j * 8 + 2 * t) =
            __floats2bfloat162_rn(oacc[4 * j + 2 * ri] * inv, oacc[4 * j + 2 * ri + 1] * inv);
    } else {
      const size_t part = (size_t)blockIdx.z * T * Hq + qh;
      float* dst = ws_o + part * D;
#pragma unroll
      for (int j = 0; j < D / 8; ++j)
        *reinterpret_cast<float2*>(dst + j * 8 + 2 * t) =
            make_float2(oacc[4 * j + 2 * ri] * inv, oacc[4 * j + 2 * ri + 1] * inv);
      if (t == 0) ws_lse[part] = lsum > 0.f ? m[ri] + log2f(lsum) : NEG_INF;
    }
  }
}
