#include "gemm/sm90_rowwise_fp8_gemm.hpp"

#include <cutlass/cutlass.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_compute_tma_warpspecialized.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <cstdint>

#include "core/checks.hpp"
#include "core/cuda_checks.hpp"
#include "gemm/sm90_cutlass_element.cuh"

namespace meshla::gemm {
namespace {

namespace fusion = cutlass::epilogue::fusion;
using cute::_0;
using cute::_1;

// 128 x 128 output tiles, 128 deep (one 128-byte swizzle row of fp8 per k-step); pairs of CTAs
// along N share each tile of a through TMA multicast. Both consumer warpgroups work on each tile
// (cooperative), and the persistent scheduler deals the tiles to the SMs in swizzles of 8 (see
// kSwizzle). Measured on an H200 against 2x1 clusters without the swizzle, 128 x 256 tiles (their
// two fp32 accumulators spill: 2.3x slower) and pingpong schedules (1.7-2.7x slower):
// bench/results/fp8_rowwise_configs_h200_2026-11-28_acd6ffc-dirty.jsonl, NOTES 101.
template <DType a_dtype, DType b_dtype, DType out_dtype>
struct RowwiseGemm {
  using ElementA = typename CutlassElement<a_dtype>::type;
  using ElementB = typename CutlassElement<b_dtype>::type;
  using ElementD = typename CutlassElement<out_dtype>::type;
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;
  using ClusterShape = cute::Shape<_1, cute::_2, _1>;
  static constexpr int kAlignmentAB = 16;  // 16 bytes of fp8: TMA's minimum
  static constexpr int kAlignmentD = 128 / cutlass::sizeof_bits<ElementD>::value;

