// Checks of CUDA, NCCL, cuBLAS and cuSOLVER status codes. The message names the failing call as
// written at the call site, its status string and the source location, e.g.
//   ncclGroupEnd() failed: unhandled cuda error (ncclUnhandledCudaError) at src/comm/...:42
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <cusolverDn.h>
#include <nccl.h>

#include "core/checks.hpp"

namespace meshla::detail {

[[noreturn]] void throw_cuda_error(cudaError_t status, const char* call, const char* file,
                                   int line);
[[noreturn]] void throw_nccl_error(ncclResult_t status, const char* call, const char* file,
                                   int line);
[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* call, const char* file,
                                     int line);
[[noreturn]] void throw_cusolver_error(cusolverStatus_t status, const char* call, const char* file,
                                       int line);

}  // namespace meshla::detail

#define MESHLA_CHECK_CUDA(call)                                                      \
  do {                                                                               \
    const cudaError_t meshla_status_ = (call);                                       \
    if (meshla_status_ != cudaSuccess)                                               \
      ::meshla::detail::throw_cuda_error(meshla_status_, #call, __FILE__, __LINE__); \
  } while (false)

// ncclInProgress is not an error for nonblocking communicators; callers that can see it wait on
// the communicator (comm/nccl.hpp) instead of using this macro directly on the raw status.
#define MESHLA_CHECK_NCCL(call)                                                      \
  do {                                                                               \
    const ncclResult_t meshla_status_ = (call);                                      \
    if (meshla_status_ != ncclSuccess)                                               \
      ::meshla::detail::throw_nccl_error(meshla_status_, #call, __FILE__, __LINE__); \
  } while (false)

#define MESHLA_CHECK_CUBLAS(call)                                                      \
  do {                                                                                 \
    const cublasStatus_t meshla_status_ = (call);                                      \
    if (meshla_status_ != CUBLAS_STATUS_SUCCESS)                                       \
      ::meshla::detail::throw_cublas_error(meshla_status_, #call, __FILE__, __LINE__); \
  } while (false)

#define MESHLA_CHECK_CUSOLVER(call)                                                      \
  do {                                                                                   \
    const cusolverStatus_t meshla_status_ = (call);                                      \
    if (meshla_status_ != CUSOLVER_STATUS_SUCCESS)                                       \
      ::meshla::detail::throw_cusolver_error(meshla_status_, #call, __FILE__, __LINE__); \
  } while (false)
