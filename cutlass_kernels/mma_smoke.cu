// One tensor-core MMA atom per arch family, compiled but never run: a CuTe atom built for the wrong arch
// compiles to a trap without an error, so the build test looks for the instruction in each arch's SASS/PTX.
//   sm_90a: GMMA (wgmma)        sm_100a/103a: UMMA (tcgen05.mma)        sm_120a: f8f6f4 mma.sync
#include <cute/arch/config.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/arch/mma_sm100_umma.hpp>
#include <cute/arch/mma_sm120.hpp>

extern "C" __global__ void mma_smoke_kernel(const unsigned long long* desc, float* out) {
  float d[4] = {0.f, 0.f, 0.f, 0.f};
#if defined(CUTE_ARCH_MMA_SM90A_ENABLED)
  using Atom = cute::SM90::GMMA::MMA_64x8x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K,
                                                             cute::SM90::GMMA::Major::K>;
  Atom::fma(desc[0], desc[1], d[0], d[1], d[2], d[3]);
#elif defined(CUTE_ARCH_TCGEN05_F16F32_MMA_ENABLED)
  using Atom = cute::SM100_MMA_F16BF16_SS<cute::bfloat16_t, cute::bfloat16_t, float, 128, 64,
                                          cute::UMMA::Major::K, cute::UMMA::Major::K>;
  Atom::fma(desc[0], desc[1], uint32_t(desc[2]), 1u, desc[3]);
  d[0] = 1.f;
#elif defined(CUTE_ARCH_F8F6F4_MMA_ENABLED)
  using Atom = cute::SM120_16x8x32_TN<cute::float_e4m3_t, cute::float_e4m3_t, float>;
  uint32_t a[4], b[2];
  for (int i = 0; i < 4; ++i) a[i] = uint32_t(desc[i]);
  for (int i = 0; i < 2; ++i) b[i] = uint32_t(desc[4 + i]);
  Atom::fma(d[0], d[1], d[2], d[3], a[0], a[1], a[2], a[3], b[0], b[1], d[0], d[1], d[2], d[3]);
#endif
  for (int i = 0; i < 4; ++i) out[threadIdx.x * 4 + i] = d[i];
}
