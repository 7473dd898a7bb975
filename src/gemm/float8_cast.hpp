// The kernels behind meshla/float8.hpp's casts, on checked arguments (float8_cast.cpp checks
// them): t's rows unit-stride at `pitch` elements, outputs contiguous.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "meshla/float8.hpp"

namespace meshla::detail {

struct Float8Layout {
  DType dtype = DType::kBFloat16;  // t's: bfloat16, float16 or float32
  std::int64_t rows = 0, cols = 0, pitch = 0;
};

void launch_float8_amax(const void* t, const Float8Layout& layout, Float8Scales scales, float* amax,
                        cudaStream_t stream);
void launch_float8_cast(const void* t, const Float8Layout& layout, Float8Scales scales,
                        const float* multiplier, DType dtype, void* q, void* q_transposed,
                        cudaStream_t stream);

}  // namespace meshla::detail
