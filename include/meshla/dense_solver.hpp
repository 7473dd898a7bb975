// Distributed dense solvers over the GPUs of one process: Cholesky solve (with log-determinant),
// inverse of a positive-definite matrix, the eigen-decomposition of a symmetric (Hermitian) one,
// and the LU solve of a general one, on cuSolverMg (on one GPU, cusolverDn: it was faster there).
//
// The matrix arrives the way frameworks shard it: GPU p of P holds rows [p*n/P, (p+1)*n/P) of A,
// row-major. meshla renumbers rows and columns so that these row blocks *are* cuSolverMg's 1-D
// column block-cyclic layout (solver/block_cyclic.hpp explains why that is exact), so the only
// data movement is a row shuffle inside each GPU; padding for n/P not a multiple of the tile is
// added inside. The symmetric ops read only the lower triangle of A in the solver's order (pass
// the full matrix). A general A (the LU solve) is the exception: cuSolverMg needs its columns,
// which each GPU reads from the others' row blocks into a working copy (one read over NVLink).
//
// Calls are synchronous: run() waits for every part's stream (its inputs), runs the solver on
// all GPUs from the calling thread, and returns when the outputs are written. One DenseSolver
// runs one call at a time (a mutex serialises them).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include <cuda_runtime_api.h>

#include "meshla/export.hpp"
#include "meshla/tensor.hpp"

namespace meshla {

enum class SolverOp {
  kCholeskySolve,    // X = A⁻¹ B, and log det A
  kCholeskyInverse,  // A⁻¹ of a positive-definite A
  kEigen,            // eigenvalues (ascending) and eigenvectors (columns of V, A V = V Λ)
  kEigenvalues,      // eigenvalues only
  kLuSolve,          // X = A⁻¹ B for a general A: LU with partial pivoting
};

MESHLA_API std::string_view solver_op_name(SolverOp op);

// Who factors A for kCholeskySolve and kCholeskyInverse. meshla's own factorization
// (solver/block_cyclic_cholesky.hpp) overlaps the panels with the trailing updates, and the solve
// after it is cuSolverMg's (one GPU: cusolverDn's); with kCusolverMg, cuSolverMg's potrf and the
// solve after it (the benchmark's reference). The inverse after either is cusolverDn's potri on
// the first GPU, the factor gathered there (cuSolverMg's potri is wrong on several GPUs past
// n = 2048), so n is at most 46340 (2^31 elements, potri's 32-bit sizes).
enum class CholeskyFactorization { kMeshla, kCusolverMg };

// The problem: order n over the solver's parts, element type, right-hand sides (kCholeskySolve,
// kLuSolve), the tile (columns per block-cyclic tile; 0 picks one; on several GPUs at most 1024
// for the eigensolver and 512 for the LU solve, cuSolverMg's syevd's and getrf's limits; the LU
// solve on one GPU takes none), whether A's shards may be
// used as the solver's working memory (then they hold garbage afterwards; not for kLuSolve on
// several GPUs, whose working copy holds A's columns), and who factors A.
struct SolverProblem {
  std::int64_t n = 0;
  DType dtype = DType::kFloat64;  // float32, float64, complex64, complex128
  std::int64_t nrhs = 0;
  std::int64_t tile = 0;
  bool overwrite_a = false;
  CholeskyFactorization cholesky = CholeskyFactorization::kMeshla;
};

// One GPU's part of a call, on the GPU of the solver's part of the same index.
//   a           [n/P, n]      rows of A (input)
//   b           [n/P, nrhs]   rows of B (kCholeskySolve, kLuSolve)
//   out         [n/P, nrhs]   rows of X (kCholeskySolve, kLuSolve); [n/P, n] rows of A⁻¹ (may be
//   `a`
//                             itself when overwrite_a) or of V (kEigen, never `a`)
//   eigenvalues [n]           real type of dtype (kEigen, kEigenvalues); optional
//   logdet      []            real type of dtype (kCholeskySolve); optional
//   info        []            int32, SolverResult::info; optional
//   workspace   any dtype, workspace_bytes(problem, part) bytes, 256-byte aligned
struct SolverShard {
  TensorView a, b, out, eigenvalues, logdet, info, workspace;
  cudaStream_t stream = nullptr;
};

// What the host learns from a call. info > 0: A is not positive definite (kCholesky*), the
// eigensolver did not converge (kEigen*) or A is singular (kLuSolve: a zero pivot); every output
// then holds NaN. The index info refers to the solver's internal order, not A's (the LU
// solve's: A' = Π A Πᵀ's pivots over several GPUs, Aᵀ's on one). cusolverMgPotrf reports a
// failed factorization as an internal error without an index: then info is 1.
struct SolverResult {
  int info = 0;
  double logdet = 0.0;              // kCholeskySolve
  std::vector<double> eigenvalues;  // kEigen, kEigenvalues: ascending
  // Wall time of the factorization and the cuSOLVER routines (what the layout work adds to).
  double solver_seconds = 0.0;
};

class MESHLA_API DenseSolver {
 public:
  // `devices`: CUDA ordinals of the parts, in row-block order (at most 16, distinct). Creates
  // the cuSolverMg handle and enables peer access between every pair.
  explicit DenseSolver(std::vector<int> devices);
  ~DenseSolver();
  DenseSolver(DenseSolver&&) noexcept;
  DenseSolver& operator=(DenseSolver&&) noexcept;
  DenseSolver(const DenseSolver&) = delete;
  DenseSolver& operator=(const DenseSolver&) = delete;

  const std::vector<int>& devices() const;

  // The tile run() uses for `op` on `problem` (its own, or the automatic choice).
  std::int64_t tile(SolverOp op, const SolverProblem& problem) const;

  // Bytes of workspace `part` needs for one call of `op` on `problem`.
  std::size_t workspace_bytes(SolverOp op, const SolverProblem& problem, int part) const;

  // Checks every shard, then runs the call; see SolverShard for what each op reads and writes.
  SolverResult run(SolverOp op, const SolverProblem& problem,
                   const std::vector<SolverShard>& shards);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace meshla
