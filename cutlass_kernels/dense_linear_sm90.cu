// bf16 linear y[M, N] = x[M, K] @ W[N, K]^T (+ residual) on Hopper GMMA (wgmma), sm_90a only, for the
// verify buckets and prefill (M >= 9; above 256 rows, token tiles on blockIdx.z), and decode sizes of large weights
// (1..8 live rows of a 16-token tile: runtime/dense_gmma.py gmma_wanted).
//
// Swap AB: the W tile is wgmma's A operand (64 W rows per consumer warpgroup, M side), the x tile its B
// operand (N side = tokens, TN a template parameter, a multiple of 8 up to 256). Both operands K-major in
// shared memory with the 128-byte swizzle; one "k atom" is 64 k (128 bytes of each row: the swizzle width).
//
// Block: NWG warpgroups (2: 256 threads, 128 W rows; 3: 384 threads, 192 W rows, so that a 24576-row W
// is one wave of 128 blocks with no K split, the shape cuBLAS picks for it on the H200; 1: 128 threads, 64 W rows,
// so that 4096-row Ws split in clusters of 2 are 128 blocks where 128-row blocks leave 36-68 SMs idle). Every thread both
// loads and computes (no producer warp: wgmma being asynchronous, the issuing warps are free to issue
// cp.async while the tensor cores work). Pipeline of STAGES shared-memory stages of
// KA k atoms each, filled with 16-byte cp.async into the swizzled addresses (no tensor map, so no host
// state per weight pointer and nothing to rebuild for graph replays), tracked by mbarriers:
//   full[s]  (all threads arrive): cp.async.mbarrier.arrive.noinc from every thread after its copies of s;
//   empty[s] (all threads arrive): every thread once its warpgroup's wgmma reading stage s has retired.
// A thread refills a buffer only after empty (every warpgroup done with it), so warps drift by up to one
// stage and STAGES-1 stages of W are in flight per block.
//
// PDL (family registered with pdl=True): the first STAGES-1 stages of W (immutable) are issued before
// ddtree::grid_dependency_wait(); x, the workspace, the tickets and the output are touched only after it. The
// next kernel may launch right after that wait (GMMA_EARLY_TRIGGER) and prefetch its weights while we stream.
//
// Epilogue: the accumulators go through shared memory (fp32 [TN][64 NWG + 4]) so the output, the residual and
// the split-K partials are written/read along n, coalesced. K splits (blockIdx.y), two ways:
// - CS > 1: the CS splits of a tile form a (1, CS, 1) thread-block cluster; each block stages its partial
//   tile in its own shared memory and, after a cluster barrier, block `rank` sums slice `rank` of the tile
//   over all CS blocks through distributed shared memory (in split order: deterministic) and writes bf16.
//   No workspace, no tickets. Measured faster than the workspace split on every Qwen3-8B shape (H200).
//   With GMMA_PUSH (below) the blocks exchange their partials by st.async instead, each summing its token groups.
// - CS = 1 with gridDim.y > 1: fp32 partials ws[split][m][n], then ddtree::splitk_finish (last block of
//   the tile reduces; one int32 ticket per (token tile, row block), left at zero). Any split count.
//
// Measured design choices (H200, tools/bench_dense.py --gmma, docs in runtime/dense_gmma.py): the proxy
// fence per stage costs nothing measurable; deeper pipelines (7-11 stages of 16 KB) and two blocks per SM
// were not faster than 3 stages of 32 KB at one block per SM; 256-row blocks (RW = 2) win only where they
// avoid a split (gate_up at M = 128); clusters of 4 lose to clusters of 2.
#include <cuda_bf16.h>
#include <cuda/std/cstdint>  // NVRTC has no <cstdint>
#include <cuda/std/utility>
using cuda::std::uint32_t;
using cuda::std::uint64_t;
using cuda::std::uintptr_t;
#include "gmma_sm90.cuh"
#include "device_common.cuh"
#include "linear_splitk.cuh"


