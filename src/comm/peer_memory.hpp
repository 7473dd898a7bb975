// Device memory that every rank of a group maps: each rank allocates its part, and every rank can
// address every other rank's part directly (copy engines write into it over NVLink).
//
// Ranks in one process share their device pointers and enable CUDA peer access; ranks in other
// processes export CUDA IPC handles. Either way the handles travel over the group's own NCCL
// communicator, at plan time.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "comm/comm_state.hpp"
#include "core/cuda_handles.hpp"

namespace meshla::detail {

// How a group's ranks reach each other's memory (ask_for_peer_access).
struct PeerAccess {
  // "" when every rank maps every other rank's memory, else why not.
  std::string unmappable;
  // "" when, besides, every pair of the group's GPUs is linked by NVLink, else why not (rank 0
  // prints it once, when the group is asked).
  std::string without_nvlink;

  bool mapped() const { return unmappable.empty(); }
  bool over_nvlink() const { return mapped() && without_nvlink.empty(); }
};

// Whether every rank of the group can map every other rank's memory: one host, CUDA peer access
// between each pair of devices, and NCCL_P2P_DISABLE not set (the user's word that peer transfers
// are off); and whether every pair is linked by NVLink (why_not_nvlink). Every rank gets the same
// answer; where it is no, the reason names a pair that cannot. When the memory can be mapped,
// CUDA peer access to the peers driven by this process is enabled. Collective; the caller keeps
// the answer (a property of the group).
PeerAccess ask_for_peer_access(const CommState& state);

class PeerBuffer {
 public:
  PeerBuffer() = default;
  // Collective over the group (every rank passes the same `bytes`), after ask_for_peer_access
  // said yes. The memory starts zeroed on every rank before any rank returns.
  //
  // With several GPUs driven by one process, the exchange is the last point where the ranks
  // wait for each other before their first execution: the caller must not free device memory
  // (cudaFree waits for the peer devices, whose queued work may wait for this thread) between
  // constructing a PeerBuffer and enqueuing the work that uses it.
  PeerBuffer(const CommState& state, std::size_t bytes);
  ~PeerBuffer();
  PeerBuffer(PeerBuffer&& other) noexcept;
  PeerBuffer& operator=(PeerBuffer&& other) noexcept;
  PeerBuffer(const PeerBuffer&) = delete;
  PeerBuffer& operator=(const PeerBuffer&) = delete;

  char* local() const { return static_cast<char*>(memory_.data()); }
  // This rank's address of `rank`'s part (local() for this rank).
  char* of(int rank) const { return parts_[static_cast<std::size_t>(rank)]; }

 private:
  void close_imports() noexcept;

  DeviceBuffer memory_;
  std::vector<char*> parts_;
  std::vector<char*> imported_;  // opened with cudaIpcOpenMemHandle; closed on destruction
  int device_ = -1;
};

}  // namespace meshla::detail
