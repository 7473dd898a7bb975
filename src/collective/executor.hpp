// The backends behind CollectiveMatmul. Each is built collectively with its plan from a resolved
// config and runs one execution at a time, in the order of its ExecutionOrder (its own, or one it
// shares with the plans whose buffers it shares); CollectiveMatmul keeps that order and checks the
// arguments before they reach a backend.
#pragma once

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include <nccl.h>

#include "collective/group_workspace.hpp"
#include "core/cuda_handles.hpp"
#include "meshla/collective_matmul.hpp"
#include "runtime/execution_order.hpp"

namespace meshla::collective {

class Executor {
 public:
  explicit Executor(std::shared_ptr<detail::ExecutionOrder> order) : order_(std::move(order)) {}
  virtual ~Executor() = default;
  // Enqueues one execution on `stream`. Side streams fork from it and join back before this
  // returns, also when it throws, so the stream orders everything the execution wrote.
  virtual void enqueue(const CollectiveMatmulArgs& args, cudaStream_t stream) = 0;
  // The order of this executor's executions and of every other one that uses its buffers.
  detail::ExecutionOrder& order() const { return *order_; }

 private:
  std::shared_ptr<detail::ExecutionOrder> order_;
};

std::unique_ptr<Executor> make_nccl_executor(const Communicator& comm,
                                             const CollectiveMatmulConfig& config);
// The caller has established that every rank maps every peer (detail::ask_for_peer_access).
std::unique_ptr<Executor> make_symmetric_executor(const Communicator& comm,
                                                  const CollectiveMatmulConfig& config);

#ifdef MESHLA_WITH_CUBLASMP
// The caller has checked that cuBLASMp is available on every rank (backend_unavailable_reason).
std::unique_ptr<Executor> make_cublasmp_executor(const Communicator& comm,
                                                 const CollectiveMatmulConfig& config);
#endif

// An executor's side streams, forked from and joined back into the caller's stream.
class SideStreams {
 public:
  SideStreams(int device, std::size_t count, bool high_priority);
  cudaStream_t operator[](std::size_t index) const { return streams_[index].get(); }
  // Each side stream waits for the work enqueued so far on `stream`.
  void fork(cudaStream_t stream);
  // `stream` waits for the work enqueued so far on each side stream.
  void join(cudaStream_t stream);
  // join() for a failure path: best effort, never throws, so the first error stays the one
  // reported and a capture is not left with an unjoined stream.
  void join_after_failure(cudaStream_t stream) noexcept;

 private:
  std::vector<detail::Stream> streams_;
  detail::Event forked_;
  std::vector<detail::Event> joined_;
};

// The ExecutionOrder of a plan that runs on buffers of its own, watched with the group's timeout.
std::shared_ptr<detail::ExecutionOrder> plan_order(const Communicator& comm);
// The ExecutionOrder of a plan on its group's workspace: the workspace's, which it keeps alive.
std::shared_ptr<detail::ExecutionOrder> workspace_order(
    const std::shared_ptr<collective::GroupWorkspace>& workspace);

// NCCL's type for `dtype`; kNotImplemented where it has none.
ncclDataType_t nccl_type(DType dtype);

// SMs the GEMMs that overlap communication may use on `device` (0: all), leaving config.comm_sms
// free; throws kInvalidArgument when that leaves none.
int overlapped_gemm_sms(const CollectiveMatmulConfig& config, int device);

}  // namespace meshla::collective
