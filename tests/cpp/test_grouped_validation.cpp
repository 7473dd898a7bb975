// Host-side checks, packed strides, workspace layout and launch grids of the grouped GEMM (no GPU
// needed).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "grouped/grouped_kernels.hpp"
#include "grouped/grouped_validation.hpp"
#include "meshla/error.hpp"

namespace meshla::grouped {
namespace {

// Fake device addresses: validation reads only shapes, strides and alignment.
void* address(std::uintptr_t at) { return reinterpret_cast<void*>(at); }

TensorView view(std::uintptr_t at, DType dtype, std::initializer_list<std::int64_t> shape) {
  return make_tensor_view(address(at), dtype, shape, 0);
}

struct Forward {
  std::int64_t groups = 4, rows = 100, in = 64, out = 32;
  DType dtype = DType::kBFloat16;
  GroupedMatmulArgs args() const {
    GroupedMatmulArgs a;
    a.m_splits = view(0x1000, DType::kInt64, {groups});
    a.x = view(0x10000, dtype, {rows, in});
    a.weight = view(0x20000, dtype, {groups, out, in});
    a.bias = view(0x30000, dtype, {groups, out});
    a.y = view(0x40000, dtype, {rows, out});
    return a;
  }
};

// A weight gradient's operands: 4 groups, 100 rows, `in` input and 32 output features; dweight
// left to the caller.
GroupedMatmulArgs wgrad_args(std::int64_t in) {
  GroupedMatmulArgs args;
  args.m_splits = view(0x1000, DType::kInt64, {4});
  args.x = view(0x10000, DType::kBFloat16, {100, in});
  args.dy = view(0x20000, DType::kBFloat16, {100, 32});
  return args;
}

std::string error_of(GroupedPass pass, const GroupedMatmulArgs& args) {
  try {
    validate_grouped_args(pass, args);
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    return error.what();
  }
  return "";
}

TEST(GroupedValidation, ForwardShapeFromXAndWeight) {
  const GroupedShape shape = validate_grouped_args(GroupedPass::kForward, Forward{}.args());
  EXPECT_EQ(shape.groups, 4);
  EXPECT_EQ(shape.rows, 100);
  EXPECT_EQ(shape.in_features, 64);
  EXPECT_EQ(shape.out_features, 32);
  EXPECT_EQ(shape.dtype, DType::kBFloat16);
}

TEST(GroupedValidation, NamesArgumentAndShapes) {
  GroupedMatmulArgs args = Forward{}.args();
  args.y = view(0x40000, DType::kBFloat16, {100, 16});
  EXPECT_EQ(error_of(GroupedPass::kForward, args),
            "grouped_linear forward: y.shape=[100, 16] must be [rows, out] = [100, 32]");

  args = Forward{}.args();
  args.weight = view(0x20000, DType::kBFloat16, {3, 32, 64});
  EXPECT_EQ(error_of(GroupedPass::kForward, args),
            "grouped_linear forward: weight.shape=[3, 32, 64] must be [G, out, in] = [4, 32, 64]");

  args = Forward{}.args();
  args.m_splits.dtype = DType::kInt32;  // JAX's group sizes
  EXPECT_EQ(error_of(GroupedPass::kForward, args), "");
  args.m_splits.dtype = DType::kFloat32;
  EXPECT_EQ(error_of(GroupedPass::kForward, args),
            "grouped_linear forward: m_splits is float32, expected int64 or int32");

  args = Forward{}.args();
  args.bias.dtype = DType::kFloat16;
  EXPECT_EQ(error_of(GroupedPass::kForward, args),
            "grouped_linear forward: bias is float16, expected bfloat16");

  args = Forward{}.args();
  args.y.device = 1;
  EXPECT_EQ(error_of(GroupedPass::kForward, args),
            "grouped_linear forward: y is on cuda:1 but m_splits is on cuda:0");
}

// A forward call's arrays, all on the host (a framework's reference path).
GroupedMatmulArgs on_host(const Forward& forward) {
  GroupedMatmulArgs args = forward.args();
  for (TensorView* view : {&args.m_splits, &args.x, &args.weight, &args.bias, &args.y}) {
    view->device_kind = DeviceKind::kCpu;
  }
  return args;
}

// ragged_dot's layout: rhs [G, in, out], the shape read from it that way, and grouped_matmul's
// words in every message; its backward passes take [G, in, out] weight gradients.
TEST(GroupedValidation, InOutLayoutReadsRhsAsGInOutInGroupedMatmulsWords) {
  GroupedMatmulArgs args = Forward{}.args();
  args.weight_layout = WeightLayout::kInOut;
  args.weight = view(0x20000, DType::kBFloat16, {4, 64, 32});
  const GroupedShape shape = validate_grouped_args(GroupedPass::kForward, args);
  EXPECT_EQ(shape.in_features, 64);
  EXPECT_EQ(shape.out_features, 32);

  args.weight = view(0x20000, DType::kBFloat16, {3, 64, 32});
  EXPECT_EQ(error_of(GroupedPass::kForward, args),
            "grouped_matmul forward: rhs.shape=[3, 64, 32] must be [G, in, out] = [4, 64, 32]");
  args.weight = view(0x20000, DType::kBFloat16, {4, 32, 64});  // [G, out, in]: x's features
  EXPECT_EQ(error_of(GroupedPass::kForward, args),
            "grouped_matmul forward: lhs.shape=[100, 64] must be [rows, in] = [100, 32]");
  args.weight = view(0x20000, DType::kBFloat16, {4, 64, 32});
  args.y = view(0x40000, DType::kBFloat16, {100, 64});
  EXPECT_EQ(error_of(GroupedPass::kForward, args),
            "grouped_matmul forward: out.shape=[100, 64] must be [rows, out] = [100, 32]");
  args = Forward{}.args();
  args.weight_layout = WeightLayout::kInOut;
  args.weight = view(0x20000, DType::kBFloat16, {4, 64, 32});
  args.m_splits.dtype = DType::kFloat32;
  EXPECT_EQ(error_of(GroupedPass::kForward, args),
            "grouped_matmul forward: group_sizes is float32, expected int64 or int32");

  GroupedMatmulArgs wgrad = wgrad_args(64);
  wgrad.weight_layout = WeightLayout::kInOut;
  wgrad.dweight = view(0x30000, DType::kBFloat16, {4, 64, 32});
  EXPECT_EQ(error_of(GroupedPass::kWgrad, wgrad), "");
  wgrad.dweight = view(0x30000, DType::kBFloat16, {4, 32, 64});
  EXPECT_EQ(error_of(GroupedPass::kWgrad, wgrad),
            "grouped_matmul wgrad: dweight.shape=[4, 32, 64] must be [G, in, out] = [4, 64, 32]");
}

TEST(GroupedValidation, HostArraysFollowTheSameRules) {
  GroupedMatmulArgs args = on_host(Forward{});
  EXPECT_EQ(error_of(GroupedPass::kForward, args), "");
  args.y.device_kind = DeviceKind::kCuda;
  EXPECT_EQ(error_of(GroupedPass::kForward, args),
            "grouped_linear forward: y is on cuda:0 but m_splits is on cpu");
  Forward unaligned;
  unaligned.in = 60;  // runs padded, on the host's reference path too
  EXPECT_EQ(error_of(GroupedPass::kForward, on_host(unaligned)), "");
}

std::string group_sizes_error_of(std::vector<std::int64_t> sizes, std::int64_t rows,
                                 WeightLayout layout = WeightLayout::kOutIn) {
  try {
    check_group_sizes(sizes.data(), static_cast<std::int64_t>(sizes.size()), rows, layout);
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    return error.what();
  }
  return "";
}

TEST(GroupedValidation, GroupSizesOnTheHostInTheDeviceChecksWords) {
  EXPECT_EQ(group_sizes_error_of({2, 0, 4}, 6), "");
  EXPECT_EQ(group_sizes_error_of({2, -1, 3, -2}, 4), "grouped_linear: m_splits[1]=-1 is negative");
  EXPECT_EQ(group_sizes_error_of({2, 3}, 6),
            "grouped_linear: m_splits sums to 5 but the input has 6 rows");
  EXPECT_EQ(group_sizes_error(WeightLayout::kOutIn, 1, -1, 0, 4),
            group_sizes_error_of({2, -1, 3}, 4));
}

// grouped_matmul's calls (ragged_dot's layout) are reported in its own words, on the host as the
// device-side record of their layout is.
TEST(GroupedValidation, GroupSizesOfGroupedMatmulInItsWords) {
  EXPECT_EQ(group_sizes_error_of({2, -1, 3}, 4, WeightLayout::kInOut),
            "grouped_matmul: group_sizes[1]=-1 is negative");
  EXPECT_EQ(group_sizes_error_of({2, 3}, 6, WeightLayout::kInOut),
            "grouped_matmul: group_sizes sums to 5 but the input has 6 rows");
  EXPECT_EQ(group_sizes_error(WeightLayout::kInOut, -1, 0, 5, 6),
            group_sizes_error_of({2, 3}, 6, WeightLayout::kInOut));
}

// 16-bit features that are not multiples of 8 run on padded copies: those operands need no
// alignment, while the ones used in place still do.
TEST(GroupedValidation, SixteenBitFeaturesNotMultiplesOf8RunPadded) {
  Forward f;
  f.in = 60;
  EXPECT_EQ(error_of(GroupedPass::kForward, f.args()), "");
  const PaddedFeatures padded =
      padded_features(validate_grouped_args(GroupedPass::kForward, f.args()));
  EXPECT_TRUE(padded.in);
  EXPECT_FALSE(padded.out);
  GroupedMatmulArgs args = f.args();
  args.x.data = address(0x10008);       // copied: any address
  args.weight.data = address(0x20002);  // copied
  EXPECT_EQ(error_of(GroupedPass::kForward, args), "");
  args.y.data = address(0x40008);  // out = 32: written in place
  EXPECT_EQ(error_of(GroupedPass::kForward, args),
            "grouped_linear forward: y must start on a 16-byte boundary for bfloat16");

  f.dtype = DType::kFloat32;  // fp32 runs meshla's own kernel in place: any size
  EXPECT_FALSE(padded_features(validate_grouped_args(GroupedPass::kForward, f.args())).any());

  args = Forward{}.args();
  args.x.data = address(0x10008);
  EXPECT_EQ(error_of(GroupedPass::kForward, args),
            "grouped_linear forward: x must start on a 16-byte boundary for bfloat16");
}

TEST(GroupedValidation, GroupStrideMayBePaddedButNotOverlapping) {
  GroupedMatmulArgs args = Forward{}.args();
  args.weight.strides[0] = 32 * 64 + 128;  // padded groups: fine
  EXPECT_EQ(error_of(GroupedPass::kForward, args), "");
  args.weight.strides[0] = 32 * 64 - 8;
  EXPECT_NE(error_of(GroupedPass::kForward, args).find("groups may not overlap"),
            std::string::npos);
  args = Forward{}.args();
  args.weight.strides[0] = 32 * 64 + 4;  // 8 bytes: breaks 16-byte alignment of later groups
  EXPECT_EQ(error_of(GroupedPass::kForward, args),
            "grouped_linear forward: weight's group stride of 2052 elements is not a multiple of "
            "16 bytes");
}

TEST(GroupedValidation, WgradOutputDtypeFollowsAccumulate) {
  GroupedMatmulArgs args = wgrad_args(64);
  args.dweight = view(0x30000, DType::kBFloat16, {4, 32, 64});
  EXPECT_EQ(error_of(GroupedPass::kWgrad, args), "");
  args.accumulate = true;
  EXPECT_EQ(error_of(GroupedPass::kWgrad, args),
            "grouped_linear wgrad: dweight is bfloat16, expected float32");
  args.dweight.dtype = DType::kFloat32;
  EXPECT_EQ(error_of(GroupedPass::kWgrad, args), "");
  args.dy = view(0x20000, DType::kBFloat16, {99, 32});
  EXPECT_EQ(error_of(GroupedPass::kWgrad, args),
            "grouped_linear wgrad: dy.shape=[99, 32] must be [rows, out] (rows of x) = [100, 32]");
}

TEST(GroupedValidation, FeaturesMustNotBeEmpty) {
  Forward f;
  f.out = 0;
  EXPECT_EQ(error_of(GroupedPass::kForward, f.args()),
            "grouped_linear forward: out_features=0 and in_features=64 (from weight.shape=[4, 0, "
            "64]) must be at least 1");
  GroupedMatmulArgs args = wgrad_args(0);
  args.dweight = view(0x30000, DType::kBFloat16, {4, 32, 0});
  EXPECT_EQ(error_of(GroupedPass::kWgrad, args),
            "grouped_linear wgrad: out_features=32 and in_features=0 (from x.shape=[100, 0], "
            "dy.shape=[100, 32]) must be at least 1");
  args = {};
  args.m_splits = view(0x1000, DType::kInt64, {4});
  args.dy = view(0x20000, DType::kBFloat16, {100, 0});
  args.dbias = view(0x30000, DType::kBFloat16, {4, 0});
  EXPECT_EQ(error_of(GroupedPass::kBiasGrad, args),
            "grouped_linear bias_grad: out_features=0 (from dy.shape=[100, 0]) must be at least 1");
}

TEST(GroupedValidation, EmptyBatchTakesAnyStrides) {
  // No rows (an expert-parallel rank that got no tokens): torch hands an expanded empty gradient,
  // strides 0, through .contiguous() unchanged.
  Forward f;
  f.rows = 0;
  GroupedMatmulArgs args = f.args();
  args.x.strides[0] = args.x.strides[1] = 0;
  args.y.strides[0] = args.y.strides[1] = 0;
  EXPECT_EQ(error_of(GroupedPass::kForward, args), "");
}

TEST(GroupedValidation, AccumulatedGradientsByAddress) {
  GroupedMatmulArgs args = wgrad_args(64);
  args.dweight_addresses = view(0x30000, DType::kInt64, {4});
  args.accumulate = true;
  EXPECT_EQ(error_of(GroupedPass::kWgrad, args), "");
  args.dweight_addresses.shape[0] = 3;
  EXPECT_EQ(
      error_of(GroupedPass::kWgrad, args),
      "grouped_linear wgrad: dweight_addresses is int64 [3]; expected a contiguous int64 [4]");
  args.dweight_addresses = view(0x30000, DType::kInt32, {4});
  EXPECT_EQ(
      error_of(GroupedPass::kWgrad, args),
      "grouped_linear wgrad: dweight_addresses is int32 [4]; expected a contiguous int64 [4]");
  args.dweight_addresses = view(0x30000, DType::kInt64, {4});
  args.accumulate = false;
  EXPECT_EQ(error_of(GroupedPass::kWgrad, args),
            "grouped_linear wgrad: dweight_addresses replaces dweight, and only when accumulating");
  args.accumulate = true;
  args.dweight = view(0x40000, DType::kFloat32, {4, 32, 64});
  EXPECT_EQ(error_of(GroupedPass::kWgrad, args),
            "grouped_linear wgrad: dweight_addresses replaces dweight, and only when accumulating");
}

TEST(GroupedValidation, MissingOperandsAreNamed) {
  GroupedMatmulArgs args = Forward{}.args();
  args.y = {};
  EXPECT_EQ(error_of(GroupedPass::kForward, args), "grouped_linear forward: y is required");
  args = {};
  EXPECT_EQ(error_of(GroupedPass::kDgrad, args), "grouped_linear dgrad: m_splits is required");
}

TEST(GroupedLayout, PackedStrideRoundsGroupsTo256Bytes) {
  EXPECT_EQ(packed_group_stride(3, 5, DType::kFloat32), 64);
  EXPECT_EQ(packed_group_stride(3, 5, DType::kBFloat16), 128);
  EXPECT_EQ(packed_group_stride(2048, 7168, DType::kBFloat16), 2048 * 7168);
  EXPECT_EQ(packed_group_stride(1, 1, DType::kFloat64), 32);
  EXPECT_THROW(packed_group_stride(0, 5, DType::kFloat32), Error);
}

TEST(GroupedLayout, WorkspacePartsAreAlignedAndDisjoint) {
  const WorkspaceLayout layout = workspace_layout(100, 1000);
  EXPECT_EQ(layout.offsets, 0u);
  EXPECT_GE(layout.invalid, 101 * sizeof(std::int64_t));
  EXPECT_EQ(layout.invalid % 256, 0u);
  EXPECT_GE(layout.pass, layout.invalid + sizeof(std::int32_t));
  EXPECT_EQ(layout.pass % 256, 0u);
  EXPECT_GE(layout.total, layout.pass + 1000);
}

TEST(GroupedLayout, SpanGridKeepsAboutAThousandBlocksOverEveryGroup) {
  // Qwen3's weight gradient: 128 groups of 1536 x 2048 elements share 1024 blocks.
  const dim3 qwen = span_grid({nullptr, DType::kBFloat16, 128, 1536 * 2048, 1536 * 2048}, 256);
  EXPECT_EQ(qwen.x, 8u);
  EXPECT_EQ(qwen.y, 128u);
  // A small group gets no more blocks than it has elements for.
  const dim3 small = span_grid({nullptr, DType::kFloat32, 1, 300, 300}, 256);
  EXPECT_EQ(small.x, 2u);
  EXPECT_EQ(small.y, 1u);
  // More groups than the budget: one block each.
  const dim3 wide = span_grid({nullptr, DType::kFloat32, 5000, 10, 16}, 256);
  EXPECT_EQ(wide.x, 1u);
  EXPECT_EQ(wide.y, 5000u);
  EXPECT_THROW(span_grid({nullptr, DType::kFloat32, 70000, 10, 16}, 256), Error);
}

}  // namespace
}  // namespace meshla::grouped
