// Matmul: row-major GEMM on cuBLASLt, the building block of every compute step in meshla.
//
//   d[i] = a[i] @ op(b) (+ bias) (+ addend[i])      for i in [0, batch)
//
// a is [m, k] row-major, op(b) is b [k, n] or, with trans_b, the transpose of b stored [n, k]
// (a torch.nn.Linear weight). Batched rows of a and d sit at fixed strides; b and the bias are
// shared by the batch. bf16 and fp16 accumulate in fp32; fp32 is computed in full fp32.
#pragma once

#include <cstdint>
#include <memory>

#include <cuda_runtime_api.h>

#include "meshla/export.hpp"
#include "meshla/tensor.hpp"

namespace meshla {

struct MatmulShape {
  DType dtype = DType::kBFloat16;
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
};

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
