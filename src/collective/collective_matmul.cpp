// CollectiveMatmul: picks the backend, checks every call's arguments and runs the executions in
// their executor's order (one at a time per group workspace); the backends
// (collective/executor.hpp) enqueue the work.
#include "meshla/collective_matmul.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "collective/executor.hpp"
#include "collective/group_workspace.hpp"
#include "comm/comm_state.hpp"
#include "comm/peer_memory.hpp"
#include "core/cuda_checks.hpp"
#include "core/cuda_handles.hpp"
#include "runtime/releases.hpp"
#ifdef MESHLA_WITH_CUBLASMP
#include "collective/cublasmp/cublasmp_library.hpp"
#endif
#include "collective/validation.hpp"

namespace meshla {

std::string_view collective_op_name(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::kAllGatherMatmul:
      return "all_gather_matmul";
    case CollectiveOp::kMatmulReduceScatter:
      return "matmul_reduce_scatter";
    case CollectiveOp::kMatmulAllReduce:
      return "matmul_all_reduce";
  }
  return "unknown";
}

std::string_view algorithm_name(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::kAuto:
      return "auto";
    case Algorithm::kSequential:
      return "sequential";
    case Algorithm::kPipelined:
      return "pipelined";
    case Algorithm::kRing:
      return "ring";
  }
  return "unknown";
}

std::string_view backend_name(Backend backend) {
  switch (backend) {
    case Backend::kAuto:
      return "auto";
    case Backend::kNccl:
      return "nccl";
    case Backend::kSymmetric:
      return "symmetric";
    case Backend::kCublasMp:
      return "cublasmp";
  }
  return "unknown";
}

std::string backend_unavailable_reason(Backend backend) {
  if (backend != Backend::kCublasMp) return "";
#ifdef MESHLA_WITH_CUBLASMP
  std::string why;
  return collective::cublasmp_library(&why) != nullptr ? "" : why;
#else
  return "meshla was built without cuBLASMp (MESHLA_WITH_CUBLASMP=OFF: pip install "
         "nvidia-cublasmp-cu13==0.7.* and rebuild)";
#endif
}

namespace collective {

SideStreams::SideStreams(int device, std::size_t count, bool high_priority) : forked_(device) {
  for (std::size_t i = 0; i < count; ++i) {
    streams_.emplace_back(device, high_priority);
    joined_.emplace_back(device);
  }
}

void SideStreams::fork(cudaStream_t stream) {
  MESHLA_CHECK_CUDA(cudaEventRecord(forked_.get(), stream));
  for (const detail::Stream& side : streams_) {
    MESHLA_CHECK_CUDA(cudaStreamWaitEvent(side.get(), forked_.get(), 0));
  }
}

void SideStreams::join(cudaStream_t stream) {
  for (std::size_t i = 0; i < streams_.size(); ++i) {
    MESHLA_CHECK_CUDA(cudaEventRecord(joined_[i].get(), streams_[i].get()));
    MESHLA_CHECK_CUDA(cudaStreamWaitEvent(stream, joined_[i].get(), 0));
  }
}

void SideStreams::join_after_failure(cudaStream_t stream) noexcept {
  for (std::size_t i = 0; i < streams_.size(); ++i) {
    cudaEventRecord(joined_[i].get(), streams_[i].get());
    cudaStreamWaitEvent(stream, joined_[i].get(), 0);
  }
}

std::shared_ptr<detail::ExecutionOrder> plan_order(const Communicator& comm) {
  return std::make_shared<detail::ExecutionOrder>(
      comm.device(), detail::rank_description(*comm.state()), comm.timeout());
}

std::shared_ptr<detail::ExecutionOrder> workspace_order(
    const std::shared_ptr<collective::GroupWorkspace>& workspace) {
  return {workspace, &workspace->order()};
}

int overlapped_gemm_sms(const CollectiveMatmulConfig& config, int device) {
  if (config.comm_sms <= 0) return 0;
  int device_sms = 0;
  MESHLA_CHECK_CUDA(cudaDeviceGetAttribute(&device_sms, cudaDevAttrMultiProcessorCount, device));
  MESHLA_CHECK_ARG(config.comm_sms < device_sms, collective_op_name(config.op)
                                                     << ": comm_sms=" << config.comm_sms
                                                     << " leaves no SM of the " << device_sms
                                                     << " on cuda:" << device << " to the GEMM");
  return device_sms - config.comm_sms;
}

}  // namespace collective

