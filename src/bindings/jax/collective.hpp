// XLA FFI handlers of the collective matmuls, for meshla.jax.
//
// meshla.jax makes the communicators of a tensor-parallel group when it traces a call (one process
// driving every GPU of the group: Communicator::create_local; one process per GPU: the NCCL id
// through jax.distributed's key-value store) and registers each GPU's under the group's number.
// The handlers find theirs by that number and their GPU: the prepare stage checks the call and
// builds its plan (collectively: every rank's handler prepares the same call), the execute stage
// only enqueues it on XLA's stream.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "meshla/communicator.hpp"

namespace meshla::jax_ffi {

// Registers `comm` as its GPU's part of group `group` (a number meshla.jax gives each group).
void register_group(std::int64_t group, const Communicator& comm);

// (target name, {stage name: XLA_FFI_Handler*}) for every collective handler, to register for
// the CUDA platform.
std::vector<std::pair<std::string, std::vector<std::pair<std::string, void*>>>>
collective_targets();

// Lets go of every registered group and its plans; called at interpreter exit.
void release_groups();

}  // namespace meshla::jax_ffi
