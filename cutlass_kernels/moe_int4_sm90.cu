// INT4 (W4A16) grouped MoE GEMMs on Hopper GMMA (wgmma), sm_90a only, for experts with many tokens (skewed
// routing, prefill): each 64-k stage of the weights is dequantized ONCE per chunk of up to TN tokens and
// multiplied against all of them by wgmma, where moe_int4.cu's mma.sync kernels dequantize again for every
// 8..32-token chunk (PERF: a hot expert with 236 tokens is compute-bound there).
//
// Same weight layout (runtime/kimi_kernels.py repack_int4_experts), same slot list, same outputs as
// moe_w4a16_kernel: MODE 0 (gate_up) h[pos, col] = SiLU(gate) * up, bf16; MODE 1 (down) out[pos, row] bf16.
// A slot runs here when min_count <= its token count < max_count (launches for several tiers of counts may
// split the hot slots between pipelines); moe_slot_split_kernel writes the counts the mma.sync kernel sees
// (count < the lowest tier's min_count ? count : 0), so each slot is done by exactly one kernel.
//
// Two kernels, eight pipelines (PIPE; runtime/kimi_kernels.py GMMA_PIPES, measurements in docs/PERF.md):
// moe_gmma_kernel<MODE, TN, PIPE>: 2 warpgroups, 128 weight rows (MODE 0: 64 gate rows = warpgroup 0, the same
// 64 up rows = warpgroup 1; MODE 1: 128 down rows) x up to TN tokens; token chunks of TN loop inside the block
// (or, with the (slot, chunk) item list, one chunk per block). Every warp dequantizes its 16-row block: lane
// (g, t) reads its 16 packed bytes (rows g and g + 8, physical columns 16t .. 16t + 15 of the unit) and its
// scale word and converts with the lop3/bf16x2 path of moe_int4.cu; the x rows (gathered through sorted_token
// for MODE 0) go in by cp.async, K-major 128-byte-swizzled [TN][64].
// - PIPE 0 / 1 (shared A): the bf16 weights go into a swizzled W tile [128][64] and wgmma reads both operands
//   from shared memory; weights 1 / 8 stages ahead in a register ring, 2 / 3 stage buffers.
// - PIPE 2 / 3 (register A): the weights become wgmma A fragments in registers (a quad transpose by shuffles,
//   dequant_frag), x alone in a 4-buffer ring, one wgmma batch in flight across the stage barrier; PIPE 3 is
//   the same at two blocks per SM (64/128-token tiles).
// - PIPE 6 (register A, slot order): as PIPE 3, but each lane's own 16 bytes are its A fragments as they are
//   (word s = k16 step s, the mma.sync path's dequantization, one scale word, no shuffles), so wgmma sees the
//   unit's columns in the repacked (slot) order. x must be in that order too: MODE 0 reads the copy that
//   moe_x_slot_kernel makes of the layer input, and MODE 0 writes h in slot order, which its MODE 1 twin
//   (the same hot slots) reads. Slot c = 16 s + 8 h + 2 t + b of a unit holds physical column 16 t + 4 s + 2 h
//   + b (x_slot_source below); an expert's h rows are only read by the kernel family that wrote them. Its x
//   ring is 6 deep, 3 stages ahead, with one barrier per two stages (half of PIPE 3's barriers and fences).
//   32-, 64- and 128-token tiles (32: experts of 8-40 tokens, uniform T >= 512).
// - PIPE 7: PIPE 6 with its steady-state stages free of the bound checks (SASS: ~3 compares, 3 predicate moves
//   and 3 branches per stage) and a whole x ring (8 buffers at 32- / 64-token tiles) per loop iteration, so
//   every buffer index and descriptor offset is a constant: ~98 instructions per stage in SASS, PIPE 6 ~130.
// - PIPE 8: PIPE 7 with the weights through a shared-memory cp.async ring 8 stages deep instead of the 4-stage
//   register ring (32- / 64-token tiles; 40 KB more shared memory per block).
// - PIPE 20: PIPE 8 at 256-token tiles (one block per SM) for the experts that make the layer compute-bound: x 4
//   stages ahead in 6 buffers, a 6-stage weight ring, and the wgmma N cut to the chunk's tokens rounded up to 32
//   (one main loop per N). The register-A wgmma reads only x from shared memory, where the warp-specialized PIPE 5
//   also stores and re-reads the dequantized weights there.
// moe_gmma_ws_kernel<MODE, TN, NSTEP> (PIPE 4 / 5 = NSTEP 0 / 16): warp-specialized, one warpgroup dequantizing
// into a shared W ring (mbarriers) for two wgmma warpgroups on half of the tile's tokens each (see its comment
// below). Traced builds count each warp's cycles in the spans DDTREE_TRACE_STALLS selects
// (device_common.cuh TraceStallSite; by default the ring waits: the producer's on free buffers, the consumers' on
// filled ones).
// The K order inside each 64-column unit is the repacked (permuted) order for the weights' lanes, but every
// weight lands at its physical column (tile or fragment) and x is read plainly, so the dot product is plain.
#include <cuda_bf16.h>
#include <cuda/std/cstdint>  // NVRTC has no <cstdint>
#include <cuda/std/utility>
using cuda::std::uint32_t;
using cuda::std::uint64_t;
#include "gmma_sm90.cuh"
#include "device_common.cuh"
#include "int4_dequant.cuh"

#ifndef DDTREE_WS_PROBE
#define DDTREE_WS_PROBE 0
#endif
namespace moe90 {
// Timing probes of the wgmma MoE kernels (NVRTC -DDDTREE_WS_PROBE=mask from the environment's DDTREE_WS_PROBE; 0 in
// every real build): each leaves one part of the stage out, so a hot stage timed without it bounds what that part
// costs. The outputs are then wrong; runtime/cuda/nvrtc.py says so when it builds one.
enum WsProbe : int {
  // moe_gmma_ws_kernel (PIPE 4 / 5)
  kProbeNoDequant = 1,   // the producer skips the dequantization and its stores (loads and the ring hand-off stay)
  kProbeNoX = 2,         // the consumers issue no x cp.async (the waits and barriers stay)
  kProbeNoMma = 4,       // the consumers issue no wgmma (the waits, barriers and releases stay)
  // moe_gmma_kernel's register-A pipelines in slot order (PIPE 6 / 7 / 8 / 20)
  kProbeRaNoDequant = 8,   // the A fragments are the loaded weight words as they are (one xor keeps the scale load)
  kProbeRaNoX = 16,        // no x cp.async (the waits and barriers stay)
  kProbeRaNoMma = 32,      // no wgmma (the arrive / commit / wait stay)
  kProbeRaNoStore = 64,    // the epilogue's global stores left out (its shared-memory staging stays)
  kProbeRaNoW = 128,       // PIPE 8 / 20: no weight-ring cp.async (the ring's shared loads stay)
  kProbeRaNoBarrier = 256, // no block barrier between stages (buffers then refilled under their readers)
  kProbeRaNoWScale = 512,  // PIPE 8 / 20: no 4-byte scale-word cp.async (the 16-byte weight copies stay)
  kProbeRaNoWPacked = 1024,  // PIPE 8 / 20: no 16-byte packed-weight cp.async (the scale copies stay)
};
constexpr int THREADS = 256;
constexpr int W_RING = 8;   // PIPE 8's shared weight ring: stages (16 + 4 bytes per thread each)
constexpr int W_TILE = 128 * 128;   // 128 rows x 64 k bf16
// moe_gmma_kernel's blocks per SM (its launch bound): two for PIPE 3 / 6 / 7 / 8, one for the others (PIPE 20 fills
// an SM's registers and shared memory)
__host__ __device__ constexpr int gmma_blocks_per_sm(int pipe) { return pipe == 3 || (pipe >= 6 && pipe <= 8) ? 2 : 1; }


using ddtree::cp_async16_s;
using ddtree::bf16x2_broadcast;
using ddtree::dequant_bf16x2;
using ddtree::nib_to_bf16x2_biased;
using ddtree::sw128_desc;

__device__ __forceinline__ void st_shared16(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

// The packed weights and the scale word of (row block rb of this lane, 64-k unit u).
__device__ __forceinline__ uint4 load_w(const uint4* wp, int u) {
  return ddtree::load_stream(wp + u * 32);
}
__device__ __forceinline__ const uint32_t* scale_word(const uint4* sp, int u) {
  return reinterpret_cast<const uint32_t*>(sp + (u / 8) * 32 + ((u / 4) & 1)) + (u & 3);
}
__device__ __forceinline__ uint32_t load_scale(const uint4* sp, int u) { return *scale_word(sp, u); }

// Dequantize one lane's 16 bytes (rows g, g + 8 of the warp's row block; columns 16t .. 16t + 15) into the
// swizzled W tile: row R = 16 w + g (+ 8), 16-byte units 2t, 2t + 1 of the 128-byte row.
__device__ __forceinline__ void dequant_store(uint32_t tile, uint4 w, uint32_t sw, int row, int t) {
  const uint32_t s_lo = bf16x2_broadcast<false>(sw), s_hi = bf16x2_broadcast<true>(sw);
  uint32_t lo[8], hi[8];   // row g / g + 8: columns 16t + 2i, + 1 as bf16x2
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int s = 0; s < 4; ++s) {   // word s: columns 16t + 4s .. + 3
    const uint32_t q = words[s];
    lo[2 * s] = dequant_bf16x2(nib_to_bf16x2_biased(q), s_lo);            // nibbles 0, 4: row g, +0, +1
    hi[2 * s] = dequant_bf16x2(nib_to_bf16x2_biased(q >> 4), s_hi);       // nibbles 1, 5: row g + 8
    lo[2 * s + 1] = dequant_bf16x2(nib_to_bf16x2_biased(q >> 8), s_lo);   // nibbles 2, 6: row g, +2, +3
    hi[2 * s + 1] = dequant_bf16x2(nib_to_bf16x2_biased(q >> 12), s_hi);  // nibbles 3, 7: row g + 8
  }
  const int r0 = row, r1 = row + 8;   // r0 % 8 == r1 % 8
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t unit = (uint32_t)((2 * t + h) ^ (r0 & 7)) << 4;
    st_shared16(tile + r0 * 128 + unit, lo[4 * h], lo[4 * h + 1], lo[4 * h + 2], lo[4 * h + 3]);
    st_shared16(tile + r1 * 128 + unit, hi[4 * h], hi[4 * h + 1], hi[4 * h + 2], hi[4 * h + 3]);
  }
}