namespace {

constexpr int kStagePad = 4;           // fp32 pad of the epilogue staging rows (conflict-free fragment stores)


using ddtree::cp_async16_s;
using ddtree::sw128_desc;

using ddtree::mbar_arrive;
using ddtree::mbar_arrive_cp_async;
using ddtree::mbar_wait;
using ddtree::cluster_ctarank;
using ddtree::cluster_sync;
using ddtree::dsmem_map;
using ddtree::mbar_arrive_cluster;
using ddtree::mbar_init;
using ddtree::mbar_wait_cluster;
// 4 fp32 at a shared::cluster address. No "memory" clobber: the caller orders the loads after a cluster
// barrier (an asm with a clobber) and issues a batch of them before using any result, so their latencies
// overlap (with a clobber each load waited for the previous one's add: ~5 us per tile at CS = 2, TN = 72).
__device__ __forceinline__ float4 ld_dsmem4(uint32_t remote) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(remote));
  return v;
}
// out[m, n + e] = bf16(v[e] (+ residual[m, n + e])) for the E columns that lie below N, one element at a time
// (where the row is not 16-byte aligned, or at N's ragged end).
template <int E>
__device__ __forceinline__ void store_bf16_cols(__nv_bfloat16* __restrict__ out, int ldo,
                                                const __nv_bfloat16* __restrict__ residual, int ldr, int m, int n,
                                                int N, const float (&v)[E]) {
#pragma unroll
  for (int e = 0; e < E; ++e)
    if (n + e < N) {
      const float r = residual ? __bfloat162float(residual[(size_t)m * ldr + n + e]) : 0.f;
      out[(size_t)m * ldo + n + e] = __float2bfloat16(v[e] + r);
    }
}
}  // namespace

// TN: tokens per tile (wgmma N). KA: 64-k atoms per pipeline stage. STAGES: shared-memory stages. RW: 64-row
// W tiles per warpgroup (block = 64*NWG*RW W rows; RW = 2 halves the x traffic per W byte, TN/2*RW accumulators
// per thread). CS: K splits reduced inside a thread-block cluster of (1, CS, 1) blocks through distributed
// shared memory (gridDim.y == CS; no workspace, no tickets, sum in split order); CS = 1: gridDim.y splits
// through the fp32 workspace and ddtree::splitk_finish (any count), or none. NWG: warpgroups per block (2, 3).
// Dynamic smem (runtime/dense_gmma.py gmma_smem_bytes): 1024 (alignment) +
//   max(STAGES * KA * (8192 * NWG * RW + TN * 128), TN * (64 * NWG + 4) * 4).
// GMMA_EARLY_TRIGGER (NVRTC option, registry.py from DDTREE_GMMA_TRIGGER): 1 lets the next kernel launch right
// after our dependency wait, so its blocks can take free SM room and issue their weight prefetch while we run;
// 0 lets it launch at our epilogue.
#ifndef GMMA_EARLY_TRIGGER
#define GMMA_EARLY_TRIGGER 1
#endif
// GMMA_BISECT (NVRTC option; only the families dense_linear_sm90_bisect1..3 set it, tools/bench_w_tiles.py): bit 0
// skips the MMAs (the loads and barriers stay), bit 1 the epilogue (nothing is written). The output is then wrong:
// a measurement of where the kernel's time goes, never a kernel to run for results.
#ifndef GMMA_BISECT
#define GMMA_BISECT 0
#endif
// GMMA_TRACE (NVRTC option; only the families dense_linear_sm90_trace* set it, tools/bench_w_tiles.py --trace-m):
// thread 0 of each block writes %globaltimer at entry, after the PDL prologue (the dependency wait), at the end of
// the K loop, in the epilogue (the partials in hand: the push's bytes landed or the DSMEM's first cluster barrier
// passed; the tile staged in shared memory; the stores issued) and at exit, with its SM and cluster rank, into `ws`
// as kTraceWords u64 per block
// (block id x-fastest): where a chain of launches spends the time between one kernel's last load and the next
// one's first. The runtime never sets it.
#ifndef GMMA_TRACE
#define GMMA_TRACE 0
#endif
#if GMMA_TRACE
constexpr int kTraceWords = 9;  // entry, after the prologue, loop end, exit, SM id, partials in hand, stores issued,
                                // cluster rank, staged (words 5 / 6 / 8 stay 0 where the path has no such point)
