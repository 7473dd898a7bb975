// The grouped GEMM's passes on CUTLASS's Hopper kernel (gemm/sm90_grouped_gemm.cuh): the table
// kernel that fills each call's tables and tile order from the group index on the device, and the
// launch. Included by the sm90_grouped_*.cu translation units, one a pass.
#pragma once

#include <algorithm>

// The group index's device functions first, as before the kernel moved to gemm/: the table kernels'
// code follows the order of the definitions they inline (the other way round, their registers and
// a few instructions came out otherwise), and these are the kernels that were measured.
#include "grouped/grouped_device.cuh"

#include "gemm/sm90_grouped_gemm.cuh"
#include "grouped/sm90_grouped_passes.hpp"

namespace meshla::grouped {

using gemm::ceil_tiles;
using gemm::check_cutlass;
using gemm::Epilogue;
using gemm::GroupedGemm;
using gemm::kTileK;
using gemm::kTileM;
using gemm::kTileN;
using gemm::leading_stride;
using gemm::OrderPlan;
using gemm::split_capacity;
using gemm::strip_m_tiles;
using gemm::write_tile_order;

// Group g's entries of the tables.
template <class G, GroupedPass pass>
__device__ void fill_group(std::int64_t g, const GroupIndex& index, const GroupedOperands& op,
                           const typename G::Tables& tables) {
  using Element = typename G::Element;
  const std::int64_t first = index.offsets[g];
  const int rows = static_cast<int>(index.offsets[g + 1] - first);
  const int in = static_cast<int>(op.in_features);
  const int out = static_cast<int>(op.out_features);
  const auto* x = static_cast<const Element*>(op.x);
  const auto* dy = static_cast<const Element*>(op.dy);
  const auto* weight = static_cast<const Element*>(op.weight) + g * op.weight_group_stride;
  if constexpr (pass == GroupedPass::kForward) {
    tables.shapes[g] = {rows, out, in};
    tables.a[g] = x + first * in;
    tables.b[g] = weight;
    tables.d[g] = static_cast<Element*>(op.out) + first * out;
    tables.bias[g] =
        op.bias ? static_cast<const Element*>(op.bias) + g * op.bias_group_stride : nullptr;
    tables.stride_a[g] = leading_stride<typename G::StrideA>(in);
    tables.stride_b[g] = leading_stride<typename G::StrideB>(in);
    tables.stride_d[g] = leading_stride<typename G::StrideD>(out);
  } else if constexpr (pass == GroupedPass::kDgrad) {
    tables.shapes[g] = {rows, in, out};
    tables.a[g] = dy + first * out;
    tables.b[g] = weight;
    tables.d[g] = static_cast<Element*>(op.out) + first * in;
    tables.stride_a[g] = leading_stride<typename G::StrideA>(out);
    tables.stride_b[g] = leading_stride<typename G::StrideB>(in);
    tables.stride_d[g] = leading_stride<typename G::StrideD>(in);
  } else {
    // A group without rows has nothing to contract; it gets no tiles (M = 0) and its dW_g is
    // zeroed, or left alone when accumulating, outside the GEMM.
    tables.shapes[g] = {rows == 0 ? 0 : out, in, rows};
    tables.a[g] = dy + first * out;
    tables.b[g] = x + first * in;
    auto* d = group_dweight<typename G::ElementD>(op, g);
    tables.d[g] = d;
    tables.c[g] = reinterpret_cast<const typename G::StoredC*>(d);
    tables.stride_a[g] = leading_stride<typename G::StrideA>(out);
    tables.stride_b[g] = leading_stride<typename G::StrideB>(in);
    tables.stride_c[g] = leading_stride<typename G::StrideC>(in);
    tables.stride_d[g] = leading_stride<typename G::StrideD>(in);
  }
}

// Everything a call does before its GEMM, in one launch. Block 0 builds the group index, then
// every group's entries of the tables and the tile order. A call whose
// m_splits fail the checks gets all-zero offsets, so every group has no rows and the GEMM touches
// nothing; block 0 then fills the output with NaN (slowly, with one block, but only on that rare
// path, which spares every valid call a launch). The weight gradient's kernel has a block grid
// over the groups (span_grid) that zeroes the groups without rows, which get no tiles from the
// GEMM; the other passes run block 0 alone.
template <class G, GroupedPass pass, bool clear_empty>
__global__ void __launch_bounds__(kIndexThreads)
    fill_tables(GroupIndex index, DeviceStatus* status, GroupedOperands op, GroupedSpan out,
                typename G::Tables tables, OrderPlan plan) {
  // This kernel launches as a programmatic dependent of the work before it on the stream (often
  // the previous call's GEMM, which lets it launch once its CTAs have run out of tiles): nothing
  // here reads or writes memory before that work is done. The GEMM, launched as this kernel's
  // programmatic dependent, may start now: it waits for the tables where it first reads them
  // (ClaimingScheduler).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  if (blockIdx.x == 0 && blockIdx.y == 0) {
    const bool valid = build_group_index(index, status);
    for (std::int64_t g = threadIdx.x; g < index.groups; g += blockDim.x) {
      fill_group<G, pass>(g, index, op, tables);
    }
    write_tile_order<pass>(index, op, tables.order(), plan, tables.scratch);
    if (!valid) {
      for (std::int64_t g = 0; g < out.groups; ++g) {
        fill_elements(out, g, Fill::kNaN, threadIdx.x, blockDim.x);
      }
    }
  }
  if constexpr (clear_empty) clear_if_empty(index, out);
}

