#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "core/cuda_checks.hpp"
#include "gemm/random_fill.hpp"

namespace meshla::detail {
namespace {

__device__ std::uint32_t mix(std::uint64_t x) {
  // splitmix64 finalizer: well spread bits from consecutive indices.
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return static_cast<std::uint32_t>((x ^ (x >> 31)) >> 32);
}

template <typename T>
__global__ void random_fill_kernel(T* data, std::size_t count, std::uint32_t seed) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < count;
       i += stride) {
    const float unit = static_cast<float>(mix(i ^ (static_cast<std::uint64_t>(seed) << 40)) >> 8) *
                       (1.0f / 16777216.0f);
    data[i] = static_cast<T>(2.0f * unit - 1.0f);
  }
}

template <typename T>
void launch(void* data, std::size_t count, std::uint32_t seed, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int blocks =
      static_cast<int>(std::min<std::size_t>((count + kThreads - 1) / kThreads, 4096));
  if (blocks == 0) return;
  random_fill_kernel<T><<<blocks, kThreads, 0, stream>>>(static_cast<T*>(data), count, seed);
  MESHLA_CHECK_CUDA(cudaGetLastError());
}

}  // namespace

void random_fill(void* data, DType dtype, std::size_t count, std::uint32_t seed,
                 cudaStream_t stream) {
  switch (dtype) {
    case DType::kBFloat16:
      return launch<__nv_bfloat16>(data, count, seed, stream);
    case DType::kFloat16:
      return launch<__half>(data, count, seed, stream);
    case DType::kFloat32:
      return launch<float>(data, count, seed, stream);
    case DType::kFloat8E4M3:
      return launch<__nv_fp8_e4m3>(data, count, seed, stream);
    case DType::kFloat8E5M2:
      return launch<__nv_fp8_e5m2>(data, count, seed, stream);
    default:
      MESHLA_THROW(kNotImplemented, "random_fill: dtype " << dtype_name(dtype));
  }
}

}  // namespace meshla::detail
