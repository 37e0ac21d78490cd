// INT4 (W4A16) grouped MoE GEMMs for Kimi K2.x: gate+up fused with SiLU(gate)*up, down, weighted combine.
//
// Design (decode/verify sizes: a few tokens per expert, so the kernels stream weights):
// * Tensor cores with swapped operands: the weight rows are the MMA's M (16 rows per m16n8k16 atom), the
//   tokens of one expert its N (8 per tile). One warp owns RB row blocks of 16 rows and a K range.
// * Weights are repacked once (runtime/kimi_kernels.py: repack_int4_experts) so that one 16-byte load per
//   lane is exactly that lane's A fragments for 4 k16 steps of one 16-row block: a warp reads 512
//   contiguous bytes per (row block, 64-wide K unit). Inside each 64-wide unit the K order is permuted
//   (same permutation for weights and activations, so the dot product is unchanged): lane (g, t) then
//   needs activation columns 16t..16t+15 of the unit, two plain 16-byte loads from a row-major bf16 row.
// * int4 -> bf16 without conversions: lop3 puts a nibble into the low mantissa bits of 128.0 (bf16 0x4300),
//   one bf16x2 subtract of 136 gives the exact value q-8, one bf16x2 multiply applies the group scale.
// * Scales (one bf16 per 16 rows x 32 K) are laid out per 512-wide K superblock so a lane pair reads its
//   16 scales with 16-byte loads and no byte is stored twice.
// * Launch shape is fixed per token bucket: blockIdx.y walks "slots" (the routing kernel's list of active
//   experts, longest first); empty slots exit at once.
// * Combine: either moe_combine_kernel, or (y != nullptr) folded into the down GEMM: the last block of each
//   column tile (atomic ticket over the slots, reset by that block for the next replay) sums the weighted
//   expert outputs of every token over the tile's columns in pick order j = 0..topk-1, the same fixed order
//   and the same arithmetic as moe_combine_kernel (same bits, whichever block comes last).
// * Programmatic dependent launch (family registered pdl=True): gate_up waits for the previous kernel
//   (routing) before reading anything; down with early != 0 reads its slot (expert, offset, count) through
//   L2 and fills its weight ring / register prefetch BEFORE the wait, then waits before touching h or
//   writing. That read of routing output before the wait is safe because routing is two launches back:
//   down is let in only when every gate_up block has run launch_dependents, which each does after its own
//   grid_dependency_wait returned, i.e. after routing completed and its writes were flushed (to L2, which
//   __ldcg reads). Every kernel here calls launch_dependents only after its own wait, keeping that chain.
//   With signals (block-level hand-offs, below) down's blocks trigger after their counter wait, or at once for an
//   empty slot: the chain holds, since down itself launches only after routing completed.
#include <cuda_bf16.h>
#include <cuda/std/type_traits>
#include <cute/arch/mma_sm80.hpp>
#include "device_common.cuh"
#include "int4_dequant.cuh"

namespace moe_int4 {

// Weight stream: skip L1 (read once), ask L2 for 256-byte lines (the warp reads 512 contiguous bytes).
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// Activations and scales: small, reused by the other warps of the block, so keep them in L1.
__device__ __forceinline__ uint4 ld_cached(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

using ddtree::DEQUANT_UNDO;

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(c[0], c[1], c[2], c[3], a[0], a[1], a[2], a[3], b0, b1,
                                            c[0], c[1], c[2], c[3]);
}

// Wait for the previous kernel, then let the next one launch (see the header: this order is what makes the
// down GEMM's early read of the routing output safe).
__device__ __forceinline__ void dependency_wait() {
  ddtree::grid_dependency_wait();
  ddtree::launch_dependents();
}

constexpr int kUnit = 64;        // K columns per 16-byte lane load
constexpr int kSuper = 512;      // K columns per scale superblock
constexpr int kStep = 4;         // K units per pipeline step (one 16-byte scale load per row block)

// The lane's activation fragments of token tile n, unit u (columns 16t..16t+15 of the permuted unit) from
// the rows in global memory: xrow[n] = token g of tile n, or nullptr for padding (zeros; PAD_ZERO false:
// padding tokens point at a real row, whose outputs are never stored).
template <int NT, bool PAD_ZERO>
struct XFromGlobal {
  const uint4* const (&xrow)[NT];
  int t;
  __device__ __forceinline__ void operator()(int n, int u, uint4 (&xa)[2]) const {
    if (!PAD_ZERO || xrow[n] != nullptr) {
      const uint4* p = xrow[n] + u * (kUnit / 8) + t * 2;
      xa[0] = ld_cached(p);
      xa[1] = ld_cached(p + 1);
    } else {
      xa[0] = make_uint4(0, 0, 0, 0);
      xa[1] = make_uint4(0, 0, 0, 0);
    }
  }
};

// The same fragments from the chunk's activations staged in shared memory (XS variants, stage_x_piece), u
// counted from the staged piece's first unit: row r = 8n + g holds row_chunks 16-byte chunks, chunk c stored
// at c ^ (r & 1) so that the two tokens g, g + 1 a quarter warp reads land in different banks. Padding rows
// hold stale values; their outputs are never stored.
// Chunk c = u * 8 + 2t is even and r & 1 = g & 1 for every n, so c ^ (r & 1) = c + (g & 1) and (c + 1) ^ (r & 1) =
// c + 1 - (g & 1): two per-lane pointers, and the unit and tile as plain offsets (immediates in the unrolled loop).
struct XFromShared {
  const uint4* lo;   // token tile 0, unit 0: the lane's first chunk
  const uint4* hi;   // its second chunk
  int tile_chunks;   // 8 rows: the next token tile
  __device__ __forceinline__ XFromShared(const uint4* xs, int row_chunks, int g, int t)
      : lo(xs + g * row_chunks + 2 * t + (g & 1)), hi(xs + g * row_chunks + 2 * t + 1 - (g & 1)),
        tile_chunks(8 * row_chunks) {}
  __device__ __forceinline__ void operator()(int n, int u, uint4 (&xa)[2]) const {
    const int c = n * tile_chunks + u * (kUnit / 8);
    xa[0] = lo[c];
    xa[1] = hi[c];
  }
};

// One 64-wide K unit u of RB row blocks x NT token tiles: fetch the lane's activation fragments (x_of), then
// per row block j dequantize its 16 weight bytes w_of(j) with scale word uu of sc[j] and multiply them in.
template <int RB, int NT, class WeightOf, class XOf>
__device__ __forceinline__ void unit_mma(float (&acc)[RB][NT][4], WeightOf w_of, const uint4 (&sc)[RB], int uu,
                                         const XOf& x_of, int u) {
  uint4 xa[NT][2];
#pragma unroll
  for (int n = 0; n < NT; ++n) x_of(n, u, xa[n]);
#pragma unroll
  for (int j = 0; j < RB; ++j) {
    const uint4 w = w_of(j);
    const ddtree::DequantScales ds = ddtree::dequant_scales(word_of(sc[j], uu));   // scale rows g, g + 8
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      uint32_t a[4];
      ddtree::dequant_word(word_of(w, s), ds, a);   // the weights times 2^-3 (int4_dequant.cuh)
#pragma unroll
      for (int n = 0; n < NT; ++n)
        mma_bf16(acc[j][n], a, word_of(xa[n][s >> 1], 2 * (s & 1)), word_of(xa[n][s >> 1], 2 * (s & 1) + 1));
    }
  }
}