#define GMMA_STAMP(i)                                                                                   \
  do {                                                                                                  \
    if (threadIdx.x == 0) {                                                                             \
      unsigned long long t_;                                                                            \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                                            \
      reinterpret_cast<unsigned long long*>(ws)[trace_block * kTraceWords + (i)] = t_;                  \
    }                                                                                                   \
  } while (0)
#else
#define GMMA_STAMP(i) \
  do {                \
  } while (0)
#endif
// GMMA_PUSH (NVRTC option; family dense_linear_sm90_push): the cluster K split's blocks exchange their partial sums
// by st.async instead of reading each other through two cluster barriers. The tile's live 8-token groups are shared
// out among the ranks; each block sends its partials of the others' groups into their receive regions (past the
// ring and the staging, so they land while the receiver still streams), counted on the receiver's gather barrier,
// sums its own groups in rank order (the DSMEM epilogue's sum: the same bits) and writes them. As soon as a
// block's own bytes have landed it tells the others (their "done" barriers), so no block exits with its
// distributed-shared-memory stores in flight. Measured (session 30, H100, qkv at 33 rows): gathering every partial
// on rank 0 left it 1.5 us from the partials in hand to its stores issued; shared groups (and 16-byte stores)
// 0.86, the op 20.88 -> 20.20 us. Where the receive region does not fit in 227 KB, the DSMEM epilogue stays.
#ifndef GMMA_PUSH
#define GMMA_PUSH 0
#endif

template <int TN, int KA, int STAGES, int RW, int CS, int NWG = 2>
__global__ void __cluster_dims__(1, CS, 1) __launch_bounds__(128 * NWG, 1)
linear_gmma_kernel(const __nv_bfloat16* __restrict__ x, int ldx,
                   const __nv_bfloat16* __restrict__ w,  // [N, K] row-major, K % 8 == 0
                   __nv_bfloat16* __restrict__ out, int ldo,
                   const __nv_bfloat16* __restrict__ residual, int ldr,  // nullable
                   float* __restrict__ ws, int* __restrict__ tickets,
                   int M, int N, int K, int k_per_split) {
  DDTREE_TRACE_WARP(ddtree::kTraceLinearGmma);
  static_assert(TN % 8 == 0 && TN >= 16 && TN <= 256, "wgmma N");
  static_assert(KA == 1 || KA == 2, "k atoms per stage");
  static_assert(RW == 1 || RW == 2, "W tiles per warpgroup");
  static_assert(NWG >= 1 && NWG <= 3, "warpgroups per block");
  constexpr int kThreads = 128 * NWG;
  constexpr int kRowsW = 64 * NWG;               // W rows per block and 64-row tile index t
  constexpr int kAtomBytesW = kRowsW * 128;      // one 64-k atom of those rows: 8 KB per warpgroup
  constexpr int kRows = kRowsW * RW;              // W rows per block
  constexpr int kAtomW = kAtomBytesW * RW;        // one 64-k atom of the W tile
  constexpr int kAtomBytesX = TN * 128;
  constexpr int kStageW = KA * kAtomW;
  constexpr int kStageBytes = KA * (kAtomW + kAtomBytesX);
  constexpr int kStageK = 64 * KA;
  constexpr int kAcc = TN / 2;  // fp32 accumulators per thread per 64-row tile (64 x TN per warpgroup)
  constexpr int kWq = 4 * RW;   // W rows per thread per atom (one 16-byte chunk each): kRows / (threads / 8)
  using Op = typename ddtree::GmmaOp<TN>::type;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  __shared__ ddtree::StageBarriers<STAGES> ring;
  const ddtree::AlignedSmem smem = ddtree::align_smem_1024(smem_raw);
  const uint32_t smem_base = smem.addr;
  unsigned char* smem_gen = smem.ptr;
  // GMMA_PUSH: 8-token group j of the tile is acc[0][4j .. 4j + 3] of every thread; the L live groups (rows < M)
  // are split among the ranks, rank r owning [r L / CS, (r + 1) L / CS). Sender q's float4 of thread i for group j
  // of rank r lands at r's offset kRecvOff + (q - (q > r)) * kSlotBytes + ((j - first group of r) * kThreads + i) * 16
  // (runtime/dense_gmma.py gmma_push_smem_bytes mirrors kRecvOff and kSlotBytes)
  constexpr int kGroups = TN / 8;
  constexpr int kSlotBytes = (kGroups + CS - 1) / CS * kThreads * 16;
  constexpr int kRecvOff = STAGES * kStageBytes > TN * (kRowsW + kStagePad) * 4 ? STAGES * kStageBytes
                                                                                : TN * (kRowsW + kStagePad) * 4;
  constexpr bool kPush = GMMA_PUSH && CS > 1 && RW == 1 && 1024 + kRecvOff + (CS - 1) * kSlotBytes <= 227 * 1024;
  // single-use, GMMA_PUSH only: [0] gather (this block's own arrival with the expected bytes + the others'
  // partials of its groups), [1] done (the CS - 1 others have all their bytes, so this block's stores are complete)
  __shared__ uint64_t push_bar[2];
  const uint32_t push_base = static_cast<uint32_t>(__cvta_generic_to_shared(push_bar));
  // The launch's dynamic shared memory comes from runtime/dense_gmma.py (gmma_smem_bytes, gmma_push_smem_bytes), which
  // restates the layout above: a launch with less would overrun it silently, so it traps instead (every GPU test of
  // an instance then checks the Python side).
  {
    constexpr uint32_t kSmemNeeded = 1024 + kRecvOff + (kPush ? (CS - 1) * kSlotBytes : 0);
    uint32_t dynamic_smem;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_smem));
    if (dynamic_smem < kSmemNeeded) __trap();
  }

