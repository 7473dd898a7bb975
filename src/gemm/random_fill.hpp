// Fills device memory with reproducible pseudo-random values in [-1, 1), for tuning GEMM
// algorithms on data that behaves like real data (zeros run faster than real data).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "meshla/tensor.hpp"

namespace meshla::detail {

void random_fill(void* data, DType dtype, std::size_t count, std::uint32_t seed,
                 cudaStream_t stream);

}  // namespace meshla::detail
