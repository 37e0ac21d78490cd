// MoE routing for DeepSeek-V3 / Kimi K2.x (noaux_tc), and the grouping of tokens by expert on the GPU.
//
// moe_topk_kernel: one warp per token. scores = sigmoid(logits); choice = scores + e_score_correction_bias;
//   with n_group > 1, keep the topk_group groups whose two best choice values sum highest (others -inf);
//   then the topk best choice values. Ties go to the lower index (group or expert) at every step, the rule
//   the numpy reference uses. Weights = the sigmoid scores of the chosen experts, divided by their sum
//   (+1e-20) when norm_topk_prob, times routed_scaling_factor.
// moe_group_kernel: one block. Counts per expert, expert-major sorted order (offsets by expert id, tokens
//   in increasing order inside an expert: deterministic, from per-expert token bitmaps), the slot list for the
//   grouped GEMMs (active experts, most tokens first so the longest blocks start first; unused slots get expert
//   -1), and for each (token, j) its sorted position for the combine.
// moe_route_kernel: both in one launch: blocks of 32 warps, each warp
//   routes up to 2 tokens (same code as moe_topk_kernel), and the last block to finish (an atomic ticket,
//   reset by that block for the next graph replay) does the grouping (same code as moe_group_kernel). For
//   T <= 64 that is a single block and no ticket. Results are bit-identical to the two-kernel path.
// moe_route_one_kernel: T = 1 only, one warp: the routing, and the grouping's outputs straight from the picks.
// moe_route_blocks_kernel: a block per token, a thread per expert (the ranks at once), the last block groups (the
//   layer's default at T = 1 and 5..64: runtime/kimi_kernels.py ROUTINGS).
// moe_route_batch_kernel: up to 4 tokens in one such block, which also groups them (warp 0; the default at 2..4).
// Everything has a fixed launch shape for a token count, so the MoE layer is graph-capturable.
// Programmatic dependent launch (family registered pdl=True): every entry waits for the previous kernel
// (ddtree::grid_dependency_wait) before its first read of logits / ids and before any write; only the
// correction bias (a weight) may be read before. The next kernel is let in at once (launch_dependents):
// its blocks wait in their own grid_dependency_wait until this grid has finished.
#include "device_common.cuh"

#define MAX_EXPERTS_PER_LANE 16   // experts <= 512
#define MAX_TOPK 16

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
  }
}