#if GMMA_TRACE
  const int trace_block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  GMMA_STAMP(0);
  if (threadIdx.x == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    reinterpret_cast<unsigned long long*>(ws)[trace_block * kTraceWords + 4] = sm;
    reinterpret_cast<unsigned long long*>(ws)[trace_block * kTraceWords + 5] = 0;
    reinterpret_cast<unsigned long long*>(ws)[trace_block * kTraceWords + 6] = 0;
    reinterpret_cast<unsigned long long*>(ws)[trace_block * kTraceWords + 7] = cluster_ctarank();
    reinterpret_cast<unsigned long long*>(ws)[trace_block * kTraceWords + 8] = 0;
  }
#endif
  const int tid = threadIdx.x;
  const int wg = tid >> 7;  // warpgroup: W rows [64 RW wg, 64 RW (wg + 1)) of the block
  const int n0 = blockIdx.x * kRows;
  const int m0 = blockIdx.z * TN;
  const int k_begin = blockIdx.y * k_per_split;
  const int k_end = min(K, k_begin + k_per_split);
  const int n_stages = (k_end - k_begin + kStageK - 1) / kStageK;

  if (tid == 0) {
    if constexpr (kPush) {
      mbar_init(push_base, 1);
      mbar_init(push_base + 8, CS - 1);
    }
    ring.init(kThreads);  // its fence.mbarrier_init covers the two above
  }
  __syncthreads();
  if constexpr (kPush) ddtree::cluster_arrive_relaxed();  // waited for after the loop, before any remote access

  // This thread's W chunks: rows tid/8 + (threads/8) q, 16-byte chunk c = tid % 8 of each 128-byte row of
  // every atom; the swizzle puts chunk c of row r at chunk c ^ (r % 8).
  const int wc = tid & 7;
  const __nv_bfloat16* w_row[kWq];
  uint32_t w_dst[kWq];
