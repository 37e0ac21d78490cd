// Routing pieces shared by moe_routing.cu (the routing kernels) and moe_int4.cu (gate_up / down routing one token
// themselves at T = 1, MoeLayer routing "inline").
#pragma once
#include "device_common.cuh"

namespace moe_route {

constexpr int kMaxExperts = 512, kMaxTopk = 16;

// Each expert's 64-bit key: its choice value mapped to an unsigned integer in the same order (+0 and -0 made equal
// first; -0 cannot arise from sigmoid + bias anyway), over ~e, so a larger key is a larger value or, on a tie, a lower
// index: the order moe_routing.cu's route_token (a warp's argmax rounds) picks in. Experts past E get keys below every
// real one (high word 0), so every key is distinct and every rank a permutation.
__device__ __forceinline__ unsigned long long key(float choice, int e) {
  unsigned u = __float_as_uint(choice + 0.0f);   // -0 + +0 = +0: equal values, equal keys
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ((unsigned long long)u << 32) | (0xffffffffu - (unsigned)e);
}
__device__ __forceinline__ unsigned long long pad_key(int e) { return 0xffffffffull - (unsigned)e; }
__device__ __forceinline__ int key_expert(unsigned long long k) { return (int)(0xffffffffu - (unsigned)k); }

// One token's expert for grouping slot `slot` (T = 1: every pick has count 1, so the slots are the picks by
// increasing expert id), picked by a whole block of NT threads from the token's router logits: the same picks as
// moe_routing.cu's kernels (sigmoid, + correction bias, the topk largest keys; no group limit), found the same way
// (each 32-expert group's topk best by rank, then the candidates ranked). Every thread returns the slot's expert.
// Called by every thread of the block; ends with a barrier. The logits may come from the kernel before the previous
// one (the caller's PDL chain makes them visible): they are read through L2.
struct InlinePick {
  unsigned long long key[kMaxExperts];
  unsigned long long cand[kMaxExperts / 32 * kMaxTopk];
  int pick_e[kMaxTopk];
  int slot_e;
};
template <int NT>
__device__ __forceinline__ int inline_slot_expert(const float* __restrict__ logits, const float* __restrict__ bias,
                                                  int E, int topk, int slot, InlinePick& sm) {
  static_assert(NT % 32 == 0 && kMaxExperts % NT == 0, "whole warps, whole expert rounds");
  constexpr int EPT = kMaxExperts / NT;
  const int tid = threadIdx.x, padded = (E + 31) & ~31;   // experts past E up to a whole group of 32: pad keys
  float logit[EPT], corr[EPT];
#pragma unroll
  for (int i = 0; i < EPT; ++i) {   // every load first
    const int e = tid + i * NT;
    logit[i] = e < E ? __ldcg(logits + e) : 0.f;
    corr[i] = e < E ? __ldg(bias + e) : 0.f;
  }
  unsigned long long mine[EPT];
#pragma unroll
  for (int i = 0; i < EPT; ++i) {
    const int e = tid + i * NT;
    const float score = 1.0f / (1.0f + __expf(-logit[i]));   // the routing kernels' expressions: the same bits
    mine[i] = e < E ? key(score + corr[i], e) : pad_key(e);
    if (e < padded) sm.key[e] = mine[i];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < EPT; ++i) {   // rank among the 32 keys of its group; the topk best are the group's candidates
    const int e = tid + i * NT;
    if (e < padded) {
      const int g0 = e & ~31;
      int rank = 0;
#pragma unroll 8
      for (int j = 0; j < 32; ++j) rank += sm.key[g0 + j] > mine[i];
      if (rank < topk) sm.cand[(e >> 5) * topk + rank] = mine[i];
    }
  }
  __syncthreads();
  const int cands = (padded >> 5) * topk;
  for (int c = tid; c < cands; c += NT) {   // the candidates' ranks: the topk best are the picks
    const unsigned long long ck = sm.cand[c];
    int rank = 0;
    for (int j = 0; j < cands; ++j) rank += sm.cand[j] > ck;
    if (rank < topk) sm.pick_e[rank] = key_expert(ck);
  }
  __syncthreads();
  if (tid < topk) {   // slot order: the picks by increasing expert id
    const int id = sm.pick_e[tid];
    int rank = 0;
    for (int j = 0; j < topk; ++j) rank += sm.pick_e[j] < id;
    if (rank == slot) sm.slot_e = id;
  }
  __syncthreads();
  return sm.slot_e;
}

}  // namespace moe_route
