// XLA FFI handlers of the dense solvers, for meshla.jax. The only C++ that knows XLA's FFI is in
// this folder.
//
// Under jax.jit + shard_map with one process driving several GPUs, XLA calls a handler once per
// GPU, each on its own thread with its own shard. The handlers of one call meet in a rendezvous
// (solver/rendezvous.hpp): each publishes its shard, the first GPU's thread runs the DenseSolver
// over all of them while the others wait, and every handler returns the call's status.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "meshla/communicator.hpp"

namespace meshla::jax_ffi {

// (target name, XLA_FFI_Handler*) for every handler, to register for the CUDA platform.
std::vector<std::pair<std::string, void*>> targets();

// Makes the ProcessSolver (cuSOLVERMp) of `comm`'s GPU in the mesh's solver group `group`, for
// the handler meshla_process_cholesky_solve. Collective over the communicator's ranks.
void register_process_solver(std::int64_t group, const Communicator& comm);

// Destroys the DenseSolvers (one per GPU list) and ProcessSolvers the handlers used; called at
// interpreter exit, before the CUDA runtime tears down.
void release_solvers();

}  // namespace meshla::jax_ffi
