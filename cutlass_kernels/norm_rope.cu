// Small memory-bound kernels of a llama-family layer: embedding gather, RMSNorm (optionally fused with the
// residual add), RoPE (rotate-half or interleaved, YaRN/llama3 scaling folded into inv_freq and
// attention_scaling on the host; optional per-head RMSNorm for Qwen3's q_norm/k_norm), SwiGLU, add.
// bf16 in and out, fp32 math, 16-byte accesses where rows are contiguous. Each is a few microseconds at
// decode sizes: their job is to not be the bottleneck and to fuse what the layer would otherwise round-trip.
#include <cuda_bf16.h>
#include <cuda/std/cstdint>  // NVRTC has no <cstdint>
using cuda::std::uint16_t;
using cuda::std::uint32_t;
#include "device_common.cuh"
using ddtree::grid_dependency_wait;
using ddtree::pack8;
using ddtree::unpack8;

// Every kernel here waits for the previous kernel (programmatic dependent launch, device_common.cuh)
// before its first global access: they read only activations.

namespace {

// Sum over the block (blockDim.x a multiple of 32, <= 1024). Every thread gets the result.
__device__ float block_sum(float v) {
  __shared__ float partial[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
  __syncthreads();  // partial[] may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < n_warps ? partial[lane] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

}  // namespace

// out[t, :] = table[ids[t], :]. One block per token; H % 8 == 0. Out-of-range ids write zeros (and are
// rejected on the host before the launch).
extern "C" __global__ void embedding_kernel(const __nv_bfloat16* __restrict__ table,
                                            const int* __restrict__ ids, __nv_bfloat16* __restrict__ out,
                                            int H, int V) {
  DDTREE_TRACE_WARP(ddtree::kTraceEmbedding);
  grid_dependency_wait();
  ddtree::launch_dependents();
  const int tok = blockIdx.x;
  const int id = ids[tok];
  const uint4* src = reinterpret_cast<const uint4*>(table + (size_t)id * H);
  uint4* dst = reinterpret_cast<uint4*>(out + (size_t)tok * H);
  const bool ok = id >= 0 && id < V;
  for (int i = threadIdx.x; i < H / 8; i += blockDim.x) dst[i] = ok ? src[i] : make_uint4(0, 0, 0, 0);
}

// One block per row, one 16-byte vector per thread (H <= 8 * blockDim.x <= 8192, H % 8 == 0).
// h = x (+ residual), rounded to bf16 (that is the residual stream the next layer reads);
// residual_out = h if given; out = h / sqrt(mean(h^2) + eps) * weight.
// x, residual and residual_out may be one buffer (in-place residual stream): no __restrict__ on them.
extern "C" __global__ void rmsnorm_kernel(const __nv_bfloat16* x, int ldx,
                                          const __nv_bfloat16* residual, int ldr,
                                          const __nv_bfloat16* __restrict__ weight,
                                          __nv_bfloat16* __restrict__ out, int ldo,
                                          __nv_bfloat16* residual_out, int ldro,
                                          int H, float eps) {
  DDTREE_TRACE_WARP(ddtree::kTraceRmsnorm);
  grid_dependency_wait();
  ddtree::launch_dependents();
  const int row = blockIdx.x;
  const int i = threadIdx.x;
  const bool active = i < H / 8;
  float h[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  if (active) {
    unpack8(reinterpret_cast<const uint4*>(x + (size_t)row * ldx)[i], h);
    if (residual) {
      float r[8];
      unpack8(reinterpret_cast<const uint4*>(residual + (size_t)row * ldr)[i], r);
      uint4 hv;
#pragma unroll
      for (int j = 0; j < 8; ++j) h[j] += r[j];
      hv = pack8(h);
      unpack8(hv, h);  // the rounded value, as stored
      if (residual_out) reinterpret_cast<uint4*>(residual_out + (size_t)row * ldro)[i] = hv;
    }
  }
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) ss += h[j] * h[j];
  const float inv = rsqrtf(block_sum(ss) / (float)H + eps);
  if (!active) return;
  float wv[8];
  unpack8(reinterpret_cast<const uint4*>(weight)[i], wv);
#pragma unroll
  for (int j = 0; j < 8; ++j) h[j] = h[j] * inv * wv[j];
  reinterpret_cast<uint4*>(out + (size_t)row * ldo)[i] = pack8(h);
}

// RoPE of one head (one warp, D <= 256): src -> dst (may alias). lane l owns pairs i = l, l+32, ... < D/2.
// angle = float(pos) * inv_freq[i] in fp32 (as HF), cos/sin * attention_scaling.
// interleaved = 0: pairs (i, i + D/2). interleaved = 1: pairs (2i, 2i+1), written de-interleaved
// [evens | odds] like HF DeepSeek. norm_weight (nullable): per-head RMSNorm over D before rotating (Qwen3).
__device__ __forceinline__ void rope_head(const __nv_bfloat16* src, __nv_bfloat16* dst, float pos,
                                          const float* __restrict__ inv_freq, float attention_scaling,
                                          int interleaved, const __nv_bfloat16* __restrict__ norm_weight,
                                          float eps, int D, int lane) {
  const int half = D / 2;
  constexpr int kMaxPairs = 4;  // D <= 256
  float a[kMaxPairs], b[kMaxPairs];
  float ss = 0.f;
#pragma unroll
  for (int p = 0; p < kMaxPairs; ++p) {
    const int i = lane + 32 * p;
    a[p] = b[p] = 0.f;
    if (i < half) {
      const int ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + half;
      a[p] = __bfloat162float(src[ia]);
      b[p] = __bfloat162float(src[ib]);
      ss += a[p] * a[p] + b[p] * b[p];
    }
  }
  float inv = 1.f;
  if (norm_weight) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    inv = rsqrtf(ss / (float)D + eps);
  }
  __syncwarp();  // every lane has read its inputs before any lane writes (dst may alias src)
#pragma unroll
  for (int p = 0; p < kMaxPairs; ++p) {
    const int i = lane + 32 * p;
    if (i >= half) continue;
    float va = a[p], vb = b[p];
    if (norm_weight) {
      const int ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + half;
      // HF rounds the normed activations to the model dtype before RoPE.
      va = __bfloat162float(__float2bfloat16(va * inv * __bfloat162float(norm_weight[ia])));
      vb = __bfloat162float(__float2bfloat16(vb * inv * __bfloat162float(norm_weight[ib])));
    }
    float s, c;
    sincosf(pos * inv_freq[i], &s, &c);
    c *= attention_scaling;
    s *= attention_scaling;
    dst[i] = __float2bfloat16(va * c - vb * s);
    dst[i + half] = __float2bfloat16(vb * c + va * s);
  }
}

// RoPE on x [T, Hn, D] (token stride ldx, head stride D) -> out (token stride ldo; may alias x).
// One warp per (token, head).
extern "C" __global__ void rope_kernel(const __nv_bfloat16* __restrict__ x, int ldx,
                                       __nv_bfloat16* out, int ldo,
                                       const int* __restrict__ positions, const float* __restrict__ inv_freq,
                                       float attention_scaling, int interleaved,
                                       const __nv_bfloat16* __restrict__ norm_weight, float eps,
                                       int T, int Hn, int D) {
  DDTREE_TRACE_WARP(ddtree::kTraceRope);
  grid_dependency_wait();
  ddtree::launch_dependents();
  const int lane = threadIdx.x & 31;
  const int item = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (item >= T * Hn) return;
  const int tok = item / Hn, head = item % Hn;
  rope_head(x + (size_t)tok * ldx + (size_t)head * D, out + (size_t)tok * ldo + (size_t)head * D,
            (float)positions[tok], inv_freq, attention_scaling, interleaved, norm_weight, eps, D, lane);
}

// The attention prologue of a llama layer in one launch: one warp per (token, head) over Hq + 2 * Hkv heads.
// Heads [0, Hq): RoPE of q (+ q_norm) -> q_out. [Hq, Hq + Hkv): RoPE of k (+ k_norm) -> k_cache row
// row0 + *row_offset + token. The rest: v copied to v_cache at the same row. row_offset (nullable) is the
// device prefix length of a captured graph (as in copy_rows_kernel). Head rows are D contiguous elements.
extern "C" __global__ void rope_qkv_cache_kernel(const __nv_bfloat16* __restrict__ q, int ldq,
                                                 const __nv_bfloat16* __restrict__ k, int ldk,
                                                 const __nv_bfloat16* __restrict__ v, int ldv,
                                                 __nv_bfloat16* __restrict__ q_out, int ldqo,
                                                 __nv_bfloat16* __restrict__ k_cache, int ldkc,
                                                 __nv_bfloat16* __restrict__ v_cache, int ldvc,
                                                 int row0, const int* __restrict__ row_offset,
                                                 const int* __restrict__ positions,
                                                 const float* __restrict__ inv_freq, float attention_scaling,
                                                 int interleaved, const __nv_bfloat16* __restrict__ q_norm,
                                                 const __nv_bfloat16* __restrict__ k_norm, float eps,
                                                 int T, int Hq, int Hkv, int D) {
  DDTREE_TRACE_WARP(ddtree::kTraceRopeQkvCache);
  grid_dependency_wait();
  ddtree::launch_dependents();
  const int lane = threadIdx.x & 31;
  const int heads = Hq + 2 * Hkv;
  const int item = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (item >= T * heads) return;
  const int tok = item / heads, head = item % heads;
  const long long row = (long long)row0 + (row_offset ? *row_offset : 0) + tok;
  if (head < Hq) {
    rope_head(q + (size_t)tok * ldq + (size_t)head * D, q_out + (size_t)tok * ldqo + (size_t)head * D,
              (float)positions[tok], inv_freq, attention_scaling, interleaved, q_norm, eps, D, lane);
  } else if (head < Hq + Hkv) {
    const int h = head - Hq;
    rope_head(k + (size_t)tok * ldk + (size_t)h * D, k_cache + row * ldkc + (size_t)h * D,
              (float)positions[tok], inv_freq, attention_scaling, interleaved, k_norm, eps, D, lane);
  } else {
    const int h = head - Hq - Hkv;
    const uint4* src = reinterpret_cast<const uint4*>(v + (size_t)tok * ldv + (size_t)h * D);
    uint4* dst = reinterpret_cast<uint4*>(v_cache + row * ldvc + (size_t)h * D);
    for (int i = lane; i < D / 8; i += 32) dst[i] = src[i];
  }
}

// out = silu(gate) * up over [T, I] (row strides in elements; gate and up may be the two halves of one
// fused gate_up output). I % 8 == 0.
extern "C" __global__ void swiglu_kernel(const __nv_bfloat16* __restrict__ gate, int ldg,
                                         const __nv_bfloat16* __restrict__ up, int ldu,
                                         __nv_bfloat16* __restrict__ out, int ldo, int T, int I) {
  DDTREE_TRACE_WARP(ddtree::kTraceSwiglu);
  grid_dependency_wait();
  ddtree::launch_dependents();
  const int vecs = I / 8;
  const long long n = (long long)T * vecs;
  for (long long v = blockIdx.x * (long long)blockDim.x + threadIdx.x; v < n;
       v += (long long)gridDim.x * blockDim.x) {
    const int row = (int)(v / vecs), col = (int)(v % vecs) * 8;
    float gf[8], uf[8];
    unpack8(*reinterpret_cast<const uint4*>(gate + (size_t)row * ldg + col), gf);
    unpack8(*reinterpret_cast<const uint4*>(up + (size_t)row * ldu + col), uf);
#pragma unroll
    for (int j = 0; j < 8; ++j) gf[j] = ddtree::silu(gf[j]) * uf[j];
    *reinterpret_cast<uint4*>(out + (size_t)row * ldo + col) = pack8(gf);
  }
}

// out = a + b, contiguous, n % 8 == 0.
extern "C" __global__ void add_kernel(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ b,
                                      __nv_bfloat16* __restrict__ out, long long n) {
  DDTREE_TRACE_WARP(ddtree::kTraceAdd);
  grid_dependency_wait();
  ddtree::launch_dependents();
  for (long long v = blockIdx.x * (long long)blockDim.x + threadIdx.x; v < n / 8;
       v += (long long)gridDim.x * blockDim.x) {
    float af[8], bf[8];
    unpack8(reinterpret_cast<const uint4*>(a)[v], af);
    unpack8(reinterpret_cast<const uint4*>(b)[v], bf);
#pragma unroll
    for (int j = 0; j < 8; ++j) af[j] += bf[j];
    reinterpret_cast<uint4*>(out)[v] = pack8(af);
  }
}
