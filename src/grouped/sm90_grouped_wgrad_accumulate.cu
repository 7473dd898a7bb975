// CUTLASS grouped GEMM, wgrad accumulate pass (bf16 and fp16).
#include "grouped/sm90_grouped_passes.cuh"

namespace meshla::grouped {

CutlassWorkspace cutlass_wgrad_accumulate_workspace(DType dtype, std::int64_t groups, int device,
                                                    int sm_count) {
  return workspace_for<GroupedPass::kWgrad, Epilogue::kAccumulate>(dtype, groups, device, sm_count);
}

void cutlass_wgrad_accumulate(const CutlassCall& call, cudaStream_t stream) {
  run_for<GroupedPass::kWgrad, Epilogue::kAccumulate>(call, stream);
}

}  // namespace meshla::grouped
