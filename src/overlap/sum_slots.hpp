// out = the sum of `slots` equal arrays laid out `slot_stride` elements apart, accumulated in
// fp32: the reduction that ends a symmetric-backend reduce-scatter round. Memory-bound and short;
// it is the only kernel of that backend besides the GEMMs.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "meshla/tensor.hpp"

namespace meshla::overlap {

void sum_slots(DType dtype, const void* slots_base, std::int64_t slot_stride, int slots,
               std::int64_t count, void* out, cudaStream_t stream);

}  // namespace meshla::overlap
