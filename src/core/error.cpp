#include "meshla/error.hpp"

#include <string>

#include "core/cuda_checks.hpp"

namespace meshla {

std::string_view error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      return "invalid argument";
    case ErrorCode::kNotImplemented:
      return "not implemented";
    case ErrorCode::kCuda:
      return "CUDA error";
    case ErrorCode::kNccl:
      return "NCCL error";
    case ErrorCode::kCublas:
      return "cuBLAS error";
    case ErrorCode::kCusolver:
      return "cuSOLVER error";
    case ErrorCode::kTimeout:
      return "timeout";
    case ErrorCode::kInternal:
      return "internal error";
  }
  return "unknown error";
}

Error::Error(ErrorCode code, const std::string& message)
    : std::runtime_error(message), code_(code) {}

namespace detail {
namespace {

[[noreturn]] void throw_call_error(ErrorCode code, const char* call, std::string_view status,
                                   const char* file, int line) {
  std::ostringstream message;
  message << call << " failed: " << status << " at " << file << ":" << line;
  throw Error(code, message.str());
}

}  // namespace

void throw_cuda_error(cudaError_t status, const char* call, const char* file, int line) {
  std::string status_text =
      std::string(cudaGetErrorString(status)) + " (" + cudaGetErrorName(status) + ")";
  throw_call_error(ErrorCode::kCuda, call, status_text, file, line);
}

void throw_nccl_error(ncclResult_t status, const char* call, const char* file, int line) {
  std::string status_text = ncclGetErrorString(status);
  const char* last = ncclGetLastError(nullptr);
  if (last != nullptr && *last != '\0') status_text += std::string(": ") + last;
  throw_call_error(ErrorCode::kNccl, call, status_text, file, line);
}

void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line) {
  std::string status_text =
      std::string(cublasLtGetStatusString(status)) + " (" + cublasLtGetStatusName(status) + ")";
  throw_call_error(ErrorCode::kCublas, call, status_text, file, line);
}

}  // namespace detail
}  // namespace meshla
