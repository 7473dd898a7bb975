// A tile scheduler for meshla's CUTLASS grouped kernels without clusters, and the mainloop that
// goes with it. CUTLASS's group scheduler deals tile i to CTA i mod grid, group by group, M-tiles
// fastest; here the CTAs claim tiles from a counter in device memory as they free up, in an order
// the table kernel writes (TileOrder), and the weight gradient's last k-tile runs only the
// k-blocks that hold its group's rows (TrimmedTileMainloop).
// - Claims: the weight gradient's tiles are not equal (each contracts its group's rows), so on a
//   skewed routing the static deal gave some CTAs several times the work of others (16 x 2048
//   skewed: the slowest CTA's share modelled at 1.59x the mean; experiment 38). Forward and dgrad
//   tiles of small groups wait on HBM for their weights longer than large groups' tiles. A claim
//   of the weight gradient takes several tiles of a group with few rows (experiment 47).
// - Order: runs of M-tiles (segments) instead of whole groups, so that a large group's rows are
//   read once per strip that L2 holds, not once per N-tile, and the small groups spread among
//   the large ones (experiment 39); the largest groups go first so that the small ones even out
//   the end (experiments 38 and 55).
// - No half tiles: a group's last M-tile of at most 64 rows runs whole. With the second consumer
//   warpgroup idle on such tiles (experiment 40) the forward at K = 7168 ran 7-9% slower than
//   with them whole, and gained nowhere at the power limit (experiment 57).
// - Trimmed k-tails: the weight gradient contracts its group's rows; the last k-tile's MMAs past
//   them would multiply TMA's zero fill (experiment 51).
// - Split last tiles: forward and dgrad claim the order's last tiles in two halves of their
//   k-tiles each, so that a nearly empty last wave ends half a tile sooner (experiment 54).
// - Arrivals: all_gather_matmul's one-launch GEMM holds each tile until its group has landed
//   (TileOrder::landed).
// - The next kernel: a CTA out of tiles lets it launch (programmatic dependent launch).
// Included by sm90_grouped_gemm.cuh.
#pragma once

#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/sm90_tile_scheduler_group.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

#include <cstdint>

#include "gemm/sm90_tile_marks.hpp"

namespace meshla::gemm {

// Claim indices [first_claim, next segment's first_claim) of one group: M-tiles m_first ..
// m_first + m_count - 1 of every N-tile, M-tiles fastest, per_claim tiles a claim (the last claim
// takes what is left).
struct TileSegment {
  std::uint32_t first_claim;
  std::int32_t group;
  std::int32_t m_first;
  std::int32_t m_count;
  std::int32_t per_claim;
};

// Written by the table kernel before each launch: segments[0, *count) in claim order, then one
// whose first_claim is the total number of claims; *claimed zero.
struct TileOrder {
  TileSegment* segments = nullptr;
  std::uint32_t* count = nullptr;
  std::uint32_t* claimed = nullptr;  // claims taken after each CTA's first
  // all_gather_matmul's one-launch GEMM (collective/symmetric/sm90_gathered_gemm.cu), whose groups
  // are rank blocks that land while it runs: per group, a flag that turns nonzero once the group's
  // rows have landed (nullptr: present from the start), and how long a warp waits for one before it
  // traps. nullptr for the grouped GEMM.
  const std::uint32_t* const* landed = nullptr;
  std::uint64_t landed_timeout_ns = 0;
  // Forward and dgrad (nullptr elsewhere): the order's last *split_tiles tiles are each claimed
  // twice, first for the first half of their k-tiles, then for the rest. The first half leaves
  // its accumulators in its slot of `partials` (one tile's, TileM x TileN floats, per slot; a
  // slot per split tile, in order) and sets the slot's flags (one per consumer warp) in
  // partial_ready, which the table kernel clears before each launch; the second half adds them
  // and stores the tile.
  std::uint32_t* split_tiles = nullptr;
  float* partials = nullptr;
  std::uint32_t* partial_ready = nullptr;
};

// A split tile's slot has a flag per consumer warp: each warp hands its own accumulators on.
constexpr int kConsumerWarps = 8;

// CUTLASS's grouped problem shape plus the tile order. Being its own type, it selects
// ClaimingScheduler (the TileSchedulerSelector specialization below).
struct ClaimedProblemShape : cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>> {
  TileOrder order;
};

// Each warp notes its current tile's mark (TileMark) in tile_marks for TrimmedTileMainloop. The
// marks are static shared memory, which comes before CUTLASS's dynamic shared memory: they take
// 1024 bytes so that its tiles keep the 1024-byte alignment of their swizzle.
alignas(1024) static __shared__ std::int32_t tile_marks[256];

// Constructed before the scheduler's base, which reads the problem shapes. The GEMM launches as a
// programmatic dependent of the table kernel; here it waits for that kernel to finish and its
// tables to be visible (at once when launched without the dependency).
struct AfterTableKernel {
  CUTLASS_DEVICE AfterTableKernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  }
};

