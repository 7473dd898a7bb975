// The order of the runs of work that share buffers (the executions of one plan, or of every plan
// on one workspace), whatever streams they are enqueued on, without a host wait; and a watchdog
// that ends the process when an eager run never finishes.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <cuda_runtime_api.h>

#include "core/cuda_handles.hpp"

namespace meshla::detail {

struct WatchedRuns;

class ExecutionOrder {
 public:
  // `context` says whose runs these are in the watchdog's message ("rank 1 of 4, cuda:1"). An
  // eager run that has not finished on the device `timeout` after it was enqueued ends
  // the process with that message: its waits on peers (stream memory operations, NCCL kernels) have
  // no bound of their own, so a rank of the group that died or never made its matching call would
  // leave this rank's streams, and every host thread that synchronises with them, waiting forever.
  // Runs inside a CUDA graph capture are not watched: their replays are the graph's.
  ExecutionOrder(int device, std::string context, std::chrono::milliseconds timeout);
  ExecutionOrder(const ExecutionOrder&) = delete;
  ExecutionOrder& operator=(const ExecutionOrder&) = delete;

  // Makes `stream` wait for the previous run: an eager run for the last eager run, a run captured
  // into a CUDA graph for the last run captured in the same capture (an event recorded inside a
  // capture cannot be waited on outside it; between a graph's replays and other work the caller
  // orders, as for any captured buffer). `run` names the run for the watchdog: a string with
  // static storage duration ("all_gather_matmul (backend=nccl)"). Returns the graph that
  // `stream` is capturing, nullptr for an eager run or an invalidated capture.
  cudaGraph_t begin(cudaStream_t stream, const char* run);
  // Marks the end of the run begun last, once its work is enqueued on `stream`; an eager run is
  // watched from here.
  void end(cudaStream_t stream);
  // end() after enqueuing failed part way, so that no later run waits for an event that was never
  // recorded: best effort, never throws, so the first error stays the one reported.
  void end_after_failure(cudaStream_t stream) noexcept;

  // Polls until the last eager run begun so far has finished on the device or `timeout` has
  // passed: wait_for_event's status, cudaSuccess when nothing ran. Runs begun meanwhile, on other
  // threads, do not prolong the wait. Never throws.
  cudaError_t wait_for_last_eager(std::chrono::milliseconds timeout) const;

  // Runs begun inside a capture so far: their graphs may replay them at any later time.
  std::uint64_t captured_runs() const { return captured_runs_; }

 private:
  // Records the end of the run begun last; an eager run's is watched from here.
  cudaError_t record_end(cudaStream_t stream) noexcept;

  // The eager runs' event and what the watchdog knows of them; shared with the watchdog, which
  // may still be querying the event while this order goes.
  std::shared_ptr<WatchedRuns> watched_;
  // Whether an eager run began: read by a plan's teardown, which may run on another thread than
  // the one beginning a sibling plan's runs.
  std::atomic<bool> executed_ = false;
  // Waits for the eager runs' event as it stands when wait_for_last_eager is called: polling the
  // event itself would follow it to every later record, and a plan let go of by a graph, on a
  // thread of its own, could wait behind its siblings' eager runs until the timeout.
  Stream waiter_;
  Event captured_done_;  // recorded after the last captured run, inside capture captured_in_
  std::optional<unsigned long long> captured_in_;
  std::uint64_t captured_runs_ = 0;
  bool ending_eager_ = false;   // what begin() began
  const char* beginning_ = "";  // the name begin() was given
};

}  // namespace meshla::detail
