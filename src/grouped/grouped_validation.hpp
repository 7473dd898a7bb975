// Host-side checks and workspace layout of the grouped GEMM: pure host logic, tested on the CPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "meshla/grouped_matmul.hpp"

namespace meshla::grouped {

struct GroupedShape {
  DType dtype;  // of x / dy / weight
  std::int64_t groups;
  std::int64_t rows;
  std::int64_t in_features;
  std::int64_t out_features;
};

// Checks every argument `pass` uses against the others (shapes, strides, dtypes, places,
// alignment) on their metadata alone, and returns the problem's shape. Throws kInvalidArgument
// naming the argument and the shapes involved. The same rules hold for host arrays (the
// frameworks' reference paths check with them), so both paths refuse a call in the same words.
// Does not check the workspace's size, which depends on the device.
GroupedShape validate_grouped_args(GroupedPass pass, const GroupedMatmulArgs& args);

// 16-bit rows TMA can read hold a multiple of 8 features (16 bytes).
constexpr std::int64_t kFeatureMultiple = 8;

// Which feature sizes of a 16-bit call are not multiples of kFeatureMultiple: such a call runs
// on copies padded with zeros to the next multiple (GroupedMatmul::run), of the operands with
// rows of that size and of the weights and bias; the others are used in place.
struct PaddedFeatures {
  bool in = false;
  bool out = false;
  bool any() const { return in || out; }
};

PaddedFeatures padded_features(const GroupedShape& shape);

// What is wrong with the group sizes, in the words of the function that lays its weights out as
// `layout` (grouped_linear's m_splits, grouped_matmul's group_sizes): group `group`'s `size` is
// negative, or (size >= 0) the sizes sum to `total` where the input has `rows`. The device-side
// check records the same facts and GroupedMatmul reports them in these words, check_group_sizes
// too.
std::string group_sizes_error(WeightLayout layout, std::int64_t group, std::int64_t size,
                              std::int64_t total, std::int64_t rows);

// The workspace of one call: the group index (offsets and the invalid flag), then the pass's own
// part (CUTLASS tables and workspace, or the bias accumulator), each 256-byte aligned.
struct WorkspaceLayout {
  std::size_t offsets = 0;
  std::size_t invalid = 0;
  std::size_t pass = 0;
  std::size_t total = 0;
};

WorkspaceLayout workspace_layout(std::int64_t groups, std::size_t pass_bytes);

}  // namespace meshla::grouped
