// all_gather_matmul's one-launch GEMM (gathered_gemm.hpp): the grouped GEMM's claimed CUTLASS
// kernel, one group per rank's block, whose scheduler holds each block's tiles until its flag says
// the block has landed (gemm/sm90_claiming_scheduler.cuh, TileOrder::landed).
#include "collective/symmetric/sm90_gathered_gemm.hpp"

#include "core/cuda_handles.hpp"
#include "gemm/sm90_grouped_gemm.cuh"

namespace meshla::collective {
namespace {

// The grouped GEMM's layouts name the operands by pass: b stored [n, k] is the forward pass's
// layout of B, [k, n] the data gradient's. The epilogue adds the bias row, or nothing when the
// bias pointer is null.
template <GroupedPass layout, DType dtype>
using Kernel = gemm::GroupedGemm<layout, dtype, gemm::Epilogue::kBias>;

template <GroupedPass layout_, DType dtype>
struct Tag {
  using type = Kernel<layout_, dtype>;
  static constexpr GroupedPass layout = layout_;
};

template <class Fn>
decltype(auto) with_kernel(const GatheredGemmShape& shape, Fn&& fn) {
  constexpr auto kBf16 = DType::kBFloat16;
  constexpr auto kFp16 = DType::kFloat16;
  if (shape.trans_b) {
    if (shape.dtype == kBf16) return fn(Tag<GroupedPass::kForward, kBf16>{});
    return fn(Tag<GroupedPass::kForward, kFp16>{});
  }
  if (shape.dtype == kBf16) return fn(Tag<GroupedPass::kDgrad, kBf16>{});
  return fn(Tag<GroupedPass::kDgrad, kFp16>{});
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

// One block of gemm::kIndexThreads threads: the tables, the flags, and the tile order (blocks
// in the order given: write_tile_order puts groups of equal rows in group order; each cut into
// strips as the grouped GEMM's forward pass cuts its groups).
template <class G, GroupedPass layout>
__global__ void __launch_bounds__(gemm::kIndexThreads)
    fill_gathered_tables(GatheredArgs args, typename G::Tables tables, const std::uint32_t** landed,
                         gemm::OrderPlan plan) {
  // The GEMM, launched as this kernel's programmatic dependent, may start now: it waits for the
  // tables where it first reads them (ClaimingScheduler).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  using Element = typename G::Element;
  __shared__ std::int64_t offsets[kMaxGatheredBlocks + 1];
  const int g = static_cast<int>(threadIdx.x);
  if (g <= args.count) offsets[g] = static_cast<std::int64_t>(g) * args.rows;
  if (g < args.count) {
    tables.shapes[g] = {args.rows, args.n, args.k};
    tables.a[g] = static_cast<const Element*>(args.blocks[g].a);
    tables.b[g] = static_cast<const Element*>(args.b);
    tables.d[g] = static_cast<Element*>(args.blocks[g].d);
    tables.bias[g] = static_cast<const Element*>(args.bias);
    tables.stride_a[g] = gemm::leading_stride<typename G::StrideA>(args.k);
    tables.stride_b[g] = gemm::leading_stride<typename G::StrideB>(args.trans_b ? args.k : args.n);
    tables.stride_d[g] = gemm::leading_stride<typename G::StrideD>(args.n);
    landed[g] = args.blocks[g].landed;
  }
  __syncthreads();
  // The order reads only the offsets and the group count.
  const gemm::GroupIndex index{nullptr, offsets, nullptr, args.count, offsets[args.count]};
  gemm::write_tile_order<layout>(index, gemm::GroupedOperands{}, tables.order(), plan,
                                 tables.scratch);
}

}  // namespace

std::string gathered_gemm_unsupported(const GatheredGemmShape& shape) {
  if (!detail::runs_hopper_kernels(shape.device)) return "not a Hopper (sm_90) GPU";
  if (shape.dtype != DType::kBFloat16 && shape.dtype != DType::kFloat16) {
    return "dtype is neither bfloat16 nor float16";
  }
  if (shape.blocks < 1 || shape.blocks > kMaxGatheredBlocks) {
    return "more than " + std::to_string(kMaxGatheredBlocks) + " blocks";
  }
  if (shape.n % 8 != 0 || shape.k % 8 != 0) return "n or k is not a multiple of 8";
  return "";
}

bool gathered_gemm_pays(const GatheredGemmShape& shape) {
  constexpr std::int64_t kMaxBlockWaves = 4;
  const std::int64_t block_tiles =
      gemm::ceil_tiles(shape.block_rows, gemm::kTileM) * gemm::ceil_tiles(shape.n, gemm::kTileN);
  return block_tiles < kMaxBlockWaves * shape.sm_count;
}

GatheredGemm::GatheredGemm(const GatheredGemmShape& shape) : shape_(shape) {
  MESHLA_ASSERT(gathered_gemm_unsupported(shape).empty());
  detail::DeviceGuard guard(shape_.device);
  const std::size_t kernel_bytes = with_kernel(shape_, [&](auto tag) {
    using G = typename decltype(tag)::type;
    // Both kernels load now, before the plan's last exchange, not at their first launch: under
    // lazy module loading that waits for the device's queued work, and with several GPUs driven
    // from one process, this kernel waiting for a block whose push another thread has yet to
    // enqueue made such a wait a hang (the threads model, seen; see load_sum_slots).
    cudaFuncAttributes attributes;
    MESHLA_CHECK_CUDA(
        cudaFuncGetAttributes(&attributes, fill_gathered_tables<G, decltype(tag)::layout>));
    MESHLA_CHECK_CUDA(
        cudaFuncGetAttributes(&attributes, cutlass::device_kernel<typename G::Kernel>));
    tables_bytes_ = G::tables_bytes(shape_.blocks) +
                    detail::align_up(static_cast<std::size_t>(shape_.blocks) * sizeof(void*));
    return G::Gemm::get_workspace_size(
        G::arguments(typename G::Tables{}, shape_.blocks, shape_.device, shape_.sm_count, false));
  });
  workspace_ = detail::DeviceBuffer(shape_.device, tables_bytes_ + kernel_bytes);
  int l2_bytes = 0;
  MESHLA_CHECK_CUDA(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, shape_.device));
  n_tiles_ = static_cast<std::int32_t>(gemm::ceil_tiles(shape_.n, gemm::kTileN));
  strip_ = gemm::strip_m_tiles(n_tiles_, shape_.k,
                               gemm::ceil_tiles(shape_.block_rows, gemm::kTileM) * shape_.blocks,
                               shape_.sm_count, l2_bytes);
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
  const gemm::OrderPlan plan{n_tiles_, strip_};
  with_kernel(shape_, [&](auto tag) {
    using G = typename decltype(tag)::type;
    char* base = static_cast<char*>(workspace_.data());
    const typename G::Tables tables = G::carve(base, shape_.blocks);
    auto** landed = reinterpret_cast<const std::uint32_t**>(base + G::tables_bytes(shape_.blocks));
    fill_gathered_tables<G, decltype(tag)::layout>
        <<<1, gemm::kIndexThreads, 0, stream>>>(args, tables, landed, plan);
    MESHLA_CHECK_CUDA(cudaGetLastError());
    auto gemm_args =
        G::arguments(tables, shape_.blocks, shape_.device, shape_.sm_count, bias != nullptr);
    gemm_args.problem_shape.order.landed = landed;
    gemm_args.problem_shape.order.landed_timeout_ns =
        static_cast<std::uint64_t>(std::chrono::nanoseconds(timeout).count());
    typename G::Gemm gemm;
    gemm::check_cutlass(gemm.initialize(gemm_args, base + tables_bytes_, stream), "initialize");
    gemm::check_cutlass(gemm.run(stream, nullptr, /*launch_with_pdl=*/true), "launch");
  });
}

}  // namespace meshla::collective
