#include "core/cuda_handles.hpp"

#include <cstdlib>
#include <string_view>
#include <thread>

#include "core/cuda_checks.hpp"

namespace meshla::detail {

DeviceGuard::DeviceGuard(int device) {
  MESHLA_CHECK_CUDA(cudaGetDevice(&previous_));
  if (previous_ != device) MESHLA_CHECK_CUDA(cudaSetDevice(device));
}

DeviceGuard::~DeviceGuard() {
  int current = -1;
  // Destructors must not throw; a failure to restore leaves the device the guard selected.
  if (cudaGetDevice(&current) == cudaSuccess && current != previous_) cudaSetDevice(previous_);
}

Stream::Stream(int device, bool high_priority) {
  DeviceGuard guard(device);
  int least = 0;
  int greatest = 0;
  MESHLA_CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  MESHLA_CHECK_CUDA(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking,
                                                 high_priority ? greatest : least));
}

Stream::~Stream() {
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

Event::Event(int device) {
  DeviceGuard guard(device);
  MESHLA_CHECK_CUDA(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
}

Event::~Event() {
  if (event_ != nullptr) cudaEventDestroy(event_);
}

Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    if (event_ != nullptr) cudaEventDestroy(event_);
    event_ = std::exchange(other.event_, nullptr);
  }
  return *this;
}

DeviceBuffer::DeviceBuffer(int device, std::size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  DeviceGuard guard(device);
  MESHLA_CHECK_CUDA(cudaMalloc(&data_, bytes));
}

DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr) cudaFree(data_);
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) cudaFree(data_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

StreamBuffer::StreamBuffer(std::size_t bytes, cudaStream_t stream)
    : bytes_(bytes), stream_(stream) {
  if (bytes == 0) return;
  MESHLA_CHECK_CUDA(cudaMallocAsync(&data_, bytes, stream));
  MESHLA_CHECK_CUDA(cudaStreamSynchronize(stream));
}

StreamBuffer::~StreamBuffer() {
  if (data_ != nullptr) cudaFreeAsync(data_, stream_);
}

StreamBuffer& StreamBuffer::operator=(StreamBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) cudaFreeAsync(data_, stream_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    stream_ = other.stream_;
  }
  return *this;
}

namespace {

// Calls `query` until it reports anything but cudaErrorNotReady, or `timeout` has passed.
template <typename Query>
cudaError_t poll(Query query, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::microseconds(10);
  cudaError_t status = query();
  while (status == cudaErrorNotReady && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
    status = query();
  }
  return status;
}

}  // namespace

cudaError_t wait_for_event(cudaEvent_t event, std::chrono::milliseconds timeout) {
  return poll([event] { return cudaEventQuery(event); }, timeout);
}

cudaError_t wait_for_stream(cudaStream_t stream, std::chrono::milliseconds timeout) {
  return poll([stream] { return cudaStreamQuery(stream); }, timeout);
}

bool runs_hopper_kernels(int device) {
  const char* portable = std::getenv("MESHLA_PORTABLE");
  if (portable != nullptr && std::string_view(portable) == "1") return false;
  int major = 0, minor = 0;
  MESHLA_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  MESHLA_CHECK_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  return major == 9 && minor == 0;
}

}  // namespace meshla::detail
