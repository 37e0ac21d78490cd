// bf16 linear y[M, N] = x[M, K] @ W[N, K]^T (+ residual) on Hopper GMMA (wgmma), sm_90a only, for up to 80 rows
// of x: narrow row blocks of W, so that one wave of blocks covers every SM with no K split.
//
// Why: linear_gmma_kernel (dense_linear_sm90.cu) swaps the operands (W is wgmma's A, 64 rows per warpgroup), so its
// row blocks are 64 or 128 rows. A 6144-row W is then 48 or 96 blocks: with a cluster K split of 2, 96 of the
// H200's 132 SMs stream and the rest idle; 4096 rows (o, down) fill 64-128. H200, session 23: those shapes reach
// 66-76% of the read bandwidth at M = 1..17, while gate_up (128 unsplit blocks of 192 rows, one long K run per
// SM) reaches 90-95%, and a chain of plain reads of qkv's bytes 88%. Here W is wgmma's B operand (the N side, any
// multiple of 8 rows): NW rows per block, NW picked so that ceil(N / NW) blocks fill one wave (6144 / 48 = 128,
// 4096 / 32 = 128), each streaming the whole K of its rows. x is the A side (the wgmma M of 64 rows per
// warpgroup): the token rows, from registers (wgmma RS), read by ldmatrix from a TX-row tile staged with W's;
// warps whose 16 rows hold no token feed zeros, and their output rows are not stored. runtime/dense_gmma.py takes it
// where it measured faster (H100, session 25: qkv / o / down of Qwen3-8B up to ~0.6 token rows per W row).
//
// Block: one warpgroup (128 threads) for up to 64 token rows, two (256 threads, token rows 64 wg ..) for TX = 80
// (the verify bucket 64: 65 rows), over NW W rows and TX token rows (blockIdx.z walks token tiles if M > TX;
// runtime/dense_gmma.py plans this kernel only where one tile holds M). Every thread loads and computes; both
// warpgroups read the same W stage.
// STAGES shared-memory stages of KA 64-k atoms, each stage [KA x-atoms: TX rows x 128 B][KA W-atoms: NW rows x
// 128 B], both with the 128-byte swizzle, filled by 16-byte cp.async and tracked by mbarriers as in
// linear_gmma_kernel (full[s]: every thread's copies landed; empty[s]: every thread is done reading stage s).
// Per stage: ldmatrix of the A fragments (KA x 4 k16 steps), wgmma RS, then wait for the MMAs to retire before
// the fragments are reused (the MMAs of a stage take less time than its bytes take to arrive; the STAGES - 1
// stages in flight keep the memory busy meanwhile).
//
// PDL (family registered with pdl=True): the first STAGES-1 stages of W (immutable) are issued before
// ddtree::grid_dependency_wait(); x, the residual and the output are touched only after it; the next kernel may
// launch right after that wait (GMMA_EARLY_TRIGGER, as linear_gmma_kernel).
//
// XMODE fuses the op that makes x into the x tile (one launch instead of two): once a stage lands, the block
// rewrites its x tile in place, live rows only (16-byte chunks dealt over all threads), then a block barrier, then
// the ldmatrix as usual; NARROW_REWRITE_AHEAD rewrites stage s + 1 while stage s's MMAs run. The cost follows M,
// not the 16 rows a warp's fragments span (measured slower than two launches from 17 rows: off by default).
//   kXSwiGLU: x <- silu(x) * x2 (gate, up), bit for bit swiglu_kernel's bf16 result;
//   kXRmsNorm: y <- rmsnorm(x (+ x2)) @ W^T as (h * norm_w) @ W^T * inv: h = x, or bf16(x + x2) (block 0 writes it to
//   sum_out, the residual stream); the tile becomes bf16(h * norm_w), h^2 is summed as the stages stream, and the
//   epilogue scales each token row by inv = rsqrt(mean(h^2) + eps). No row is read twice (a norm before the loop
//   would read every x row once more and make the MMAs wait for it), at the price of the bits: rmsnorm_kernel
//   rounds h * inv * norm_w to bf16, this rounds h * norm_w (one rounding per element either way).
// x2 rides in its own tile of each stage, beside x's; the rmsnorm weight's slice too.
//
// Clusters that share x (linear_gmma_narrow_mc_kernel, CS = 2): every block reads all of x for its NW rows of W,
// so from ~0.6 x rows per W row the L2 -> SM traffic of x, not HBM, sets the time (H100: o at M = 33, 17.9 vs
// 14.8 us for linear_gmma_kernel). In a (CS, 1, 1) cluster of neighbouring row blocks each x row of a stage is one
// bulk copy (cp.async.bulk ... multicast::cluster) issued by one thread of one block (row r by block r % CS) and
// written into every block's tile; thread 0 of each block expects all of the stage's x bytes on its full barrier
// (transaction count), and a stage's buffer is refilled only when every warp of every block of the cluster has
// released it (one remote arrival per warp on each block's empty barrier). The rows land unswizzled, kPitch =
// KA * 128 + 16 bytes apart (so an ldmatrix's 8 rows fall in distinct banks); the k past K in the last stage is
// never written and is zeroed in the A fragments instead; rows past M stay stale and only feed rows not stored.
// Every block of a cluster must have a row to copy in every token tile (>= CS live rows; narrow_plan checks): a
// block's empty barrier also gates its own W refills, and only the copies it waits for keep one warp's arrival for
// stage s + STAGES from landing there before another warp's for stage s.
//
// Epilogue: straight from the accumulators (a thread holds token rows 16 warp + lane / 4 (+ 8), W rows
// 8 j + 2 (lane % 4) (+ 1)): bf16 pairs along n, with the residual. No workspace, no tickets, one writer per
// output element: deterministic.
#include <cuda_bf16.h>
#include <cuda/std/cstdint>  // NVRTC has no <cstdint>
#include <cuda/std/utility>
using cuda::std::uint32_t;
using cuda::std::uint64_t;
using cuda::std::uintptr_t;
#include "gmma_sm90.cuh"
#include "device_common.cuh"

