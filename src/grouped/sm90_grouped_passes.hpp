// The bf16/fp16 grouped GEMM on CUTLASS's Hopper ptr-array kernel (TMA + WGMMA, persistent,
// problem sizes read on the device). This header includes no CUTLASS header; each pass is
// instantiated in its own translation unit because each takes about a minute to compile.
#pragma once

#include <cstddef>

#include "grouped/grouped_kernels.hpp"

namespace meshla::grouped {

struct CutlassWorkspace {
  std::size_t tables = 0;  // per-group problem sizes, pointers and strides
  std::size_t kernel = 0;  // CUTLASS's own workspace
};

// One call of a CUTLASS pass. It builds the group index itself (reporting bad m_splits to
// `status`), poisons `out` when they are bad and zeroes empty groups' weight gradients, so no
// other kernel runs before or after it.
struct CutlassCall {
  GroupIndex index;
  DeviceStatus* status;
  GroupedOperands operands;
  GroupedSpan out;  // the output as groups of elements
  DType dtype;
  void* tables;
  void* kernel_workspace;
  int device;
  int sm_count;
  int l2_bytes;
};

CutlassWorkspace cutlass_forward_workspace(DType dtype, std::int64_t groups, int device,
                                           int sm_count);
CutlassWorkspace cutlass_dgrad_workspace(DType dtype, std::int64_t groups, int device,
                                         int sm_count);
CutlassWorkspace cutlass_wgrad_workspace(DType dtype, std::int64_t groups, int device,
                                         int sm_count);
CutlassWorkspace cutlass_wgrad_accumulate_workspace(DType dtype, std::int64_t groups, int device,
                                                    int sm_count);

void cutlass_forward(const CutlassCall& call, cudaStream_t stream);
void cutlass_dgrad(const CutlassCall& call, cudaStream_t stream);
void cutlass_wgrad(const CutlassCall& call, cudaStream_t stream);
// dweight (fp32) += dy_gᵀ · x_g
void cutlass_wgrad_accumulate(const CutlassCall& call, cudaStream_t stream);

}  // namespace meshla::grouped
