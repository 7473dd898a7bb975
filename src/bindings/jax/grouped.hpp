// XLA FFI handlers of the grouped GEMM (meshla/grouped_matmul.hpp), for meshla.jax.grouped_linear:
// one per pass, each taking the group sizes and its operands and returning its output and the
// call's workspace (a result XLA allocates at the size meshla.jax asked for when it traced the
// call), so that a call only enqueues and XLA may capture it in a command buffer.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace meshla::jax_ffi {

// (target name, XLA_FFI_Handler*) for every grouped handler, to register for the CUDA platform.
std::vector<std::pair<std::string, void*>> grouped_targets();

// Lets go of the GroupedMatmuls the handlers made (one per GPU); called at interpreter exit.
void release_grouped();

}  // namespace meshla::jax_ffi
