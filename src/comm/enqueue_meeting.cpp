#include "comm/enqueue_meeting.hpp"

#include "core/checks.hpp"

namespace meshla::detail {

EnqueueMeeting::EnqueueMeeting(int ranks) : ranks_(ranks) {
  MESHLA_CHECK_ARG(ranks >= 1, "EnqueueMeeting: ranks=" << ranks << " must be at least 1");
}

void EnqueueMeeting::arrive(int rank, std::string_view run, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  MESHLA_CHECK(kTimeout, !broken_,
               run << " on rank " << rank << ": an earlier meeting of the ranks that this process "
                   << "drives timed out, so their calls no longer pair");
  const std::uint64_t mine = meeting_;
  if (++arrived_ == ranks_) {
    arrived_ = 0;
    ++meeting_;
    all_arrived_.notify_all();
    return;
  }
  all_arrived_.wait_for(lock, timeout, [&] { return meeting_ != mine || broken_; });
  if (meeting_ != mine) return;
  broken_ = true;
  all_arrived_.notify_all();
  MESHLA_THROW(kTimeout, run << " on rank " << rank << ": the other ranks of the group that this "
                             << "process drives did not enqueue their part within "
                             << timeout.count()
                             << " ms (does every rank's thread make the same calls, in the same "
                                "order?)");
}

}  // namespace meshla::detail
