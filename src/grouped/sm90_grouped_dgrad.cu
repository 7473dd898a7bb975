// CUTLASS grouped GEMM, dgrad pass (bf16 and fp16).
#include "grouped/sm90_grouped_passes.cuh"

namespace meshla::grouped {

CutlassWorkspace cutlass_dgrad_workspace(DType dtype, std::int64_t groups, int device,
                                         int sm_count) {
  return workspace_for<GroupedPass::kDgrad, Epilogue::kStore>(dtype, groups, device, sm_count);
}

void cutlass_dgrad(const CutlassCall& call, cudaStream_t stream) {
  run_for<GroupedPass::kDgrad, Epilogue::kStore>(call, stream);
}

}  // namespace meshla::grouped
