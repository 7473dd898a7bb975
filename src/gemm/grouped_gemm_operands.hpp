// What a grouped GEMM is told of its groups on the device: the group index (each group's rows of
// the stacked operands, from the prefix sums of its sizes) and the operands of one pass as raw
// pointers and element strides. Read by the table kernels of gemm/sm90_grouped_gemm.cuh's users
// (the grouped GEMM's passes; all_gather_matmul's one-launch GEMM, whose groups are rank blocks).
#pragma once

#include <cstdint>

#include "core/host_device.hpp"
#include "meshla/grouped_matmul.hpp"

namespace meshla::gemm {

// The table kernels run as one block of this many threads (block scans over the groups).
constexpr int kIndexThreads = 256;

// The prefix sums of a call's m_splits, written to the workspace by launch_group_index.
struct GroupIndex {
  const void* m_splits;   // [groups] sizes: int64, or int32 where sizes_int32 (JAX's ragged_dot)
  std::int64_t* offsets;  // [groups + 1]: group g owns rows [offsets[g], offsets[g + 1])
  std::int32_t* invalid;  // 1 when m_splits failed the checks; then every offset is 0
  std::int64_t groups;
  std::int64_t rows;
  bool sizes_int32 = false;

  MESHLA_HOST_DEVICE std::int64_t size(std::int64_t g) const {
    return sizes_int32 ? static_cast<const std::int32_t*>(m_splits)[g]
                       : static_cast<const std::int64_t*>(m_splits)[g];
  }
};

// Operands of one pass of the grouped GEMM, as raw pointers and element strides.
struct GroupedOperands {
  GroupedPass pass;
  std::int64_t in_features;
  std::int64_t out_features;
  const void* x;
  const void* dy;
  const void* weight;
  std::int64_t weight_group_stride;
  const void* bias;  // nullptr: no bias
  std::int64_t bias_group_stride;
  void* out;                      // y, dx or dweight
  std::int64_t out_group_stride;  // dweight only
  bool accumulate;
  const std::int64_t* out_addresses;  // dweight only, where set: group g's at out_addresses[g]
};

}  // namespace meshla::gemm
