// Small kernels the runtime itself uses to test and measure: a streaming read (bandwidth), an elementwise
// update (graph capture and parameter update tests), an empty kernel (launch and replay overhead).
#include "device_common.cuh"

// acc xor-folded with this thread's 16-byte vectors i, i + stride, ... below n_vec (grid-stride, streaming loads:
// not kept in L2), written to sink only on an impossible value so that no load can be dropped.
__device__ __forceinline__ void read_fold(const uint4* __restrict__ src, long long i, long long n_vec,
                                          unsigned int acc, unsigned int* __restrict__ sink) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (; i < n_vec; i += stride) {
    uint4 v = __ldcs(src + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// Reads n_vec 16-byte vectors (read_fold: almost nothing is written).
extern "C" __global__ void read_sum_kernel(const uint4* __restrict__ src, long long n_vec,
                                           unsigned int* __restrict__ sink) {
  read_fold(src, (long long)blockIdx.x * blockDim.x + threadIdx.x, n_vec, 0u, sink);
}

// The same read with DEPTH independent 16-byte loads in flight per thread (vectors i + j * stride, j < DEPTH, all
// issued before any is folded): read_sum_kernel keeps one, so few blocks per SM cannot have enough bytes in flight.
// tools/bench_dense.py --read-by-sms runs one 1024-thread block on each of G SMs with DEPTH 8 (128 KB in flight
// per SM, about what the GMMA linears' rings hold), to see how the read scales with the SMs that stream.
template <int DEPTH>
__global__ void read_sum_deep_kernel(const uint4* __restrict__ src, long long n_vec, unsigned int* __restrict__ sink) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  unsigned int acc = 0u;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n_vec; i += DEPTH * stride) {
    uint4 v[DEPTH];
#pragma unroll
    for (int j = 0; j < DEPTH; ++j) v[j] = i + j * stride < n_vec ? __ldcs(src + i + j * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int j = 0; j < DEPTH; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

// read_sum_kernel as a link of a PDL chain (family runtime_probe_pdl, launched with programmatic stream
// serialization), shaped like the weight-streaming linears: each thread issues its first load, waits for the
// previous kernel (ddtree::grid_dependency_wait), lets the next one launch, then streams the rest. What a chain of
// same-size reads reaches when each may start under the previous one's tail (tools/bench_dense.py).
extern "C" __global__ void read_sum_pdl_kernel(const uint4* __restrict__ src, long long n_vec,
                                               unsigned int* __restrict__ sink) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const uint4 first = i < n_vec ? __ldcs(src + i) : make_uint4(0, 0, 0, 0);
  ddtree::grid_dependency_wait();
  ddtree::launch_dependents();
  read_fold(src, i + (long long)gridDim.x * blockDim.x, n_vec, first.x ^ first.y ^ first.z ^ first.w, sink);
}

// x[i] = x[i] * a + b for i < n.
extern "C" __global__ void add_scalar_kernel(float* x, float a, float b, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = x[i] * a + b;
}

extern "C" __global__ void noop_kernel(const void* p, int n) {}

// The MoE weight stream without its arithmetic (tools/bench_stream_rows.py): warp w streams 2 separate rows
// (streams 2w, 2w + 1) of `units` 512-byte units, 4 units (2 KB) per row per step, DEPTH steps in flight in
// registers, as moe_w4a16_kernel reads its two row blocks. step_major 0: each row contiguous (the repacked
// weight layout); 1: step s of every row side by side (rows interleaved at 2 KB). HINT: the L2::256B
// prefetch hint moe_int4.cu's loads carry. Xor-folds everything, writes only on an impossible value.
template <int HINT>
__device__ __forceinline__ uint4 probe_load(const uint4* p) {
  uint4 r;
  if constexpr (HINT)
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  else
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

template <int DEPTH, int HINT>
__global__ void stream_rows_kernel(const uint4* __restrict__ src, int units, int streams, int step_major,
                                   unsigned int* __restrict__ sink) {
  const int lane = threadIdx.x & 31;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (2 * warp >= streams) return;
  const int steps = units / 4;
  auto at = [&](int j, int s, int uu) -> const uint4* {
    const long long sid = 2LL * warp + j;
    const long long unit = step_major ? ((long long)s * streams + sid) * 4 + uu : sid * units + 4LL * s + uu;
    return src + unit * 32 + lane;
  };
  uint4 buf[DEPTH][8];
  auto load = [&](uint4 (&b)[8], int s) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int uu = 0; uu < 4; ++uu) b[j * 4 + uu] = probe_load<HINT>(at(j, s, uu));
  };
  unsigned int acc = 0;
#pragma unroll
  for (int d = 0; d < DEPTH - 1; ++d)
    if (d < steps) load(buf[d], d);
  for (int s0 = 0; s0 < steps; s0 += DEPTH) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {   // unrolled: the buffer indices are constants
      const int s = s0 + d;
      if (s >= steps) break;
      if (s + DEPTH - 1 < steps) load(buf[(d + DEPTH - 1) % DEPTH], s + DEPTH - 1);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc ^= buf[d][i].x ^ buf[d][i].y ^ buf[d][i].z ^ buf[d][i].w;
    }
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}
