// CUTLASS's Hopper ptr-array GEMM as meshla runs it over groups of rows: one kernel type per
// (pass, dtype, epilogue), the per-group tables it reads (problem sizes, operand pointers,
// strides), and the order in which its CTAs claim their tiles, written on the device by a table
// kernel of the caller's. Shared by the grouped GEMM's passes (grouped/sm90_grouped_passes.cuh)
// and all_gather_matmul's one-launch GEMM (collective/symmetric/sm90_gathered_gemm.cu), whose
// groups are the ranks' blocks.
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

#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <type_traits>

#include "core/alignment.hpp"
#include "core/cuda_checks.hpp"
#include "gemm/grouped_gemm_operands.hpp"
#include "gemm/sm90_claiming_scheduler.cuh"
#include "gemm/sm90_cutlass_element.cuh"
#include "gemm/sm90_tile_marks.hpp"

#if !defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#error "meshla's grouped GEMM needs CUTLASS's SM90 ptr-array support (CUDA 12.3+ and sm_90a)"
#endif

namespace meshla::gemm {

// What the epilogue does with the fp32 accumulator.
enum class Epilogue {
  kStore,       // D = acc
  kBias,        // D = acc + bias_g broadcast over rows (no bias: the pointer table is null)
  kAccumulate,  // D (fp32) = acc + D
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

// The kernels' tile: 128 rows (M) by 256 columns (N) of the output, 64 deep (K) a k-step.
constexpr std::int64_t kTileM = 128;
constexpr std::int64_t kTileN = 256;
constexpr std::int64_t kTileK = 64;

__host__ __device__ constexpr std::int64_t ceil_tiles(std::int64_t extent, std::int64_t tile) {
  return (extent + tile - 1) / tile;
}

// Forward and dgrad cut each group's M-tiles into strips (write_tile_order); the strips widen
// where needed to keep them within kStripBudget segments beyond one per group.
constexpr std::int64_t kStripBudget = 4096;

__host__ __device__ constexpr std::uint32_t segment_capacity(GroupedPass pass,
                                                             std::int64_t groups) {
  return static_cast<std::uint32_t>(groups + (pass == GroupedPass::kWgrad ? 0 : kStripBudget));
}

// How the table kernel orders a call's tiles, from the shapes the host knows.
struct OrderPlan {
  std::int32_t n_tiles;  // every group's N-tiles
  std::int64_t strip;    // M-tiles per segment
  // Forward and dgrad: the launch's CTAs, for split_tail_tiles (0: no tile split).
  std::uint32_t split_sms = 0;
  std::int64_t k_tiles = 0;  // every group's k-tiles (forward and dgrad)
};

// The epilogue writes each tile to shared memory in subtiles of 128 rows, and a TMA store takes
// each subtile on. It keeps up to 4 stores in flight instead of CUTLASS's 2, so the consumer
// warpgroups wait less on the stores before their next tile; wide_subtiles makes the
// subtiles 128 x 64 instead of 128 x 32, half as many rounds, but their larger buffers leave room
// for 3 mainloop stages instead of 4. Measured in experiment 42 (bench/NOTES.md): 4 stores
// gained 0.5-2% on forward and dgrad; wide subtiles gained 2-7% on weight gradients and on dgrad
// of large groups and lost 3-5% where the mainloop waits on each group's weight from HBM
// (forward, Qwen3's dgrad). In the benchmark's own rotation (experiment 44) the gains held on
// average and on DeepSeek's long calls; single short calls vary by up to 3% between rotations.
template <GroupedPass pass, DType dtype, Epilogue epilogue, bool wide_subtiles = false>
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
  // No clusters: the CTAs claim their tiles one by one in the table kernel's order
  // (sm90_claiming_scheduler.cuh). Clusters of two CTAs share each weight tile through multicast,
  // but CUTLASS's deal then rounds each group's M-tiles up to the pair, and the claimed kernel beat
  // them even where the groups are large: DeepSeek-V3 with 8 experts, forward and dgrad, 3-7%
  // faster at the power limit (experiment 57); claimed pairs gained nothing (experiment 50).
  using TileShape = cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::Int<kTileK>>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using MainSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpiSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
  using ProblemShape = ClaimedProblemShape;

