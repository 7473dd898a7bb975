// Checks of cuSOLVER status codes (cusolverDn and cuSolverMg share cusolverStatus_t), named
// like the CUDA ones in core/cuda_checks.hpp: the failing call, its status and the location.
#pragma once

#include <cusolver_common.h>

#include <string_view>

#include "core/checks.hpp"

namespace meshla::solver {

inline std::string_view cusolver_status_name(cusolverStatus_t status) {
  switch (status) {
    case CUSOLVER_STATUS_NOT_INITIALIZED:
      return "CUSOLVER_STATUS_NOT_INITIALIZED";
    case CUSOLVER_STATUS_ALLOC_FAILED:
      return "CUSOLVER_STATUS_ALLOC_FAILED";
    case CUSOLVER_STATUS_INVALID_VALUE:
      return "CUSOLVER_STATUS_INVALID_VALUE";
    case CUSOLVER_STATUS_ARCH_MISMATCH:
      return "CUSOLVER_STATUS_ARCH_MISMATCH";
    case CUSOLVER_STATUS_EXECUTION_FAILED:
      return "CUSOLVER_STATUS_EXECUTION_FAILED";
    case CUSOLVER_STATUS_INTERNAL_ERROR:
      return "CUSOLVER_STATUS_INTERNAL_ERROR";
    case CUSOLVER_STATUS_NOT_SUPPORTED:
      return "CUSOLVER_STATUS_NOT_SUPPORTED";
    default:
      return "cusolverStatus_t";
  }
}

}  // namespace meshla::solver

#define MESHLA_CHECK_CUSOLVER(call)                                                            \
  do {                                                                                         \
    const cusolverStatus_t meshla_status_ = (call);                                            \
    if (meshla_status_ != CUSOLVER_STATUS_SUCCESS)                                             \
      MESHLA_THROW(kCusolver,                                                                  \
                   #call " failed: " << ::meshla::solver::cusolver_status_name(meshla_status_) \
                                     << " (" << static_cast<int>(meshla_status_) << ") at "    \
                                     << __FILE__ << ":" << __LINE__);                          \
  } while (false)
