// CUTLASS grouped GEMM, forward pass (bf16 and fp16).
#include "grouped/sm90_grouped_passes.cuh"

namespace meshla::grouped {

CutlassWorkspace cutlass_forward_workspace(DType dtype, std::int64_t groups, int device,
                                           int sm_count) {
  return workspace_for<GroupedPass::kForward, Epilogue::kBias>(dtype, groups, device, sm_count);
}

void cutlass_forward(const CutlassCall& call, cudaStream_t stream) {
  run_for<GroupedPass::kForward, Epilogue::kBias>(call, stream);
}

}  // namespace meshla::grouped
