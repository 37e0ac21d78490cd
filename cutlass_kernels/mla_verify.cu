// MLA (DeepSeek-V3 / Kimi K2.x) absorbed attention for tree verify and prefill.
//
// The cache holds per position one 576-wide bf16 row: the 512-d compressed latent then the 64-d rope key.
// Queries arrive absorbed: q[token, head, 0:512] = q_nope @ W_UK[head], q[..., 512:576] = q_rope. All heads
// share the cache row (multi-query), so one M tile of the MMA is 64 (token, head) rows and every KV tile in
// shared memory is used by all of them. Score = q . kv[0:576]; the value is kv[0:512]; the output is the
// attention-weighted latent [token, head, 512] (W_UV is applied after, by mla_head_gemm_kernel).
// Visibility: positions < prefix_len are visible to every query; position prefix_len + j (tree node j) is
// visible to query i iff bit j of mask[i] (the tree contract's uint32 bitmask rows, W words each). With
// mask == nullptr the kernel is causal over the new tokens (the prefill variant): visible iff j <= i.
//
// Block: 8 warps. Warp (rw, half): rows 16*rw..16*rw+15 of the 64-row tile, output columns 256*half...+255.
// For S = Q K^T the two halves split the 576-wide reduction and swap partial sums through shared memory
// (both then hold the identical full S, so the softmax needs no further exchange). P stays in registers
// (the C fragment of S is the A fragment of P V). KV tiles of 32 positions are double-buffered with
// cp.async. The KV range is split over gridDim.z blocks (flash-decoding); with more than one split the
// partial results (unnormalised O, row max, row sum) go to a workspace that mla_combine_kernel merges.

#include <cuda_bf16.h>
#include <cute/arch/mma_sm80.hpp>
#include "device_common.cuh"
#include "mla_common.cuh"

namespace mla {
constexpr int D = 576;          // latent 512 + rope 64
constexpr int DV = mla_common::DV;
constexpr int LD = D + 8;       // padded smem row (elements): 1168 bytes, rows hit different banks
constexpr int BM = 64;          // (token, head) rows per block
constexpr int BN = 32;          // KV positions per tile
constexpr int THREADS = 256;

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  const int n = valid ? 16 : 0;   // 0 source bytes: zero fill
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(d), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N)); }

__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(c[0], c[1], c[2], c[3], a[0], a[1], a[2], a[3], b0, b1,
                                            c[0], c[1], c[2], c[3]);
}
using mla_common::pack_bf16;

// Rows [row0, row0 + NROWS) of a [rows_total, D] bf16 matrix into smem (zero rows past the end). This thread
// copies 16-byte unit tid % 8 of each of the 9 128-byte chunks of rows tid / 8 + 32 h: every address is a base
// plus a constant. (A loop over units i = tid, tid + 256, .. that divided by 72 per copy cost several times the
// instructions.)
template <int NROWS>
__device__ __forceinline__ void load_rows_async(uint16_t* s, const uint16_t* g, int row0, int rows_total) {
  static_assert(THREADS == 256 && NROWS % 32 == 0, "8 lanes per 128-byte chunk row, 32 rows per pass");
  const int uc = threadIdx.x & 7, r0 = threadIdx.x >> 3;
#pragma unroll
  for (int h = 0; h < NROWS / 32; ++h) {
    const int r = r0 + 32 * h;
    const bool ok = row0 + r < rows_total;
    const uint16_t* src = g + (long long)(ok ? row0 + r : 0) * D + uc * 8;
#pragma unroll
    for (int c = 0; c < D / 64; ++c) cp_async16(s + r * LD + c * 64 + uc * 8, src + c * 64, ok);
  }
}
}  // namespace mla

