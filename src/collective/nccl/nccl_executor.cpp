// The NCCL backend of collective matmul: replays a Schedule with cuBLASLt GEMMs on the caller's
// stream and NCCL calls on a high-priority side stream forked from it. A float8 product moves a's
// bytes (and, rowwise, its rows' scales) and reduces partial sums in its output dtype.
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
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      return ncclUint8;  // moved, never added
    default:
      MESHLA_THROW(kNotImplemented, "no NCCL type for " << dtype_name(dtype));
  }
}

namespace {

// Device memory, row width and element size of each schedule buffer for one execution, and the
// rows' scales of a's buffers (rowwise float8: one float a row).
struct Bindings {
  std::array<char*, 4> base{};
  std::array<std::int64_t, 4> width{};
  std::array<std::int64_t, 4> element{};
  std::array<const float*, 4> row_scales{};

  char* at(Rows rows) const {
    const auto index = static_cast<std::size_t>(rows.buffer);
    return base[index] + rows.begin * width[index] * element[index];
  }
  std::int64_t count(Buffer buffer, std::int64_t rows) const {
    return rows * width[static_cast<std::size_t>(buffer)];
  }
  std::int64_t bytes(Buffer buffer, std::int64_t rows) const {
    return count(buffer, rows) * element[static_cast<std::size_t>(buffer)];
  }
  const float* scales_at(Rows rows) const {
    return row_scales[static_cast<std::size_t>(rows.buffer)] + rows.begin;
  }
  void bind(Buffer buffer, void* data, std::int64_t row_width, DType dtype) {
    const auto index = static_cast<std::size_t>(buffer);
    base[index] = static_cast<char*>(data);
    width[index] = row_width;
    element[index] = static_cast<std::int64_t>(dtype_size(dtype));
  }
};

// The dtype a buffer holds: a's rows (input, gathered) or the product's.
DType dtype_of(const CollectiveMatmulConfig& config, Buffer buffer) {
  return buffer == Buffer::kInput || buffer == Buffer::kGathered ? config.dtype
                                                                 : product_dtype(config);
}

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
    // Scratch: the gathered rows (all_gather_matmul that does not return them), the gathered
    // rows' scales (rowwise float8), then the partial products.
    const bool gathers = config.op == CollectiveOp::kAllGatherMatmul;
    const std::size_t gathered_bytes =
        gathers && !config.return_gathered
            ? schedule_.gathered_rows * config.k * dtype_size(config.dtype)
            : 0;
    gathers_scales_ = gathers && config.scaling == MatmulScaling::kRowwise && comm.size() > 1;
    scales_offset_ = detail::align_up(gathered_bytes);
    partial_offset_ =
        scales_offset_ +
        detail::align_up(gathers_scales_ ? sizeof(float) * static_cast<std::size_t>(config.m) : 0);
    workspace_->reserve(*comm.state(),
                        {.scratch_bytes = partial_offset_ + schedule_.partial_rows * config.n *
                                                                dtype_size(product_dtype(config))});
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
    for (const GemmTask& gemm : schedule_.gemms) {
      workspace_->matmul().prepare(shape_of(gemm, member_rows(gemm)));
    }
    // Last: the split is a meeting of the ranks, and with several GPUs in one process nothing
    // between it and the first execution may free device memory (cudaFree waits for the peer
    // devices, whose queued NCCL kernels may wait for this thread). One rank makes no NCCL call.
    if (config.comm_ctas > 0 && comm.size() > 1) {
      transfers_ = Communicator(detail::split_with_max_ctas(*comm.state(), config.comm_ctas));
    }
  }

  void enqueue(const CollectiveMatmulArgs& args, cudaStream_t stream) override {
    Bindings at;
    const auto bind = [&](Buffer buffer, void* data, std::int64_t row_width) {
      at.bind(buffer, data, row_width, dtype_of(config_, buffer));
    };
    bind(Buffer::kInput, args.a.data, config_.k);
    bind(Buffer::kGathered, config_.return_gathered ? args.gathered.data : workspace_->scratch(),
         config_.k);
    bind(Buffer::kPartial, workspace_->scratch() + partial_offset_, config_.n);
    bind(Buffer::kOutput, args.out.data, config_.n);
    if (config_.scaling == MatmulScaling::kRowwise) {
      const auto* own = static_cast<const float*>(args.a_scale.data);
      at.row_scales[static_cast<std::size_t>(Buffer::kInput)] = own;
      at.row_scales[static_cast<std::size_t>(Buffer::kGathered)] =
          gathers_scales_ ? reinterpret_cast<const float*>(workspace_->scratch() + scales_offset_)
                          : own;
    }
    if (schedule_.comms.empty()) {  // one rank's run: its GEMM alone
      enqueue_tasks(at, args, stream);
      return;
    }
    comm_stream_.fork(stream);
    try {
      // The rows' scales travel first on the communication stream, so every GEMM that waits for
      // gathered rows finds their scales there too.
      if (gathers_scales_) {
        MESHLA_CHECK_NCCL(ncclAllGather(args.a_scale.data, workspace_->scratch() + scales_offset_,
                                        config_.m / transfers_.size(), ncclFloat32,
                                        transfers_.state()->comm, comm_stream_[0]));
      }
      enqueue_tasks(at, args, stream);
    } catch (...) {
      comm_stream_.join_after_failure(stream);
      throw;
    }
    comm_stream_.join(stream);
  }

 private:
  // Rowwise scales take one GEMM per batch member (Matmul's rowwise kernel runs a batch of 1).
  bool member_rows(const GemmTask& gemm) const {
    return config_.scaling == MatmulScaling::kRowwise && gemm.batch > 1;
  }

  MatmulShape shape_of(const GemmTask& gemm, bool one_member) const {
    return {.dtype = config_.dtype,
            .b_dtype = config_.b_dtype,
            .out_dtype = config_.out_dtype,
            .scaling = config_.scaling,
            .m = gemm.rows,
            .n = config_.n,
            .k = config_.k,
            .trans_b = config_.trans_b,
            .batch = one_member ? 1 : gemm.batch,
            .lda = config_.k,
            .ldb = 0,
            .ldd = config_.n,
            .batch_stride_a = one_member ? 0 : gemm.a_stride * config_.k,
            .batch_stride_d = one_member ? 0 : gemm.d_stride * config_.n,
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
    const bool rowwise = config_.scaling == MatmulScaling::kRowwise;
    const bool one_member = member_rows(gemm);
    const MatmulShape shape = shape_of(gemm, one_member);
    for (int member = 0; member < (one_member ? gemm.batch : 1); ++member) {
      const Rows a{gemm.a.buffer, gemm.a.begin + member * gemm.a_stride};
      const Rows d{gemm.d.buffer, gemm.d.begin + member * gemm.d_stride};
      workspace_->matmul().run(
          shape,
          {.a = at.at(a),
           .b = args.b.data,
           .bias = gemm.bias ? args.bias.data : nullptr,
           .addend = gemm.has_addend ? at.at(gemm.addend) : nullptr,
           .d = at.at(d),
           .a_scale = rowwise ? at.scales_at(a) : static_cast<const float*>(args.a_scale.data),
           .b_scale = static_cast<const float*>(args.b_scale.data)},
          stream);
    }
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
    // The collectives' source is a's rows (all-gather) or partial sums (reductions).
    const ncclDataType_t type = nccl_type(dtype_of(config_, task.src.buffer));
    const std::int64_t count = at.count(task.src.buffer, task.rows);
    switch (task.kind) {
      case CommKind::kCopy:
        MESHLA_CHECK_CUDA(cudaMemcpyAsync(at.at(task.dst), at.at(task.src),
                                          at.bytes(task.src.buffer, task.rows),
                                          cudaMemcpyDeviceToDevice, stream));
        break;
      case CommKind::kSendRecv: {
        detail::NcclGroup group;
        // Each transfer moves its own buffer's elements: a's rows, or partial sums.
        for (const Transfer& send : task.sends) {
          MESHLA_CHECK_NCCL(ncclSend(at.at(send.at), at.count(send.at.buffer, send.rows),
                                     nccl_type(dtype_of(config_, send.at.buffer)), send.peer,
                                     state.comm, stream));
        }
        for (const Transfer& recv : task.recvs) {
          MESHLA_CHECK_NCCL(ncclRecv(at.at(recv.at), at.count(recv.at.buffer, recv.rows),
                                     nccl_type(dtype_of(config_, recv.at.buffer)), recv.peer,
                                     state.comm, stream));
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
  std::size_t scales_offset_ = 0;   // in the scratch: the gathered rows' scales
  std::size_t partial_offset_ = 0;  // in the scratch
  bool gathers_scales_ = false;     // rowwise float8 all_gather_matmul on several ranks
  int gemm_sms_ = 0;                // SMs of the GEMMs that overlap communication (0: all)
};

}  // namespace

std::unique_ptr<Executor> make_nccl_executor(const Communicator& comm,
                                             const CollectiveMatmulConfig& config) {
  return std::make_unique<NcclExecutor>(comm, config,
                                        collective::GroupWorkspace::of(*comm.state()));
}

}  // namespace meshla::collective