// Routes token `tok` (one warp, all 32 lanes): writes topk_ids / topk_w [tok, 0..topk); returns pick `lane`'s
// expert to lanes < topk.
__device__ __forceinline__ int route_token(const float* __restrict__ logits, const float* __restrict__ bias,
                                            int tok, int E, int topk, int n_group, int topk_group,
                                            int norm_topk_prob, float routed_scaling_factor,
                                            int* __restrict__ topk_ids, float* __restrict__ topk_w) {
  const int lane = threadIdx.x & 31;
  const float NEG_INF = __int_as_float(0xff800000);
  float score[MAX_EXPERTS_PER_LANE], choice[MAX_EXPERTS_PER_LANE];   // expert e = lane + 32 * i
  // Every load first, then the arithmetic: written as one loop, the compiler issued each logit and bias load
  // right before its use, 32 dependent global round trips in a row (~11 us for one token, ncu on the H200).
  float logit[MAX_EXPERTS_PER_LANE], corr[MAX_EXPERTS_PER_LANE];
#pragma unroll
  for (int i = 0; i < MAX_EXPERTS_PER_LANE; ++i) {
    const int e = lane + 32 * i;
    logit[i] = e < E ? logits[(long long)tok * E + e] : 0.f;
    corr[i] = e < E ? bias[e] : 0.f;
  }
#pragma unroll
  for (int i = 0; i < MAX_EXPERTS_PER_LANE; ++i) {
    const int e = lane + 32 * i;
    if (e < E) {
      score[i] = 1.0f / (1.0f + __expf(-logit[i]));
      choice[i] = score[i] + corr[i];
    } else {
      score[i] = 0.f;
      choice[i] = NEG_INF;
    }
  }
  if (n_group > 1) {
    // Group score = sum of the group's two best choice values; keep topk_group groups.
    const int gsize = E / n_group;
    unsigned keep = 0;   // bit per group (n_group <= 32)
    float gs = NEG_INF;  // lane < n_group holds group `lane`'s score
    for (int grp = 0; grp < n_group; ++grp) {
      float b1 = NEG_INF, b2 = NEG_INF;
#pragma unroll
      for (int i = 0; i < MAX_EXPERTS_PER_LANE; ++i) {
        const int e = lane + 32 * i;
        if (e < E && e / gsize == grp) {
          const float v = choice[i];
          if (v > b1) { b2 = b1; b1 = v; } else if (v > b2) { b2 = v; }
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {   // merge the per-lane top-2 lists
        const float o1 = __shfl_xor_sync(0xffffffffu, b1, o), o2 = __shfl_xor_sync(0xffffffffu, b2, o);
        const float n1 = fmaxf(b1, o1);
        const float n2 = fmaxf(fminf(b1, o1), fmaxf(b2, o2));
        b1 = n1; b2 = n2;
      }
      if (lane == grp) gs = b1 + b2;
    }
    for (int r = 0; r < topk_group; ++r) {
      float v = lane < n_group ? gs : NEG_INF;
      int i = lane < n_group ? lane : 1 << 30;
      if ((keep >> lane) & 1u) { v = NEG_INF; i = 1 << 30; }
      warp_argmax(v, i);
      keep |= 1u << i;
    }
#pragma unroll
    for (int i = 0; i < MAX_EXPERTS_PER_LANE; ++i) {
      const int e = lane + 32 * i;
      if (e < E && !((keep >> (e / gsize)) & 1u)) choice[i] = NEG_INF;
    }
  }
  int my_id = 0;          // lane j < topk keeps pick j
  float my_w = 0.f, wsum = 0.f;
  for (int r = 0; r < topk; ++r) {
    float v = NEG_INF;
    int idx = 1 << 30;
#pragma unroll
    for (int i = 0; i < MAX_EXPERTS_PER_LANE; ++i) {   // local best; ascending e, so strict > keeps the lowest
      const int e = lane + 32 * i;
      if (e < E && (choice[i] > v || idx == (1 << 30))) { v = choice[i]; idx = e; }
    }
    warp_argmax(v, idx);
    float w = 0.f;
#pragma unroll
    for (int i = 0; i < MAX_EXPERTS_PER_LANE; ++i)
      if (lane + 32 * i == idx) { w = score[i]; choice[i] = NEG_INF; }
    w = __shfl_sync(0xffffffffu, w, idx & 31);
    wsum += w;
    if (lane == r) { my_id = idx; my_w = w; }
  }
  if (lane < topk) {
    const float scale = norm_topk_prob ? routed_scaling_factor / (wsum + 1e-20f) : routed_scaling_factor;
    topk_ids[tok * topk + lane] = my_id;
    topk_w[tok * topk + lane] = my_w * scale;
  }
  return my_id;
}

extern "C" __global__ void moe_topk_kernel(const float* __restrict__ logits, const float* __restrict__ bias,
                                           int T, int E, int topk, int n_group, int topk_group,
                                           int norm_topk_prob, float routed_scaling_factor,
                                           int* __restrict__ topk_ids, float* __restrict__ topk_w) {
  DDTREE_TRACE_WARP(ddtree::kTraceMoeTopk);
  ddtree::grid_dependency_wait();
  ddtree::launch_dependents();
  const int tok = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (tok >= T) return;
  route_token(logits, bias, tok, E, topk, n_group, topk_group, norm_topk_prob, routed_scaling_factor,
              topk_ids, topk_w);
}

// Single block of 1024 threads. Dynamic smem: ids[T*topk], cnt[E], off[E], act[E], act_cnt[E], n_act,
// bits[E][ws], before[E][ws] (ints; ws = ceil(T/32) | 1, odd so that different experts' rows start in different
// banks: an even stride put every expert's word w in one bank, 32-way conflicts, 85 us at T = 1024).
// The sorted position of (t, e) is off[e] + the number of earlier tokens that chose e: a popcount over e's
// token bitmap (a token never picks an expert twice), so positions are deterministic without a serial scan.
// before[e][w] holds the popcount of e's words 0..w-1, so each pair reads two words.
// The grouping, by one whole block (at least E/32 warps; 1024 threads in both kernels). topk_ids is read through L2
// (__ldcg): in moe_route_kernel other blocks of the same grid wrote it.
__device__ __forceinline__ void group_block(const int* __restrict__ topk_ids, int T, int topk, int E, int num_slots,
                                            int* __restrict__ expert_count, int* __restrict__ slot_expert,
                                            int* __restrict__ slot_offset, int* __restrict__ slot_count,
                                            int* __restrict__ sorted_token, int* __restrict__ assign_pos,
                                            int* smem) {
  const int P = T * topk;
  const int words = (T + 31) / 32, ws = words | 1;
  int* ids = smem;
  int* cnt = ids + P;
  int* off = cnt + E;
  int* act = off + E;          // the active experts (count > 0) in increasing id, and their counts
  int* act_cnt = act + E;
  int* n_act = act_cnt + E;
  unsigned* bits = reinterpret_cast<unsigned*>(n_act + 1);
  int* before = n_act + 1 + E * ws;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int a = tid; a < P; a += blockDim.x) ids[a] = __ldcg(topk_ids + a);
  for (int e = tid; e < E; e += blockDim.x) cnt[e] = 0;
  for (int i = tid; i < E * ws; i += blockDim.x) bits[i] = 0u;
  for (int s = tid; s < num_slots; s += blockDim.x) { slot_expert[s] = -1; slot_offset[s] = 0; slot_count[s] = 0; }
  __syncthreads();
  for (int a = tid; a < P; a += blockDim.x) {
    const int e = ids[a], t = a / topk;
    atomicAdd(&cnt[e], 1);
    atomicOr(&bits[e * ws + (t >> 5)], 1u << (t & 31));
  }
  __syncthreads();
  // before[e][w]: one thread per expert runs along its row (ws odd: the 32 rows a warp reads at word w sit in
  // 32 different banks); with one word (T <= 32) it is 0 and is neither written nor read
  for (int x = tid; words > 1 && x < E; x += blockDim.x) {
    int run = 0;
    for (int w = 0; w < words; ++w) {
      before[x * ws + w] = run;
      run += __popc(bits[x * ws + w]);
    }
  }
  // Exclusive prefix sum of the counts over experts and the active list (count > 0, increasing id): one warp
  // per 32-expert chunk scans its chunk, then adds the totals of the chunks before it (E <= 512: <= 16 chunks).
  const int chunks = (E + 31) / 32;
  __shared__ int chunk_sum[16], chunk_act[16];
  int c = 0, incl = 0;
  unsigned mask = 0u;
  const int e = warp * 32 + lane;
  if (warp < chunks) {
    c = e < E ? cnt[e] : 0;
    incl = c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    mask = __ballot_sync(0xffffffffu, c > 0);
    if (lane == 31) { chunk_sum[warp] = incl; chunk_act[warp] = __popc(mask); }
  }
  __syncthreads();
  if (warp < chunks) {
    int carry = 0, active = 0;
    for (int w = 0; w < warp; ++w) { carry += chunk_sum[w]; active += chunk_act[w]; }
    if (e < E) off[e] = carry + incl - c;
    if (c > 0) {
      const int i = active + __popc(mask & ((1u << lane) - 1u));
      act[i] = e;
      act_cnt[i] = c;
    }
    if (warp == chunks - 1 && lane == 0) *n_act = active + chunk_act[warp];
  }
  __syncthreads();
  for (int e = tid; e < E; e += blockDim.x) expert_count[e] = cnt[e];
  // Slot order: more tokens first, then lower expert id. Ranks count only active experts (inactive ones have
  // count 0 and never rank above an active one): 8 x 8 compares for one token instead of 384 x 384.
  const int na = *n_act;
  for (int i = tid; i < na; i += blockDim.x) {
    const int e = act[i], c = act_cnt[i];
    int rank = 0;
    for (int j = 0; j < na; ++j) {
      const int cf = act_cnt[j];
      rank += (cf > c) || (cf == c && j < i);   // act is in increasing id: j < i <=> lower id
    }
    slot_expert[rank] = e;
    slot_offset[rank] = off[e];
    slot_count[rank] = c;
  }
  for (int a = tid; a < P; a += blockDim.x) {
    const int e = ids[a], t = a / topk;
    const int i = e * ws + (t >> 5);
    const int p = off[e] + (words > 1 ? before[i] : 0) + __popc(bits[i] & ((1u << (t & 31)) - 1u));
    sorted_token[p] = t;
    assign_pos[a] = p;
  }
}

extern "C" __global__ void __launch_bounds__(1024)
moe_group_kernel(const int* __restrict__ topk_ids, int T, int topk, int E, int num_slots,
                 int* __restrict__ expert_count, int* __restrict__ slot_expert, int* __restrict__ slot_offset,
                 int* __restrict__ slot_count, int* __restrict__ sorted_token, int* __restrict__ assign_pos) {
  DDTREE_TRACE_WARP(ddtree::kTraceMoeGroup);
  extern __shared__ int smem[];
  ddtree::grid_dependency_wait();
  ddtree::launch_dependents();
  group_block(topk_ids, T, topk, E, num_slots, expert_count, slot_expert, slot_offset, slot_count, sorted_token,
              assign_pos, smem);
}

// Whether this block is the last of the grid's `blocks` to get here (an atomic ticket, reset by that block for the
// next graph replay): every block's global writes before the call are visible to the one that returns true.
// Block-uniform; `last` is the caller's __shared__ int.
__device__ __forceinline__ bool last_block_to_finish(int* __restrict__ ticket, int& last, int blocks) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(ticket, 1) == blocks - 1;
  __syncthreads();
  if (!last) return false;
  __threadfence();
  if (threadIdx.x == 0) *ticket = 0;   // ready for the next launch (graph replay)
  return true;
}

