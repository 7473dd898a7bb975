#include "collective/group_workspace.hpp"

#include <algorithm>
#include <string>

#include "core/alignment.hpp"
#include "core/checks.hpp"
#include "core/cuda_checks.hpp"

namespace meshla::collective {
namespace {

// The size a part grows to: what is needed, or, when the old memory is kept, at least double the
// old, so that all that is ever kept stays smaller than what is in use.
std::size_t grown_size(std::size_t needed, std::size_t capacity, bool keep_old) {
  return keep_old ? std::max(needed, 2 * capacity) : needed;
}

}  // namespace

GroupWorkspace::GroupWorkspace(const detail::CommState& state)
    : order_(state.device, rank_description(state), state.timeout),
      scratch_stream_(state.device, /*high_priority=*/false),
      matmul_(state.device) {}

void GroupWorkspace::wait_for_last_execution(const detail::CommState& state) const {
  const cudaError_t status = order_.wait_for_last_eager(state.timeout);
  MESHLA_CHECK(kTimeout, status != cudaErrorNotReady,
               "the collective-matmul workspace of rank "
                   << state.rank << " cannot grow: its last "
                   << "execution is still running after " << state.timeout.count()
                   << " ms (did a rank of the group not make its "
                      "matching call?)");
  MESHLA_CHECK_CUDA(status);
}

void GroupWorkspace::reserve(const detail::CommState& state, const Sizes& needed) {
  // New memory is made before old memory goes, so that a failed growth leaves the workspace, and
  // the plans already using it, as they were.
  const bool grow_scratch = needed.scratch_bytes > capacity_.scratch_bytes;
  const bool grow_peers =
      needed.signal_bytes > capacity_.signal_bytes || needed.data_bytes > capacity_.data_bytes;
  if (!grow_scratch && !grow_peers) return;
  wait_for_last_execution(state);
  if (grow_scratch) {
    const bool keep_old = order_.captured_runs() != captured_runs_at_scratch_;
    detail::StreamBuffer grown(grown_size(needed.scratch_bytes, capacity_.scratch_bytes, keep_old),
                               scratch_stream_.get());
    if (keep_old && scratch_.data() != nullptr) kept_scratch_.push_back(std::move(scratch_));
    capacity_.scratch_bytes = grown.bytes();
    scratch_ = std::move(grown);  // stream-ordered: freeing the old waits for no device
    captured_runs_at_scratch_ = order_.captured_runs();
  }
  if (!grow_peers) return;
  // Old peer memory is kept where a graph may replay on it, and where this process drives more
  // than one rank of the group: there cudaFree waits for the peer devices, whose queued work may
  // be a peer's half of an exchange that waits for this thread.
  const bool keep_old =
      order_.captured_runs() != captured_runs_at_peers_ || state.ranks_in_process() > 1;
  const std::size_t signal_bytes = std::max(needed.signal_bytes, capacity_.signal_bytes);
  const std::size_t data_bytes = grown_size(needed.data_bytes, capacity_.data_bytes, keep_old);
  const std::size_t data_offset = detail::align_up(signal_bytes);
  detail::PeerBuffer grown(state, data_offset + data_bytes);
  if (keep_old && capacity_.signal_bytes > 0) kept_peers_.push_back(std::move(peers_));
  peers_ = std::move(grown);
  capacity_.signal_bytes = signal_bytes;
  capacity_.data_bytes = data_bytes;
  data_offset_ = data_offset;
  captured_runs_at_peers_ = order_.captured_runs();
}

}  // namespace meshla::collective
