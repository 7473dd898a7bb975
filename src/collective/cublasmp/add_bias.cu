#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "collective/cublasmp/add_bias.hpp"
#include "core/cuda_checks.hpp"

namespace meshla::collective {
namespace {

template <typename T>
__global__ void add_bias_kernel(T* out, std::int64_t count, std::int64_t cols, const T* bias) {
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += step) {
    out[i] = static_cast<T>(static_cast<float>(out[i]) + static_cast<float>(bias[i % cols]));
  }
}

template <typename T>
void launch(void* out, std::int64_t rows, std::int64_t cols, const void* bias,
            cudaStream_t stream) {
  constexpr int kThreads = 512;
  const std::int64_t count = rows * cols;
  // A few waves of blocks over the device; the loop strides over the rest.
  const int blocks = static_cast<int>(std::clamp<std::int64_t>(count / kThreads + 1, 1, 2048));
  add_bias_kernel<T><<<blocks, kThreads, 0, stream>>>(static_cast<T*>(out), count, cols,
                                                      static_cast<const T*>(bias));
  MESHLA_CHECK_CUDA(cudaGetLastError());
}

}  // namespace

void add_bias(DType dtype, void* out, std::int64_t rows, std::int64_t cols, const void* bias,
              cudaStream_t stream) {
  if (rows * cols == 0) return;
  switch (dtype) {
    case DType::kBFloat16:
      return launch<__nv_bfloat16>(out, rows, cols, bias, stream);
    case DType::kFloat16:
      return launch<__half>(out, rows, cols, bias, stream);
    case DType::kFloat32:
      return launch<float>(out, rows, cols, bias, stream);
    default:
      MESHLA_THROW(kNotImplemented, "add_bias: dtype " << dtype_name(dtype));
  }
}

}  // namespace meshla::collective
