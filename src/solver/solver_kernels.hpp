// Device kernels of the dense solvers: moving between the row blocks frameworks hand over and the
// renumbered block-cyclic layout cuSolverMg works in (solver/block_cyclic.hpp), and the small
// reductions around the solver. Every function enqueues on `stream` of the current device and
// dispatches on `dtype` (float32, float64, complex64, complex128).
//
// "Working" arrays are column-major local arrays of the solver's layout: `ld` rows (>= padded n),
// one column per local column of the part. "Shards" are the framework's row-major row blocks.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "meshla/tensor.hpp"
#include "solver/block_cyclic.hpp"

namespace meshla::solver {

inline constexpr int kMaxParts = 16;  // cuSolverMg drives at most 16 GPUs

// One pointer per part, passed to kernels by value (each part reads its peers' memory directly).
struct PartPointers {
  void* data[kMaxParts] = {};
};

// Local columns [first, first + columns) of `part`, from a shard (src[c*src_ld + q] = A[row of
// local column first+c, q]) to the working array (dst[c*dst_ld + r']), rows renumbered; padding
// rows and columns get `pad_diagonal` on the diagonal and zero elsewhere.
void rows_to_solver_order(DType dtype, const void* src, std::int64_t src_ld, void* dst,
                          std::int64_t dst_ld, const BlockCyclicLayout& layout, std::int64_t part,
                          std::int64_t first, std::int64_t columns, double pad_diagonal,
                          cudaStream_t stream);

// `part`'s local columns of a general A' = Π A Πᵀ in the working array (dst[c*ld + r'] =
// A'[r', solver column of c]), read from every part's rows of A that meet `part`'s columns:
// shards.data[q] holds part q's rows, row i's element for `part`'s local column c at
// shards.data[q][i * shard_ld + shard_column0 + c] (the whole row blocks, [rows_per_part, n]
// row-major, peers' memory read directly: shard_ld = n, shard_column0 = part * rows_per_part;
// or blocks received from the other processes, [rows_per_part, rows_per_part]: rows_per_part,
// 0). The transpose of what rows_to_solver_order makes of a row block, which is the same only
// for a symmetric A. Padding as rows_to_solver_order's.
void columns_to_solver_order(DType dtype, const PartPointers& shards, std::int64_t shard_ld,
                             std::int64_t shard_column0, void* dst, std::int64_t ld,
                             const BlockCyclicLayout& layout, std::int64_t part,
                             double pad_diagonal, cudaStream_t stream);

// The inverse for real columns: dst[c*dst_ld + q] = src[c*src_ld + solver_index(q)], q < n.
void rows_to_original_order(DType dtype, const void* src, std::int64_t src_ld, void* dst,
                            std::int64_t dst_ld, const BlockCyclicLayout& layout,
                            std::int64_t columns, cudaStream_t stream);

// B' (column-major, ld rows, nrhs columns, on this device) from every part's row block of B
// ([rows_per_part, nrhs] row-major), rows renumbered, padding rows zero; conjugated if asked.
void gather_rhs(DType dtype, const PartPointers& shards, void* dst, std::int64_t ld,
                const BlockCyclicLayout& layout, std::int64_t nrhs, bool conjugate,
                cudaStream_t stream);

// `part`'s row block of X ([rows_per_part, nrhs] row-major) from X' (column-major, ld rows, on
// the device that holds it), conjugated if asked.
void scatter_solution(DType dtype, const void* src, std::int64_t ld, void* x,
                      const BlockCyclicLayout& layout, std::int64_t part, std::int64_t nrhs,
                      bool conjugate, cudaStream_t stream);

// Fills the strict upper triangle of `part`'s local columns of a Hermitian matrix whose lower
// triangle (solver order) is valid, reading the mirrored elements from the parts that hold them.
void mirror_lower_to_upper(DType dtype, const PartPointers& working, std::int64_t ld,
                           const BlockCyclicLayout& layout, std::int64_t part, cudaStream_t stream);

// `part`'s row block of V ([rows_per_part, n] row-major) from the eigenvectors of A' (columns of
// the working arrays), rows renumbered back, conjugated if asked; the padded eigenpairs (the
// largest, past column n) are left out.
void gather_eigenvectors(DType dtype, const PartPointers& working, std::int64_t ld, void* out,
                         const BlockCyclicLayout& layout, std::int64_t part, bool conjugate,
                         cudaStream_t stream);

// *result = Σ log(real(L'[j,j])) over `part`'s local columns of a Cholesky factor (float64).
void sum_log_diagonal(DType dtype, const void* working, std::int64_t ld,
                      const BlockCyclicLayout& layout, std::int64_t part, double* result,
                      cudaStream_t stream);

// Where *info is 0 and `part`'s local columns of an LU factor U' hold an exactly zero pivot
// U'[j,j], *info = j + 1 (the smallest such j of this part): cuSOLVERMp 0.8's getrf leaves info
// 0 for an exactly singular A.
void mark_zero_pivot(DType dtype, const void* working, std::int64_t ld,
                     const BlockCyclicLayout& layout, std::int64_t part, int* info,
                     cudaStream_t stream);

// *result = max over the shard's rows of Σ_q |A[row, q]| (float64; *result must start at 0).
void max_abs_row_sum(DType dtype, const void* shard, std::int64_t rows, std::int64_t n,
                     double* result, cudaStream_t stream);

// Sets `count` elements of `dtype` (any floating or complex type) to NaN.
void fill_nan(DType dtype, void* data, std::int64_t count, cudaStream_t stream);

}  // namespace meshla::solver
