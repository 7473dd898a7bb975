// The NCCL backend of collective matmul: replays a Schedule with cuBLASLt GEMMs on the caller's
// stream and NCCL calls on a high-priority side stream forked from it.
#include "meshla/collective_matmul.hpp"

#include <cstdio>
#include <thread>

#include "comm/comm_state.hpp"
#include "core/cuda_checks.hpp"
#include "core/cuda_handles.hpp"
#include "meshla/matmul.hpp"
#include "overlap/schedule.hpp"
#include "overlap/validation.hpp"

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

namespace {

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return ncclBfloat16;
    case DType::kFloat16:
      return ncclFloat16;
    case DType::kFloat32:
      return ncclFloat32;
    default:
      MESHLA_THROW(kNotImplemented, "collective matmul: no NCCL type for " << dtype_name(dtype));
  }
}

// Device memory and row width of each schedule buffer for one execution.
struct Bindings {
  std::array<char*, 4> base{};
  std::array<std::int64_t, 4> width{};
  std::int64_t element = 0;

  char* at(overlap::Rows rows) const {
    const auto index = static_cast<std::size_t>(rows.buffer);
    return base[index] + rows.begin * width[index] * element;
  }
  std::int64_t count(overlap::Buffer buffer, std::int64_t rows) const {
    return rows * width[static_cast<std::size_t>(buffer)];
  }
  void bind(overlap::Buffer buffer, void* data, std::int64_t row_width) {
    base[static_cast<std::size_t>(buffer)] = static_cast<char*>(data);
    width[static_cast<std::size_t>(buffer)] = row_width;
  }
};

}  // namespace

struct CollectiveMatmul::Impl {
  Impl(Communicator comm_, const CollectiveMatmulConfig& requested)
      : comm(std::move(comm_)),
        config(overlap::resolve_config(requested, comm.size())),
        transfers(config.comm_ctas > 0
                      ? Communicator(detail::split_with_max_ctas(*comm.state(), config.comm_ctas))
                      : comm),
        schedule(overlap::make_schedule({.op = config.op,
                                         .algorithm = config.algorithm,
                                         .tp = comm.size(),
                                         .rank = comm.rank(),
                                         .m = config.m,
                                         .chunks = config.chunks,
                                         .bias = config.bias,
                                         .return_gathered = config.return_gathered})),
        matmul(comm.device()),
        comm_stream(comm.device(), /*high_priority=*/true),
        fork(comm.device()),
        join(comm.device()),
        done(comm.device()) {
    const int device = comm.device();
    int device_sms = 0;
    MESHLA_CHECK_CUDA(cudaDeviceGetAttribute(&device_sms, cudaDevAttrMultiProcessorCount, device));
    MESHLA_CHECK_ARG(config.comm_sms < device_sms, collective_op_name(config.op)
                                                       << ": comm_sms=" << config.comm_sms
                                                       << " leaves no SM of the " << device_sms
                                                       << " on cuda:" << device << " to the GEMM");
    gemm_sms = config.comm_sms > 0 ? device_sms - config.comm_sms : 0;
    const std::size_t element = dtype_size(config.dtype);
    if (config.op == CollectiveOp::kAllGatherMatmul && !config.return_gathered) {
      own_gathered = detail::DeviceBuffer(device, schedule.gathered_rows * config.k * element);
    }
    partial = detail::DeviceBuffer(device, schedule.partial_rows * config.n * element);
    for (std::size_t i = 0; i < schedule.gemms.size(); ++i) gemm_done.emplace_back(device);
    for (std::size_t i = 0; i < schedule.comms.size(); ++i) comm_done.emplace_back(device);
    for (const overlap::GemmTask& gemm : schedule.gemms) matmul.prepare(shape_of(gemm));
  }

  ~Impl() {
    if (!executed) return;
    // The buffers and the communicator may go with this plan: let the last eager execution
    // finish (graphs captured from the plan must not outlive it, like any captured buffer).
    const auto deadline = std::chrono::steady_clock::now() + comm.timeout();
    cudaError_t status = cudaEventQuery(done.get());
    while (status == cudaErrorNotReady && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      status = cudaEventQuery(done.get());
    }
    if (status == cudaErrorNotReady) {
      std::fprintf(stderr,
                   "meshla: %s plan destroyed while its last execution was still running after "
                   "%lld ms; its buffers are freed anyway\n",
                   std::string(collective_op_name(config.op)).c_str(),
                   static_cast<long long>(comm.timeout().count()));
    }
  }

