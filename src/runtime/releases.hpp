// Letting go of native resources off the thread that lets go of them, and the process's end.
// begin_process_exit and releases_under_way are exported for the Python bindings (MESHLA_API).
#pragma once

#include <functional>
#include <memory>

#include <cuda_runtime_api.h>

#include "meshla/export.hpp"

namespace meshla::detail {

// Runs `release` on a thread of its own, with `device` current and in relaxed capture mode, and
// returns at once: for releases that may wait for other processes or threads (ncclCommAbort waits
// for the peers' aborts), or that may not run where they are asked for (a CUDA user object's
// destructor may make no CUDA call). Relaxed, so that its frees are not refused while another
// thread captures a CUDA graph in the default, global mode; `release` must still make no call that
// synchronises the device (cublasLtDestroy does), which would invalidate that capture. After
// begin_process_exit, or where no thread can be started, `release` is leaked unrun, with all it
// holds: what it would free is left to the process's end, and destroying it here could make the
// CUDA calls it was sent away to make.
void release_on_own_thread(int device, std::function<void()> release) noexcept;

// The process is ending: waits a few seconds at most for the releases under way, and from then on
// leaves what is let go of to the process's end (the driver and the operating system reclaim it,
// and a peer waiting in an abort sees this process's connections close). An abort started now
// could wait for a peer that waits for this process to exit. meshla's Python package calls it
// first thing at interpreter exit.
MESHLA_API void begin_process_exit();

// The releases under way (release_on_own_thread): for tests and diagnostics.
MESHLA_API int releases_under_way();

// Makes `graph` (a capture under way), and the executable graphs made from it, hold `owner` until
// they are destroyed and their launches have finished, then lets go of it with
// release_on_own_thread on `device`. A plan passes itself when a run of it is captured, so that a
// graph replaying its work keeps its memory and communicator however early the program lets go
// of the plan.
void hold_in_graph(cudaGraph_t graph, int device, std::shared_ptr<const void> owner);

}  // namespace meshla::detail