#ifndef GMMA_EARLY_TRIGGER
#define GMMA_EARLY_TRIGGER 1
#endif
// 1: a fused prologue rewrites stage s + 1's x tile while stage s's MMAs run (off the MMAs' path); 0: stage s's
// before its own ldmatrix (registry DDTREE_NARROW_REWRITE)
#ifndef NARROW_REWRITE_AHEAD
#define NARROW_REWRITE_AHEAD 1
#endif

namespace {
constexpr int kXPlain = 0, kXRmsNorm = 1, kXSwiGLU = 2;  // XMODE (as dense_linear.cu's)

// Four 8x8 b16 matrices from shared memory (lane l gives the row address of matrix l / 8, row l % 8).
__device__ __forceinline__ void ldmatrix_x4_s(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
}  // namespace

// NW: W rows per block (wgmma N: a multiple of 16 up to 256). TX: token rows per tile (a multiple of 16 up to 128;
// warps 0 .. TX/16 - 1 hold them; above 64, two warpgroups). KA: 64-k atoms per stage. STAGES: shared-memory stages.
// XMODE: kXPlain, kXRmsNorm or kXSwiGLU (x2, norm_w, eps, sum_out unused where XMODE does not say).
// Dynamic smem (registry.narrow_stage_bytes): 1024 (alignment) + STAGES * stage, stage = KA * (XT * TX + NW) * 128
// (XT = 2 x tiles (x, x2) with a prologue, else 1; CS > 1: the x tiles are XT * TX * kPitch bytes rounded up to
// 1024), + KA * 128 for the RMSNorm weight, rounded up to 1024.
// CS: with CS > 1 (linear_gmma_narrow_mc_kernel, a (CS, 1, 1) cluster of neighbouring row blocks) x is read once per
// cluster: each block bulk-copies every CS-th token row and multicasts it to all CS blocks (see the file comment).
template <int NW, int TX, int KA, int STAGES, int XMODE, int CS>
__device__ __forceinline__ void narrow_linear(const __nv_bfloat16* __restrict__ x, int ldx,
                                              const __nv_bfloat16* __restrict__ x2, int ldx2,
                                              const __nv_bfloat16* __restrict__ norm_w, float eps,
                                              __nv_bfloat16* __restrict__ sum_out, int ldsum,
                                              const __nv_bfloat16* __restrict__ w,
                                              __nv_bfloat16* __restrict__ out, int ldo,
                                              const __nv_bfloat16* __restrict__ residual, int ldr,
                                              int M, int N, int K) {
  static_assert(NW % 16 == 0 && NW >= 16 && NW <= 256, "wgmma N, and whole passes of 16 rows per copy");
  static_assert(CS >= 1 && CS <= 4, "cluster of row blocks sharing x");
  static_assert(TX % 16 == 0 && TX >= 16 && TX <= 128, "token rows: whole warps of one or two m64 tiles");
  static_assert(KA >= 1 && KA <= 4, "k atoms per stage");
  static_assert(XMODE == kXPlain || XMODE == kXRmsNorm || XMODE == kXSwiGLU, "x prologue");
  constexpr int kThreads = TX > 64 ? 256 : 128;
  constexpr int kRowsPerPass = kThreads / 8;    // rows one pass of 16-byte copies covers (8 chunks a row)
  constexpr int kXTiles = XMODE == kXPlain ? 1 : 2;
  constexpr bool kMc = CS > 1;
  constexpr int kAtomX = TX * 128;              // one 64-k atom of the token rows (x, then x2 if any)
  constexpr int kAtomW = NW * 128;              // one 64-k atom of the W rows
  // CS > 1: each x tile is TX rows of the stage's KA * 128 bytes as one bulk copy wrote them (no swizzle), kPitch
  // apart: rows 16 bytes apart in the banks, so an ldmatrix's 8 rows hit distinct banks.
  constexpr int kPitch = KA * 128 + 16;
  constexpr int kTileX = kMc ? TX * kPitch : KA * kAtomX;  // one x tile (x or x2) of a stage
  constexpr int kStageX = (kXTiles * kTileX + 1023) / 1024 * 1024;  // x tile(s), then W atoms (each 1024-aligned)
  constexpr int kStageG = kStageX + KA * kAtomW;  // RMSNorm: the norm weight's KA x 64 k (128 bytes each)
  constexpr int kStageBytes = (kStageG + (XMODE == kXRmsNorm ? KA * 128 : 0) + 1023) / 1024 * 1024;
  constexpr int kStageK = 64 * KA;
  constexpr int kAcc = NW / 2;                  // fp32 accumulators per thread (64 x NW per warpgroup)
  constexpr int kWq = (NW + kRowsPerPass - 1) / kRowsPerPass;  // W rows per thread per atom (chunk tid % 8)
  constexpr int kXq = (TX + kRowsPerPass - 1) / kRowsPerPass;
  static_assert(kAtomX % 1024 == 0 && kAtomW % 1024 == 0, "swizzled tiles start 1024-aligned");
  static_assert(!kMc || TX <= CS * kThreads, "multicast: one row per thread and tile");
  // Byte offset in a stage of 16-byte chunk c (0 .. 8 KA - 1) of token row r in x tile t (0: x, 1: x2).
  auto x_off = [](int t, int r, int c) {
    return kMc ? t * kTileX + r * kPitch + 16 * c
               : (t * KA + (c >> 3)) * kAtomX + r * 128 + (((c & 7) ^ (r & 7)) << 4);
  };
  using Op = typename ddtree::GmmaRsOp<NW>::type;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  __shared__ ddtree::StageBarriers<STAGES> ring;
  const ddtree::AlignedSmem smem = ddtree::align_smem_1024(smem_raw);
  const uint32_t smem_base = smem.addr;
  unsigned char* smem_gen = smem.ptr;

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int n0 = blockIdx.x * NW;
  const int m0 = blockIdx.z * TX;
  const int n_stages = (K + kStageK - 1) / kStageK;
  const bool with_x2 = XMODE == kXSwiGLU || (XMODE == kXRmsNorm && x2 != nullptr);

  // full: every thread's cp.async (W, the norm weight; CS = 1: x), and with CS > 1 thread 0's expect_tx of the
  // multicast bytes. empty: every thread (CS > 1: every warp of every block of the cluster, whose copies write
  // into all of them).
  if (tid == 0) ring.init(kThreads + (kMc ? 1 : 0), kMc ? kThreads / 32 * CS : kThreads);
  const uint32_t rank = kMc ? ddtree::cluster_ctarank() : 0;
  if constexpr (kMc) {
    ddtree::cluster_sync();  // every block's barriers initialised before any multicast or remote arrival
  } else {
    __syncthreads();
  }

  // This thread's copies: 16-byte chunk c = tid % 8 of rows tid / 8 + kRowsPerPass q of every atom (those below
  // NW / TX); the swizzle puts chunk c of row r at chunk c ^ (r % 8), and r % 8 = (tid / 8) % 8 for every q.
  const int wc = tid & 7;
  const int r_first = tid >> 3;
  const uint32_t chunk_dst = r_first * 128 + ((wc ^ (r_first & 7)) << 4);
  const __nv_bfloat16* w_row[kWq];
#pragma unroll
  for (int q = 0; q < kWq; ++q) {
    const int n = n0 + r_first + kRowsPerPass * q;
    w_row[q] = n < N ? w + (size_t)n * K + 8 * wc : nullptr;
  }
  auto in_tile = [&](int q, int rows) { return rows % kRowsPerPass == 0 || r_first + kRowsPerPass * q < rows; };
  auto load_w = [&](int stage) {
    const uint32_t buf = smem_base + (stage % STAGES) * kStageBytes + kStageX;
    const int k0 = stage * kStageK;
#pragma unroll
    for (int a = 0; a < KA; ++a) {
      const bool k_ok = k0 + 64 * a + 8 * wc < K;
#pragma unroll
      for (int q = 0; q < kWq; ++q) {
        if (!in_tile(q, NW)) continue;
        const bool ok = k_ok && w_row[q] != nullptr;
        ddtree::cp_async16_s(buf + a * kAtomW + chunk_dst + q * kRowsPerPass * 128,
                             ok ? (const void*)(w_row[q] + k0 + 64 * a) : (const void*)w, ok);
      }
    }
  };
  // x (and x2 into the next KA atoms): rows past M zero-filled, so their products land in rows never stored.
  // CS > 1: this block's rows (r % CS == rank), each one bulk copy of the stage's k range multicast to the
  // cluster; rows past M and the k past K are not written (stale: the fragments mask k >= K, rows past M only
  // make rows never stored). Thread 0 expects the bytes every block's copies bring into this block.
  auto load_x = [&](int stage) {
    const uint32_t buf = smem_base + (stage % STAGES) * kStageBytes;
    const int k0 = stage * kStageK;
    if constexpr (kMc) {
      const int live_rows = min(TX, M - m0);
      const uint32_t row_bytes = 2 * min(kStageK, K - k0);
      const uint32_t full_bar = ring.full(stage % STAGES);
      if (tid == 0) ddtree::mbar_arrive_expect_tx(full_bar, (with_x2 ? 2 : 1) * live_rows * row_bytes);
      const int r = CS * tid + (int)rank;
      if (r < live_rows) {
        ddtree::bulk_copy_multicast(buf + x_off(0, r, 0), x + (size_t)(m0 + r) * ldx + k0, row_bytes, full_bar,
                                    (1 << CS) - 1);
        if (with_x2)
          ddtree::bulk_copy_multicast(buf + x_off(1, r, 0), x2 + (size_t)(m0 + r) * ldx2 + k0, row_bytes,
                                      full_bar, (1 << CS) - 1);
      }
    } else {
#pragma unroll
    for (int t = 0; t < kXTiles; ++t) {
      const __nv_bfloat16* src = t == 0 ? x : x2;
      const int ld = t == 0 ? ldx : ldx2;
      if (t == 1 && !with_x2) break;
#pragma unroll
      for (int a = 0; a < KA; ++a) {
        const int k = k0 + 64 * a + 8 * wc;
#pragma unroll
        for (int q = 0; q < kXq; ++q) {
          if (!in_tile(q, TX)) continue;
          const int m = m0 + r_first + kRowsPerPass * q;
          const bool ok = m < M && k < K;
          ddtree::cp_async16_s(buf + (t * KA + a) * kAtomX + chunk_dst + q * kRowsPerPass * 128,
                               ok ? (const void*)(src + (size_t)m * ld + k) : (const void*)src, ok);
        }
      }
    }
    }
    if (XMODE == kXRmsNorm && tid < 8 * KA) {  // the norm weight of this stage's k: 16 bytes per thread
      const int k = k0 + 8 * tid;
      ddtree::cp_async16_s(buf + kStageG + 16 * tid, k < K ? (const void*)(norm_w + k) : (const void*)norm_w, k < K);
    }
  };

  // Prologue: W of the first STAGES-1 stages before the dependency wait (weights are immutable), then x.
  constexpr int kPre = STAGES - 1;
  ring.prologue(n_stages, GMMA_EARLY_TRIGGER, load_w, load_x);

  // Warp w holds token rows 16 w .. 16 w + 15 (warpgroup w / 4's m64 tile). ldmatrix rows of this lane: matrix
  // q = lane / 8 is rows 8 (q % 2) .. + 7 of the warp's 16, k chunk q / 2 of the k16 step, so the four registers
  // are the m16k16 A fragment (a0a1: row g, k 2t; a2a3: row g + 8; a4a5: row g, k 2t + 8; a6a7: row g + 8).
  const bool warp_has_rows = 16 * warp < TX && m0 + 16 * warp < M;
  const int lm_row = 16 * warp + 8 * ((lane >> 3) & 1) + (lane & 7);
  const int lm_half = lane >> 4;

  auto wait_full = [&](int s, int b) { ddtree::mbar_wait(ring.full(b), (s / STAGES) & 1); };  // stage s landed
  // Fused prologue: each stage's x tile is rewritten in place, rows below M only, by the whole block (16-byte
  // chunks dealt over the threads in a fixed order), then a block barrier before any warp reads it: the cost
  // follows the live rows, not the 64-row fragments. RMSNorm: h^2 summed per (thread, pass) slot over the stages,
  // in stage order (deterministic), gathered per row after the loop.
  constexpr int kChunks = KA * 8;                                   // 16-byte chunks of a row per stage
  constexpr int kPasses = (TX * kChunks + kThreads - 1) / kThreads;  // chunks per thread per stage, at most
  const int live_rows = min(TX, M - m0);
  float ss_slot[XMODE == kXRmsNorm ? kPasses : 1];
#pragma unroll
  for (int p = 0; p < (XMODE == kXRmsNorm ? kPasses : 1); ++p) ss_slot[p] = 0.f;
  const bool write_sum = XMODE == kXRmsNorm && with_x2 && sum_out != nullptr && blockIdx.x == 0;
  // rewrite_x(s, b): stage s (in buffer b), once landed; the block barrier after it comes from the caller.
  auto rewrite_x = [&](int s, int b) {
    wait_full(s, b);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    unsigned char* stage = smem_gen + b * kStageBytes;
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      const int i = tid + kThreads * p;
      if (i >= live_rows * kChunks) break;
      const int r = i / kChunks, c = i % kChunks, a = c >> 3, cc = c & 7;
      if (kMc && s * kStageK + 8 * c >= K) continue;  // never copied (stale); the fragments mask it
      uint4* px = reinterpret_cast<uint4*>(stage + x_off(0, r, c));
      float h[8], u[8];
      ddtree::unpack8(*px, h);
      if (with_x2) ddtree::unpack8(*reinterpret_cast<const uint4*>(stage + x_off(1, r, c)), u);
      if constexpr (XMODE == kXSwiGLU) {
#pragma unroll
        for (int j = 0; j < 8; ++j) h[j] = ddtree::silu(h[j]) * u[j];  // as swiglu_kernel
      } else {
        const int k = s * kStageK + 64 * a + 8 * cc;
        if (with_x2) {
#pragma unroll
          for (int j = 0; j < 8; ++j) h[j] += u[j];
          const uint4 hv = ddtree::pack8(h);
          ddtree::unpack8(hv, h);  // the rounded residual sum, as stored
          if (write_sum && k < K) *reinterpret_cast<uint4*>(sum_out + (size_t)(m0 + r) * ldsum + k) = hv;
        }
        float g[8];
        ddtree::unpack8(*reinterpret_cast<const uint4*>(stage + kStageG + a * 128 + 16 * cc), g);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          ss_slot[p] += h[j] * h[j];
          h[j] *= g[j];
        }
      }
      *px = ddtree::pack8(h);
    }
  };
  auto block_sync = [] { asm volatile("bar.sync 1, %0;" ::"n"(kThreads) : "memory"); };
  constexpr bool kAhead = XMODE != kXPlain && NARROW_REWRITE_AHEAD;
  if constexpr (kAhead) {  // stage 0 before the loop; the loop rewrites stage s + 1 under stage s's MMAs
    rewrite_x(0, 0);
    block_sync();
  }

  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) {
    acc[i] = 0.f;
    cute::warpgroup_fence_operand(acc[i]);
  }

  for (int s = 0; s < n_stages; ++s) {
    const int b = s % STAGES;
    if constexpr (kAhead) {
      // stage s landed and was rewritten in the previous iteration (or before the loop)
    } else if constexpr (XMODE != kXPlain) {
      rewrite_x(s, b);
      block_sync();  // every live row rewritten before any ldmatrix
    } else {
      wait_full(s, b);
      // cp.async wrote through the generic proxy, wgmma reads W through the async proxy
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    const uint32_t xbase = smem_base + b * kStageBytes;
    const uint32_t wbase = xbase + kStageX;
    uint32_t afrag[KA][4][4];
#pragma unroll
    for (int a = 0; a < KA; ++a)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (warp_has_rows) {
          ldmatrix_x4_s(afrag[a][j], xbase + x_off(0, lm_row, 8 * a + 2 * j + lm_half));
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e) afrag[a][j][e] = 0u;
        }
      }
    if constexpr (kMc) {  // the last stage's k past K was never copied: zero those bf16 pairs (K % 8 == 0)
      const int k0 = s * kStageK;
      if (k0 + kStageK > K) {
#pragma unroll
        for (int a = 0; a < KA; ++a)
#pragma unroll
          for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              if (k0 + 64 * a + 16 * j + 8 * (e >> 1) + 2 * (lane & 3) >= K) afrag[a][j][e] = 0u;
      }
    }
    cute::warpgroup_arrive();