  MatmulShape shape_of(const overlap::GemmTask& gemm) const {
    return {.dtype = config.dtype,
            .m = gemm.rows,
            .n = config.n,
            .k = config.k,
            .trans_b = config.trans_b,
            .batch = gemm.batch,
            .lda = config.k,
            .ldb = 0,
            .ldd = config.n,
            .batch_stride_a = gemm.a_stride * config.k,
            .batch_stride_d = gemm.d_stride * config.n,
            .bias = gemm.bias,
            .addend = gemm.has_addend,
            .sm_count = gemm.overlaps_comm ? gemm_sms : 0};
  }

  void run_gemm(std::size_t index, const Bindings& at, const CollectiveMatmulArgs& args,
                cudaStream_t stream) {
    const overlap::GemmTask& gemm = schedule.gemms[index];
    if (gemm.wait_comm >= 0) {
      MESHLA_CHECK_CUDA(cudaStreamWaitEvent(stream, comm_done[gemm.wait_comm].get(), 0));
    }
    matmul.run(shape_of(gemm),
               {.a = at.at(gemm.a),
                .b = args.b.data,
                .bias = gemm.bias ? args.bias.data : nullptr,
                .addend = gemm.has_addend ? at.at(gemm.addend) : nullptr,
                .d = at.at(gemm.d)},
               stream);
    MESHLA_CHECK_CUDA(cudaEventRecord(gemm_done[index].get(), stream));
  }

  void run_comm(std::size_t index, const Bindings& at) {
    const overlap::CommTask& task = schedule.comms[index];
    const detail::CommState& state = *transfers.state();
    cudaStream_t stream = comm_stream.get();
    if (task.wait_gemm >= 0) {
      MESHLA_CHECK_CUDA(cudaStreamWaitEvent(stream, gemm_done[task.wait_gemm].get(), 0));
    }
    const ncclDataType_t type = nccl_type(config.dtype);
    const std::int64_t count = at.count(task.src.buffer, task.rows);
    switch (task.kind) {
      case overlap::CommKind::kCopy:
        MESHLA_CHECK_CUDA(cudaMemcpyAsync(at.at(task.dst), at.at(task.src), count * at.element,
                                          cudaMemcpyDeviceToDevice, stream));
        break;
      case overlap::CommKind::kSendRecv: {
        detail::NcclGroup group;
        for (const overlap::Transfer& send : task.sends) {
          MESHLA_CHECK_NCCL(ncclSend(at.at(send.at), at.count(send.at.buffer, send.rows), type,
                                     send.peer, state.comm, stream));
        }
        for (const overlap::Transfer& recv : task.recvs) {
          MESHLA_CHECK_NCCL(ncclRecv(at.at(recv.at), at.count(recv.at.buffer, recv.rows), type,
                                     recv.peer, state.comm, stream));
        }
        MESHLA_CHECK_NCCL(group.end());
        break;
      }
      case overlap::CommKind::kAllGather:
        MESHLA_CHECK_NCCL(
            ncclAllGather(at.at(task.src), at.at(task.dst), count, type, state.comm, stream));
        break;
      case overlap::CommKind::kReduceScatter:
        MESHLA_CHECK_NCCL(ncclReduceScatter(at.at(task.src), at.at(task.dst), count, type, ncclSum,
                                            state.comm, stream));
        break;
      case overlap::CommKind::kAllReduce:
        MESHLA_CHECK_NCCL(ncclAllReduce(at.at(task.src), at.at(task.dst), count, type, ncclSum,
                                        state.comm, stream));
        break;
    }
    MESHLA_CHECK_CUDA(cudaEventRecord(comm_done[index].get(), stream));
  }

