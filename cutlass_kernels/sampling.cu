// Per-row reductions over the vocabulary and the KV commit of a DDTree round:
// - log_softmax_topk_kernel: the K largest log-softmax values of each row, sorted, exact (K <= 1024).
// - argmax_kernel: greedy token per tree node (ties: lowest index).
// - sample_kernel: inverse-CDF sample of softmax(logits / T), its uniform drawn in-kernel by Philox from the
//   seed key and the row's sequence position (base.py `sample`).
// - kv_compact_kernel: move the accepted nodes' KV rows to dst_start.. in every cache plane in one launch.
// Logits are bf16 [rows, V] with a row stride that is a multiple of 8 (16-byte loads); V itself is any size.
//
// Top-K design: bf16 logits have 16-bit order-preserving keys, so the K-th largest key is found exactly by
// two 8-bit radix-select passes (shared-memory histograms), then one ordered pass gathers every key above
// the threshold plus the first (lowest-index) ties at it, and a bitonic sort of <= 1024 (key, ~index) pairs
// orders them. The row (<= 300 KB) stays in L2 across the four passes. One 1024-thread block per row: the
// drafter has ~15 rows, so this is latency- not bandwidth-bound; a multi-block split is the next step if
// it shows in the round time.
#include <cuda_bf16.h>
#include <cuda/std/cstdint>  // NVRTC has no <cstdint>
#include "device_common.cuh"
using cuda::std::uint16_t;
using cuda::std::uint32_t;

#define NEG_INF __int_as_float(0xff800000u)

namespace {

constexpr int kTopkThreads = 1024;
constexpr int kMaxK = 1024;

// Order-preserving 16-bit key of a bf16 bit pattern (larger float -> larger key).
__device__ __forceinline__ uint32_t bf16_key(uint16_t u) {
  return (u & 0x8000u) ? (~u & 0xFFFFu) : (u | 0x8000u);
}
__device__ __forceinline__ float key_to_float(uint32_t key) {
  uint32_t u = (key & 0x8000u) ? (key & 0x7FFFu) : (~key & 0xFFFFu);
  return __uint_as_float(u << 16);
}

// Loads 8 logits starting at `base` (a multiple of 8) as raw bf16 bits; n_valid of them are inside the row.
__device__ __forceinline__ int load8(const uint16_t* row, int base, int V, uint16_t (&u)[8]) {
  if (base + 8 <= V) {
    uint4 v = *reinterpret_cast<const uint4*>(row + base);
    const uint16_t* p = reinterpret_cast<const uint16_t*>(&v);
#pragma unroll
    for (int j = 0; j < 8; ++j) u[j] = p[j];
    return 8;
  }
  const int n = max(0, V - base);
#pragma unroll
  for (int j = 0; j < 8; ++j) u[j] = j < n ? row[base + j] : 0;
  return n;
}
__device__ __forceinline__ float bf16_bits_to_float(uint16_t u) { return __uint_as_float((uint32_t)u << 16); }

// Block-wide combine of per-thread (max, sum of exp(x - max)) pairs. Every thread gets the result.
__device__ void block_max_sumexp(float& m, float& s) {
  __shared__ float sm[32], ss[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    const float mn = fmaxf(m, m2);
    s = (m == NEG_INF ? 0.f : s * __expf(m - mn)) + (m2 == NEG_INF ? 0.f : s2 * __expf(m2 - mn));
    m = mn;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) { sm[warp] = m; ss[warp] = s; }
  __syncthreads();
  m = lane < n_warps ? sm[lane] : NEG_INF;
  s = lane < n_warps ? ss[lane] : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    const float mn = fmaxf(m, m2);
    s = (m == NEG_INF ? 0.f : s * __expf(m - mn)) + (m2 == NEG_INF ? 0.f : s2 * __expf(m2 - mn));
    m = mn;
  }
}

// Radix-select step: given hist[256] (counts per byte value), find the byte b such that
// (count above b) < k <= (count above b) + hist[b]. Run by warp 0; writes (b, count above b) to out.
__device__ void select_bin(const int* hist, int k, int* out) {
  const int lane = threadIdx.x & 31;
  int c = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) c += hist[8 * lane + j];
  int suffix = c;  // inclusive suffix sum over lanes >= this one
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_down_sync(0xffffffffu, suffix, o);
    if (lane + o < 32) suffix += v;
  }
  const int above = suffix - c;
  if (above < k && k <= suffix) {
    int acc = above;
    for (int b = 8 * lane + 7; b >= 8 * lane; --b) {
      if (acc + hist[b] >= k) { out[0] = b; out[1] = acc; break; }
      acc += hist[b];
    }
  }
}

}  // namespace