// One token's grouping outputs for its pick p (expert id, rank = its place among the picks by increasing id): with
// one token every picked expert has count 1, so group_block's slot order (more tokens first, then lower id) is the
// picks by increasing id, and a pick's sorted position is its rank. Bit-identical to group_block's outputs; the
// caller has zeroed expert_count before (the picks' ones land after).
__device__ __forceinline__ void group_one_token_pick(int p, int id, int rank, int* __restrict__ expert_count,
                                                     int* __restrict__ slot_expert, int* __restrict__ slot_offset,
                                                     int* __restrict__ slot_count, int* __restrict__ sorted_token,
                                                     int* __restrict__ assign_pos) {
  expert_count[id] = 1;
  slot_expert[rank] = id;
  slot_offset[rank] = rank;
  slot_count[rank] = 1;
  sorted_token[rank] = 0;
  assign_pos[p] = rank;
}

// T = 1 (decode): the routing and moe_group_kernel's outputs from one warp, without the block-wide grouping. With
// one token every picked expert has count 1, so group_block's slot order (more tokens first, then lower id) is
// the picks in increasing expert id, and a pick's sorted position is its expert's rank among the picks:
// bit-identical outputs. num_slots = min(E, topk) = topk: every slot is used. Grid 1, block 32.
extern "C" __global__ void __launch_bounds__(32)
moe_route_one_kernel(const float* __restrict__ logits, const float* __restrict__ bias, int E, int topk,
                     int n_group, int topk_group, int norm_topk_prob, float routed_scaling_factor,
                     int* __restrict__ topk_ids, float* __restrict__ topk_w, int* __restrict__ expert_count,
                     int* __restrict__ slot_expert, int* __restrict__ slot_offset, int* __restrict__ slot_count,
                     int* __restrict__ sorted_token, int* __restrict__ assign_pos) {
  DDTREE_TRACE_WARP(ddtree::kTraceMoeRouteOne);
  ddtree::grid_dependency_wait();
  ddtree::launch_dependents();
  const int lane = threadIdx.x;
  const int my_id = route_token(logits, bias, 0, E, topk, n_group, topk_group, norm_topk_prob,
                                routed_scaling_factor, topk_ids, topk_w);
  int rank = 0;   // picks are distinct experts
  for (int k = 0; k < topk; ++k) rank += __shfl_sync(0xffffffffu, my_id, k) < my_id;
  for (int e = lane; e < E; e += 32) expert_count[e] = 0;
  __syncwarp();   // the zeros land before the picks' ones
  if (lane < topk)
    group_one_token_pick(lane, my_id, rank, expert_count, slot_expert, slot_offset, slot_count, sorted_token,
                         assign_pos);
}

