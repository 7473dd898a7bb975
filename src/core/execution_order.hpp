// The order of the runs of work that share buffers (the executions of one plan, or of every plan
// on one workspace), whatever streams they are enqueued on, without a host wait; and a watchdog
// that ends the process when an eager run never finishes.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include <cuda_runtime_api.h>

#include "core/cuda_handles.hpp"

namespace meshla::detail {

class ExecutionOrder {
 public:
  // `context` says whose runs these are in the watchdog's message ("rank 1 of 4, cuda:1"). An
  // eager run that has not finished on the device `timeout` after it was enqueued ends
  // the process with that message: its waits on peers (stream memory operations, NCCL kernels) have
  // no bound of their own, so a rank of the group that died or never made its matching call would
  // leave this rank's streams, and every host thread that synchronises with them, waiting forever.
  // Runs inside a CUDA graph capture are not watched: their replays are the graph's.
  ExecutionOrder(int device, std::string context, std::chrono::milliseconds timeout);
  ~ExecutionOrder();
  ExecutionOrder(const ExecutionOrder&) = delete;
  ExecutionOrder& operator=(const ExecutionOrder&) = delete;

  // Makes `stream` wait for the previous run: an eager run for the last eager run, a run captured
  // into a CUDA graph for the last run captured in the same capture (an event recorded inside a
  // capture cannot be waited on outside it; between a graph's replays and other work the caller
  // orders, as for any captured buffer). `run` names the run for the watchdog: a string with
  // static storage duration ("all_gather_matmul (backend=nccl)").
  void begin(cudaStream_t stream, const char* run);
  // Marks the end of the run begun last, once its work is enqueued on `stream`; an eager run is
  // watched from here.
  void end(cudaStream_t stream);
  // end() after enqueuing failed part way, so that no later run waits for an event that was never
  // recorded: best effort, never throws, so the first error stays the one reported.
  void end_after_failure(cudaStream_t stream) noexcept;

  // Polls until the last eager run has finished on the device or `timeout` has passed:
  // wait_for_event's status, cudaSuccess when nothing ran. Never throws.
  cudaError_t wait_for_last_eager(std::chrono::milliseconds timeout) const;

  // Runs begun inside a capture so far: their graphs may replay them at any later time.
  std::uint64_t captured_runs() const { return captured_runs_; }

 private:
  friend class ExecutionWatchdog;
  // The watchdog's question: whether the last eager run is still unfinished `timeout_` after it
  // was enqueued (at `now`, steady-clock nanoseconds); forgets a run seen finished.
  bool overdue(std::int64_t now);
  // Starts watching the run that end() ends, if it is eager.
  void watch() noexcept;

  const std::string context_;
  const std::chrono::milliseconds timeout_;
  Event done_;  // recorded on the caller's stream after the last eager run
  bool executed_ = false;
  Event captured_done_;  // `done_` of the last captured run, inside capture captured_in_
  std::optional<unsigned long long> captured_in_;
  std::uint64_t captured_runs_ = 0;
  cudaEvent_t ending_ = nullptr;  // the event that end() records: done_ or captured_done_
  const char* beginning_ = "";    // the name begin() was given
  std::atomic<const char*> watched_run_{""};  // the name of the last eager run
  // When the last eager run was enqueued (steady-clock nanoseconds); 0 once seen finished.
  std::atomic<std::int64_t> watched_since_{0};
};

}  // namespace meshla::detail