#pragma unroll
  for (int q = 0; q < kWq; ++q) {
    const int r = (tid >> 3) + (kThreads / 8) * q;
    const int n = n0 + r;
    w_row[q] = n < N ? w + (size_t)n * K + 8 * wc : nullptr;
    w_dst[q] = r * 128 + ((wc ^ (r & 7)) << 4);
  }
  auto load_w = [&](int stage) {
    const uint32_t buf = smem_base + (stage % STAGES) * kStageBytes;
    const int k0 = k_begin + stage * kStageK;
#pragma unroll
    for (int a = 0; a < KA; ++a) {
      const bool k_ok = k0 + 64 * a + 8 * wc < k_end;
#pragma unroll
      for (int q = 0; q < kWq; ++q) {
        const bool ok = k_ok && w_row[q] != nullptr;
        cp_async16_s(buf + a * kAtomW + w_dst[q], ok ? (const void*)(w_row[q] + k0 + 64 * a) : (const void*)w, ok);
      }
    }
  };
  auto load_x = [&](int stage) {
    const uint32_t buf = smem_base + (stage % STAGES) * kStageBytes + kStageW;
    const int k0 = k_begin + stage * kStageK;
    constexpr int kChunks = KA * TN * 8;
#pragma unroll
    for (int i0 = 0; i0 < kChunks; i0 += kThreads) {
      const int i = i0 + tid;
      if (kChunks % kThreads == 0 || i < kChunks) {
        const int a = i / (TN * 8), rem = i % (TN * 8);
        const int r = rem >> 3, c = rem & 7;
        const int m = m0 + r, k = k0 + 64 * a + 8 * c;
        const bool ok = m < M && k < k_end;
        cp_async16_s(buf + a * kAtomBytesX + r * 128 + ((c ^ (r & 7)) << 4),
                     ok ? (const void*)(x + (size_t)m * ldx + k) : (const void*)x, ok);
      }
    }
  };

  // Prologue: W of the first STAGES-1 stages before the dependency wait (weights are immutable), then x.
  constexpr int kPre = STAGES - 1;
  ring.prologue(n_stages, GMMA_EARLY_TRIGGER, load_w, load_x);
  GMMA_STAMP(1);

  float acc[RW][kAcc];
#pragma unroll
  for (int t = 0; t < RW; ++t)
#pragma unroll
    for (int i = 0; i < kAcc; ++i) {
      acc[t][i] = 0.f;
      cute::warpgroup_fence_operand(acc[t][i]);
    }

  for (int s = 0; s < n_stages; ++s) {
    const int b = s % STAGES;
    mbar_wait(ring.full(b), (s / STAGES) & 1);
    // cp.async wrote through the generic proxy, wgmma reads through the async proxy (measured free, run 2)
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    const uint32_t wbase = smem_base + b * kStageBytes + wg * (RW * 64 * 128);
    const uint32_t xbase = smem_base + b * kStageBytes + kStageW;
    cute::warpgroup_arrive();
#pragma unroll
    for (int a = 0; a < KA; ++a) {
      const uint64_t db = sw128_desc(xbase + a * kAtomBytesX);
#pragma unroll
      for (int t = 0; t < RW; ++t) {
        const uint64_t da = sw128_desc(wbase + a * kAtomW + t * (64 * 128));
#pragma unroll
        for (int j = 0; j < 4; ++j)  // k16 steps: +32 bytes = +2 in the descriptor's address field
          if constexpr (!(GMMA_BISECT & 1))
            ddtree::gmma_ss<Op>(da + 2 * j, db + 2 * j, acc[t], cute::SM90::GMMA::ScaleOut::One,
                                cuda::std::make_integer_sequence<int, kAcc>{});
      }
    }
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<1>();  // this warpgroup's MMAs of stage s-1 have retired
#pragma unroll
    for (int t = 0; t < RW; ++t)
#pragma unroll
      for (int i = 0; i < kAcc; ++i) cute::warpgroup_fence_operand(acc[t][i]);
    if (s >= 1) mbar_arrive(ring.empty((s - 1) % STAGES));
    // Refill: stage s + STAGES - 1 goes into the buffer stage s - 1 used, once both warpgroups are done.
    const int t = s + kPre;
    if (t < n_stages) {
      if (s >= 1) mbar_wait(ring.empty((s - 1) % STAGES), ((s - 1) / STAGES) & 1);
      load_w(t);
      load_x(t);
      mbar_arrive_cp_async(ring.full(t % STAGES));
    }
  }
  cute::warpgroup_wait<0>();