// q: [Tq * H, 576] bf16 (row = token * H + head); kv: [kv_len, 576] bf16 with kv_len = prefix_len + Tq;
// mask: [Tq, mask_words] uint32 or nullptr (causal). With gridDim.z == 1: out bf16 [Tq * H, 512].
// Otherwise: part_o fp32 [splits, Tq * H, 512], part_ml fp32 [splits, Tq * H, 2] (row max in log2 units,
// row sum); positions per split = split_len (a multiple of 32).
extern "C" __global__ void __launch_bounds__(mla::THREADS, 1)
mla_attention_kernel(const uint16_t* __restrict__ q, const uint16_t* __restrict__ kv,
                     const unsigned* __restrict__ mask, int mask_words, int Tq, int H, int prefix_len,
                     float softmax_scale, int split_len, uint16_t* __restrict__ out,
                     float* __restrict__ part_o, float* __restrict__ part_ml) {
  DDTREE_TRACE_WARP(ddtree::kTraceMlaAttention);
  using namespace mla;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint16_t* sq = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* skv = sq + BM * LD;
  float* sx = reinterpret_cast<float*>(skv + 2 * BN * LD);   // [half][rw][4 tiles][4][32]

  ddtree::grid_dependency_wait();  // PDL: q and the KV cache are earlier kernels' outputs
  ddtree::launch_dependents();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int rw = warp & 3, half = warp >> 2;
  const int g = lane >> 2, t = lane & 3;
  const int rows_total = Tq * H;
  const int row0 = blockIdx.x * BM;
  const int kv_len = prefix_len + Tq;
  const int split = blockIdx.z;
  const int kv_begin = split * split_len;
  const int kv_end = min(kv_len, kv_begin + split_len);
  const float sl2 = softmax_scale * 1.4426950408889634f;
  const float NEG_INF = __int_as_float(0xff800000);

  // Rows this lane owns in the S / O fragments, and their query token.
  const int my_row[2] = {row0 + rw * 16 + g, row0 + rw * 16 + g + 8};
  int my_tok[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) my_tok[i] = my_row[i] < rows_total ? my_row[i] / H : -1;

  load_rows_async<BM>(sq, q, row0, rows_total);
  const int ntiles = kv_end > kv_begin ? (kv_end - kv_begin + BN - 1) / BN : 0;
  if (ntiles > 0) load_rows_async<BN>(skv, kv, kv_begin, kv_end);
  cp_async_commit();

  float o[32][4];
#pragma unroll
  for (int j = 0; j < 32; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) o[j][c] = 0.f;
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};

  // The reduction range of S for this half: 288 columns = 18 k16 steps.
  const int k_lo = half * (D / 2);
  for (int it = 0; it < ntiles; ++it) {
    const int p0 = kv_begin + it * BN;
    uint16_t* cur = skv + (it & 1) * BN * LD;
    if (it + 1 < ntiles) {
      load_rows_async<BN>(skv + ((it + 1) & 1) * BN * LD, kv, p0 + BN, kv_end);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    // Partial S over this half's 288 columns: 16 rows x 32 positions.
    float s[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) s[j][c] = 0.f;
#pragma unroll 6
    for (int kk = 0; kk < D / 2 / 16; ++kk) {
      const int k0 = k_lo + kk * 16;
      uint32_t a[4];
      ldsm_x4(a, sq + (rw * 16 + (lane & 15)) * LD + k0 + (lane >> 4) * 8);
#pragma unroll
      for (int nb = 0; nb < 2; ++nb) {
        uint32_t b[4];
        ldsm_x4(b, cur + (nb * 16 + (lane & 7) + ((lane >> 4) << 3)) * LD + k0 + ((lane >> 3) & 1) * 8);
        mma(s[2 * nb], a, b[0], b[1]);
        mma(s[2 * nb + 1], a, b[2], b[3]);
      }
    }
    // Swap partial sums with the other half (same rows), then add: p0 + p1 in both halves.
    float* mine = sx + ((half * 4 + rw) * 16) * 32;
    const float* other = sx + (((1 - half) * 4 + rw) * 16) * 32;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) mine[(j * 4 + c) * 32 + lane] = s[j][c];
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float ov = other[(j * 4 + c) * 32 + lane];
        s[j][c] = half == 0 ? s[j][c] + ov : ov + s[j][c];
      }

    // Mask (masked positions -inf), the row maxima of the raw scores, online softmax per row (mla_common: base 2,
    // the scale folded into the exponent). A tile of prefix positions only skips the per-position test.
    auto s_at = [&](int j, int c) -> float& { return s[j][c]; };
    float mraw[2] = {NEG_INF, NEG_INF};
    if (p0 + BN <= min(prefix_len, kv_end)) {
      mla_common::row_max_raw<4>(s_at, mraw);
    } else {
      uint64_t vis[2];
#pragma unroll
      for (int ri = 0; ri < 2; ++ri)
        vis[ri] = mla_common::visible64(p0, my_tok[ri], kv_end, prefix_len, mask, mask_words) >> (2 * t);
      mla_common::mask_row_max_raw<4>(s_at, vis, mraw);
    }
    float corr[2];
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) mraw[ri] = mla_common::quad_max(mraw[ri]);
    mla_common::rescale_rows(mraw, sl2, m, l, corr);
    uint32_t pa[2][4];   // P as A fragments for two k16 steps of positions
    mla_common::exp_pack<4>(s_at, sl2, m, l, pa);
    mla_common::rescale_o<32>([&](int j, int e) -> float& { return o[j][e]; }, corr);
    // O[16 x 256] += P[16 x 32] V[32 x 256]
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      const uint32_t a[4] = {pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3]};
#pragma unroll
      for (int nb = 0; nb < 16; ++nb) {
        uint32_t b[4];
        ldsm_x4_t(b, cur + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + half * 256 + nb * 16 +
                         (lane >> 4) * 8);
        mma(o[2 * nb], a, b[0], b[1]);
        mma(o[2 * nb + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();   // the tile and the exchange buffer are rewritten next iteration
  }

  cp_async_wait<0>();   // (only matters when this split had no tile: the q copy is still in flight)

  // Row sums: each lane has partial sums over its columns; reduce over the quad.
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) l[ri] = mla_common::quad_sum(l[ri]);
#pragma unroll
  for (int ri = 0; ri < 2; ++ri) {
    const int row = my_row[ri];
    if (row >= rows_total) continue;
    mla_common::store_row<32>(row, half, t, [&](int j, int b) { return o[j][2 * ri + b]; }, m[ri], l[ri], split,
                              rows_total, out, part_o, part_ml);
  }
}