// Row block j's 16-byte weight and scale loads of the step of units u .. u + kStep - 1 (u >= 0, a multiple of
// kStep): one 64-bit address per row block, the units as immediate offsets from it, and unsigned index arithmetic.
// Written as (u + uu) * 32 on a signed int, each load had its own sign-extended 64-bit address (~50 integer
// instructions per step in sm_90a SASS).
__device__ __forceinline__ const uint4* step_weights(const uint4* wp, int u) { return wp + (unsigned)u * 32u; }
__device__ __forceinline__ const uint4* step_scales(const uint4* sp, int u) {
  const unsigned uu = (unsigned)u;
  return sp + (uu / 8u) * 32u + ((uu / 4u) & 1u);
}

// The register pipeline's loads of one step (4 units from un on): each row block's weights and scale word.
template <int RB>
__device__ __forceinline__ void load_weight_step(uint4 (&w)[kStep][RB], uint4 (&sc)[RB], const uint4* const (&wp)[RB],
                                                 const uint4* const (&sp)[RB], int un) {
#pragma unroll
  for (int j = 0; j < RB; ++j) {
    const uint4* ws = step_weights(wp[j], un);
#pragma unroll
    for (int uu = 0; uu < kStep; ++uu) w[uu][j] = ld_stream(ws + uu * 32);
    sc[j] = ld_cached(step_scales(sp[j], un));
  }
}

// Per-warp work for NT token tiles (8 tokens each): accumulate RB row blocks over K units [u0, u1).
// x_of: the lane's activation fragments (XFromGlobal / XFromShared).
template <int RB, int NT, class XOf>
__device__ __forceinline__ void warp_gemm(float (&acc)[RB][NT][4], const uint4* const (&wp)[RB],
                                          const uint4* const (&sp)[RB], const XOf& x_of,
                                          int u0, int u1, bool dep_wait) {
  ddtree::zero_fragments(acc);
  if (u0 >= u1) {
    if (dep_wait) dependency_wait();
    return;
  }

  // Software pipeline: the weights and scales of step i+1 are in flight while step i computes.
  uint4 wn[kStep][RB], sn[RB];
  load_weight_step(wn, sn, wp, sp, u0);
  if (dep_wait) dependency_wait();   // the first weights are in flight; activations only after the wait
  for (int u = u0; u < u1; u += kStep) {
    uint4 wc[kStep][RB], sc[RB];
#pragma unroll
    for (int j = 0; j < RB; ++j) {
      sc[j] = sn[j];
#pragma unroll
      for (int uu = 0; uu < kStep; ++uu) wc[uu][j] = wn[uu][j];
    }
    if (u + kStep < u1) load_weight_step(wn, sn, wp, sp, u + kStep);
#pragma unroll
    for (int uu = 0; uu < kStep; ++uu)
      unit_mma<RB, NT>(acc, [&](int j) { return wc[uu][j]; }, sc, uu, x_of, u + uu);
  }
}

