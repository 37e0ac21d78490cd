// MLA absorbed attention (tree verify / prefill) on Hopper GMMA (wgmma), sm_90a only: the same contract as
// mla_verify.cu's mla_attention_kernel (q [Tq*H, 576], kv [kv_len, 576], mask or causal, split-KV partials for
// mla_combine_kernel), with the tensor-core work on wgmma instead of mma.sync (ncu on that kernel: one block
// of 8 warps per SM, tensor pipe 25% busy, stalled on dependency chains and shared-memory fragment loads).
//
// Block: two warpgroups over one 64-row tile of (token, head) rows and 64-position KV tiles. Both warpgroups
// compute the whole S = Q K^T of the tile (64 x 64, 36 wgmma m64n64k16 with both operands K-major in shared
// memory): the duplicated S work (+~50% FLOPs) buys no exchange between them, and both derive the identical
// softmax. Warpgroup wg then accumulates O[:, 256 wg .. 256 wg + 255] += P V with P straight from its S
// registers (the accumulator layout is the A-register layout: wgmma RS) and V = the same KV tile read
// MN-major (wgmma m64n256k16, 4 k16 steps per tile). O lives in registers (128 fp32 per thread).
//
// Shared memory (dynamic, 1024-aligned): Q and two KV tiles, each [9 chunks of 64 columns][64 rows][128 B]
// with the 128-byte swizzle (16-byte unit u of row r stored at unit u ^ (r % 8)), filled by cp.async: 3 x 72 KB
// = 216 KB + 1 KB alignment. The next KV tile is in flight while the current one is computed.
//
// SPLIT_S = 1 (built, measured next): no duplicated S. Warpgroup wg computes S for positions 32 wg .. 32 wg + 31
// of the tile (wgmma m64n32k16); the two exchange their row maxima through shared memory (both then hold the
// same running max), each writes its half of P (bf16) into a swizzled 64 x 64 tile, and O += P V reads P from
// shared memory (wgmma SS). Row sums are kept per warpgroup and added (warpgroup 0's + 1's) at the end. Two
// more block barriers per tile; 35% less tensor work per block. + 8 KB (P) + 1 KB (maxima, sums).
#include <cuda_bf16.h>
#include <cuda/std/cstdint>  // NVRTC has no <cstdint>
#include <cuda/std/utility>
using cuda::std::uint32_t;
using cuda::std::uint64_t;
#include "gmma_sm90.cuh"
#include "device_common.cuh"
#include "mla_common.cuh"

namespace mla90 {
constexpr int D = 576;
constexpr int BM = 64;                 // (token, head) rows per block
constexpr int BN = 64;                 // KV positions per tile
constexpr int CHUNKS = D / 64;         // 64-column (128-byte) chunks of a row
constexpr int CHUNK_BYTES = 64 * 128;  // one chunk of a 64-row tile
constexpr int TILE_BYTES = CHUNKS * CHUNK_BYTES;
constexpr int THREADS = 256;

constexpr int P_BYTES = 64 * 128;      // P tile (SPLIT_S): 64 rows x 64 positions bf16, swizzled
using OpS = ddtree::GmmaOp<64>::type;     // S = Q K^T over a 64-position tile
using OpS32 = ddtree::GmmaOp<32>::type;   // SPLIT_S: this warpgroup's 32 positions
using OpO = cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_RS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::MN>;
using OpOs = cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::MN>;

using ddtree::cp_async16_s;
using ddtree::gmma_rs;
using ddtree::gmma_ss;
using ddtree::sw128_desc;

// Rows [row0, row0 + 64) of a [rows_total, 576] bf16 matrix into a swizzled tile (zero rows past the end). This
// thread copies 16-byte unit uc = tid % 8 of each of the 9 128-byte chunks of rows tid / 8 and tid / 8 + 32: the
// swizzled position uc ^ (r % 8) is the same for both, so every address is a base plus a constant. (A loop over
// units i = tid, tid + 256, .. that divided by 72 per copy was most of a tile's instructions.)
__device__ __forceinline__ void load_tile(uint32_t tile, const uint16_t* g, int row0, int rows_total) {
  static_assert(THREADS == 256 && BM == 64, "8 lanes per 128-byte chunk row, 32 rows per pass, 2 passes");
  const int uc = threadIdx.x & 7, r0 = threadIdx.x >> 3;
  const uint32_t dst = tile + r0 * 128 + ((uc ^ (r0 & 7)) << 4);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + 32 * h;
    const bool ok = row0 + r < rows_total;
    const uint16_t* src = g + (long long)(ok ? row0 + r : 0) * D + uc * 8;
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) cp_async16_s(dst + h * 32 * 128 + c * CHUNK_BYTES, src + c * 64, ok);
  }
}

using mla_common::pack_bf16;
}  // namespace mla90

