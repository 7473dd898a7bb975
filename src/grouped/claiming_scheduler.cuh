// A tile scheduler for meshla's CUTLASS grouped kernels without clusters, and the mainloop that
// goes with it. CUTLASS's group scheduler deals tile i to CTA i mod grid, group by group, M-tiles
// fastest; here the CTAs claim tiles from a counter in device memory as they free up, in an order
// the table kernel writes (TileOrder), and a tile whose rows all lie in its first half leaves the
// second consumer warpgroup idle (HalfTileMainloop).
// - Claims: the weight gradient's tiles are not equal (each contracts its group's rows), so on a
//   skewed routing the static deal gave some CTAs several times the work of others (16 x 2048
//   skewed: the slowest CTA's share modelled at 1.59x the mean; experiment 38). Forward and dgrad
//   tiles of small groups wait on HBM for their weights longer than large groups' tiles. A claim
//   of the weight gradient takes several tiles of a group with few rows (experiment 47).
// - Order: runs of M-tiles (segments) instead of whole groups, so that a large group's rows are
//   read once per strip that L2 holds, not once per N-tile, and the small groups spread among
//   the large ones (experiment 39); the weight gradient's largest groups go first so that the
//   small ones even out the end.
// - Half tiles: a group's last M-tile with 64 rows or fewer (experiment 40).
// - Arrivals: all_gather_matmul's one-launch GEMM holds each tile until its group has landed
//   (TileOrder::landed).
// - The next kernel: a CTA out of tiles lets it launch (programmatic dependent launch).
// Included by cutlass_grouped.cuh.
#pragma once

#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/sm90_tile_scheduler_group.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

#include <cstdint>

namespace meshla::grouped {

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
  // all_gather_matmul's one-launch GEMM (overlap/gathered_gemm.cu), whose groups are rank blocks
  // that land while it runs: per group, a flag that turns nonzero once the group's rows have
  // landed (nullptr: present from the start), and how long a warp waits for one before it traps.
  // nullptr for the grouped GEMM.
  const std::uint32_t* const* landed = nullptr;
  std::uint64_t landed_timeout_ns = 0;
};

// CUTLASS's grouped problem shape plus the tile order. Being its own type, it selects
// ClaimingScheduler (the TileSchedulerSelector specialization below).
struct ClaimedProblemShape : cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>> {
  TileOrder order;
};

// A tile's second consumer warpgroup owns its rows 64-127 (CUTLASS's cooperative tiled MMA stacks
// the two warpgroups' 64-row atoms along M). When a group's last M-tile has 64 rows or fewer,
// that warpgroup has nothing to compute: the scheduler marks such tiles (is_valid_tile ==
// kUpperHalfOnly), and each warp notes its current tile's mark here for HalfTileMainloop.
// The flags are static shared memory, which comes before CUTLASS's dynamic shared memory: they
// take 1024 bytes so that its tiles keep the 1024-byte alignment of their swizzle.
constexpr std::int32_t kUpperHalfOnly = 2;
alignas(1024) static __shared__ bool upper_half_only[1024];

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
template <int Stages, int TileM, int TileN>
class ClaimingScheduler
    : private AfterTableKernel,
      public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<ClaimedProblemShape,
                                                                             Stages> {
  using Base =
      cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<ClaimedProblemShape, Stages>;
  using WorkTileInfo = typename Base::WorkTileInfo;

 public:
  CUTLASS_DEVICE ClaimingScheduler(typename Base::Params const& params,
                                   typename Base::SchedulerResponse* response)
      : AfterTableKernel(),
        Base(params, response),
        order_(params.problem_shapes_.order),
        grid_size_(gridDim.x * gridDim.y * gridDim.z),
        count_(*order_.count),
        total_(order_.segments[count_].first_claim) {}

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
    if (claim >= total_) {
      next_in_claim_ = claim_end_;
      return WorkTileInfo::invalid_work_tile();
    }
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
    rows_ = cute::get<0>(shape);
    const auto n_tiles = static_cast<std::uint32_t>((cute::get<1>(shape) + TileN - 1) / TileN);
    const auto per_claim = static_cast<std::uint32_t>(current_.per_claim);
    const std::uint32_t first = (claim - current_.first_claim) * per_claim;
    next_in_claim_ = first + 1;
    claim_end_ = min(first + per_claim, static_cast<std::uint32_t>(current_.m_count) * n_tiles);
    return tile_at(first);
  }

  // Tile `local` of the current segment, M-tiles fastest.
  CUTLASS_DEVICE WorkTileInfo tile_at(std::uint32_t local) const {
    const auto m_count = static_cast<std::uint32_t>(current_.m_count);
    const std::int32_t m = current_.m_first + static_cast<std::int32_t>(local % m_count);
    const bool upper_half = rows_ - m * TileM <= TileM / 2;
    return {m, static_cast<std::int32_t>(local / m_count), current_.group,
            upper_half ? kUpperHalfOnly : 1};
  }

  CUTLASS_DEVICE static void note(const WorkTileInfo& work) {
    upper_half_only[cutlass::canonical_warp_idx_sync()] = work.is_valid_tile == kUpperHalfOnly;
  }

  TileOrder order_;
  std::uint32_t grid_size_;
  std::uint32_t count_;
  std::uint32_t total_;
  std::uint32_t segment_ = 0;
  TileSegment current_{};  // segments[segment_]
  int rows_ = 0;           // of current_'s group
  std::uint32_t next_in_claim_ = 0;
  std::uint32_t claim_end_ = 0;
  std::int32_t awaited_group_ = -1;
  typename Base::PipelineState last_handed_{};
  bool handed_on_ = false;
};

