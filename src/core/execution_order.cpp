#include "core/execution_order.hpp"

#include "core/cuda_checks.hpp"

namespace meshla::detail {

ExecutionOrder::ExecutionOrder(int device) : done_(device), captured_done_(device) {}

cudaEvent_t ExecutionOrder::begin(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  unsigned long long capture_id = 0;
  MESHLA_CHECK_CUDA(cudaStreamGetCaptureInfo(stream, &capture, &capture_id));
  if (capture == cudaStreamCaptureStatusNone) {
    if (executed_) MESHLA_CHECK_CUDA(cudaStreamWaitEvent(stream, done_.get(), 0));
    executed_ = true;
    return done_.get();
  }
  if (captured_in_ == capture_id) {
    MESHLA_CHECK_CUDA(cudaStreamWaitEvent(stream, captured_done_.get(), 0));
  }
  captured_in_ = capture_id;
  ++captured_runs_;
  return captured_done_.get();
}

cudaError_t ExecutionOrder::wait_for_last_eager(std::chrono::milliseconds timeout) const {
  return executed_ ? wait_for_event(done_.get(), timeout) : cudaSuccess;
}

}  // namespace meshla::detail