// warp_gemm with D register buffers used in turn (the step loop unrolled by D), so no copy of the prefetched
// weights per step: the copy wc = wn of warp_gemm costs ~40 register moves per step in SASS (sm_90a,
// <0, 2, 4, 1, 1, 0>: 943 instructions per step, issue-bound at T = 1). D - 1 steps are in flight while one is
// computed. STAGES = 1 variants: D = 2; STAGES = -D: D = 3, 4 (more bytes in flight per warp for the small
// grids of T <= 8, at 40 registers per buffer).
// XP > 0 (the XS variants' pieces): stage_x(q) makes piece q of the chunk's activations (row group q / XP, K
// piece q % XP, units / XP units) ready in shared memory: piece 0 once the first weights are in flight (and
// after the dependency wait), before any activation is read, each later piece when the stream reaches it;
// x_of then counts units from the piece's first, plus units / XP for odd q (the second buffer).
// RG > 1 (row groups): [u0, u1) spans RG groups of groups.units K units; group r reads the weights and scales
// r * groups.w_stride / s_stride further on, and its sums go to group_end(acc, r) before they restart, except
// the last group's, which stay in acc. One unbroken weight stream per warp over RG row groups: the pipeline's
// fill and drain are paid once, not per group.
struct RowGroups {
  int units;
  long long w_stride, s_stride;
};
template <int RB, int NT, int RG, int XP, int D, class XOf, class StageX, class GroupEnd>
__device__ __forceinline__ void warp_gemm_pingpong(float (&acc)[RB][NT][4], const uint4* const (&wp)[RB],
                                                   const uint4* const (&sp)[RB], const XOf& x_of,
                                                   int u0, int u1, bool dep_wait, StageX stage_x,
                                                   const RowGroups& groups, GroupEnd group_end) {
  ddtree::zero_fragments(acc);
  if (u0 >= u1) {
    if (dep_wait) dependency_wait();
    return;
  }
  static_assert(D >= 2, "at least two register buffers");
  auto load_step = [&](uint4 (&w)[kStep][RB], uint4 (&sc)[RB], int u) {
    if constexpr (RG == 1) {
      load_weight_step(w, sc, wp, sp, u);
    } else {
      const int r = u / groups.units;
      const uint4* wq[RB];
      const uint4* sq[RB];
#pragma unroll
      for (int j = 0; j < RB; ++j) {
        wq[j] = wp[j] + r * groups.w_stride;
        sq[j] = sp[j] + r * groups.s_stride;
      }
      load_weight_step(w, sc, wq, sq, u - r * groups.units);
    }
  };
  auto compute_step = [&](const uint4 (&w)[kStep][RB], const uint4 (&sc)[RB], int u) {
    const int r = RG == 1 ? 0 : u / groups.units, ul = u - r * groups.units;
    int ux = ul;   // the unit as x_of counts it
    if constexpr (XP > 1) {   // (one piece, XP 1, stays for every row group)
      const int piece_units = groups.units / XP, p = ul / piece_units, q = r * XP + p;
      ux = ul - p * piece_units;
      if (ux == 0 && u != u0) stage_x(q);
      ux += (q & 1) * piece_units;   // piece q's buffer
    }
#pragma unroll
    for (int uu = 0; uu < kStep; ++uu) {
      unit_mma<RB, NT>(acc, [&](int j) { return w[uu][j]; }, sc, uu, x_of, ux + uu);
    }
    if (RG > 1 && ul + kStep == groups.units && u + kStep < u1) {
      group_end(acc, r);
      ddtree::zero_fragments(acc);
    }
  };
  if constexpr (D == 2) {   // the measured two-buffer loop as it was written (the general one compiles differently)
    uint4 wa[kStep][RB], sa[RB], wb[kStep][RB], sb[RB];
    load_step(wa, sa, u0);
    if (dep_wait) dependency_wait();   // the first weights are in flight; activations only after the wait
    if constexpr (XP > 0) stage_x(0);
    for (int u = u0; u < u1; u += 2 * kStep) {
      const bool second = u + kStep < u1;
      if (second) load_step(wb, sb, u + kStep);
      compute_step(wa, sa, u);
      if (!second) break;
      if (u + 2 * kStep < u1) load_step(wa, sa, u + 2 * kStep);
      compute_step(wb, sb, u + kStep);
    }
  } else {
    uint4 w[D][kStep][RB], sc[D][RB];
#pragma unroll
    for (int d = 0; d < D - 1; ++d)
      if (d == 0 || u0 + d * kStep < u1) load_step(w[d], sc[d], u0 + d * kStep);
    if (dep_wait) dependency_wait();
    if constexpr (XP > 0) stage_x(0);
    for (int u = u0; u < u1; u += D * kStep) {
#pragma unroll
      for (int d = 0; d < D; ++d) {   // unrolled: the buffer indices are constants
        const int us = u + d * kStep;
        if (d > 0 && us >= u1) break;
        if (us + (D - 1) * kStep < u1) load_step(w[(d + D - 1) % D], sc[(d + D - 1) % D], us + (D - 1) * kStep);
        compute_step(w[d], sc[d], us);
      }
    }
  }
}

using ddtree::cp_async16;
using ddtree::cp_async_commit;
using ddtree::cp_async_wait;