#pragma unroll
  for (int t = 0; t < RW; ++t)
#pragma unroll
    for (int i = 0; i < kAcc; ++i) cute::warpgroup_fence_operand(acc[t][i]);
  GMMA_STAMP(2);
  if (!GMMA_EARLY_TRIGGER) ddtree::launch_dependents();  // the next kernel may start its weight prefetch now
  if constexpr ((GMMA_BISECT & 2) != 0) {
    if (acc[0][0] == 1.2345e-30f) out[0] = __float2bfloat16(acc[0][0]);  // keeps the MMAs (never true for x != 0)
    GMMA_STAMP(3);
    return;
  }
  // Rows [row_lo, row_hi) of the tile are this block's to write: all of them, or its groups' under GMMA_PUSH.
  int row_lo = 0, row_hi = TN;
  if constexpr (kPush) {
    ddtree::cluster_wait();  // every block of the cluster has initialized its barriers
    const int rank = static_cast<int>(cluster_ctarank());
    const int live = min(kGroups, (M - m0 + 7) / 8);
    const int g_lo = rank * live / CS, g_hi = (rank + 1) * live / CS;
    if (tid == 0) ddtree::mbar_arrive_expect_tx(push_base, (CS - 1) * (g_hi - g_lo) * kThreads * 16);
#pragma unroll
    for (int q = 0; q < CS; ++q) {
      if (q == rank) continue;
      const int q_lo = q * live / CS, q_hi = (q + 1) * live / CS;
      const uint32_t dst = dsmem_map(smem_base, q) + kRecvOff + (rank - (rank > q)) * kSlotBytes;
      const uint32_t gather = dsmem_map(push_base, q);
#pragma unroll
      for (int j = 0; j < kGroups; ++j)
        if (j >= q_lo && j < q_hi)
          ddtree::st_async_f4(dst + ((j - q_lo) * kThreads + tid) * 16,
                              make_float4(acc[0][4 * j], acc[0][4 * j + 1], acc[0][4 * j + 2], acc[0][4 * j + 3]),
                              gather);
    }
    // One thread acquires the others' bytes (an acquire at cluster scope invalidates L1: CCTL.IVALL per waiting
    // warp) and the block barrier passes them on; every warp is then also done with the ring.
    if (tid == 0) {
      mbar_wait_cluster(push_base, 0);
      GMMA_STAMP(5);
#pragma unroll
      for (int q = 0; q < CS; ++q)
        if (q != rank) mbar_arrive_cluster(dsmem_map(push_base + 8, q));
    }
    __syncthreads();
    // In batches of groups, every slot's float4 loaded before any add (so their latencies overlap; a group this
    // rank does not own is loaded from a landed slot at a clamped place, summed and dropped), then summed in rank
    // order from zero (the DSMEM epilogue's sum). Slot s holds rank s + (s >= rank)'s partial.
    const float4* recv = reinterpret_cast<const float4*>(smem_gen + kRecvOff);
    constexpr int kBatch = 4;
#pragma unroll
    for (int j0 = 0; j0 < kGroups; j0 += kBatch) {
      float4 part[kBatch][CS - 1];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int local = min(max(j0 + b - g_lo, 0), kSlotBytes / 16 / kThreads - 1);
#pragma unroll
        for (int q = 0; q < CS - 1; ++q)
          if (j0 + b < kGroups) part[b][q] = recv[q * (kSlotBytes / 16) + local * kThreads + tid];
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int j = j0 + b;
        if (j >= kGroups) continue;  // static; no branch on ownership, or the loads sink to their adds
        const bool mine = j >= g_lo && j < g_hi;
        const float4 own = make_float4(acc[0][4 * j], acc[0][4 * j + 1], acc[0][4 * j + 2], acc[0][4 * j + 3]);
        float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int q = 0; q < CS - 1; ++q) {
          if (q == rank) sum = make_float4(sum.x + own.x, sum.y + own.y, sum.z + own.z, sum.w + own.w);
          sum = make_float4(sum.x + part[b][q].x, sum.y + part[b][q].y, sum.z + part[b][q].z, sum.w + part[b][q].w);
        }
        if (rank == CS - 1) sum = make_float4(sum.x + own.x, sum.y + own.y, sum.z + own.z, sum.w + own.w);
        acc[0][4 * j] = mine ? sum.x : own.x;
        acc[0][4 * j + 1] = mine ? sum.y : own.y;
        acc[0][4 * j + 2] = mine ? sum.z : own.z;
        acc[0][4 * j + 3] = mine ? sum.w : own.w;
      }
    }
    row_lo = 8 * g_lo;
    row_hi = 8 * g_hi;
    // on to the unsplit epilogue below (its staging does not overlap the receive region)
  }

  // Epilogue, one pass per 64-row tile t of each warpgroup (so staging is [TN][128 + 4] fp32 whatever RW):
  // acc[t][4j + 2i + b] is W row 16*warp + lane/4 + 8i of the tile, token 8j + 2*(lane%4) + b; staged at
  // stg[token][64*wg + row] (row length 132: conflict-free), then written along n (coalesced).
  constexpr int kLd = kRowsW + kStagePad;
  float* stg = reinterpret_cast<float*>(smem_gen);
  const int warp = (tid >> 5) & 3, lane = tid & 31;
  const int r0 = 64 * wg + 16 * warp + (lane >> 2);
  const int c0 = 2 * (lane & 3);
  const bool single = gridDim.y == 1 || kPush;  // a GMMA_PUSH block holds the whole sum of its rows
  // 16-byte stores (8 bf16 or two float4 of the workspace) where every row start is 16-byte aligned
  const bool res16 = residual == nullptr || (ldr % 8 == 0 && reinterpret_cast<uintptr_t>(residual) % 16 == 0);
  const bool vec16 = single ? ldo % 8 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0 && res16
                            : N % 4 == 0 && reinterpret_cast<uintptr_t>(ws) % 16 == 0;