template <GroupedPass pass, DType dtype, Epilogue epilogue, bool wide_subtiles>
CutlassWorkspace workspace_of(std::int64_t groups, int device, int sm_count) {
  using G = GroupedGemm<pass, dtype, epilogue, wide_subtiles>;
  const typename G::Tables none{};
  return {G::tables_bytes(groups, split_capacity(G::split_sms(sm_count))),
          G::Gemm::get_workspace_size(G::arguments(none, groups, device, sm_count, false))};
}

// The weight gradient's tiles contract their group's rows, often few, so its epilogue weighs more
// than its mainloop's fourth stage: it always takes wide subtiles (experiment 42: 2-7% on Qwen3
// and DeepSeek with 32 experts, level on DeepSeek with 8; experiment 44: 16 x 2048 uniform lost
// 2%, within its spread). The accumulating epilogue keeps CUTLASS's.
constexpr bool always_wide(GroupedPass pass, Epilogue epilogue) {
  return pass == GroupedPass::kWgrad && epilogue == Epilogue::kStore;
}

// dgrad takes wide subtiles when its groups average at least 8 M-tiles of rows, so that a group's
// weight serves enough tiles from L2; with fewer (Qwen3: 4) the mainloop waits on HBM for each
// group's weight and needs its fourth stage (experiment 42: wide subtiles gained 2-4% on
// DeepSeek with 32 experts and 16 x 2048 rows, and lost 1-3% on Qwen3). The forward pass lost
// 2-5% with them on Qwen3 and 16 x 2048 rows and keeps narrow ones.
constexpr std::int64_t kWideDgradMinRowsPerGroup = 8 * 128;

template <GroupedPass pass, DType dtype, Epilogue epilogue>
CutlassWorkspace workspace_of(std::int64_t groups, int device, int sm_count) {
  auto widest = [](CutlassWorkspace a, CutlassWorkspace b) {
    return CutlassWorkspace{std::max(a.tables, b.tables), std::max(a.kernel, b.kernel)};
  };
  constexpr bool wide = always_wide(pass, epilogue);
  CutlassWorkspace all = workspace_of<pass, dtype, epilogue, wide>(groups, device, sm_count);
  if constexpr (pass == GroupedPass::kDgrad) {
    all = widest(all, workspace_of<pass, dtype, epilogue, true>(groups, device, sm_count));
  }
  return all;
}

