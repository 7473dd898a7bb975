// Move-only RAII owners of CUDA runtime objects, and a guard that makes a device current for a
// scope and restores the caller's device afterwards.
#pragma once

#include <chrono>
#include <cstddef>
#include <utility>

#include <cuda_runtime_api.h>

namespace meshla::detail {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// Owns a non-blocking stream; `priority` as cudaDeviceGetStreamPriorityRange (lower is higher).
class Stream {
 public:
  Stream() = default;
  Stream(int device, bool high_priority);
  ~Stream();
  Stream(Stream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}
  Stream& operator=(Stream&& other) noexcept;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// Owns an event without timing (cheapest to record and wait on).
class Event {
 public:
  Event() = default;
  explicit Event(int device);
  ~Event();
  Event(Event&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  Event& operator=(Event&& other) noexcept;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// Owns device memory from cudaMalloc.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(int device, std::size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// Owns device memory from the stream-ordered allocator, allocated and freed in the order of a
// stream that outlives it. Neither waits for the device's other work, let alone a peer device's:
// cudaFree does, with peer access enabled, and with several GPUs driven from one process a peer's
// queued work may wait for this very thread.
class StreamBuffer {
 public:
  StreamBuffer() = default;
  // Usable on any stream when this returns.
  StreamBuffer(std::size_t bytes, cudaStream_t stream);
  ~StreamBuffer();
  StreamBuffer(StreamBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)),
        stream_(other.stream_) {}
  StreamBuffer& operator=(StreamBuffer&& other) noexcept;
  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  cudaStream_t stream_ = nullptr;
};

// Whether meshla's Hopper kernels (CUTLASS with TMA and WGMMA, built for sm_90a alone) run on
// `device`: compute capability 9.0, unless the environment sets MESHLA_PORTABLE=1, which sends
// every call down the paths other GPUs take (how those are tested on Hopper).
bool runs_hopper_kernels(int device);

// Polls `event` until it has completed or `timeout` has passed: cudaSuccess, cudaErrorNotReady
// on timeout, or the error the event reports. Never throws, so destructors may use it.
cudaError_t wait_for_event(cudaEvent_t event, std::chrono::milliseconds timeout);
// The same for all the work enqueued on `stream` so far.
cudaError_t wait_for_stream(cudaStream_t stream, std::chrono::milliseconds timeout);

}  // namespace meshla::detail
