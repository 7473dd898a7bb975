// cuBLASMp, opened at run time. libmeshla does not link it: libcublasmp needs the GPU driver
// (libcuda) and NVSHMEM to load, and meshla must load without them (CI, machines without
// cuBLASMp). The backend asks for the library when a plan wants it and reports why it is missing.
//
// Built against cuBLASMp 0.7, the last release that runs on NCCL 2.28 (0.8 onwards needs NCCL
// 2.29): its overlapped algorithms need the device workspace on NVSHMEM's symmetric heap, which
// cuBLASMp initialises when the first grid is created, so nvshmem_malloc/nvshmem_free are
// resolved from the NVSHMEM library libcublasmp brings in.
#pragma once

#include <cstddef>
#include <string>

#include <cublasmp.h>

#include "core/checks.hpp"

namespace meshla::collective {

struct CublasMpLibrary {
  decltype(&cublasMpCreate) create;
  decltype(&cublasMpDestroy) destroy;
  decltype(&cublasMpStreamSet) stream_set;
  decltype(&cublasMpGridCreate) grid_create;
  decltype(&cublasMpGridDestroy) grid_destroy;
  decltype(&cublasMpMatrixDescriptorCreate) matrix_descriptor_create;
  decltype(&cublasMpMatrixDescriptorDestroy) matrix_descriptor_destroy;
  decltype(&cublasMpMatmulDescriptorCreate) matmul_descriptor_create;
  decltype(&cublasMpMatmulDescriptorDestroy) matmul_descriptor_destroy;
  decltype(&cublasMpMatmulDescriptorAttributeSet) matmul_descriptor_attribute_set;
  decltype(&cublasMpMatmul_bufferSize) matmul_buffer_size;
  decltype(&cublasMpMatmul) matmul;
  void* (*nvshmem_malloc)(std::size_t bytes);
  void (*nvshmem_free)(void* pointer);
  int version;  // cublasMpGetVersion: major * 1000 + minor * 100 + patch
};

// The library, opened once per process (MESHLA_CUBLASMP_LIBRARY names the file; otherwise
// libcublasmp.so.0 on the loader's path, which includes the nvidia-cublasmp-cu13 wheel beside an
// installed meshla). nullptr, with `why` set, when it cannot be used: not found, the driver or
// NVSHMEM missing, another cuBLASMp version, or an NCCL older than it needs.
const CublasMpLibrary* cublasmp_library(std::string* why);

// "CUBLASMP_STATUS_INVALID_VALUE" and so on (cuBLASMp 0.7 has no status-string function).
const char* cublasmp_status_name(cublasMpStatus_t status);

}  // namespace meshla::collective

#define MESHLA_CHECK_CUBLASMP(call)                                                        \
  do {                                                                                     \
    const cublasMpStatus_t meshla_status_ = (call);                                        \
    MESHLA_CHECK(                                                                          \
        kCublas, meshla_status_ == CUBLASMP_STATUS_SUCCESS,                                \
        #call << " failed: " << ::meshla::collective::cublasmp_status_name(meshla_status_) \
              << " at " << __FILE__ << ":" << __LINE__);                                   \
  } while (false)