#pragma unroll
    for (int a = 0; a < KA; ++a) {
      const uint64_t db = ddtree::sw128_desc(wbase + a * kAtomW);
#pragma unroll
      for (int j = 0; j < 4; ++j)  // k16 steps: +32 bytes = +2 in the descriptor's address field
        ddtree::gmma_rs<Op>(afrag[a][j], db + 2 * j, acc, cuda::std::make_integer_sequence<int, kAcc>{});
    }
    cute::warpgroup_commit_batch();
    if constexpr (kAhead) {
      if (s + 1 < n_stages) rewrite_x(s + 1, (s + 1) % STAGES);  // while the MMAs run (another buffer)
    }
    cute::warpgroup_wait<0>();  // this stage's MMAs have retired: its buffer and the fragments are free
#pragma unroll
    for (int i = 0; i < kAcc; ++i) cute::warpgroup_fence_operand(acc[i]);
    if constexpr (kMc) {
      // every block's next copies into buffer b wait for this warp: its generic writes (the rewrite) ordered before
      // them (async proxy), then one arrival per warp on buffer b's empty barrier in each block of the cluster
      if constexpr (XMODE != kXPlain) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      __syncwarp();
      if (lane == 0) {
#pragma unroll
        for (int c = 0; c < CS; ++c) ddtree::mbar_arrive_cluster(ddtree::dsmem_map(ring.empty(b), c));
      }
    } else {
      ddtree::mbar_arrive(ring.empty(b));
    }
    if constexpr (kAhead) block_sync();  // stage s + 1's rows rewritten before the next ldmatrix
    // Refill: stage s + STAGES - 1 goes into the buffer stage s - 1 used, once every thread is done with it.
    const int t = s + kPre;
    if (t < n_stages) {
      if (s >= 1) ddtree::mbar_wait(ring.empty((s - 1) % STAGES), ((s - 1) / STAGES) & 1);
      load_w(t);
      load_x(t);
      ddtree::mbar_arrive_cp_async(ring.full(t % STAGES));
    }
  }
  if (!GMMA_EARLY_TRIGGER) ddtree::launch_dependents();
  // no block leaves while another may still arrive on its barriers or copy into it
  if constexpr (kMc) ddtree::cluster_sync();

  // RMSNorm: each row's sum of squares from its chunk slots, in chunk order; inv = rsqrt(mean + eps) scales the row.
  float row_scale[2] = {1.f, 1.f};
  if constexpr (XMODE == kXRmsNorm) {
    __shared__ float slot_ss[TX * kChunks];
#pragma unroll
    for (int p = 0; p < kPasses; ++p)
      if (tid + kThreads * p < TX * kChunks) slot_ss[tid + kThreads * p] = ss_slot[p];
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = 16 * warp + (lane >> 2) + 8 * i;
      float v = 0.f;
      if (r < live_rows)
        for (int c = 0; c < kChunks; ++c) v += slot_ss[r * kChunks + c];
      row_scale[i] = rsqrtf(v / (float)K + eps);
    }
  }
  // acc[4 j + 2 i + e]: token row 16 warp + lane / 4 + 8 i, W row 8 j + 2 (lane % 4) + e.
  if (!warp_has_rows) return;
  const bool pairs = ((reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(residual)) & 3) == 0 &&
                     ((ldo | (residual ? ldr : 0)) & 1) == 0;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int m = m0 + 16 * warp + (lane >> 2) + 8 * i;
    if (m >= M) continue;
    __nv_bfloat16* orow = out + (size_t)m * ldo;
    const __nv_bfloat16* rrow = residual ? residual + (size_t)m * ldr : nullptr;
