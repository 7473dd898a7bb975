// How a collective matmul maps onto cuBLASMp's distributed D = op(A) op(B). Pure host index math
// (no cuBLASMp header), so CI checks it without cuBLASMp or a GPU.
//
// cuBLASMp is column-major: meshla's row-major [r, c] array is its c x r matrix. It works on
// global matrices split into one block per rank, over a P x 1 process grid ("rows over ranks") or
// a 1 x P one. meshla's b is its A, a is its B and out is its D:
//   all_gather_matmul      D (n P) x m, rows over P:     local n x m     = out [m, n]
//                          B k x m, columns over P:      local k x m/P   = a [m/P, k], gathered
//                          A k x (n P), columns over P:  local k x n     = b [n, k] (trans_b), or
//                          A (n P) x k, rows over P:     local n x k     = b [k, n]
//   matmul_reduce_scatter  D n x m, columns over P:      local n x m/P   = out [m/P, n]
//                          B (k P) x m, rows over P:     local k x m     = a [m, k]
//                          A (k P) x n, rows over P:     local k x n     = b [n, k] (trans_b), or
//                          A n x (k P), columns over P:  local n x k     = b [k, n]
//   matmul_all_reduce      D n x (m P), columns over P:  local n x m     = out [m, n], summed by
//                          the ALLREDUCE epilogue; A and B as for reduce-scatter, trans_b only.
#pragma once

#include <array>
#include <cstdint>

#include "meshla/collective_matmul.hpp"

namespace meshla::collective {

// One operand: its global shape, the block each rank holds, and how ranks split it.
struct CublasMpOperand {
  std::int64_t rows, cols, row_block, col_block;
  bool rows_over_ranks;  // P x 1 grid; otherwise 1 x P
};

struct CublasMpLayout {
  std::array<std::int64_t, 3> shape;  // cuBLASMp's m, n, k: D's rows and columns, the contraction
  CublasMpOperand a, b, d;
  bool transpose_a;       // op(A) = Aᵀ: meshla's b stored [n, k]
  std::int64_t out_rows;  // rows of this rank's out
};

// For a config that resolve_config accepted for backend=cublasmp on `tp` ranks.
CublasMpLayout cublasmp_layout(const CollectiveMatmulConfig& config, std::int64_t tp);

}  // namespace meshla::collective