// Called by a whole warp; returns once *flag is nonzero, after which the warp's loads (and the TMA
// loads it hands the tile to) see the rows the flag announces. Traps after `timeout_ns`, so that a
// rank that died does not hang its peers forever: the launch then fails and the CUDA context is
// lost. No printf says so: a call anywhere in the kernel makes ptxas serialize every wgmma
// (warning C7510).
CUTLASS_DEVICE void await_landed(const std::uint32_t* flag, std::uint64_t timeout_ns) {
  if (cutlass::canonical_lane_idx() == 0) {
    std::uint64_t start = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    for (;;) {
      std::uint32_t value = 0;
      asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
      if (value != 0) break;
      std::uint64_t now = 0;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      if (now - start > timeout_ns) __trap();
      __nanosleep(256);
    }
    // TMA reads through the async proxy: order its reads of the rows after the flag's.
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }
  __syncwarp();
}

// CUTLASS's group scheduler with claimed, ordered tiles. Every warp of a CTA computes its first
// tile, the first of the claim whose index is the CTA's linear block index, itself; the scheduler
// warp hands the others every later tile through a shared-memory pipeline: the rest of the
// current claim's tiles at once, then the first of a new claim. It claims only once the CTA has
// taken the tile handed on before (every consumer released its slot), so a CTA holds its running
// tile and one more, enough for the loads to run ahead, and leaves the rest to whichever CTA
// frees first. A claim of several tiles (short ones: TileSegment::per_claim) lets the loads run
// ahead through all of them.
template <int Stages, int TileM, int TileN, int TileK>
class ClaimingScheduler
    : private AfterTableKernel,
      public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<ClaimedProblemShape,
                                                                             Stages> {
  using Base =
      cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<ClaimedProblemShape, Stages>;
  using WorkTileInfo = typename Base::WorkTileInfo;

 public:
  using Params = typename Base::Params;

  CUTLASS_DEVICE ClaimingScheduler(Params const& params, typename Base::SchedulerResponse* response)
      : AfterTableKernel(),
        Base(params, response),
        order_(params.problem_shapes_.order),
        grid_size_(gridDim.x * gridDim.y * gridDim.z),
        count_(*order_.count),
        total_(order_.segments[count_].first_claim),
        split_(order_.split_tiles == nullptr ? 0 : *order_.split_tiles) {}

  // The k-tiles of a split tile's half (TileMark::halved); a whole tile's otherwise.
  template <class ProblemShapeMNKL, class TileShape>
  CUTLASS_HOST_DEVICE static int get_work_k_tile_count(WorkTileInfo const& work,
                                                       ProblemShapeMNKL problem_shape,
                                                       TileShape tile_shape) {
    const int k_tiles = Base::get_work_k_tile_count(work, problem_shape, tile_shape);
    if (!TileMark::split(work.is_valid_tile)) return k_tiles;
    const int k_split = TileMark::k_split(work.is_valid_tile);
    return TileMark::second_half(work.is_valid_tile) ? k_tiles - k_split : k_split;
  }

  CUTLASS_HOST_DEVICE static std::uint32_t get_work_k_tile_start(WorkTileInfo const& work) {
    return TileMark::second_half(work.is_valid_tile)
               ? static_cast<std::uint32_t>(TileMark::k_split(work.is_valid_tile))
               : 0u;
  }

  // A split tile's first half stores nothing: its second half stores the sum.
  CUTLASS_HOST_DEVICE static bool compute_epilogue(WorkTileInfo const& work, Params const&) {
    return !TileMark::split(work.is_valid_tile) || TileMark::second_half(work.is_valid_tile);
  }

  // Called by every consumer thread once its tile's MMAs are done. A split tile's first half
  // hands its accumulators on through its slot, warp by warp; the second half waits for each of
  // its warps' share and adds it. The first half was claimed before the second, by a CTA that
  // runs (CTAs claim only while they run), and every such wait is for an earlier claim, so the
  // waits end. The halves add in the same order on every call: results repeat bit for bit.
  template <class FrgTensorC>
  CUTLASS_DEVICE static void fixup(Params const& params, WorkTileInfo const& work,
                                   FrgTensorC& accumulators, std::uint32_t /*warp_groups*/,
                                   std::uint32_t warp_group) {
    const std::int32_t mark = work.is_valid_tile;
    if (!TileMark::split(mark)) return;
    constexpr int kValues = decltype(cute::size(accumulators))::value;
    static_assert(kValues % 4 == 0 && kValues * 32 * kConsumerWarps == TileM * TileN,
                  "each consumer warp holds an equal share of the tile's accumulators");
    const TileOrder& order = params.problem_shapes_.order;
    const std::uint32_t warp = warp_group * 4 + cutlass::canonical_warp_idx_sync() % 4;
    const std::uint32_t flag = TileMark::slot(mark) * kConsumerWarps + warp;
    const int lane = cutlass::canonical_lane_idx();
    // The warp's share, float4 by float4, each lane's interleaved with the others' (coalesced).
    auto* share = reinterpret_cast<float4*>(order.partials) + flag * (kValues / 4 * 32) + lane;
    if (!TileMark::second_half(mark)) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kValues / 4; ++i) {
        __stcg(share + i * 32, make_float4(accumulators(4 * i), accumulators(4 * i + 1),
                                           accumulators(4 * i + 2), accumulators(4 * i + 3)));
      }
      __threadfence();
      __syncwarp();
      if (lane == 0) {
        asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(order.partial_ready + flag),
                     "r"(1u)
                     : "memory");
      }
      return;
    }
    // The whole wait in one asm statement: as a C++ loop around the accumulators, ptxas spilled
    // registers of every tile's path (8 bytes: Qwen3's forward 1-2% slower, experiment 54).
    asm volatile(
        "{\n"
        ".reg .pred ready;\n"
        ".reg .u32 value;\n"
        "WAIT_%=:\n"
        "ld.acquire.gpu.global.u32 value, [%0];\n"
        "setp.ne.u32 ready, value, 0;\n"
        "@!ready bra WAIT_%=;\n"
        "}\n" ::"l"(order.partial_ready + flag)
        : "memory");
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kValues / 4; ++i) {
      const float4 part = __ldcg(share + i * 32);
      accumulators(4 * i) += part.x;
      accumulators(4 * i + 1) += part.y;
      accumulators(4 * i + 2) += part.z;
      accumulators(4 * i + 3) += part.w;
    }
  }

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    const WorkTileInfo work =
        first_of_claim(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
    note(work);
    return work;
  }

  template <class Pipeline, class PipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work, Pipeline& pipeline, PipelineState state) {
    const auto next = Base::fetch_next_work(work, pipeline, state);
    note(cute::get<0>(next));
    return next;
  }

  template <class Pipeline, class PipelineState>
  CUTLASS_DEVICE auto advance_to_next_work(Pipeline& pipeline, PipelineState state,
                                           std::uint32_t /*advance_count*/ = 1) {
    WorkTileInfo work;
    if (next_in_claim_ < claim_end_) {
      work = tile_at(next_in_claim_++);
    } else {
      if (handed_on_) {
        // The slot of the tile handed on last is free again once every consumer has taken it.
        PipelineState reuse = last_handed_;
        reuse.advance(Stages);
        pipeline.producer_acquire(reuse);
      }
      std::uint32_t claim = 0;
      if (cutlass::canonical_lane_idx() == 0) claim = atomicAdd(order_.claimed, 1u);
      claim = __shfl_sync(0xffffffff, claim, 0);
      // Indices below the grid size are the CTAs' first claims; claims go on from there.
      work = first_of_claim(grid_size_ + claim);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      // Out of tiles: the next kernel on the stream may launch once every CTA has got here or
      // exited (a grouped GEMM's table kernel, which waits for this one to finish before it
      // touches memory).
      if (!work.is_valid()) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    }
    pipeline.producer_acquire(state);
    if (cute::elect_one_sync()) {
      this->response_ptr_[state.index()] = work;
      cutlass::arch::fence_view_async_shared();
      pipeline.producer_commit(state);
    }
    last_handed_ = state;
    handed_on_ = true;
    return cute::make_tuple(work, true);
  }

 private:
  // The first tile of claim index `claim`, after which [next_in_claim_, claim_end_) are the
  // claim's other tiles; called by whole warps. A warp's indices only grow, so the search for the
  // segment goes on from the last one found, 32 segments a step.
  CUTLASS_DEVICE WorkTileInfo first_of_claim(std::uint32_t claim) {
    if (claim >= total_ + split_) {
      next_in_claim_ = claim_end_;
      return WorkTileInfo::invalid_work_tile();
    }
    // Claims past the order's unsplit tiles take the split tiles' halves in turn; their claims
    // hold one tile each (forward and dgrad).
    const std::uint32_t first_split = total_ - split_;
    const bool halved = claim >= first_split;
    const std::uint32_t slot = halved ? (claim - first_split) / 2 : 0;
    const bool second = halved && (claim - first_split) % 2 == 1;
    if (halved) claim = first_split + slot;
    for (;;) {
      // Lane i asks whether the segment i + 1 past the cursor starts at or before `claim`; those
      // that do are a prefix of the lanes, since first_claim grows and the last segment's is the
      // total.
      const std::uint32_t next = segment_ + 1 + cutlass::canonical_lane_idx();
      const bool passed = next <= count_ && order_.segments[next].first_claim <= claim;
      const std::uint32_t lanes = __ballot_sync(0xffffffff, passed);
      segment_ += __popc(lanes);
      if (lanes != 0xffffffffu) break;
    }
    current_ = order_.segments[segment_];
    // all_gather_matmul's order takes the groups one after another: a warp waits once for each.
    if (order_.landed != nullptr && current_.group != awaited_group_) {
      const std::uint32_t* flag = order_.landed[current_.group];
      if (flag != nullptr) await_landed(flag, order_.landed_timeout_ns);
      awaited_group_ = current_.group;
    }
    const auto shape = this->scheduler_params.problem_shapes_.get_problem_shape(current_.group);
    k_residue_ = cute::get<2>(shape) % TileK;
    const auto n_tiles = static_cast<std::uint32_t>((cute::get<1>(shape) + TileN - 1) / TileN);
    const auto per_claim = static_cast<std::uint32_t>(current_.per_claim);
    const std::uint32_t first = (claim - current_.first_claim) * per_claim;
    next_in_claim_ = first + 1;
    claim_end_ = min(first + per_claim, static_cast<std::uint32_t>(current_.m_count) * n_tiles);
    WorkTileInfo work = tile_at(first);
    if (halved) {
      const int k_tiles = static_cast<int>((cute::get<2>(shape) + TileK - 1) / TileK);
      work.is_valid_tile = TileMark::halved(work.is_valid_tile, second, k_tiles / 2, slot);
    }
    return work;
  }

  // Tile `local` of the current segment, M-tiles fastest.
  CUTLASS_DEVICE WorkTileInfo tile_at(std::uint32_t local) const {
    const auto m_count = static_cast<std::uint32_t>(current_.m_count);
    const std::int32_t m = current_.m_first + static_cast<std::int32_t>(local % m_count);
    return {m, static_cast<std::int32_t>(local / m_count), current_.group,
            TileMark::of(k_residue_)};
  }

  CUTLASS_DEVICE static void note(const WorkTileInfo& work) {
    tile_marks[cutlass::canonical_warp_idx_sync()] = work.is_valid_tile;
  }

  TileOrder order_;
  std::uint32_t grid_size_;
  std::uint32_t count_;
  std::uint32_t total_;
  std::uint32_t split_;  // the order's last split_ tiles are claimed in halves
  std::uint32_t segment_ = 0;
  TileSegment current_{};  // segments[segment_]
  int k_residue_ = 0;      // current_'s group's K mod TileK
  std::uint32_t next_in_claim_ = 0;
  std::uint32_t claim_end_ = 0;
  std::int32_t awaited_group_ = -1;
  typename Base::PipelineState last_handed_{};
  bool handed_on_ = false;
};

