// The NCCL backend of collective matmul: replays a Schedule with cuBLASLt GEMMs on the caller's
// stream and NCCL calls on a high-priority side stream forked from it.
#include <array>

#include "collective/executor.hpp"
#include "collective/group_workspace.hpp"
#include "collective/schedule.hpp"
#include "comm/comm_state.hpp"
#include "core/alignment.hpp"
#include "core/cuda_checks.hpp"
#include "meshla/matmul.hpp"

namespace meshla::collective {

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return ncclBfloat16;
    case DType::kFloat16:
      return ncclFloat16;
    case DType::kFloat32:
      return ncclFloat32;
    default:
      MESHLA_THROW(kNotImplemented, "no NCCL type for " << dtype_name(dtype));
  }
}

namespace {

// Device memory and row width of each schedule buffer for one execution.
struct Bindings {
  std::array<char*, 4> base{};
  std::array<std::int64_t, 4> width{};
  std::int64_t element = 0;

  char* at(Rows rows) const {
    const auto index = static_cast<std::size_t>(rows.buffer);
    return base[index] + rows.begin * width[index] * element;
  }
  std::int64_t count(Buffer buffer, std::int64_t rows) const {
    return rows * width[static_cast<std::size_t>(buffer)];
  }
  void bind(Buffer buffer, void* data, std::int64_t row_width) {
    base[static_cast<std::size_t>(buffer)] = static_cast<char*>(data);
    width[static_cast<std::size_t>(buffer)] = row_width;
  }
};

class NcclExecutor final : public Executor {
 public:
  NcclExecutor(const Communicator& comm, const CollectiveMatmulConfig& config,
               std::shared_ptr<collective::GroupWorkspace> workspace)
      : Executor(workspace_order(workspace)),
        config_(config),
        transfers_(comm),
        schedule_(make_schedule({.op = config.op,
                                 .algorithm = config.algorithm,
                                 .tp = comm.size(),
                                 .rank = comm.rank(),
                                 .m = config.m,
                                 .chunks = config.chunks,
                                 .bias = config.bias,
                                 .return_gathered = config.return_gathered})),
        comm_stream_(comm.device(), 1, /*high_priority=*/true),
        workspace_(std::move(workspace)) {
    const int device = comm.device();
    gemm_sms_ = overlapped_gemm_sms(config, device);
    const std::size_t element = dtype_size(config.dtype);
    // Scratch: the gathered rows (all_gather_matmul that does not return them), then the partial
    // products.
    const std::size_t gathered_bytes =
        config.op == CollectiveOp::kAllGatherMatmul && !config.return_gathered
            ? schedule_.gathered_rows * config.k * element
            : 0;
    partial_offset_ = detail::align_up(gathered_bytes);
    workspace_->reserve(*comm.state(), {.scratch_bytes = partial_offset_ + schedule_.partial_rows *
                                                                               config.n * element});
    // Events only for the tasks that another task waits on: a record that nothing waits on costs
    // host time (a one-rank run is a GEMM alone; the join waits for the last transfers itself).
    gemm_done_.resize(schedule_.gemms.size());
    comm_done_.resize(schedule_.comms.size());
    for (const CommTask& comm_task : schedule_.comms) {
      if (comm_task.wait_gemm >= 0) gemm_done_[comm_task.wait_gemm] = detail::Event(device);
    }
    for (const GemmTask& gemm : schedule_.gemms) {
      if (gemm.wait_comm >= 0) comm_done_[gemm.wait_comm] = detail::Event(device);
    }
    for (const GemmTask& gemm : schedule_.gemms) workspace_->matmul().prepare(shape_of(gemm));
    // Last: the split is a meeting of the ranks, and with several GPUs in one process nothing
    // between it and the first execution may free device memory (cudaFree waits for the peer
    // devices, whose queued NCCL kernels may wait for this thread). One rank makes no NCCL call.
    if (config.comm_ctas > 0 && comm.size() > 1) {
      transfers_ = Communicator(detail::split_with_max_ctas(*comm.state(), config.comm_ctas));
    }
  }

  void enqueue(const CollectiveMatmulArgs& args, cudaStream_t stream) override {
    Bindings at;
    at.element = static_cast<std::int64_t>(dtype_size(config_.dtype));
    at.bind(Buffer::kInput, args.a.data, config_.k);
    at.bind(Buffer::kGathered, config_.return_gathered ? args.gathered.data : workspace_->scratch(),
            config_.k);
    at.bind(Buffer::kPartial, workspace_->scratch() + partial_offset_, config_.n);
    at.bind(Buffer::kOutput, args.out.data, config_.n);
    if (schedule_.comms.empty()) {  // one rank's run: its GEMM alone
      enqueue_tasks(at, args, stream);
      return;
    }
    comm_stream_.fork(stream);
    try {
      enqueue_tasks(at, args, stream);
    } catch (...) {
      comm_stream_.join_after_failure(stream);
      throw;
    }
    comm_stream_.join(stream);
  }

 private:
  MatmulShape shape_of(const GemmTask& gemm) const {
    return {.dtype = config_.dtype,
            .m = gemm.rows,
            .n = config_.n,
            .k = config_.k,
            .trans_b = config_.trans_b,
            .batch = gemm.batch,
            .lda = config_.k,
            .ldb = 0,
            .ldd = config_.n,
            .batch_stride_a = gemm.a_stride * config_.k,
            .batch_stride_d = gemm.d_stride * config_.n,
            .bias = gemm.bias,
            .addend = gemm.has_addend,
            .sm_count = gemm.overlaps_comm ? gemm_sms_ : 0};
  }