namespace {

// "all_gather_matmul (backend=nccl)": the watchdog's name for a run, which must outlive it.
const char* run_name(CollectiveOp op, Backend backend) {
  constexpr std::array kOps{CollectiveOp::kAllGatherMatmul, CollectiveOp::kMatmulReduceScatter,
                            CollectiveOp::kMatmulAllReduce};
  constexpr std::array kBackends{Backend::kAuto, Backend::kNccl, Backend::kSymmetric,
                                 Backend::kCublasMp};
  static const std::vector<std::string> names = [&] {
    std::vector<std::string> all;
    for (CollectiveOp each_op : kOps) {
      for (Backend each_backend : kBackends) {
        all.push_back(std::string(collective_op_name(each_op)) +
                      " (backend=" + std::string(backend_name(each_backend)) + ")");
      }
    }
    return all;
  }();
  const auto position = [](const auto& values, auto value) {
    return static_cast<std::size_t>(std::find(values.begin(), values.end(), value) -
                                    values.begin());
  };
  return names[position(kOps, op) * kBackends.size() + position(kBackends, backend)].c_str();
}

// Where this process drives several ranks of the group, waits until each has enqueued its part of
// the eager run just enqueued on `stream` (see EnqueueMeeting). A captured run enqueues nothing on
// the device: its graph's launches are the caller's to order. Bounded by twice the group's timeout:
// a peer that never calls also leaves this rank's run unfinished, and the watchdog, at the timeout,
// ends the process with the message that names the run.
void meet_after_enqueue(const detail::CommState& state, cudaStream_t stream, const char* run) {
  if (state.enqueue_meeting == nullptr) return;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  MESHLA_CHECK_CUDA(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return;
  state.enqueue_meeting->arrive(state.rank, run, 2 * state.timeout);
}

// Throws kNotImplemented on every rank unless the backend can run on all of them, so that no
// rank goes on into a collective set-up that another rank never joins. Collective.
void require_on_every_rank(const Communicator& comm, const CollectiveMatmulConfig& config) {
  const std::string why = backend_unavailable_reason(config.backend);
  const std::byte available{why.empty()};
  const std::vector<std::byte> everyone =
      comm.size() > 1 ? detail::all_gather_host(*comm.state(), &available, 1)
                      : std::vector<std::byte>{available};
  MESHLA_CHECK(kNotImplemented, why.empty(),
               collective_op_name(config.op)
                   << ": backend=" << backend_name(config.backend) << " is unavailable: " << why);
  for (std::size_t rank = 0; rank < everyone.size(); ++rank) {
    MESHLA_CHECK(kNotImplemented, everyone[rank] == std::byte{1},
                 collective_op_name(config.op)
                     << ": backend=" << backend_name(config.backend) << " is unavailable on rank "
                     << rank << " of the group");
  }
}

std::unique_ptr<collective::Executor> make_executor(const Communicator& comm,
                                                    const CollectiveMatmulConfig& config) {
  switch (config.backend) {
    case Backend::kSymmetric:
      return collective::make_symmetric_executor(comm, config);
#ifdef MESHLA_WITH_CUBLASMP
    case Backend::kCublasMp:
      return collective::make_cublasmp_executor(comm, config);
#endif
    default:
      MESHLA_ASSERT(config.backend == Backend::kNccl);
      return collective::make_nccl_executor(comm, config);
  }
}

// Before a plan goes, with the buffers and the communicator it may take along: waits for the last
// eager execution in `order` (a graph that captured the plan's runs holds the plan itself, see
// hold_in_graph; a cublasmp plan's it does not, and must not outlive). One that never finishes ends
// the process through the order's watchdog, at its timeout counted from its enqueue, so before this
// wait gives up; should the watchdog not have, this says so and returns false, and the plan leaks
// its whole state (memory, and the communicator whose abort would cut the stalled execution short),
// since freeing memory that the execution may use would wait for it.
bool finished_before_teardown(const detail::ExecutionOrder& order, const Communicator& comm,
                              std::string_view plan) {
  if (order.wait_for_last_eager(comm.timeout()) != cudaErrorNotReady) return true;
  std::fprintf(stderr,
               "meshla: %s plan destroyed while its group's last execution was still running "
               "after %lld ms; its buffers are left allocated\n",
               std::string(plan).c_str(), static_cast<long long>(comm.timeout().count()));
  return false;
}

// A plan's state, shared by the plan and by the CUDA graphs that captured its runs, and deleted
// with the last of them unless its last execution never finished (finished_before_teardown).
template <typename Impl>
std::shared_ptr<Impl> shared_plan_state(std::unique_ptr<Impl> state) {
  return std::shared_ptr<Impl>(state.release(), [](Impl* last) {
    if (finished_before_teardown(last->order(), last->comm, last->name())) delete last;
  });
}

// The group's answer to ask_for_peer_access, asked by its first plan that may run symmetric
// (collective: every rank's first such plan asks, as they are built in the same order) and kept
// with the communicator (CommState::resource).
struct PeerAccessAnswer {
  explicit PeerAccessAnswer(const detail::CommState&) {}
  std::optional<detail::PeerAccess> answer;
};

const detail::PeerAccess& peer_access_of(detail::CommState& state) {
  std::optional<detail::PeerAccess>& answer = state.resource<PeerAccessAnswer>()->answer;
  if (!answer) answer = detail::ask_for_peer_access(state);
  return *answer;
}

// Resolves the config, once every rank of the group has given the same one, asking the group
// whether its ranks map each other's memory, and over NVLink, when the backend may be symmetric.
// Collective: every rank asks, or none does.
CollectiveMatmulConfig resolve_for_group(const Communicator& comm,
                                         const CollectiveMatmulConfig& requested) {
  if (comm.size() > 1) {
    collective::require_same_config(
        detail::all_gather_records(*comm.state(), collective::config_record(requested)),
        comm.rank());
  }
  if (requested.backend == Backend::kCublasMp) {
    CollectiveMatmulConfig resolved = collective::resolve_config(requested, comm.size());
    require_on_every_rank(comm, requested);
    return resolved;
  }
  collective::PeerReach reach = collective::PeerReach::kNone;
  if (requested.backend != Backend::kNccl && comm.size() >= 2) {
    const detail::PeerAccess& access = peer_access_of(*comm.state());
    MESHLA_CHECK(kNotImplemented, access.mapped() || requested.backend != Backend::kSymmetric,
                 collective_op_name(requested.op)
                     << ": backend=symmetric needs every rank to map every other rank's memory, "
                        "but "
                     << access.unmappable << "; use backend=nccl");
    reach = access.over_nvlink() ? collective::PeerReach::kNvlink
            : access.mapped()    ? collective::PeerReach::kMapped
                                 : collective::PeerReach::kNone;
  } else if (comm.size() == 1) {
    reach = collective::PeerReach::kNvlink;
  }
  return collective::resolve_config(requested, comm.size(), reach);
}

}  // namespace

struct CollectiveMatmul::Impl : std::enable_shared_from_this<CollectiveMatmul::Impl> {
  Impl(Communicator comm_, const CollectiveMatmulConfig& requested)
      : comm(std::move(comm_)),
        config(resolve_for_group(comm, requested)),
        executor(make_executor(comm, config)) {}

