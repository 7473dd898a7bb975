// One CUTLASS Hopper grouped GEMM per (pass, dtype): the kernel type, the per-group tables it reads
// (problem sizes, operand pointers, strides), the kernel that fills them from the group index on
// the device, and the launch. Included only by the cutlass_grouped_*.cu translation units.
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_compute_tma_warpspecialized.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <algorithm>
#include <type_traits>

#include "core/alignment.hpp"
#include "core/cuda_checks.hpp"
#include "grouped/claiming_scheduler.cuh"
#include "grouped/cutlass_grouped.hpp"
#include "grouped/grouped_device.cuh"

#if !defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#error "meshla's grouped GEMM needs CUTLASS's SM90 ptr-array support (CUDA 12.3+ and sm_90a)"
#endif

namespace meshla::grouped {

// What the epilogue does with the fp32 accumulator.
enum class Epilogue {
  kStore,       // D = acc
  kBias,        // D = acc + bias_g broadcast over rows (no bias: the pointer table is null)
  kAccumulate,  // D (fp32) = acc + D
};

template <DType dtype>
struct CutlassElement;
template <>
struct CutlassElement<DType::kBFloat16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct CutlassElement<DType::kFloat16> {
  using type = cutlass::half_t;
};

// Row-major [rows, cols] operands in CUTLASS's terms: A is [M, K], B is [N, K], C and D [M, N].
// forward  A = x  (K-major)       B = W_g as [N=out, K=in]  (K-major)
// dgrad    A = dy (K-major)       B = W_g as [N=in, K=out]  (N-major)
// wgrad    A = dyᵀ (M-major)      B = x as [N=in, K=rows]   (N-major)
template <GroupedPass pass>
struct PassLayouts;
template <>
struct PassLayouts<GroupedPass::kForward> {
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::ColumnMajor;
};
template <>
struct PassLayouts<GroupedPass::kDgrad> {
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::RowMajor;
};
template <>
struct PassLayouts<GroupedPass::kWgrad> {
  using A = cutlass::layout::ColumnMajor;
  using B = cutlass::layout::RowMajor;
};

template <GroupedPass pass, DType dtype, Epilogue epilogue, int cluster_m = 1>
struct GroupedGemm {
  using Element = typename CutlassElement<dtype>::type;
  using ElementD = std::conditional_t<epilogue == Epilogue::kAccumulate, float, Element>;
  using ElementC = std::conditional_t<epilogue == Epilogue::kAccumulate, float, void>;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignment = 8;  // 16 bytes of 16-bit elements: TMA's minimum
  static constexpr int kAlignmentD = 128 / cutlass::sizeof_bits<ElementD>::value;

  // Cooperative 128x256 tiles: both consumer warpgroups share each tile and the persistent
  // scheduler walks all groups' tiles in one launch. Measured against pingpong 64x256 and 128x128
  // (bench/NOTES.md, experiment 12), it wins or ties on every benchmarked shape.
  // cluster_m = 2 pairs M-tiles, which then share each B tile through multicast, but CUTLASS
  // rounds each group's M-tile count up to the pair and runs the extra tile in full. Forward and
  // dgrad tile the rows, known only on the device: on the skewed Qwen3 routing the rounding cost
  // 13% more tiles, more than the multicast bought (experiment 24), so they pair only when the
  // groups are large on average (run_clustered). The weight gradient (M = out_features) never
  // pairs: where its count is even, pairing measured within 1% (experiment 28).
  using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using ClusterShape = cute::Shape<cute::Int<cluster_m>, cute::_1, cute::_1>;
  using MainSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpiSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;

  // The weight gradient's tiles are claimed (claiming_scheduler.cuh); forward and dgrad tiles
  // all cost the same, and CUTLASS's static deal suits them.
  using ProblemShape =
      std::conditional_t<pass == GroupedPass::kWgrad, ClaimedProblemShape,
                         cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>>;

  using BiasEvt = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::plus, ElementD, float,
                                             cutlass::FloatRoundStyle::round_to_nearest>,
      cutlass::epilogue::fusion::Sm90AccFetch,
      cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, Element*, float,
                                                  cute::Stride<cute::_0, cute::_1, cute::_0>>>;
  using Fusion =
      std::conditional_t<epilogue == Epilogue::kBias, BiasEvt,
                         cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC>>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, LayoutD*,
      kAlignmentD, ElementD, LayoutD*, kAlignmentD, EpiSchedule, Fusion>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, typename PassLayouts<pass>::A*,
      kAlignment, Element, typename PassLayouts<pass>::B*, kAlignment, float, TileShape,
      ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      MainSchedule>::CollectiveOp;

  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape = typename ProblemShape::UnderlyingProblemShape;
  using StoredC = std::conditional_t<std::is_void_v<ElementC>, float, ElementC>;