// The block routing: one thread per expert (E <= 512, topk <= 16), every expert's rank from comparisons done at
// once, the same outputs as moe_topk + moe_group bit for bit. route_token (a warp per token) walks its topk picks
// one after another (a 16-wide scan and two five-step shuffle reductions each, after 16 sigmoid divides per lane:
// ~5 us for one token, H100); route_tokens_block routes one token in 2.3 us (H100, traced), or up to NT at once
// with the same barriers.
constexpr int kRouteBlockMaxExperts = 32 * MAX_EXPERTS_PER_LANE;
constexpr int kRouteBatchTokens = 4;   // moe_route_batch_kernel's most tokens (kimi_kernels.ROUTE_BATCH_TOKENS)
template <int NT>   // route_tokens_block's shared memory for up to NT tokens
struct RouteSmem {
  // per token and expert: the choice values (group limit), then the keys, then the candidates' keys
  unsigned long long key[NT][kRouteBlockMaxExperts];
  float score[NT][kRouteBlockMaxExperts];
  float group_sum[NT][32];
  unsigned keep[NT];
  int pick_e[NT == 1 ? MAX_TOPK : 32];   // pick r of token t at t * topk + r
  float pick_w[NT == 1 ? MAX_TOPK : 32];
};
// Each expert gets a 64-bit key: its choice value mapped to an unsigned integer in the same order (+0 and -0 made
// equal first; -0 cannot arise from sigmoid + bias anyway), over ~e, so a larger key is a larger value or, on a
// tie, a lower index: the order route_token's argmax rounds pick in. Experts past E get keys below every real one
// (high word 0), so every key is distinct and every rank a permutation.
__device__ __forceinline__ unsigned long long route_key(float choice, int e) {
  unsigned u = __float_as_uint(choice + 0.0f);   // -0 + +0 = +0: equal values, equal keys
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ((unsigned long long)u << 32) | (0xffffffffu - (unsigned)e);
}
// Routes tokens tok0 .. tok0 + nt - 1 (nt <= NT; NT > 1: nt * topk <= 32) with the whole block (thread e = expert e),
// as route_token does each with a warp:
//   group limit (n_group > 1): thread (t, g) sums token t's group g's two best choice values, then ranks it among
//     the token's groups; the topk_group best sums are kept (ties to the lower group), the others' choices -inf;
//   1: each warp ranks its 32 keys of each token; its topk best become that token's candidates (warps x topk);
//   2: thread (t, c) ranks candidate c among token t's; the topk best are the picks, in pick order (sm.pick_e /
//      pick_w at t * topk + r);
//   3: lane t * topk + r of warp 0 writes pick r of token t: its weight from the scores summed in pick order.
// `corr` is this thread's correction bias (read before the dependency wait by the caller). NaN logits give some
// distinct in-range picks (not the reference's, which has none to give). Ends with a barrier.
template <int NT>
__device__ __forceinline__ void route_tokens_block(const float* __restrict__ logits, float corr, int tok0, int nt,
                                                   int E, int topk, int n_group, int topk_group, int norm_topk_prob,
                                                   float routed_scaling_factor, int* __restrict__ topk_ids,
                                                   float* __restrict__ topk_w, RouteSmem<NT>& sm) {
  if (NT == 1) nt = 1;
  const int e = threadIdx.x, lane = e & 31, warp = e >> 5, warps = blockDim.x >> 5;
  const float NEG_INF = __int_as_float(0xff800000);
  float logit[NT], choice[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t)   // every load first
    logit[t] = t < nt && e < E ? logits[(long long)(tok0 + t) * E + e] : 0.f;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const float score = 1.0f / (1.0f + __expf(-logit[t]));   // route_token's expressions: the same bits
    choice[t] = e < E ? score + corr : NEG_INF;
    sm.score[t][e] = score;
  }
  if (n_group > 1) {
    const int gsize = E / n_group;
    float* choice_s = reinterpret_cast<float*>(&sm.key[0][0]);   // [t][e] at t * kRouteBlockMaxExperts + e
#pragma unroll
    for (int t = 0; t < NT; ++t)
      if (t < nt) choice_s[t * kRouteBlockMaxExperts + e] = choice[t];
    if (e < NT) sm.keep[e] = 0u;
    __syncthreads();
    for (int i = e; i < nt * n_group; i += blockDim.x) {   // item (t, grp)
      const int t = i / n_group, grp = i % n_group;
      float b1 = NEG_INF, b2 = NEG_INF;
      for (int j = grp * gsize; j < (grp + 1) * gsize; ++j) {
        const float v = choice_s[t * kRouteBlockMaxExperts + j];
        if (v > b1) { b2 = b1; b1 = v; } else if (v > b2) { b2 = v; }
      }
      sm.group_sum[t][grp] = b1 + b2;
    }
    __syncthreads();
    for (int i = e; i < nt * n_group; i += blockDim.x) {
      const int t = i / n_group, grp = i % n_group;
      const float gs = sm.group_sum[t][grp];
      int rank = 0;   // groups with a higher sum, or the same sum and a lower index
      for (int h = 0; h < n_group; ++h) {
        const float o = sm.group_sum[t][h];
        rank += o > gs || (o == gs && h < grp);
      }
      if (rank < topk_group) atomicOr(&sm.keep[t], 1u << grp);
    }
    __syncthreads();   // also: every read of choice_s is done before the keys overwrite it
#pragma unroll
    for (int t2 = 0; t2 < NT; ++t2)
      if (t2 < nt && e < E && !((sm.keep[t2] >> (e / gsize)) & 1u)) choice[t2] = NEG_INF;
  }
  unsigned long long key[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    key[t] = e < E ? route_key(choice[t], e) : 0xffffffffull - (unsigned)e;
    if (t < nt) sm.key[t][e] = key[t];
  }
  __syncwarp();
  int wrank[NT];   // rank among this warp's 32 keys of token t
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    wrank[t] = 0;
    if (t < nt) {
#pragma unroll 8
      for (int j = 0; j < 32; ++j) wrank[t] += sm.key[t][(warp << 5) + j] > key[t];
    }
  }
  __syncthreads();   // every warp's reads of sm.key are done: the candidates overwrite its front
