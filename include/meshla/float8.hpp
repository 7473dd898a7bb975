// Casts of 16- and 32-bit arrays to float8 with dynamic scales, the passes an fp8 training step
// runs around its GEMMs (torchao's and TransformerEngine's recipes): the largest magnitude of
// each group of values that shares a scale, then the scaled, rounded values, optionally
// transposed in the same pass (an fp8 GEMM takes both operands with the contraction contiguous,
// so a weight gradient needs the operands' transposes).
//
//   amax[g] = max |t[i, j]| over the values of group g             (float32; NaN if one is)
//   q[i, j] = float8(t[i, j] * multiplier[g(i, j)])                 [rows, cols]
//   q_transposed[j, i] = q[i, j]                                    [cols, rows]
//
// t is [rows, cols] with unit-stride rows at any pitch, bfloat16, float16 or float32, on the
// device. The product is rounded once to float32, then to the nearest float8 value, saturated to
// the dtype's largest finite one (NaN stays NaN), so that q is what torch's
// `(t.float() * multiplier).to(dtype)` gives wherever that product is finite in the dtype. Both
// functions only enqueue work on `stream`.
#pragma once

#include <cuda_runtime_api.h>

#include "meshla/export.hpp"
#include "meshla/tensor.hpp"

namespace meshla {

// Which values share a scale: all of them, each row's, or each column's.
enum class Float8Scales { kTensor, kRows, kColumns };

// Writes amax: float32, one value (kTensor), rows or cols of them, contiguous on t's device.
// Throws kInvalidArgument naming the argument that is not as described.
MESHLA_API void float8_amax(const TensorView& t, Float8Scales scales, const TensorView& amax,
                            cudaStream_t stream);

// Writes q ([rows, cols]) and/or q_transposed ([cols, rows]), contiguous, in one float8 dtype
// (float8_e4m3fn or float8_e5m2), on t's device; an absent view (TensorView{}) is not written,
// and one of them must be given. `multiplier` holds float32 values as float8_amax's amax.
// Throws kInvalidArgument naming the argument that is not as described.
MESHLA_API void float8_cast(const TensorView& t, Float8Scales scales, const TensorView& multiplier,
                            const TensorView& q, const TensorView& q_transposed,
                            cudaStream_t stream);

}  // namespace meshla