// warp_gemm with the weight stream going through a per-warp shared-memory ring of S steps (cp.async):
// S-1 steps (4 KB each for RB = 2) stay in flight without holding registers, also while a step is computed.
// Every lane reads back only the 16-byte slots it copied itself, so the lane's own cp.async.wait_group is the
// only synchronisation.
template <int RB, int NT, int S, class XOf>
__device__ __forceinline__ void warp_gemm_async(float (&acc)[RB][NT][4], const uint4* const (&wp)[RB],
                                                const uint4* const (&sp)[RB], const XOf& x_of,
                                                int u0, int u1, int lane, uint4* ring, bool dep_wait) {
  constexpr int PER = kStep * RB + RB;   // 16-byte slots per lane per step: weights, then scales
  ddtree::zero_fragments(acc);
  const int nsteps = (u1 - u0) / kStep;
  auto issue = [&](int i) {
    const int u = u0 + i * kStep;
    uint4* slot = ring + (i % S) * PER * 32 + lane;
#pragma unroll
    for (int j = 0; j < RB; ++j) {
#pragma unroll
      for (int uu = 0; uu < kStep; ++uu) cp_async16(slot + (j * kStep + uu) * 32, wp[j] + (u + uu) * 32);
      cp_async16(slot + (kStep * RB + j) * 32, sp[j] + (u / 8) * 32 + ((u / 4) & 1));
    }
  };
#pragma unroll
  for (int i = 0; i < S - 1; ++i) {
    if (i < nsteps) issue(i);
    cp_async_commit();
  }
  if (dep_wait) dependency_wait();   // S - 1 weight steps in flight; activations only after the wait
  for (int i = 0; i < nsteps; ++i) {
    cp_async_wait<S - 2>();   // (S - 1 + i) groups committed: group i has landed
    // the next step goes in before this one is computed (S - 1 steps in flight during the compute, not S - 2):
    // it overwrites the slot read in step i - 1 (already consumed)
    if (i + S - 1 < nsteps) issue(i + S - 1);
    cp_async_commit();
    const uint4* slot = ring + (i % S) * PER * 32 + lane;
    const int u = u0 + i * kStep;
    uint4 sc[RB];
#pragma unroll
    for (int j = 0; j < RB; ++j) sc[j] = slot[(kStep * RB + j) * 32];
#pragma unroll
    for (int uu = 0; uu < kStep; ++uu)
      unit_mma<RB, NT>(acc, [&](int j) { return slot[(j * kStep + uu) * 32]; }, sc, uu, x_of, u + uu);
  }
  cp_async_wait<0>();
}
}  // namespace moe_int4

