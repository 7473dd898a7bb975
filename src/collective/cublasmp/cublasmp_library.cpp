#include "collective/cublasmp/cublasmp_library.hpp"

#include <mutex>
#include <sstream>

#include <nccl.h>

#include "core/shared_library.hpp"

namespace meshla::collective {
namespace {

// NCCL that cuBLASMp 0.7 was built for (its wheel's requirement).
constexpr int kMinimumNcclVersion = 22803;

template <typename Function>
void resolve(void* library, const char* name, Function* out, std::string* why) {
  detail::resolve_symbol(library, "cuBLASMp library", name, out, why);
}

struct Loaded {
  CublasMpLibrary library{};
  std::string why;  // empty when the library is usable
};

Loaded load() {
  Loaded loaded;
  // Never closed: NVSHMEM, which cuBLASMp starts, must stay mapped until the process ends.
  void* handle = detail::open_library("MESHLA_CUBLASMP_LIBRARY", "libcublasmp.so.0",
                                      "pip install nvidia-cublasmp-cu13==0.7.*", &loaded.why);
  if (handle == nullptr) return loaded;
  CublasMpLibrary& l = loaded.library;
  std::string& why = loaded.why;
  decltype(&cublasMpGetVersion) get_version = nullptr;
  resolve(handle, "cublasMpGetVersion", &get_version, &why);
  resolve(handle, "cublasMpCreate", &l.create, &why);
  resolve(handle, "cublasMpDestroy", &l.destroy, &why);
  resolve(handle, "cublasMpStreamSet", &l.stream_set, &why);
  resolve(handle, "cublasMpGridCreate", &l.grid_create, &why);
  resolve(handle, "cublasMpGridDestroy", &l.grid_destroy, &why);
  resolve(handle, "cublasMpMatrixDescriptorCreate", &l.matrix_descriptor_create, &why);
  resolve(handle, "cublasMpMatrixDescriptorDestroy", &l.matrix_descriptor_destroy, &why);
  resolve(handle, "cublasMpMatmulDescriptorCreate", &l.matmul_descriptor_create, &why);
  resolve(handle, "cublasMpMatmulDescriptorDestroy", &l.matmul_descriptor_destroy, &why);
  resolve(handle, "cublasMpMatmulDescriptorAttributeSet", &l.matmul_descriptor_attribute_set, &why);
  resolve(handle, "cublasMpMatmul_bufferSize", &l.matmul_buffer_size, &why);
  resolve(handle, "cublasMpMatmul", &l.matmul, &why);
  // dlsym on a handle searches its dependencies too: NVSHMEM comes with libcublasmp.
  resolve(handle, "nvshmem_malloc", &l.nvshmem_malloc, &why);
  resolve(handle, "nvshmem_free", &l.nvshmem_free, &why);
  if (!why.empty()) return loaded;

  if (get_version(&l.version) != CUBLASMP_STATUS_SUCCESS) {
    why = "cublasMpGetVersion failed";
    return loaded;
  }
  // Workspace and bias rules differ between minor releases; run only the one built against.
  if (l.version / 100 != CUBLASMP_VERSION / 100) {
    std::ostringstream message;
    message << "loaded cuBLASMp " << l.version / 1000 << "." << l.version / 100 % 10
            << " but meshla was built against " << CUBLASMP_VER_MAJOR << "." << CUBLASMP_VER_MINOR;
    why = message.str();
    return loaded;
  }
  int nccl_version = 0;
  if (ncclGetVersion(&nccl_version) != ncclSuccess || nccl_version < kMinimumNcclVersion) {
    std::ostringstream message;
    message << "cuBLASMp " << CUBLASMP_VER_MAJOR << "." << CUBLASMP_VER_MINOR
            << " needs NCCL 2.28.3 or newer; this process has NCCL code " << nccl_version;
    why = message.str();
  }
  return loaded;
}

}  // namespace

const CublasMpLibrary* cublasmp_library(std::string* why) {
  static const Loaded loaded = load();
  if (!loaded.why.empty()) {
    if (why != nullptr) *why = loaded.why;
    return nullptr;
  }
  return &loaded.library;
}

const char* cublasmp_status_name(cublasMpStatus_t status) {
  switch (status) {
    case CUBLASMP_STATUS_SUCCESS:
      return "CUBLASMP_STATUS_SUCCESS";
    case CUBLASMP_STATUS_NOT_INITIALIZED:
      return "CUBLASMP_STATUS_NOT_INITIALIZED";
    case CUBLASMP_STATUS_ALLOCATION_FAILED:
      return "CUBLASMP_STATUS_ALLOCATION_FAILED";
    case CUBLASMP_STATUS_INVALID_VALUE:
      return "CUBLASMP_STATUS_INVALID_VALUE";
    case CUBLASMP_STATUS_ARCHITECTURE_MISMATCH:
      return "CUBLASMP_STATUS_ARCHITECTURE_MISMATCH";
    case CUBLASMP_STATUS_EXECUTION_FAILED:
      return "CUBLASMP_STATUS_EXECUTION_FAILED";
    case CUBLASMP_STATUS_INTERNAL_ERROR:
      return "CUBLASMP_STATUS_INTERNAL_ERROR";
    case CUBLASMP_STATUS_NOT_SUPPORTED:
      return "CUBLASMP_STATUS_NOT_SUPPORTED";
  }
  return "unknown cuBLASMp status";
}

}  // namespace meshla::collective