#pragma unroll
  for (int t = 0; t < NT; ++t)
    if (t < nt && wrank[t] < topk) sm.key[t][warp * topk + wrank[t]] = key[t];
  __syncthreads();
  const int cands = warps * topk;
  if (e < nt * cands) {   // nt * topk <= 32: nt * cands <= the block
    const int t = e / cands;
    const unsigned long long ck = sm.key[t][e % cands];
    int rank = 0;
    for (int j = 0; j < cands; ++j) rank += sm.key[t][j] > ck;
    if (rank < topk) {
      const int pe = (int)(0xffffffffu - (unsigned)ck);
      sm.pick_e[t * topk + rank] = pe;
      sm.pick_w[t * topk + rank] = sm.score[t][pe];
    }
  }
  __syncthreads();
  if (warp == 0 && lane < nt * topk) {
    const int t0 = lane / topk * topk;
    float wsum = 0.f;
    for (int r = 0; r < topk; ++r) wsum += sm.pick_w[t0 + r];
    const float scale = norm_topk_prob ? routed_scaling_factor / (wsum + 1e-20f) : routed_scaling_factor;
    topk_ids[tok0 * topk + lane] = sm.pick_e[lane];
    topk_w[tok0 * topk + lane] = sm.pick_w[lane] * scale;
  }
}
// The MoE GEMMs' hand-off counters (moe_int4.cu, signals; null: none) zeroed for this forward, after the routing's
// dependency wait: every kernel of the previous forward has finished with them by then.
__device__ __forceinline__ void zero_signals(int* signals, int n) {
  if (signals != nullptr)
    for (int i = threadIdx.x; i < n; i += blockDim.x) signals[i] = 0;
}
// moe_route_blocks_kernel: a block per token (route_tokens_block with one token). With one token the grouping's
// outputs follow from the picks (moe_route_one_kernel's shortcut); with more, the last block to finish (an atomic
// ticket, reset by that block for the next graph replay) runs group_block. Grid T, block 32 * ceil(E / 32), dynamic
// smem as moe_group_kernel (none for T = 1).
extern "C" __global__ void __launch_bounds__(kRouteBlockMaxExperts)
moe_route_blocks_kernel(const float* __restrict__ logits, const float* __restrict__ bias, int T, int E, int topk,
                        int n_group, int topk_group, int norm_topk_prob, float routed_scaling_factor, int num_slots,
                        int* __restrict__ topk_ids, float* __restrict__ topk_w, int* __restrict__ expert_count,
                        int* __restrict__ slot_expert, int* __restrict__ slot_offset, int* __restrict__ slot_count,
                        int* __restrict__ sorted_token, int* __restrict__ assign_pos, int* __restrict__ ticket,
                        int* __restrict__ signals, int num_signals) {
  DDTREE_TRACE_WARP(ddtree::kTraceMoeRouteBlocks);
  extern __shared__ int smem[];   // group_block's (T > 1)
  __shared__ RouteSmem<1> sm;
  __shared__ int last;
  const int e = threadIdx.x;
  const float corr = e < E ? bias[e] : 0.f;   // a weight: read before the wait
  ddtree::grid_dependency_wait();
  ddtree::launch_dependents();
  if (blockIdx.x == 0) zero_signals(signals, num_signals);
  if (T == 1) {
    if (e < E) expert_count[e] = 0;   // the picks' ones are written after route_tokens_block's barriers
    route_tokens_block(logits, corr, 0, 1, E, topk, n_group, topk_group, norm_topk_prob, routed_scaling_factor,
                       topk_ids, topk_w, sm);
    if (e < topk) {   // one token: every pick has count 1; slot order = the picks by increasing expert id
      const int my_id = sm.pick_e[e];
      int rank = 0;
      for (int k = 0; k < topk; ++k) rank += sm.pick_e[k] < my_id;
      group_one_token_pick(e, my_id, rank, expert_count, slot_expert, slot_offset, slot_count, sorted_token,
                           assign_pos);
    }
    return;
  }
  route_tokens_block(logits, corr, blockIdx.x, 1, E, topk, n_group, topk_group, norm_topk_prob,
                     routed_scaling_factor, topk_ids, topk_w, sm);
  if (!last_block_to_finish(ticket, last, T)) return;   // grid T: the last block groups every token
  group_block(topk_ids, T, topk, E, num_slots, expert_count, slot_expert, slot_offset, slot_count, sorted_token,
              assign_pos, smem);
}