  void execute(const CollectiveMatmulArgs& args, cudaStream_t stream) {
    collective::validate_args(config, comm.size(), comm.device(), args);
    detail::DeviceGuard guard(comm.device());
    // One execution at a time on the executor's buffers: a run waits for the previous one,
    // stream-ordered, also across streams and within one capture (two micro-batches of one layer
    // in one graph).
    detail::ExecutionOrder& order = executor->order();
    const cudaGraph_t capturing_graph = order.begin(stream, run_name(config.op, config.backend));
    try {
      // Not a cublasmp plan: its NVSHMEM memory is freed collectively, in the order in which the
      // ranks let go of their plans, which a graph's release, whenever it comes, would not keep.
      if (capturing_graph != nullptr && config.backend != Backend::kCublasMp) {
        detail::hold_in_graph(capturing_graph, comm.device(), shared_from_this());
      }
      executor->enqueue(args, stream);
    } catch (...) {
      order.end_after_failure(stream);
      throw;
    }
    order.end(stream);
    meet_after_enqueue(*comm.state(), stream, run_name(config.op, config.backend));
  }

  const detail::ExecutionOrder& order() const { return executor->order(); }
  std::string_view name() const { return collective_op_name(config.op); }

  Communicator comm;
  CollectiveMatmulConfig config;
  std::unique_ptr<collective::Executor> executor;
};

CollectiveMatmul::CollectiveMatmul(Communicator comm, const CollectiveMatmulConfig& config)
    : impl_(shared_plan_state(std::make_unique<Impl>(std::move(comm), config))) {}
CollectiveMatmul::~CollectiveMatmul() = default;
CollectiveMatmul::CollectiveMatmul(CollectiveMatmul&&) noexcept = default;
CollectiveMatmul& CollectiveMatmul::operator=(CollectiveMatmul&&) noexcept = default;

void CollectiveMatmul::execute(const CollectiveMatmulArgs& args, cudaStream_t stream) {
  impl_->execute(args, stream);
}

const CollectiveMatmulConfig& CollectiveMatmul::config() const { return impl_->config; }
const Communicator& CollectiveMatmul::communicator() const { return impl_->comm; }

struct AllGather::Impl : std::enable_shared_from_this<AllGather::Impl> {
  Impl(Communicator comm_in, const AllGatherConfig& config_in)
      : comm(std::move(comm_in)),
        config((collective::check_all_gather_config(config_in), config_in)),
        type(collective::nccl_type(config.dtype)),
        execution_order(
            collective::workspace_order(collective::GroupWorkspace::of(*comm.state()))) {}

