// The GEMM's shape rules (check_matmul_shape, which Matmul::prepare and run apply): dtypes of
// each operand, fp8's scales, operand order and row alignment; every message says what is wrong.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "error_message.hpp"
#include "meshla/error.hpp"
#include "meshla/matmul.hpp"

namespace meshla {
namespace {

MatmulShape fp8_shape() {
  return {.dtype = DType::kFloat8E4M3,
          .out_dtype = DType::kBFloat16,
          .scaling = MatmulScaling::kTensorwise,
          .m = 64,
          .n = 32,
          .k = 128,
          .trans_b = true};
}

TEST(MatmulShape, SixteenAndThirtyTwoBitProductsTakeOneDtypeAndNoScales) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    check_matmul_shape({.dtype = dtype, .m = 8, .n = 8, .k = 8});
  }
  EXPECT_NE(
      message_of([] { check_matmul_shape({.dtype = DType::kFloat64, .m = 8, .n = 8, .k = 8}); },
                 ErrorCode::kNotImplemented)
          .find("matmul: dtype float64 is not supported"),
      std::string::npos);
  EXPECT_NE(
      message_of(
          [] {
            check_matmul_shape(
                {.dtype = DType::kBFloat16, .out_dtype = DType::kFloat32, .m = 8, .n = 8, .k = 8});
          },
          ErrorCode::kInvalidArgument)
          .find("a bfloat16 product takes b and d of its dtype, not b bfloat16 and d "
                "float32"),
      std::string::npos);
  EXPECT_NE(message_of(
                [] {
                  check_matmul_shape({.dtype = DType::kFloat16,
                                      .scaling = MatmulScaling::kRowwise,
                                      .m = 8,
                                      .n = 8,
                                      .k = 8});
                },
                ErrorCode::kInvalidArgument)
                .find("scales apply to float8 operands, not float16"),
            std::string::npos);
}

TEST(MatmulShape, Fp8ProductsTakeScalesKMajorOperandsAndAlignedRows) {
  check_matmul_shape(fp8_shape());
  MatmulShape rowwise = fp8_shape();
  rowwise.scaling = MatmulScaling::kRowwise;
  rowwise.b_dtype = DType::kFloat8E5M2;  // e4m3 x e5m2, as a gradient's GEMM
  rowwise.out_dtype = DType::kFloat32;
  check_matmul_shape(rowwise);

  const auto refused = [](MatmulShape shape, ErrorCode code, const std::string& words) {
    const std::string message = message_of([&] { check_matmul_shape(shape); }, code);
    EXPECT_NE(message.find(words), std::string::npos) << message;
  };
  MatmulShape s = fp8_shape();
  s.b_dtype = DType::kBFloat16;
  refused(s, ErrorCode::kInvalidArgument, "a (float8_e4m3fn) and b (bfloat16) must both be float8");
  s = fp8_shape();
  s.dtype = DType::kFloat8E5M2;
  s.b_dtype = DType::kFloat8E5M2;
  refused(s, ErrorCode::kNotImplemented, "no float8_e5m2 x float8_e5m2 GEMM");
  s = fp8_shape();
  s.out_dtype = DType::kFloat8E4M3;
  refused(s, ErrorCode::kInvalidArgument,
          "a float8 product's d is bfloat16, float16 or float32, not float8_e4m3fn");
  s = fp8_shape();
  s.out_dtype.reset();  // d defaults to a's dtype
  refused(s, ErrorCode::kInvalidArgument, "not float8_e4m3fn");
  s = fp8_shape();
  s.scaling = MatmulScaling::kNone;
  refused(s, ErrorCode::kInvalidArgument, "float8 operands need their scales");
  s = fp8_shape();
  s.trans_b = false;
  refused(s, ErrorCode::kNotImplemented, "float8 needs b stored [n, k] (trans_b)");
  s = fp8_shape();
  s.k = 120;
  refused(s, ErrorCode::kInvalidArgument,
          "float8 rows must start 16 bytes apart: k=120, lda=120 and ldb=120 must be multiples "
          "of 16");
  s = fp8_shape();
  s.lda = 136;
  refused(s, ErrorCode::kInvalidArgument, "lda=136");
  s = fp8_shape();
  s.addend = true;
  refused(s, ErrorCode::kNotImplemented, "a float8 product takes no addend");
  s = fp8_shape();
  s.bias = true;
  check_matmul_shape(s);  // a bias in d's dtype, bfloat16
  s.out_dtype = DType::kFloat32;
  refused(s, ErrorCode::kNotImplemented, "a float8 product with a float32 d takes no bias");
  s = fp8_shape();
  s.scaling = MatmulScaling::kRowwise;
  s.batch = 2;
  s.batch_stride_a = 64 * 128;
  s.batch_stride_d = 64 * 32;
  refused(s, ErrorCode::kNotImplemented, "rowwise scales take a batch of 1, not 2");
  s = fp8_shape();
  s.scaling = MatmulScaling::kRowwise;
  s.out_dtype = DType::kFloat16;
  refused(s, ErrorCode::kNotImplemented,
          "a rowwise float8 product's d is bfloat16 or float32, not float16");
}

}  // namespace
}  // namespace meshla