// grid rows, block 1024. logp float [rows, K], ids int32 [rows, K]; ties: lower index first.
extern "C" __global__ void __launch_bounds__(kTopkThreads)
log_softmax_topk_kernel(const uint16_t* __restrict__ logits, int ld, int V, int K,
                        float* __restrict__ out_logp, int* __restrict__ out_ids) {
  DDTREE_TRACE_WARP(ddtree::kTraceLogSoftmaxTopk);
  ddtree::grid_dependency_wait();  // PDL: nothing global is touched before it
  ddtree::launch_dependents();
  __shared__ int hist[256];
  __shared__ int sel[2];
  __shared__ unsigned long long cand[kMaxK];
  __shared__ int n_gt_slot, eq_seen;
  __shared__ int warp_eq[32];
  const uint16_t* row = logits + (size_t)blockIdx.x * ld;
  const int tid = threadIdx.x;
  const int chunk = 8 * kTopkThreads;

  // Pass 1: max and sum of exp (online per thread).
  float m = NEG_INF, s = 0.f;
  for (int base = 8 * tid; base < V; base += chunk) {
    uint16_t u[8];
    const int n = load8(row, base, V, u);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j >= n) break;
      const float x = bf16_bits_to_float(u[j]);
      if (x > m) { s = (m == NEG_INF ? 0.f : s * __expf(m - x)) + 1.f; m = x; }
      else s += __expf(x - m);
    }
  }
  block_max_sumexp(m, s);
  const float log_z = m + logf(s);

  // Passes 2 and 3: radix select of the K-th largest key, high byte then low byte.
  int k_left = K, count_gt = 0;
  uint32_t prefix = 0;
  for (int pass = 0; pass < 2; ++pass) {
    for (int i = tid; i < 256; i += kTopkThreads) hist[i] = 0;
    __syncthreads();
    for (int base = 8 * tid; base < V; base += chunk) {
      uint16_t u[8];
      const int n = load8(row, base, V, u);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (j >= n) break;
        const uint32_t key = bf16_key(u[j]);
        if (pass == 0) atomicAdd(&hist[key >> 8], 1);
        else if ((key >> 8) == prefix) atomicAdd(&hist[key & 0xFF], 1);
      }
    }
    __syncthreads();
    if (tid < 32) select_bin(hist, k_left, sel);
    __syncthreads();
    prefix = pass == 0 ? (uint32_t)sel[0] : (prefix << 8) | (uint32_t)sel[0];
    count_gt += sel[1];
    k_left -= sel[1];
    __syncthreads();
  }
  const uint32_t threshold = prefix;  // the K-th largest key
  const int need_eq = K - count_gt;   // how many ties at the threshold to take, lowest index first

  // Pass 4: gather, keeping ties in index order (block exclusive scan of per-thread tie counts).
  if (tid == 0) { n_gt_slot = 0; eq_seen = 0; }
  __syncthreads();
  const int lane = tid & 31, warp = tid >> 5;
  for (int base0 = 0; base0 < V; base0 += chunk) {
    const int base = base0 + 8 * tid;
    uint16_t u[8];
    const int n = load8(row, base, V, u);
    int n_eq = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j >= n) break;
      const uint32_t key = bf16_key(u[j]);
      if (key > threshold) {
        const int slot = atomicAdd(&n_gt_slot, 1);
        cand[slot] = ((unsigned long long)key << 32) | (0xFFFFFFFFu - (uint32_t)(base + j));
      } else if (key == threshold) ++n_eq;
    }
    int incl = n_eq;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    if (lane == 31) warp_eq[warp] = incl;
    __syncthreads();
    int warp_off = 0, total = 0;
    for (int w = 0; w < kTopkThreads / 32; ++w) {
      if (w < warp) warp_off += warp_eq[w];
      total += warp_eq[w];
    }
    int rank = eq_seen + warp_off + incl - n_eq;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < n && rank < need_eq && bf16_key(u[j]) == threshold) {
        cand[count_gt + rank] = ((unsigned long long)threshold << 32) | (0xFFFFFFFFu - (uint32_t)(base + j));
        ++rank;
      }
    }
    __syncthreads();
    if (tid == 0) eq_seen += total;
    __syncthreads();
    const bool done = eq_seen >= need_eq && n_gt_slot >= count_gt;
    __syncthreads();  // everyone has read the counters before the next chunk's atomics move them
    if (done) break;
  }

  // Bitonic sort, descending, over the next power of two >= K (padding sorts last).
  int P = 1;
  while (P < K) P <<= 1;
  for (int i = K + tid; i < P; i += kTopkThreads) cand[i] = 0ull;
  __syncthreads();
  for (int k = 2; k <= P; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      const int i = tid, ixj = i ^ j;
      if (i < P && ixj > i) {
        const unsigned long long a = cand[i], b = cand[ixj];
        const bool descending = (i & k) == 0;
        if (descending ? (a < b) : (a > b)) { cand[i] = b; cand[ixj] = a; }
      }
      __syncthreads();
    }
  for (int i = tid; i < K; i += kTopkThreads) {
    const unsigned long long c = cand[i];
    out_logp[(size_t)blockIdx.x * K + i] = key_to_float((uint32_t)(c >> 32)) - log_z;
    out_ids[(size_t)blockIdx.x * K + i] = (int)(0xFFFFFFFFu - (uint32_t)(c & 0xFFFFFFFFu));
  }
}