  void execute(const TensorView& rows, const TensorView& gathered, cudaStream_t stream) {
    collective::validate_all_gather(config, comm.size(), comm.device(), rows, gathered);
    detail::DeviceGuard guard(comm.device());
    // After the group's previous execution, whose NCCL calls on this communicator may be on
    // another stream, and before its next.
    detail::ExecutionOrder& order = *execution_order;
    const cudaGraph_t capturing_graph = order.begin(stream, "all_gather (backend=nccl)");
    try {
      if (capturing_graph != nullptr) {
        detail::hold_in_graph(capturing_graph, comm.device(), shared_from_this());
      }
      const auto count = static_cast<std::size_t>(config.rows * config.cols);
      if (comm.size() == 1) {
        // One rank's rows are all there is: a copy, without NCCL's host time (see the one-rank
        // sequential schedules).
        MESHLA_CHECK_CUDA(cudaMemcpyAsync(gathered.data, rows.data,
                                          count * dtype_size(config.dtype),
                                          cudaMemcpyDeviceToDevice, stream));
      } else {
        MESHLA_CHECK_NCCL(
            ncclAllGather(rows.data, gathered.data, count, type, comm.state()->comm, stream));
      }
    } catch (...) {
      order.end_after_failure(stream);
      throw;
    }
    order.end(stream);
    meet_after_enqueue(*comm.state(), stream, "all_gather (backend=nccl)");
  }

  const detail::ExecutionOrder& order() const { return *execution_order; }
  std::string_view name() const { return "all_gather"; }

  Communicator comm;
  AllGatherConfig config;
  ncclDataType_t type;
  // The group's workspace's, shared with the nccl and symmetric plans' executions (the workspace
  // is made here if the group has none yet).
  std::shared_ptr<detail::ExecutionOrder> execution_order;
};

AllGather::AllGather(Communicator comm, const AllGatherConfig& config)
    : impl_(shared_plan_state(std::make_unique<Impl>(std::move(comm), config))) {}
AllGather::~AllGather() = default;
AllGather::AllGather(AllGather&&) noexcept = default;
AllGather& AllGather::operator=(AllGather&&) noexcept = default;

void AllGather::execute(const TensorView& rows, const TensorView& gathered, cudaStream_t stream) {
  impl_->execute(rows, gathered, stream);
}

const AllGatherConfig& AllGather::config() const { return impl_->config; }

struct CollectivePlans::Impl {
  Communicator comm;
  std::map<collective::ConfigRecord, CollectiveMatmul> matmuls;
  std::map<std::array<std::int64_t, 3>, AllGather> gathers;  // dtype, rows, cols
};

CollectivePlans::CollectivePlans(Communicator comm)
    : impl_(std::make_unique<Impl>(Impl{.comm = std::move(comm)})) {}
CollectivePlans::~CollectivePlans() = default;
CollectivePlans::CollectivePlans(CollectivePlans&&) noexcept = default;
CollectivePlans& CollectivePlans::operator=(CollectivePlans&&) noexcept = default;

CollectiveMatmul& CollectivePlans::matmul(const CollectiveMatmulConfig& config) {
  const collective::ConfigRecord key = collective::config_record(config);
  auto found = impl_->matmuls.find(key);
  if (found == impl_->matmuls.end()) {
    found = impl_->matmuls.emplace(key, CollectiveMatmul(impl_->comm, config)).first;
  }
  return found->second;
}

AllGather& CollectivePlans::all_gather(const AllGatherConfig& config) {
  const std::array<std::int64_t, 3> key{static_cast<std::int64_t>(config.dtype), config.rows,
                                        config.cols};
  auto found = impl_->gathers.find(key);
  if (found == impl_->gathers.end()) {
    found = impl_->gathers.emplace(key, AllGather(impl_->comm, config)).first;
  }
  return found->second;
}

void CollectivePlans::clear() {
  impl_->matmuls.clear();
  impl_->gathers.clear();
}

std::size_t CollectivePlans::size() const { return impl_->matmuls.size() + impl_->gathers.size(); }

const Communicator& CollectivePlans::communicator() const { return impl_->comm; }

}  // namespace meshla
