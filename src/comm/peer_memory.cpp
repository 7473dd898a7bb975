#include "comm/peer_memory.hpp"

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>

#include "comm/nvlink.hpp"
#include "core/cuda_checks.hpp"

namespace meshla::detail {
namespace {

// Who a rank is, as far as mapping its memory goes.
struct PeerIdentity {
  std::uint64_t host = 0;     // hash of the host name and boot id
  std::uint64_t process = 0;  // random per process: CUDA IPC cannot open a process's own handles
  std::int32_t device = -1;   // ordinal in its own process
  std::int32_t p2p_disabled = 0;
  char pci_bus_id[32] = {};
};

std::uint64_t host_hash() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  std::string boot_id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot_id;
  return std::hash<std::string>{}(std::string(name) + "/" + boot_id);
}

std::uint64_t process_token() {
  static const std::uint64_t token = [] {
    std::random_device random;
    return (static_cast<std::uint64_t>(random()) << 32) ^ random() ^
           static_cast<std::uint64_t>(getpid());
  }();
  return token;
}

bool p2p_disabled_by_environment() {
  const char* value = std::getenv("NCCL_P2P_DISABLE");
  return value != nullptr && std::strcmp(value, "0") != 0 && value[0] != '\0';
}

PeerIdentity identity_of(int device) {
  PeerIdentity me;
  me.host = host_hash();
  me.process = process_token();
  me.device = device;
  me.p2p_disabled = p2p_disabled_by_environment() ? 1 : 0;
  MESHLA_CHECK_CUDA(cudaDeviceGetPCIBusId(me.pci_bus_id, sizeof(me.pci_bus_id) - 1, device));
  return me;
}

// What this rank finds of its peers: why it cannot map one's memory, or why one is not linked to
// it by NVLink.
PeerAccess reach_of_peers(const CommState& state, const std::vector<PeerIdentity>& everyone) {
  const PeerIdentity& me = everyone[static_cast<std::size_t>(state.rank)];
  PeerAccess reach;
  for (int rank = 0; rank < state.size; ++rank) {
    if (rank == state.rank) continue;
    const PeerIdentity& peer = everyone[static_cast<std::size_t>(rank)];
    std::ostringstream pair;
    pair << "rank " << state.rank << " (" << me.pci_bus_id << ") and rank " << rank << " ("
         << peer.pci_bus_id << ")";
    if (me.p2p_disabled || peer.p2p_disabled) {
      reach.unmappable = "NCCL_P2P_DISABLE is set";
      return reach;
    }
    if (peer.host != me.host) {
      reach.unmappable = pair.str() + " are on different hosts";
      return reach;
    }
    int peer_device = peer.device;
    if (peer.process != me.process &&
        cudaDeviceGetByPCIBusId(&peer_device, peer.pci_bus_id) != cudaSuccess) {
      cudaGetLastError();
      reach.unmappable = pair.str() + ": the peer's GPU is not visible to this process";
      return reach;
    }
    int can_access = 0;
    MESHLA_CHECK_CUDA(cudaDeviceCanAccessPeer(&can_access, me.device, peer_device));
    if (can_access == 0) {
      reach.unmappable = pair.str() + " have no CUDA peer access";
      return reach;
    }
    if (reach.without_nvlink.empty()) {
      const std::string why = why_not_nvlink(me.pci_bus_id, peer.pci_bus_id);
      if (!why.empty()) reach.without_nvlink = pair.str() + ": " + why;
    }
  }
  return reach;
}

}  // namespace