// moe_group_kernel's outputs from the P = T * topk <= 32 picks in shared memory (pick a = token a / topk), by warp 0
// alone: lane a holds pick a. Its expert's count and its place among that expert's picks come from the lanes with
// the same id (__match_any); its sorted position is the picks of lower experts plus that place (group_block's
// expert-major order, tokens increasing inside an expert); the first pick of each expert stands for it in the slot
// order (more tokens first, then lower id). expert_count must be zeroed before (other experts stay 0).
__device__ __forceinline__ void group_picks_warp(const int* pick_e, int P, int topk, int num_slots,
                                                 int* __restrict__ expert_count, int* __restrict__ slot_expert,
                                                 int* __restrict__ slot_offset, int* __restrict__ slot_count,
                                                 int* __restrict__ sorted_token, int* __restrict__ assign_pos) {
  const int lane = threadIdx.x & 31;
  const bool live = lane < P;
  const int id = live ? pick_e[lane] : -1 - lane;   // distinct dummies never match a live pick
  const unsigned same = __match_any_sync(0xffffffffu, id);
  const int cnt = __popc(same), before = __popc(same & ((1u << lane) - 1u));
  const bool first = live && before == 0;
  int off = 0, slot = 0;
  for (int b = 0; b < P; ++b) {
    const int ob = __shfl_sync(0xffffffffu, id, b), cb = __shfl_sync(0xffffffffu, cnt, b);
    const bool fb = __shfl_sync(0xffffffffu, (int)first, b) != 0;
    off += ob < id;
    slot += fb && (cb > cnt || (cb == cnt && ob < id));
  }
  const int active = __popc(__ballot_sync(0xffffffffu, first));
  if (live) {
    const int p = off + before;
    sorted_token[p] = lane / topk;
    assign_pos[lane] = p;
  }
  if (first) {
    expert_count[id] = cnt;
    slot_expert[slot] = id;
    slot_offset[slot] = off;
    slot_count[slot] = cnt;
  }
  for (int sl = active + lane; sl < num_slots; sl += 32) {
    slot_expert[sl] = -1;
    slot_offset[sl] = 0;
    slot_count[sl] = 0;
  }
}
// moe_route_batch_kernel: T <= kRouteBatchTokens tokens with T * topk <= 32, one block of one thread per expert:
// the tokens are routed together (route_tokens_block, with the same barriers for every token), and warp 0 groups
// the T * topk picks from shared memory (group_picks_warp): no ticket, no second pass over global memory. The same
// outputs as moe_topk + moe_group bit for bit. Grid 1, block 32 * ceil(E / 32).
extern "C" __global__ void __launch_bounds__(kRouteBlockMaxExperts)
moe_route_batch_kernel(const float* __restrict__ logits, const float* __restrict__ bias, int T, int E, int topk,
                       int n_group, int topk_group, int norm_topk_prob, float routed_scaling_factor, int num_slots,
                       int* __restrict__ topk_ids, float* __restrict__ topk_w, int* __restrict__ expert_count,
                       int* __restrict__ slot_expert, int* __restrict__ slot_offset, int* __restrict__ slot_count,
                       int* __restrict__ sorted_token, int* __restrict__ assign_pos, int* __restrict__ signals,
                       int num_signals) {
  DDTREE_TRACE_WARP(ddtree::kTraceMoeRouteBatch);
  __shared__ RouteSmem<kRouteBatchTokens> sm;
  const int e = threadIdx.x;
  const float corr = e < E ? bias[e] : 0.f;   // a weight: read before the wait
  ddtree::grid_dependency_wait();
  ddtree::launch_dependents();
  if (T > kRouteBatchTokens || T * topk > 32) __trap();   // the host routes such T otherwise
  zero_signals(signals, num_signals);
  if (e < E) expert_count[e] = 0;   // the picked experts' counts are written after route_tokens_block's barriers
  route_tokens_block(logits, corr, 0, T, E, topk, n_group, topk_group, norm_topk_prob, routed_scaling_factor,
                     topk_ids, topk_w, sm);
  if (e < 32)
    group_picks_warp(sm.pick_e, T * topk, topk, num_slots, expert_count, slot_expert, slot_offset, slot_count,
                     sorted_token, assign_pos);
}

