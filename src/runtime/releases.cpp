#include "runtime/releases.hpp"

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>

#include "core/cuda_checks.hpp"

namespace meshla::detail {
namespace {

// The releases under way and whether the process is ending. Never destroyed: a release thread may
// still use it while static destructors run.
struct Releases {
  std::mutex mutex;
  std::condition_variable done;
  int in_flight = 0;
  bool exiting = false;
};

Releases& releases() {
  static Releases* const state = new Releases();
  return *state;
}

// How long the process's end waits for the releases under way: an abort returns once the peers
// have ended the communicator too, which at exit is usually moments away; a wait for a peer that
// itself waits for this process to end is cut short.
constexpr std::chrono::seconds kExitWaitForReleases{5};

// What a captured graph holds (hold_in_graph).
struct HeldByGraph {
  int device;
  std::shared_ptr<const void> owner;
};

// The user object's destructor, on CUDA's internal thread, where no CUDA call may be made: the
// owner's last reference may free memory, so it goes on a thread of its own.
void release_held_by_graph(void* held) {
  auto* holding = static_cast<HeldByGraph*>(held);
  release_on_own_thread(holding->device, [holding] { delete holding; });
}

}  // namespace

void release_on_own_thread(int device, std::function<void()> release) noexcept {
  // On the heap, so that a release that does not run is leaked rather than destroyed here.
  auto* work = new std::function<void()>(std::move(release));
  Releases& state = releases();
  {
    std::lock_guard lock(state.mutex);
    if (state.exiting) return;
    ++state.in_flight;
  }
  try {
    std::thread([device, work] {
      // The device first: a CUDA call on a new thread would otherwise make a context on GPU 0.
      cudaSetDevice(device);
      cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
      cudaThreadExchangeStreamCaptureMode(&mode);
      (*work)();
      delete work;
      Releases& state = releases();
      std::lock_guard lock(state.mutex);
      --state.in_flight;
      state.done.notify_all();
    }).detach();
  } catch (const std::system_error&) {
    std::lock_guard lock(state.mutex);
    --state.in_flight;
  }
}

void begin_process_exit() {
  Releases& state = releases();
  std::unique_lock lock(state.mutex);
  state.exiting = true;
  state.done.wait_for(lock, kExitWaitForReleases, [&] { return state.in_flight == 0; });
}

int releases_under_way() {
  Releases& state = releases();
  std::lock_guard lock(state.mutex);
  return state.in_flight;
}

void hold_in_graph(cudaGraph_t graph, int device, std::shared_ptr<const void> owner) {
  auto* held = new HeldByGraph{device, std::move(owner)};
  cudaUserObject_t object = nullptr;
  const cudaError_t created =
      cudaUserObjectCreate(&object, held, release_held_by_graph, 1, cudaUserObjectNoDestructorSync);
  if (created != cudaSuccess) {
    delete held;
    MESHLA_CHECK_CUDA(created);
  }
  // The reference moves to the graph; where it cannot, dropping it releases `held` at once.
  const cudaError_t retained = cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove);
  if (retained != cudaSuccess) {
    cudaUserObjectRelease(object, 1);
    MESHLA_CHECK_CUDA(retained);
  }
}

}  // namespace meshla::detail