// Rows 0 .. rows - 1 of a bf16 [rows][LD] shared tile, COLS wide, to out[row * ld_out + 0 .. COLS - 1] in
// 16-byte pieces by the block's threads.
template <int COLS, int LD>
__device__ __forceinline__ void store_rows(const __nv_bfloat16* tile, __nv_bfloat16* out, int ld_out, int rows,
                                           int tid) {
  constexpr int V = COLS / 8;   // 16-byte pieces per row
  for (int i = tid; i < rows * V; i += THREADS) {
    const int row = i / V, v = i % V;
    *reinterpret_cast<uint4*>(out + (long long)row * ld_out + v * 8) =
        *reinterpret_cast<const uint4*>(tile + row * LD + v * 8);
  }
}

// Slot order (PIPE 6): the physical column of slot c of a 64-column unit, and back.
__device__ __forceinline__ int x_slot_source(int c) {
  return 16 * ((c >> 1) & 3) + 4 * (c >> 4) + 2 * ((c >> 3) & 1) + (c & 1);
}
__device__ __forceinline__ int slot_of_column(int p) {
  return 16 * ((p >> 2) & 3) + 8 * ((p >> 1) & 1) + 2 * (p >> 4) + (p & 1);
}

// PIPE 6: the lane's 16 bytes as they are: word s is k16 step s (rows g, g + 8; slots 2t, 2t + 1, 2t + 8,
// 2t + 9), one scale word for all four (the lane's 16 columns lie in one 32-column group). The offset-free
// dequantization (int4_dequant.cuh): the fragments hold the weights times 2^-3, DEQUANT_UNDO undoes it.
__device__ __forceinline__ void dequant_slot(const uint4& w, uint32_t sw, uint32_t (&a)[4][4]) {
  const ddtree::DequantScales ds = ddtree::dequant_scales(sw);
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int s = 0; s < 4; ++s) ddtree::dequant_word(words[s], ds, a[s]);
}
// The slot-order A fragments: dequant_slot, or in the kProbeRaNoDequant probe build the loaded words as they are (one
// xor uses the scale word, so its load stays).
__device__ __forceinline__ void slot_frag(const uint4& w, uint32_t sw, uint32_t (&a)[4][4]) {
  if constexpr ((DDTREE_WS_PROBE & kProbeRaNoDequant) != 0) {
    const uint32_t words[4] = {w.x ^ sw, w.y, w.z, w.w};
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
      for (int i = 0; i < 4; ++i) a[s][i] = words[(s + i) & 3];
  } else {
    dequant_slot(w, sw, a);
  }
}
// f(integral_constant<int, STEP n>) for n = 1 .. MAXN / STEP (a switch unrolled at compile time): a wgmma N that
// must be a constant, chosen per token chunk.
template <int STEP, int MAXN, int N = STEP, class F>
__device__ __forceinline__ void dispatch_n(int n, F&& f) {
  if constexpr (N < MAXN) {
    if (n * STEP <= N) {
      f(cuda::std::integral_constant<int, N>{});
      return;
    }
    dispatch_n<STEP, MAXN, N + STEP>(n, f);
  } else {
    f(cuda::std::integral_constant<int, MAXN>{});
  }
}

// PIPE 2: the lane's 16 bytes dequantized straight into wgmma A fragments (m64k16, the mma.sync m16n8k16 A
// layout per warp). Lane t of a quad holds columns 16t .. 16t + 15 of the unit, i.e. all of k16 step t for rows
// g and g + 8; step j's fragment wants columns 16j + 2t, +1, +8, +9 from every lane of the quad. Each word s
// holds columns 4s .. 4s + 3 of the lane's 16, row g in nibbles 0 (+0), 4 (+1), 2 (+2), 6 (+3) and row g + 8 in
// nibbles 1, 5, 3, 7, so byte b of a word is (column 2b' (b = b' or b' + 2)) of both rows: the 4 bytes lane t'
// wants from step t (columns 2t', 2t' + 1 from word t' / 2, 2t' + 8, + 9 from word 2 + t' / 2) are one prmt,
// laid out so that nibble pairs (0, 4), (1, 5), (2, 6), (3, 7) are a0 .. a3. A 4 x 4 transpose over the quad
// (two xor-shuffle rounds) then gives lane t' the word of every step j. a[j] = step j's A fragment.
__device__ __forceinline__ void dequant_frag(const uint4& w, uint32_t sc_lo_group, uint32_t sc_hi_group, int t,
                                             uint32_t (&a)[4][4]) {
  const uint32_t d0 = __byte_perm(w.x, w.z, 0x6240), d1 = __byte_perm(w.x, w.z, 0x7351);   // for lanes t' = 0, 1
  const uint32_t d2 = __byte_perm(w.y, w.w, 0x6240), d3 = __byte_perm(w.y, w.w, 0x7351);   // for lanes t' = 2, 3
  const bool b0 = t & 1, b1 = t & 2;
  // Round 1 (lanes t, t ^ 1): send the words for the partner's column parity, keep ours.
  const uint32_t r0 = __shfl_xor_sync(0xffffffffu, b0 ? d0 : d1, 1), r1 = __shfl_xor_sync(0xffffffffu, b0 ? d2 : d3, 1);
  const uint32_t k0 = b0 ? d1 : d0, k1 = b0 ? d3 : d2;
  // Steps (t & 2) + 0 / + 1 (even / odd) of the words for lanes b0 (x) and b0 + 2 (y).
  const uint32_t xe = b0 ? r0 : k0, xo = b0 ? k0 : r0, ye = b0 ? r1 : k1, yo = b0 ? k1 : r1;
  // Round 2 (lanes t, t ^ 2): keep the words for lane t, send the ones for lane t ^ 2.
  const uint32_t s0 = __shfl_xor_sync(0xffffffffu, b1 ? xe : ye, 2), s1 = __shfl_xor_sync(0xffffffffu, b1 ? xo : yo, 2);
  const uint32_t m0 = b1 ? ye : xe, m1 = b1 ? yo : xo;
  const uint32_t q[4] = {b1 ? s0 : m0, b1 ? s1 : m1, b1 ? m0 : s0, b1 ? m1 : s1};
#pragma unroll
  for (int j = 0; j < 4; ++j) {   // steps 0, 1: columns 0 .. 31 of the unit (scale group 0), steps 2, 3: group 1
    const uint32_t sw = j < 2 ? sc_lo_group : sc_hi_group;
    const uint32_t s_lo = bf16x2_broadcast<false>(sw), s_hi = bf16x2_broadcast<true>(sw);
    a[j][0] = dequant_bf16x2(nib_to_bf16x2_biased(q[j]), s_lo);          // row g, columns 16j + 2t, + 1
    a[j][1] = dequant_bf16x2(nib_to_bf16x2_biased(q[j] >> 4), s_hi);     // row g + 8
    a[j][2] = dequant_bf16x2(nib_to_bf16x2_biased(q[j] >> 8), s_lo);     // row g, columns 16j + 8 + 2t, + 1
    a[j][3] = dequant_bf16x2(nib_to_bf16x2_biased(q[j] >> 12), s_hi);    // row g + 8
  }
}
}  // namespace moe90