namespace moe_int4 {

// XS variants: the chunk's real tokens' activation rows (c0 .. c0 + 8 NT - 1, below count) go into shared
// memory once per block instead of being read by every warp: the activations' L2 traffic (beside the weight
// stream through the same L2) shrinks by the block's warp count. XS = 1: the whole K; XS > 1: XS pieces of
// k / XS, two buffers side by side in each row (XFromShared's row of 2 k / XS), the next piece copied while
// the current one is read.
// issue_x_piece: the cp.async copies of piece `piece` into buffer `buf` (every thread its share, one group).
template <int MODE, int NT, int XS>
__device__ __forceinline__ void issue_x_piece(uint4* xs, const uint16_t* __restrict__ x, int ldx, int k, int c0,
                                              int count, int offset, const int* __restrict__ sorted_token,
                                              int piece, int buf) {
  const int rows = min(8 * NT, count - c0), piece_chunks = k / 8 / XS;
  const int row_chunks = XS > 1 ? 2 * piece_chunks : piece_chunks;
  for (int r = 0; r < rows; ++r) {
    const int row = MODE == 0 ? sorted_token[offset + c0 + r] : offset + c0 + r;
    const uint4* src = reinterpret_cast<const uint4*>(x + (long long)row * ldx) + piece * piece_chunks;
    uint4* dst = xs + r * row_chunks;
    for (int c = threadIdx.x; c < piece_chunks; c += blockDim.x)
      cp_async16(dst + ((buf * piece_chunks + c) ^ (r & 1)), src + c);
  }
  cp_async_commit();
}

// Piece q of the chunk's run of RG x XS pieces (row group q / XS, K piece q % XS, buffer q % 2) ready for
// every warp: q = 0 first waits for every warp to be done with the previous chunk and copies it; later pieces
// were copied one piece ahead. Then the copy of piece q + 1 starts, into the buffer of piece q - 1, which every
// warp is done with (they are all past the barrier, at piece q).
template <int MODE, int NT, int XS, int RG>
__device__ __forceinline__ void stage_x_piece(uint4* xs, const uint16_t* __restrict__ x, int ldx, int k, int c0,
                                              int count, int offset, const int* __restrict__ sorted_token, int q) {
  if (q == 0) {
    __syncthreads();
    issue_x_piece<MODE, NT, XS>(xs, x, ldx, k, c0, count, offset, sorted_token, 0, 0);
  }
  cp_async_wait<0>();
  __syncthreads();
  if (XS > 1 && q + 1 < RG * XS)
    issue_x_piece<MODE, NT, XS>(xs, x, ldx, k, c0, count, offset, sorted_token, (q + 1) % XS, (q + 1) & 1);
}

// One chunk of up to 8*NT tokens of a slot: stream the block's weights once, reduce the KS partial sums in
// shared memory, store (MODE 0: h = SiLU(gate) * up; MODE 1: the expert's output; both bf16).
// XS: the activations come from shared memory (stage_x_piece into xs), else each warp reads them from global.
// FIT (XS, one 8-token tile): the tile holds only x_rows rows (the host's min(8, T)); lanes of the rows past them
// read row 0 (their outputs are never stored).
// RG > 1: the warp's RG row groups (groups: K units per group, pointer strides; rb0 + r * rb_stride is group
// r's first row block) in one weight stream, each group stored as it completes.
template <int MODE, int RB, int WN, int KS, int NT, int S, int XS, int RG, int FIT>
__device__ __forceinline__ void gemm_chunk(const uint16_t* __restrict__ x, int ldx, const uint4* const (&wp)[RB],
                                           const uint4* const (&sp)[RB], int n_rows, int k, int u0, int u1,
                                           int rb0, int c0, int count, int offset,
                                           const int* __restrict__ sorted_token, void* __restrict__ out, float* red,
                                           uint4* ring, uint4* xs, bool dep_wait, const RowGroups& groups,
                                           int rb_stride, int x_rows, const int* wait_counter, int wait_target) {
  constexpr int RBM = MODE == 0 ? RB / 2 : RB;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wn = warp % WN, ks = warp / WN;
  const int g = lane >> 2, t = lane & 3;
  // Lane (g, t) holds rows g and g+8 of each row block for tokens 2t and 2t+1 of each tile.
  auto store = [&](const float (&acc)[RB][NT][4], int rb_first) {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int i = c0 + n * 8 + 2 * t + (c & 1);
        if (i >= count) continue;
        const long long orow = (long long)(offset + i) * n_rows;
#pragma unroll
        for (int j = 0; j < RBM; ++j) {
          const int col = (rb_first + j) * 16 + g + 8 * (c >> 1);
          if (MODE == 0) {
            const float h = ddtree::silu(DEQUANT_UNDO * acc[j][n][c]) * (DEQUANT_UNDO * acc[j + RBM][n][c]);
            reinterpret_cast<__nv_bfloat16*>(out)[orow + col] = __float2bfloat16_rn(h);
          } else {
            reinterpret_cast<__nv_bfloat16*>(out)[orow + col] = __float2bfloat16_rn(DEQUANT_UNDO * acc[j][n][c]);
          }
        }
      }
  };
  auto group_end = [&](const float (&acc)[RB][NT][4], int r) { store(acc, rb0 + r * rb_stride); };
  constexpr bool REG = S == 1 || S < 0;   // the register ring of warp_gemm_pingpong, D buffers
  constexpr int D = S < 0 ? -S : 2;
  static_assert(RG == 1 || (REG && KS == 1), "row groups: the register ring pipeline, whole K per warp");
  float acc[RB][NT][4];
  if constexpr (XS) {
    static_assert(REG && KS == 1, "XS: the register ring pipeline, whole K per warp");
    static_assert(!FIT || NT == 1, "FIT: one 8-token tile");
    const XFromShared x_of{xs, (XS > 1 ? 2 : 1) * (k / 8 / XS), FIT && g >= x_rows ? 0 : g, t};
    // with a counter (signals), the wait is for it, at the same place: before the first activations are staged
    const bool count_wait = dep_wait && wait_counter != nullptr;
    warp_gemm_pingpong<RB, NT, RG, XS, D>(acc, wp, sp, x_of, u0, u1, dep_wait && !count_wait, [&](int q) {
      if (count_wait && q == 0) {
        ddtree::signal_wait(wait_counter, wait_target);
        ddtree::launch_dependents();
      }
      stage_x_piece<MODE, NT, XS, RG>(xs, x, ldx, k, c0, count, offset, sorted_token, q);
    }, groups, group_end);
  } else {
    const uint4* xrow[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const int i = c0 + n * 8 + g;
      const int pos = offset + i;
      const int row = MODE == 0 ? (i < count ? sorted_token[pos] : 0) : pos;
      // register ring: a padding token reads a real row (token 0 / the chunk's first position; its outputs are
      // never stored), so the unit loop needs no null test and no zeroing
      const int pad_row = MODE == 0 ? 0 : offset + c0;
      xrow[n] = i < count ? reinterpret_cast<const uint4*>(x + (long long)row * ldx)
              : REG ? reinterpret_cast<const uint4*>(x + (long long)pad_row * ldx) : nullptr;
    }
    const XFromGlobal<NT, !REG> x_of{xrow, t};
    if constexpr (REG) {
      warp_gemm_pingpong<RB, NT, RG, 0, D>(acc, wp, sp, x_of, u0, u1, dep_wait, [](int) {}, groups, group_end);
    } else if constexpr (S > 1) {
      warp_gemm_async<RB, NT, S>(acc, wp, sp, x_of, u0, u1, lane, ring, dep_wait);
    } else {
      warp_gemm<RB, NT>(acc, wp, sp, x_of, u0, u1, dep_wait);
    }
  }

  if (KS > 1) {
    __syncthreads();   // the previous chunk's readers are done with red[]
    if (ks > 0) {
#pragma unroll
      for (int j = 0; j < RB; ++j)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int c = 0; c < 4; ++c)
            red[((((ks - 1) * WN + wn) * RB + j) * NT * 4 + n * 4 + c) * 32 + lane] = acc[j][n][c];
    }
    __syncthreads();
    if (ks > 0) return;
#pragma unroll
    for (int p = 1; p < KS; ++p)
#pragma unroll
      for (int j = 0; j < RB; ++j)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int c = 0; c < 4; ++c)
            acc[j][n][c] += red[((((p - 1) * WN + wn) * RB + j) * NT * 4 + n * 4 + c) * 32 + lane];
  }
  store(acc, rb0 + (RG - 1) * rb_stride);   // the last (only) group
}

}  // namespace moe_int4

