// all_gather_matmul's one-launch GEMM (gathered_gemm.hpp): the grouped GEMM's CUTLASS kernel, one
// group per rank's block, with a tile scheduler that holds each tile until its block has landed.
#include "overlap/gathered_gemm.hpp"

#include <cstdio>

#include "grouped/cutlass_grouped.cuh"

namespace meshla::overlap {

// CUTLASS's grouped problem shape plus what the scheduler waits for. Being its own type, it
// selects ArrivalScheduler (the specialization of TileSchedulerSelector below).
struct ArrivalProblemShape : cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>> {
  const std::uint32_t* const* landed = nullptr;  // device table, one flag (or nullptr) per group
  std::uint64_t timeout_ns = 0;
};

__device__ std::uint64_t global_ns() {
  std::uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
}

__device__ std::uint32_t load_acquire(const std::uint32_t* flag) {
  std::uint32_t value;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
  return value;
}

// Called by a whole warp; returns once *flag is nonzero.
__device__ void await_landed(const std::uint32_t* flag, std::uint64_t timeout_ns, int block) {
  if (threadIdx.x % 32 == 0) {
    const std::uint64_t start = global_ns();
    while (load_acquire(flag) == 0) {
      if (global_ns() - start > timeout_ns) {
        printf("meshla: all_gather_matmul's GEMM waited %llu ms for block %d to land; trapping\n",
               static_cast<unsigned long long>(timeout_ns / 1000000), block);
        __trap();
      }
      __nanosleep(256);
    }
    // The block is read by TMA, the async proxy: order those reads after the flag's.
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }
  __syncwarp();
}

// CUTLASS's static persistent group scheduler (tile i of the launch on CTA i mod grid, groups in
// order), holding each tile until its group's block has landed. Every warp computes its CTA's first
// tile itself, and the scheduler warp hands the later ones to the others through a shared-memory
// pipeline, so waiting in those two places is waiting before any load of the tile. The waits
// follow the tiles' order, so a CTA waits at most once per group.
template <int Stages>
class ArrivalScheduler
    : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<ArrivalProblemShape,
                                                                             Stages> {
  using Base =
      cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<ArrivalProblemShape, Stages>;

 public:
  CUTLASS_DEVICE ArrivalScheduler(typename Base::Params const& params,
                                  typename Base::SchedulerResponse* response)
      : Base(params, response) {
    // The base's own first index, which it keeps private.
    linear_idx_ = params.raster_order_ == Base::RasterOrder::AlongN
                      ? std::uint64_t(blockIdx.x) + std::uint64_t(blockIdx.y) * gridDim.x
                      : std::uint64_t(blockIdx.x) * gridDim.y + blockIdx.y;
    grid_size_ = std::uint64_t(gridDim.x) * gridDim.y * gridDim.z;
  }

  template <class ClusterShape>
  CUTLASS_DEVICE auto initial_work_tile_info(ClusterShape) {
    const auto work = this->get_current_work_for_linear_idx(linear_idx_);
    await(work);
    return work;
  }

  // The base's, with the wait between choosing the tile and handing it on.
  template <class Pipeline, class PipelineState>
  CUTLASS_DEVICE auto advance_to_next_work(Pipeline& pipeline, PipelineState state,
                                           std::uint32_t advance_count = 1) {
    linear_idx_ += grid_size_ * advance_count;
    const auto work = this->get_current_work_for_linear_idx(linear_idx_);
    await(work);
    pipeline.producer_acquire(state);
    if (cute::elect_one_sync()) {
      this->response_ptr_[state.index()] = work;
      cutlass::arch::fence_view_async_shared();
      pipeline.producer_commit(state);
    }
    return cute::make_tuple(work, true);
  }

 private:
  CUTLASS_DEVICE void await(const typename Base::WorkTileInfo& work) {
    if (!work.is_valid() || work.L_idx <= awaited_) return;
    const ArrivalProblemShape& problem = this->scheduler_params.problem_shapes_;
    const std::uint32_t* flag = problem.landed[work.L_idx];
    if (flag != nullptr) await_landed(flag, problem.timeout_ns, work.L_idx);
    awaited_ = work.L_idx;
  }

  std::uint64_t linear_idx_ = 0;
  std::uint64_t grid_size_ = 0;
  int awaited_ = -1;
};

}  // namespace meshla::overlap

namespace cutlass::gemm::kernel::detail {

template <class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<GroupScheduler, arch::Sm90, TileShape, ClusterShape,
                             SchedulerPipelineStageCount, meshla::overlap::ArrivalProblemShape> {
  using Scheduler = meshla::overlap::ArrivalScheduler<SchedulerPipelineStageCount>;
};

}  // namespace cutlass::gemm::kernel::detail