// PIPE 2 main loop over the k units of one token chunk: the warpgroup's 64 weight rows dequantized into A
// registers (dequant_frag), x [TN][64] in a BUFFERS-deep shared ring loaded X_AHEAD stages ahead, wgmma with A
// from registers. Two A register sets in turn, so stage u + 1 is dequantized while stage u's wgmma runs, and
// one wgmma batch stays in flight across the stage barrier (wait<1>, not <0>): the tensor cores are not
// drained every stage. The barrier (with the cp.async wait and the proxy fence before it) comes after every
// PAIR-th stage (1 or 2): before it, x of the next PAIR stages must have landed (X_AHEAD - PAIR groups may stay
// in flight). Buffer reuse: x of stage u + X_AHEAD goes into the buffer stage u + X_AHEAD - BUFFERS read, which
// every warpgroup retired (wait<1> of stage u - 1 - PAIR at the latest) before the last barrier, PAIR - 1
// stages before u at most: BUFFERS >= X_AHEAD + 1 + PAIR. (Units come in multiples of 8: k % 512 == 0.)
// SMEM_W (PIPE 8 / 20): the packed weights and scale words go through a shared-memory ring of WR stages instead of
// registers, each lane's own 16 + 4 bytes per stage by cp.async in the stage's x group, loaded WR stages ahead
// (twice PIPE 7's register ring, which left the weights arriving late: PERF.md session 12). How long a copy may
// take is set by x's distance X_AHEAD, since each cp.async wait also covers every older group; the ring only has
// to reach past it (WR >= X_AHEAD + 1: the wait that lands x of a stage has landed the next stage's weights).
// A lane reads back only what it copied itself, so its own cp.async wait suffices (no barrier); it refills the
// slot its dequantization has just read. The copies check their bound in every stage (a compare), so the steady
// state ends as PIPE 7's.
// N: the wgmma's token columns (PIPE 20: the chunk's tokens rounded up, at most TN; the x buffers stay TN rows).
// fill_t0: the traced build's start of the item's fill span (ddtree::kStallRaFill), ended at the first barrier.
template <int TN, int W_AHEAD, int BUFFERS, int X_AHEAD, int PAIR, bool SLOT, bool SPLIT, bool SMEM_W = false,
          int N = TN, int WR = moe90::W_RING, class LoadX>
__device__ __forceinline__ void gmma_register_a_mainloop(float* acc, const uint4* wp, const uint4* sp, int t,
                                                         int units, uint32_t smem_base, LoadX&& load_x,
                                                         long long fill_t0) {
  static_assert(W_AHEAD % 2 == 0 && (PAIR == 1 || PAIR == 2) && X_AHEAD >= PAIR && X_AHEAD + 1 + PAIR <= BUFFERS,
                "ring sizes");
  static_assert(!SMEM_W || (SLOT && SPLIT && WR % BUFFERS == 0 && WR >= X_AHEAD + 1),
                "PIPE 8 / 20: PIPE 7 with an x ring of 8 / 6 buffers, the weights' wait covered by x's");
  static_assert(N % 32 == 0 && N <= TN, "wgmma N: whole 32-row groups of the x tile");
  using Op = typename ddtree::GmmaRsOp<N>::type;
  constexpr int X_TILE = TN * 128, ACC = N / 2;
  // the weights' lead in stages: the depth of the register ring or of the shared one
  constexpr int LEAD = SMEM_W ? WR : W_AHEAD;
  uint4 wr[SMEM_W ? 1 : W_AHEAD];
  // scale words of the unit's column groups 0 and 1 (SLOT: s0r is the lane's own group, s1r unused)
  uint32_t s0r[SMEM_W ? 1 : W_AHEAD], s1r[SMEM_W ? 1 : W_AHEAD];
  // SMEM_W: this lane's 16 bytes of ring slot i at w_ring + i * 4096, its scale word at s_ring + i * 1024
  const uint32_t w_ring = smem_base + BUFFERS * X_TILE + 16 * threadIdx.x;
  const uint32_t s_ring = smem_base + BUFFERS * X_TILE + WR * moe90::THREADS * 16 + 4 * threadIdx.x;
  auto load_stage = [&](int slot, int u) {   // SMEM_W: slot = u % WR
    if constexpr (SMEM_W) {
      if constexpr ((DDTREE_WS_PROBE & (moe90::kProbeRaNoW | moe90::kProbeRaNoWPacked)) == 0)
        ddtree::cp_async16_s(w_ring + slot * (moe90::THREADS * 16), wp + u * 32, true);
      if constexpr ((DDTREE_WS_PROBE & (moe90::kProbeRaNoW | moe90::kProbeRaNoWScale)) == 0)
        ddtree::cp_async4_s(s_ring + slot * (moe90::THREADS * 4), moe90::scale_word(sp, u));
    } else {
      wr[slot] = moe90::load_w(wp, u);
      s0r[slot] = moe90::load_scale(sp, u);
      if constexpr (!SLOT) s1r[slot] = moe90::load_scale(sp + 2, u);
    }
  };
  auto dequant = [&](int slot, uint32_t (&a)[4][4]) {
    if constexpr (SMEM_W) {
      uint4 w;
      uint32_t sw;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w)
                   : "r"(w_ring + slot * (moe90::THREADS * 16)) : "memory");
      asm volatile("ld.shared.u32 %0, [%1];" : "=r"(sw) : "r"(s_ring + slot * (moe90::THREADS * 4)) : "memory");
      moe90::slot_frag(w, sw, a);
    } else if constexpr (SLOT) {
      moe90::slot_frag(wr[slot], s0r[slot], a);
    } else {
      moe90::dequant_frag(wr[slot], s0r[slot], s1r[slot], t, a);
    }
  };
#pragma unroll
  for (int d = 0; d < LEAD; ++d)
    if (d < units) load_stage(d, d);
