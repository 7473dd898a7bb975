#include "grouped/grouped_validation.hpp"

#include <sstream>
#include <string>
#include <string_view>

#include "core/alignment.hpp"
#include "core/checks.hpp"
#include "grouped/grouped_kernels.hpp"

namespace meshla {

std::string_view grouped_pass_name(GroupedPass pass) {
  switch (pass) {
    case GroupedPass::kForward:
      return "forward";
    case GroupedPass::kDgrad:
      return "dgrad";
    case GroupedPass::kWgrad:
      return "wgrad";
    case GroupedPass::kBiasGrad:
      return "bias_grad";
  }
  return "unknown";
}

std::int64_t packed_group_stride(std::int64_t out_features, std::int64_t in_features, DType dtype) {
  MESHLA_CHECK_ARG(out_features > 0 && in_features > 0,
                   "packed_group_stride: out_features=" << out_features << " and in_features="
                                                        << in_features << " must be positive");
  const auto size = static_cast<std::int64_t>(dtype_size(dtype));
  MESHLA_CHECK_ARG(256 % size == 0, "packed_group_stride: dtype " << dtype_name(dtype)
                                                                  << " does not divide 256 bytes");
  const std::int64_t per_boundary = 256 / size;
  return (out_features * in_features + per_boundary - 1) / per_boundary * per_boundary;
}

void check_group_sizes(const std::int64_t* sizes, std::int64_t groups, std::int64_t rows,
                       WeightLayout layout) {
  std::int64_t total = 0;
  for (std::int64_t g = 0; g < groups; ++g) {
    MESHLA_CHECK_ARG(sizes[g] >= 0, grouped::group_sizes_error(layout, g, sizes[g], 0, rows));
    total += sizes[g];
  }
  MESHLA_CHECK_ARG(total == rows, grouped::group_sizes_error(layout, -1, 0, total, rows));
}

void check_grouped_call(GroupedPass pass, const GroupedMatmulArgs& args) {
  grouped::validate_grouped_args(pass, args);
}

namespace grouped {
namespace {

// What a call's messages call the function, its arguments and the weights' shape: the names of
// the front-end function that lays its weights out that way (WeightLayout).
struct Words {
  const char* function;
  const char* m_splits;
  const char* x;
  const char* weight;
  const char* y;
  const char* weight_shape;
  const char* group_matrix;
};

constexpr Words kLinearWords{"grouped_linear", "m_splits", "x", "weight", "y",
                             "[G, out, in]",   "[out, in]"};
constexpr Words kRaggedWords{"grouped_matmul", "group_sizes", "lhs", "rhs", "out",
                             "[G, in, out]",   "[in, out]"};

const Words& words_of(WeightLayout layout) {
  return layout == WeightLayout::kInOut ? kRaggedWords : kLinearWords;
}

// The checks of one call, with its function's and pass's names in every message.
class Checker {
 public:
  Checker(GroupedPass pass, const GroupedMatmulArgs& args)
      : pass_(pass), args_(args), words_(words_of(args.weight_layout)) {}

  const Words& words() const { return words_; }

  std::string prefix() const {
    return std::string(words_.function) + " " + std::string(grouped_pass_name(pass_));
  }

  void require(const TensorView& view, const char* name) const {
    MESHLA_CHECK_ARG(view.given(), prefix() << ": " << name << " is required");
  }

  // Every operand lives where m_splits does: one GPU, or the host for the reference path.
  void on_device(const TensorView& view, const char* name) const {
    const TensorView& splits = args_.m_splits;
    MESHLA_CHECK_ARG(view.device_kind == splits.device_kind &&
                         (view.device_kind == DeviceKind::kCpu || view.device == splits.device),
                     prefix() << ": " << name << " is on " << view.place_string() << " but "
                              << words_.m_splits << " is on " << splits.place_string());
  }

  // A row-major matrix with contiguous rows; returns nothing, checks shape [rows, cols].
  void matrix(const TensorView& view, const char* name, std::int64_t rows, std::int64_t cols,
              std::string_view expected) const {
    on_device(view, name);
    MESHLA_CHECK_ARG(view.ndim == 2 && view.shape[0] == rows && view.shape[1] == cols,
                     prefix() << ": " << name << ".shape=" << view.shape_string() << " must be "
                              << expected << " = [" << rows << ", " << cols << "]");
    MESHLA_CHECK_ARG(view.is_row_major_contiguous(),
                     prefix() << ": " << name << " must be contiguous (row-major), shape "
                              << view.shape_string());
  }

