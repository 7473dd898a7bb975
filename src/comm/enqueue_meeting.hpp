// Where one process drives several ranks of a group (Communicator::create_local: a host thread per
// GPU), each rank's thread waits, after enqueuing its part of a collective, until every other
// rank's thread has enqueued its part too.
//
// Until then a device's work may wait for a peer's part that no thread has enqueued yet (an NCCL
// kernel, a stream wait on a peer's flag). A thread that went on meanwhile into a CUDA call that
// waits for its own device holds a lock of the driver while it waits, and the peer thread's
// enqueue needs that lock: neither part completes. Loading a kernel lazily (CUDA's default) is
// such a call; cuBLAS's first use of a kernel in torch's addmm hung the threads model that way
// (2x H200, 2026-11-27: one thread in cuKernelSetAttribute, the other's cuMemcpyDtoDAsync waiting
// for a driver lock). With every part enqueued before any thread leaves the collective, the
// devices finish it without the host, and such a wait ends.
//
// Pure host code (a mutex and a condition variable), CPU-tested.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string_view>

namespace meshla::detail {

class EnqueueMeeting {
 public:
  explicit EnqueueMeeting(int ranks);
  EnqueueMeeting(const EnqueueMeeting&) = delete;
  EnqueueMeeting& operator=(const EnqueueMeeting&) = delete;

  // Returns once every rank has arrived for the current meeting (the ranks' n-th calls meet each
  // other). Throws kTimeout when they have not within `timeout`, naming `run`, after which the
  // meeting is broken: every later arrival throws at once, since the ranks' calls no longer pair.
  void arrive(int rank, std::string_view run, std::chrono::milliseconds timeout);

  int ranks() const { return ranks_; }

 private:
  const int ranks_;
  std::mutex mutex_;
  std::condition_variable all_arrived_;
  int arrived_ = 0;
  std::uint64_t meeting_ = 0;  // meetings completed so far
  bool broken_ = false;
};

}  // namespace meshla::detail
