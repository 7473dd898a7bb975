// all_gather_matmul's GEMM on the symmetric backend as one persistent launch over every rank's
// block (bf16 and fp16). Each block's tiles wait on the device for the flag that says the block
// has landed, so the blocks arrive while the kernel runs and only the kernel's last wave is partly
// idle, where one GEMM per block (or pair of blocks) leaves a partial wave at the end of each:
// m/tp rows of 128-row tiles rarely fill whole waves of 132 SMs (bench/NOTES.md, experiments 31
// and 45). The kernel is the grouped GEMM's (gemm/sm90_grouped_gemm.cuh), its CTAs claiming the
// tiles block by block in the order given. This header includes no CUTLASS header.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "core/cuda_handles.hpp"
#include "meshla/tensor.hpp"

namespace meshla::collective {

// Blocks one launch can take: the ranks of a node.
constexpr int kMaxGatheredBlocks = 8;

struct GatheredGemmShape {
  DType dtype = DType::kBFloat16;
  int blocks = 0;               // ranks of the group
  std::int64_t block_rows = 0;  // rows of each rank's block: m / tp
  std::int64_t n = 0, k = 0;
  bool trans_b = false;  // b is [n, k] (else [k, n]), both row-major
  int device = 0;
  int sm_count = 0;  // SMs the kernel may occupy
};

// Why GatheredGemm cannot run `shape`, or "" when it can: a Hopper GPU (its kernel is built for
// sm_90a alone; see detail::runs_hopper_kernels), bf16 or fp16, at most kMaxGatheredBlocks
// blocks, n and k multiples of 8 (TMA moves 16-byte aligned rows).
std::string gathered_gemm_unsupported(const GatheredGemmShape& shape);

// Whether the one launch should run `shape` rather than a GEMM per batch of blocks: when each
// block's GEMM would take fewer than 4 waves of the kernel's 128x256 tiles on shape.sm_count SMs,
// where a GEMM per batch loses most to its partly idle last wave and to waiting for its blocks.
// Measured on 2x H200 in the benchmark, ratio to torch's GEMM alone, per batch against one launch
// (bench/NOTES.md 45): M=2048 (3.4 waves a block) 1.28 against 1.16; M=4096 (6.8 waves) 1.04
// against 1.05, M=8192 1.00 against 1.04. Timed on one GPU without the transfers, per batch wins
// at M=2048's blocks (one H100: 0.98 against 1.03x): the one launch gains while the blocks land,
// so plans do not time the two forms.
bool gathered_gemm_pays(const GatheredGemmShape& shape);

struct GatheredBlock {
  const void* a = nullptr;  // [block_rows, k]
  void* d = nullptr;        // [block_rows, n]
  // Set to nonzero once `a` has landed (by the stream that copies it in); the kernel's tiles of
  // this block wait for it. nullptr: present before the launch.
  const std::uint32_t* landed = nullptr;
};

class GatheredGemm {
 public:
  // Allocates the kernel's tables and workspace on shape.device, once.
  explicit GatheredGemm(const GatheredGemmShape& shape);

  // d = a · b (+ bias) for every block of `blocks` (shape.blocks of them, pointers 16-byte
  // aligned), tiles taken block by block in that order. A block whose flag stays unset for
  // `timeout` stops the kernel with a device-side trap (the CUDA context is then lost): a rank
  // that died must not hang its peers.
  void run(const GatheredBlock* blocks, const void* b, const void* bias,
           std::chrono::milliseconds timeout, cudaStream_t stream);

 private:
  GatheredGemmShape shape_;
  std::int32_t n_tiles_ = 0;  // the tile order's plan (gemm::OrderPlan)
  std::int64_t strip_ = 0;
  std::size_t tables_bytes_ = 0;
  detail::DeviceBuffer workspace_;  // tables, then CUTLASS's workspace
};

}  // namespace meshla::collective
