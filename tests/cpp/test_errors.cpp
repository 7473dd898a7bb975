// The check macros name the failing call, its status string and the error code.
#include <gtest/gtest.h>

#include <limits>

#include "core/cuda_checks.hpp"
#include "core/cuda_types.hpp"
#include "core/timeout.hpp"

namespace meshla {
namespace {

template <typename Call>
Error caught(Call&& call) {
  try {
    call();
  } catch (const Error& error) {
    return error;
  }
  ADD_FAILURE() << "no error was raised";
  return Error(ErrorCode::kInternal, "");
}

TEST(Errors, CudaCheckNamesTheCall) {
  // Fails with or without a GPU: no device has an exabyte.
  const Error error = caught([] {
    void* pointer = nullptr;
    MESHLA_CHECK_CUDA(cudaMalloc(&pointer, std::size_t{1} << 60));
  });
  EXPECT_EQ(error.code(), ErrorCode::kCuda);
  const std::string message = error.what();
  EXPECT_NE(message.find("cudaMalloc(&pointer, std::size_t{1} << 60) failed: "), std::string::npos)
      << message;
  EXPECT_NE(message.find("(cuda"), std::string::npos) << message;  // the status name
  EXPECT_NE(message.find("test_errors.cpp"), std::string::npos) << message;
}

TEST(Errors, NcclCheckNamesTheCall) {
  const Error error = caught([] {
    int count = 0;
    MESHLA_CHECK_NCCL(ncclCommCount(nullptr, &count));
  });
  EXPECT_EQ(error.code(), ErrorCode::kNccl);
  const std::string message = error.what();
  EXPECT_NE(message.find("ncclCommCount(nullptr, &count) failed: "), std::string::npos) << message;
  EXPECT_NE(message.find("invalid argument"), std::string::npos) << message;
}

TEST(Errors, CublasCheckNamesTheCall) {
  const Error error = caught([] {
    // An attribute value of the wrong size is invalid.
    cublasLtMatmulDesc_t desc = nullptr;
    MESHLA_CHECK_CUBLAS(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const char too_small = 0;
    const cublasStatus_t status =
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &too_small, 1);
    cublasLtMatmulDescDestroy(desc);
    MESHLA_CHECK_CUBLAS(status);
  });
  EXPECT_EQ(error.code(), ErrorCode::kCublas);
  EXPECT_NE(std::string(error.what()).find("CUBLAS_STATUS_INVALID_VALUE"), std::string::npos)
      << error.what();
}

TEST(Errors, ArgumentChecksCarryTheMessage) {
  const Error error = caught([] {
    const int m = 1001;
    MESHLA_CHECK_ARG(m % 4 == 0, "all_gather_matmul: m=" << m << " is not divisible by tp_size=4");
  });
  EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
  EXPECT_STREQ(error.what(), "all_gather_matmul: m=1001 is not divisible by tp_size=4");
  EXPECT_EQ(error_code_name(ErrorCode::kTimeout), "timeout");
}

TEST(Errors, CudaDataTypeCoversEveryFloatingDtype) {
  EXPECT_EQ(detail::cuda_data_type(DType::kFloat32), CUDA_R_32F);
  EXPECT_EQ(detail::cuda_data_type(DType::kFloat64), CUDA_R_64F);
  EXPECT_EQ(detail::cuda_data_type(DType::kFloat16), CUDA_R_16F);
  EXPECT_EQ(detail::cuda_data_type(DType::kBFloat16), CUDA_R_16BF);
  EXPECT_EQ(detail::cuda_data_type(DType::kComplex64), CUDA_C_32F);
  EXPECT_EQ(detail::cuda_data_type(DType::kComplex128), CUDA_C_64F);
  const Error error = caught([] { detail::cuda_data_type(DType::kInt64); });
  EXPECT_EQ(error.code(), ErrorCode::kNotImplemented);
  EXPECT_NE(std::string(error.what()).find("int64"), std::string::npos) << error.what();
}

TEST(Errors, TimeoutsArePositiveFiniteAndAtMostThirtyDays) {
  using std::chrono::milliseconds;
  EXPECT_EQ(detail::timeout_from_seconds(300.0), milliseconds(300000));
  EXPECT_EQ(detail::timeout_from_seconds(1e-4), milliseconds(1));  // never a zero wait
  EXPECT_EQ(detail::timeout_from_seconds(30.0 * 24 * 3600), milliseconds(2592000000LL));
  for (double seconds : {0.0, -1.0, 1e10, std::numeric_limits<double>::infinity(),
                         std::numeric_limits<double>::quiet_NaN()}) {
    const Error error = caught([&] { detail::timeout_from_seconds(seconds); });
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument) << seconds;
    EXPECT_NE(std::string(error.what()).find("timeout_s="), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace meshla
