// Device helpers shared by the kernel families: SiLU, streaming loads, cp.async, programmatic dependent launch,
// Philox random numbers.
#pragma once
#include <cuda_bf16.h>
#include <cuda/std/cstdint>  // NVRTC has no <cstdint>

namespace ddtree {

// SiLU for the SwiGLU epilogues: x * sigmoid(x) with the fast reciprocal (MUFU.RCP + FMUL; IEEE division
// put a range check and a slow-path call beside every output) and ex2 with denormals flushed (__expf's
// non-flushing ex2 adds a range fix-up of three instructions; e^-x below 2^-126 is 0 next to the 1 anyway).
// x -> -inf: 1 + e^-x = inf, x * 0 = -0.
__device__ __forceinline__ float silu(float x) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x * -1.4426950408889634f));
  return __fdividef(x, 1.0f + e);
}

// A weight read once: 16 bytes, not allocated in L1 (the activations and partials use it).
__device__ __forceinline__ uint4 load_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// 8 bf16 in 16 bytes <-> 8 floats (pack rounds to nearest even).
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __bfloat1622float2(h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  uint4 v;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return v;
}

// Zero a [A][B] grid of mma.sync m16n8 accumulator fragments (4 floats each).
template <int A, int B>
__device__ __forceinline__ void zero_fragments(float (&acc)[A][B][4]) {
#pragma unroll
  for (int a = 0; a < A; ++a)
#pragma unroll
    for (int b = 0; b < B; ++b)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.f;
}

