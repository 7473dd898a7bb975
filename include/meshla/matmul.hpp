// Matmul: row-major GEMM on cuBLASLt, the building block of every compute step in meshla.
//
//   d[i] = a[i] @ op(b) (+ bias) (+ addend[i])      for i in [0, batch)
//
// a is [m, k] row-major, op(b) is b [k, n] or, with trans_b, the transpose of b stored [n, k]
// (a torch.nn.Linear weight). Batched rows of a and d sit at fixed strides; b and the bias are
// shared by the batch. bf16 and fp16 accumulate in fp32; fp32 is computed in full fp32.
//
// fp8 (float8_e4m3fn or float8_e5m2 a and b, not both e5m2) is scaled: with tensorwise scales
// d = a_scale * b_scale * (a @ op(b)) (+ bias), with rowwise ones d[i, j] = a_scale[i] *
// b_scale[j] * (a @ op(b))[i, j] (+ bias[j]): float32 scales on the device, read when the GEMM
// runs (no host sync, graph-capturable), as torch._scaled_mm's. d is bfloat16, float16 or
// float32 (rowwise: bfloat16 or float32); b is stored [n, k] (trans_b), the only operand order
// cuBLASLt's fp8 kernels take. Rowwise scales on Hopper run meshla's CUTLASS kernel, as
// cuBLASLt's outer-vector scales do not run there; everything else runs on cuBLASLt.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>

#include <cuda_runtime_api.h>

#include "meshla/export.hpp"
#include "meshla/tensor.hpp"

namespace meshla {

// How an fp8 product's operands are scaled back (see above); kNone for every other dtype.
enum class MatmulScaling { kNone, kTensorwise, kRowwise };

struct MatmulShape {
  DType dtype = DType::kBFloat16;  // a's, and b's and d's unless given below
  std::optional<DType> b_dtype;    // fp8: b's where it differs from a's (e4m3 with e5m2)
  std::optional<DType> out_dtype;  // fp8: d's and the bias's
  MatmulScaling scaling = MatmulScaling::kNone;
  std::int64_t m = 0, n = 0, k = 0;
  bool trans_b = false;
  int batch = 1;
  std::int64_t lda = 0, ldb = 0, ldd = 0;  // row pitches in elements (0: packed)
  std::int64_t batch_stride_a = 0;         // elements between batch members of a
  std::int64_t batch_stride_d = 0;         // ... of d and of the addend
  bool bias = false;                       // add a length-n bias to every row
  bool addend = false;                     // add a [m, n] array laid out like d
  int sm_count = 0;  // SMs the GEMM may occupy (0: all), leaving the rest to concurrent kernels
};

struct MatmulOperands {
  const void* a = nullptr;
  const void* b = nullptr;
  const void* bias = nullptr;
  const void* addend = nullptr;
  void* d = nullptr;
  const float* a_scale = nullptr;  // fp8: one float (tensorwise) or m (rowwise)
  const float* b_scale = nullptr;  // fp8: one float (tensorwise) or n (rowwise)
  // The call's own workspace, kMatmulWorkspaceBytes at a 256-byte boundary, for callers whose
  // calls on one device may run at once (XLA schedules what it sees; a workspace it does not
  // see would be shared unordered). nullptr: the Matmul's, which its calls share, so that they
  // must run one after another (one stream, or streams ordered by the caller).
  void* workspace = nullptr;
};

// Bytes of a call's own workspace (MatmulOperands::workspace): cuBLASLt's recommended workspace
// for Hopper.
inline constexpr std::size_t kMatmulWorkspaceBytes = std::size_t{32} << 20;

// The rules prepare() and run() apply to a shape (extents, pitches, dtypes, scales), on the shape
// alone: throws kInvalidArgument or kNotImplemented with a message that names what is wrong.
MESHLA_API void check_matmul_shape(const MatmulShape& shape);

class MESHLA_API Matmul {
 public:
  // A workspace on `device`, and the device's cuBLASLt handle (made on first use, kept for the
  // process's life).
  explicit Matmul(int device);
  ~Matmul();
  Matmul(Matmul&&) noexcept;
  Matmul& operator=(Matmul&&) noexcept;
  Matmul(const Matmul&) = delete;
  Matmul& operator=(const Matmul&) = delete;

  // Chooses and caches the algorithm for `shape` with 16-byte aligned operands, so that run() on
  // a prepared shape only enqueues: times cuBLASLt's candidates on scratch data of the shape
  // (allocated, filled and freed here, stream-ordered, with a workspace of their own) and keeps
  // the fastest. Waits for its own timing runs only, so it may overlap runs already enqueued; a
  // shape prepared before costs nothing.
  void prepare(const MatmulShape& shape);

  // Enqueues the product on `stream`. Never allocates device memory or waits on the host. The
  // algorithm is cached per shape and operand alignment; a shape or alignment not prepared costs
  // one host-side heuristic query (its first candidate, untimed), safe inside graph capture.
  void run(const MatmulShape& shape, const MatmulOperands& operands, cudaStream_t stream);

  int device() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace meshla
