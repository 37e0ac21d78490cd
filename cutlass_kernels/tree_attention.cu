// Attention over a KV cache with a prefix and a block of new tokens (runtime/backends/base.py `attention`):
// queries q [T, Hq, D] at cache slots n_prefix .. n_prefix+T-1; keys/values = cache slots [0, n_prefix+T).
// Every prefix slot is visible; new slot n_prefix+j is visible to query i iff bit j of visibility row i is
// set (uint32 [T, ceil(T/32)]). tree_attention_kernel serves tree verify (ancestor mask), causal prefill
// (lower-triangular mask) and the DFlash block (all ones); decode_attention_kernel the shapes whose T * G query
// rows fit one warp (decode, trees of a few nodes). No dense mask is ever materialised.
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
#include "mla_common.cuh"
#include "tree_attention_common.cuh"

namespace {

constexpr int kRowsPerWarp = 16;
constexpr int kWarps = 4;
constexpr int kTileRows = kRowsPerWarp * kWarps;  // query rows per block
using tree_attention::kTileKeys;
using tree_attention::active_splits;
using tree_attention::query_rows;
using tree_attention::load_q_fragments;
using tree_attention::slot_visible;
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
using mla_common::pack_bf16;
__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                    uint32_t b0, uint32_t b1) {
  cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(d[0], d[1], d[2], d[3], a0, a1, a2, a3, b0, b1,
                                            d[0], d[1], d[2], d[3]);
}

// Cache rows key0 .. key0 + ROWS - 1 (row stride ld, this head's columns from head_col) into a padded
// [ROWS][D + 8] tile, by NT threads (lane: this thread's index among them): 16-byte unit lane % U of rows
// lane / U + (NT / U) j, so the addresses are one pointer and one shared offset stepped by constants. (A loop
// over units i = lane, lane + NT, .. that worked out row and column per copy cost several times the
// instructions.) Rows at or past n_keys are zero-filled (their source is the cache's first row, never read).
template <int D, int ROWS, int NT>
__device__ __forceinline__ void copy_rows(__nv_bfloat16 (*dst)[D + 8], const __nv_bfloat16* __restrict__ cache,
                                          int ld, int head_col, int key0, int n_keys, int lane) {
  constexpr int U = D / 8, RPP = NT / U;   // units per row, rows per pass
  static_assert(NT % U == 0 && ROWS % RPP == 0, "whole passes");
  const int r0 = lane / U, c = (lane % U) * 8;
  const __nv_bfloat16* src = cache + (size_t)(key0 + r0) * ld + head_col + c;
  const size_t step = (size_t)RPP * ld;
  if (key0 + ROWS <= n_keys) {
#pragma unroll
    for (int j = 0; j < ROWS / RPP; ++j) cp_async16(&dst[r0 + RPP * j][c], src + j * step, true);
  } else {
#pragma unroll
    for (int j = 0; j < ROWS / RPP; ++j) {
      const bool in = key0 + r0 + RPP * j < n_keys;
      cp_async16(&dst[r0 + RPP * j][c], in ? src + j * step : cache, in);
    }
  }
}

