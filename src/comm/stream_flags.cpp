#include "comm/stream_flags.hpp"

#include <cuda.h>

#include "core/checks.hpp"
#include "core/cuda_checks.hpp"

namespace meshla::detail {
namespace {

// libmeshla does not link libcuda (it must import on machines without a driver), so the driver
// functions come from the runtime's entry-point table, looked up once.
struct DriverFlags {
  using StreamValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
  using ErrorName = CUresult (*)(CUresult, const char**);
  StreamValue32 write = nullptr;
  StreamValue32 wait = nullptr;
  ErrorName error_name = nullptr;
};

template <typename Function>
Function driver_function(const char* name) {
  void* function = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  MESHLA_CHECK_CUDA(
      cudaGetDriverEntryPointByVersion(name, &function, 12000, cudaEnableDefault, &found));
  MESHLA_CHECK(kCuda, found == cudaDriverEntryPointSuccess && function != nullptr,
               "the CUDA driver does not provide " << name);
  return reinterpret_cast<Function>(function);
}

const DriverFlags& driver() {
  static const DriverFlags flags{
      .write = driver_function<DriverFlags::StreamValue32>("cuStreamWriteValue32"),
      .wait = driver_function<DriverFlags::StreamValue32>("cuStreamWaitValue32"),
      .error_name = driver_function<DriverFlags::ErrorName>("cuGetErrorName")};
  return flags;
}

void check_driver(CUresult status, const char* call, const std::uint32_t* flag) {
  if (status == CUDA_SUCCESS) return;
  const char* name = "unknown error";
  driver().error_name(status, &name);
  MESHLA_THROW(kCuda, call << " on flag " << static_cast<const void*>(flag) << " failed: " << name);
}

}  // namespace

void write_flag(cudaStream_t stream, std::uint32_t* flag, std::uint32_t value) {
  // The default flags keep the memory barrier that makes earlier writes visible first.
  check_driver(
      driver().write(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(flag), value,
                     CU_STREAM_WRITE_VALUE_DEFAULT),
      "cuStreamWriteValue32", flag);
}

void wait_flag(cudaStream_t stream, std::uint32_t* flag, std::uint32_t value) {
  check_driver(driver().wait(reinterpret_cast<CUstream>(stream),
                             reinterpret_cast<CUdeviceptr>(flag), value, CU_STREAM_WAIT_VALUE_EQ),
               "cuStreamWaitValue32", flag);
}

}  // namespace meshla::detail
