#include "core/execution_order.hpp"

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "core/cuda_checks.hpp"

namespace meshla::detail {
namespace {

std::int64_t steady_nanoseconds() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

// The one thread that watches every ExecutionOrder of the process: a registry of the live orders,
// keyed by address (each adds itself on construction and removes itself on destruction).
class ExecutionWatchdog {
 public:
  // Never destroyed: the thread may still be polling while static destructors run.
  static ExecutionWatchdog& instance() {
    static ExecutionWatchdog* const watchdog = new ExecutionWatchdog();
    return *watchdog;
  }

  void add(ExecutionOrder* order, int device) {
    std::lock_guard lock(mutex_);
    orders_.push_back(order);
    if (started_) return;
    started_ = true;
    // Before CUDA's own teardown at exit (registered earlier, so run later): the thread makes no
    // CUDA call after this returns.
    std::atexit([] { instance().stop(); });
    std::thread([this, device] { run(device); }).detach();
  }

  void remove(ExecutionOrder* order) {
    std::lock_guard lock(mutex_);
    orders_.erase(std::remove(orders_.begin(), orders_.end(), order), orders_.end());
  }

 private:
  // Often enough that a timeout of seconds ends near its time, rarely enough to cost nothing.
  static constexpr std::chrono::milliseconds kPollInterval{50};

  void stop() {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    wake_.notify_all();
  }

  void run(int device) {
    // The device of an order that exists, so that no context is made on another GPU; and a
    // capture mode under which this thread's event queries never invalidate another thread's
    // CUDA graph capture (they would in the default, global mode).
    cudaSetDevice(device);
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&mode);
    std::unique_lock lock(mutex_);
    while (!stopping_) {
      const std::int64_t now = steady_nanoseconds();
      for (ExecutionOrder* order : orders_) {
        if (order->overdue(now)) end_process(*order, now);
      }
      wake_.wait_for(lock, kPollInterval);
    }
  }

  [[noreturn]] static void end_process(const ExecutionOrder& order, std::int64_t now) {
    const long long waited = (now - order.watched_since_.load()) / 1'000'000;
    std::fprintf(
        stderr,
        "meshla: %s on %s: an execution enqueued %lld ms ago has not finished on the device "
        "(timeout %lld ms). A rank of the group that died or never made its matching call "
        "leaves this rank's streams waiting forever (so would work queued ahead of it on "
        "the stream that runs longer than the timeout: raise the communicator's timeout_s "
        "for that). Ending the process.\n",
        order.watched_run_.load(), order.context_.c_str(), waited,
        static_cast<long long>(order.timeout_.count()));
    std::fflush(stderr);
    std::abort();
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<ExecutionOrder*> orders_;
  bool started_ = false;
  bool stopping_ = false;
};

ExecutionOrder::ExecutionOrder(int device, std::string context, std::chrono::milliseconds timeout)
    : context_(std::move(context)), timeout_(timeout), done_(device), captured_done_(device) {
  ExecutionWatchdog::instance().add(this, device);
}

ExecutionOrder::~ExecutionOrder() { ExecutionWatchdog::instance().remove(this); }

void ExecutionOrder::begin(cudaStream_t stream, const char* run) {
  beginning_ = run;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  unsigned long long capture_id = 0;
  MESHLA_CHECK_CUDA(cudaStreamGetCaptureInfo(stream, &capture, &capture_id));
  if (capture == cudaStreamCaptureStatusNone) {
    if (executed_) MESHLA_CHECK_CUDA(cudaStreamWaitEvent(stream, done_.get(), 0));
    executed_ = true;
    ending_ = done_.get();
    return;
  }
  if (captured_in_ == capture_id) {
    MESHLA_CHECK_CUDA(cudaStreamWaitEvent(stream, captured_done_.get(), 0));
  }
  captured_in_ = capture_id;
  ++captured_runs_;
  ending_ = captured_done_.get();
}

void ExecutionOrder::end(cudaStream_t stream) {
  watch();
  MESHLA_CHECK_CUDA(cudaEventRecord(ending_, stream));
}

void ExecutionOrder::end_after_failure(cudaStream_t stream) noexcept {
  watch();
  cudaEventRecord(ending_, stream);
}

void ExecutionOrder::watch() noexcept {
  // Before the record: a watchdog that sees the new record unfinished then reads this run's time.
  if (ending_ != done_.get()) return;
  watched_run_.store(beginning_);
  watched_since_.store(steady_nanoseconds());
}

cudaError_t ExecutionOrder::wait_for_last_eager(std::chrono::milliseconds timeout) const {
  return executed_ ? wait_for_event(done_.get(), timeout) : cudaSuccess;
}

bool ExecutionOrder::overdue(std::int64_t now) {
  // Read before the query, for forgetting: if end() watches a newer run meanwhile, the exchange
  // fails and the newer run stays watched.
  std::int64_t before = watched_since_.load();
  if (before == 0) return false;
  if (cudaEventQuery(done_.get()) != cudaErrorNotReady) {
    // Finished (or failed, which the caller's own synchronisation reports).
    watched_since_.compare_exchange_strong(before, 0);
    return false;
  }
  // Read after the query, for the deadline: the run found unfinished may be one that end()
  // recorded after `before` was read, and it is timed from its own enqueue.
  const std::int64_t since = watched_since_.load();
  return since != 0 && now - since > std::chrono::nanoseconds(timeout_).count();
}

}  // namespace meshla::detail