  // acc * a_scale[row] * b_scale[col] + bias[col], in fp32, rounded once into d. A null bias
  // pointer adds zero.
  using Multiply = fusion::Sm90Compute<cutlass::multiplies, float, float,
                                       cutlass::FloatRoundStyle::round_to_nearest>;
  using RowScale = fusion::Sm90ColBroadcast<0, TileShape, float, float, cute::Stride<_1, _0, _0>>;
  using ColumnScale =
      fusion::Sm90RowBroadcast<0, TileShape, float, float, cute::Stride<_0, _1, _0>>;
  using Bias = fusion::Sm90RowBroadcast<0, TileShape, ElementD, float, cute::Stride<_0, _1, _0>>;
  using Scaled =
      fusion::Sm90EVT<Multiply, fusion::Sm90EVT<Multiply, fusion::Sm90AccFetch, RowScale>,
                      ColumnScale>;
  using Fusion = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::plus, ElementD, float,
                                                     cutlass::FloatRoundStyle::round_to_nearest>,
                                 Scaled, Bias>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
      cutlass::layout::RowMajor, kAlignmentD, ElementD, cutlass::layout::RowMajor, kAlignmentD,
      cutlass::epilogue::TmaWarpSpecializedCooperative, Fusion>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cutlass::layout::RowMajor,
      kAlignmentAB, ElementB, cutlass::layout::ColumnMajor, kAlignmentAB, float, TileShape,
      ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>,
                                                      CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// The scheduler's tiles go to the SMs in runs of 8 along the raster: 8-10% faster than runs of 1
// at M = 8192, where consecutive tiles then reuse each other's operands in L2.
constexpr int kSwizzle = 8;

// Every stride here is (row pitch, 1, 0): a [m, k] and d [m, n] row-major, b [n, k] with k
// contiguous, one batch member.
template <class Stride>
Stride pitched(std::int64_t pitch) {
  Stride stride{};
  cute::get<0>(stride) = pitch;
  return stride;
}

void check_cutlass(cutlass::Status status, const char* what) {
  MESHLA_CHECK(kInternal, status == cutlass::Status::kSuccess,
               "matmul: CUTLASS rowwise float8 GEMM "
                   << what << " failed: " << cutlassGetStatusString(status));
}

template <DType a_dtype, DType b_dtype, DType out_dtype>
void run(const MatmulShape& s, const MatmulOperands& ops, int device, int sm_count, void* workspace,
         std::size_t workspace_bytes, cudaStream_t stream) {
  using G = RowwiseGemm<a_dtype, b_dtype, out_dtype>;
  using Kernel = typename G::Kernel;
  using ElementD = typename G::ElementD;
  typename G::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {static_cast<int>(s.m), static_cast<int>(s.n), static_cast<int>(s.k), 1},
      {static_cast<const typename G::ElementA*>(ops.a), pitched<typename Kernel::StrideA>(s.lda),
       static_cast<const typename G::ElementB*>(ops.b), pitched<typename Kernel::StrideB>(s.ldb)},
      {{{{{}, {ops.a_scale}, {}}, {ops.b_scale}, {}}, {static_cast<const ElementD*>(ops.bias)}, {}},
       nullptr,
       pitched<typename Kernel::StrideC>(s.ldd),
       static_cast<ElementD*>(ops.d),
       pitched<typename Kernel::StrideD>(s.ldd)}};
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count;
  args.scheduler.max_swizzle_size = kSwizzle;
  typename G::Gemm gemm;
  MESHLA_CHECK(
      kNotImplemented, gemm.can_implement(args) == cutlass::Status::kSuccess,
      "matmul: the rowwise float8 GEMM cannot run m=" << s.m << ", n=" << s.n << ", k=" << s.k);
  MESHLA_CHECK(kInternal, G::Gemm::get_workspace_size(args) <= workspace_bytes,
               "matmul: the rowwise float8 GEMM needs more workspace than the Matmul's");
  check_cutlass(gemm.initialize(args, workspace, stream), "initialize");
  check_cutlass(gemm.run(stream), "launch");
}

bool aligned_16(const void* pointer) { return reinterpret_cast<std::uintptr_t>(pointer) % 16 == 0; }

}  // namespace

void run_sm90_rowwise_fp8(const MatmulShape& s, const MatmulOperands& ops, int device, int sm_count,
                          void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  const DType b_dtype = s.b_dtype.value_or(s.dtype);
  const DType out_dtype = s.out_dtype.value_or(s.dtype);
  const std::int64_t out_bytes = static_cast<std::int64_t>(dtype_size(out_dtype));
  MESHLA_CHECK_ARG(aligned_16(ops.a) && aligned_16(ops.b) && aligned_16(ops.d) &&
                       aligned_16(ops.a_scale) && aligned_16(ops.b_scale) && aligned_16(ops.bias) &&
                       (s.ldd * out_bytes) % 16 == 0,
                   "matmul: a rowwise float8 product needs a, b, d, the scales and the bias at "
                   "16-byte aligned addresses and d's rows 16 bytes apart (ldd="
                       << s.ldd << " of " << dtype_name(out_dtype) << ")");
  constexpr auto kE4M3 = DType::kFloat8E4M3, kE5M2 = DType::kFloat8E5M2;
  constexpr auto kBf16 = DType::kBFloat16, kFp32 = DType::kFloat32;
  const auto dispatch = [&](auto a, auto b) {
    constexpr DType a_type = decltype(a)::value, b_type = decltype(b)::value;
    if (out_dtype == kBf16) {
      run<a_type, b_type, kBf16>(s, ops, device, sm_count, workspace, workspace_bytes, stream);
    } else {
      run<a_type, b_type, kFp32>(s, ops, device, sm_count, workspace, workspace_bytes, stream);
    }
  };
  using E4M3 = std::integral_constant<DType, kE4M3>;
  using E5M2 = std::integral_constant<DType, kE5M2>;
  if (s.dtype == kE4M3 && b_dtype == kE4M3) {
    dispatch(E4M3{}, E4M3{});
  } else if (s.dtype == kE4M3) {
    dispatch(E4M3{}, E5M2{});
  } else {
    dispatch(E5M2{}, E4M3{});
  }
}

}  // namespace meshla::gemm