#pragma unroll
  for (int a = 0; a < X_AHEAD; ++a) {
    if (a < units) load_x(smem_base + a * X_TILE, a);
    ddtree::cp_async_commit();
  }
  uint32_t a_frag[2][4][4];
  if constexpr (!SMEM_W) {
    dequant(0, a_frag[0]);
    if (W_AHEAD < units) load_stage(0, W_AHEAD);
  }
  ddtree::cp_async_wait<X_AHEAD - PAIR>();   // x of stages 0 .. PAIR - 1 (SMEM_W: and the weights of 0 .. LEAD - 1)
  if constexpr (SMEM_W) {
    dequant(0, a_frag[0]);
    if (LEAD < units) load_stage(0, LEAD);   // into the slot just read; the group of stage 0
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // cp.async -> wgmma
  __syncthreads();
  ddtree::trace_stall_end<ddtree::kStallRaFill>(fill_t0);
  // W_AHEAD stages, unrolled (ring slot, A set and barrier placement are constants). CHECKED: the bound checks
  // of the last groups; without them (SPLIT, the steady state) every check below holds by the loop's bound.
  // phase: u0 % PERIOD when a constant, else -1 (PERIOD: the x ring, or SMEM_W the weight ring, a multiple of it)
  auto stage_group = [&](int u0, auto checked, int phase) {
    constexpr bool CHECKED = decltype(checked)::value;
#pragma unroll
    for (int d = 0; d < W_AHEAD; ++d) {
      const int u = u0 + d;
      if (CHECKED && u >= units) break;
      const int buf = phase >= 0 ? (phase + d) % BUFFERS : u % BUFFERS;
      const uint64_t db = ddtree::sw128_desc(smem_base + buf * X_TILE);
#pragma unroll
      for (int i = 0; i < ACC; ++i) cute::warpgroup_fence_operand(acc[i]);
      cute::warpgroup_arrive();
      if constexpr ((DDTREE_WS_PROBE & moe90::kProbeRaNoMma) == 0) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          ddtree::gmma_rs<Op>(a_frag[d & 1][kk], db + 2 * kk, acc, cuda::std::make_integer_sequence<int, ACC>{});
      }
      cute::warpgroup_commit_batch();
      const int xbuf = phase >= 0 ? (phase + d + X_AHEAD) % BUFFERS : (u + X_AHEAD) % BUFFERS;
      if (!CHECKED || u + X_AHEAD < units) load_x(smem_base + xbuf * X_TILE, u + X_AHEAD);
      ddtree::cp_async_commit();   // one group per stage, empty at the tail, so the wait count below holds
      const long long t_mma = ddtree::trace_stall_begin<ddtree::kStallMmaWait>();
      cute::warpgroup_wait<1>();   // stage u - 1's wgmma retired: its A set and x buffer are free
#pragma unroll
      for (int i = 0; i < ACC; ++i) cute::warpgroup_fence_operand(acc[i]);
      ddtree::trace_stall_end<ddtree::kStallMmaWait>(t_mma);
      const long long t_dq = ddtree::trace_stall_begin<ddtree::kStallDequant>();
      if (!CHECKED || u + 1 < units) {
        if constexpr (SMEM_W) {
          // stage u + 1 from its slot, then stage u + 1 + LEAD into the same slot
          const int slot = phase >= 0 ? (phase + d + 1) % WR : (u + 1) % WR;
          dequant(slot, a_frag[(d + 1) & 1]);
          if (u + 1 + LEAD < units) load_stage(slot, u + 1 + LEAD);
        } else {
          const int slot = (d + 1) % W_AHEAD;
          dequant(slot, a_frag[(d + 1) & 1]);
          if (!CHECKED || u + 1 + W_AHEAD < units) load_stage(slot, u + 1 + W_AHEAD);
        }
      }
      ddtree::trace_stall_end<ddtree::kStallDequant>(t_dq);
      if (d % PAIR == PAIR - 1) {   // u0 is a multiple of PAIR
        const long long t_x = ddtree::trace_stall_begin<ddtree::kStallXWait>();
        ddtree::cp_async_wait<X_AHEAD - PAIR>();   // x of stages u + 1 .. u + PAIR has landed
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        ddtree::trace_stall_end<ddtree::kStallXWait>(t_x);
        const long long t_bar = ddtree::trace_stall_begin<ddtree::kStallBarrier>();
        if constexpr ((DDTREE_WS_PROBE & moe90::kProbeRaNoBarrier) == 0) __syncthreads();
        ddtree::trace_stall_end<ddtree::kStallBarrier>(t_bar);
      }
    }
  };
  int u0 = 0;
  if constexpr (SPLIT) {
    // Groups whose last stage u0 + W_AHEAD - 1 passes every check (u + 1 + W_AHEAD < units (SMEM_W: u + 1 <
    // units; its copies check themselves), u + X_AHEAD < units), PERIOD / W_AHEAD of them per iteration so that
    // every buffer and ring index is a constant once unrolled.
    constexpr int PERIOD = SMEM_W ? WR : BUFFERS;
    constexpr int G = PERIOD % W_AHEAD == 0 ? PERIOD / W_AHEAD : 1;
    for (; u0 + G * W_AHEAD + (SMEM_W ? 0 : W_AHEAD) < units && u0 + G * W_AHEAD - 1 + X_AHEAD < units;
         u0 += G * W_AHEAD) {
#pragma unroll
      for (int i = 0; i < G; ++i)
        stage_group(u0 + i * W_AHEAD, cuda::std::false_type{}, G * W_AHEAD == PERIOD ? i * W_AHEAD : -1);
    }
  }
  for (; u0 < units; u0 += W_AHEAD) stage_group(u0, cuda::std::true_type{}, -1);
  cute::warpgroup_wait<0>();
#pragma unroll
  for (int i = 0; i < ACC; ++i) cute::warpgroup_fence_operand(acc[i]);
}

