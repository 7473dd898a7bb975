#include "runtime/execution_order.hpp"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "core/cuda_checks.hpp"

namespace meshla::detail {

// An order's eager runs as the watchdog sees them. The order's thread writes `since` and `run`
// between two increments of `generation` (odd while it records), so the watchdog, which reads
// `generation` before and after its look, never pairs one run's event with another run's time.
struct WatchedRuns {
  WatchedRuns(int device, std::string context_, std::chrono::milliseconds timeout_)
      : done(device), context(std::move(context_)), timeout(timeout_) {}

  Event done;  // recorded on the caller's stream after the last eager run
  const std::string context;
  const std::chrono::milliseconds timeout;
  std::atomic<std::uint64_t> generation{0};
  std::atomic<std::int64_t> since{0};  // when the last eager run was enqueued; 0 once seen done
  std::atomic<const char*> run{""};    // its name
};

namespace {

std::int64_t steady_nanoseconds() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Whether `runs`' last eager run is still unfinished its timeout after it was enqueued (at `now`,
// steady-clock nanoseconds); forgets a run seen finished.
bool overdue(WatchedRuns& runs, std::int64_t now) {
  const std::uint64_t generation = runs.generation.load();
  if (generation % 2 != 0) return false;  // a run is being recorded: look again next time
  std::int64_t since = runs.since.load();
  if (since == 0) return false;
  const cudaError_t status = cudaEventQuery(runs.done.get());
  if (runs.generation.load() != generation) return false;  // a newer run: look again next time
  if (status != cudaErrorNotReady) {
    // Finished (or failed, which the caller's own synchronisation reports). Forgotten unless a
    // newer run is watched meanwhile, which the exchange then leaves in place.
    runs.since.compare_exchange_strong(since, 0);
    return false;
  }
  return now - since > std::chrono::nanoseconds(runs.timeout).count();
}

[[noreturn]] void end_process(const WatchedRuns& runs, std::int64_t now) {
  std::fprintf(stderr,
               "meshla: %s on %s: an execution enqueued %lld ms ago has not finished on the device "
               "(timeout %lld ms). A rank of the group that died or never made its matching call "
               "leaves this rank's streams waiting forever (so would work queued ahead of it on "
               "the stream that runs longer than the timeout: raise the communicator's timeout_s "
               "for that). Ending the process.\n",
               runs.run.load(), runs.context.c_str(),
               static_cast<long long>((now - runs.since.load()) / 1'000'000),
               static_cast<long long>(runs.timeout.count()));
  std::fflush(stderr);
  std::abort();
}

// The one thread that watches every order of the process. Its registry holds the orders' runs
// weakly: an order that goes drops out at the next look.
class Watchdog {
 public:
  // Never destroyed: the thread may still be waiting while static destructors run.
  static Watchdog& instance() {
    static Watchdog* const watchdog = new Watchdog();
    return *watchdog;
  }

  void add(const std::shared_ptr<WatchedRuns>& runs, int device) {
    std::lock_guard lock(mutex_);
    watched_.push_back(runs);
    if (started_) return;
    started_ = true;
    std::thread([this, device] { run(device); }).detach();
  }

 private:
  // Often enough that a timeout of seconds ends near its time, rarely enough to cost nothing.
  static constexpr std::chrono::milliseconds kPollInterval{50};

  Watchdog() {
    // At exit, before CUDA's own teardown (registered earlier, so run later): the thread is
    // stopped between two looks, and makes no CUDA call afterwards.
    std::atexit([] { instance().stop(); });
    // A forked child has no watchdog thread and cannot use CUDA: it starts afresh, with the
    // registry's lock free (the fork may have come in the middle of a look).
    pthread_atfork([] { instance().mutex_.lock(); }, [] { instance().mutex_.unlock(); },
                   [] {
                     Watchdog& self = instance();
                     self.watched_.clear();
                     self.started_ = self.stopping_ = self.looking_ = false;
                     self.mutex_.unlock();
                   });
  }

