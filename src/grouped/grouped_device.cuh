// Device functions of the grouped GEMM shared by its kernels and the CUTLASS passes' table kernel
// (which builds the index, clears empty groups' weight gradients and, on the rare invalid call,
// poisons the output itself, so that a valid call launches one kernel before the GEMM and none
// after it): the checks of m_splits, the group index (prefix sums) and the element fills (NaN for
// a failed call's output, zero for an empty group's weight gradient).
#pragma once

#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <limits>

#include "grouped/grouped_kernels.hpp"

namespace meshla::grouped {

using gemm::kIndexThreads;
constexpr std::int64_t kNoGroup = std::numeric_limits<std::int64_t>::max();

struct LesserGroup {
  __device__ std::int64_t operator()(std::int64_t a, std::int64_t b) const { return a < b ? a : b; }
};

// What m_splits says about a call: the sum of the sizes and the first group with a negative one.
struct SplitsCheck {
  std::int64_t total;
  std::int64_t lowest_negative;  // kNoGroup when none is negative

  __device__ bool valid(std::int64_t rows) const {
    return lowest_negative == kNoGroup && total == rows;
  }
};

// Run by one whole block of kIndexThreads threads; every thread gets the result.
__device__ inline SplitsCheck check_splits(const GroupIndex& index) {
  using Reduce = cub::BlockReduce<std::int64_t, kIndexThreads>;
  __shared__ typename Reduce::TempStorage storage;
  __shared__ SplitsCheck result;
  std::int64_t total = 0;
  std::int64_t negative = kNoGroup;
  // Each thread meets its groups in increasing order, so its first negative is its lowest.
  for (std::int64_t g = threadIdx.x; g < index.groups; g += kIndexThreads) {
    const std::int64_t size = index.size(g);
    total += size;
    if (size < 0 && negative == kNoGroup) negative = g;
  }
  const std::int64_t sum = Reduce(storage).Sum(total);
  __syncthreads();
  const std::int64_t lowest = Reduce(storage).Reduce(negative, LesserGroup());
  if (threadIdx.x == 0) result = {sum, lowest};
  __syncthreads();
  return result;
}

// Run by one whole block of kIndexThreads threads: checks m_splits, reports a failure to `status`,
// then writes the offsets, all zero when invalid so that no later kernel reads or writes outside
// the caller's tensors. The block's offsets are visible to all its threads when it returns; so is
// the result: whether m_splits passed.
__device__ inline bool build_group_index(const GroupIndex& index, DeviceStatus* status) {
  using Scan = cub::BlockScan<std::int64_t, kIndexThreads>;
  __shared__ typename Scan::TempStorage scan_storage;

  const SplitsCheck check = check_splits(index);
  const bool valid = check.valid(index.rows);
  if (threadIdx.x == 0) {
    *index.invalid = valid ? 0 : 1;
    if (!valid) {
      const bool has_negative = check.lowest_negative != kNoGroup;
      volatile DeviceStatus* report = status;
      report->group = has_negative ? static_cast<std::int32_t>(check.lowest_negative) : -1;
      report->value = has_negative ? index.size(check.lowest_negative) : check.total;
      report->rows = index.rows;
      __threadfence_system();
      report->code = has_negative ? kNegativeSize : kSumMismatch;
      __threadfence_system();
    }
  }

  std::int64_t carry = 0;
  for (std::int64_t base = 0; base < index.groups; base += kIndexThreads) {
    const std::int64_t g = base + threadIdx.x;
    const std::int64_t size = valid && g < index.groups ? index.size(g) : 0;
    std::int64_t prefix, chunk_total;
    Scan(scan_storage).ExclusiveSum(size, prefix, chunk_total);
    __syncthreads();
    if (g < index.groups) index.offsets[g] = carry + prefix;
    carry += chunk_total;
  }
  if (threadIdx.x == 0) index.offsets[index.groups] = carry;
  __syncthreads();
  return valid;
}

// This thread's index along x of the grid, and the threads along x: a grid-stride loop's start and
// step.
__device__ inline std::int64_t grid_thread() {
  return blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
}

__device__ inline std::int64_t grid_threads() {
  return static_cast<std::int64_t>(gridDim.x) * blockDim.x;
}

enum class Fill { kZero, kNaN };

// Group g's weight gradient: at op.out_addresses[g] where the caller gave one address a group,
// else g group strides into op.out.
template <typename T>
__device__ T* group_dweight(const GroupedOperands& op, std::int64_t g) {
  return op.out_addresses != nullptr ? reinterpret_cast<T*>(op.out_addresses[g])
                                     : static_cast<T*>(op.out) + g * op.out_group_stride;
}

// Writes `value` over group `group` of `span`: the calling threads take elements first,
// first + step, ... The bit patterns come from span.dtype, so one function serves every dtype.
__device__ inline void fill_elements(const GroupedSpan& span, std::int64_t group, Fill value,
                                     std::int64_t first, std::int64_t step) {
  auto fill = [&](auto* data, auto bits) {
    data = span.addresses != nullptr ? reinterpret_cast<decltype(data)>(span.addresses[group])
                                     : data + group * span.group_stride;
    for (std::int64_t i = first; i < span.group_elements; i += step) data[i] = bits;
  };
  const bool nan = value == Fill::kNaN;
  if (span.dtype == DType::kFloat32) {
    fill(static_cast<std::uint32_t*>(span.data), nan ? std::uint32_t{0x7fc00000u} : 0u);
  } else {
    // bf16 and fp16: the quiet NaN with the sign and mantissa of float's.
    const std::uint16_t nan_bits = span.dtype == DType::kBFloat16 ? 0x7fc0 : 0x7e00;
    fill(static_cast<std::uint16_t*>(span.data), nan ? nan_bits : std::uint16_t{0});
  }
}

// Run by whole blocks of kIndexThreads threads on a grid whose y walks the groups of `span` and
// whose x splits each group between blocks. Group blockIdx.y, when it has no rows, gets zeros, or
// NaN when m_splits fail the checks. Each block checks m_splits itself, so this needs no group
// index and can run in the kernel that builds it, and a block whose group has rows (nearly all of
// them) returns after one load.
__device__ inline void clear_if_empty(const GroupIndex& index, const GroupedSpan& span) {
  const std::int64_t g = blockIdx.y;
  if (index.size(g) != 0) return;  // the same for the whole block
  const bool valid = check_splits(index).valid(index.rows);
  fill_elements(span, g, valid ? Fill::kZero : Fill::kNaN, grid_thread(), grid_threads());
}

}  // namespace meshla::grouped
