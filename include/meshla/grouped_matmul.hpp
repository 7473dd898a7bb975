// Grouped GEMM for Mixture-of-Experts: G linear layers, layer g applied to its own contiguous
// slice of m_splits[g] rows. The group sizes live on the device (int64 or int32 [G]) and the host
// never reads them, so every call only enqueues work and can be captured in a CUDA graph.
//
//   forward   y_g  = x_g · W_gᵀ (+ b_g)        x [rows, in]   W [G, out, in]   y [rows, out]
//   dgrad     dx_g = dy_g · W_g                dy [rows, out]                  dx [rows, in]
//   wgrad     dW_g = dy_gᵀ · x_g  (or +=)      dW [G, out, in]: like x, or fp32 when accumulating
//   bias_grad db_g = Σ over rows of dy_g       db [G, out]
//
// W and dW have contiguous rows and any group stride, so a packed buffer whose groups start on
// 256-byte boundaries (packed_group_stride) is used as is. Groups with no rows are allowed: their
// dW_g and db_g are zero (left untouched when accumulating). Accumulated weight gradients may
// also sit anywhere, each at its own address (dweight_addresses).
//
// On Hopper, bf16 and fp16 accumulate in fp32 on CUTLASS's grouped GEMM (TMA + WGMMA, problem
// sizes read on the device). TMA reads 16-bit rows of a multiple of 8 features at 16-byte
// aligned addresses in place; features of other sizes run there on zero-padded copies of the
// operands with such rows, and of the weights and bias, in the workspace (the outputs cropped
// back), so any size runs, at the cost of those copies. fp32 groups, and bf16 and fp16 ones on
// other GPUs (or under MESHLA_PORTABLE=1, read when the engine is made), run meshla's portable
// kernel: SIMT, fp32 products and sums, any feature size in place, far slower than Hopper's.
// The 16-byte alignment of 16-bit operands is required everywhere, so that a program that runs
// on one GPU runs on every other.
//
// Checks that need m_splits (no negative size, sizes summing to the rows of x) run on the device.
// A call that fails them does no GEMM, fills its outputs with NaN and records the error in
// host-mapped memory of its GroupedMatmul; the next call of that GroupedMatmul, or
// check_device_errors(), throws it as kInvalidArgument. No call waits for the device to find out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include <cuda_runtime_api.h>

#include "meshla/export.hpp"
#include "meshla/tensor.hpp"

namespace meshla {

enum class GroupedPass { kForward, kDgrad, kWgrad, kBiasGrad };

// How weight and dweight hold each group's matrix.
enum class WeightLayout {
  kOutIn,  // [G, out, in]: a linear layer's weight (grouped_linear; the default)
  kInOut,  // [G, in, out]: jax.lax.ragged_dot's rhs, [G, k, n] (grouped_matmul). The passes
           // run on the same kernels with the roles swapped (the forward is the [G, out, in]
           // dgrad of the transposed problem, the dgrad its forward, the wgrad swaps x and dy),
           // so nothing is transposed; the checks name the arguments as grouped_matmul does:
           // group_sizes, lhs [rows, in], rhs [G, in, out], out [rows, out]. A bias is added
           // after the product (the dgrad kernel that runs the forward has no bias epilogue).
};

// Every pass takes m_splits and a workspace of workspace_bytes() bytes, allocated by the caller
// for this call (stream-ordered: two calls in flight at once must not share one). Unused fields
// stay empty (data == nullptr).
struct GroupedMatmulArgs {
  TensorView m_splits;  // int64 or int32 (JAX's ragged_dot's) [G], on the device
  TensorView x;         // [rows, in]: forward, wgrad
  TensorView dy;        // [rows, out]: dgrad, wgrad, bias_grad
  TensorView weight;    // [G, out, in] ([G, in, out] for kInOut): forward, dgrad
  TensorView bias;      // [G, out]: forward, optional
  TensorView y;         // [rows, out]: forward output
  TensorView dx;        // [rows, in]: dgrad output
  TensorView dweight;   // weight's layout: wgrad output (fp32 when accumulate)
  TensorView dbias;     // [G, out]: bias_grad output
  // wgrad with accumulate, instead of dweight: int64 [G] on the device, the address of each
  // group's fp32 matrix in weight's layout (contiguous, 16-byte aligned, not overlapping
  // another), for gradients that do not lie at equal spacing in one buffer (a framework's grad
  // buffer).
  TensorView dweight_addresses;
  bool accumulate = false;  // wgrad: dweight += dy_gᵀ · x_g
  TensorView workspace;     // uint8-sized bytes on the device
  WeightLayout weight_layout = WeightLayout::kOutIn;
};

// Elements between consecutive groups of a packed [G, out, in] buffer in which every group starts
// on a 256-byte boundary.
MESHLA_API std::int64_t packed_group_stride(std::int64_t out_features, std::int64_t in_features,
                                            DType dtype);

class MESHLA_API GroupedMatmul {
 public:
  // Reads the device's SM count and allocates the host-mapped error record.
  explicit GroupedMatmul(int device);
  ~GroupedMatmul();
  GroupedMatmul(GroupedMatmul&&) noexcept;
  GroupedMatmul& operator=(GroupedMatmul&&) noexcept;
  GroupedMatmul(const GroupedMatmul&) = delete;
  GroupedMatmul& operator=(const GroupedMatmul&) = delete;

  // Bytes of workspace one call of `pass` on `args` needs, from the arrays' metadata alone (data
  // is not read; workspace may be absent): what the call's shapes, dtypes, layout, bias and
  // accumulate ask for. Checks `args` as run() does.
  std::size_t workspace_bytes(GroupedPass pass, const GroupedMatmulArgs& args) const;

  // Checks every argument it can on the host, then enqueues the pass on `stream`.
  void run(GroupedPass pass, const GroupedMatmulArgs& args, cudaStream_t stream);

  // Waits for `stream`, then throws the error a call's device-side check recorded, if any.
  void check_device_errors(cudaStream_t stream);

  int device() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The checks of GroupedMatmul::run that need only the arrays' metadata (shapes, strides, dtypes,
// places, alignment), for host arrays too: a framework's reference path checks its calls with
// them, so it refuses what run() would, in the same words. Throws kInvalidArgument.
MESHLA_API void check_grouped_call(GroupedPass pass, const GroupedMatmulArgs& args);

// The device-side check of the group sizes, for sizes the host holds (a reference path): throws
// kInvalidArgument for the first negative size, or for sizes not summing to `rows`, in the words
// in which run() reports what its device-side check found for a call whose weights are laid out
// as `layout` (grouped_linear's m_splits, grouped_matmul's group_sizes).
// `sizes` holds `groups` sizes, in host memory.
MESHLA_API void check_group_sizes(const std::int64_t* sizes, std::int64_t groups, std::int64_t rows,
                                  WeightLayout layout = WeightLayout::kOutIn);

MESHLA_API std::string_view grouped_pass_name(GroupedPass pass);

}  // namespace meshla