#pragma unroll
  for (int t = 0; t < RW; ++t) {
    // t = 0: all warpgroups done with the stage buffers (GMMA_PUSH: synced above); t > 0: previous pass written out
    if (t > 0 || !kPush) __syncthreads();
#pragma unroll
    for (int j = 0; j < TN / 8; ++j)
      if (8 * j >= row_lo && 8 * j < row_hi)
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int b = 0; b < 2; ++b) stg[(8 * j + c0 + b) * kLd + r0 + 8 * i] = acc[t][4 * j + 2 * i + b];
    if (CS > 1 && !kPush) {
      // Every block of the cluster holds its partial tile in stg; block `rank` sums rows slice `rank` of all
      // CS tiles (remote reads through DSMEM, in split order) and writes bf16 (+ residual).
      // Four consecutive columns per thread per item; a batch of kBatch items' CS remote loads is issued
      // before any sum, so the DSMEM latencies overlap.
      cluster_sync();
      GMMA_STAMP(5);
      const uint32_t rank = cluster_ctarank();
      const uint32_t stg_s = static_cast<uint32_t>(__cvta_generic_to_shared(stg));
      uint32_t peer[CS];
#pragma unroll
      for (int q = 0; q < CS; ++q) peer[q] = dsmem_map(stg_s, q);
      constexpr int kItems = TN * kRowsW / 4;  // float4 items of the tile; block `rank` sums [lo, hi)
      const int lo = (int)rank * kItems / CS, hi = ((int)rank + 1) * kItems / CS;
      constexpr int kBatch = CS >= 3 ? 2 : 4;
      for (int v0 = lo; v0 < hi; v0 += kBatch * kThreads) {
        float4 part[kBatch][CS];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int v = v0 + b * kThreads + tid;
          if (v < hi) {
            const int i = 4 * v;
            const uint32_t off = 4u * ((i / kRowsW) * kLd + i % kRowsW);
#pragma unroll
            for (int q = 0; q < CS; ++q) part[b][q] = ld_dsmem4(peer[q] + off);
          }
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int v = v0 + b * kThreads + tid;
          if (v >= hi) continue;
          const int i = 4 * v;
          const int mm = i / kRowsW, col = i % kRowsW;  // col % 4 == 0: the 4 columns share a 64-row tile
          const int m = m0 + mm, n = n0 + (col >> 6) * (64 * RW) + 64 * t + (col & 63);
          if (m >= M) continue;
          float sum[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int q = 0; q < CS; ++q) {  // split order: deterministic
            sum[0] += part[b][q].x;
            sum[1] += part[b][q].y;
            sum[2] += part[b][q].z;
            sum[3] += part[b][q].w;
          }
          store_bf16_cols(out, ldo, residual, ldr, m, n, N, sum);
        }
      }
      GMMA_STAMP(6);
      cluster_sync();  // no block reuses or releases its stg while another may still read it
      continue;
    }
    __syncthreads();
    GMMA_STAMP(8);
    // Eight consecutive columns (one 16-byte store of bf16) per thread per item, rows [row_lo, row_hi).
    constexpr int kVecPerRow = kRowsW / 8;
    const int m_live = min(row_hi, M - m0);
