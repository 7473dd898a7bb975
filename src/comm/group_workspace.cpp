#include "comm/group_workspace.hpp"

#include <algorithm>
#include <string>

#include "core/alignment.hpp"
#include "core/checks.hpp"
#include "core/cuda_checks.hpp"

namespace meshla::detail {
std::shared_ptr<GroupWorkspace> GroupWorkspace::of(CommState& state) {
  std::shared_ptr<GroupWorkspace> workspace = state.group_workspace.lock();
  if (workspace == nullptr) {
    workspace = std::make_shared<GroupWorkspace>(state);
    state.group_workspace = workspace;
  }
  return workspace;
}

GroupWorkspace::GroupWorkspace(const CommState& state)
    : device_(state.device),
      order_(state.device, rank_description(state), state.timeout),
      scratch_stream_(state.device, /*high_priority=*/false),
      matmul_(state.device) {}

void GroupWorkspace::wait_for_last_execution(const CommState& state) const {
  const cudaError_t status = order_.wait_for_last_eager(state.timeout);
  MESHLA_CHECK(kTimeout, status != cudaErrorNotReady,
               "the symmetric workspace of rank " << state.rank << " cannot grow: its last "
                                                  << "execution is still running after "
                                                  << state.timeout.count()
                                                  << " ms (did a rank of the group not make its "
                                                     "matching call?)");
  MESHLA_CHECK_CUDA(status);
}

void GroupWorkspace::reserve(const CommState& state, const Sizes& needed) {
  if (needed.scratch_bytes > capacity_.scratch_bytes) {
    wait_for_last_execution(state);
    const bool captured = order_.captured_runs() != captured_runs_at_scratch_;
    if (captured && scratch_.data() != nullptr) kept_scratch_.push_back(std::move(scratch_));
    scratch_ = StreamBuffer();  // the old memory goes before the new is allocated
    capacity_.scratch_bytes = 0;
    scratch_ = StreamBuffer(needed.scratch_bytes, scratch_stream_.get());
    capacity_.scratch_bytes = needed.scratch_bytes;
    captured_runs_at_scratch_ = order_.captured_runs();
  }
  if (needed.signal_bytes <= capacity_.signal_bytes && needed.data_bytes <= capacity_.data_bytes) {
    return;
  }
  wait_for_last_execution(state);
  const std::size_t signal_bytes = std::max(needed.signal_bytes, capacity_.signal_bytes);
  const std::size_t data_bytes = std::max(needed.data_bytes, capacity_.data_bytes);
  const bool captured = order_.captured_runs() != captured_runs_at_peers_;
  if (captured && capacity_.data_bytes + capacity_.signal_bytes > 0) {
    kept_peers_.push_back(std::move(peers_));
  }
  peers_ = PeerBuffer();
  capacity_.signal_bytes = capacity_.data_bytes = data_offset_ = 0;
  const std::size_t data_offset = align_up(signal_bytes);
  peers_ = PeerBuffer(state, data_offset + data_bytes);
  capacity_.signal_bytes = signal_bytes;
  capacity_.data_bytes = data_bytes;
  data_offset_ = data_offset;
  captured_runs_at_peers_ = order_.captured_runs();
}

}  // namespace meshla::detail