#pragma unroll
    for (int j = 0; j < NW / 8; ++j) {
      const int n = n0 + 8 * j + 2 * (lane & 3);
      float v0 = acc[4 * j + 2 * i] * row_scale[i], v1 = acc[4 * j + 2 * i + 1] * row_scale[i];
      if (pairs && n + 1 < N) {
        if (rrow) {
          const float2 r = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(rrow + n));
          v0 += r.x;
          v1 += r.y;
        }
        *reinterpret_cast<__nv_bfloat162*>(orow + n) = __floats2bfloat162_rn(v0, v1);
      } else {
        if (n < N) orow[n] = __float2bfloat16(v0 + (rrow ? __bfloat162float(rrow[n]) : 0.f));
        if (n + 1 < N) orow[n + 1] = __float2bfloat16(v1 + (rrow ? __bfloat162float(rrow[n + 1]) : 0.f));
      }
    }
  }
}

#define NARROW_PARAMS                                                                                      \
  const __nv_bfloat16 *__restrict__ x, int ldx,                                                          \
      const __nv_bfloat16 *__restrict__ x2, int ldx2,      /* up (SwiGLU) / residual (RMSNorm) */          \
      const __nv_bfloat16 *__restrict__ norm_w, float eps, /* RMSNorm weight [K] */                        \
      __nv_bfloat16 *__restrict__ sum_out, int ldsum,      /* RMSNorm: bf16(x + x2) (nullable) */          \
      const __nv_bfloat16 *__restrict__ w,                 /* [N, K] row-major, K % 8 == 0 */              \
      __nv_bfloat16 *__restrict__ out, int ldo, const __nv_bfloat16 *__restrict__ residual, /* nullable */ \
      int ldr, int M, int N, int K