namespace moe_int4 {

// y[tok, col..col+3] = sum_j topk_w[tok, j] * down_out[assign_pos[tok, j], col..] (+ shared), fp32, j in
// order, bf16 out. down_out is bf16: each expert's output rounded once, as a bf16 model's expert MLP returns
// it (and half the bytes of fp32: at T = 256 the fp32 rows, 59 MB, no longer stayed in L2 for this read).
// CG: read down_out through L2 (written by other blocks of the running grid). All topk loads are issued
// before the first add (a loop of dependent L2 round trips cost ~0.6 us per pick).
constexpr int kMaxTopk = 16;
__device__ __forceinline__ float4 bf16x4_to_float4(uint2 b) {
  return make_float4(__uint_as_float(b.x << 16), __uint_as_float(b.x & 0xffff0000u),
                     __uint_as_float(b.y << 16), __uint_as_float(b.y & 0xffff0000u));
}
// Token tok's routing weights and the sorted positions of its picks (through L2 with CG).
template <bool CG>
__device__ __forceinline__ void load_picks(const float* __restrict__ topk_w, const int* __restrict__ assign_pos,
                                           int topk, int tok, float (&w)[kMaxTopk], int (&pos)[kMaxTopk]) {
#pragma unroll
  for (int j = 0; j < kMaxTopk; ++j)
    if (j < topk) {
      w[j] = CG ? __ldcg(topk_w + tok * topk + j) : topk_w[tok * topk + j];
      pos[j] = CG ? __ldcg(assign_pos + tok * topk + j) : assign_pos[tok * topk + j];
    }
}
template <bool CG>
__device__ __forceinline__ void combine4_picks(const uint16_t* __restrict__ down_out, const float (&w)[kMaxTopk],
                                               const int (&pos)[kMaxTopk], const uint16_t* __restrict__ shared,
                                               uint16_t* __restrict__ y, int n, int topk, int tok, int col) {
  uint2 v[kMaxTopk];
#pragma unroll
  for (int j = 0; j < kMaxTopk; ++j)
    if (j < topk) {
      const uint2* src = reinterpret_cast<const uint2*>(down_out + (long long)pos[j] * n + col);
      v[j] = CG ? __ldcg(src) : *src;
    }
  float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int j = 0; j < kMaxTopk; ++j)
    if (j < topk) {
      const float4 e = bf16x4_to_float4(v[j]);
      s.x += w[j] * e.x; s.y += w[j] * e.y; s.z += w[j] * e.z; s.w += w[j] * e.w;
    }
  if (shared != nullptr) {
    const float4 e = bf16x4_to_float4(*reinterpret_cast<const uint2*>(shared + (long long)tok * n + col));
    s.x += e.x; s.y += e.y; s.z += e.z; s.w += e.w;
  }
  __nv_bfloat162 lo = __floats2bfloat162_rn(s.x, s.y), hi = __floats2bfloat162_rn(s.z, s.w);
  uint2 o;
  o.x = *reinterpret_cast<uint32_t*>(&lo);
  o.y = *reinterpret_cast<uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(y + (long long)tok * n + col) = o;
}
template <bool CG>
__device__ __forceinline__ void combine4(const uint16_t* __restrict__ down_out, const float* __restrict__ topk_w,
                                         const int* __restrict__ assign_pos, const uint16_t* __restrict__ shared,
                                         uint16_t* __restrict__ y, int n, int topk, int tok, int col) {
  float w[kMaxTopk];
  int pos[kMaxTopk];
  load_picks<false>(topk_w, assign_pos, topk, tok, w, pos);
  combine4_picks<CG>(down_out, w, pos, shared, y, n, topk, tok, col);
}

}  // namespace moe_int4

