// Pieces shared by the GQA attention kernels (tree_attention.cu: mma.sync, every arch; tree_attention_sm90.cu:
// wgmma, sm_90a): the KV split in use at the replayed prefix, the packed (query, head-in-group) rows and
// their Q fragments (the m16k16 A layout of mma.sync, also wgmma's A-register layout per warp).
#pragma once
#include "device_common.cuh"

namespace tree_attention {

constexpr int kTileKeys = 64;   // cache slots per KV tile (the split plan's unit, runtime/dense_kernels.py)

// Splits in use for n_keys keys: the plan's entry for that many key tiles (clamped to the grid), else all.
__device__ __forceinline__ int active_splits(int n_keys, int grid_splits, const int* __restrict__ split_table) {
  if (split_table == nullptr) return grid_splits;
  const int n_tiles = (n_keys + kTileKeys - 1) / kTileKeys;
  return max(1, min(grid_splits, __ldg(split_table + n_tiles)));
}

// This lane's two query rows r and r + 8 of the packed (query, head-in-group) rows: query index, q head, valid.
__device__ __forceinline__ void query_rows(int r, int T, int G, int kvh, int (&qi)[2], int (&head)[2],
                                           bool (&valid)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int rh = r + 8 * h;
    valid[h] = rh < T * G;
    qi[h] = valid[h] ? rh / G : 0;
    head[h] = kvh * G + (valid[h] ? rh % G : 0);
  }
}

// Whether cache slot `key` is visible to query qi (valid: the packed row is a real one): every prefix slot, tree
// slot key - n_prefix through its bit of the query's visibility row, nothing at or past n_keys.
__device__ __forceinline__ bool slot_visible(int key, int n_keys, int n_prefix, bool valid, int qi,
                                             const uint32_t* __restrict__ visibility, int vis_words) {
  bool vis = key < n_keys;
  if (vis && key >= n_prefix) {
    const int nj = key - n_prefix;
    vis = valid && ((visibility[(size_t)qi * vis_words + (nj >> 5)] >> (nj & 31)) & 1u);
  }
  return vis;
}

// slot_visible for the 64 slots key0 .. key0 + 63 at once, bit i = slot key0 + i: one load of the query's (at most
// three) visibility words per tile instead of one per slot.
__device__ __forceinline__ uint64_t tile_visible64(int key0, int n_keys, int n_prefix, bool valid, int qi,
                                                   const uint32_t* __restrict__ visibility, int vis_words) {
  const uint64_t tree =
      valid ? ddtree::bit_window64(visibility + (size_t)qi * vis_words, vis_words, key0 - n_prefix) : 0ull;
  return ddtree::window_visible64(key0, n_prefix, n_keys, tree);
}

// The lane's Q fragments for all of D, loaded once (A operand: rows g / g+8, k = 2t.. and 2t+8..).
template <int D>
__device__ __forceinline__ void load_q_fragments(uint32_t (&qa)[D / 16][4], const __nv_bfloat16* __restrict__ q,
                                                 int ldq, const int (&qi)[2], const int (&head)[2],
                                                 const bool (&valid)[2], int t) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int h = c & 1, d = kk * 16 + 2 * t + 8 * (c >> 1);
      qa[kk][c] = valid[h] ? *reinterpret_cast<const uint32_t*>(q + (size_t)qi[h] * ldq + head[h] * D + d) : 0u;
    }
}

}  // namespace tree_attention