template <GroupedPass pass>
OrderPlan order_plan(const CutlassCall& call) {
  const GroupedOperands& op = call.operands;
  const std::int64_t groups = call.index.groups;
  const std::int64_t n = pass == GroupedPass::kForward ? op.out_features : op.in_features;
  OrderPlan plan{static_cast<std::int32_t>(ceil_tiles(n, kTileN)), 0};
  std::int64_t m_tiles_bound;  // of all groups
  if constexpr (pass == GroupedPass::kWgrad) {
    plan.strip = ceil_tiles(op.out_features, kTileM);  // one segment per group
    m_tiles_bound = plan.strip * groups;
  } else {
    m_tiles_bound = ceil_tiles(call.index.rows, kTileM) + groups;  // >= the sum of ceil(rows_g/128)
    const std::int64_t k = pass == GroupedPass::kForward ? op.in_features : op.out_features;
    plan.strip = strip_m_tiles(plan.n_tiles, k, m_tiles_bound, call.sm_count, call.l2_bytes);
    plan.k_tiles = ceil_tiles(k, kTileK);
  }
  // Claim indices are 32-bit.
  MESHLA_CHECK_ARG(m_tiles_bound * plan.n_tiles < (std::int64_t{1} << 32),
                   "grouped_linear "
                       << grouped_pass_name(pass) << ": " << call.index.rows << " rows in "
                       << groups << " groups with in_features=" << op.in_features
                       << ", out_features=" << op.out_features << " make more than 2^32 tiles");
  return plan;
}

template <GroupedPass pass, DType dtype, Epilogue epilogue, bool wide_subtiles>
void run_grouped(const CutlassCall& call, cudaStream_t stream) {
  using G = GroupedGemm<pass, dtype, epilogue, wide_subtiles>;
  const std::int64_t groups = call.index.groups;
  OrderPlan plan = order_plan<pass>(call);
  plan.split_sms = G::split_sms(call.sm_count);
  const typename G::Tables tables = G::carve(call.tables, groups, split_capacity(plan.split_sms));
  // The weight gradient (not accumulated) zeroes empty groups; accumulating leaves them alone.
  constexpr bool clear_empty = pass == GroupedPass::kWgrad && epilogue == Epilogue::kStore;
  cudaLaunchConfig_t config{};
  config.gridDim = clear_empty ? span_grid(call.out, kIndexThreads) : dim3(1);
  config.blockDim = dim3(kIndexThreads);
  config.stream = stream;
  // Launched as a programmatic dependent of the work before it (experiment 47: 1-2.5 us less a
  // call on 16 x 2048 rows, the launch hidden behind the previous GEMM's last tiles).
  cudaLaunchAttribute after_previous{};
  after_previous.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  after_previous.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &after_previous;
  config.numAttrs = 1;
  MESHLA_CHECK_CUDA(cudaLaunchKernelEx(&config, fill_tables<G, pass, clear_empty>, call.index,
                                       call.status, call.operands, call.out, tables, plan));
  typename G::Gemm gemm;
  const auto args =
      G::arguments(tables, groups, call.device, call.sm_count, call.operands.bias != nullptr);
  check_cutlass(gemm.initialize(args, call.kernel_workspace, stream), "initialize");
  // The GEMM launches as the table kernel's programmatic dependent: its CTAs start while the
  // table kernel runs and wait for it in ClaimingScheduler (experiment 43: 0.5-1.5% on the
  // 0.2 ms calls of 16 x 2048 rows).
  check_cutlass(gemm.run(stream, nullptr, /*launch_with_pdl=*/true), "launch");
}

template <GroupedPass pass, Epilogue epilogue>
CutlassWorkspace workspace_for(DType dtype, std::int64_t groups, int device, int sm_count) {
  if (dtype == DType::kBFloat16)
    return workspace_of<pass, DType::kBFloat16, epilogue>(groups, device, sm_count);
  MESHLA_ASSERT(dtype == DType::kFloat16);
  return workspace_of<pass, DType::kFloat16, epilogue>(groups, device, sm_count);
}

template <GroupedPass pass, DType dtype, Epilogue epilogue>
void run_subtiled(const CutlassCall& call, cudaStream_t stream) {
  if constexpr (pass == GroupedPass::kDgrad) {
    if (call.index.rows >= kWideDgradMinRowsPerGroup * call.index.groups) {
      return run_grouped<pass, dtype, epilogue, true>(call, stream);
    }
  }
  run_grouped<pass, dtype, epilogue, always_wide(pass, epilogue)>(call, stream);
}

template <GroupedPass pass, Epilogue epilogue>
void run_for(const CutlassCall& call, cudaStream_t stream) {
  if (call.dtype == DType::kBFloat16)
    return run_subtiled<pass, DType::kBFloat16, epilogue>(call, stream);
  MESHLA_ASSERT(call.dtype == DType::kFloat16);
  run_subtiled<pass, DType::kFloat16, epilogue>(call, stream);
}

}  // namespace meshla::grouped
