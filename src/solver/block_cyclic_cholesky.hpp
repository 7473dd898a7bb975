// meshla's own Cholesky factorization of a matrix in the solver's 1-D column block-cyclic layout
// (solver/block_cyclic.hpp), A' = L Lᴴ, L written over the lower triangle of the working arrays
// exactly where cuSolverMg's potrf leaves it, so cuSolverMg's potrs and potri take it as theirs
// (on one GPU, cusolverDn's potrs).
//
// Why not cusolverMgPotrf: on 4 H200s at n=16384 (float64) it takes as long as one GPU's
// cusolverDn (0.0425 s), and it scales 2.6x at n=65536. It waits for every panel before the
// trailing update. Here, right-looking with one step of look-ahead, per tile column k:
//   - the part that owns tile k factors it: cusolverDn potrf of the diagonal tile, then a trsm
//     of the rows below;
//   - every other part pulls that panel into one of two panel buffers on its copy stream (copy
//     engines, while its SMs still work on step k-1);
//   - every part updates its own tile columns j > k with a GEMM each, A'[j:, j] -= L[j:, k] L[j,
//   k]ᴴ.
//     The owner of tile k+1 updates that tile first and factors it right away, so panel k+1
//     travels while the rest of step k's updates run.
// On one GPU the local array is the whole matrix, and cusolverDn's potrf factors it in one call.
// The GEMMs also write the upper half of each diagonal tile, which the lower-triangle routines
// never read (cuSolverMg's potri result is mirrored from the lower triangle afterwards).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include <cuda_runtime_api.h>
#include <cusolverDn.h>

#include "meshla/tensor.hpp"
#include "solver/block_cyclic.hpp"
#include "solver/solver_kernels.hpp"

namespace meshla::solver {

// Where the factorization's pieces live in a part's workspace (offsets from its start).
struct CholeskyWorkspace {
  std::size_t panels = 0;  // two panel buffers, ld x tile elements each
  std::size_t potrf = 0;   // cusolverDn's workspace for a diagonal tile (one GPU: all of A)
  std::size_t pivots = 0;  // one int per local tile: cusolverDn's info of that tile
  std::size_t total = 0;
};

// One operation of the factorization, in the order the host enqueues them (which is also an
// order a single thread may run them in):
//   kFactor   the owner of tile k factors its diagonal tile and solves the rows below;
//   kCopy     `part` copies panel k into its panel buffer k % 2 (never the owner of k);
//   kUpdate   `part` updates its tile column j with panel k;
//   kRelease  `part` has enqueued every update that reads panel k (its buffer may be reused).
struct CholeskyStep {
  enum class Kind { kFactor, kCopy, kUpdate, kRelease };
  Kind kind;
  int part;
  std::int64_t k;
  std::int64_t j = -1;  // kUpdate only
};

// The whole schedule for `layout` (pure host logic, unit-tested on the CPU by running it).
std::vector<CholeskyStep> cholesky_schedule(const BlockCyclicLayout& layout);

// `potrf_bytes`: cusolverDn's device workspace for its potrf (a tile; on one GPU the whole
// matrix) with leading dimension ld = layout.padded_n().
CholeskyWorkspace cholesky_workspace(DType dtype, const BlockCyclicLayout& layout,
                                     std::size_t potrf_bytes);

// LAPACK's info from every part's per-tile cusolverDn infos (pivots[part][s] for the part's local
// tile s, global tile s * parts + part): 0, or the 1-based solver-order index of the first
// pivot that is not positive.
int first_failed_pivot(const BlockCyclicLayout& layout,
                       const std::vector<std::vector<int>>& pivots);

// cuBLAS and cusolverDn handles and a copy stream on each part's GPU; created once per solver.
class BlockCyclicCholesky {
 public:
  explicit BlockCyclicCholesky(const std::vector<int>& devices);
  ~BlockCyclicCholesky();
  BlockCyclicCholesky(BlockCyclicCholesky&&) noexcept;
  BlockCyclicCholesky& operator=(BlockCyclicCholesky&&) noexcept;

  CholeskyWorkspace workspace(DType dtype, const BlockCyclicLayout& layout) const;

  // Factors the working arrays (column-major, ld = layout.padded_n() rows) in place; the parts'
  // `workspaces` start `workspace(dtype, layout)` bytes each. Enqueued on `streams` (one per
  // part), which it waits for at the end; returns LAPACK's info.
  int factor(DType dtype, const PartPointers& working, const BlockCyclicLayout& layout,
             const std::vector<void*>& workspaces, const std::vector<cudaStream_t>& streams);

  // Part `part`'s cusolverDn handle and its parameters, which the solver's calls on one GPU
  // share (dense_solver.cpp).
  cusolverDnHandle_t dense_handle(int part) const;
  cusolverDnParams_t dense_params(int part) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace meshla::solver