// One warp, its 16 query rows (this lane: g and g + 8) against KEYS cache slots from key0 on, K and V rows
// [KEYS][D + 8] in shared memory: S = Q K^T, mask and scale, the online softmax update of row_max / row_sum
// (base 2), O += P V.
template <int D, int KEYS>
__device__ __forceinline__ void attend_tile(const uint32_t (&qa)[D / 16][4], const __nv_bfloat16 (*ks)[D + 8],
                                            const __nv_bfloat16 (*vs)[D + 8], int key0, int n_keys, int n_prefix,
                                            const uint32_t* __restrict__ visibility, int vis_words,
                                            const int (&qi)[2], const bool (&valid)[2], float scale_log2,
                                            float (&oacc)[D / 8][4], float (&row_max)[2], float (&row_sum)[2]) {
  constexpr int NT = KEYS / 8;   // n-tiles of 8 keys
  const int lane = threadIdx.x & 31;
  const int t = lane & 3;
  // S = Q K^T for 16 rows x KEYS keys.
  float s[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) s[j][c] = 0.f;
  const int mi = lane >> 3, rr = lane & 7;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
    for (int n2 = 0; n2 < KEYS / 16; ++n2) {
      uint32_t b[4];  // matrices: keys +0..7 | d lo, keys +0..7 | d hi, keys +8..15 | d lo, d hi
      ldmatrix_x4(b, &ks[n2 * 16 + rr + 8 * (mi >> 1)][kk * 16 + 8 * (mi & 1)]);
      mma(s[2 * n2], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b[0], b[1]);
      mma(s[2 * n2 + 1], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b[2], b[3]);
    }

  // Mask (masked slots -inf), then the online softmax update per row (the 4 lanes of a row hold its KEYS keys) in
  // base 2. The tree kernel's 64-slot tiles (RAW) test a tile's slots against its visibility bits loaded once
  // (tile_visible64), take the row maxima of the raw scores (scaling by scale_log2 > 0 keeps the order), fold the
  // scale into one FFMA before ex2.approx, and rescale O only when a row of the warp moved its max: fewer
  // instructions per tile (mla_common's steps). The decode kernel's 16/32-slot tiles keep the per-slot test,
  // scale-then-exp2f and the unconditional rescale: with the RAW softmax and copy_rows together it measured 2-5%
  // slower (SmolLM2 decode and AR step, H200, docs/PERF.md session 18).
  constexpr bool RAW = KEYS >= 64;
  float tile_max[2] = {NEG_INF, NEG_INF};
  // A tile of prefix slots only: all visible, no per-slot test (most of a 64-slot tile's non-MMA instructions at
  // long prefixes: 1.05-1.27x on the tree kernel, H200; the decode kernel's 16/32-slot tiles keep the plain loop,
  // where the branch measured up to 10% slower at SmolLM2 b64, docs/PERF.md session 17).
  auto s_at = [&](int j, int c) -> float& { return s[j][c]; };
  if (RAW && key0 + KEYS <= n_prefix) {
    mla_common::row_max_raw<NT>(s_at, tile_max);
  } else if (RAW) {
    uint64_t vis[2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
      vis[h] = tree_attention::tile_visible64(key0, n_keys, n_prefix, valid[h], qi[h], visibility, vis_words) >> (2 * t);
    mla_common::mask_row_max_raw<NT>(s_at, vis, tile_max);
  } else {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int h = c >> 1;
        const int key = key0 + j * 8 + 2 * t + (c & 1);
        const bool vis = slot_visible(key, n_keys, n_prefix, valid[h], qi[h], visibility, vis_words);
        s[j][c] = vis ? s[j][c] * scale_log2 : NEG_INF;
        tile_max[h] = fmaxf(tile_max[h], s[j][c]);
      }
  }
  // alpha = 2^(old max - new max) for the sum and O; P = 2^(s - max); a row with nothing visible yet takes 0 in
  // the exponent (masked scores give 0, not NaN).
  float alpha[2], base[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
    tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
    const float new_max = fmaxf(row_max[h], RAW ? tile_max[h] * scale_log2 : tile_max[h]);
    base[h] = new_max == NEG_INF ? 0.f : new_max;
    if (RAW) alpha[h] = new_max == row_max[h] ? 1.f : ddtree::exp2_approx(row_max[h] - new_max);
    else alpha[h] = exp2f(row_max[h] - base[h]);
    row_max[h] = new_max;
  }
  float tile_sum[2] = {0.f, 0.f};
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      s[j][c] = RAW ? ddtree::exp2_approx(fmaf(s[j][c], scale_log2, -base[c >> 1])) : exp2f(s[j][c] - base[c >> 1]);
      tile_sum[c >> 1] += s[j][c];
    }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    tile_sum[h] += __shfl_xor_sync(0xffffffffu, tile_sum[h], 1);
    tile_sum[h] += __shfl_xor_sync(0xffffffffu, tile_sum[h], 2);
    row_sum[h] = row_sum[h] * alpha[h] + tile_sum[h];
  }
  if (!RAW || __any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      oacc[j][0] *= alpha[0]; oacc[j][1] *= alpha[0];
      oacc[j][2] *= alpha[1]; oacc[j][3] *= alpha[1];
    }
  }
  // O += P V: the S accumulators of key n-tiles 2kk, 2kk+1 are exactly the A fragment of k-step kk.