  using BiasEvt = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::plus, ElementD, float,
                                             cutlass::FloatRoundStyle::round_to_nearest>,
      cutlass::epilogue::fusion::Sm90AccFetch,
      cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, Element*, float,
                                                  cute::Stride<cute::_0, cute::_1, cute::_0>>>;
  using Fusion =
      std::conditional_t<epilogue == Epilogue::kBias, BiasEvt,
                         cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC>>;

  using EpilogueTile = cute::Shape<cute::_128, cute::Int<wide_subtiles ? 64 : 32>>;
  // CUTLASS's choice for this subtile (what its epilogue builder would take), with the stores in
  // flight raised where measured: not for the accumulating epilogue, whose C subtiles share the
  // buffers (4 stores would leave 3 mainloop stages).
  using BuilderPolicy =
      decltype(cutlass::epilogue::collective::detail::sm90_get_tma_dispatch_policy<
               TileShape, EpilogueTile, ElementC, ElementD, EpiSchedule>());
  static constexpr int kStoresInFlight =
      epilogue != Epilogue::kAccumulate ? 4 : BuilderPolicy::StagesD;
  using EpiloguePolicy = cutlass::epilogue::Sm90PtrArrayTmaWarpSpecialized<
      BuilderPolicy::StagesC, kStoresInFlight, BuilderPolicy::FragmentSize,
      BuilderPolicy::ReuseSmemC, BuilderPolicy::DelayTmaStore,
      BuilderPolicy::NumEpilogueWarpGroups>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::detail::Sm90TmaBuilderImpl<
      TileShape, EpilogueTile, float, float, ElementC, LayoutD*, kAlignmentD, ElementD, LayoutD*,
      kAlignmentD, Fusion, EpiloguePolicy>::CollectiveOp;

  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, typename PassLayouts<pass>::A*,
      kAlignment, Element, typename PassLayouts<pass>::B*, kAlignment, float, TileShape,
      ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage) + sizeof(tile_marks))>,
      MainSchedule>::CollectiveOp;
  using CollectiveMainloop = std::conditional_t<pass == GroupedPass::kWgrad,
                                                TrimmedTileMainloop<BuiltMainloop>, BuiltMainloop>;

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
    TileSegment* segments;  // segment_capacity(pass, groups) + 1
    TileSegment* scratch;   // forward and dgrad: 2 x segment_capacity, for the order's merge
    std::uint32_t* count;
    std::uint32_t* claimed;
    // Split tiles (TileOrder::split_tiles), where the launch has split slots; nullptr otherwise.
    std::uint32_t* split_tiles;
    float* partials;
    std::uint32_t* partial_ready;

    __host__ __device__ TileOrder order() const {
      TileOrder order;
      order.segments = segments;
      order.count = count;
      order.claimed = claimed;
      order.split_tiles = split_tiles;
      order.partials = partials;
      order.partial_ready = partial_ready;
      return order;
    }
  };

  static std::size_t segments_bytes(std::int64_t groups) {
    return (segment_capacity(pass, groups) + 1) * sizeof(TileSegment);
  }

  // The weight gradient keeps its groups' order by rows and never merges.
  static std::size_t scratch_bytes(std::int64_t groups) {
    return pass == GroupedPass::kWgrad ? 0 : 2 * segments_bytes(groups);
  }

  // The CTAs of a launch that may split its last tiles (split_tail_tiles): forward and dgrad.
  // 0 for the weight gradient.
  static std::uint32_t split_sms(int sm_count) {
    if constexpr (pass != GroupedPass::kWgrad) {
      MESHLA_ASSERT(sm_count > 0 && split_capacity(sm_count) <= TileMark::kMaxSlots);
      return static_cast<std::uint32_t>(sm_count);
    } else {
      return 0;
    }
  }

  static std::size_t partials_bytes(std::uint32_t split_slots) {
    return static_cast<std::size_t>(split_slots) * kTileM * kTileN * sizeof(float);
  }
  static std::size_t ready_bytes(std::uint32_t split_slots) {
    return static_cast<std::size_t>(split_slots) * kConsumerWarps * sizeof(std::uint32_t);
  }

  // split_slots: the split tiles a launch may have (split_capacity).
  static std::size_t tables_bytes(std::int64_t groups, std::uint32_t split_slots = 0) {
    const auto n = static_cast<std::size_t>(groups);
    const std::size_t split = split_slots == 0 ? 0
                                               : detail::align_up(sizeof(std::uint32_t)) +
                                                     detail::align_up(partials_bytes(split_slots)) +
                                                     detail::align_up(ready_bytes(split_slots));
    return detail::align_up(n * sizeof(Shape)) + 5 * detail::align_up(n * sizeof(void*)) +
           detail::align_up(n * sizeof(StrideA)) + detail::align_up(n * sizeof(StrideB)) +
           detail::align_up(n * sizeof(StrideC)) + detail::align_up(n * sizeof(StrideD)) +
           detail::align_up(segments_bytes(groups)) + detail::align_up(scratch_bytes(groups)) +
           2 * detail::align_up(sizeof(std::uint32_t)) + split;
  }

  static Tables carve(void* base, std::int64_t groups, std::uint32_t split_slots = 0) {
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
    tables.segments = reinterpret_cast<TileSegment*>(take(segments_bytes(groups)));
    tables.scratch = reinterpret_cast<TileSegment*>(take(scratch_bytes(groups)));
    tables.count = reinterpret_cast<std::uint32_t*>(take(sizeof(std::uint32_t)));
    tables.claimed = reinterpret_cast<std::uint32_t*>(take(sizeof(std::uint32_t)));
    tables.split_tiles = nullptr;
    tables.partials = nullptr;
    tables.partial_ready = nullptr;
    if (split_slots != 0) {
      tables.split_tiles = reinterpret_cast<std::uint32_t*>(take(sizeof(std::uint32_t)));
      tables.partials = reinterpret_cast<float*>(take(partials_bytes(split_slots)));
      tables.partial_ready = reinterpret_cast<std::uint32_t*>(take(ready_bytes(split_slots)));
    }
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
    args.problem_shape.order = tables.order();
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

// Every pass's order puts the largest groups first, ties in group order, so that the small groups'
// tiles even out the CTAs' loads at the end. The weight gradient's tiles cost in proportion to
// their group's rows (experiment 38). Forward and dgrad tiles cost the same whatever the group,
// but the groups' partial last M-tiles come at the end: on skewed DeepSeek-32 the forward was
// 3.6-4.1% faster with the groups by decreasing rows than in the routing's random order, 5% slower
// in increasing order (experiment 55), and 3.7% faster with this order than without (experiment
// 56); skewed Qwen3 moved by at most 1%. Past kSortedGroups the groups keep their order.
constexpr std::int64_t kSortedGroups = 512;

// Writes by_rows[rank] = group, the groups by decreasing rows, ties in group order. Each thread
// counts the groups before its own among the rows staged in shared memory: groups² /
// kIndexThreads steps on the forward's critical path, shared reads that every thread of a warp
// takes at the same address (one broadcast each). Run by one whole block, with index.groups <=
// kSortedGroups.
__device__ inline void order_by_rows(const GroupIndex& index, std::int32_t* by_rows) {
  __shared__ std::int64_t rows[kSortedGroups];
  for (std::int64_t g = threadIdx.x; g < index.groups; g += kIndexThreads) {
    rows[g] = index.offsets[g + 1] - index.offsets[g];
  }
  __syncthreads();
  for (std::int64_t g = threadIdx.x; g < index.groups; g += kIndexThreads) {
    const std::int64_t mine = rows[g];
    std::int32_t before = 0;
    for (std::int64_t h = 0; h < index.groups; ++h) {
      before += rows[h] > mine || (rows[h] == mine && h < g);
    }
    by_rows[before] = static_cast<std::int32_t>(g);
  }
  __syncthreads();
}

// Group g's M-tiles: its rows' (forward, dgrad), or out_features' when it has rows (wgrad).
template <GroupedPass pass>
__device__ std::int64_t group_m_tiles(const GroupIndex& index, const GroupedOperands& op,
                                      std::int64_t g) {
  const std::int64_t rows = index.offsets[g + 1] - index.offsets[g];
  if constexpr (pass == GroupedPass::kWgrad) {
    return rows == 0 ? 0 : ceil_tiles(op.out_features, kTileM);
  } else {
    return ceil_tiles(rows, kTileM);
  }
}

// Sums of one class's segments and tiles, packed as count << 32 | tiles (the host keeps the
// tiles below 2^32), for one block scan of both classes.
struct ClassSums {
  std::uint64_t heavy;
  std::uint64_t light;
};

struct AddClassSums {
  __device__ ClassSums operator()(const ClassSums& a, const ClassSums& b) const {
    return {a.heavy + b.heavy, a.light + b.light};
  }
};

// Segments and claims (or tiles) packed as count << 32 | claims, one 64-bit sum for a block scan.
__device__ inline std::uint32_t packed_count(std::uint64_t packed) {
  return static_cast<std::uint32_t>(packed >> 32);
}
__device__ inline std::uint32_t packed_claims(std::uint64_t packed) {
  return static_cast<std::uint32_t>(packed);
}

// Where a segment falls in its class's run of tiles: the middle of its tiles, as a fraction of the
// class's tiles. `list` is one class's segments with first_claim counted within the class (forward
// and dgrad claim one tile at a time).
__device__ inline double class_position(const TileSegment& s, std::int32_t n_tiles,
                                        std::uint32_t class_tiles) {
  return (2.0 * s.first_claim + static_cast<double>(s.m_count) * n_tiles) / (2.0 * class_tiles);
}

// How many of `list`'s `count` segments come before `position` (at or before it when
// `ties_before`), by binary search: their positions grow along the list.
__device__ inline std::uint32_t segments_before(const TileSegment* list, std::uint32_t count,
                                                double position, bool ties_before,
                                                std::int32_t n_tiles, std::uint32_t class_tiles) {
  std::uint32_t low = 0, high = count;
  while (low < high) {
    const std::uint32_t mid = (low + high) / 2;
    const double at = class_position(list[mid], n_tiles, class_tiles);
    if (at < position || (ties_before && at == position)) {
      low = mid + 1;
    } else {
      high = mid;
    }
  }
  return low;
}

// Forward and dgrad tiles of a group with m M-tiles read 1/m of its weight's column (256 x K
// elements) each. On an H100 (3.35 TB/s beside about 990 TFLOP/s) a tile's MMAs last as long as
// one SM's share of HBM takes to read about 220 x K bytes, so the tiles of groups with at most 2
// M-tiles wait on HBM, and a stretch of them in a row leaves the tensor cores idle while the
// large groups' tiles leave HBM idle. interleave_heavy spreads them out. Measured against "fewer
// M-tiles than the mean" and at most 1 or 4 (experiment 39): 2 and 1 were best, the mean lost up
// to 2% on 16 x 2048 skewed.
constexpr std::int64_t kHeavyMTiles = 2;

// Spreads the segments of heavy groups (kHeavyMTiles) evenly among the others'. Each class keeps
// its group order; the two are merged by the position of each segment within its class. Run by
// one whole block on the group-ordered segments of write_tile_order; writes them back merged.
template <GroupedPass pass>
__device__ void interleave_heavy(const GroupIndex& index, const GroupedOperands& op,
                                 const TileOrder& order, std::uint32_t count, TileSegment* scratch,
                                 std::int32_t n_tiles) {
  using Scan = cub::BlockScan<ClassSums, kIndexThreads>;
  __shared__ typename Scan::TempStorage storage;
  // Heavy, light.
  TileSegment* lists[2] = {scratch, scratch + segment_capacity(pass, index.groups)};
  ClassSums carry{0, 0};
  for (std::uint32_t base = 0; base < count; base += kIndexThreads) {
    const std::uint32_t s = base + threadIdx.x;
    TileSegment segment{};
    bool heavy = false;
    ClassSums mine{0, 0};
    if (s < count) {
      segment = order.segments[s];
      const std::uint64_t packed =
          (std::uint64_t{1} << 32) | static_cast<std::uint32_t>(segment.m_count * n_tiles);
      heavy = group_m_tiles<pass>(index, op, segment.group) <= kHeavyMTiles;
      (heavy ? mine.heavy : mine.light) = packed;
    }
    ClassSums before, chunk;
    Scan(storage).ExclusiveScan(mine, before, ClassSums{0, 0}, AddClassSums{}, chunk);
    __syncthreads();
    if (s < count) {
      const std::uint64_t at = heavy ? carry.heavy + before.heavy : carry.light + before.light;
      segment.first_claim = packed_claims(at);
      lists[heavy ? 0 : 1][packed_count(at)] = segment;
    }
    carry = AddClassSums{}(carry, chunk);
  }
  __syncthreads();
  const std::uint32_t counts[2] = {packed_count(carry.heavy), packed_count(carry.light)};
  const std::uint32_t tiles[2] = {packed_claims(carry.heavy), packed_claims(carry.light)};
  for (int c = 0; c < 2; ++c) {
    const int other = 1 - c;
    for (std::uint32_t i = threadIdx.x; i < counts[c]; i += kIndexThreads) {
      TileSegment segment = lists[c][i];
      const double position = class_position(segment, n_tiles, tiles[c]);
      // Ties: the heavy segment first.
      const std::uint32_t j =
          segments_before(lists[other], counts[other], position, c == 1, n_tiles, tiles[other]);
      const std::uint32_t other_tiles =
          j == 0 ? 0
                 : lists[other][j - 1].first_claim +
                       static_cast<std::uint32_t>(lists[other][j - 1].m_count * n_tiles);
      segment.first_claim += other_tiles;
      order.segments[i + j] = segment;
    }
  }
}

// Tiles of the weight gradient contract their group's rows, in k-steps of 64: a group with few rows
// has tiles that are mostly their loads' latency and their epilogue. A claim takes enough of them
// for kClaimKSteps k-steps, so that the loads run ahead through the claim's tiles (of one group:
// no TMA descriptor changes between them), up to kMaxTilesPerClaim, which bounds what a CTA holds
// when the others run out. Forward and dgrad tiles contract a whole feature dimension and are
// claimed one at a time. Experiment 47 (one H100, against claims of one tile in the same run):
// skewed Qwen3 1.12-1.13 -> 1.15 of torch in two runs; the other shapes moved within noise.
// Experiment 48 found the gain elsewhere than predicted: the tiles of 1-2 k-steps take as long
// with any claim size (their epilogue's writes bound them); the groups of 3-7 k-steps, which
// claim 2-3 tiles, were not measured apart.
constexpr std::int64_t kClaimKSteps = 8;
constexpr std::int64_t kMaxTilesPerClaim = 4;

template <GroupedPass pass>
__device__ std::int64_t tiles_per_claim(const GroupIndex& index, std::int64_t g) {
  if constexpr (pass == GroupedPass::kWgrad) {
    const std::int64_t rows = index.offsets[g + 1] - index.offsets[g];
    const std::int64_t k_steps = max(ceil_tiles(rows, kTileK), std::int64_t{1});
    return min(ceil_tiles(kClaimKSteps, k_steps), kMaxTilesPerClaim);
  } else {
    return 1;
  }
}

// Forward and dgrad: how many of the order's last `tiles` tiles are split (split_tail_tiles), and
// every slot's flags cleared. Run by one whole block.
__device__ inline void write_split_tiles(const TileOrder& order, const OrderPlan& plan,
                                         std::uint32_t tiles) {
  if (threadIdx.x == 0) {
    *order.split_tiles = split_tail_tiles(tiles, plan.split_sms, plan.k_tiles);
  }
  for (std::uint32_t i = threadIdx.x; i < split_capacity(plan.split_sms) * kConsumerWarps;
       i += blockDim.x) {
    order.partial_ready[i] = 0;
  }
}

// Writes the order in which the GEMM's CTAs claim their tiles (sm90_claiming_scheduler.cuh): the
// groups by decreasing rows (order_by_rows), each cut into segments of `strip` M-tiles, then for
// forward and dgrad the heavy groups spread among the others (interleave_heavy); the weight
// gradient's groups one segment each, several tiles a claim where they are short
// (tiles_per_claim). Run by one whole block, after the group index.
template <GroupedPass pass>
__device__ void write_tile_order(const GroupIndex& index, const GroupedOperands& op,
                                 const TileOrder& order, const OrderPlan& plan,
                                 TileSegment* scratch) {
  __shared__ std::int32_t by_rows[kSortedGroups];
  const bool sorted = index.groups <= kSortedGroups;
  if (sorted) order_by_rows(index, by_rows);
  using Scan = cub::BlockScan<std::uint64_t, kIndexThreads>;
  __shared__ typename Scan::TempStorage storage;
  std::uint64_t carry = 0;  // segments << 32 | claims
  bool any_heavy = false;
  for (std::int64_t base = 0; base < index.groups; base += kIndexThreads) {
    const std::int64_t position = base + threadIdx.x;
    const std::int64_t g = position >= index.groups ? -1 : sorted ? by_rows[position] : position;
    const std::int64_t m_tiles = g < 0 ? 0 : group_m_tiles<pass>(index, op, g);
    const std::int64_t strips = ceil_tiles(m_tiles, plan.strip);
    const std::int64_t per_claim = g < 0 ? 1 : tiles_per_claim<pass>(index, g);
    // Every strip but the last has plan.strip M-tiles.
    auto strip_claims = [&](std::int64_t j) {
      return ceil_tiles(min(plan.strip, m_tiles - j * plan.strip) * plan.n_tiles, per_claim);
    };
    const std::int64_t claims =
        strips == 0 ? 0 : (strips - 1) * strip_claims(0) + strip_claims(strips - 1);
    const std::uint64_t mine =
        static_cast<std::uint64_t>(strips) << 32 | static_cast<std::uint64_t>(claims);
    std::uint64_t before, chunk;
    Scan(storage).ExclusiveSum(mine, before, chunk);
    any_heavy |= __syncthreads_or(m_tiles > 0 && m_tiles <= kHeavyMTiles) != 0;
    const std::uint64_t at = carry + before;
    for (std::int64_t j = 0; j < strips; ++j) {
      order.segments[packed_count(at) + j] = {
          packed_claims(at) + static_cast<std::uint32_t>(j * strip_claims(0)),
          static_cast<std::int32_t>(g), static_cast<std::int32_t>(j * plan.strip),
          static_cast<std::int32_t>(min(plan.strip, m_tiles - j * plan.strip)),
          static_cast<std::int32_t>(per_claim)};
    }
    carry += chunk;
  }
  if (threadIdx.x == 0) {
    order.segments[packed_count(carry)] = {packed_claims(carry), -1, 0, 0, 1};
    *order.count = packed_count(carry);
    *order.claimed = 0;
  }
  __syncthreads();
  // Without heavy groups the merge would leave the order as it is: the table kernel, which every
  // call waits for, skips its passes over the segments (16 groups on an H100: 4.3 -> 3.5 us).
  if (pass != GroupedPass::kWgrad && any_heavy) {
    interleave_heavy<pass>(index, op, order, packed_count(carry), scratch, plan.n_tiles);
    __syncthreads();
  }
  if (pass != GroupedPass::kWgrad && order.split_tiles != nullptr) {
    // Forward and dgrad claim one tile at a time: claims are tiles.
    write_split_tiles(order, plan, packed_claims(carry));
  }
}

inline void check_cutlass(cutlass::Status status, const char* what) {
  MESHLA_CHECK(kInternal, status == cutlass::Status::kSuccess,
               "CUTLASS grouped GEMM " << what << " failed: " << cutlassGetStatusString(status));
}

// Forward and dgrad: M-tiles per segment of the tile order, for n_tiles N-tiles, a contraction of
// k, and at most m_tiles_bound M-tiles over all groups. A strip's rows stay in L2 while its
// N-tiles pass over them: they fill at most a quarter of it, and the strip is at least a wave of
// tiles, so that the weight it reads again serves a wave. Whole groups read their rows once per
// N-tile when those exceed L2 (the largest skewed Qwen3 group: 72 MB, 6 N-tiles). Measured in
// experiment 39: strips of one wave alone made DeepSeek's dgrad (28 N-tiles, 5 M-tiles a wave)
// read its weight once per 5 M-tiles, 2% slower than a quarter or half of L2; half of L2 or more
// lost 1.5-5% on skewed Qwen3.
inline std::int64_t strip_m_tiles(std::int32_t n_tiles, std::int64_t k, std::int64_t m_tiles_bound,
                                  int sm_count, int l2_bytes) {
  const std::int64_t m_tile_bytes = kTileM * k * 2;  // 16-bit elements
  return std::max({ceil_tiles(sm_count, n_tiles), std::int64_t{l2_bytes} / 4 / m_tile_bytes,
                   ceil_tiles(m_tiles_bound, kStripBudget)});
}

}  // namespace meshla::gemm