// One grouped W4A16 GEMM. MODE 0 (gate_up): X rows gathered through sorted_token, weights wq0/ws0 = gate
// and wq1/ws1 = up, epilogue h = SiLU(gate) * up stored bf16 at the sorted position [P, n_rows].
// MODE 1 (down): X = h (rows at sorted positions), weights wq0/ws0 = down, bf16 output [P, n_rows].
// Block: WN x KS warps; warp (wn, ks) owns RB row blocks (MODE 0: RB/2 of gate and the same RB/2 of up)
// and the ks-th part of K; the KS partial sums meet in shared memory. The slot's tokens go through in
// chunks of 8, 16, 24 or 32 (NT = 1, 2, 3, 4 tiles; at most NTMAX, 3 only where NTMAX is 4), the weights
// streamed once per chunk.
// STAGES = 0: weights prefetched one step ahead in registers; 1: the same with two register buffers in turn
// (no per-step copy); -D: D register buffers in turn (D - 1 steps in flight); STAGES >= 2: through a cp.async
// ring. The register rings (1, -D) are what XS and RG build on. XS > 0 (register ring, KS 1): each chunk's
// activations are staged in dynamic shared memory by the block in XS pieces along K (8 NTMAX x k / XS bf16 at
// a time) instead of read by every warp.
// RG > 1 (register ring, KS 1): the block covers RG row groups of WN x RB row blocks, each warp streaming its RG
// groups back to back (grid.x = rows / (16 RBM WN RG)).
// MODE 1 only: early != 0 starts the weight stream before the dependency wait (header); y != nullptr folds
// the combine in (topk_w, assign_pos [T, topk], shared bf16 [T, n_rows] or null, y bf16 [T, n_rows],
// tickets int [gridDim.x], zero before the first launch). MODE 0 ignores these (pass 0 / null), but T with FIT.
// FIT = 1 (XS, NTMAX 1): the activation tile is min(8, T) rows, not 8: at T = 2 gate_up's 7168-wide rows take
// 28 KB instead of 112, so 4 blocks fit on an SM instead of 2 (T: the layer's tokens, passed in either mode).
// signals != nullptr (XS, and in MODE 1 early): block-level hand-offs instead of whole-grid waits between gate_up,
// down and the combine (ddtree::signal_wait): each gate_up block of a used slot arrives on signals[slot] after
// its stores; each down block of a used slot waits there for signal_target arrivals (gate_up's blocks per slot)
// where it would wait for gate_up's grid, and every down block arrives on signals[gridDim.y] for the combine. The
// routing kernel zeroes them after its own wait (every reader and writer of the previous forward is done then:
// the combine waited for all of down's arrivals, each down block for its slot's gate_up arrivals). gate_up still
// waits for the routing's grid.
// Minimum blocks per SM: 1 for the register rings (room for their buffers); FIT 4 (<= 128 registers at 128 threads:
// what puts T = 2's gate_up in one wave).
template <int MODE, int RB, int WN, int KS, int NTMAX, int STAGES, int XS = 0, int RG = 1, int FIT = 0>
__global__ void __launch_bounds__(32 * WN * KS, FIT ? 4 : STAGES == 1 || STAGES < 0 ? 1 : 0)
moe_w4a16_kernel(const uint16_t* __restrict__ x, int ldx,
                 const uint4* __restrict__ wq0, const uint4* __restrict__ ws0,
                 const uint4* __restrict__ wq1, const uint4* __restrict__ ws1,
                 int n_rows, int k,
                 const int* __restrict__ slot_expert, const int* __restrict__ slot_offset,
                 const int* __restrict__ slot_count, const int* __restrict__ sorted_token,
                 void* __restrict__ out, int early,
                 const float* __restrict__ topk_w, const int* __restrict__ assign_pos,
                 const uint16_t* __restrict__ shared, uint16_t* __restrict__ y, int* __restrict__ tickets,
                 int T, int topk, int* __restrict__ signals, int signal_target) {
  DDTREE_TRACE_WARP(MODE == 0 ? ddtree::kTraceMoeGateUp : ddtree::kTraceMoeDown);
  using namespace moe_int4;
  static_assert(MODE == 1 || RB % 2 == 0, "gate_up pairs gate and up row blocks");
  static_assert(NTMAX == 1 || NTMAX == 2 || NTMAX == 4, "token tiles per chunk: 1, 2 or 4");
  static_assert(!FIT || (XS && NTMAX == 1), "FIT: staged activations (XS), one 8-token tile");
  constexpr int RBM = MODE == 0 ? RB / 2 : RB;   // row blocks per matrix
  const bool pre = MODE == 1 && early != 0;      // read the slot and start the weights before the wait
  if (!pre) dependency_wait();
  const int slot = blockIdx.y;
  const int expert = pre ? __ldcg(slot_expert + slot) : slot_expert[slot];
  const int count = pre ? __ldcg(slot_count + slot) : slot_count[slot];
  const int offset = pre ? __ldcg(slot_offset + slot) : slot_offset[slot];

  if (expert >= 0) {   // routing gives every used slot count >= 1
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wn = warp % WN, ks = warp / WN;
    const int g = lane >> 2, t = lane & 3;
    const int row_blocks = n_rows / 16, units = k / kUnit, supers = k / kSuper;
    const int rb0 = (blockIdx.x * RG * WN + wn) * RBM;   // row group r: rb0 + r * WN * RBM

    const uint4* wp[RB];
    const uint4* sp[RB];
#pragma unroll
    for (int j = 0; j < RB; ++j) {
      const int m = (MODE == 0 && j >= RBM) ? 1 : 0;
      const int rb = rb0 + (j % RBM);
      const long long blk = (long long)expert * row_blocks + rb;
      wp[j] = (m ? wq1 : wq0) + blk * units * 32 + lane;
      sp[j] = (m ? ws1 : ws0) + blk * supers * 32 + (g * 2 + (t >> 1)) * 2;
    }
    // This warp's K range, in whole pipeline steps.
    const int steps = units / kStep;
    const int u0 = (steps * ks / KS) * kStep, u1 = (steps * (ks + 1) / KS) * kStep + (RG - 1) * units;
    const RowGroups groups{units, (long long)WN * RBM * units * 32, (long long)WN * RBM * supers * 32};

    __shared__ float red[KS > 1 ? (KS - 1) * WN * RB * NTMAX * 4 * 32 : 1];
    // STAGES > 1: dynamic shared memory holds each warp's weight ring, STAGES x (4 RB + RB) x 32 x 16 bytes;
    // XS: the activation tile (moe_ring itself).
    extern __shared__ uint4 moe_ring[];
    uint4* ring = moe_ring + warp * (STAGES > 1 ? STAGES : 0) * (kStep * RB + RB) * 32;   // (ring variants only)
    bool wait_first = pre;   // the first chunk waits once its first weights are in flight
    int c0 = 0;
    auto chunk = [&](auto nt) {   // one chunk of 8 nt tokens from c0 on
      constexpr int NT = decltype(nt)::value;
      gemm_chunk<MODE, RB, WN, KS, NT, STAGES, XS, RG, FIT>(x, ldx, wp, sp, n_rows, k, u0, u1, rb0, c0, count,
                                                            offset, sorted_token, out, red, ring, moe_ring,
                                                            wait_first, groups, WN * RBM, min(8, T),
                                                            MODE == 1 && signals ? signals + slot : nullptr,
                                                            signal_target);
      c0 += 8 * NT;
      wait_first = false;
    };
    while (c0 < count) {   // count is uniform over the block: every warp takes the same branches
      const int rem = count - c0;
      if (NTMAX >= 4 && rem > 24) {
        chunk(cuda::std::integral_constant<int, (NTMAX >= 4 ? 4 : 1)>{});
      } else if (NTMAX >= 4 && rem > 16) {   // 17..24 tokens: three tiles, not four (a quarter fewer MMAs)
        chunk(cuda::std::integral_constant<int, (NTMAX >= 4 ? 3 : 1)>{});
      } else if (NTMAX >= 2 && rem > 8) {
        chunk(cuda::std::integral_constant<int, (NTMAX >= 2 ? 2 : 1)>{});
      } else {
        chunk(cuda::std::integral_constant<int, 1>{});
      }
    }
  } else if (pre) {
    if (signals != nullptr) ddtree::launch_dependents();   // (no tickets with signals)
    else dependency_wait();   // an empty slot still waits before it touches the tickets
  }
  if (signals != nullptr) {   // after this block's stores
    if (MODE == 1) ddtree::signal_arrive(signals + gridDim.y);
    else if (expert >= 0) ddtree::signal_arrive(signals + slot);
  }

  if constexpr (MODE == 1) {
    if (y == nullptr) return;
    // Folded combine: the last block of this column tile (over all slots) writes y for its columns.
    __shared__ int last_flag;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last_flag = atomicAdd(tickets + blockIdx.x, 1) == (int)gridDim.y - 1;
    __syncthreads();
    if (!last_flag) return;
    __threadfence();
    constexpr int kCols = 16 * RB * WN * RG, kQuads = kCols / 4;
    const int col0 = blockIdx.x * kCols;
    for (int i = threadIdx.x; i < T * kQuads; i += blockDim.x)
      combine4<true>(reinterpret_cast<const uint16_t*>(out), topk_w, assign_pos, shared, y, n_rows, topk,
                     i / kQuads, col0 + (i % kQuads) * 4);
    if (threadIdx.x == 0) tickets[blockIdx.x] = 0;   // ready for the next launch (graph replay)
  }
}

