// The GMMA linear's weight loads without its MMAs (tools/bench_w_tiles.py, issue 6): how fast G blocks, one per
// SM, stream the row tiles of a row-major bf16 W [N, K] into shared memory, 32 KB stages of 32 KB / PIECE rows x
// PIECE bytes (linear_gmma_kernel: 128 rows x 256 bytes).
//
// Block b takes units [b U / G, (b + 1) U / G) of the U = (N / rows) x (row bytes / PIECE) (row tile, k piece)
// units in tile-major order, one unit a stage, STAGES stages in flight: G = 2 x tiles is the partition of
// linear_gmma_kernel's cluster-of-2 K split, G = the SM count a stream-K one.
// LOAD 0: 16-byte cp.async per thread, as linear_gmma_kernel issues them (the SM's load slots carry them).
// LOAD 1: one bulk copy (the TMA engine) per row piece, issued by one warp.
// LOAD 2: one 32 KB bulk copy per stage, as if W were repacked so that each stage's tile is contiguous.
// PDL 1 (family runtime_probe_sm90_pdl): the stages in flight are issued before the dependency wait and the next
// kernel is let in right after it, as linear_gmma_kernel does in a chain.
// Each thread folds one word of every stage; the sink is written only on an impossible value.
#include <cuda/std/cstdint>
#include "gmma_sm90.cuh"

template <int LOAD, int STAGES, int PIECE = 256, int PDL = 0>
__global__ void __launch_bounds__(256, 1)
read_w_tiles_kernel(const unsigned char* __restrict__ w, int n_rows, int row_bytes, unsigned int* __restrict__ sink) {
  static_assert(LOAD >= 0 && LOAD <= 2, "load path");
  static_assert(PIECE >= 256 && PIECE <= 2048 && (PIECE & (PIECE - 1)) == 0, "piece bytes");
  constexpr int kPiece = PIECE, kStage = 32768, kRows = kStage / kPiece, kChunks = kPiece / 16;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  __shared__ ddtree::StageBarriers<STAGES> ring;
  const ddtree::AlignedSmem smem = ddtree::align_smem_1024(smem_raw);
  const int tid = threadIdx.x;
  const int per_tile = row_bytes / kPiece;
  const long long units = (long long)(n_rows / kRows) * per_tile;
  const long long u0 = blockIdx.x * units / gridDim.x;
  const int n = (int)((blockIdx.x + 1) * units / gridDim.x - u0);
  if (tid == 0) ring.init(LOAD == 0 ? blockDim.x : 1);
  __syncthreads();

  auto issue = [&](int s) {
    const long long u = u0 + s;
    const long long tile = u / per_tile;
    const unsigned char* src = w + tile * kRows * row_bytes + (u - tile * per_tile) * kPiece;
    const cuda::std::uint32_t dst = smem.addr + (s % STAGES) * kStage, bar = ring.full(s % STAGES);
    if constexpr (LOAD == 0) {
#pragma unroll
      for (int q = 0; q < 8; ++q) {  // 16-byte chunk i = tid + 256 q: row i / kChunks, chunk i % kChunks of it
        const int r = (tid + 256 * q) / kChunks, c = (tid + 256 * q) % kChunks;
        ddtree::cp_async16_s(dst + r * kPiece + 16 * c, src + (size_t)r * row_bytes + 16 * c, true);
      }
      ddtree::mbar_arrive_cp_async(bar);
    } else if constexpr (LOAD == 1) {
      if (tid < 32) {
        if (tid == 0) ddtree::mbar_arrive_expect_tx(bar, kStage);
        __syncwarp();
#pragma unroll
        for (int q = 0; q < (kRows + 31) / 32; ++q)
          if (tid + 32 * q < kRows)
            ddtree::bulk_copy(dst + (tid + 32 * q) * kPiece, src + (size_t)(tid + 32 * q) * row_bytes, kPiece, bar);
      }
    } else {
      if (tid == 0) {
        ddtree::mbar_arrive_expect_tx(bar, kStage);
        ddtree::bulk_copy(dst, w + u * kStage, kStage, bar);
      }
    }
  };

  for (int s = 0; s < STAGES && s < n; ++s) issue(s);
  if constexpr (PDL) {
    ddtree::grid_dependency_wait();
    ddtree::launch_dependents();
  }
  unsigned int acc = 0;
  const unsigned int* words = reinterpret_cast<const unsigned int*>(smem.ptr);
  for (int s = 0; s < n; ++s) {
    ddtree::mbar_wait(ring.full(s % STAGES), (s / STAGES) & 1);
    acc ^= words[(s % STAGES) * (kStage / 4) + tid * 8];
    __syncthreads();  // every thread has passed this phase and read the buffer: refill it
    if (s + STAGES < n) issue(s + STAGES);
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}
