// Host checks of a DenseSolver call: the problem and every GPU's shard. Pure host code (no CUDA
// call), unit-tested on the CPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "meshla/dense_solver.hpp"
#include "meshla/export.hpp"
#include "solver/block_cyclic.hpp"

namespace meshla::solver {

// float32 for float32 and complex64, float64 for float64 and complex128 (eigenvalues, logdet).
DType real_dtype(DType dtype);
bool is_complex(DType dtype);

// The dtype is one the solvers take; nrhs is 1 to 256 for kCholeskySolve and kLuSolve.
void check_solver_problem(SolverOp op, const SolverProblem& problem);

// A call of the tall-skinny QR (qr, least_squares, svd, polar: meshla.torch and meshla.jax run
// it in the frameworks' own ops, a QR of each device's row block, then one of the stacked R
// factors): the dtype as the solvers take, m rows split evenly over `parts` devices, a at least
// as tall as it is wide (kNotImplemented otherwise), nrhs >= 0 (0: no right-hand side).
// Exported for the bindings (MESHLA_API), which check every call with it, on CPU arrays too.
MESHLA_API void check_tall_qr_call(std::string_view name, std::int64_t m, std::int64_t n,
                                   DType dtype, std::int64_t parts, std::int64_t nrhs);

// A right-hand side's row block beside a's block of a_rows rows: 2-D (or 1-D where
// `vector_ok`: one right-hand side) with a's rows and dtype; `b` names it in the message ("b",
// "b_shards[1]"). Both front ends check B with it, so that the words are the same in each.
// Exported for the bindings (MESHLA_API).
MESHLA_API void check_rhs_block(std::string_view name, std::string_view b,
                                const std::vector<std::int64_t>& b_shape, DType b_dtype,
                                std::int64_t a_rows, DType a_dtype, bool vector_ok = false);

// The most elements the inverse's padded matrix may have: cusolverDn's potri has 32-bit sizes.
constexpr std::int64_t kLargestInverseElements = 2147483647;

// The layout `op` runs order n on `parts` GPUs in, with `tile` columns a tile (0: choose_tile's,
// up to kLargestCholeskyTile or kLargestEigenTile); a tile over kLargestEigenTile for the
// eigensolver on several GPUs is an error, and so is an inverse whose padded matrix has more than
// kLargestInverseElements (kNotImplemented). On one GPU the eigensolver and the LU solve take
// any tile, by default the whole matrix.
BlockCyclicLayout solver_layout(SolverOp op, std::int64_t n, std::int64_t parts, std::int64_t tile);

// A call of `op` with `problem` over `parts` GPUs, checked on its metadata alone: the problem
// (check_solver_problem), its layout (solver_layout), and overwrite_a only where the layout does
// not pad (padded, the solver works in a workspace of its own) and, for kLuSolve, on one GPU.
// Returns the layout. What DenseSolver runs, and what every front end checks first, on CPU arrays
// too. Exported for the bindings (MESHLA_API).
MESHLA_API BlockCyclicLayout check_solver_call(SolverOp op, const SolverProblem& problem,
                                               std::int64_t parts);

// Shard `part` of `parts` (a GPU of a DenseSolver, or a rank of a ProcessSolver) on `device`: the
// shapes, dtypes and outputs `op` needs (see SolverShard), and a 256-byte aligned workspace of at
// least `workspace_bytes`.
void check_solver_shard(SolverOp op, const SolverProblem& problem, const BlockCyclicLayout& layout,
                        int parts, int part, int device, const SolverShard& shard,
                        std::size_t workspace_bytes);
// One shard per part, each on devices[part], with the shapes, dtypes and outputs `op` needs (see
// SolverShard), and a 256-byte aligned workspace of at least workspace_bytes[part].
void check_solver_shards(SolverOp op, const SolverProblem& problem, const BlockCyclicLayout& layout,
                         const std::vector<int>& devices, const std::vector<SolverShard>& shards,
                         const std::vector<std::size_t>& workspace_bytes);

}  // namespace meshla::solver