// y[t] = sum_j weight[t, j] * down_out[assign_pos[t, j]] (+ shared[t]), fp32 sum in a fixed order, bf16 out.
// One block per token, 4 consecutive columns per thread. early != 0: the token's weights and positions are read
// (through L2) before the dependency wait, so only the down_out round trip follows it. They are routing outputs,
// three launches back: the combine is let in only when every down block has run launch_dependents after its own
// wait, i.e. after gate_up, and so the routing, completed (the header's chain).
// signals != nullptr (moe_w4a16_kernel's down counter, its signals[gridDim.y]): wait for signal_target arrivals of
// down's blocks instead of down's grid, then read down_out through L2 (down's other blocks may still be running).
// With a shared output as well, the grid wait follows the counter's: the shared MLP runs on a side stream joined
// before this launch, and where a graph captured with this launch's programmatic attribute makes that join edge
// programmatic too, only griddepcontrol.wait orders its stores before our reads (without it, graph replay once gave
// NaN from poisoned shared rows: H100, docs/PERF.md session 38; the likely cause, not proven). By then every down
// block has arrived, so the wait is for down's last blocks to retire and for the shared MLP.
extern "C" __global__ void moe_combine_kernel(const uint16_t* __restrict__ down_out,
                                              const float* __restrict__ topk_w, const int* __restrict__ assign_pos,
                                              const uint16_t* __restrict__ shared, uint16_t* __restrict__ y, int n,
                                              int topk, int early, const int* __restrict__ signals,
                                              int signal_target) {
  DDTREE_TRACE_WARP(ddtree::kTraceMoeCombine);
  const int tok = blockIdx.x;
  float w[moe_int4::kMaxTopk];
  int pos[moe_int4::kMaxTopk];
  if (early) moe_int4::load_picks<true>(topk_w, assign_pos, topk, tok, w, pos);
  if (signals != nullptr) {
    ddtree::signal_wait(signals, signal_target);
    if (shared != nullptr) ddtree::grid_dependency_wait();
    ddtree::launch_dependents();
  } else {
    moe_int4::dependency_wait();
  }
  if (!early) moe_int4::load_picks<false>(topk_w, assign_pos, topk, tok, w, pos);
  const int col0 = (blockIdx.y * blockDim.x + threadIdx.x) * 4, stride = gridDim.y * blockDim.x * 4;
  if (signals != nullptr) {
    for (int col = col0; col < n; col += stride)
      moe_int4::combine4_picks<true>(down_out, w, pos, shared, y, n, topk, tok, col);
  } else {
    for (int col = col0; col < n; col += stride)
      moe_int4::combine4_picks<false>(down_out, w, pos, shared, y, n, topk, tok, col);
  }
}
