// Communicator: a shared handle to one NCCL communicator. Groups smaller than the world (tp=2
// inside 4 ranks) are made the same way, from the id exchanged inside the smaller group.
//
// Every object that communicates (a collective-matmul plan, a solver) holds a copy, so the NCCL
// communicator lives exactly as long as its last user and the order in which Python or C++ drops
// its references never matters. The unique id that bootstraps a multi-process communicator
// travels through the caller's own channel (torch.distributed, jax.distributed, mpi4py): meshla
// opens no socket, file or store of its own.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "meshla/export.hpp"

namespace meshla {

// The bytes of an ncclUniqueId, made on one rank and handed to every other rank of the group.
struct UniqueId {
  static constexpr std::size_t kSize = 128;
  std::array<std::uint8_t, kSize> bytes{};
};

MESHLA_API UniqueId make_unique_id();

struct CommunicatorOptions {
  // Bound on creating the communicator (every rank must take part within it) and on a plan's
  // wait for its last execution when it is destroyed. Operations themselves are not bounded:
  // a rank that stops calling them stalls its peers' streams, as with any NCCL communicator.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
};

namespace detail {
struct CommState;
}

class MESHLA_API Communicator {
 public:
  // One rank of a multi-process group; every rank calls this with the same id.
  static Communicator create(const UniqueId& id, int rank, int size, int device,
                             const CommunicatorOptions& options = {});

  // All ranks of a group driven by one process, one per device, in device-list order. Each
  // communicator is then used from its own host thread.
  static std::vector<Communicator> create_local(const std::vector<int>& devices,
                                                const CommunicatorOptions& options = {});

  int rank() const;
  int size() const;
  int device() const;
  std::chrono::milliseconds timeout() const;

  // For meshla's own backends; the state type is private to the library.
  const std::shared_ptr<detail::CommState>& state() const { return state_; }
  explicit Communicator(std::shared_ptr<detail::CommState> state);

 private:
  std::shared_ptr<detail::CommState> state_;
};

}  // namespace meshla