// grid (chunks, rows), block 256: out[row] = first index of the row maximum. Block x scans columns
// [x * chunk, (x + 1) * chunk). With one chunk the block writes out[row]; with several, each block folds its
// packed (key, ~index) into slots[row] (atomicMax: order-free, so deterministic) and the last block of the row
// (ticket) writes out[row] and leaves slot and ticket at zero for the next launch (graph replay).
extern "C" __global__ void argmax_kernel(const uint16_t* __restrict__ logits, int ld, int V, int* __restrict__ out,
                                         int chunk, unsigned long long* __restrict__ slots, int* __restrict__ tickets) {
  DDTREE_TRACE_WARP(ddtree::kTraceArgmax);
  ddtree::grid_dependency_wait();  // PDL: nothing global is touched before it
  ddtree::launch_dependents();
  const int r = blockIdx.y;
  const uint16_t* row = logits + (size_t)r * ld;
  const int begin = blockIdx.x * chunk, end = min(V, begin + chunk);
  uint32_t best_key = 0;
  int best_idx = 0x7FFFFFFF;
#pragma unroll 4  // several 16-byte loads in flight per thread (a one-row AR argmax is a chain of 24 otherwise)
  for (int base = begin + 8 * threadIdx.x; base < end; base += 8 * blockDim.x) {
    uint16_t u[8];
    const int n = load8(row, base, end, u);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j >= n) break;
      const uint32_t key = bf16_key(u[j]) + 1;  // +1: every real element beats the empty start
      if (key > best_key) { best_key = key; best_idx = base + j; }  // ascending index: first max kept
    }
  }
  // Pack (key, ~index) so one max-reduction takes the larger key, then the lower index.
  unsigned long long v = ((unsigned long long)best_key << 32) | (0xFFFFFFFFu - (uint32_t)best_idx);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  __shared__ unsigned long long partial[32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < (int)(blockDim.x >> 5); ++w) v = partial[w] > v ? partial[w] : v;
  if (gridDim.x > 1) {
    atomicMax(slots + r, v);
    __threadfence();
    if (atomicAdd(tickets + r, 1) != (int)gridDim.x - 1) return;
    v = atomicExch(slots + r, 0ull);  // every block's max is in (atomics are ordered on the slot)
    tickets[r] = 0;
  }
  out[r] = (int)(0xFFFFFFFFu - (uint32_t)(v & 0xFFFFFFFFu));
}

