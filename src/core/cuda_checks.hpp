// Checks of CUDA, NCCL and cuBLAS status codes. The message names the failing call as
// written at the call site, its status string and the source location, e.g.
//   ncclGroupEnd() failed: unhandled cuda error (ncclUnhandledCudaError) at src/comm/...:42
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "core/checks.hpp"

namespace meshla::detail {

[[noreturn]] void throw_cuda_error(cudaError_t status, const char* call, const char* file,
                                   int line);
[[noreturn]] void throw_nccl_error(ncclResult_t status, const char* call, const char* file,
                                   int line);
[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* call, const char* file,
                                     int line);

}  // namespace meshla::detail

#define MESHLA_CHECK_CUDA(call)                                                      \
  do {                                                                               \
    const cudaError_t meshla_status_ = (call);                                       \
    if (meshla_status_ != cudaSuccess)                                               \
      ::meshla::detail::throw_cuda_error(meshla_status_, #call, __FILE__, __LINE__); \
  } while (false)

// ncclInProgress counts as a failure here: only communicator creation, which waits for it
// itself, uses nonblocking communicators.
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
