// Data movement the CUDA backend (runtime/backends/cuda_backend.py) needs around the dense kernels:
// - copy_rows_kernel: dst row (row0 + *row_offset + r) = src row r, for r < rows, in 16-byte vectors.
//   With row_offset on the device this is the KV-cache append of a captured graph: the prefix length
//   lives in device memory, so one graph replays at any prefix. With a null row_offset it is a strided
//   copy (concat of activations, making a strided view contiguous).
// Rows are row_bytes long (a multiple of 16); strides in bytes (multiples of 16).
#include <cuda/std/cstdint>  // NVRTC has no <cstdint>
#include "device_common.cuh"

extern "C" __global__ void copy_rows_kernel(unsigned char* __restrict__ dst, long long ldd_bytes,
                                            const unsigned char* __restrict__ src, long long lds_bytes,
                                            int rows, int row_bytes, int row0, const int* __restrict__ row_offset) {
  DDTREE_TRACE_WARP(ddtree::kTraceCopyRows);
  ddtree::grid_dependency_wait();  // PDL: nothing global is touched before it
  ddtree::launch_dependents();
  const int r = blockIdx.y;
  const int v = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows || v >= row_bytes / 16) return;
  const long long dst_row = (long long)row0 + (row_offset ? *row_offset : 0) + r;
  const uint4 x = reinterpret_cast<const uint4*>(src + (long long)r * lds_bytes)[v];
  reinterpret_cast<uint4*>(dst + dst_row * ldd_bytes)[v] = x;
}