// grid rows, block 256: the smallest j with cumsum(p)[j] > u * sum(p), p = exp((x - max) / temperature),
// summed in index order (numpy's searchsorted(cumsum, u * total, side="right")). u = the Philox uniform of
// (key, positions[row]) (device_common.cuh position_uniform): key uint32 [2] and positions int32 [rows] are
// read from device memory, so a captured graph samples with whatever seed and positions the state holds.
extern "C" __global__ void sample_kernel(const uint16_t* __restrict__ logits, int ld, int V, float inv_temperature,
                                         const int* __restrict__ positions, const unsigned* __restrict__ key,
                                         int* __restrict__ out) {
  DDTREE_TRACE_WARP(ddtree::kTraceSample);
  ddtree::grid_dependency_wait();  // PDL: nothing global is touched before it
  ddtree::launch_dependents();
  __shared__ float warp_tot[32];
  __shared__ int found;
  const uint16_t* row = logits + (size_t)blockIdx.x * ld;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, n_warps = blockDim.x >> 5;
  const int chunk = 8 * blockDim.x;

  // Pass 1: max and total (online).
  float m = NEG_INF, s = 0.f;
  for (int base = 8 * tid; base < V; base += chunk) {
    uint16_t u[8];
    const int n = load8(row, base, V, u);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j >= n) break;
      const float x = bf16_bits_to_float(u[j]) * inv_temperature;
      if (x > m) { s = (m == NEG_INF ? 0.f : s * __expf(m - x)) + 1.f; m = x; }
      else s += __expf(x - m);
    }
  }
  block_max_sumexp(m, s);
  const float target = ddtree::position_uniform(key, positions[blockIdx.x]) * s;  // every thread: no broadcast
  if (tid == 0) found = 0x7FFFFFFF;  // atomicMin target
  __syncthreads();

  // Pass 2: ordered cumulative sum, chunk by chunk, until it passes the target. The sum of the chunks before
  // is kept by every thread (same warp totals, same order: the same float everywhere), not in shared memory.
  float running = 0.f;
  int last_positive = -1;
  for (int base0 = 0; base0 < V; base0 += chunk) {
    const int base = base0 + 8 * tid;
    uint16_t u[8];
    float p[8];
    const int n = load8(row, base, V, u);
    float mine = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      p[j] = j < n ? __expf(bf16_bits_to_float(u[j]) * inv_temperature - m) : 0.f;
      mine += p[j];
      if (p[j] > 0.f) last_positive = base + j;
    }
    float incl = mine;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    if (lane == 31) warp_tot[warp] = incl;
    __syncthreads();
    float warp_off = 0.f, total = 0.f;
    for (int w = 0; w < n_warps; ++w) {
      if (w < warp) warp_off += warp_tot[w];
      total += warp_tot[w];
    }
    float excl = __shfl_up_sync(0xffffffffu, incl, 1);
    if (lane == 0) excl = 0.f;
    float c = running + warp_off + excl;  // cumulative sum before this thread's 8
    // Every thread whose span ends past the target proposes its first crossing element (its last element
    // if rounding hides the crossing inside it); the lowest proposal is the sample.
    if (n > 0 && c + mine > target) {
      int pick = base + n - 1;
      bool hit = false;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        c += p[j];
        if (!hit && j < n && c > target) { pick = base + j; hit = true; }
      }
      atomicMin(&found, pick);
    }
    __syncthreads();
    const bool done = found != 0x7FFFFFFF;
    running += total;
    __syncthreads();  // warp_tot and found are read: the next chunk may write them
    if (done) break;
  }
  // Rounding can leave the target just above the summed total: take the last token with p > 0.
  __shared__ int last_pos[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) last_positive = max(last_positive, __shfl_xor_sync(0xffffffffu, last_positive, o));
  if (lane == 0) last_pos[warp] = last_positive;
  __syncthreads();
  if (tid == 0) {
    int lp = -1;
    for (int w = 0; w < n_warps; ++w) lp = max(lp, last_pos[w]);
    out[blockIdx.x] = found != 0x7FFFFFFF ? found : lp;
  }
}

// For each cache plane p and each i < m (in order): plane[dst_start + i] = plane[src_slots[i]].
// planes: device pointers (uint64) to P planes of rows of row_bytes (a multiple of 16); meta = {dst_start, m}
// on the device so a graph replays with new values. One thread owns one 16-byte column of one plane and
// walks i upwards. Safe in place because src_slots[i] >= dst_start + i: a row written at step i' < i is
// dst_start + i' < dst_start + i <= src_slots[i], so no step reads a row an earlier step overwrote.
// (Threads in parallel over i would race: with slots [s, s+2, s+3], step 2 writes s+2 while step 1 reads it.)
extern "C" __global__ void kv_compact_kernel(const unsigned long long* __restrict__ planes, int row_bytes,
                                             const int* __restrict__ src_slots, const int* __restrict__ meta) {
  DDTREE_TRACE_WARP(ddtree::kTraceKvCompact);
  ddtree::grid_dependency_wait();  // PDL: nothing global is touched before it
  ddtree::launch_dependents();
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= row_bytes / 16) return;
  unsigned char* base = reinterpret_cast<unsigned char*>(planes[blockIdx.y]);
  const int dst_start = meta[0], m = meta[1];
  for (int i = 0; i < m; ++i) {
    const int src = src_slots[i], dst = dst_start + i;
    if (src == dst) continue;
    const uint4 v = *reinterpret_cast<const uint4*>(base + (size_t)src * row_bytes + 16 * col);
    *reinterpret_cast<uint4*>(base + (size_t)dst * row_bytes + 16 * col) = v;
  }
}
