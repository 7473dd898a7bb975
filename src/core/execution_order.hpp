// The order of the runs of work that share buffers (the executions of one plan, or of every plan
// on one workspace), whatever streams they are enqueued on, without a host wait.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>

#include <cuda_runtime_api.h>

#include "core/cuda_handles.hpp"

namespace meshla::detail {

class ExecutionOrder {
 public:
  explicit ExecutionOrder(int device);

  // Makes `stream` wait for the previous run: an eager run for the last eager run, a run captured
  // into a CUDA graph for the last run captured in the same capture (an event recorded inside a
  // capture cannot be waited on outside it; between a graph's replays and other work the caller
  // orders, as for any captured buffer). Returns the event that the caller records on `stream`
  // once the run is enqueued, and also when enqueuing it failed, so that no later run waits for
  // an event that was never recorded.
  cudaEvent_t begin(cudaStream_t stream);

  // Polls until the last eager run has finished on the device or `timeout` has passed:
  // wait_for_event's status, cudaSuccess when nothing ran. Never throws.
  cudaError_t wait_for_last_eager(std::chrono::milliseconds timeout) const;

  // Runs begun inside a capture so far: their graphs may replay them at any later time.
  std::uint64_t captured_runs() const { return captured_runs_; }

 private:
  Event done_;  // recorded on the caller's stream after the last eager run
  bool executed_ = false;
  Event captured_done_;  // `done_` of the last captured run, inside capture captured_in_
  std::optional<unsigned long long> captured_in_;
  std::uint64_t captured_runs_ = 0;
};

}  // namespace meshla::detail