  // [G, out, in] (or [G, in, out]: the layout's) with contiguous rows and any group stride of at
  // least out * in.
  void grouped_weights(const TensorView& view, const char* name, const GroupedShape& shape) const {
    on_device(view, name);
    const bool in_out = args_.weight_layout == WeightLayout::kInOut;
    const std::int64_t rows = in_out ? shape.in_features : shape.out_features;
    const std::int64_t cols = in_out ? shape.out_features : shape.in_features;
    MESHLA_CHECK_ARG(view.ndim == 3 && view.shape[0] == shape.groups && view.shape[1] == rows &&
                         view.shape[2] == cols,
                     prefix() << ": " << name << ".shape=" << view.shape_string() << " must be "
                              << words_.weight_shape << " = [" << shape.groups << ", " << rows
                              << ", " << cols << "]");
    const bool rows_contiguous = (view.shape[2] == 1 || view.strides[2] == 1) &&
                                 (view.shape[1] == 1 || view.strides[1] == view.shape[2]);
    const bool groups_apart =
        view.shape[0] == 1 || view.strides[0] >= view.shape[1] * view.shape[2];
    MESHLA_CHECK_ARG(rows_contiguous && groups_apart,
                     prefix() << ": " << name << " has strides [" << view.strides[0] << ", "
                              << view.strides[1] << ", " << view.strides[2]
                              << "]; each group must be a contiguous " << words_.group_matrix
                              << " matrix and groups may not overlap");
  }

  // One fp32 matrix's address a group (GroupedMatmulArgs::dweight_addresses): only in place of
  // dweight, when accumulating.
  void addresses(const TensorView& view, const char* name, const GroupedShape& shape) const {
    MESHLA_CHECK_ARG(args_.accumulate && !args_.dweight.given(),
                     prefix() << ": " << name << " replaces dweight, and only when accumulating");
    on_device(view, name);
    MESHLA_CHECK_ARG(view.dtype == DType::kInt64 && view.ndim == 1 &&
                         view.shape[0] == shape.groups && view.is_row_major_contiguous(),
                     prefix() << ": " << name << " is " << dtype_name(view.dtype) << " "
                              << view.shape_string() << "; expected a contiguous int64 ["
                              << shape.groups << "]");
  }

  void bias_like(const TensorView& view, const char* name, const GroupedShape& shape) const {
    on_device(view, name);
    MESHLA_CHECK_ARG(
        view.ndim == 2 && view.shape[0] == shape.groups && view.shape[1] == shape.out_features,
        prefix() << ": " << name << ".shape=" << view.shape_string() << " must be [G, out] = ["
                 << shape.groups << ", " << shape.out_features << "]");
    MESHLA_CHECK_ARG((view.shape[1] == 1 || view.strides[1] == 1) &&
                         (view.shape[0] == 1 || view.strides[0] >= view.shape[1]),
                     prefix() << ": " << name << " must have contiguous rows (strides ["
                              << view.strides[0] << ", " << view.strides[1] << "])");
  }

  void dtype(const TensorView& view, const char* name, DType expected) const {
    MESHLA_CHECK_ARG(view.dtype == expected, prefix()
                                                 << ": " << name << " is " << dtype_name(view.dtype)
                                                 << ", expected " << dtype_name(expected));
  }

  // TMA reads and writes 16-byte aligned rows.
  void aligned(const TensorView& view, const char* name, std::int64_t group_stride) const {
    const auto size = static_cast<std::int64_t>(dtype_size(view.dtype));
    MESHLA_CHECK_ARG(reinterpret_cast<std::uintptr_t>(view.data) % 16 == 0,
                     prefix() << ": " << name << " must start on a 16-byte boundary for "
                              << dtype_name(view.dtype));
    MESHLA_CHECK_ARG(group_stride * size % 16 == 0,
                     prefix() << ": " << name << "'s group stride of " << group_stride
                              << " elements is not a multiple of 16 bytes");
  }