// MODE 0: x bf16 [T, ldx] gathered by sorted_token, weights gate (wq0/ws0) and up (wq1/ws1), out h bf16
// [P, n_rows]; MODE 1: x = h [P, ldx] at sorted positions, weights down (wq0/ws0), out bf16 [P, n_rows].
// Grid (n_rows / (MODE 0 ? 64 : 128), up to n_items rows: slots or items); dynamic smem 1024 + the larger of
// the stage buffers ((2 + PIPE) * (16384 + TN * 128) for PIPE 0 / 1, 4 * TN * 128 for PIPE 2 / 3, 6 * TN * 128
// for PIPE 6 and PIPE 7 at 128-token tiles, 8 * TN * 128 for PIPE 7 at 32 / 64, that + 8 * 256 * 20 (the
// weight ring) for PIPE 8, 6 * TN * 128 + 6 * 256 * 20 for PIPE 20) and the epilogue staging (MODE 0: up as float
// [TN][68] + h as bf16 [TN][72] = TN * 416 bytes; MODE 1 TN * 272) (moe_gmma_smem_bytes in kimi_kernels.py).
template <int MODE, int TN, int PIPE>
__global__ void __launch_bounds__(moe90::THREADS, moe90::gmma_blocks_per_sm(PIPE))
moe_gmma_kernel(const uint16_t* __restrict__ x, int ldx, const uint4* __restrict__ wq0, const uint4* __restrict__ ws0,
                const uint4* __restrict__ wq1, const uint4* __restrict__ ws1, int n_rows, int k,
                const int* __restrict__ slot_expert, const int* __restrict__ slot_offset,
                const int* __restrict__ slot_count, const int* __restrict__ sorted_token, void* __restrict__ out,
                int min_count, int max_count, int n_items, const int* __restrict__ item_slot,
                const int* __restrict__ item_chunk) {
  DDTREE_TRACE_WARP(MODE == 0 ? ddtree::kTraceMoeGmmaGateUp : ddtree::kTraceMoeGmmaDown);
  using namespace moe90;
  static_assert(TN == 32 || TN == 64 || TN == 128 || TN == 256, "token tile");
  static_assert((PIPE >= 0 && PIPE <= 3) || (PIPE >= 6 && PIPE <= 8) || PIPE == 20, "pipeline");
  static_assert(TN != 32 || PIPE >= 6, "32-token tiles: PIPE 6 / 7 / 8 only (PIPE 3's lost to its 64: PERF.md)");
  static_assert(gmma_blocks_per_sm(PIPE) == 1 || TN <= 128, "two blocks per SM only fit 64- and 128-token tiles");
  static_assert(PIPE != 8 || TN <= 64, "PIPE 8: 32- / 64-token tiles (its weight ring beside the 8-buffer x ring)");
  static_assert(PIPE != 20 || TN == 256, "PIPE 20: 256-token tiles (at 128, two blocks per SM, it lost: PERF.md 42)");
  constexpr bool SLOT = PIPE >= 6;   // otherwise PIPE 3's pipeline
  constexpr bool SPLIT = PIPE >= 7;   // PIPE 7: PIPE 6 with the steady-state stages unchecked, an 8-buffer x ring
  // PIPE 1: packed weights W_AHEAD = 8 stages ahead in a register ring, 3 stage buffers (W tile + x) with x two
  // stages ahead; PIPE 0: one stage ahead each, 2 buffers (fewer registers and 50 KB of shared memory).
  // PIPE 2: no W tile; x only, 4 buffers, two stages ahead; weights 8 (TN 256: 4) stages ahead.
  // register A (PIPE 3: the same with two blocks per SM, 4 stages ahead; PIPE 6: PIPE 3 in slot order)
  constexpr bool RA = PIPE >= 2;
  constexpr int P = SLOT ? 3 : PIPE;
  // (PIPE 20: the stages per unrolled group; its weights are W_RING_20 ahead)
  constexpr int W_AHEAD =
      PIPE == 20 ? 2 : P == 0 ? 1 : P == 3 && TN == 128 ? 2 : (P == 2 && TN == 256) || P == 3 ? 4 : 8;
  // PIPE 6: x 3 stages ahead in 6 buffers, a barrier every second stage (PAIR; gmma_register_a_mainloop);
  // PIPE 20 (a barrier every stage): 4 ahead in 6 buffers beside a 6-stage weight ring (223 KB)
  constexpr int PAIR = PIPE == 20 ? 1 : SLOT ? 2 : 1;
  // (PIPE 7: 8 buffers up to 64-token tiles, so the buffer index is a mask)
  constexpr int BUFFERS = PIPE == 20 ? 6 : SPLIT && TN <= 64 ? 8 : SLOT ? 6 : RA ? 4 : PIPE ? 3 : 2;
  // PIPE 8: x 5 stages ahead (the most its 8 buffers allow): a cp.async wait covers every older group, the
  // weights' too, so this distance less PAIR, not the weight ring's depth, is how many stages any of its loads
  // have to land (PIPE 20 at 2 ahead left them one stage: PERF.md session 42)
  constexpr int X_AHEAD = PIPE == 8 ? 5 : PIPE == 20 ? 4 : SLOT ? 3 : RA ? 2 : BUFFERS - 1;
  constexpr int W_RING_20 = 6;
  constexpr int X_TILE = TN * 128;
  constexpr int STAGE = (RA ? 0 : W_TILE) + X_TILE;   // bytes per stage buffer; x at offset STAGE - X_TILE
  constexpr int ACC = TN / 2;
  using O = typename ddtree::GmmaOp<TN>::type;
  // Rows y = blockIdx.y, + gridDim.y, .. < n_items (one pass when the grid has n_items rows). item_slot null:
  // row y is slot y and runs all of its token chunks in turn; else it is item y, one TN-token chunk
  // (item_chunk[y]) of slot item_slot[y], so a hot expert's chunks run on blocks side by side. Slots are sorted
  // by count, most first (items by slot): the first slot below min_count ends the block's rows.
  for (int y = blockIdx.y; y < n_items; y += gridDim.y) {
    long long fill_t0 = ddtree::trace_stall_begin<ddtree::kStallRaFill>();   // traced builds (RA): the item's fill
    const int slot = item_slot != nullptr ? item_slot[y] : y;
    const int expert = slot_expert[slot], count = slot_count[slot], offset = slot_offset[slot];
    if (expert < 0 || count < min_count) break;   // the mma.sync kernel's slot, and so are all later ones
    if (count >= max_count) continue;              // a higher tier's slot
    const int c_begin = item_slot != nullptr ? item_chunk[y] * TN : 0;
    const int c_end = item_slot != nullptr ? min(count, c_begin + TN) : count;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t smem_base = (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) + 1023u) & ~1023u;
    float* const stg = reinterpret_cast<float*>(smem_raw + (smem_base - static_cast<uint32_t>(
        __cvta_generic_to_shared(smem_raw))));   // epilogue staging over the stage buffers (see there)

    const int tid = threadIdx.x, wg = tid >> 7, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int row_blocks = n_rows / 16, units = k / 64, supers = k / 512;
    // This warp's 16-row block of the 128-row tile (MODE 0: warps 0-3 gate, 4-7 the same rows of up).
    const int rb = MODE == 0 ? blockIdx.x * 4 + (warp & 3) : blockIdx.x * 8 + warp;
    const bool second = MODE == 0 && warp >= 4;
    const long long blk = (long long)expert * row_blocks + rb;
    const uint4* wp = (second ? wq1 : wq0) + blk * units * 32 + lane;
    // PIPE 0 / 1 / 6: the scale word of the lane's own group (t >> 1); PIPE 2 / 3: both groups' (sp, sp + 2)
    const uint4* sp = (second ? ws1 : ws0) + blk * supers * 32 + (g * 2 + (RA && !SLOT ? 0 : t >> 1)) * 2;
    const int wrow = warp * 16 + g;   // this lane's first row in the W tile

    for (int c0 = c_begin; c0 < c_end; c0 += TN) {
      if (c0 != c_begin) fill_t0 = ddtree::trace_stall_begin<ddtree::kStallRaFill>();   // the next chunk's fill
      // x chunks of this thread: rows i = tid / 8 + 32 j, 16-byte unit tid % 8 of the 64-k stage. The row
      // addresses once per chunk: looking sorted_token up inside load_x put a dependent global load in front of
      // every stage's cp.async.
      const uint16_t* xrow[TN / 32];
#pragma unroll
      for (int j = 0; j < TN / 32; ++j) {
        const int i = tid / 8 + 32 * j;
        const int row = c0 + i >= count ? 0 : MODE == 0 ? sorted_token[offset + c0 + i] : offset + c0 + i;
        xrow[j] = x + (long long)row * ldx + (tid & 7) * 8;
      }
      // Row i's unit c lands at i * 128 + ((c ^ (i % 8)) << 4); i % 8 is the same for every j, so the offset is
      // one register plus the constant 4096 j (the compiler did not see that and swizzled per j, every stage).
      const uint32_t x_off = (tid / 8) * 128 + (((tid & 7) ^ ((tid / 8) & 7)) << 4);
      // the chunk's first n_rows rows (a constant, a multiple of 32: PIPE 20's wgmma N) of stage u's x
      auto load_x_rows = [&](uint32_t tile, int u, auto n_rows) {
        if constexpr (!RA || (DDTREE_WS_PROBE & kProbeRaNoX) == 0) {
#pragma unroll
          for (int j = 0; j < decltype(n_rows)::value / 32; ++j)
            cp_async16_s(tile + x_off + 4096 * j, xrow[j] + u * 64, c0 + tid / 8 + 32 * j < count);
        }
      };
      auto load_x = [&](uint32_t tile, int u) { load_x_rows(tile, u, cuda::std::integral_constant<int, TN>{}); };
      float acc[ACC];
#pragma unroll
      for (int i = 0; i < ACC; ++i) {
        acc[i] = 0.f;
        cute::warpgroup_fence_operand(acc[i]);
      }
      if constexpr (PIPE == 20) {
        // the wgmma N (and the x rows loaded): the chunk's tokens rounded up to 32, so an expert's last chunk
        // of 72 tokens costs 96 token columns, not TN
        dispatch_n<32, TN>((min(TN, count - c0) + 31) / 32, [&](auto n_cols) {
          constexpr int N = decltype(n_cols)::value;
          gmma_register_a_mainloop<TN, W_AHEAD, BUFFERS, X_AHEAD, PAIR, SLOT, SPLIT, true, N, W_RING_20>(
              acc, wp, sp, t, units, smem_base,
              [&](uint32_t tile, int u) { load_x_rows(tile, u, n_cols); }, fill_t0);
        });
      } else if constexpr (RA) {
        gmma_register_a_mainloop<TN, W_AHEAD, BUFFERS, X_AHEAD, PAIR, SLOT, SPLIT, PIPE == 8>(
            acc, wp, sp, t, units, smem_base, load_x, fill_t0);
      } else {
        // Prologue: the packed weights of stages 0 .. W_AHEAD - 1 into the register ring, x of stages
        // 0 .. X_AHEAD - 1 (one cp.async group each), stage 0's W tile dequantized, its ring slot refilled with
        // stage W_AHEAD.
        uint4 wr[W_AHEAD];
        uint32_t sr[W_AHEAD];
#pragma unroll
        for (int d = 0; d < W_AHEAD; ++d)
          if (d < units) {
            wr[d] = load_w(wp, d);
            sr[d] = load_scale(sp, d);
          }
#pragma unroll
        for (int a = 0; a < X_AHEAD; ++a) {
          if (a < units) load_x(smem_base + a * STAGE + STAGE - X_TILE, a);
          ddtree::cp_async_commit();
        }
        dequant_store(smem_base, wr[0], sr[0], wrow, t);
        if (W_AHEAD < units) {
          wr[0] = load_w(wp, W_AHEAD);
          sr[0] = load_scale(sp, W_AHEAD);
        }
        ddtree::cp_async_wait<X_AHEAD - 1>();   // x of stage 0 (later stages' may still be in flight)
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // st.shared / cp.async -> wgmma
        __syncthreads();

        // Stage u: wgmma on buffer u % BUFFERS while x of stage u + X_AHEAD loads into buffer (u + X_AHEAD) %
        // BUFFERS (its last reader, stage u - 1's wgmma with PIPE 1, retired before the barrier that ended stage
        // u - 1) and W of stage u + 1 is dequantized into buffer (u + 1) % BUFFERS from ring slot (u + 1) %
        // W_AHEAD, which then takes stage u + 1 + W_AHEAD. Unrolled by W_AHEAD so the ring index is a constant.
        for (int u0 = 0; u0 < units; u0 += W_AHEAD) {
#pragma unroll
          for (int d = 0; d < W_AHEAD; ++d) {
            const int u = u0 + d;
            if (u >= units) break;
            const uint32_t cur = smem_base + (u % BUFFERS) * STAGE, nxt = smem_base + ((u + 1) % BUFFERS) * STAGE;
            cute::warpgroup_arrive();
            const uint64_t da = sw128_desc(cur + wg * 64 * 128), db = sw128_desc(cur + W_TILE);
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
              ddtree::gmma_ss<O>(da + 2 * kk, db + 2 * kk, acc,
                      u == 0 && kk == 0 ? cute::SM90::GMMA::ScaleOut::Zero : cute::SM90::GMMA::ScaleOut::One,
                      cuda::std::make_integer_sequence<int, ACC>{});
            cute::warpgroup_commit_batch();
            if (u + X_AHEAD < units) load_x(smem_base + ((u + X_AHEAD) % BUFFERS) * STAGE + W_TILE, u + X_AHEAD);
            ddtree::cp_async_commit();   // one group per stage, empty at the tail, so the wait count below holds
            if (u + 1 < units) {
              // stage u + 1's ring slot (u0 is a multiple of W_AHEAD): a constant once unrolled
              const int ring = (d + 1) % W_AHEAD;
              dequant_store(nxt, wr[ring], sr[ring], wrow, t);
              if (u + 1 + W_AHEAD < units) {
                wr[ring] = load_w(wp, u + 1 + W_AHEAD);
                sr[ring] = load_scale(sp, u + 1 + W_AHEAD);
              }
            }
            cute::warpgroup_wait<0>();
#pragma unroll
            for (int i = 0; i < ACC; ++i) cute::warpgroup_fence_operand(acc[i]);
            ddtree::cp_async_wait<X_AHEAD - 1>();   // x of stage u + 1 has landed; later stages' may be in flight
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            __syncthreads();   // stage u + 1 complete; every warpgroup done with stage u
          }
        }
      }
      const long long epilogue_t0 = ddtree::trace_stall_begin<ddtree::kStallRaEpilogue>();
      ddtree::cp_async_wait<0>();

      // Epilogue: acc[4j + 2i + b] = W row 16 (warp % 4) + g + 8i of the warpgroup's 64, token 8j + 2t + b.
      const int r_wg = (warp & 3) * 16 + g;
      auto for_each_output = [&](auto&& f) {   // f(token of the chunk, row of the warpgroup's 64, value)
#pragma unroll
        for (int j = 0; j < TN / 8; ++j)
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            const int tok = 8 * j + 2 * t + b;
            if (c0 + tok >= count) continue;
#pragma unroll
            for (int i = 0; i < 2; ++i)
              f(tok, r_wg + 8 * i, SLOT ? ddtree::DEQUANT_UNDO * acc[4 * j + 2 * i + b] : acc[4 * j + 2 * i + b]);
          }
      };
      // The bf16 outputs go through shared memory (over the stage buffers: every warpgroup's last wgmma must have
      // retired, hence the barrier) and leave as 16-byte row pieces: one 2-byte store per output scattered 8 rows
      // x 16 bytes per warp instruction, with its address arithmetic, was ~5 instructions per output.
      __syncthreads();
      const int rows = min(TN, count - c0);
      if constexpr (MODE == 0) {   // warpgroup 1's up sums meet warpgroup 0's gate sums in shared memory
        constexpr int LD = 64 + 4, HLD = 64 + 8;   // up as float [TN][LD], then h as bf16 [TN][HLD]
        __nv_bfloat16* const hs = reinterpret_cast<__nv_bfloat16*>(stg + TN * LD);
        if (wg == 1) for_each_output([&](int tok, int r, float up) { stg[tok * LD + r] = up; });
        __syncthreads();
        if (wg == 0)
          for_each_output([&](int tok, int r, float gate) {
            // (SLOT: h in slot order, for the MODE 1 twin; the block's 64 columns are one unit of its K)
            hs[tok * HLD + (SLOT ? moe90::slot_of_column(r) : r)] =
                __float2bfloat16_rn(ddtree::silu(gate) * stg[tok * LD + r]);
          });
        __syncthreads();
        if constexpr ((DDTREE_WS_PROBE & kProbeRaNoStore) == 0 || !RA)
          moe90::store_rows<64, HLD>(hs, reinterpret_cast<__nv_bfloat16*>(out) + (long long)(offset + c0) * n_rows +
                                   blockIdx.x * 64, n_rows, rows, tid);
      } else {
        constexpr int HLD = 128 + 8;
        __nv_bfloat16* const hs = reinterpret_cast<__nv_bfloat16*>(stg);
        for_each_output([&](int tok, int r, float v) { hs[tok * HLD + wg * 64 + r] = __float2bfloat16_rn(v); });
        __syncthreads();
        if constexpr ((DDTREE_WS_PROBE & kProbeRaNoStore) == 0 || !RA)
          moe90::store_rows<128, HLD>(hs, reinterpret_cast<__nv_bfloat16*>(out) + (long long)(offset + c0) * n_rows +
                                    blockIdx.x * 128, n_rows, rows, tid);
      }
      __syncthreads();   // the staging (stage buffers) is free again for the next chunk
      ddtree::trace_stall_end<ddtree::kStallRaEpilogue>(epilogue_t0);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Warp-specialized variant (moe_gmma_ws_kernel): the RA / SS kernels above issue the dequantization and the
// wgmma from the same 8 warps, and ncu shows them bound by those warps' own instruction latency (0.3 issued per
// scheduler per cycle, 1 or 2 warps each), not by the tensor cores. Here warpgroup 0 only dequantizes: each
// warp two 16-row blocks of the 128-row W tile per 64-k stage into a ring of WS_STAGES shared buffers (full /
// empty mbarriers per buffer); warpgroups 1 and 2 only load x and issue wgmma, each for half of the chunk's TN
// tokens against all 128 rows (two m64 wgmmas per k16: MODE 0 gate and up rows, so SiLU(gate) * up is formed in
// registers; MODE 1 down rows 0-63 and 64-127). Each consumer warpgroup keeps its own x ring (4 buffers, 2 stages
// ahead, a 128-thread named barrier per stage) and one wgmma batch in flight.
namespace moe90 {
constexpr int WS_THREADS = 384, WS_STAGES = 4, WS_XBUF = 4, WS_XAHEAD = 2, WS_WAHEAD = 8;
// Registers after setmaxnreg: the CTA's pool is what it launched with (168 per thread at 384 threads, the
// launch bound), and setmaxnreg.inc waits until the pool has them, so the two sides must fit it exactly or
// the consumers wait forever (96 / 208 did: 9216 freed, 10240 asked).
constexpr int WS_PRODUCER_REGS = 120, WS_CONSUMER_REGS = 192;
static_assert(128 * WS_PRODUCER_REGS + 256 * WS_CONSUMER_REGS <= WS_THREADS * 168, "register pool");

using ddtree::mbar_arrive;
using ddtree::mbar_init;
using ddtree::mbar_wait;
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// moe_gmma_ws_kernel's wait on its W ring's mbarrier, the cycles counted as the warp's stall in traced builds.
__device__ __forceinline__ void ring_wait(uint32_t bar, uint32_t parity) {
  const long long t0 = ddtree::trace_stall_begin<ddtree::kStallRing>();
  mbar_wait(bar, parity);
  ddtree::trace_stall_end<ddtree::kStallRing>(t0);
}
}  // namespace moe90

// Grid as moe_gmma_kernel; block 384; dynamic smem moe_gmma_smem_bytes (runtime/kimi_kernels.py) = 1024 +
// WS_STAGES * 16384 (W) + 2 * WS_XBUF * (TN / 2) * 128 (x) + 2 * WS_STAGES * 8 (barriers).
// NSTEP 0: every wgmma is N = TN / 2 (a half's padding tokens computed too); NSTEP 16: N is the half's token
// count rounded up to 16 (one stage loop per N, dispatch_n), so a 133-token expert in a 256-token tile costs
// 128 + 16 token columns, not 256.
template <int MODE, int TN, int NSTEP>
__global__ void __launch_bounds__(moe90::WS_THREADS, 1)
moe_gmma_ws_kernel(const uint16_t* __restrict__ x, int ldx, const uint4* __restrict__ wq0,
                   const uint4* __restrict__ ws0, const uint4* __restrict__ wq1, const uint4* __restrict__ ws1,
                   int n_rows, int k, const int* __restrict__ slot_expert, const int* __restrict__ slot_offset,
                   const int* __restrict__ slot_count, const int* __restrict__ sorted_token, void* __restrict__ out,
                   int min_count, int max_count, const int* __restrict__ item_slot,
                   const int* __restrict__ item_chunk) {
  DDTREE_TRACE_WARP(MODE == 0 ? ddtree::kTraceMoeGmmaWsGateUp : ddtree::kTraceMoeGmmaWsDown);
  using namespace moe90;
  static_assert(TN == 128 || TN == 256, "token tile: two consumer halves of 64 / 128");
  static_assert(NSTEP == 0 || NSTEP == 16, "N step");
  constexpr int HN = TN / 2, ACC = HN / 2, X_TILE = HN * 128;
  const int slot = item_slot != nullptr ? item_slot[blockIdx.y] : blockIdx.y;
  const int expert = slot_expert[slot], count = slot_count[slot], offset = slot_offset[slot];
  if (expert < 0 || count < min_count || count >= max_count) return;   // another kernel's slot
  const int c_begin = item_slot != nullptr ? item_chunk[blockIdx.y] * TN : 0;
  const int c_end = item_slot != nullptr ? min(count, c_begin + TN) : count;
  const int units = k / 64;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t smem_base = (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) + 1023u) & ~1023u;
  const uint32_t w_ring = smem_base, x_ring = smem_base + WS_STAGES * W_TILE;
  const uint32_t bars = x_ring + 2 * WS_XBUF * X_TILE;   // full[WS_STAGES], then empty[WS_STAGES]
  const int tid = threadIdx.x, wg = tid >> 7, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  if (tid == 0) {
    for (int b = 0; b < WS_STAGES; ++b) {
      mbar_init(bars + 8 * b, 128);                    // full: every producer thread, after its stores
      mbar_init(bars + 8 * (WS_STAGES + b), 8);        // empty: lane 0 of each consumer warp
    }
  }
  __syncthreads();

  if (wg == 0) {
    // Producer. Warp w: tile rows 16w .. (row block rb0) and 64 + 16w .. (rb1): MODE 0 the gate and up rows of
    // the block's 64 output rows, MODE 1 down rows.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(WS_PRODUCER_REGS));
    const int row_blocks = n_rows / 16, supers = k / 512;
    const int rb0 = MODE == 0 ? blockIdx.x * 4 + warp : blockIdx.x * 8 + warp;
    const int rb1 = MODE == 0 ? rb0 : rb0 + 4;
    const long long blk0 = (long long)expert * row_blocks + rb0, blk1 = (long long)expert * row_blocks + rb1;
    const uint4* wp0 = wq0 + blk0 * units * 32 + lane;
    const uint4* wp1 = (MODE == 0 ? wq1 : wq0) + blk1 * units * 32 + lane;
    const int soff = (g * 2 + (t >> 1)) * 2;
    const uint4* sp0 = ws0 + blk0 * supers * 32 + soff;
    const uint4* sp1 = (MODE == 0 ? ws1 : ws0) + blk1 * supers * 32 + soff;
    int gs = 0;   // stage counter over all chunks: buffer gs % WS_STAGES, its use number gs / WS_STAGES
    for (int c0 = c_begin; c0 < c_end; c0 += TN) {
      uint4 w0[WS_WAHEAD], w1[WS_WAHEAD];
      uint32_t s0[WS_WAHEAD], s1[WS_WAHEAD];
#pragma unroll
      for (int d = 0; d < WS_WAHEAD; ++d)
        if (d < units) {
          w0[d] = load_w(wp0, d);
          w1[d] = load_w(wp1, d);
          s0[d] = load_scale(sp0, d);
          s1[d] = load_scale(sp1, d);
        }
      for (int u0 = 0; u0 < units; u0 += WS_WAHEAD) {
#pragma unroll
        for (int d = 0; d < WS_WAHEAD; ++d, ++gs) {
          const int u = u0 + d;
          if (u >= units) break;
          const int b = gs % WS_STAGES;
          ring_wait(bars + 8 * (WS_STAGES + b), ((gs / WS_STAGES) & 1) ^ 1);   // the consumers freed buffer b
          const uint32_t tile = w_ring + b * W_TILE;
          const long long t_deq = ddtree::trace_stall_begin<ddtree::kStallDequant>();
          if constexpr ((DDTREE_WS_PROBE & kProbeNoDequant) == 0) {
            dequant_store(tile, w0[d], s0[d], 16 * warp + g, t);
            dequant_store(tile, w1[d], s1[d], 64 + 16 * warp + g, t);
          }
          ddtree::trace_stall_end<ddtree::kStallDequant>(t_deq);
          if (u + WS_WAHEAD < units) {
            w0[d] = load_w(wp0, u + WS_WAHEAD);
            w1[d] = load_w(wp1, u + WS_WAHEAD);
            s0[d] = load_scale(sp0, u + WS_WAHEAD);
            s1[d] = load_scale(sp1, u + WS_WAHEAD);
          }
          const long long t_pub = ddtree::trace_stall_begin<ddtree::kStallPublish>();
          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // st.shared -> the consumers' wgmma
          mbar_arrive(bars + 8 * b);
          ddtree::trace_stall_end<ddtree::kStallPublish>(t_pub);
        }
      }
    }
    return;
  }

  // Consumers: warpgroup cw = wg - 1 takes tokens cw * HN .. + HN - 1 of each chunk.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(WS_CONSUMER_REGS));
  const int cw = wg - 1, ctid = tid - 128 * wg, cwarp = warp & 3;
  const uint32_t my_x = x_ring + cw * WS_XBUF * X_TILE;
  const uint32_t x_off = (ctid / 8) * 128 + (((ctid & 7) ^ ((ctid / 8) & 7)) << 4);   // row ctid / 8 + 16 j
  int gs = 0;
  for (int c0 = c_begin; c0 < c_end; c0 += TN) {
    const int h0 = c0 + cw * HN;   // this warpgroup's first token of the chunk
    const bool idle = h0 >= count;
    const int valid = min(HN, count - h0);   // its tokens in this chunk (NSTEP 16: the wgmma N)
    const uint16_t* xrow[HN / 16];
#pragma unroll
    for (int j = 0; j < HN / 16; ++j) {
      const int i = h0 + ctid / 8 + 16 * j;
      const int row = i >= count ? 0 : MODE == 0 ? sorted_token[offset + i] : offset + i;
      xrow[j] = x + (long long)row * ldx + (ctid & 7) * 8;
    }
    auto load_x = [&](int u) {
      const uint32_t tile = my_x + (u % WS_XBUF) * X_TILE;
      if constexpr ((DDTREE_WS_PROBE & kProbeNoX) == 0) {
#pragma unroll
        for (int j = 0; j < HN / 16; ++j)
          cp_async16_s(tile + x_off + 2048 * j, xrow[j] + u * 64, h0 + ctid / 8 + 16 * j < count);
      }
    };
    float acc0[ACC], acc1[ACC];
#pragma unroll
    for (int i = 0; i < ACC; ++i) {
      acc0[i] = 0.f;
      acc1[i] = 0.f;
    }
    if (idle) {   // no tokens in this half: release every stage the producer fills
      for (int u = 0; u < units; ++u, ++gs) {
        const int b = gs % WS_STAGES;
        ring_wait(bars + 8 * b, (gs / WS_STAGES) & 1);
        if (lane == 0) mbar_arrive(bars + 8 * (WS_STAGES + b));
      }
      continue;
    }
#pragma unroll
    for (int a = 0; a < WS_XAHEAD; ++a) {
      if (a < units) load_x(a);
      ddtree::cp_async_commit();
    }
    // The stage loop for wgmma N (a constant inside: a run-time N chosen per wgmma made ptxas serialize them).
    auto stage_loop = [&](auto n_tokens) {
      constexpr int N = decltype(n_tokens)::value;
      using ON = typename ddtree::GmmaOp<N>::type;
      for (int u = 0; u < units; ++u, ++gs) {
        const int b = gs % WS_STAGES;
        const long long t_x = ddtree::trace_stall_begin<ddtree::kStallXWait>();
        ddtree::cp_async_wait<WS_XAHEAD - 1>();   // this thread's x of stage u
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        ddtree::trace_stall_end<ddtree::kStallXWait>(t_x);
        const long long t_bar = ddtree::trace_stall_begin<ddtree::kStallBarrier>();
        named_barrier(1 + cw, 128);               // the warpgroup's x of stage u; its wgmma of u - 2 retired
        ddtree::trace_stall_end<ddtree::kStallBarrier>(t_bar);
        ring_wait(bars + 8 * b, (gs / WS_STAGES) & 1);   // W of stage u
        const uint32_t wt = w_ring + b * W_TILE;
        const uint64_t da0 = sw128_desc(wt), da1 = sw128_desc(wt + 64 * 128);
        const uint64_t db = sw128_desc(my_x + (u % WS_XBUF) * X_TILE);
#pragma unroll
        for (int i = 0; i < ACC; ++i) {
          cute::warpgroup_fence_operand(acc0[i]);
          cute::warpgroup_fence_operand(acc1[i]);
        }
        if constexpr ((DDTREE_WS_PROBE & kProbeNoMma) == 0) {
          cute::warpgroup_arrive();
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) {
            ddtree::gmma_ss<ON>(da0 + 2 * kk, db + 2 * kk, acc0, cute::SM90::GMMA::ScaleOut::One,
                                cuda::std::make_integer_sequence<int, N / 2>{});
            ddtree::gmma_ss<ON>(da1 + 2 * kk, db + 2 * kk, acc1, cute::SM90::GMMA::ScaleOut::One,
                                cuda::std::make_integer_sequence<int, N / 2>{});
          }
        }
        cute::warpgroup_commit_batch();
        if (u + WS_XAHEAD < units) load_x(u + WS_XAHEAD);   // buffer of stage u - 2, retired (see the barrier)
        ddtree::cp_async_commit();
        const long long t_mma = ddtree::trace_stall_begin<ddtree::kStallMmaWait>();
        cute::warpgroup_wait<1>();   // stage u - 1's wgmma retired: its W buffer goes back to the producer
        ddtree::trace_stall_end<ddtree::kStallMmaWait>(t_mma);
#pragma unroll
        for (int i = 0; i < ACC; ++i) {
          cute::warpgroup_fence_operand(acc0[i]);
          cute::warpgroup_fence_operand(acc1[i]);
        }
        if (u > 0 && lane == 0) mbar_arrive(bars + 8 * (WS_STAGES + (gs - 1) % WS_STAGES));
      }
      cute::warpgroup_wait<0>();
#pragma unroll
      for (int i = 0; i < ACC; ++i) {
        cute::warpgroup_fence_operand(acc0[i]);
        cute::warpgroup_fence_operand(acc1[i]);
      }
    };
    if constexpr (NSTEP == 0) {
      stage_loop(cuda::std::integral_constant<int, HN>{});
    } else {
      dispatch_n<16, HN>((valid + 15) / 16, stage_loop);
    }
    if (lane == 0) mbar_arrive(bars + 8 * (WS_STAGES + (gs - 1) % WS_STAGES));
    ddtree::cp_async_wait<0>();
    named_barrier(1 + cw, 128);   // every warp done reading this chunk's x before the next chunk's loads

    // Epilogue: acc[4j + 2i + b] = row 16 cwarp + g + 8i of the m64 tile, token 8j + 2t + b of the half. (Staging
    // the outputs through the x ring for 16-byte stores, as moe_gmma_kernel does, measured no faster here.)
    const int r = cwarp * 16 + g;
#pragma unroll
    for (int j = 0; j < HN / 8; ++j)
#pragma unroll
      for (int bb = 0; bb < 2; ++bb) {
        const int tok = h0 + 8 * j + 2 * t + bb;
        if (tok >= count) continue;
        const long long orow = (long long)(offset + tok) * n_rows;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int a = 4 * j + 2 * i + bb;
          if constexpr (MODE == 0) {
            reinterpret_cast<__nv_bfloat16*>(out)[orow + blockIdx.x * 64 + r + 8 * i] =
                __float2bfloat16_rn(ddtree::silu(acc0[a]) * acc1[a]);
          } else {
            __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(out) + orow + blockIdx.x * 128 + r + 8 * i;
            o[0] = __float2bfloat16_rn(acc0[a]);
            o[64] = __float2bfloat16_rn(acc1[a]);
          }
        }
      }
  }
}