// Merge the KV splits: out[row] = sum_s 2^(m_s - M) O_s / sum_s 2^(m_s - M) l_s. Block (row, quarter) of 8 warps,
// 4 columns per lane (128 per block). One memory round trip for up to kCombinePrefetch * 8 splits: each warp
// loads its splits' O columns (w, w + 8, ...) into registers before the weights are known, while the threads
// read (m_s, l_s) once (splits <= 1024, 4 per thread); then warp w sums its splits in order, and warp 0 adds
// the eight warp sums in order (a fixed order: the same bits every run). The old kernel, 4 warps with three
// dependent passes (max, weights, O), took ~7 us for 65 splits x 16 rows (ncu, session 16).
constexpr int kCombineQuarter = mla::DV / 4;
constexpr int kCombineWarps = 8, kCombinePrefetch = 16, kCombineMlPerThread = 4;
static_assert(kCombineWarps * 32 * kCombineMlPerThread >= 1024, "the split limit (MLA_MAX_SPLITS)");
extern "C" __global__ void __launch_bounds__(kCombineWarps * 32)
mla_combine_kernel(const float* __restrict__ part_o, const float* __restrict__ part_ml, int splits,
                   int rows_total, uint16_t* __restrict__ out) {
  DDTREE_TRACE_WARP(ddtree::kTraceMlaCombine);
  __shared__ float wgt[1024];
  __shared__ float red[2][kCombineWarps];
  __shared__ float4 wsum[kCombineWarps - 1][32];
  const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float NEG_INF = __int_as_float(0xff800000);
  ddtree::grid_dependency_wait();  // PDL: the partials are the previous kernel's output
  ddtree::launch_dependents();
  const int col = blockIdx.y * kCombineQuarter + lane * 4;
  const float* const o_row = part_o + (long long)row * mla::DV + col;
  const long long o_split = (long long)rows_total * mla::DV;
  float4 v[kCombinePrefetch];
#pragma unroll
  for (int i = 0; i < kCombinePrefetch; ++i) {
    const int s = warp + i * kCombineWarps;
    if (s < splits) v[i] = *reinterpret_cast<const float4*>(o_row + s * o_split);
  }
  float2 ml[kCombineMlPerThread];
  float mx = NEG_INF;
#pragma unroll
  for (int i = 0; i < kCombineMlPerThread; ++i) {
    const int s = tid + i * kCombineWarps * 32;
    ml[i] = s < splits ? *reinterpret_cast<const float2*>(part_ml + ((long long)s * rows_total + row) * 2)
                       : make_float2(NEG_INF, 0.f);
    mx = fmaxf(mx, ml[i].x);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if (lane == 0) red[0][warp] = mx;
  __syncthreads();
  float M = red[0][0];
#pragma unroll
  for (int w = 1; w < kCombineWarps; ++w) M = fmaxf(M, red[0][w]);
  float lsum = 0.f;
#pragma unroll
  for (int i = 0; i < kCombineMlPerThread; ++i) {
    const int s = tid + i * kCombineWarps * 32;
    const float w = ml[i].x == NEG_INF ? 0.f : exp2f(ml[i].x - M);   // a split that saw nothing weighs 0
    if (s < splits) wgt[s] = w;
    lsum += w * ml[i].y;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) lsum += __shfl_xor_sync(0xffffffffu, lsum, o);
  if (lane == 0) red[1][warp] = lsum;
  __syncthreads();
  float L = 0.f;
#pragma unroll
  for (int w = 0; w < kCombineWarps; ++w) L += red[1][w];
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int i = 0; i < kCombinePrefetch; ++i) {
    const int s = warp + i * kCombineWarps;
    if (s < splits) {
      const float w = wgt[s];
      acc.x += w * v[i].x; acc.y += w * v[i].y; acc.z += w * v[i].z; acc.w += w * v[i].w;
    }
  }
#pragma unroll 8
  for (int s = warp + kCombinePrefetch * kCombineWarps; s < splits; s += kCombineWarps) {
    const float w = wgt[s];
    const float4 x = *reinterpret_cast<const float4*>(o_row + s * o_split);
    acc.x += w * x.x; acc.y += w * x.y; acc.z += w * x.z; acc.w += w * x.w;
  }
  if (warp > 0) wsum[warp - 1][lane] = acc;
  __syncthreads();
  if (warp > 0) return;
#pragma unroll
  for (int w = 0; w < kCombineWarps - 1; ++w) {
    const float4 x = wsum[w][lane];
    acc.x += x.x; acc.y += x.y; acc.z += x.z; acc.w += x.w;
  }
  const float inv = L > 0.f ? 1.f / L : 0.f;
  uint2 o;
  o.x = mla::pack_bf16(acc.x * inv, acc.y * inv);
  o.y = mla::pack_bf16(acc.z * inv, acc.w * inv);
  *reinterpret_cast<uint2*>(out + (long long)row * mla::DV + col) = o;
}