// 16-byte global -> shared copy, bypassing L1; valid = false zero-fills (tails).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid = true) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(n) : "memory");
}
// The same into a shared-memory address the caller computed (e.g. a swizzled tile position).
__device__ __forceinline__ void cp_async16_s(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
// 4 bytes through L1 (cp.async.cg takes 16 only): the MoE scale words.
__device__ __forceinline__ void cp_async4_s(unsigned dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}
// "memory": the compiler must not move shared-memory reads of a copy's destination above the wait that
// lands it, nor reads of a slot below the copy that overwrites it (moe_int4's per-lane ring has no barrier).
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// 2^x on the SFU alone (ex2.approx.ftz: about 2 ulp, subnormal results flushed to 0, 2^-inf = 0): exp2f adds a
// range test and a fix-up for subnormal results, 3-4 more instructions per call that softmax weights never need.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Bits nj0 .. nj0 + 63 of a bitmask row of `words` uint32 words (row bit j = bit j % 32 of word j / 32) as a
// uint64, bit i = row bit nj0 + i; row bits below 0 or past the row read as 0. At most three word loads, issued
// together: the attention kernels test a whole KV tile's slots against it instead of loading a word per slot.
__device__ __forceinline__ uint64_t bit_window64(const uint32_t* __restrict__ row, int words, int nj0) {
  auto word = [&](int i) -> uint64_t { return i >= 0 && i < words ? row[i] : 0u; };
  if (nj0 <= -64) return 0;
  if (nj0 < 0) return (word(0) | word(1) << 32) << (-nj0);
  const int a = nj0 >> 5, sh = nj0 & 31;
  const uint64_t x = word(a) | word(a + 1) << 32;
  return sh ? (x >> sh) | (word(a + 2) << (64 - sh)) : x;
}
// The low n bits set (n clamped to 0 .. 64).
__device__ __forceinline__ uint64_t low_bits64(int n) {
  return n <= 0 ? 0ull : n >= 64 ? ~0ull : (1ull << n) - 1;
}
// Which of the 64 cache slots p0 .. p0 + 63 an attention row sees, bit i = slot p0 + i: every slot below prefix
// (the committed prefix), tree slots through tree_bits (bit i = slot p0 + i's visibility bit), none at or past end.
__device__ __forceinline__ uint64_t window_visible64(int p0, int prefix, int end, uint64_t tree_bits) {
  return (low_bits64(prefix - p0) | tree_bits) & low_bits64(end - p0);
}

// Per-warp timeline trace (NVRTC option -DDDTREE_TRACE=1, set for every family by DDTREE_TRACE=1:
// runtime/cuda/trace.py, tools/trace_timeline.py). Lane 0 of every warp of an instrumented kernel
// (DDTREE_TRACE_WARP at its top) stamps %globaltimer as the warp starts, after its first grid_dependency_wait, and as
// lane 0 returns, and appends one record to the buffer the host put in the module global ddtree_trace_buffer
// (null: nothing is written). The start and wait stamps wait in a per-(SM, hardware warp slot) table until the end,
// so nothing stays in registers across the kernel. A kernel may also bracket its waits on other warps (mbarriers)
// with trace_stall_begin / trace_stall_end: their clock64 cycles add up in the same table. Buffer (u64 words): [0]
// records appended (may pass the capacity: those are dropped), [1] capacity, [2, 8) unused, then the table
// (kTraceSms x kTraceWarpSlots x kTraceSlotWords: start, wait, clock64 at the start, stall cycles), then
// kTraceRecordWords per record: start, wait (0: none), end, %gridid (one per launch), code | SM << 32, block
// (linear) | warp in block << 32, stall cycles | the warp's cycles << 32 (each capped at 2^32 - 1). The runtime never
// sets it: the stamps and one atomic per warp cost time.
#ifndef DDTREE_TRACE
#define DDTREE_TRACE 0
#endif
// The spans a traced build counts in each warp's stall word (NVRTC option -DDDTREE_TRACE_STALLS=mask, from the
// environment's DDTREE_TRACE_STALLS): a mask of TraceStallSite, the mbarrier ring waits unless set. One mask per
// build, so one run answers "what share of each warp's cycles goes to these sites" without mixing them.
#ifndef DDTREE_TRACE_STALLS
#define DDTREE_TRACE_STALLS 1
#endif
enum TraceStallSite : unsigned {
  kStallRing = 1,        // moe_gmma_ws_kernel: the W ring's mbarrier waits (producer: free buffers; consumers: full)
  kStallXWait = 2,       // its consumers' cp.async wait for their x stage (and the proxy fence after it); in
                         // moe_gmma_kernel's register-A main loop the same wait before each stage barrier
  kStallBarrier = 4,     // its consumers' named barrier per stage; register A: the block barrier per stage
  kStallMmaWait = 8,     // its consumers' wgmma wait for the previous stage's batch; register A: the same wait
  kStallPublish = 16,    // its producer's proxy fence and full-barrier arrive after each stage's stores
  kStallDequant = 32,    // its producer's dequantization and shared stores (work, not a wait); register A: the
                         // next stage's weight read, dequantization into A registers and its ring refill copy
  kStallRaFill = 64,       // moe_gmma_kernel (register A): an item's start, from its slot lookups to the end of the
                           // mainloop's first barrier (the pipeline fill: the first stage's weights and x landed)
  kStallRaEpilogue = 128,  // moe_gmma_kernel (register A): the epilogue, from the mainloop's end to the barrier that
                           // frees the staging for the next item
};
// What each instrumented kernel passes to DDTREE_TRACE_WARP: runtime/cuda/trace.py reads the names from here.
enum TraceCode : unsigned {
  kTraceEmbedding = 1, kTraceRmsnorm = 2, kTraceRope = 3, kTraceRopeQkvCache = 4, kTraceSwiglu = 5, kTraceAdd = 6,
  kTraceLinearChunked = 10, kTraceLinearXres = 11, kTraceLinearGemv = 12, kTraceLinearGmma = 13,
  kTraceLinearNarrow = 14, kTraceLinearNarrowCluster = 15,
  kTraceTreeAttention = 20, kTraceDecodeAttention = 21, kTraceAttentionCombine = 22, kTraceTreeAttentionGmma = 23,
  kTraceLogSoftmaxTopk = 30, kTraceArgmax = 31, kTraceSample = 32, kTraceKvCompact = 33, kTraceCopyRows = 34,
  kTraceMoeTopk = 40, kTraceMoeGroup = 41, kTraceMoeRouteOne = 42, kTraceMoeRoute = 43, kTraceMoeGateUp = 44,
  kTraceMoeDown = 45, kTraceMoeCombine = 46, kTraceMoeGmmaGateUp = 47, kTraceMoeGmmaDown = 48,
  kTraceMoeGmmaWsGateUp = 49, kTraceMoeGmmaWsDown = 50, kTraceMoeSlotSplit = 51, kTraceMoeXSlot = 52,
  kTraceMoeRouteBlocks = 53, kTraceMoeRouteBatch = 54,
  kTraceMlaAttention = 60, kTraceMlaCombine = 61, kTraceMlaHeadGemm = 62, kTraceMlaAttentionGmma = 63,
};
#if DDTREE_TRACE
// (runtime/cuda/trace.py reads these numbers from this declaration; kTraceRecordsAt: where the records start, past
// the header and the table, written out so that the host reads the number the device uses)
constexpr int kTraceHeaderWords = 8, kTraceSms = 256, kTraceWarpSlots = 64, kTraceSlotWords = 4, kTraceRecordWords = 7,
              kTraceRecordsAt = 65544;
static_assert(kTraceRecordsAt == kTraceHeaderWords + kTraceSlotWords * kTraceSms * kTraceWarpSlots,
              "the records start past the header and the whole per-warp-slot table");
}  // namespace ddtree
extern "C" {
__device__ unsigned long long* ddtree_trace_buffer;   // set by the host after the module loads; null: off
}
namespace ddtree {
__device__ __forceinline__ unsigned long long trace_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ bool trace_lane0() {
  unsigned lane;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane == 0;
}
__device__ __forceinline__ unsigned trace_smid() {
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  return sm;
}
// This warp's (start, wait, clock64 at the start, stall cycles) in the table, on SM sm: a hardware warp slot holds
// one warp at a time.
__device__ __forceinline__ unsigned long long* trace_warp_slot(unsigned sm) {
  unsigned w;
  asm volatile("mov.u32 %0, %%warpid;" : "=r"(w));
  const unsigned slot = (sm % kTraceSms) * kTraceWarpSlots + w % kTraceWarpSlots;
  return ddtree_trace_buffer + kTraceHeaderWords + kTraceSlotWords * slot;
}
__device__ __forceinline__ unsigned long long trace_cap32(long long v) {
  return v < 0 ? 0ull : v > 0xffffffffll ? 0xffffffffull : (unsigned long long)v;
}
struct TraceWarp {
  unsigned code;
  __device__ explicit TraceWarp(unsigned c) : code(c) {
    if (ddtree_trace_buffer != nullptr && trace_lane0()) {
      unsigned long long* slot = trace_warp_slot(trace_smid());
      slot[0] = trace_now();
      slot[1] = 0;
      slot[2] = (unsigned long long)clock64();
      slot[3] = 0;
    }
  }
  __device__ ~TraceWarp() {
    if (ddtree_trace_buffer == nullptr || !trace_lane0()) return;
    const unsigned long long end = trace_now();
    const long long clock_end = clock64();
    const unsigned sm = trace_smid();
    const unsigned long long* slot = trace_warp_slot(sm);
    unsigned long long grid;
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(grid));
    const unsigned long long i = atomicAdd(ddtree_trace_buffer, 1ull);
    if (i >= ddtree_trace_buffer[1]) return;
    unsigned long long* r = ddtree_trace_buffer + kTraceRecordsAt + kTraceRecordWords * i;
    const unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const unsigned warp = (threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) >> 5;
    r[0] = slot[0];
    r[1] = slot[1];
    r[2] = end;
    r[3] = grid;
    r[4] = code | (unsigned long long)sm << 32;
    r[5] = block | (unsigned long long)warp << 32;
    r[6] = trace_cap32((long long)slot[3]) | trace_cap32(clock_end - (long long)slot[2]) << 32;
  }
};
// The first dependency wait of this warp (grid_dependency_wait calls it after the wait returns).
__device__ __forceinline__ void trace_wait_done() {
  if (ddtree_trace_buffer != nullptr && trace_lane0()) {
    unsigned long long* slot = trace_warp_slot(trace_smid());
    if (slot[1] == 0) slot[1] = trace_now();
  }
}
// A bracketed span of site SITE: t0 = trace_stall_begin<SITE>() before it, trace_stall_end<SITE>(t0) after it (lane
// 0's cycles in between join the warp's stall count) when the build counts that site (DDTREE_TRACE_STALLS).
template <unsigned SITE>
__device__ __forceinline__ long long trace_stall_begin() {
  if constexpr ((DDTREE_TRACE_STALLS & SITE) != 0) return ddtree_trace_buffer != nullptr ? clock64() : 0;
  return 0;
}
template <unsigned SITE>
__device__ __forceinline__ void trace_stall_end(long long t0) {
  if constexpr ((DDTREE_TRACE_STALLS & SITE) != 0)
    if (ddtree_trace_buffer != nullptr && trace_lane0()) trace_warp_slot(trace_smid())[3] += clock64() - t0;
}
#define DDTREE_TRACE_WARP(code) const ::ddtree::TraceWarp ddtree_trace_warp_(code)
#else
__device__ __forceinline__ void trace_wait_done() {}
template <unsigned SITE>
__device__ __forceinline__ long long trace_stall_begin() { return 0; }
template <unsigned SITE>
__device__ __forceinline__ void trace_stall_end(long long) {}
#define DDTREE_TRACE_WARP(code) \
  do {                          \
  } while (0)
