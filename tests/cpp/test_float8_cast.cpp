// The float8 casts' argument rules (meshla/float8.hpp), checked before any work is enqueued:
// every message names the argument that is wrong and the shapes. The casts themselves run in the
// GPU suite (check_matmul.py's fp8 family).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "error_message.hpp"
#include "meshla/error.hpp"
#include "meshla/float8.hpp"

namespace meshla {
namespace {

// Views of fake device addresses: the checks read metadata only.
void* fake(std::uintptr_t address) { return reinterpret_cast<void*>(address); }

TensorView t_view(DType dtype = DType::kBFloat16) {
  return make_tensor_view(fake(0x1000), dtype, {64, 96}, 0);
}

std::string amax_error(const TensorView& t, Float8Scales scales, const TensorView& amax) {
  return message_of([&] { float8_amax(t, scales, amax, nullptr); }, ErrorCode::kInvalidArgument);
}

std::string cast_error(const TensorView& multiplier, const TensorView& q,
                       const TensorView& q_transposed, Float8Scales scales = Float8Scales::kRows,
                       const TensorView& t = t_view()) {
  return message_of([&] { float8_cast(t, scales, multiplier, q, q_transposed, nullptr); },
                    ErrorCode::kInvalidArgument);
}

TEST(Float8Cast, TMustBeSixteenOrThirtyTwoBitRowsOnAGpu) {
  const TensorView amax = make_tensor_view(fake(0x2000), DType::kFloat32, {1}, 0);
  EXPECT_NE(amax_error(t_view(DType::kFloat64), Float8Scales::kTensor, amax)
                .find("float8_amax: t is float64; expected bfloat16, float16 or float32"),
            std::string::npos);
  TensorView columns_apart = t_view();
  columns_apart.strides = {1, 64};
  EXPECT_NE(amax_error(columns_apart, Float8Scales::kTensor, amax)
                .find("float8_amax: t must be a 2-D array of unit-stride rows, got shape [64, 96]"),
            std::string::npos);
  TensorView on_host = t_view();
  on_host.device_kind = DeviceKind::kCpu;
  EXPECT_NE(amax_error(on_host, Float8Scales::kTensor, amax)
                .find("float8_amax: t is on cpu, not a CUDA device"),
            std::string::npos);
}

TEST(Float8Cast, AmaxHoldsOneValuePerGroup) {
  const TensorView per_row = make_tensor_view(fake(0x2000), DType::kFloat32, {64}, 0);
  EXPECT_NE(amax_error(t_view(), Float8Scales::kColumns, per_row)
                .find("float8_amax: amax must be 96 contiguous float32 values for t [64, 96], "
                      "got float32 [64]"),
            std::string::npos);
  const TensorView elsewhere = make_tensor_view(fake(0x2000), DType::kFloat32, {64}, 1);
  EXPECT_NE(amax_error(t_view(), Float8Scales::kRows, elsewhere)
                .find("float8_amax: amax is on cuda:1, t on cuda:0"),
            std::string::npos);
}

TEST(Float8Cast, OutputsAreFloat8InTheirLayouts) {
  const TensorView rows = make_tensor_view(fake(0x2000), DType::kFloat32, {64}, 0);
  const TensorView q = make_tensor_view(fake(0x3000), DType::kFloat8E4M3, {64, 96}, 0);
  const TensorView q_t = make_tensor_view(fake(0x4000), DType::kFloat8E4M3, {96, 64}, 0);
  EXPECT_NE(cast_error(rows, {}, {}).find("float8_cast: neither q nor q_transposed is given"),
            std::string::npos);
  EXPECT_NE(cast_error({}, q, {}).find("float8_cast: multiplier is absent (one per row of t)"),
            std::string::npos);
  EXPECT_NE(cast_error(rows, q_t, {})
                .find("float8_cast: q must be a contiguous float8 [64, 96] for t [64, 96], got "
                      "float8_e4m3fn [96, 64]"),
            std::string::npos);
  const TensorView q_bf16 = make_tensor_view(fake(0x3000), DType::kBFloat16, {96, 64}, 0);
  EXPECT_NE(
      cast_error(rows, {}, q_bf16)
          .find("float8_cast: q_transposed must be a contiguous float8 [96, 64] for t [64, 96], "
                "got bfloat16 [96, 64]"),
      std::string::npos);
  const TensorView e5m2_t = make_tensor_view(fake(0x4000), DType::kFloat8E5M2, {96, 64}, 0);
  EXPECT_NE(cast_error(rows, q, e5m2_t)
                .find("float8_cast: q is float8_e4m3fn and q_transposed float8_e5m2; one dtype"),
            std::string::npos);
  const TensorView one = make_tensor_view(fake(0x2000), DType::kFloat32, {1}, 0);
  EXPECT_NE(cast_error(one, q, q_t, Float8Scales::kColumns)
                .find("float8_cast: multiplier must be 96 contiguous float32 values"),
            std::string::npos);
}

}  // namespace
}  // namespace meshla