#pragma unroll
  for (int kk = 0; kk < KEYS / 16; ++kk) {
    const uint32_t a0 = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
    const uint32_t a1 = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
    const uint32_t a2 = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    const uint32_t a3 = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
    for (int n2 = 0; n2 < D / 16; ++n2) {
      uint32_t b[4];  // matrices: keys +0..7 | d lo, keys +8..15 | d lo, keys +0..7 | d hi, +8..15 | d hi
      ldmatrix_x4_trans(b, &vs[kk * 16 + rr + 8 * (mi & 1)][n2 * 16 + 8 * (mi >> 1)]);
      mma(oacc[2 * n2], a0, a1, a2, a3, b[0], b[1]);
      mma(oacc[2 * n2 + 1], a0, a1, a2, a3, b[2], b[3]);
    }
  }
}

}  // namespace

// grid (ceil(T*G / 64), Hkv, splits), block 128, dynamic smem = tree_attention_smem_bytes(D).
// q/o token strides in elements (head stride D); k/v token strides in elements (head stride D).
// (At D = 64 the register cap keeps 4 blocks per SM, as the split plan's ATTN_BLOCKS_PER_SM assumes.)
template <int D>
__global__ void __launch_bounds__(kWarps * 32, D == 64 ? 4 : 1)
tree_attention_kernel(const __nv_bfloat16* __restrict__ q, int ldq,
                      const __nv_bfloat16* __restrict__ k_cache, int ldk,
                      const __nv_bfloat16* __restrict__ v_cache, int ldv,
                      const uint32_t* __restrict__ visibility, int vis_words,
                      const int* __restrict__ n_prefix_ptr,
                      __nv_bfloat16* __restrict__ o, int ldo,
                      float* __restrict__ ws_o, float* __restrict__ ws_lse,
                      int T, int Hq, int Hkv, float scale_log2, const int* __restrict__ split_table) {
  DDTREE_TRACE_WARP(ddtree::kTraceTreeAttention);
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

  const int row_base = blockIdx.x * kTileRows + warp * kRowsPerWarp;
  int qi[2], head[2];
  bool valid[2];
  query_rows(row_base + g, T, G, kvh, qi, head, valid);
  const bool warp_active = row_base < T * G;

  uint32_t qa[D / 16][4];
  load_q_fragments<D>(qa, q, ldq, qi, head, valid, t);

  float oacc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) oacc[j][c] = 0.f;
  float row_max[2] = {NEG_INF, NEG_INF}, row_sum[2] = {0.f, 0.f};

  auto load_tile = [&](int tile, int buf) {
    const int key0 = tile * kTileKeys;
    copy_rows<D, kTileKeys, kWarps * 32>(ks[buf], k_cache, ldk, kvh * D, key0, n_keys, threadIdx.x);
    copy_rows<D, kTileKeys, kWarps * 32>(vs[buf], v_cache, ldv, kvh * D, key0, n_keys, threadIdx.x);
    cp_async_commit();
  };

  if (tile_begin < tile_end) load_tile(tile_begin, 0);
  for (int tile = tile_begin; tile < tile_end; ++tile) {
    const int buf = (tile - tile_begin) & 1;
    if (tile + 1 < tile_end) { load_tile(tile + 1, buf ^ 1); cp_async_wait<1>(); }
    else cp_async_wait<0>();
    __syncthreads();

    if (warp_active)
      attend_tile<D, kTileKeys>(qa, ks[buf], vs[buf], tile * kTileKeys, n_keys, n_prefix, visibility, vis_words, qi,
                                valid, scale_log2, oacc, row_max, row_sum);
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

// Decode and small trees, one block per 16 packed query rows of a KV head (blockIdx.x; one block where all
// T * G rows fit). Instead of one warp computing while three wait at the block's barriers (tree_attention_kernel
// with few rows), every warp streams its own KT-slot tiles (the block's split dealt round-robin) through its own
// S-stage shared ring, with no block barrier in the loop; the warps' softmax states meet in shared memory at the
// end. Splits over blockIdx.z as in tree_attention_kernel (counted in KT-slot tiles; the plan's table is indexed
// by 64-slot tiles), partials for attention_combine_kernel.
// grid (ceil(T * G / 16), Hkv, splits), block 128, dynamic smem = decode_attention_smem_bytes(D, KT, S)
// (runtime/dense_kernels.py).
template <int D, int KT, int S>
__global__ void __launch_bounds__(kWarps * 32)
decode_attention_kernel(const __nv_bfloat16* __restrict__ q, int ldq,
                        const __nv_bfloat16* __restrict__ k_cache, int ldk,
                        const __nv_bfloat16* __restrict__ v_cache, int ldv,
                        const uint32_t* __restrict__ visibility, int vis_words,
                        const int* __restrict__ n_prefix_ptr,
                        __nv_bfloat16* __restrict__ o, int ldo,
                        float* __restrict__ ws_o, float* __restrict__ ws_lse,
                        int T, int Hq, int Hkv, float scale_log2, const int* __restrict__ split_table) {
  DDTREE_TRACE_WARP(ddtree::kTraceDecodeAttention);
  static_assert(KT % 16 == 0 && S >= 2, "tiles of whole 16-key MMA steps, at least two stages");
  ddtree::grid_dependency_wait();  // PDL: nothing global is touched before it
  ddtree::launch_dependents();
  constexpr int kLd = D + 8;
  using Tile = __nv_bfloat16[KT][kLd];
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  Tile* ring = reinterpret_cast<Tile*>(smem_raw) + warp * 2 * S;  // this warp's K stages, then its V stages
  const int G = Hq / Hkv;
  const int kvh = blockIdx.y;
  const int n_prefix = *n_prefix_ptr;
  const int n_keys = n_prefix + T;
  const int splits = active_splits(n_keys, gridDim.z, split_table);
  if ((int)blockIdx.z >= splits) return;
  const int n_tiles = (n_keys + KT - 1) / KT;
  const int per_split = (n_tiles + splits - 1) / splits;
  const int tile_begin = blockIdx.z * per_split;
  const int tile_end = min(n_tiles, tile_begin + per_split);

  int qi[2], head[2];
  bool valid[2];
  const int row0 = blockIdx.x * 16;   // this block's first packed row
  query_rows(row0 + g, T, G, kvh, qi, head, valid);
  uint32_t qa[D / 16][4];
  load_q_fragments<D>(qa, q, ldq, qi, head, valid, t);
  float oacc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) oacc[j][c] = 0.f;
  float row_max[2] = {NEG_INF, NEG_INF}, row_sum[2] = {0.f, 0.f};

  auto load_tile = [&](int tile, int stage) {  // the warp's own copies: only its lanes wait for them
    // (main's loop, 4 copies unrolled: with copy_rows and the RAW softmax together this kernel grew 5-50% in SASS
    // and measured 2-5% slower, session 18; the two were not timed apart, so both stay out of it)
    const int key0 = tile * KT;
    constexpr int kVecsPerRow = D / 8;
#pragma unroll 4
    for (int i = lane; i < KT * kVecsPerRow; i += 32) {
      const int r = i / kVecsPerRow, c = (i % kVecsPerRow) * 8;
      const int key = key0 + r;
      const bool ok = key < n_keys;
      const size_t slot = ok ? (size_t)key : 0;
      cp_async16(&ring[stage][r][c], k_cache + slot * ldk + kvh * D + c, ok);
      cp_async16(&ring[S + stage][r][c], v_cache + slot * ldv + kvh * D + c, ok);
    }
  };
  const int first = tile_begin + warp;
#pragma unroll
  for (int i = 0; i < S - 1; ++i) {  // S - 1 tiles in flight; a group per stage, empty past the end
    if (first + i * kWarps < tile_end) load_tile(first + i * kWarps, i);
    cp_async_commit();
  }
  for (int tile = first, it = 0; tile < tile_end; tile += kWarps, ++it) {
    cp_async_wait<S - 2>();  // S - 1 + it groups committed: this tile's has landed
    __syncwarp();            // for every lane of the warp
    // the tile S - 1 ahead goes into the stage read in the previous iteration (done: the __syncwarp below)
    const int ahead = tile + (S - 1) * kWarps;
    if (ahead < tile_end) load_tile(ahead, (it + S - 1) % S);
    cp_async_commit();
    attend_tile<D, KT>(qa, ring[it % S], ring[S + it % S], tile * KT, n_keys, n_prefix, visibility, vis_words,
                       qi, valid, scale_log2, oacc, row_max, row_sum);
    __syncwarp();
  }
  cp_async_wait<0>();

  // The warps' states into shared memory (over the rings): unnormalised O [warp][16][D], row max and sum.
  __syncthreads();
  float* so = reinterpret_cast<float*>(smem_raw);
  float* sm = so + kWarps * 16 * D;   // [warp][16] row max, then the merge weights
  float* sl = sm + kWarps * 16;       // [warp][16] row sum, then 1 / the merged sum in sl[row]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = warp * 16 + g + 8 * h;
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
      *reinterpret_cast<float2*>(so + row * D + j * 8 + 2 * t) = make_float2(oacc[j][2 * h], oacc[j][2 * h + 1]);
    if (t == 0) { sm[row] = row_max[h]; sl[row] = row_sum[h]; }
  }
  __syncthreads();
  const int rows = min(16, T * G - row0);   // this block's rows; row r here is packed row row0 + r
  float lse = NEG_INF;
  if (threadIdx.x < rows) {  // per row: each warp's weight 2^(max_w - max), the merged sum
    const int row = threadIdx.x;
    float m = NEG_INF;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, sm[w * 16 + row]);
    float wgt[kWarps], den = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      wgt[w] = m == NEG_INF ? 0.f : exp2f(sm[w * 16 + row] - m);
      den += wgt[w] * sl[w * 16 + row];
    }
    const float inv = den > 0.f ? 1.f / den : 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sm[w * 16 + row] = wgt[w] * inv;
    if (den > 0.f) lse = m + log2f(den);
  }
  __syncthreads();
  // O = sum_w weight_w O_w, 4 columns per thread; one split writes O, several write O / l and the base-2 lse.
  for (int i = threadIdx.x; i < rows * (D / 4); i += kWarps * 32) {
    const int row = i / (D / 4), d = (i % (D / 4)) * 4;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float wt = sm[w * 16 + row];
      const float4 v = *reinterpret_cast<const float4*>(so + (w * 16 + row) * D + d);
      acc.x += wt * v.x; acc.y += wt * v.y; acc.z += wt * v.z; acc.w += wt * v.w;
    }
    const int qrow = (row0 + row) / G, qhead = kvh * G + (row0 + row) % G;
    if (splits == 1) {
      __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(o + (size_t)qrow * ldo + qhead * D + d);
      dst[0] = __floats2bfloat162_rn(acc.x, acc.y);
      dst[1] = __floats2bfloat162_rn(acc.z, acc.w);
    } else {
      const size_t part = (size_t)blockIdx.z * T * Hq + (size_t)qrow * Hq + qhead;
      *reinterpret_cast<float4*>(ws_o + part * D + d) = acc;
    }
  }
  if (splits > 1 && threadIdx.x < rows) {
    const int row = row0 + threadIdx.x;
    ws_lse[(size_t)blockIdx.z * T * Hq + (size_t)(row / G) * Hq + kvh * G + row % G] = lse;
  }
}

// Merge the split partials: o = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M). grid T*Hq, block D.
template <int D>
__global__ void __launch_bounds__(D)
attention_combine_kernel(const float* __restrict__ ws_o, const float* __restrict__ ws_lse, int grid_splits,
                         __nv_bfloat16* __restrict__ o, int ldo, int T, int Hq, const int* __restrict__ n_prefix_ptr,
                         const int* __restrict__ split_table) {
  DDTREE_TRACE_WARP(ddtree::kTraceAttentionCombine);
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