// Top-k and grouping in one launch. Grid: ceil(T / (32 * ROUTE_TOKENS_PER_WARP)) blocks of 1024 threads;
// dynamic smem as moe_group_kernel. ticket: one int, 0 before the first launch; the last block resets it.
#define ROUTE_TOKENS_PER_WARP 2
extern "C" __global__ void __launch_bounds__(1024)
moe_route_kernel(const float* __restrict__ logits, const float* __restrict__ bias, int T, int E, int topk,
                 int n_group, int topk_group, int norm_topk_prob, float routed_scaling_factor,
                 int num_slots, int* __restrict__ topk_ids, float* __restrict__ topk_w,
                 int* __restrict__ expert_count, int* __restrict__ slot_expert, int* __restrict__ slot_offset,
                 int* __restrict__ slot_count, int* __restrict__ sorted_token, int* __restrict__ assign_pos,
                 int* __restrict__ ticket) {
  DDTREE_TRACE_WARP(ddtree::kTraceMoeRoute);
  extern __shared__ int smem[];
  __shared__ int last;
  ddtree::grid_dependency_wait();
  ddtree::launch_dependents();
  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5;
  for (int i = 0; i < ROUTE_TOKENS_PER_WARP; ++i) {
    const int tok = (blockIdx.x * ROUTE_TOKENS_PER_WARP + i) * warps + warp;
    if (tok < T)
      route_token(logits, bias, tok, E, topk, n_group, topk_group, norm_topk_prob, routed_scaling_factor,
                  topk_ids, topk_w);
  }
  if (gridDim.x > 1) {   // the last block to get here groups everything
    if (!last_block_to_finish(ticket, last, (int)gridDim.x)) return;
  } else {
    __syncthreads();   // this block's topk_ids stores are visible to the whole block
  }
  group_block(topk_ids, T, topk, E, num_slots, expert_count, slot_expert, slot_offset, slot_count, sorted_token,
              assign_pos, smem);
}
