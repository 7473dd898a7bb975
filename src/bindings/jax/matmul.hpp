// The XLA FFI handler of one GPU's fp8 product (meshla/matmul.hpp), for meshla.jax's fp8 training:
// the weight gradient and the local input gradients, which XLA's own GEMMs would run on
// dequantized operands (its rewriter makes no fp8 GEMM of them).
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace meshla::jax_ffi {

// (target name, XLA_FFI_Handler*) of the handler, to register for the CUDA platform.
std::vector<std::pair<std::string, void*>> matmul_targets();

// Lets go of the Matmuls the handler made (one per GPU); called at interpreter exit.
void release_matmuls();

}  // namespace meshla::jax_ffi
