#include "meshla/communicator.hpp"

#include <cstring>
#include <thread>

#include "comm/comm_state.hpp"
#include "core/cuda_checks.hpp"
#include "core/cuda_handles.hpp"

namespace meshla {
namespace detail {

CommState::CommState(ncclComm_t comm_, int rank_, int size_, int device_,
                     std::chrono::milliseconds timeout_, std::function<void(ncclComm_t)> release)
    : comm(comm_),
      rank(rank_),
      size(size_),
      device(device_),
      timeout(timeout_),
      release_(std::move(release)) {}

CommState::~CommState() {
  if (release_) release_(comm);
}

void release_nccl_comm(ncclComm_t comm) {
  if (comm != nullptr) ncclCommAbort(comm);
}

void wait_until_ready(const CommState& state, const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + state.timeout;
  auto pause = std::chrono::microseconds(10);
  while (true) {
    ncclResult_t async_status = ncclSuccess;
    MESHLA_CHECK_NCCL(ncclCommGetAsyncError(state.comm, &async_status));
    if (async_status == ncclSuccess) return;
    if (async_status != ncclInProgress) {
      throw_nccl_error(async_status, what, __FILE__, __LINE__);
    }
    if (std::chrono::steady_clock::now() > deadline) {
      MESHLA_THROW(kTimeout, what << " did not complete within " << state.timeout.count()
                                  << " ms on rank " << state.rank << " of " << state.size
                                  << " (device " << state.device
                                  << "); is every rank of the group taking part?");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(10000));
  }
}

void check_nccl_on(const CommState& state, ncclResult_t status, const char* call, const char* file,
                   int line) {
  if (status == ncclSuccess) return;
  if (status == ncclInProgress) {
    wait_until_ready(state, call);
    return;
  }
  throw_nccl_error(status, call, file, line);
}

namespace {

ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  // Nonblocking, so that every wait for peers is ours and bounded by the timeout.
  config.blocking = 0;
  return config;
}

ncclUniqueId to_nccl(const UniqueId& id) {
  static_assert(sizeof(ncclUniqueId) == UniqueId::kSize);
  ncclUniqueId nccl_id;
  std::memcpy(&nccl_id, id.bytes.data(), UniqueId::kSize);
  return nccl_id;
}

// Takes ownership of a communicator whose creation was started, waiting for it to finish; on
// failure the half-made communicator is aborted with the state.
std::shared_ptr<CommState> adopt(ncclComm_t comm, int rank, int size, int device,
                                 std::chrono::milliseconds timeout, const char* what) {
  auto state = std::make_shared<CommState>(comm, rank, size, device, timeout, release_nccl_comm);
  wait_until_ready(*state, what);
  return state;
}

void check_arguments(int rank, int size, int device, std::chrono::milliseconds timeout) {
  MESHLA_CHECK_ARG(size >= 1, "Communicator: size=" << size << " must be at least 1");
  MESHLA_CHECK_ARG(rank >= 0 && rank < size,
                   "Communicator: rank=" << rank << " is outside [0, size=" << size << ")");
  int device_count = 0;
  MESHLA_CHECK_CUDA(cudaGetDeviceCount(&device_count));
  MESHLA_CHECK_ARG(device >= 0 && device < device_count,
                   "Communicator: device=" << device << " is outside the " << device_count
                                           << " visible CUDA devices");
  MESHLA_CHECK_ARG(timeout.count() > 0,
                   "Communicator: timeout=" << timeout.count() << " ms must be positive");
}

}  // namespace
}  // namespace detail

UniqueId make_unique_id() {
  ncclUniqueId nccl_id;
  MESHLA_CHECK_NCCL(ncclGetUniqueId(&nccl_id));
  UniqueId id;
  std::memcpy(id.bytes.data(), &nccl_id, UniqueId::kSize);
  return id;
}

Communicator::Communicator(std::shared_ptr<detail::CommState> state) : state_(std::move(state)) {
  MESHLA_ASSERT(state_ != nullptr);
}

Communicator Communicator::create(const UniqueId& id, int rank, int size, int device,
                                  const CommunicatorOptions& options) {
  detail::check_arguments(rank, size, device, options.timeout);
  detail::DeviceGuard guard(device);
  ncclConfig_t config = detail::nonblocking_config();
  ncclComm_t comm = nullptr;
  const ncclResult_t status =
      ncclCommInitRankConfig(&comm, size, detail::to_nccl(id), rank, &config);
  if (status != ncclSuccess && status != ncclInProgress) {
    if (comm != nullptr) ncclCommAbort(comm);
    detail::throw_nccl_error(status, "ncclCommInitRankConfig", __FILE__, __LINE__);
  }
  return Communicator(
      detail::adopt(comm, rank, size, device, options.timeout, "ncclCommInitRankConfig"));
}

std::vector<Communicator> Communicator::create_local(const std::vector<int>& devices,
                                                     const CommunicatorOptions& options) {
  const int size = static_cast<int>(devices.size());
  MESHLA_CHECK_ARG(size >= 1, "Communicator.create_local: devices is empty");
  for (int rank = 0; rank < size; ++rank) {
    detail::check_arguments(rank, size, devices[rank], options.timeout);
    for (int other = 0; other < rank; ++other) {
      MESHLA_CHECK_ARG(devices[other] != devices[rank],
                       "Communicator.create_local: device " << devices[rank] << " is listed twice");
    }
  }
  const ncclUniqueId id = detail::to_nccl(make_unique_id());
  std::vector<ncclComm_t> comms(size, nullptr);
  std::vector<ncclConfig_t> configs(size, detail::nonblocking_config());
  {
    detail::DeviceGuard guard(devices[0]);
    MESHLA_CHECK_NCCL(ncclGroupStart());
    for (int rank = 0; rank < size; ++rank) {
      MESHLA_CHECK_CUDA(cudaSetDevice(devices[rank]));
      MESHLA_CHECK_NCCL(ncclCommInitRankConfig(&comms[rank], size, id, rank, &configs[rank]));
    }
    const ncclResult_t status = ncclGroupEnd();
    if (status != ncclSuccess && status != ncclInProgress) {
      for (ncclComm_t comm : comms) detail::release_nccl_comm(comm);
      detail::throw_nccl_error(status, "ncclGroupEnd", __FILE__, __LINE__);
    }
  }
  // Adopt every communicator before waiting on any, so a failure releases them all.
  std::vector<std::shared_ptr<detail::CommState>> states;
  for (int rank = 0; rank < size; ++rank) {
    states.push_back(std::make_shared<detail::CommState>(
        comms[rank], rank, size, devices[rank], options.timeout, detail::release_nccl_comm));
  }
  std::vector<Communicator> result;
  for (auto& state : states) {
    detail::wait_until_ready(*state, "ncclCommInitRankConfig");
    result.emplace_back(state);
  }
  return result;
}

int Communicator::rank() const { return state_->rank; }
int Communicator::size() const { return state_->size; }
int Communicator::device() const { return state_->device; }
std::chrono::milliseconds Communicator::timeout() const { return state_->timeout; }

}  // namespace meshla