// CUTLASS's ptr-array mainloop for the weight gradient, whose tiles contract their group's rows:
// where a tile's mark (TileMark) has a K residue, the last k-tile runs only the k-blocks that hold
// some of K, not the MMAs of TMA's zero fill past them. Skewed Qwen3's weight gradient runs 4.4%
// fewer MMAs so, and gains 0.7-1.1% at the power limit (experiment 51): MMAs of zeros cost less
// energy than others, but not none.
template <class Mainloop>
struct TrimmedTileMainloop : Mainloop {
  using PipelineState = typename Mainloop::PipelineState;

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(typename Mainloop::MainloopPipeline pipeline, PipelineState read,
                          FrgTensorC& accumulators, int k_tile_count, int thread_idx,
                          typename Mainloop::TensorStorage& shared_tensors,
                          typename Mainloop::Params const& params) {
    const int k_residue = TileMark::k_residue(tile_marks[cutlass::canonical_warp_idx_sync()]);
    // With a residue, the whole k-tiles as CUTLASS runs them (their last stage left unreleased,
    // its MMAs perhaps in flight), then the last one.
    const bool trimmed = k_tile_count >= 1 && k_residue != 0;
    const int whole = trimmed ? k_tile_count - 1 : k_tile_count;
    Mainloop::mma(pipeline, read, accumulators, whole, thread_idx, shared_tensors, params);
    if (!trimmed) return;
    const int warp_group = __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    PipelineState last = read;
    last.advance(whole);
    mma_last_k_tile(pipeline, last, accumulators, k_residue, whole == 0, warp_group,
                    shared_tensors);
    if (whole > 0) {
      // The k-tile before the last is done once at most the last one's MMAs are in flight; its
      // stage goes back to the producer, as Mainloop::mma would have released it. mma_tail
      // releases the last.
      cute::warpgroup_wait<1>();
      cute::warpgroup_fence_operand(accumulators);
      PipelineState previous = read;
      previous.advance(whole - 1);
      pipeline.consumer_release(previous);
    }
  }