namespace meshla::overlap {
namespace {

// The grouped GEMM's layouts name the operands by pass: b stored [n, k] is the forward pass's
// layout of B, [k, n] the data gradient's. The epilogue adds the bias row, or nothing when the
// bias pointer is null.
template <GroupedPass layout, DType dtype>
using Kernel = grouped::GroupedGemm<layout, dtype, grouped::Epilogue::kBias, /*cluster_m=*/1,
                                    ArrivalProblemShape>;

template <class T>
struct Tag {
  using type = T;
};

template <class Fn>
decltype(auto) with_kernel(const GatheredGemmShape& shape, Fn&& fn) {
  constexpr auto kBf16 = DType::kBFloat16;
  constexpr auto kFp16 = DType::kFloat16;
  if (shape.trans_b) {
    if (shape.dtype == kBf16) return fn(Tag<Kernel<GroupedPass::kForward, kBf16>>{});
    return fn(Tag<Kernel<GroupedPass::kForward, kFp16>>{});
  }
  if (shape.dtype == kBf16) return fn(Tag<Kernel<GroupedPass::kDgrad, kBf16>>{});
  return fn(Tag<Kernel<GroupedPass::kDgrad, kFp16>>{});
}

// One launch's operands, passed by value so that a captured graph replays them.
struct GatheredArgs {
  GatheredBlock blocks[kMaxGatheredBlocks];
  const void* b;
  const void* bias;
  int count;
  int rows, n, k;
  bool trans_b;
};

template <class G>
__global__ void fill_gathered_tables(GatheredArgs args, typename G::Tables tables,
                                     const std::uint32_t** landed) {
  using Element = typename G::Element;
  const int g = static_cast<int>(threadIdx.x);
  if (g >= args.count) return;
  tables.shapes[g] = {args.rows, args.n, args.k};
  tables.a[g] = static_cast<const Element*>(args.blocks[g].a);
  tables.b[g] = static_cast<const Element*>(args.b);
  tables.d[g] = static_cast<Element*>(args.blocks[g].d);
  tables.bias[g] = static_cast<const Element*>(args.bias);
  tables.stride_a[g] = grouped::leading_stride<typename G::StrideA>(args.k);
  tables.stride_b[g] = grouped::leading_stride<typename G::StrideB>(args.trans_b ? args.k : args.n);
  tables.stride_d[g] = grouped::leading_stride<typename G::StrideD>(args.n);
  landed[g] = args.blocks[g].landed;
}

}  // namespace

const char* gathered_gemm_unsupported(const GatheredGemmShape& shape) {
  if (shape.dtype != DType::kBFloat16 && shape.dtype != DType::kFloat16) {
    return "dtype is neither bfloat16 nor float16";
  }
  if (shape.blocks < 1 || shape.blocks > kMaxGatheredBlocks)
    return "more blocks than one launch takes";
  if (shape.n % 8 != 0 || shape.k % 8 != 0) return "n or k is not a multiple of 8";
  return "";
}

GatheredGemm::GatheredGemm(const GatheredGemmShape& shape) : shape_(shape) {
  MESHLA_ASSERT(*gathered_gemm_unsupported(shape) == '\0');
  if (shape_.sm_count == 0) {
    MESHLA_CHECK_CUDA(
        cudaDeviceGetAttribute(&shape_.sm_count, cudaDevAttrMultiProcessorCount, shape_.device));
  }
  const auto kernel_bytes = with_kernel(shape_, [&](auto tag) {
    using G = typename decltype(tag)::type;
    tables_bytes_ = G::tables_bytes(shape_.blocks) +
                    detail::align_up(static_cast<std::size_t>(shape_.blocks) * sizeof(void*));
    return G::Gemm::get_workspace_size(
        G::arguments(typename G::Tables{}, shape_.blocks, shape_.device, shape_.sm_count, false));
  });
  workspace_ = detail::DeviceBuffer(shape_.device, tables_bytes_ + kernel_bytes);
}

void GatheredGemm::run(const GatheredBlock* blocks, const void* b, const void* bias,
                       std::chrono::milliseconds timeout, cudaStream_t stream) {
  GatheredArgs args{};
  for (int g = 0; g < shape_.blocks; ++g) args.blocks[g] = blocks[g];
  args.b = b;
  args.bias = bias;
  args.count = shape_.blocks;
  args.rows = static_cast<int>(shape_.block_rows);
  args.n = static_cast<int>(shape_.n);
  args.k = static_cast<int>(shape_.k);
  args.trans_b = shape_.trans_b;
  with_kernel(shape_, [&](auto tag) {
    using G = typename decltype(tag)::type;
    char* base = static_cast<char*>(workspace_.data());
    const typename G::Tables tables = G::carve(base, shape_.blocks);
    auto** landed = reinterpret_cast<const std::uint32_t**>(base + G::tables_bytes(shape_.blocks));
    fill_gathered_tables<G><<<1, kMaxGatheredBlocks, 0, stream>>>(args, tables, landed);
    MESHLA_CHECK_CUDA(cudaGetLastError());
    auto gemm_args =
        G::arguments(tables, shape_.blocks, shape_.device, shape_.sm_count, bias != nullptr);
    gemm_args.problem_shape.landed = landed;
    gemm_args.problem_shape.timeout_ns =
        static_cast<std::uint64_t>(std::chrono::nanoseconds(timeout).count());
    typename G::Gemm gemm;
    grouped::check_cutlass(gemm.initialize(gemm_args, base + tables_bytes_, stream), "initialize");
    grouped::check_cutlass(gemm.run(stream), "launch");
  });
}

}  // namespace meshla::overlap
