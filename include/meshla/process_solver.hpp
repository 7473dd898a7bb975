// Dense solves over one GPU in each of several processes (one host or several), on cuSOLVERMp
// over the group's NCCL communicator: the engine for the process models in which no process
// drives every GPU, where cuSolverMg (DenseSolver) cannot reach.
//
// The matrix arrives as DenseSolver's does: rank p of P holds rows [p*n/P, (p+1)*n/P) of A,
// row-major. The same renumbering (solver/block_cyclic.hpp) makes those rows cuSOLVERMp's 1-D
// column block-cyclic layout on a 1 x P process grid, so A moves only inside each GPU. B, n x
// nrhs and small, is all-gathered, solved on the grid, and X broadcast back from the ranks that
// hold its column blocks. The LU solve needs A's columns, not its rows (cuSOLVERMp 0.8 solves
// with A untransposed only): every rank sends every other the block of its rows in their columns
// first (an all-to-all of A; two more copies of a rank's block in its workspace).
//
// Calls are collective and synchronous: every rank calls run() with the same problem, and it
// returns when this rank's outputs are written. The front ends agree on the call before they
// enter; a rank that dies or never calls leaves the others waiting in NCCL until the watchdog
// (runtime/execution_order.hpp) ends their processes, the communicator's timeout after.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "meshla/communicator.hpp"
#include "meshla/dense_solver.hpp"
#include "meshla/export.hpp"

namespace meshla {

class MESHLA_API ProcessSolver {
 public:
  // Collective over `comm`'s ranks: this process's cuSOLVERMp handle on the communicator's device
  // (cuSOLVERMp allows one per process and GPU; every ProcessSolver on the device shares it) and
  // the group's 1 x P grid. Give it a communicator of its own: cuSOLVERMp's collectives must not
  // interleave with other work on the same NCCL communicator. Raises kNotImplemented where
  // cuSOLVERMp cannot run (see unavailable_reason), or for more than max_ranks() ranks.
  explicit ProcessSolver(Communicator comm);
  ~ProcessSolver();
  ProcessSolver(ProcessSolver&&) noexcept;
  ProcessSolver& operator=(ProcessSolver&&) noexcept;
  ProcessSolver(const ProcessSolver&) = delete;
  ProcessSolver& operator=(const ProcessSolver&) = delete;

  // Why cuSOLVERMp cannot be opened in this process ("" where it can): not installed, or lacking
  // a function meshla calls. The version is checked when the handle is made.
  static std::string unavailable_reason();
  // The most ranks a solver takes (the gather of B: the parts the layout kernels address).
  static int max_ranks();

  int rank() const;
  int size() const;
  // The tile run() uses for `op` on `problem` (its own, or the automatic choice).
  std::int64_t tile(SolverOp op, const SolverProblem& problem) const;
  // Bytes of workspace this rank needs for one call of `op` on `problem`.
  std::size_t workspace_bytes(SolverOp op, const SolverProblem& problem) const;
  // This rank's part of the call: `shard` as one part of SolverShard's description, the rank's
  // rows. kCholeskySolve and kLuSolve so far; other ops raise kNotImplemented. overwrite_a as in
  // SolverProblem. SolverResult::info and logdet are the whole matrix's, the same on every rank.
  SolverResult run(SolverOp op, const SolverProblem& problem, const SolverShard& shard);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace meshla