#endif

// Programmatic dependent launch (sm_90 and later; every arch we build). A kernel launched with the PDL
// attribute may start while the previous kernel on the stream still runs; it must call grid_dependency_wait()
// before it reads anything that kernel writes and before it writes anything (a buffer the previous kernel
// may still read). Reading weights (never written inside a graph) before the wait is what PDL buys.
// Without the attribute both are no-ops. Kernels of a family registered with pdl=True must follow this.
__device__ __forceinline__ void grid_dependency_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  trace_wait_done();
}
// Lets the next kernel on the stream launch now (its blocks then wait in grid_dependency_wait for our
// completion and memory flush); without it, the next kernel launches as our blocks exit.
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;"); }

// Block-level hand-off through a counter in global memory, where a consumer block needs only some of the
// previous kernel's blocks (grid_dependency_wait waits for the whole grid to finish and flush): each producer
// block arrives once after its writes, a consumer block spins until the count reaches its target. Deadlock-free
// only where every producer block is resident or done when a consumer spins (PDL: the consumer grid launches
// once every producer block has run launch_dependents). Both must be reached by every thread of the block.
// The arrival is a release reduction: MEMBAR.ALL.GPU + REDG at sm_90a, where __threadfence + atomicAdd gave
// MEMBAR.SC.GPU, an L1 invalidation (CCTL.IVALL) and ATOMG; the block's exit waits on it.
__device__ __forceinline__ void signal_arrive(int* counter) {
  __syncthreads();   // every thread's writes come before thread 0's release (bar.sync orders them in the CTA)
  if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(counter) : "memory");
}
__device__ __forceinline__ void signal_wait(const int* counter, int target) {
  if (threadIdx.x == 0) {
    while (true) {
      int v;
      asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
      if (v >= target) break;
      __nanosleep(512);   // fewer polls of the counter's L2 line while the producers stream
    }
  }
  __syncthreads();   // the other threads' reads come after thread 0's acquire
  trace_wait_done();
}