template <int SPLIT_S>
__global__ void __launch_bounds__(mla90::THREADS, 1)
mla_attention_gmma_kernel(const uint16_t* __restrict__ q, const uint16_t* __restrict__ kv,
                          const unsigned* __restrict__ mask, int mask_words, int Tq, int H, int prefix_len,
                          float softmax_scale, int split_len, uint16_t* __restrict__ out,
                          float* __restrict__ part_o, float* __restrict__ part_ml) {
  DDTREE_TRACE_WARP(ddtree::kTraceMlaAttentionGmma);
  using namespace mla90;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t smem_base = (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) + 1023u) & ~1023u;
  const uint32_t sq = smem_base, skv = smem_base + TILE_BYTES;   // Q, then KV tiles 0 and 1
  const uint32_t sp = smem_base + 3 * TILE_BYTES;                 // SPLIT_S: the P tile, then maxima and sums
  float* const xchg = reinterpret_cast<float*>(smem_raw + (sp + P_BYTES - static_cast<uint32_t>(
      __cvta_generic_to_shared(smem_raw))));                       // [2 warpgroups][64 rows]
  constexpr int SN = SPLIT_S ? 32 : 64;   // positions of S per warpgroup
  constexpr int SACC = SN / 2;            // S accumulators per thread

  ddtree::grid_dependency_wait();  // PDL: q and the KV cache are earlier kernels' outputs
  ddtree::launch_dependents();
  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int rows_total = Tq * H;
  const int row0 = blockIdx.x * BM;
  const int kv_len = prefix_len + Tq;
  const int split = blockIdx.z;
  const int kv_begin = split * split_len;
  const int kv_end = min(kv_len, kv_begin + split_len);
  const float sl2 = softmax_scale * 1.4426950408889634f;
  const float NEG_INF = __int_as_float(0xff800000);

  // Rows this thread owns in the S / O accumulators (wgmma m64nN: warp w of the warpgroup holds rows
  // 16 w .. 16 w + 15; element 4 j + 2 i + b is row 16 w + g + 8 i, column 8 j + 2 t + b), and their token.
  const int my_row[2] = {row0 + warp * 16 + g, row0 + warp * 16 + g + 8};
  int my_tok[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) my_tok[i] = my_row[i] < rows_total ? my_row[i] / H : -1;

  const int ntiles = kv_end > kv_begin ? (kv_end - kv_begin + BN - 1) / BN : 0;
  load_tile(sq, q, row0, rows_total);
  if (ntiles > 0) load_tile(skv, kv, kv_begin, kv_end);
  ddtree::cp_async_commit();

  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) {
    o[i] = 0.f;
    cute::warpgroup_fence_operand(o[i]);
  }
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};

  for (int it = 0; it < ntiles; ++it) {
    const int p0 = kv_begin + it * BN;
    const uint32_t cur = skv + (it & 1) * TILE_BYTES;
    ddtree::cp_async_wait<0>();
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // cp.async (generic) -> wgmma (async proxy)
    __syncthreads();   // tile it is visible to all; every warpgroup is done with tile it - 1 (waited below)
    if (it + 1 < ntiles) {
      load_tile(skv + ((it + 1) & 1) * TILE_BYTES, kv, p0 + BN, kv_end);
      ddtree::cp_async_commit();
    }

    // S = Q K^T over the 576 columns: 9 chunks x 4 k16 steps (SPLIT_S: this warpgroup's 32 positions).
    float s[SACC];
#pragma unroll
    for (int i = 0; i < SACC; ++i) cute::warpgroup_fence_operand(s[i]);
    cute::warpgroup_arrive();
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
      const uint64_t da = sw128_desc(sq + c * CHUNK_BYTES, 16);
      const uint64_t db = sw128_desc(cur + c * CHUNK_BYTES + (SPLIT_S ? wg * 32 * 128 : 0), 16);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const auto sc = c == 0 && kk == 0 ? cute::SM90::GMMA::ScaleOut::Zero : cute::SM90::GMMA::ScaleOut::One;
        if constexpr (SPLIT_S)
          gmma_ss<OpS32>(da + 2 * kk, db + 2 * kk, s, sc, cuda::std::make_integer_sequence<int, SACC>{});
        else
          gmma_ss<OpS>(da + 2 * kk, db + 2 * kk, s, sc, cuda::std::make_integer_sequence<int, SACC>{});
      }
    }
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<0>();
#pragma unroll
    for (int i = 0; i < SACC; ++i) cute::warpgroup_fence_operand(s[i]);
    const int ps = p0 + (SPLIT_S ? wg * 32 : 0);   // position of this warpgroup's first S column

    // Mask (masked positions -inf), the row maxima of the raw scores, online softmax per row (the 4 lanes of a
    // quad share a row; mla_common: base 2, the scale folded into the exponent).
    auto s_at = [&](int j, int e) -> float& { return s[4 * j + e]; };
    float mraw[2] = {NEG_INF, NEG_INF};
    if (ps + SN <= min(prefix_len, kv_end)) {   // prefix positions only: visible to every real row, no per-slot
      mla_common::row_max_raw<SN / 8>(s_at, mraw);   // test (as tree_attention_sm90.cu; padding rows never stored)
    } else {
      uint64_t vis[2];
#pragma unroll
      for (int ri = 0; ri < 2; ++ri)
        vis[ri] = mla_common::visible64(ps, my_tok[ri], kv_end, prefix_len, mask, mask_words) >> (2 * t);
      mla_common::mask_row_max_raw<SN / 8>(s_at, vis, mraw);
    }
    float corr[2];
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) mraw[ri] = mla_common::quad_max(mraw[ri]);
    if constexpr (SPLIT_S) {   // the row max over both halves: fmaxf is exact, so both get the same value
      if (t == 0) {
        xchg[wg * 64 + warp * 16 + g] = mraw[0];
        xchg[wg * 64 + warp * 16 + g + 8] = mraw[1];
      }
      __syncthreads();
      mraw[0] = fmaxf(mraw[0], xchg[(1 - wg) * 64 + warp * 16 + g]);
      mraw[1] = fmaxf(mraw[1], xchg[(1 - wg) * 64 + warp * 16 + g + 8]);
    }
    mla_common::rescale_rows(mraw, sl2, m, l, corr);
    uint32_t pa[SN / 16][4];   // P as the A registers of k16 steps (positions 16 kk .. 16 kk + 15)
    mla_common::exp_pack<SN / 8>(s_at, sl2, m, l, pa);
    mla_common::rescale_o<32>([&](int j, int e) -> float& { return o[4 * j + e]; }, corr);

    if constexpr (SPLIT_S) {   // this half of P into the swizzled [64 rows][64 positions] tile
      unsigned char* pt = smem_raw + (sp - static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)));
