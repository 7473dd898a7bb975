#include "meshla/communicator.hpp"

#include <cstring>
#include <thread>
#include <utility>

#include "comm/comm_state.hpp"
#include "core/cuda_checks.hpp"
#include "core/cuda_handles.hpp"
#include "runtime/releases.hpp"

namespace meshla {
namespace detail {

CommState::CommState(ncclComm_t comm_, ncclComm_t bootstrap_, int rank_, int size_, int device_,
                     std::chrono::milliseconds timeout_,
                     std::function<void(std::vector<ncclComm_t>)> release)
    : comm(comm_),
      bootstrap(bootstrap_),
      rank(rank_),
      size(size_),
      device(device_),
      timeout(timeout_),
      release_(std::move(release)) {}

CommState::~CommState() {
  // The layers' resources go on a thread of their own: a cudaFree waits for the work queued on the
  // peer devices, which, where one process drives several ranks, may wait for a thread that the
  // one letting go here holds up (Python's, holding the GIL).
  if (!resources_.empty()) {
    release_on_own_thread(device,
                          [resources = std::move(resources_)]() mutable { resources.clear(); });
  }
  if (!release_) return;
  std::vector<ncclComm_t> comms;
  for (ncclComm_t handle : {comm, bootstrap}) {
    if (handle != nullptr) comms.push_back(handle);
  }
  if (!comms.empty()) release_(std::move(comms));
}

void release_nccl_comms(std::vector<ncclComm_t> comms) {
  int device = 0;  // left 0 only if NCCL cannot say, which a live communicator always can
  ncclCommCuDevice(comms.front(), &device);
  release_on_own_thread(device, [comms] {
    for (ncclComm_t comm : comms) ncclCommAbort(comm);
  });
}

std::string rank_description(const CommState& state) {
  return "rank " + std::to_string(state.rank) + " of " + std::to_string(state.size) +
         ", cuda:" + std::to_string(state.device);
}

std::shared_ptr<CommState> split_with_max_ctas(const CommState& parent, int max_ctas) {
  MESHLA_CHECK_ARG(max_ctas >= 1, "split_with_max_ctas: max_ctas=" << max_ctas << " must be >= 1");
  DeviceGuard guard(parent.device);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
  config.minCTAs = 1;
  config.maxCTAs = max_ctas;
  ncclComm_t child = nullptr;
  // The parent is blocking, so the split completes (with every rank) before it returns.
  MESHLA_CHECK_NCCL(ncclCommSplit(parent.comm, 0, parent.rank, &child, &config));
  MESHLA_CHECK(kNccl, child != nullptr, "ncclCommSplit returned no communicator");
  auto state = std::make_shared<CommState>(child, nullptr, parent.rank, parent.size, parent.device,
                                           parent.timeout, release_nccl_comms);
  state->enqueue_meeting = parent.enqueue_meeting;
  return state;
}

std::vector<std::byte> all_gather_host(const CommState& state, const void* data,
                                       std::size_t bytes) {
  DeviceGuard guard(state.device);
  // Everything here is ordered on a private stream and the staging memory comes from the
  // stream-ordered allocator: no call below may wait for the whole device, nor (cudaFree with
  // peer access enabled) for a peer device, whose queued work may wait for this thread's next
  // call. NCCL's own rule for several GPUs driven from one process.
  Stream stream(state.device, /*high_priority=*/false);
  Event gathered(state.device);
  const std::size_t total = bytes * static_cast<std::size_t>(state.size);
  void* staging = nullptr;
  MESHLA_CHECK_CUDA(cudaMallocAsync(&staging, total, stream.get()));
  char* mine = static_cast<char*>(staging) + bytes * static_cast<std::size_t>(state.rank);
  MESHLA_CHECK_CUDA(cudaMemcpyAsync(mine, data, bytes, cudaMemcpyHostToDevice, stream.get()));
  MESHLA_CHECK_NCCL(ncclAllGather(mine, staging, bytes, ncclUint8, state.comm, stream.get()));
  MESHLA_CHECK_CUDA(cudaEventRecord(gathered.get(), stream.get()));
  // A stalled exchange keeps its staging memory: freeing it would wait for the stalled kernel.
  const cudaError_t status = wait_for_event(gathered.get(), state.timeout);
  MESHLA_CHECK(kTimeout, status != cudaErrorNotReady,
               "all_gather_host: rank " << state.rank << " of " << state.size << " waited "
                                        << state.timeout.count()
                                        << " ms for its peers; is every rank building the same "
                                           "plan?");
  MESHLA_CHECK_CUDA(status);
  std::vector<std::byte> all(total);
  MESHLA_CHECK_CUDA(
      cudaMemcpyAsync(all.data(), staging, total, cudaMemcpyDeviceToHost, stream.get()));
  MESHLA_CHECK_CUDA(cudaFreeAsync(staging, stream.get()));
  MESHLA_CHECK_CUDA(cudaStreamSynchronize(stream.get()));
  return all;
}

NcclGroup::NcclGroup() { MESHLA_CHECK_NCCL(ncclGroupStart()); }

NcclGroup::~NcclGroup() {
  if (open_) ncclGroupEnd();
}

ncclResult_t NcclGroup::end() {
  open_ = false;
  return ncclGroupEnd();
}

namespace {

ncclConfig_t config_with_blocking(int blocking) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = blocking;
  return config;
}

ncclUniqueId to_nccl(const UniqueId& id) {
  static_assert(sizeof(ncclUniqueId) == UniqueId::kSize);
  ncclUniqueId nccl_id;
  std::memcpy(&nccl_id, id.bytes.data(), UniqueId::kSize);
  return nccl_id;
}

// Waits until a nonblocking communicator has finished `what` (its creation, or a split it runs).
// Throws kNccl on an asynchronous error and kTimeout when `timeout` passes first.
void wait_until_done(ncclComm_t comm, const char* what, int rank, int size, int device,
                     std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::microseconds(10);
  while (true) {
    ncclResult_t async_status = ncclSuccess;
    MESHLA_CHECK_NCCL(ncclCommGetAsyncError(comm, &async_status));
    if (async_status == ncclSuccess) return;
    if (async_status != ncclInProgress) throw_nccl_error(async_status, what, __FILE__, __LINE__);
    if (std::chrono::steady_clock::now() > deadline) {
      MESHLA_THROW(kTimeout, "Communicator: " << what << " for rank " << rank << " of " << size
                                              << " on device " << device
                                              << " did not complete within " << timeout.count()
                                              << " ms; is every rank of the group creating it "
                                                 "with the same unique id?");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(10000));
  }
}

// Owns the communicators of one creation until they are handed to CommStates, aborting them if
// creation fails part-way: here, on the failing thread, not with release_nccl_comms, since a
// parent's split job may still be writing a twin's handle into `comms` until the parent's abort
// has returned. The peers, failing too, abort theirs within their own timeout.
struct PendingComms {
  std::vector<ncclComm_t> comms;
  explicit PendingComms(std::size_t count) : comms(count, nullptr) {}
  ~PendingComms() {
    for (ncclComm_t comm : comms) {
      if (comm != nullptr) ncclCommAbort(comm);
    }
  }
  std::vector<ncclComm_t> release() { return std::exchange(comms, {}); }
};

// Creates the ranks `ranks` (devices `devices`) of a group of `size` from one id: nonblocking
// creation bounded by the timeout, then a blocking twin split from each (see CommState).
std::vector<Communicator> create_ranks(const ncclUniqueId& id, const std::vector<int>& ranks,
                                       const std::vector<int>& devices, int size,
                                       std::chrono::milliseconds timeout) {
  const std::size_t count = ranks.size();
  // Declared first so destroyed last: on failure the parents are aborted first, which stops a
  // split job of theirs that may still be writing a twin's handle.
  PendingComms twins(count);
  PendingComms bootstraps(count);
  std::vector<ncclConfig_t> configs(count, config_with_blocking(0));
  DeviceGuard guard(devices[0]);
  {
    // One group: the ranks of a single process must be created together or they wait for each
    // other forever.
    NcclGroup group;
    for (std::size_t i = 0; i < count; ++i) {
      MESHLA_CHECK_CUDA(cudaSetDevice(devices[i]));
      MESHLA_CHECK_NCCL(
          ncclCommInitRankConfig(&bootstraps.comms[i], size, id, ranks[i], &configs[i]));
    }
    const ncclResult_t started = group.end();
    if (started != ncclSuccess && started != ncclInProgress) {
      throw_nccl_error(started, "ncclGroupEnd (communicator creation)", __FILE__, __LINE__);
    }
  }
  for (std::size_t i = 0; i < count; ++i) {
    wait_until_done(bootstraps.comms[i], "ncclCommInitRankConfig", ranks[i], size, devices[i],
                    timeout);
  }
  // Every rank has now shown up, so the blocking split below has no one left to wait for.
  std::vector<ncclConfig_t> blocking(count, config_with_blocking(1));
  {
    NcclGroup group;
    for (std::size_t i = 0; i < count; ++i) {
      MESHLA_CHECK_CUDA(cudaSetDevice(devices[i]));
      MESHLA_CHECK_NCCL(
          ncclCommSplit(bootstraps.comms[i], 0, ranks[i], &twins.comms[i], &blocking[i]));
    }
    const ncclResult_t split = group.end();
    if (split != ncclSuccess && split != ncclInProgress) {
      throw_nccl_error(split, "ncclGroupEnd (ncclCommSplit)", __FILE__, __LINE__);
    }
  }
  for (std::size_t i = 0; i < count; ++i) {
    // The split runs as a job of the nonblocking parent, which reports its progress; the twin's
    // handle is written only when that job is done.
    wait_until_done(bootstraps.comms[i], "ncclCommSplit", ranks[i], size, devices[i], timeout);
    MESHLA_CHECK(kNccl, twins.comms[i] != nullptr,
                 "ncclCommSplit finished without a communicator for rank " << ranks[i]);
    wait_until_done(twins.comms[i], "ncclCommSplit", ranks[i], size, devices[i], timeout);
  }
  std::vector<ncclComm_t> made = twins.release();
  std::vector<ncclComm_t> parents = bootstraps.release();
  const auto meeting =
      count > 1 ? std::make_shared<EnqueueMeeting>(static_cast<int>(count)) : nullptr;
  std::vector<Communicator> result;
  for (std::size_t i = 0; i < count; ++i) {
    result.emplace_back(std::make_shared<CommState>(made[i], parents[i], ranks[i], size, devices[i],
                                                    timeout, release_nccl_comms));
    result.back().state()->enqueue_meeting = meeting;
  }
  return result;
}

void check_arguments(int rank, int size, int device, std::chrono::milliseconds timeout) {
  MESHLA_CHECK_ARG(size >= 1, "Communicator: size=" << size << " must be at least 1");
  MESHLA_CHECK_ARG(rank >= 0 && rank < size,
                   "Communicator: rank=" << rank << " is outside [0, size=" << size << ")");
  MESHLA_CHECK_ARG(timeout.count() > 0,
                   "Communicator: timeout=" << timeout.count() << " ms must be positive");
  int device_count = 0;
  MESHLA_CHECK_CUDA(cudaGetDeviceCount(&device_count));
  MESHLA_CHECK_ARG(device >= 0 && device < device_count,
                   "Communicator: device=" << device << " is outside the " << device_count
                                           << " visible CUDA devices");
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
  return detail::create_ranks(detail::to_nccl(id), {rank}, {device}, size, options.timeout).front();
}

std::vector<Communicator> Communicator::create_local(const std::vector<int>& devices,
                                                     const CommunicatorOptions& options) {
  const int size = static_cast<int>(devices.size());
  MESHLA_CHECK_ARG(size >= 1, "Communicator.create_local: devices is empty");
  std::vector<int> ranks;
  for (int rank = 0; rank < size; ++rank) {
    detail::check_arguments(rank, size, devices[rank], options.timeout);
    for (int other = 0; other < rank; ++other) {
      MESHLA_CHECK_ARG(devices[other] != devices[rank],
                       "Communicator.create_local: device " << devices[rank] << " is listed twice");
    }
    ranks.push_back(rank);
  }
  return detail::create_ranks(detail::to_nccl(make_unique_id()), ranks, devices, size,
                              options.timeout);
}

int Communicator::rank() const { return state_->rank; }
int Communicator::size() const { return state_->size; }
int Communicator::device() const { return state_->device; }
std::chrono::milliseconds Communicator::timeout() const { return state_->timeout; }

}  // namespace meshla