// cold_count[s] = slot_count[s] when below min_count (the mma.sync kernel's slots), else 0 (this file's).
extern "C" __global__ void moe_slot_split_kernel(const int* __restrict__ slot_count, int* __restrict__ cold_count,
                                                 int slots, int min_count) {
  DDTREE_TRACE_WARP(ddtree::kTraceMoeSlotSplit);
  for (int s = blockIdx.x * blockDim.x + threadIdx.x; s < slots; s += gridDim.x * blockDim.x) {
    const int c = slot_count[s];
    cold_count[s] = c < min_count ? c : 0;
  }
}

// PIPE 6's copy of the layer input in slot order: y[row, 64 u + c] = x[row, 64 u + x_slot_source(c)], moved
// as bf16 pairs (slots and sources are pair-aligned). pairs = cols / 2 per row, cols % 64 == 0.
extern "C" __global__ void moe_x_slot_kernel(const uint32_t* __restrict__ x, uint32_t* __restrict__ y, int pairs,
                                             long long total) {
  DDTREE_TRACE_WARP(ddtree::kTraceMoeXSlot);
  const long long step = (long long)gridDim.x * blockDim.x;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += step) {
    const long long row = i / pairs;
    const int p = (int)(i - row * pairs), base = p & ~31, c = 2 * (p & 31);
    y[i] = x[row * pairs + base + moe90::x_slot_source(c) / 2];
  }
}
