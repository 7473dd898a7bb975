// The CUDA library data type of each meshla dtype (cuBLASLt, cuSolverMg, cuBLASMp all take one).
#pragma once

#include <library_types.h>

#include "meshla/tensor.hpp"

namespace meshla::detail {

// Throws kNotImplemented for the integer dtypes, which no meshla routine hands to those libraries.
// Callers check first which of the floating dtypes they support, with their own message.
cudaDataType_t cuda_data_type(DType dtype);

}  // namespace meshla::detail