  // Device tables, carved out of the workspace in this order, each 256-byte aligned.
  struct Tables {
    Shape* shapes;
    const Element** a;
    const Element** b;
    const StoredC** c;
    ElementD** d;
    const Element** bias;
    StrideA* stride_a;
    StrideB* stride_b;
    StrideC* stride_c;
    StrideD* stride_d;
    std::uint32_t* claimed;  // the weight gradient's claim counter
  };

  static std::size_t tables_bytes(std::int64_t groups) {
    const auto n = static_cast<std::size_t>(groups);
    return detail::align_up(n * sizeof(Shape)) + 5 * detail::align_up(n * sizeof(void*)) +
           detail::align_up(n * sizeof(StrideA)) + detail::align_up(n * sizeof(StrideB)) +
           detail::align_up(n * sizeof(StrideC)) + detail::align_up(n * sizeof(StrideD)) +
           detail::align_up(sizeof(std::uint32_t));
  }

  static Tables carve(void* base, std::int64_t groups) {
    auto* cursor = static_cast<char*>(base);
    const auto n = static_cast<std::size_t>(groups);
    auto take = [&](std::size_t bytes) {
      char* at = cursor;
      cursor += detail::align_up(bytes);
      return at;
    };
    Tables tables;
    tables.shapes = reinterpret_cast<Shape*>(take(n * sizeof(Shape)));
    tables.a = reinterpret_cast<const Element**>(take(n * sizeof(void*)));
    tables.b = reinterpret_cast<const Element**>(take(n * sizeof(void*)));
    tables.c = reinterpret_cast<const StoredC**>(take(n * sizeof(void*)));
    tables.d = reinterpret_cast<ElementD**>(take(n * sizeof(void*)));
    tables.bias = reinterpret_cast<const Element**>(take(n * sizeof(void*)));
    tables.stride_a = reinterpret_cast<StrideA*>(take(n * sizeof(StrideA)));
    tables.stride_b = reinterpret_cast<StrideB*>(take(n * sizeof(StrideB)));
    tables.stride_c = reinterpret_cast<StrideC*>(take(n * sizeof(StrideC)));
    tables.stride_d = reinterpret_cast<StrideD*>(take(n * sizeof(StrideD)));
    tables.claimed = reinterpret_cast<std::uint32_t*>(take(sizeof(std::uint32_t)));
    return tables;
  }