#define NARROW_ARGS x, ldx, x2, ldx2, norm_w, eps, sum_out, ldsum, w, out, ldo, residual, ldr, M, N, K

// One block per NW rows of W (grid x), per TX token rows (grid z).
template <int NW, int TX, int KA, int STAGES, int XMODE = kXPlain>
__global__ void __launch_bounds__(TX > 64 ? 256 : 128, 1) linear_gmma_narrow_kernel(NARROW_PARAMS) {
  DDTREE_TRACE_WARP(ddtree::kTraceLinearNarrow);
  narrow_linear<NW, TX, KA, STAGES, XMODE, 1>(NARROW_ARGS);
}

// The same in (CS, 1, 1) clusters that read x once per cluster (grid x a multiple of CS; blocks past N only copy).
template <int NW, int TX, int KA, int STAGES, int XMODE, int CS>
__global__ void __cluster_dims__(CS, 1, 1) __launch_bounds__(TX > 64 ? 256 : 128, 1)
    linear_gmma_narrow_mc_kernel(NARROW_PARAMS) {
  DDTREE_TRACE_WARP(ddtree::kTraceLinearNarrowCluster);
  narrow_linear<NW, TX, KA, STAGES, XMODE, CS>(NARROW_ARGS);
}

// Instances: cutlass_kernels/registry.py NARROW_GMMA_INSTANCES (NVRTC instantiates its name expressions).
