// The sum of `slots` equal arrays laid out `slot_stride` elements apart, accumulated in fp32 and
// stored to each of the `out_count` pointers of `outs` (which may be peers' memory): the reduction
// that ends a symmetric-backend reduce-scatter round. Memory-bound and short; it is the only kernel
// of that backend besides the GEMMs.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "meshla/tensor.hpp"

namespace meshla::collective {

// Outputs one launch stores to; more take another launch each.
inline constexpr int kMaxSumOutputs = 8;

void sum_slots(DType dtype, const void* slots_base, std::int64_t slot_stride, int slots,
               std::int64_t count, void* const* outs, int out_count, cudaStream_t stream);

// Loads sum_slots' kernels for `dtype` now. Under CUDA's lazy module loading the first launch
// loads them, and loading can wait for work already queued on the device; with several GPUs
// driven from one process that work may wait for another thread's next call, so plans load
// their kernels before their last exchange instead (seen as a hang of the threads model).
void load_sum_slots(DType dtype);

}  // namespace meshla::collective