  static typename Gemm::Arguments arguments(const Tables& tables, std::int64_t groups, int device,
                                            int sm_count, bool has_bias) {
    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    // No host copy of the sizes: they exist only on the device.
    args.problem_shape.num_groups = static_cast<int>(groups);
    args.problem_shape.problem_shapes = tables.shapes;
    args.problem_shape.host_problem_shapes = nullptr;
    if constexpr (pass == GroupedPass::kWgrad) args.problem_shape.claimed = tables.claimed;
    args.mainloop = {tables.a, tables.stride_a, tables.b, tables.stride_b};
    args.epilogue.ptr_C = std::is_void_v<ElementC>
                              ? nullptr
                              : reinterpret_cast<decltype(args.epilogue.ptr_C)>(tables.c);
    args.epilogue.dC = tables.stride_c;
    args.epilogue.ptr_D = tables.d;
    args.epilogue.dD = tables.stride_d;
    if constexpr (epilogue == Epilogue::kBias) {
      auto& row = args.epilogue.thread;
      // Sm90EVT arguments: children first (accumulator, bias row), then the node (plus).
      row.op_1.ptr_row = has_bias ? tables.bias : nullptr;
    } else {
      args.epilogue.thread.alpha = 1.0f;
      args.epilogue.thread.beta = epilogue == Epilogue::kAccumulate ? 1.0f : 0.0f;
    }
    args.hw_info.device_id = device;
    args.hw_info.sm_count = sm_count;
    return args;
  }
};

// Sets the one dynamic stride of a packed row- or column-major operand: its leading dimension.
template <class Stride>
__device__ Stride leading_stride(std::int64_t leading) {
  Stride stride{};
  if constexpr (!cute::is_static<cute::remove_cvref_t<decltype(cute::get<0>(stride))>>::value) {
    cute::get<0>(stride) = leading;
  } else {
    cute::get<1>(stride) = leading;
  }
  return stride;
}

// Group g's entries, at position `slot` of the tables (the order in which the GEMM takes the
// groups' tiles).
template <class G, GroupedPass pass>
__device__ void fill_group(std::int64_t g, std::int64_t slot, const GroupIndex& index,
                           const GroupedOperands& op, const typename G::Tables& tables) {
  using Element = typename G::Element;
  const std::int64_t first = index.offsets[g];
  const int rows = static_cast<int>(index.offsets[g + 1] - first);
  const int in = static_cast<int>(op.in_features);
  const int out = static_cast<int>(op.out_features);
  const auto* x = static_cast<const Element*>(op.x);
  const auto* dy = static_cast<const Element*>(op.dy);
  const auto* weight = static_cast<const Element*>(op.weight) + g * op.weight_group_stride;
  if constexpr (pass == GroupedPass::kForward) {
    tables.shapes[slot] = {rows, out, in};
    tables.a[slot] = x + first * in;
    tables.b[slot] = weight;
    tables.d[slot] = static_cast<Element*>(op.out) + first * out;
    tables.bias[slot] =
        op.bias ? static_cast<const Element*>(op.bias) + g * op.bias_group_stride : nullptr;
    tables.stride_a[slot] = leading_stride<typename G::StrideA>(in);
    tables.stride_b[slot] = leading_stride<typename G::StrideB>(in);
    tables.stride_d[slot] = leading_stride<typename G::StrideD>(out);
  } else if constexpr (pass == GroupedPass::kDgrad) {
    tables.shapes[slot] = {rows, in, out};
    tables.a[slot] = dy + first * out;
    tables.b[slot] = weight;
    tables.d[slot] = static_cast<Element*>(op.out) + first * in;
    tables.stride_a[slot] = leading_stride<typename G::StrideA>(out);
    tables.stride_b[slot] = leading_stride<typename G::StrideB>(in);
    tables.stride_d[slot] = leading_stride<typename G::StrideD>(in);
  } else {
    // A group without rows has nothing to contract; it gets no tiles (M = 0) and its dW_g is
    // zeroed, or left alone when accumulating, outside the GEMM.
    tables.shapes[slot] = {rows == 0 ? 0 : out, in, rows};
    tables.a[slot] = dy + first * out;
    tables.b[slot] = x + first * in;
    auto* d = static_cast<typename G::ElementD*>(op.out) + g * op.out_group_stride;
    tables.d[slot] = d;
    tables.c[slot] = reinterpret_cast<const typename G::StoredC*>(d);
    tables.stride_a[slot] = leading_stride<typename G::StrideA>(out);
    tables.stride_b[slot] = leading_stride<typename G::StrideB>(in);
    tables.stride_c[slot] = leading_stride<typename G::StrideC>(in);
    tables.stride_d[slot] = leading_stride<typename G::StrideD>(in);
  }
}

// The weight gradient's tiles cost in proportion to their group's rows, and the GEMM's CTAs claim
// them in table order (claiming_scheduler.cuh): largest groups first, ties in group order, so
// that the small tiles even out the CTAs' loads at the end. Counting the larger groups costs
// groups² steps in one block; past kSortedGroups the groups keep their order.
constexpr std::int64_t kSortedGroups = 512;

__device__ inline std::int64_t claim_order(const GroupIndex& index, std::int64_t g) {
  if (index.groups > kSortedGroups) return g;
  const std::int64_t rows = index.offsets[g + 1] - index.offsets[g];
  std::int64_t before = 0;
  for (std::int64_t h = 0; h < index.groups; ++h) {
    const std::int64_t other = index.offsets[h + 1] - index.offsets[h];
    before += other > rows || (other == rows && h < g);
  }
  return before;
}

// Everything a call does before its GEMM, in one launch. Block 0 builds the group index, then
// every group's entries of the tables. A call whose m_splits fail the checks gets all-zero offsets,
// so every group has no rows and the GEMM touches nothing; block 0 then fills the output with NaN
// (slowly, with one block, but only on that rare path, which spares every valid call a launch).
// The weight gradient's kernel has a block grid over the groups (span_grid) that zeroes the groups
// without rows, which get no tiles from the GEMM; the other passes run block 0 alone.
template <class G, GroupedPass pass, bool clear_empty>
__global__ void __launch_bounds__(kIndexThreads)
    fill_tables(GroupIndex index, DeviceStatus* status, GroupedOperands op, GroupedSpan out,
                typename G::Tables tables) {
  if (blockIdx.x == 0 && blockIdx.y == 0) {
    build_group_index(index, status);
    for (std::int64_t g = threadIdx.x; g < index.groups; g += blockDim.x) {
      const std::int64_t slot = pass == GroupedPass::kWgrad ? claim_order(index, g) : g;
      fill_group<G, pass>(g, slot, index, op, tables);
    }
    if (pass == GroupedPass::kWgrad && threadIdx.x == 0) *tables.claimed = 0;
    if (*index.invalid != 0) {
      for (std::int64_t g = 0; g < out.groups; ++g) {
        fill_elements(out, g, Fill::kNaN, threadIdx.x, blockDim.x);
      }
    }
  }
  if constexpr (clear_empty) clear_if_empty(index, out);
}

inline void check_cutlass(cutlass::Status status, const char* what) {
  MESHLA_CHECK(kInternal, status == cutlass::Status::kSuccess,
               "CUTLASS grouped GEMM " << what << " failed: " << cutlassGetStatusString(status));
}

template <GroupedPass pass, DType dtype, Epilogue epilogue, int cluster_m>
CutlassWorkspace workspace_of(std::int64_t groups, int device, int sm_count) {
  using G = GroupedGemm<pass, dtype, epilogue, cluster_m>;
  const typename G::Tables none{};
  return {G::tables_bytes(groups),
          G::Gemm::get_workspace_size(G::arguments(none, groups, device, sm_count, false))};
}

constexpr bool pairs_along_m(GroupedPass pass) { return pass != GroupedPass::kWgrad; }

// Forward and dgrad pair M-tiles when the groups average at least 32 tiles of rows: the rounding
// then adds at most one tile per group to each N-tile column (1/32 of the tiles at worst, half
// that on average), and the multicast of the weight tile gains more (experiment 30, DeepSeek-V3
// with 8 experts: 1-3%). At 16 tiles per group the rounding already loses (32 experts skewed
// about 2%, 16 x 2048 skewed 3-13%).
constexpr std::int64_t kPairedMinRowsPerGroup = 32 * 128;

template <GroupedPass pass, DType dtype, Epilogue epilogue>
CutlassWorkspace workspace_of(std::int64_t groups, int device, int sm_count) {
  const CutlassWorkspace single = workspace_of<pass, dtype, epilogue, 1>(groups, device, sm_count);
  if constexpr (pairs_along_m(pass)) {
    const CutlassWorkspace paired =
        workspace_of<pass, dtype, epilogue, 2>(groups, device, sm_count);
    return {std::max(single.tables, paired.tables), std::max(single.kernel, paired.kernel)};
  } else {
    return single;
  }
}

template <GroupedPass pass, DType dtype, Epilogue epilogue, int cluster_m>
void run_grouped(const CutlassCall& call, cudaStream_t stream) {
  using G = GroupedGemm<pass, dtype, epilogue, cluster_m>;
  const std::int64_t groups = call.index.groups;
  const typename G::Tables tables = G::carve(call.tables, groups);
  // The weight gradient (not accumulated) zeroes empty groups; accumulating leaves them alone.
  constexpr bool clear_empty = pass == GroupedPass::kWgrad && epilogue == Epilogue::kStore;
  const dim3 grid = clear_empty ? span_grid(call.out, kIndexThreads) : dim3(1);
  fill_tables<G, pass, clear_empty><<<grid, kIndexThreads, 0, stream>>>(
      call.index, call.status, call.operands, call.out, tables);
  MESHLA_CHECK_CUDA(cudaGetLastError());
  typename G::Gemm gemm;
  const auto args =
      G::arguments(tables, groups, call.device, call.sm_count, call.operands.bias != nullptr);
  check_cutlass(gemm.initialize(args, call.kernel_workspace, stream), "initialize");
  check_cutlass(gemm.run(stream), "launch");
}

template <GroupedPass pass, Epilogue epilogue>
CutlassWorkspace workspace_for(DType dtype, std::int64_t groups, int device, int sm_count) {
  if (dtype == DType::kBFloat16)
    return workspace_of<pass, DType::kBFloat16, epilogue>(groups, device, sm_count);
  MESHLA_ASSERT(dtype == DType::kFloat16);
  return workspace_of<pass, DType::kFloat16, epilogue>(groups, device, sm_count);
}

template <GroupedPass pass, DType dtype, Epilogue epilogue>
void run_clustered(const CutlassCall& call, cudaStream_t stream) {
  if constexpr (pairs_along_m(pass)) {
    if (call.index.rows >= kPairedMinRowsPerGroup * call.index.groups) {
      return run_grouped<pass, dtype, epilogue, 2>(call, stream);
    }
  }
  run_grouped<pass, dtype, epilogue, 1>(call, stream);
}

template <GroupedPass pass, Epilogue epilogue>
void run_for(const CutlassCall& call, cudaStream_t stream) {
  if (call.dtype == DType::kBFloat16)
    return run_clustered<pass, DType::kBFloat16, epilogue>(call, stream);
  MESHLA_ASSERT(call.dtype == DType::kFloat16);
  run_clustered<pass, DType::kFloat16, epilogue>(call, stream);
}

}  // namespace meshla::grouped