  void execute(const CollectiveMatmulArgs& args, cudaStream_t stream) {
    overlap::validate_args(config, comm.size(), comm.device(), args);
    detail::DeviceGuard guard(comm.device());
    Bindings at;
    at.element = static_cast<std::int64_t>(dtype_size(config.dtype));
    at.bind(overlap::Buffer::kInput, args.a.data, config.k);
    at.bind(overlap::Buffer::kGathered,
            config.return_gathered ? args.gathered.data : own_gathered.data(), config.k);
    at.bind(overlap::Buffer::kPartial, partial.data(), config.n);
    at.bind(overlap::Buffer::kOutput, args.out.data, config.n);

    // One execution of a plan at a time: its buffers, events and GEMM workspace are shared by
    // all of them, so a run on another stream first waits for the previous run (stream-ordered,
    // no host wait). Not while capturing: a graph's replays are ordered by the caller.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    MESHLA_CHECK_CUDA(cudaStreamIsCapturing(stream, &capture));
    const bool eager = capture == cudaStreamCaptureStatusNone;
    if (eager && executed) MESHLA_CHECK_CUDA(cudaStreamWaitEvent(stream, done.get(), 0));
    MESHLA_CHECK_CUDA(cudaEventRecord(fork.get(), stream));
    MESHLA_CHECK_CUDA(cudaStreamWaitEvent(comm_stream.get(), fork.get(), 0));
    executed = executed || eager;
    try {
      enqueue_tasks(at, args, stream);
    } catch (...) {
      // Join what was enqueued, so the caller's stream still orders everything written (and a
      // capture is not left with an unjoined stream); the first error is the one reported.
      cudaEventRecord(join.get(), comm_stream.get());
      cudaStreamWaitEvent(stream, join.get(), 0);
      if (eager) cudaEventRecord(done.get(), stream);
      throw;
    }
    MESHLA_CHECK_CUDA(cudaEventRecord(join.get(), comm_stream.get()));
    MESHLA_CHECK_CUDA(cudaStreamWaitEvent(stream, join.get(), 0));
    // Only eager runs mark `done`: an event recorded inside a capture cannot be waited on
    // outside it.
    if (eager) MESHLA_CHECK_CUDA(cudaEventRecord(done.get(), stream));
  }

  // A stream wait binds to the latest record of its event, so each task is enqueued after the
  // task it waits for; communication goes first whenever it can, to start transfers early.
  void enqueue_tasks(const Bindings& at, const CollectiveMatmulArgs& args, cudaStream_t stream) {
    std::size_t next_gemm = 0;
    std::size_t next_comm = 0;
    while (next_gemm < schedule.gemms.size() || next_comm < schedule.comms.size()) {
      if (next_comm < schedule.comms.size() &&
          schedule.comms[next_comm].wait_gemm < static_cast<int>(next_gemm)) {
        run_comm(next_comm++, at);
      } else if (next_gemm < schedule.gemms.size() &&
                 schedule.gemms[next_gemm].wait_comm < static_cast<int>(next_comm)) {
        run_gemm(next_gemm++, at, args, stream);
      } else {
        MESHLA_THROW(kInternal, collective_op_name(config.op)
                                    << ": schedule waits form a cycle at gemm " << next_gemm
                                    << ", comm " << next_comm);
      }
    }
  }

  Communicator comm;
  CollectiveMatmulConfig config;
  Communicator transfers;  // comm itself, or its split with at most comm_ctas thread blocks
  overlap::Schedule schedule;
  Matmul matmul;
  detail::Stream comm_stream;
  detail::Event fork;
  detail::Event join;
  detail::Event done;  // recorded on the caller's stream when an execution has finished there
  std::vector<detail::Event> gemm_done;
  std::vector<detail::Event> comm_done;
  detail::DeviceBuffer own_gathered;
  detail::DeviceBuffer partial;
  // SMs of the GEMMs that overlap communication; set in the constructor body, before any GEMM
  // shape is prepared.
  int gemm_sms = 0;
  bool executed = false;
};

CollectiveMatmul::CollectiveMatmul(Communicator comm, const CollectiveMatmulConfig& config)
    : impl_(std::make_unique<Impl>(std::move(comm), config)) {}
CollectiveMatmul::~CollectiveMatmul() = default;
CollectiveMatmul::CollectiveMatmul(CollectiveMatmul&&) noexcept = default;
CollectiveMatmul& CollectiveMatmul::operator=(CollectiveMatmul&&) noexcept = default;

void CollectiveMatmul::execute(const CollectiveMatmulArgs& args, cudaStream_t stream) {
  impl_->execute(args, stream);
}

const CollectiveMatmulConfig& CollectiveMatmul::config() const { return impl_->config; }
const Communicator& CollectiveMatmul::communicator() const { return impl_->comm; }

}  // namespace meshla
