// Rowwise-scaled fp8 GEMM on Hopper, where cuBLASLt's outer-vector scales do not run (sm_90
// refuses them, seen on H100 with CUDA 13.0's cuBLASLt): a CUTLASS kernel whose epilogue scales
// each product by its row's and column's scales and adds the bias.
//
//   d[i, j] = a_scale[i] * b_scale[j] * (a @ bᵀ)[i, j] (+ bias[j])
//
// a is [m, k] and b [n, k] in float8 (e4m3 with e4m3 or e5m2, either way round), d bfloat16 or
// float32; the fp8 products accumulate in fp32 with CUTLASS's periodic promotion (not the tensor
// cores' fast accumulation), as cuBLASLt's tensorwise kernels do.
#pragma once

#include <cstddef>

#include <cuda_runtime_api.h>

#include "meshla/matmul.hpp"

namespace meshla::gemm {

// Enqueues the product of a checked, packed-pitch shape (Matmul's rules) with rowwise scaling on
// `stream`; `sm_count` SMs of `device` at most. Throws kInvalidArgument where an operand's address
// is not 16-byte aligned (the kernel's TMA loads and stores need it) and kNotImplemented where
// CUTLASS refuses the problem.
void run_sm90_rowwise_fp8(const MatmulShape& shape, const MatmulOperands& ops, int device,
                          int sm_count, void* workspace, std::size_t workspace_bytes,
                          cudaStream_t stream);

}  // namespace meshla::gemm
