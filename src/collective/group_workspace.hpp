// What the collective-matmul plans of one group share: peer memory (the symmetric backend's flags
// and blocks), local scratch (staged products, gathered rows), and a Matmul: the cuBLASLt
// workspace and tuned algorithms. The memory is sized by the largest plan built so far and grown
// at plan time when a new plan needs more, so that a group that runs many shapes holds one of
// each, not one per shape. The plans' executions share all of it, so they run one at a time, in
// the workspace's ExecutionOrder, and each runs its GEMMs on the caller's stream only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "comm/comm_state.hpp"
#include "comm/peer_memory.hpp"
#include "core/cuda_handles.hpp"
#include "meshla/matmul.hpp"
#include "runtime/execution_order.hpp"

namespace meshla::collective {

class GroupWorkspace {
 public:
  struct Sizes {
    // Peer memory for flags, which the plans leave zero at the end of every execution, so that
    // any plan finds them zero at the start of its own.
    std::size_t signal_bytes = 0;
    std::size_t data_bytes = 0;     // peer memory for blocks and partial products
    std::size_t scratch_bytes = 0;  // local memory
  };

  // The group's workspace (CommState::resource), made by its first plan and kept until the
  // communicator goes. Kept, not dropped with the last plan: plans go at moments that differ
  // between ranks (with the last CUDA graph that held them), and a rank that made the workspace
  // again would grow it, collectively, where its peers do not.
  static std::shared_ptr<GroupWorkspace> of(detail::CommState& state) {
    return state.resource<GroupWorkspace>();
  }

  explicit GroupWorkspace(const detail::CommState& state);
  GroupWorkspace(const GroupWorkspace&) = delete;
  GroupWorkspace& operator=(const GroupWorkspace&) = delete;

  // Grows whatever part is smaller than `needed`. Collective: every rank of the group passes the
  // same sizes (its plans are built in the same order, with the same configs, on every rank), so
  // every rank grows the peer memory at the same call. The new memory is made before the old
  // goes, so a growth that throws changes nothing. Replaced memory is freed once the last
  // execution on it has finished (waiting up to the group's timeout, then kTimeout), except
  // - where a CUDA graph captured an execution of the group since it was made: a replay may use
  //   it;
  // - peer memory, where this process drives several ranks of the group: cudaFree would wait for
  //   the peer devices, whose queued work may wait for this thread.
  // Kept memory stays until the workspace goes; a part whose old memory is kept grows to at least
  // double. The scratch is stream-ordered memory, whose freeing waits for no device.
  //
  // With several GPUs driven by one process, the plan must call this last in its construction
  // (see PeerBuffer).
  void reserve(const detail::CommState& state, const Sizes& needed);

  // This rank's address of `rank`'s flags and of its data.
  char* signals(int rank) const { return peers_.of(rank); }
  char* data(int rank) const { return peers_.of(rank) + data_offset_; }
  char* scratch() const { return static_cast<char*>(scratch_.data()); }
  detail::ExecutionOrder& order() { return order_; }
  Matmul& matmul() { return matmul_; }

 private:
  // Waits for the last eager execution before memory that it may use is freed.
  void wait_for_last_execution(const detail::CommState& state) const;

  detail::ExecutionOrder order_;
  detail::Stream scratch_stream_;  // allocates and frees the scratch, in stream order
  Matmul matmul_;
  Sizes capacity_;
  std::size_t data_offset_ = 0;
  detail::PeerBuffer peers_;
  detail::StreamBuffer scratch_;
  // order_.captured_runs() when peers_ and scratch_ were allocated: more since, and a graph may
  // replay on them (counting the captures of every plan of the group, which may keep memory that
  // a capture never touched).
  std::uint64_t captured_runs_at_peers_ = 0;
  std::uint64_t captured_runs_at_scratch_ = 0;
  std::vector<detail::PeerBuffer> kept_peers_;  // replaced, but used by captured graphs
  std::vector<detail::StreamBuffer> kept_scratch_;
};

}  // namespace meshla::collective