  void run_gemm(std::size_t index, const Bindings& at, const CollectiveMatmulArgs& args,
                cudaStream_t stream) {
    const GemmTask& gemm = schedule_.gemms[index];
    if (gemm.wait_comm >= 0) {
      MESHLA_CHECK_CUDA(cudaStreamWaitEvent(stream, comm_done_[gemm.wait_comm].get(), 0));
    }
    workspace_->matmul().run(shape_of(gemm),
                             {.a = at.at(gemm.a),
                              .b = args.b.data,
                              .bias = gemm.bias ? args.bias.data : nullptr,
                              .addend = gemm.has_addend ? at.at(gemm.addend) : nullptr,
                              .d = at.at(gemm.d)},
                             stream);
    if (gemm_done_[index].get() != nullptr) {
      MESHLA_CHECK_CUDA(cudaEventRecord(gemm_done_[index].get(), stream));
    }
  }

  void run_comm(std::size_t index, const Bindings& at) {
    const CommTask& task = schedule_.comms[index];
    const detail::CommState& state = *transfers_.state();
    cudaStream_t stream = comm_stream_[0];
    if (task.wait_gemm >= 0) {
      MESHLA_CHECK_CUDA(cudaStreamWaitEvent(stream, gemm_done_[task.wait_gemm].get(), 0));
    }
    const ncclDataType_t type = nccl_type(config_.dtype);
    const std::int64_t count = at.count(task.src.buffer, task.rows);
    switch (task.kind) {
      case CommKind::kCopy:
        MESHLA_CHECK_CUDA(cudaMemcpyAsync(at.at(task.dst), at.at(task.src), count * at.element,
                                          cudaMemcpyDeviceToDevice, stream));
        break;
      case CommKind::kSendRecv: {
        detail::NcclGroup group;
        for (const Transfer& send : task.sends) {
          MESHLA_CHECK_NCCL(ncclSend(at.at(send.at), at.count(send.at.buffer, send.rows), type,
                                     send.peer, state.comm, stream));
        }
        for (const Transfer& recv : task.recvs) {
          MESHLA_CHECK_NCCL(ncclRecv(at.at(recv.at), at.count(recv.at.buffer, recv.rows), type,
                                     recv.peer, state.comm, stream));
        }
        MESHLA_CHECK_NCCL(group.end());
        break;
      }
      case CommKind::kAllGather:
        MESHLA_CHECK_NCCL(
            ncclAllGather(at.at(task.src), at.at(task.dst), count, type, state.comm, stream));
        break;
      case CommKind::kReduceScatter:
        MESHLA_CHECK_NCCL(ncclReduceScatter(at.at(task.src), at.at(task.dst), count, type, ncclSum,
                                            state.comm, stream));
        break;
      case CommKind::kAllReduce:
        MESHLA_CHECK_NCCL(ncclAllReduce(at.at(task.src), at.at(task.dst), count, type, ncclSum,
                                        state.comm, stream));
        break;
    }
    if (comm_done_[index].get() != nullptr) {
      MESHLA_CHECK_CUDA(cudaEventRecord(comm_done_[index].get(), stream));
    }
  }

  // A stream wait binds to the latest record of its event, so each task is enqueued after the
  // task it waits for; communication goes first whenever it can, to start transfers early.
  void enqueue_tasks(const Bindings& at, const CollectiveMatmulArgs& args, cudaStream_t stream) {
    std::size_t next_gemm = 0;
    std::size_t next_comm = 0;
    while (next_gemm < schedule_.gemms.size() || next_comm < schedule_.comms.size()) {
      if (next_comm < schedule_.comms.size() &&
          schedule_.comms[next_comm].wait_gemm < static_cast<int>(next_gemm)) {
        run_comm(next_comm++, at);
      } else if (next_gemm < schedule_.gemms.size() &&
                 schedule_.gemms[next_gemm].wait_comm < static_cast<int>(next_comm)) {
        run_gemm(next_gemm++, at, args, stream);
      } else {
        MESHLA_THROW(kInternal, collective_op_name(config_.op)
                                    << ": schedule waits form a cycle at gemm " << next_gemm
                                    << ", comm " << next_comm);
      }
    }
  }

  CollectiveMatmulConfig config_;
  Communicator transfers_;  // the plan's communicator, or its split with at most comm_ctas CTAs
  Schedule schedule_;
  SideStreams comm_stream_;
  std::vector<detail::Event> gemm_done_;  // null where no task waits for the GEMM
  std::vector<detail::Event> comm_done_;  // null where no task waits for the transfer
  // The gathered rows, the partial products and the GEMMs, shared with the group's other plans.
  std::shared_ptr<collective::GroupWorkspace> workspace_;
  std::size_t partial_offset_ = 0;  // in the scratch
  int gemm_sms_ = 0;                // SMs of the GEMMs that overlap communication (0: all)
};

}  // namespace

std::unique_ptr<Executor> make_nccl_executor(const Communicator& comm,
                                             const CollectiveMatmulConfig& config) {
  return std::make_unique<NcclExecutor>(comm, config,
                                        collective::GroupWorkspace::of(*comm.state()));
}

}  // namespace meshla::collective