  void stop() {
    std::unique_lock lock(mutex_);
    stopping_ = true;
    wake_.notify_all();
    // Bounded: a query stuck on a CUDA lock must not hold up the process's exit.
    wake_.wait_for(lock, std::chrono::seconds(1), [this] { return !looking_; });
  }

  void run(int device) {
    // The device of an order that exists, so that no context is made on another GPU; and a
    // capture mode under which this thread's event queries never invalidate another thread's
    // CUDA graph capture (they would in the default, global mode).
    cudaSetDevice(device);
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&mode);
    std::vector<std::shared_ptr<WatchedRuns>> looking_at;
    std::unique_lock lock(mutex_);
    while (!stopping_) {
      // Queried without the lock, so that a query slowed by a CUDA lock that a stuck thread holds
      // does not hold up the orders that are being made meanwhile.
      looking_at.clear();
      std::erase_if(watched_, [&](const std::weak_ptr<WatchedRuns>& weak) {
        std::shared_ptr<WatchedRuns> runs = weak.lock();
        if (runs == nullptr) return true;  // its order is gone
        looking_at.push_back(std::move(runs));
        return false;
      });
      looking_ = true;
      lock.unlock();
      const std::int64_t now = steady_nanoseconds();
      for (const std::shared_ptr<WatchedRuns>& runs : looking_at) {
        if (overdue(*runs, now)) end_process(*runs, now);
      }
      looking_at.clear();
      lock.lock();
      looking_ = false;
      wake_.notify_all();
      if (!stopping_) wake_.wait_for(lock, kPollInterval);
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<std::weak_ptr<WatchedRuns>> watched_;
  bool started_ = false;
  bool stopping_ = false;
  bool looking_ = false;  // the thread is querying events, without the lock
};

}  // namespace

ExecutionOrder::ExecutionOrder(int device, std::string context, std::chrono::milliseconds timeout)
    : watched_(std::make_shared<WatchedRuns>(device, std::move(context), timeout)),
      waiter_(device, /*high_priority=*/false),
      captured_done_(device) {
  Watchdog::instance().add(watched_, device);
}

cudaGraph_t ExecutionOrder::begin(cudaStream_t stream, const char* run) {
  beginning_ = run;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  unsigned long long capture_id = 0;
  cudaGraph_t graph = nullptr;
  MESHLA_CHECK_CUDA(cudaStreamGetCaptureInfo(stream, &capture, &capture_id, &graph));
  ending_eager_ = capture == cudaStreamCaptureStatusNone;
  if (ending_eager_) {
    if (executed_) MESHLA_CHECK_CUDA(cudaStreamWaitEvent(stream, watched_->done.get(), 0));
    executed_ = true;
    return nullptr;
  }
  if (captured_in_ == capture_id) {
    MESHLA_CHECK_CUDA(cudaStreamWaitEvent(stream, captured_done_.get(), 0));
  }
  captured_in_ = capture_id;
  ++captured_runs_;
  return capture == cudaStreamCaptureStatusActive ? graph : nullptr;
}

void ExecutionOrder::end(cudaStream_t stream) { MESHLA_CHECK_CUDA(record_end(stream)); }

void ExecutionOrder::end_after_failure(cudaStream_t stream) noexcept { record_end(stream); }

cudaError_t ExecutionOrder::record_end(cudaStream_t stream) noexcept {
  if (!ending_eager_) return cudaEventRecord(captured_done_.get(), stream);
  WatchedRuns& runs = *watched_;
  runs.generation.fetch_add(1);
  const cudaError_t status = cudaEventRecord(runs.done.get(), stream);
  runs.run.store(beginning_);
  runs.since.store(steady_nanoseconds());
  runs.generation.fetch_add(1);
  return status;
}

cudaError_t ExecutionOrder::wait_for_last_eager(std::chrono::milliseconds timeout) const {
  if (!executed_) return cudaSuccess;
  const cudaError_t snapshot = cudaStreamWaitEvent(waiter_.get(), watched_->done.get(), 0);
  return snapshot == cudaSuccess ? wait_for_stream(waiter_.get(), timeout) : snapshot;
}

}  // namespace meshla::detail
