// Kernels of the grouped GEMM other than CUTLASS's: the device-side group index (prefix sums and
// validation of m_splits), NaN poisoning of a failed call's outputs, zeroing of empty groups'
// weight gradients, the bias gradient, the bias added after a product without a bias epilogue,
// the padded runs' copies and the portable grouped GEMM. Launchers only enqueue on `stream`.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "gemm/grouped_gemm_operands.hpp"
#include "meshla/grouped_matmul.hpp"

namespace meshla::grouped {

using gemm::GroupedOperands;
using gemm::GroupIndex;

// A launch grid's largest y extent: the kernels over groups put them there, so this is also the
// most groups a call may have.
constexpr std::int64_t kMaxGridY = 65535;

// What a failed device-side check leaves in host-mapped memory. Written by the device with
// volatile stores, read by the host without synchronizing: a stale read only delays the report to
// a later call.
struct DeviceStatus {
  std::int32_t code;   // DeviceStatusCode
  std::int32_t group;  // the first group with a negative size
  std::int64_t value;  // m_splits[group], or the sum of m_splits
  std::int64_t rows;   // the rows of x (or dy) the sum had to match
};

enum DeviceStatusCode : std::int32_t { kStatusOk = 0, kNegativeSize = 1, kSumMismatch = 2 };

void launch_group_index(const GroupIndex& index, DeviceStatus* status, cudaStream_t stream);

// `groups` blocks of `group_elements` elements, `group_stride` elements apart.
struct GroupedSpan {
  void* data;
  DType dtype;
  std::int64_t groups;
  std::int64_t group_elements;
  std::int64_t group_stride;
  // Where set, group g starts at addresses[g] instead (dweight_addresses).
  const std::int64_t* addresses = nullptr;
};

// The grid of a kernel over every group of `span` (y: the groups, x: blocks sharing a group), about
// a thousand blocks in all, with `threads` threads each.
dim3 span_grid(const GroupedSpan& span, int threads);

// Fills `span` with NaN when *invalid is set; does nothing otherwise.
void launch_poison_if_invalid(const std::int32_t* invalid, const GroupedSpan& span,
                              cudaStream_t stream);

// Zeroes the groups of `span` whose group has no rows (NaN when m_splits fail the checks).
void launch_zero_empty_groups(const GroupIndex& index, const GroupedSpan& span,
                              cudaStream_t stream);

// db[g, :] = sum of dy's rows of group g, accumulated in fp32 in `accumulator` ([groups, out]
// floats of workspace), rounded once into db.
void launch_bias_grad(const GroupIndex& index, const void* dy, DType dtype, std::int64_t out,
                      float* accumulator, void* dbias, std::int64_t dbias_group_stride,
                      cudaStream_t stream);

// y[r, :] += bias[g, :] for each row r of group g (rows past the groups' total untouched), added
// in fp32 to y as the product left it (already rounded to y's dtype, so rounded twice in all,
// where a bias epilogue rounds once): the bias of a pass whose kernel has no bias epilogue.
void launch_add_group_bias(const GroupIndex& index, void* y, DType dtype, std::int64_t out,
                           const void* bias, std::int64_t bias_group_stride, cudaStream_t stream);

// `groups` row-major matrices of [rows, cols] elements whose rows are `pitch` elements apart,
// group g's at data + g * group_stride elements, or at addresses[g] where addresses is set.
struct Matrices {
  void* data;
  std::int64_t rows;
  std::int64_t cols;
  std::int64_t pitch;
  std::int64_t group_stride;
  const std::int64_t* addresses = nullptr;
};

enum class CopyMode {
  kCopy,      // dst = src where src has the element, 0 elsewhere (padding in, cropping out)
  kAddFloat,  // dst += src (fp32), over dst's extent
};

// Copies (or adds) every element of dst's extent from src, for the padded runs of feature sizes
// TMA cannot read. `element_size` is 2 (bf16, fp16: moved as bits) or 4 (fp32).
void launch_copy_matrices(const Matrices& src, const Matrices& dst, std::int64_t groups,
                          int element_size, CopyMode mode, cudaStream_t stream);

// The portable grouped GEMM of any pass but kBiasGrad (fp32 groups on every GPU; bf16 and fp16
// groups where meshla's Hopper kernel cannot run): SIMT, fp32 products and sums, any feature
// size, the group sizes read on the device.
void launch_grouped_simt(const GroupIndex& index, const GroupedOperands& operands, DType dtype,
                         cudaStream_t stream);

}  // namespace meshla::grouped