// CUTLASS's ptr-array mainloop whose second warpgroup skips the MMAs of a tile marked
// kUpperHalfOnly: it still waits for each stage and releases it, as the producer counts on, but
// leaves the tensor cores to the first warpgroup, so such a tile takes about half the time.
template <class Mainloop>
struct HalfTileMainloop : Mainloop {
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(typename Mainloop::MainloopPipeline pipeline,
                          typename Mainloop::PipelineState read, FrgTensorC& accumulators,
                          int k_tile_count, int thread_idx,
                          typename Mainloop::TensorStorage& shared_tensors,
                          typename Mainloop::Params const& params) {
    const bool second_warpgroup =
        __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarpGroup, 0) == 1;
    if (!second_warpgroup || !upper_half_only[cutlass::canonical_warp_idx_sync()] ||
        k_tile_count < 1) {
      Mainloop::mma(pipeline, read, accumulators, k_tile_count, thread_idx, shared_tensors, params);
      return;
    }
    // One k-tile's MMAs still run: accumulators that only wgmma writes keep ptxas from serializing
    // every wgmma of the kernel (warning C7515, about 7% slower), and the epilogue's TMA store
    // drops these rows anyway, all past the group's last. Then release as Mainloop::mma does, one
    // stage behind; mma_tail releases the last.
    Mainloop::mma(pipeline, read, accumulators, 1, thread_idx, shared_tensors, params);
    cute::warpgroup_wait<0>();
    typename Mainloop::PipelineState release = read;
    ++read;
    for (int k = 1; k < k_tile_count; ++k) {
      pipeline.consumer_wait(read, pipeline.consumer_try_wait(read));
      ++read;
      pipeline.consumer_release(release);
      ++release;
    }
  }
};

}  // namespace meshla::grouped

namespace cutlass::gemm::kernel::detail {

template <class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<GroupScheduler, arch::Sm90, TileShape, ClusterShape,
                             SchedulerPipelineStageCount, meshla::grouped::ClaimedProblemShape> {
  // A claim is one CTA's: a cluster's CTAs would have to claim together.
  static_assert(decltype(cute::size(ClusterShape{}))::value == 1,
                "ClaimingScheduler runs without clusters");
  using Scheduler = meshla::grouped::ClaimingScheduler<SchedulerPipelineStageCount,
                                                       decltype(cute::size<0>(TileShape{}))::value,
                                                       decltype(cute::size<1>(TileShape{}))::value>;
};

}  // namespace cutlass::gemm::kernel::detail