#pragma unroll
      for (int kk = 0; kk < 2; ++kk)
#pragma unroll
        for (int h = 0; h < 2; ++h)        // positions +0..7 / +8..15 of the k16 step
#pragma unroll
          for (int ri = 0; ri < 2; ++ri) {   // rows g / g + 8
            const int r = warp * 16 + g + 8 * ri, unit = wg * 4 + kk * 2 + h;
            *reinterpret_cast<uint32_t*>(pt + r * 128 + ((unit ^ (r & 7)) << 4) + t * 4) = pa[kk][2 * h + ri];
          }
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // st.shared (generic) -> wgmma
      __syncthreads();
    }

    // O[:, 256 wg ..] += P V: V = this tile's columns 256 wg .. 256 wg + 255 (chunks 4 wg .. 4 wg + 3), MN-major.
#pragma unroll
    for (int i = 0; i < 128; ++i) cute::warpgroup_fence_operand(o[i]);
    cute::warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const uint64_t dv = sw128_desc(cur + 4 * wg * CHUNK_BYTES + kk * 16 * 128, CHUNK_BYTES);
      if constexpr (SPLIT_S)
        gmma_ss<OpOs>(sw128_desc(sp, 16) + 2 * kk, dv, o, cute::SM90::GMMA::ScaleOut::One,
                       cuda::std::make_integer_sequence<int, 128>{});
      else
        gmma_rs<OpO>(pa[kk], dv, o, cuda::std::make_integer_sequence<int, 128>{});
    }
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<0>();
#pragma unroll
    for (int i = 0; i < 128; ++i) cute::warpgroup_fence_operand(o[i]);
  }

  ddtree::cp_async_wait<0>();   // (only matters when this split had no tile: the q copy is still in flight)

#pragma unroll
  for (int ri = 0; ri < 2; ++ri) l[ri] = mla_common::quad_sum(l[ri]);
  if constexpr (SPLIT_S) {   // each warpgroup summed its own positions: total = warpgroup 0's + 1's
    __syncthreads();         // the last tile's maxima have been read
    if (t == 0) {
      xchg[wg * 64 + warp * 16 + g] = l[0];
      xchg[wg * 64 + warp * 16 + g + 8] = l[1];
    }
    __syncthreads();
    l[0] = xchg[warp * 16 + g] + xchg[64 + warp * 16 + g];
    l[1] = xchg[warp * 16 + g + 8] + xchg[64 + warp * 16 + g + 8];
  }
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) {
    const int row = my_row[ri];
    if (row >= rows_total) continue;
    mla_common::store_row<32>(row, wg, t, [&](int j, int b) { return o[4 * j + 2 * ri + b]; }, m[ri], l[ri], split,
                              rows_total, out, part_o, part_ml);
  }
}
