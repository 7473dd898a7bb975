// all_gather_matmul's GEMM on the symmetric backend as one persistent launch over every rank's
// block (bf16 and fp16). Each block's tiles wait on the device for the flag that says the block has
// landed, so the blocks arrive while the kernel runs and only the kernel's last wave is partly
// idle, where one GEMM per block (or per pair of blocks) leaves a partial wave at the end of each:
// m/tp rows of 128-row tiles rarely fill whole waves of 132 SMs (bench/NOTES.md, experiment 31).
// The kernel is CUTLASS's Hopper ptr-array GEMM (the grouped GEMM's) with a tile scheduler that
// waits. This header includes no CUTLASS header.
#pragma once

#include <chrono>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "core/cuda_handles.hpp"
#include "meshla/tensor.hpp"

namespace meshla::overlap {

// Blocks one launch can take: tp of a node.
constexpr int kMaxGatheredBlocks = 8;

struct GatheredGemmShape {
  DType dtype = DType::kBFloat16;
  int blocks = 0;               // ranks of the group
  std::int64_t block_rows = 0;  // rows of each rank's block: m / tp
  std::int64_t n = 0, k = 0;
  bool trans_b = false;  // b is [n, k] (else [k, n]), both row-major
  int device = 0;
  int sm_count = 0;  // SMs the kernel may occupy (0: all)
};

// Why GatheredGemm cannot run `shape`, or "" when it can: dtype bf16 or fp16, at most
// kMaxGatheredBlocks blocks, n and k multiples of 8 (TMA moves 16-byte aligned rows).
const char* gathered_gemm_unsupported(const GatheredGemmShape& shape);

struct GatheredBlock {
  const void* a = nullptr;  // [block_rows, k]
  void* d = nullptr;        // [block_rows, n]
  // Set to nonzero (by the stream that copies the block in) once `a` has landed; the kernel's tiles
  // of this block wait for it. nullptr: present before the launch.
  const std::uint32_t* landed = nullptr;
};

class GatheredGemm {
 public:
  // Allocates the kernel's tables and workspace on shape.device, once.
  explicit GatheredGemm(const GatheredGemmShape& shape);

  // d = a · b (+ bias) for every block, tiles taken block by block in the order of `blocks`
  // (shape.blocks of them), each 16-byte aligned. A block whose flag stays unset for `timeout`
  // stops the kernel with a device-side trap (the CUDA context is then lost): a rank that died
  // must not hang its peers.
  void run(const GatheredBlock* blocks, const void* b, const void* bias,
           std::chrono::milliseconds timeout, cudaStream_t stream);

 private:
  GatheredGemmShape shape_;
  detail::DeviceBuffer workspace_;  // tables, then CUTLASS's workspace
  std::size_t tables_bytes_ = 0;
};

}  // namespace meshla::overlap