PeerAccess ask_for_peer_access(const CommState& state) {
  const std::vector<PeerIdentity> everyone = all_gather_records(state, identity_of(state.device));
  const PeerAccess mine = reach_of_peers(state, everyone);
  struct Reach {
    std::int32_t mapped;
    std::int32_t over_nvlink;
  };
  const std::vector<Reach> reaches = all_gather_records(
      state, Reach{.mapped = mine.mapped() ? 1 : 0, .over_nvlink = mine.over_nvlink() ? 1 : 0});
  // Every rank reports its own reason where it has one, else the first rank that has.
  PeerAccess group;
  for (int rank = 0; rank < state.size; ++rank) {
    if (reaches[static_cast<std::size_t>(rank)].mapped == 0 && group.unmappable.empty()) {
      group.unmappable =
          !mine.mapped() ? mine.unmappable
                         : "rank " + std::to_string(rank) + " cannot map all of its peers' memory";
    }
  }
  if (!group.mapped()) return group;
  for (int rank = 0; rank < state.size; ++rank) {
    if (reaches[static_cast<std::size_t>(rank)].over_nvlink == 0 && group.without_nvlink.empty()) {
      group.without_nvlink =
          !mine.without_nvlink.empty()
              ? mine.without_nvlink
              : "rank " + std::to_string(rank) + " is not linked to all of its peers by NVLink";
    }
  }
  if (!group.without_nvlink.empty() && state.rank == 0) {
    // Once per group (the answer is kept): the reason the automatic choice is not the copy
    // engines, which users comparing backends would otherwise have to guess.
    std::fprintf(stderr,
                 "meshla: %s; backend=auto runs nccl on this group of %d, and "
                 "backend=symmetric runs over CUDA peer access without NVLink\n",
                 group.without_nvlink.c_str(), state.size);
  }
  const PeerIdentity& me = everyone[static_cast<std::size_t>(state.rank)];
  DeviceGuard guard(state.device);
  for (const PeerIdentity& peer : everyone) {
    if (peer.process != me.process || peer.device == me.device) continue;
    const cudaError_t enabled = cudaDeviceEnablePeerAccess(peer.device, 0);
    if (enabled == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();  // not an error here; clear it so no later check reports it
    } else {
      MESHLA_CHECK_CUDA(enabled);
    }
  }
  return group;
}

namespace {

struct ExportedPart {
  cudaIpcMemHandle_t handle{};
  std::uint64_t process = 0;
  std::uint64_t address = 0;
  std::int32_t device = -1;
};

}  // namespace

PeerBuffer::PeerBuffer(const CommState& state, std::size_t bytes)
    : memory_(state.device, bytes),
      parts_(static_cast<std::size_t>(state.size), nullptr),
      device_(state.device) {
  MESHLA_ASSERT(bytes > 0);
  DeviceGuard guard(device_);
  {
    Stream stream(device_, /*high_priority=*/false);
    MESHLA_CHECK_CUDA(cudaMemsetAsync(memory_.data(), 0, bytes, stream.get()));
    MESHLA_CHECK_CUDA(cudaStreamSynchronize(stream.get()));
  }
  ExportedPart mine;
  MESHLA_CHECK_CUDA(cudaIpcGetMemHandle(&mine.handle, memory_.data()));
  mine.process = process_token();
  mine.address = reinterpret_cast<std::uint64_t>(memory_.data());
  mine.device = device_;
  // Gathering also orders every rank's zeroing before any rank's first write into a peer.
  const std::vector<ExportedPart> parts = all_gather_records(state, mine);
  try {
    for (int rank = 0; rank < state.size; ++rank) {
      const ExportedPart& part = parts[static_cast<std::size_t>(rank)];
      char*& address = parts_[static_cast<std::size_t>(rank)];
      if (rank == state.rank) {
        address = local();
      } else if (part.process == mine.process) {
        address = reinterpret_cast<char*>(part.address);  // peer access: ask_for_peer_access
      } else {
        void* opened = nullptr;
        MESHLA_CHECK_CUDA(
            cudaIpcOpenMemHandle(&opened, part.handle, cudaIpcMemLazyEnablePeerAccess));
        address = static_cast<char*>(opened);
        imported_.push_back(address);
      }
    }
  } catch (...) {
    close_imports();
    throw;
  }
}

PeerBuffer::~PeerBuffer() { close_imports(); }

PeerBuffer::PeerBuffer(PeerBuffer&& other) noexcept
    : memory_(std::move(other.memory_)),
      parts_(std::move(other.parts_)),
      imported_(std::move(other.imported_)),
      device_(other.device_) {}

PeerBuffer& PeerBuffer::operator=(PeerBuffer&& other) noexcept {
  if (this != &other) {
    close_imports();
    memory_ = std::move(other.memory_);
    parts_ = std::move(other.parts_);
    imported_ = std::move(other.imported_);
    device_ = other.device_;
  }
  return *this;
}

void PeerBuffer::close_imports() noexcept {
  if (imported_.empty()) return;
  int previous = -1;
  cudaGetDevice(&previous);
  cudaSetDevice(device_);
  for (char* address : imported_) cudaIpcCloseMemHandle(address);
  imported_.clear();
  if (previous >= 0) cudaSetDevice(previous);
}

}  // namespace meshla::detail
