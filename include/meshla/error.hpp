// The single error type of meshla. Every failure, from a bad argument to a failed NCCL call, is
// reported as a meshla::Error carrying a code that the bindings map to the host language's own
// exception kinds (ValueError, NotImplementedError, RuntimeError, ffi::Error).
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

#include "meshla/export.hpp"

namespace meshla {

enum class ErrorCode {
  kInvalidArgument,  // the caller passed something wrong: shapes, dtypes, devices, options
  kNotImplemented,   // a valid request this build or backend does not support
  kCuda,             // a CUDA runtime or driver call failed
  kNccl,             // an NCCL call failed
  kCublas,           // a cuBLAS / cuBLASLt call failed
  kCusolver,         // a cuSOLVER call failed
  kTimeout,          // a bounded wait ran out
  kInternal,         // a broken invariant inside meshla
};

MESHLA_API std::string_view error_code_name(ErrorCode code);

class MESHLA_API Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message);
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace meshla
