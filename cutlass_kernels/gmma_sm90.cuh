// Hopper wgmma helpers shared by the sm_90a families (dense_linear_sm90, mla_verify_sm90, moe_int4_sm90).
#pragma once
#include <cuda/std/cstdint>  // NVRTC has no <cstdint>
#include <cuda/std/utility>
#include "device_common.cuh"  // grid_dependency_wait, launch_dependents
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED  // N = 24, 40, 56, 72, ... (every multiple of 8)
#include <cute/arch/mma_sm90_gmma.hpp>

namespace ddtree {

// Descriptor of a 128-byte-swizzled shared-memory operand (tile base 1024-byte aligned). K-major: 128-byte
// rows, 8-row groups 1024 bytes apart (SBO); a k16 step inside the swizzle atom is +32 bytes of start address
// (+2 in the descriptor); LBO unused (16). MN-major: 64 bf16 of MN per 128-byte row, the next 64 at LBO
// bytes, 8-row K groups 1024 bytes apart (SBO).
__device__ __forceinline__ cuda::std::uint64_t sw128_desc(cuda::std::uint32_t addr, cuda::std::uint32_t lbo_bytes = 16) {
  return (cuda::std::uint64_t)((addr & 0x3FFFF) >> 4) | ((cuda::std::uint64_t)(lbo_bytes >> 4) << 16) |
         ((cuda::std::uint64_t)(1024 >> 4) << 32) | ((cuda::std::uint64_t)1 << 62);
}

// wgmma m64nNk16 bf16 -> fp32, both operands K-major in shared memory, for the N the kernels instantiate.
template <int TN> struct GmmaOp;
#define DDTREE_GMMA_OP(N)                                                                          \
  template <> struct GmmaOp<N> {                                                                   \
    using type = cute::SM90::GMMA::MMA_64x##N##x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K,       \
                                                                  cute::SM90::GMMA::Major::K>;     \
  };
DDTREE_GMMA_OP(16)
DDTREE_GMMA_OP(32)
DDTREE_GMMA_OP(48)
DDTREE_GMMA_OP(64)
DDTREE_GMMA_OP(72)
DDTREE_GMMA_OP(80)
DDTREE_GMMA_OP(96)
DDTREE_GMMA_OP(112)
DDTREE_GMMA_OP(128)
DDTREE_GMMA_OP(136)
DDTREE_GMMA_OP(192)
DDTREE_GMMA_OP(256)
#undef DDTREE_GMMA_OP

// The same with A from registers (K-major, the only RS layout), B K-major in shared memory.
template <int TN> struct GmmaRsOp;
#define DDTREE_GMMA_RS_OP(N)                                                                       \
  template <> struct GmmaRsOp<N> {                                                                 \
    using type = cute::SM90::GMMA::MMA_64x##N##x16_F32BF16BF16_RS<cute::SM90::GMMA::Major::K,       \
                                                                  cute::SM90::GMMA::Major::K>;     \
  };
DDTREE_GMMA_RS_OP(32)
DDTREE_GMMA_RS_OP(48)
DDTREE_GMMA_RS_OP(64)
DDTREE_GMMA_RS_OP(80)
DDTREE_GMMA_RS_OP(96)
DDTREE_GMMA_RS_OP(128)
DDTREE_GMMA_RS_OP(160)
DDTREE_GMMA_RS_OP(192)
DDTREE_GMMA_RS_OP(224)
DDTREE_GMMA_RS_OP(256)
#undef DDTREE_GMMA_RS_OP

// One wgmma with both operands in shared memory, all of the thread's accumulators (acc[0 .. sizeof...(I))).
template <class Op, int... I>
__device__ __forceinline__ void gmma_ss(cuda::std::uint64_t da, cuda::std::uint64_t db, float* acc,
                                        cute::SM90::GMMA::ScaleOut scale_d, cuda::std::integer_sequence<int, I...>) {
  Op::fma(da, db, acc[I]..., scale_d);
}

// One wgmma with A from registers (4 x bf16x2: the m64k16 fragment), B in shared memory, accumulating.
template <class Op, int... I>
__device__ __forceinline__ void gmma_rs(const cuda::std::uint32_t (&a)[4], cuda::std::uint64_t db, float* acc,
                                        cuda::std::integer_sequence<int, I...>) {
  Op::fma(a[0], a[1], a[2], a[3], db, acc[I]..., cute::SM90::GMMA::ScaleOut::One);
}

// mbarriers in shared memory (CTA scope). arrive releases and try_wait acquires (the PTX defaults, spelled
// out); mbar_wait spins until the phase of the given parity has completed (a fresh barrier: parity 1 passes).
__device__ __forceinline__ void mbar_init(cuda::std::uint32_t bar, cuda::std::uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(cuda::std::uint32_t bar) {
  asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.release.cta.shared::cta.b64 st, [%0];\n}" ::"r"(bar) : "memory");
}
// One arrival when all of this thread's earlier cp.async copies have landed (count them in the init).
__device__ __forceinline__ void mbar_arrive_cp_async(cuda::std::uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(cuda::std::uint32_t bar, cuda::std::uint32_t parity) {
  asm volatile(
      "{\n .reg .pred done;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT_%=;\n}" ::"r"(bar), "r"(parity) : "memory");
}

// Thread-block cluster helpers (distributed shared memory).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ cuda::std::uint32_t cluster_ctarank() {
  cuda::std::uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// The shared::cluster address of shared offset `addr` (this CTA's address space) in cluster CTA `rank`.
__device__ __forceinline__ cuda::std::uint32_t dsmem_map(cuda::std::uint32_t addr, cuda::std::uint32_t rank) {
  cuda::std::uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  return remote;
}
// The split cluster barrier without its memory ordering (barrier.cluster.arrive.release compiles to MEMBAR.ALL.GPU
// + ERRBAR): arrive early, wait later, e.g. so that every block's mbarriers are initialized (fence.mbarrier_init)
// before another block's remote arrival. Every thread of the block, once each.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }
// mbar_wait with cluster-scope acquire: for a phase completed by another block (remote arrivals, st.async bytes).
__device__ __forceinline__ void mbar_wait_cluster(cuda::std::uint32_t bar, cuda::std::uint32_t parity) {
  asm volatile(
      "{\n .reg .pred done;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT_%=;\n}" ::"r"(bar), "r"(parity) : "memory");
}
// 16 bytes from registers into another block's shared memory (a dsmem_map address), counted as complete_tx bytes
// on that block's mbarrier `remote_bar` (a dsmem_map address too).
__device__ __forceinline__ void st_async_f4(cuda::std::uint32_t remote, float4 v, cuda::std::uint32_t remote_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
               ::"r"(remote), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(remote_bar) : "memory");
}
// One arrival on an mbarrier of any CTA of the cluster (a dsmem_map address). Release at CTA scope, as CUTLASS's
// cluster pipelines do: .release.cluster compiles to MEMBAR.ALL.GPU + ERRBAR before the arrival, which waits for
// every load the thread has in flight (its cp.async of later stages) and put one stage in flight at a time.
__device__ __forceinline__ void mbar_arrive_cluster(cuda::std::uint32_t remote_bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cluster.b64 _, [%0];" ::"r"(remote_bar) : "memory");
}
// One arrival that also expects `bytes` more of asynchronous copies (complete_tx) before the phase completes.
__device__ __forceinline__ void mbar_arrive_expect_tx(cuda::std::uint32_t bar, cuda::std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global memory to shared offset `dst` of every
// CTA in `cta_mask`, each completing the transfer on its own mbarrier at offset `bar` (sm_90a).
__device__ __forceinline__ void bulk_copy_multicast(cuda::std::uint32_t dst, const void* src,
                                                    cuda::std::uint32_t bytes, cuda::std::uint32_t bar,
                                                    cuda::std::uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "h"(cta_mask) : "memory");
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global memory to shared offset `dst` of this CTA,
// completing the transfer on the mbarrier at offset `bar` (the TMA engine: no per-thread load slots).
__device__ __forceinline__ void bulk_copy(cuda::std::uint32_t dst, const void* src, cuda::std::uint32_t bytes,
                                          cuda::std::uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// The full / empty mbarrier pair of each of STAGES pipeline stages (full[s]: the stage's copies have landed;
// empty[s]: every reader is done with it), declared __shared__ by the kernel.
template <int STAGES>
struct StageBarriers {
  cuda::std::uint64_t bar[2 * STAGES];  // full[0..S), empty[0..S)
  __device__ __forceinline__ cuda::std::uint32_t base() const {
    return static_cast<cuda::std::uint32_t>(__cvta_generic_to_shared(bar));
  }
  __device__ __forceinline__ cuda::std::uint32_t full(int s) const { return base() + 8u * s; }
  __device__ __forceinline__ cuda::std::uint32_t empty(int s) const { return base() + 8u * (STAGES + s); }
  // By one thread, before a block barrier: every barrier completes a phase after `count` arrivals.
  __device__ __forceinline__ void init(cuda::std::uint32_t count) const { init(count, count); }
  __device__ __forceinline__ void init(cuda::std::uint32_t full_count, cuda::std::uint32_t empty_count) const {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full(s), full_count);
      mbar_init(empty(s), empty_count);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // The PDL prologue of a weight-streaming ring (every thread): load_w(s) of the first STAGES - 1 stages before
  // the dependency wait (weights are immutable), the next kernel let in right after it when `early`, then
  // load_x(s) of those stages, each closed by the thread's cp.async arrival on full(s).
  template <class LoadW, class LoadX>
  __device__ __forceinline__ void prologue(int n_stages, bool early, LoadW&& load_w, LoadX&& load_x) const {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
      if (s < n_stages) load_w(s);
    grid_dependency_wait();
    if (early) launch_dependents();
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
      if (s < n_stages) {
        load_x(s);
        mbar_arrive_cp_async(full(s));
      }
  }
};

// The dynamic shared memory from its first 1024-aligned byte (the 128-byte swizzle repeats every 1024 bytes; the
// kernel asks for 1 KB of slack): as a shared-window address and as a generic pointer.
struct AlignedSmem {
  cuda::std::uint32_t addr;
  unsigned char* ptr;
};
__device__ __forceinline__ AlignedSmem align_smem_1024(unsigned char* raw) {
  const cuda::std::uint32_t raw_addr = static_cast<cuda::std::uint32_t>(__cvta_generic_to_shared(raw));
  const cuda::std::uint32_t addr = (raw_addr + 1023u) & ~1023u;
  return {addr, raw + (addr - raw_addr)};
}

}  // namespace ddtree