 private:
  GroupedPass pass_;
  const GroupedMatmulArgs& args_;
  const Words& words_;
};

}  // namespace

GroupedShape validate_grouped_args(GroupedPass pass, const GroupedMatmulArgs& args) {
  const Checker check(pass, args);
  const Words& words = check.words();
  const std::string where = check.prefix();
  const TensorView& splits = args.m_splits;
  check.require(splits, words.m_splits);
  MESHLA_CHECK_ARG(splits.dtype == DType::kInt64 || splits.dtype == DType::kInt32,
                   where << ": " << words.m_splits << " is " << dtype_name(splits.dtype)
                         << ", expected int64 or int32");
  MESHLA_CHECK_ARG(splits.ndim == 1 && splits.shape[0] >= 1 && splits.is_row_major_contiguous(),
                   where << ": " << words.m_splits << ".shape=" << splits.shape_string()
                         << " must be a contiguous [G] with G >= 1");
  MESHLA_CHECK_ARG(splits.shape[0] <= kMaxGridY, where << ": " << words.m_splits << " has "
                                                       << splits.shape[0] << " groups, more than "
                                                       << kMaxGridY);

  // The operand that fixes the rows and the dtype: x, or dy where the pass has no x.
  const bool has_x = pass == GroupedPass::kForward || pass == GroupedPass::kWgrad;
  const TensorView& lead = has_x ? args.x : args.dy;
  const char* lead_name = has_x ? words.x : "dy";
  check.require(lead, lead_name);
  MESHLA_CHECK_ARG(lead.ndim == 2, where << ": " << lead_name << ".shape=" << lead.shape_string()
                                         << " must be 2-D [rows, features]");
  const DType dtype = lead.dtype;
  MESHLA_CHECK_ARG(
      dtype == DType::kBFloat16 || dtype == DType::kFloat16 || dtype == DType::kFloat32,
      where << ": " << lead_name << " is " << dtype_name(dtype)
            << "; grouped GEMM takes bfloat16, float16 or float32");

  GroupedShape shape{dtype, splits.shape[0], lead.shape[0], 0, 0};
  const bool in_out = args.weight_layout == WeightLayout::kInOut;
  switch (pass) {
    case GroupedPass::kForward:
    case GroupedPass::kDgrad:
      check.require(args.weight, words.weight);
      MESHLA_CHECK_ARG(args.weight.ndim == 3, where << ": " << words.weight
                                                    << ".shape=" << args.weight.shape_string()
                                                    << " must be " << words.weight_shape);
      shape.out_features = args.weight.shape[in_out ? 2 : 1];
      shape.in_features = args.weight.shape[in_out ? 1 : 2];
      break;
    case GroupedPass::kWgrad:
      check.require(args.dy, "dy");
      MESHLA_CHECK_ARG(args.dy.ndim == 2,
                       where << ": dy.shape=" << args.dy.shape_string() << " must be 2-D");
      if (!args.dweight_addresses.given()) check.require(args.dweight, "dweight");
      shape.out_features = args.dy.shape[1];
      shape.in_features = lead.shape[1];
      break;
    case GroupedPass::kBiasGrad:
      check.require(args.dbias, "dbias");
      shape.out_features = lead.shape[1];
      break;
  }
  // An empty feature dimension has no tiles to cut: refused, as nn.Linear's sizes are.
  const bool has_in = pass != GroupedPass::kBiasGrad;
  MESHLA_CHECK_ARG(
      shape.out_features >= 1 && (!has_in || shape.in_features >= 1),
      where << ": out_features=" << shape.out_features
            << (has_in ? " and in_features=" + std::to_string(shape.in_features) : "") << " (from "
            << (pass == GroupedPass::kForward || pass == GroupedPass::kDgrad
                    ? std::string(words.weight) + ".shape=" + args.weight.shape_string()
                : pass == GroupedPass::kWgrad
                    ? std::string(words.x) + ".shape=" + lead.shape_string() +
                          ", dy.shape=" + args.dy.shape_string()
                    : "dy.shape=" + lead.shape_string())
            << ") must be at least 1");

  switch (pass) {
    case GroupedPass::kForward:
      check.matrix(args.x, words.x, shape.rows, shape.in_features, "[rows, in]");
      check.grouped_weights(args.weight, words.weight, shape);
      check.dtype(args.weight, words.weight, dtype);
      check.require(args.y, words.y);
      check.matrix(args.y, words.y, shape.rows, shape.out_features, "[rows, out]");
      check.dtype(args.y, words.y, dtype);
      if (args.bias.given()) {
        check.bias_like(args.bias, "bias", shape);
        check.dtype(args.bias, "bias", dtype);
      }
      break;
    case GroupedPass::kDgrad:
      check.matrix(args.dy, "dy", shape.rows, shape.out_features, "[rows, out]");
      check.grouped_weights(args.weight, words.weight, shape);
      check.dtype(args.weight, words.weight, dtype);
      check.require(args.dx, "dx");
      check.matrix(args.dx, "dx", shape.rows, shape.in_features, "[rows, in]");
      check.dtype(args.dx, "dx", dtype);
      break;
    case GroupedPass::kWgrad:
      check.matrix(args.x, words.x, shape.rows, shape.in_features, "[rows, in]");
      check.matrix(args.dy, "dy", shape.rows, shape.out_features,
                   "[rows, out] (rows of " + std::string(words.x) + ")");
      check.dtype(args.dy, "dy", dtype);
      if (args.dweight_addresses.given()) {
        check.addresses(args.dweight_addresses, "dweight_addresses", shape);
      } else {
        check.grouped_weights(args.dweight, "dweight", shape);
        check.dtype(args.dweight, "dweight", args.accumulate ? DType::kFloat32 : dtype);
      }
      break;
    case GroupedPass::kBiasGrad:
      check.matrix(args.dy, "dy", shape.rows, shape.out_features, "[rows, out]");
      check.bias_like(args.dbias, "dbias", shape);
      check.dtype(args.dbias, "dbias", dtype);
      break;
  }

  if (dtype != DType::kFloat32 && pass != GroupedPass::kBiasGrad) {
    // TMA reads and writes 16-byte aligned rows in place. Features that are not multiples of 8
    // run padded (padded_features): the operands with such a row are copied into the workspace,
    // so only those used in place must be aligned.
    const PaddedFeatures padded = padded_features(shape);
    const auto check_aligned = [&](const TensorView& view, const char* name, bool copied) {
      if (view.given() && !copied) check.aligned(view, name, view.ndim == 3 ? view.strides[0] : 0);
    };
    check_aligned(args.x, words.x, padded.in);
    check_aligned(args.dy, "dy", padded.out);
    check_aligned(args.weight, words.weight, padded.any());
    check_aligned(args.y, words.y, padded.out);
    check_aligned(args.dx, "dx", padded.in);
    check_aligned(args.dweight, "dweight", padded.any());
    if (args.bias.given() && !padded.any()) check.aligned(args.bias, "bias", args.bias.strides[0]);
  }
  return shape;
}

PaddedFeatures padded_features(const GroupedShape& shape) {
  const bool sixteen_bit = shape.dtype == DType::kBFloat16 || shape.dtype == DType::kFloat16;
  return {sixteen_bit && shape.in_features % kFeatureMultiple != 0,
          sixteen_bit && shape.out_features % kFeatureMultiple != 0};
}

std::string group_sizes_error(WeightLayout layout, std::int64_t group, std::int64_t size,
                              std::int64_t total, std::int64_t rows) {
  const Words& words = words_of(layout);
  std::ostringstream message;
  if (size < 0) {
    message << words.function << ": " << words.m_splits << "[" << group << "]=" << size
            << " is negative";
  } else {
    message << words.function << ": " << words.m_splits << " sums to " << total
            << " but the input has " << rows << " rows";
  }
  return message.str();
}

WorkspaceLayout workspace_layout(std::int64_t groups, std::size_t pass_bytes) {
  WorkspaceLayout layout;
  layout.offsets = 0;
  layout.invalid = detail::align_up(sizeof(std::int64_t) * static_cast<std::size_t>(groups + 1));
  layout.pass = layout.invalid + detail::kWorkspaceAlignment;
  layout.total = layout.pass + detail::align_up(pass_bytes);
  return layout;
}

}  // namespace grouped
}  // namespace meshla
