// Device functions of the grouped GEMM shared by its kernels and the CUTLASS passes' table kernel
// (which builds the index and, on the rare invalid call, poisons the output itself, so that a
// valid call launches one kernel before the GEMM and none after it): the group index (prefix sums
// and validation of m_splits) and the element fill (NaN for a failed call's output, zero for an
// empty group's weight gradient).
#pragma once

#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <limits>

#include "grouped/grouped_kernels.hpp"

namespace meshla::grouped {

constexpr int kIndexThreads = 256;
constexpr std::int64_t kNoGroup = std::numeric_limits<std::int64_t>::max();

struct LesserGroup {
  __device__ std::int64_t operator()(std::int64_t a, std::int64_t b) const { return a < b ? a : b; }
};

// Run by one whole block of kIndexThreads threads: walks m_splits twice, first to validate (a
// negative size, or a sum other than the rows), then to write the offsets, all zero when invalid so
// that no later kernel reads or writes outside the caller's tensors. The block's offsets are
// visible to all its threads when it returns.
__device__ inline void build_group_index(const GroupIndex& index, DeviceStatus* status) {
  using Scan = cub::BlockScan<std::int64_t, kIndexThreads>;
  using Min = cub::BlockReduce<std::int64_t, kIndexThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ typename Min::TempStorage min_storage;
  __shared__ bool valid;

  std::int64_t total = 0;
  std::int64_t negative = kNoGroup;
  for (std::int64_t base = 0; base < index.groups; base += kIndexThreads) {
    const std::int64_t g = base + threadIdx.x;
    const std::int64_t size = g < index.groups ? index.m_splits[g] : 0;
    if (size < 0 && g < negative) negative = g;
    std::int64_t prefix, chunk_total;
    Scan(scan_storage).ExclusiveSum(size, prefix, chunk_total);
    __syncthreads();
    total += chunk_total;
  }
  const std::int64_t lowest = Min(min_storage).Reduce(negative, LesserGroup());
  if (threadIdx.x == 0) {
    const bool has_negative = lowest != kNoGroup;
    valid = !has_negative && total == index.rows;
    *index.invalid = valid ? 0 : 1;
    if (!valid) {
      volatile DeviceStatus* report = status;
      report->group = has_negative ? static_cast<std::int32_t>(lowest) : -1;
      report->value = has_negative ? index.m_splits[lowest] : total;
      report->rows = index.rows;
      __threadfence_system();
      report->code = has_negative ? kNegativeSize : kSumMismatch;
      __threadfence_system();
    }
  }
  __syncthreads();

  std::int64_t carry = 0;
  for (std::int64_t base = 0; base < index.groups; base += kIndexThreads) {
    const std::int64_t g = base + threadIdx.x;
    const std::int64_t size = valid && g < index.groups ? index.m_splits[g] : 0;
    std::int64_t prefix, chunk_total;
    Scan(scan_storage).ExclusiveSum(size, prefix, chunk_total);
    __syncthreads();
    if (g < index.groups) index.offsets[g] = carry + prefix;
    carry += chunk_total;
  }
  if (threadIdx.x == 0) index.offsets[index.groups] = carry;
  __syncthreads();
}

enum class Fill { kZero, kNaN };

// Writes `value` over group `group` of `span`: the calling threads take elements first,
// first + step, ... The bit patterns come from span.dtype, so one function serves every dtype.
__device__ inline void fill_elements(const GroupedSpan& span, std::int64_t group, Fill value,
                                     std::int64_t first, std::int64_t step) {
  auto fill = [&](auto* data, auto bits) {
    data += group * span.group_stride;
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

}  // namespace meshla::grouped