#pragma unroll 4
    for (int v = row_lo * kVecPerRow + tid; v < m_live * kVecPerRow; v += kThreads) {
      const int mm = v / kVecPerRow, col = 8 * (v % kVecPerRow);
      const int m = m0 + mm, n = n0 + (col >> 6) * (64 * RW) + 64 * t + (col & 63);
      if (n >= N) continue;
      const float4 lo = *reinterpret_cast<const float4*>(stg + mm * kLd + col);
      const float4 hi = *reinterpret_cast<const float4*>(stg + mm * kLd + col + 4);
      float f[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      if (!single) {
        float* dst = ws + ((size_t)blockIdx.y * M + m) * N + n;
        if (vec16 && n + 8 <= N) {
          __stcg(reinterpret_cast<float4*>(dst), lo);
          __stcg(reinterpret_cast<float4*>(dst) + 1, hi);
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e)
            if (n + e < N) __stcg(dst + e, f[e]);
        }
        continue;
      }
      if (vec16 && n + 8 <= N) {
        if (residual) {
          float r[8];
          ddtree::unpack8(*reinterpret_cast<const uint4*>(residual + (size_t)m * ldr + n), r);
#pragma unroll
          for (int e = 0; e < 8; ++e) f[e] += r[e];
        }
        *reinterpret_cast<uint4*>(out + (size_t)m * ldo + n) = ddtree::pack8(f);
      } else {
        store_bf16_cols(out, ldo, residual, ldr, m, n, N, f);
      }
    }
    GMMA_STAMP(6);
  }
  if constexpr (kPush)
    if (tid == 0) mbar_wait_cluster(push_base + 8, 0);  // the block stays until its sends have landed
  GMMA_STAMP(3);
  if (CS > 1 || single) return;
  if constexpr (NWG == 2) {
    // Outputs per thread per pass of the reduction: as many as divide the tile evenly, up to 16 (the last
    // block's reduction is a chain of L2 latencies; more independent loads in flight shorten it).
    constexpr int kElemsPerThread = TN * kRows / kThreads;
    constexpr int kIlp = kElemsPerThread % 16 == 0 ? 16 : kElemsPerThread % 12 == 0 ? 12
                       : kElemsPerThread % 8 == 0 ? 8 : kElemsPerThread % 4 == 0 ? 4 : 1;
    ddtree::splitk_finish<TN, kRows, kThreads, kIlp>(out, ldo, residual, ldr, ws,
                                                      tickets + blockIdx.z * gridDim.x + blockIdx.x, M, N, m0, n0);
  } else {
    __trap();  // one or three warpgroups split K only in a cluster (runtime/dense_gmma.py refuses a workspace
  }            // split; with three, at 168 registers, the workspace reduction spilled)
}

// Instances: cutlass_kernels/registry.py DENSE_GMMA_INSTANCES (NVRTC instantiates its name expressions).