// Per-head small GEMM for the absorption (q_nope @ W_UK) and the output projection (o_lat @ W_UV^T):
// y[(t*H + h) * ldy + n] = sum_k x[(t*H + h) * ldx + k] * w[h * w_sh + n * w_sn + k * w_sk], bf16 in/out,
// fp32 sum. One warp per
// (t, h, 8 outputs); lanes split K. Memory-bound at decode sizes; good enough beside the attention.
extern "C" __global__ void mla_head_gemm_kernel(const uint16_t* __restrict__ x, const uint16_t* __restrict__ w,
                                                uint16_t* __restrict__ y, int T, int H, int N, int K,
                                                int ldx, int ldy, long long w_sh, int w_sn, int w_sk) {
  DDTREE_TRACE_WARP(ddtree::kTraceMlaHeadGemm);
  ddtree::grid_dependency_wait();  // PDL: nothing global is touched before it
  ddtree::launch_dependents();
  const int lane = threadIdx.x & 31;
  const long long wid = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int nblk = N / 8;
  if (wid >= (long long)T * H * nblk) return;
  const int n0 = (int)(wid % nblk) * 8;
  const int h = (int)((wid / nblk) % H);
  const long long th = wid / nblk;   // t * H + h
  const uint16_t* xr = x + th * ldx;
  const uint16_t* wh = w + h * w_sh;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int k = lane; k < K; k += 32) {
    const float xv = __uint_as_float((unsigned)xr[k] << 16);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      acc[i] += xv * __uint_as_float((unsigned)wh[(long long)(n0 + i) * w_sn + (long long)k * w_sk] << 16);
  }
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], o);
  if (lane < 8) {
    float v = acc[0];
#pragma unroll
    for (int i = 1; i < 8; ++i) if (lane == i) v = acc[i];
    y[th * ldy + n0 + lane] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
}
