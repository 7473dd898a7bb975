// The state behind a meshla::Communicator: the NCCL communicators of one rank of one group, shared
// by every Communicator copy and every plan that uses them, released with the last of them.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <nccl.h>

#include "comm/enqueue_meeting.hpp"

namespace meshla::detail {

class GroupWorkspace;

// How a group's ranks reach each other's memory (enable_peer_access).
struct PeerAccess {
  // "" when every rank maps every other rank's memory, else why not.
  std::string unmappable;
  // "" when, besides, every pair of the group's GPUs is linked by NVLink, else why not (rank 0
  // prints it once, when the group is asked).
  std::string without_nvlink;

  bool mapped() const { return unmappable.empty(); }
  bool over_nvlink() const { return mapped() && without_nvlink.empty(); }
};

struct CommState {
  // `release` ends the state's NCCL communicators (the working one, then its bootstrap, each
  // present); production code passes release_nccl_comms, CPU tests a recorder. It runs exactly
  // once, when the last owner lets go.
  CommState(ncclComm_t comm, ncclComm_t bootstrap, int rank, int size, int device,
            std::chrono::milliseconds timeout,
            std::function<void(std::vector<ncclComm_t>)> release);
  ~CommState();
  CommState(const CommState&) = delete;
  CommState& operator=(const CommState&) = delete;

  // The blocking communicator every operation uses. A nonblocking one would hand each group
  // launch to a new host thread and return ncclInProgress, costing tens of microseconds of host
  // time per call on the hot path.
  ncclComm_t comm;
  // The nonblocking communicator it was split from: creation in nonblocking mode is what lets a
  // missing rank end in a timeout instead of a hang. Kept until the end so that no peer still
  // finishing its split loses its partner.
  ncclComm_t bootstrap;
  int rank;
  int size;
  int device;
  std::chrono::milliseconds timeout;
  // Where this process drives several ranks of the group (Communicator::create_local), the
  // meeting their threads hold after enqueuing each collective (see EnqueueMeeting), shared by
  // those ranks' states; null for one process per GPU.
  std::shared_ptr<EnqueueMeeting> enqueue_meeting;
  // Ranks of this group that this process drives: 1 for one process per GPU, the group's size for
  // Communicator::create_local.
  int ranks_in_process() const { return enqueue_meeting ? enqueue_meeting->ranks() : 1; }
  // enable_peer_access's answer for this group, once asked. A property of the group, so each plan
  // need not ask again. Like the NCCL communicator itself, used by one thread at a time.
  std::optional<PeerAccess> peer_access;
  // The memory that this group's collective-matmul plans share (GroupWorkspace::of), made by the
  // first plan and kept until the communicator goes (then freed on a thread of its own). Kept, not
  // dropped with the last plan: plans go at moments that differ between ranks (with the last CUDA
  // graph that held them), and a rank that made the workspace again would grow it, collectively,
  // where its peers do not.
  std::shared_ptr<GroupWorkspace> group_workspace;

 private:
  std::function<void(std::vector<ncclComm_t>)> release_;
};

// "rank 1 of 4, cuda:1": this rank of the group, for messages.
std::string rank_description(const CommState& state);

// Ends one rank's communicators, in order, with ncclCommAbort on a thread of their own
// (release_on_own_thread), and returns at once. ncclCommAbort is not local: NCCL's proxy thread
// serves the connections of this rank's peers on the node until they close, so an abort returns
// only when those peers have ended the communicator too, or exited (NCCL 2.28, src/proxy.cc).
// Ranks let go of their groups in orders that differ (garbage collection, interpreter exit), and a
// rank waiting in one abort while its peer waits in another would hang both; off the caller's
// thread each abort waits for its own peers only. Hence a thread per release, too: one thread
// aborting in turn would wait in the first abort for peers that abort in another order.
// ncclCommFinalize would wait on the caller's thread for the peers' matching calls. Plans
// synchronise their own last execution before they let go.
void release_nccl_comms(std::vector<ncclComm_t> comms);

// A blocking communicator over the same ranks as `parent` whose kernels use at most `max_ctas`
// thread blocks. Collective over the parent's ranks; every rank passes the same max_ctas.
std::shared_ptr<CommState> split_with_max_ctas(const CommState& parent, int max_ctas);

// Every rank's `bytes` bytes at `data`, in rank order, gathered through the communicator: for
// plan-time exchanges (peer-memory handles). Collective; a rank that does not take part within
// the communicator's timeout makes it throw kTimeout.
std::vector<std::byte> all_gather_host(const CommState& state, const void* data, std::size_t bytes);

// Every rank's `mine`, in rank order (all_gather_host of a trivially copyable record). Collective.
template <typename Record>
std::vector<Record> all_gather_records(const CommState& state, const Record& mine) {
  static_assert(std::is_trivially_copyable_v<Record>);
  const std::vector<std::byte> bytes = all_gather_host(state, &mine, sizeof(Record));
  std::vector<Record> all(static_cast<std::size_t>(state.size));
  std::memcpy(all.data(), bytes.data(), bytes.size());
  return all;
}

// An NCCL group, ended on every path: NCCL's group depth is per thread, and a group left open by
// an exception would defer (and so hang) every later NCCL call of the thread, torch's included.
class NcclGroup {
 public:
  NcclGroup();
  ~NcclGroup();
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;
  // Ends the group and returns ncclGroupEnd's status (ncclInProgress for nonblocking members).
  ncclResult_t end();

 private:
  bool open_ = true;
};

}  // namespace meshla::detail