// Philox4x32-10 counter-based random numbers (Salmon et al., SC 2011; the Random123 / cuRAND constants).
// Ten rounds of two 32x32->64 multiplies; the key is bumped by Weyl constants between rounds. Reference and
// known-answer tests: runtime/philox.py, tests/test_philox.py.
__device__ __forceinline__ uint4 philox4x32_10(uint4 ctr, uint2 key) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    if (r) { key.x += 0x9E3779B9u; key.y += 0xBB67AE85u; }
    const unsigned hi0 = __umulhi(0xD2511F53u, ctr.x), lo0 = 0xD2511F53u * ctr.x;
    const unsigned hi1 = __umulhi(0xCD9E8D57u, ctr.z), lo1 = 0xCD9E8D57u * ctr.z;
    ctr = make_uint4(hi1 ^ ctr.y ^ key.x, lo1, hi0 ^ ctr.w ^ key.y, lo0);
  }
  return ctr;
}
// The sampling uniform of an absolute sequence position (base.py `sample`): counter (position, 0, 0, 0),
// key = the seed's (lo, hi) words; the first output word's top 24 bits * 2^-24, in [0, 1), exact in float.
__device__ __forceinline__ float position_uniform(const unsigned* key, int position) {
  const uint4 w = philox4x32_10(make_uint4((unsigned)position, 0u, 0u, 0u), make_uint2(key[0], key[1]));
  return (float)(w.x >> 8) * (1.0f / 16777216.0f);
}

}  // namespace ddtree
