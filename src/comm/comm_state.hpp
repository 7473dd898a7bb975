// The state behind a meshla::Communicator: the NCCL communicators of one rank of one group, shared
// by every Communicator copy and every plan that uses them, released with the last of them.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <typeindex>
#include <typeinfo>
#include <vector>

#include <nccl.h>

#include "comm/enqueue_meeting.hpp"

namespace meshla::detail {

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
  // What a layer above keeps for this group, one object of each type (the collective layer's
  // workspace and peer-access answer: collective/group_resources.hpp), made by its first use and
  // kept until the communicator goes, then released on a thread of its own (its cudaFree may wait
  // for the peer devices, whose queued work may wait for a thread that the one letting go holds
  // up). Like the NCCL communicator itself, used by one thread at a time.
  template <typename Resource>
  std::shared_ptr<Resource> resource() {
    std::shared_ptr<void>& slot = resources_[std::type_index(typeid(Resource))];
    if (slot == nullptr) slot = std::make_shared<Resource>(*this);
    return std::static_pointer_cast<Resource>(slot);
  }

 private:
  std::function<void(std::vector<ncclComm_t>)> release_;
  std::map<std::type_index, std::shared_ptr<void>> resources_;
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