 private:
  // The MMAs of the k-blocks of stage `last` that hold any of the first k_residue elements of
  // the k-tile, as Mainloop::mma runs a k-tile's (zeroing the accumulators first where `first`).
  // Each count of k-blocks has its own unrolled run: a wgmma under a branch of its own, or in a
  // loop, makes ptxas serialize every wgmma of the kernel (C7515).
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma_last_k_tile(typename Mainloop::MainloopPipeline pipeline,
                                      PipelineState last, FrgTensorC& accumulators, int k_residue,
                                      bool first, int warp_group,
                                      typename Mainloop::TensorStorage& shared_tensors) {
    using namespace cute;
    using TiledMma = typename Mainloop::TiledMma;
    Tensor sA =
        make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), typename Mainloop::SmemLayoutA{});
    Tensor sB =
        make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), typename Mainloop::SmemLayoutB{});
    constexpr int kWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    const auto warp_groups =
        make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_slice(warp_groups(warp_group));
    Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));  // (MMA,M,K,PIPE)
    Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));  // (MMA,N,K,PIPE)
    constexpr int kBlocks = decltype(size<2>(tCrA))::value;
    constexpr int kBlockK = decltype(size<1>(sA))::value / kBlocks;  // (BLK_M, BLK_K, PIPE)
    static_assert(kBlocks == 4, "a k-tile of 4 k-blocks");
    const int blocks = (k_residue + kBlockK - 1) / kBlockK;

    pipeline.consumer_wait(last, pipeline.consumer_try_wait(last));
    const int stage = last.index();
    tiled_mma.accumulate_ = first ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
    warpgroup_fence_operand(accumulators);
    auto run = [&](auto count) {
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int k_block = 0; k_block < decltype(count)::value; ++k_block) {
        cute::gemm(tiled_mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), accumulators);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
    };
    switch (blocks) {
      case 1:
        run(Int<1>{});
        break;
      case 2:
        run(Int<2>{});
        break;
      case 3:
        run(Int<3>{});
        break;
      default:
        run(Int<4>{});
        break;
    }
    warpgroup_fence_operand(accumulators);
  }
};

}  // namespace meshla::gemm

namespace cutlass::gemm::kernel::detail {

template <class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<GroupScheduler, arch::Sm90, TileShape, ClusterShape,
                             SchedulerPipelineStageCount, meshla::gemm::ClaimedProblemShape> {
  // A claim is one CTA's: a cluster's CTAs would have to claim together.
  static_assert(decltype(cute::size(ClusterShape{}))::value == 1,
                "ClaimingScheduler runs without clusters");
  using Scheduler = meshla::gemm::ClaimingScheduler<
      SchedulerPipelineStageCount, decltype(cute::size<0>(TileShape{}))::value,
      decltype(cute::size<1>(TileShape{}))::value, decltype(cute::size<2>(TileShape{}))::value>;
};

}  // namespace cutlass::gemm::kernel::detail
