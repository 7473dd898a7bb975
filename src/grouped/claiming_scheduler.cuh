// A tile scheduler for the weight gradient's CUTLASS kernel: CTAs claim tiles from a counter in
// device memory as they free up, where CUTLASS's group scheduler deals tile i to CTA i mod grid.
// The weight gradient's tiles are not equal: each one contracts its group's rows, so on a skewed
// routing the static deal gave some CTAs several times the work of others (16 x 2048 skewed: the
// slowest CTA's share modelled at 1.59x the mean, the pass measured 1.35x slower than on uniform
// routing). Claimed in order of decreasing cost (fill_tables sorts the groups), the large tiles go
// first and the small ones even out the end. Included by cutlass_grouped.cuh.
#pragma once

#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/sm90_tile_scheduler_group.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

#include <cstdint>

namespace meshla::grouped {

// CUTLASS's grouped problem shape plus the claim counter. Being its own type, it selects
// ClaimingScheduler (the TileSchedulerSelector specialization below).
struct ClaimedProblemShape : cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>> {
  std::uint32_t* claimed = nullptr;  // tiles claimed after each CTA's first; zero at launch
};

// CUTLASS's group scheduler with claimed tiles. Every warp of a CTA computes its first tile, tile
// blockIdx, itself (the base's initial_work_tile_info); later tiles are claimed by the scheduler
// warp, which hands them to the others through a shared-memory pipeline. It claims the next tile
// only once the CTA has taken the one handed on before (every consumer released its slot), so a
// CTA holds its running tile and one more, enough for the loads to run ahead, and leaves the rest
// to whichever CTA frees first.
template <int Stages>
class ClaimingScheduler
    : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<ClaimedProblemShape,
                                                                             Stages> {
  using Base =
      cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<ClaimedProblemShape, Stages>;

 public:
  CUTLASS_DEVICE ClaimingScheduler(typename Base::Params const& params,
                                   typename Base::SchedulerResponse* response)
      : Base(params, response), grid_size_(std::uint64_t(gridDim.x) * gridDim.y * gridDim.z) {}

  template <class Pipeline, class PipelineState>
  CUTLASS_DEVICE auto advance_to_next_work(Pipeline& pipeline, PipelineState state,
                                           std::uint32_t /*advance_count*/ = 1) {
    if (handed_on_) {
      // The slot of the tile handed on last is free again once every consumer has taken it.
      PipelineState reuse = last_handed_;
      reuse.advance(Stages);
      pipeline.producer_acquire(reuse);
    }
    std::uint32_t claim = 0;
    if (cutlass::canonical_lane_idx() == 0) {
      claim = atomicAdd(this->scheduler_params.problem_shapes_.claimed, 1u);
    }
    claim = __shfl_sync(0xffffffff, claim, 0);
    // Indices below the grid size are the CTAs' first tiles; claims go on from there, increasing,
    // as the base's group search needs.
    const auto work = this->get_current_work_for_linear_idx(grid_size_ + claim);
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
  std::uint64_t grid_size_;
  typename Base::PipelineState last_handed_{};
  bool handed_on_ = false;
};

}  // namespace meshla::grouped

namespace cutlass::gemm::kernel::detail {

template <class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<GroupScheduler, arch::Sm90, TileShape, ClusterShape,
                             SchedulerPipelineStageCount, meshla::grouped::ClaimedProblemShape> {
  // A claim is one CTA's: a cluster's CTAs would have to claim together.
  static_assert(decltype(cute::size(ClusterShape{}))::value == 1,
                "ClaimingScheduler runs without clusters");
  using Scheduler = meshla::grouped::ClaimingScheduler<SchedulerPipelineStageCount>;
};

}  // namespace cutlass::gemm::kernel::detail
