// out[r, c] += bias[c] for a row-major [rows, cols] output: the bias of a reduced product, added
// once after the reduction where the GEMM's own epilogue would add it on every rank's partial.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "meshla/tensor.hpp"

namespace meshla::collective {

void add_bias(DType dtype, void* out, std::int64_t rows, std::int64_t cols, const void* bias,
              cudaStream_t stream);

}  // namespace meshla::collective
