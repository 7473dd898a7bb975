#include "grouped/grouped_kernels.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>

#include "core/cuda_checks.hpp"
#include "grouped/grouped_device.cuh"

namespace meshla::grouped {
namespace {

// One block builds the index (grouped_device.cuh) for the passes that do not build their own.
__global__ void __launch_bounds__(kIndexThreads)
    group_index_kernel(GroupIndex index, DeviceStatus* status) {
  build_group_index(index, status);
}

__global__ void poison_kernel(const std::int32_t* invalid, GroupedSpan span) {
  if (*invalid == 0) return;
  fill_elements(span, blockIdx.y, Fill::kNaN, grid_thread(), grid_threads());
}

__global__ void __launch_bounds__(kIndexThreads)
    zero_empty_kernel(GroupIndex index, GroupedSpan span) {
  clear_if_empty(index, span);
}

template <template <typename> class Kernel, typename... Args>
void launch_by_dtype(DType dtype, dim3 grid, int threads, cudaStream_t stream, Args... args) {
  switch (dtype) {
    case DType::kFloat32:
      Kernel<float>::launch(grid, threads, stream, args...);
      break;
    case DType::kBFloat16:
      Kernel<__nv_bfloat16>::launch(grid, threads, stream, args...);
      break;
    case DType::kFloat16:
      Kernel<__half>::launch(grid, threads, stream, args...);
      break;
    default:
      MESHLA_THROW(kInternal, "grouped kernel launched with dtype " << dtype_name(dtype));
  }
  MESHLA_CHECK_CUDA(cudaGetLastError());
}

// Bias gradient: each thread owns one column and a run of kBiasRows rows, which may cross group
// boundaries; it adds its partial sum for a group into the fp32 accumulator when the group ends.
constexpr int kBiasThreads = 256;
constexpr int kBiasRows = 128;

__device__ std::int64_t group_of_row(const GroupIndex& index, std::int64_t row) {
  // The last group whose first row is <= row: with empty groups several share a first row, and the
  // last of them is the one that owns it.
  std::int64_t low = 0, high = index.groups - 1;
  while (low < high) {
    const std::int64_t mid = (low + high + 1) / 2;
    if (index.offsets[mid] <= row) {
      low = mid;
    } else {
      high = mid - 1;
    }
  }
  return low;
}

template <typename T>
__global__ void bias_grad_kernel(GroupIndex index, const T* dy, std::int64_t out,
                                 float* accumulator) {
  const std::int64_t column = blockIdx.x * static_cast<std::int64_t>(kBiasThreads) + threadIdx.x;
  const std::int64_t rows = index.offsets[index.groups];
  if (column >= out) return;
  // The grid's y extent is capped (kMaxGridY): its blocks take every gridDim.y-th run of rows.
  for (std::int64_t begin = blockIdx.y * static_cast<std::int64_t>(kBiasRows); begin < rows;
       begin += gridDim.y * static_cast<std::int64_t>(kBiasRows)) {
    const std::int64_t end = begin + kBiasRows < rows ? begin + kBiasRows : rows;
    std::int64_t group = group_of_row(index, begin);
    std::int64_t group_end = index.offsets[group + 1];
    float sum = 0.0f;
    for (std::int64_t row = begin; row < end; ++row) {
      while (row >= group_end) {
        atomicAdd(&accumulator[group * out + column], sum);
        sum = 0.0f;
        ++group;
        group_end = index.offsets[group + 1];
      }
      sum += static_cast<float>(dy[row * out + column]);
    }
    atomicAdd(&accumulator[group * out + column], sum);
  }
}

template <typename T>
__global__ void round_bias_kernel(const float* accumulator, std::int64_t groups, std::int64_t out,
                                  T* dbias, std::int64_t stride) {
  const std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (i >= groups * out) return;
  dbias[(i / out) * stride + i % out] = static_cast<T>(accumulator[i]);
}

template <typename T>
struct BiasGrad {
  static void launch(dim3 grid, int threads, cudaStream_t stream, GroupIndex index, const void* dy,
                     std::int64_t out, float* accumulator, void* dbias, std::int64_t stride) {
    bias_grad_kernel<T>
        <<<grid, threads, 0, stream>>>(index, static_cast<const T*>(dy), out, accumulator);
    const std::int64_t total = index.groups * out;
    round_bias_kernel<T><<<static_cast<unsigned>((total + 255) / 256), 256, 0, stream>>>(
        accumulator, index.groups, out, static_cast<T*>(dbias), stride);
  }
};

template <typename T>
__global__ void add_group_bias_kernel(GroupIndex index, T* y, std::int64_t out, const T* bias,
                                      std::int64_t stride) {
  const std::int64_t total = index.offsets[index.groups] * out;
  for (std::int64_t i = grid_thread(); i < total; i += grid_threads()) {
    const std::int64_t row = i / out;
    const std::int64_t column = i - row * out;
    const float sum = static_cast<float>(y[i]) +
                      static_cast<float>(bias[group_of_row(index, row) * stride + column]);
    y[i] = static_cast<T>(sum);
  }
}

template <typename T>
struct AddGroupBias {
  static void launch(dim3 grid, int threads, cudaStream_t stream, GroupIndex index, void* y,
                     std::int64_t out, const void* bias, std::int64_t stride) {
    add_group_bias_kernel<T><<<grid, threads, 0, stream>>>(index, static_cast<T*>(y), out,
                                                           static_cast<const T*>(bias), stride);
  }
};

template <typename T>
__device__ T* matrix_of(const Matrices& set, std::int64_t g) {
  return set.addresses != nullptr ? reinterpret_cast<T*>(set.addresses[g])
                                  : static_cast<T*>(set.data) + g * set.group_stride;
}

// A block per row at a time (grid-stride over every group's rows), its threads along the row:
// each thread moves kCopyRun elements blockDim.x apart, all of their loads issued before their
// stores, so that a warp's accesses stay contiguous (coalesced) and enough bytes are in flight to
// keep HBM busy. One element a thread at a time left the copy at about a third of the
// bandwidth; runs of consecutive elements a thread (strided across the warp) were slower still,
// their 2-byte stores scattered over many sectors. The rows of one side are usually not 4-byte
// aligned (1001 features), so elements move one at a time.
constexpr int kCopyRun = 8;

template <typename T, CopyMode kMode>
__global__ void copy_matrices_kernel(Matrices src, Matrices dst, std::int64_t groups) {
  const std::int64_t step = blockDim.x;
  for (std::int64_t item = blockIdx.x; item < groups * dst.rows; item += gridDim.x) {
    const std::int64_t g = item / dst.rows;
    const std::int64_t row = item - g * dst.rows;
    const T* from = row < src.rows ? matrix_of<T>(src, g) + row * src.pitch : nullptr;
    T* to = matrix_of<T>(dst, g) + row * dst.pitch;
    const std::int64_t held = from != nullptr ? src.cols : 0;
    for (std::int64_t first = threadIdx.x; first < dst.cols; first += step * kCopyRun) {
      T values[kCopyRun];
#pragma unroll
      for (int e = 0; e < kCopyRun; ++e) {
        const std::int64_t column = first + e * step;
        values[e] = column < held ? from[column] : T{};
      }
#pragma unroll
      for (int e = 0; e < kCopyRun; ++e) {
        const std::int64_t column = first + e * step;
        if (column >= dst.cols) break;
        if constexpr (kMode == CopyMode::kAddFloat) {
          to[column] += values[e];
        } else {
          to[column] = values[e];
        }
      }
    }
  }
}

// The portable grouped GEMM (fp32 groups anywhere; bf16 and fp16 groups where meshla's Hopper
// kernel cannot run): 64x64 tiles, 16-deep slices of K, 4x4 outputs per thread, products and
// sums in fp32. Group g's operands are A (M x K) and B (K x N) of element type T at element
// strides that depend on the pass; its output D is Out: T, or fp32 where a weight gradient
// accumulates into fp32 main grads.
constexpr int kTile = 64;
constexpr int kDepth = 16;
constexpr int kSimtThreads = 256;

template <typename T, typename Out>
struct GroupGemm {
  std::int64_t m, n, k;
  const T* a;
  std::int64_t a_m, a_k;
  const T* b;
  std::int64_t b_k, b_n;
  Out* d;
  std::int64_t d_m;
  const T* bias;  // length n, or nullptr
};

template <typename T, typename Out>
__device__ GroupGemm<T, Out> group_gemm(const GroupIndex& index, const GroupedOperands& op,
                                        std::int64_t g) {
  const std::int64_t first = index.offsets[g];
  const std::int64_t rows = index.offsets[g + 1] - first;
  const std::int64_t in = op.in_features, out = op.out_features;
  const auto* x = static_cast<const T*>(op.x);
  const auto* dy = static_cast<const T*>(op.dy);
  const auto* w = static_cast<const T*>(op.weight) + g * op.weight_group_stride;
  auto* d = static_cast<Out*>(op.out);
  switch (op.pass) {
    case GroupedPass::kForward:
      return {rows, out,
              in,   x + first * in,
              in,   1,
              w,    1,
              in,   d + first * out,
              out,  op.bias ? static_cast<const T*>(op.bias) + g * op.bias_group_stride : nullptr};
    case GroupedPass::kDgrad:
      return {rows, in, out, dy + first * out, out, 1, w, in, 1, d + first * in, in, nullptr};
    default:  // kWgrad
      return {rows == 0 ? 0 : out, in, rows, dy + first * out,          1,  out,
              x + first * in,      in, 1,    group_dweight<Out>(op, g), in, nullptr};
  }
}

template <typename T, typename Out>
__global__ void __launch_bounds__(kSimtThreads)
    grouped_simt_kernel(GroupIndex index, GroupedOperands op) {
  const GroupGemm<T, Out> p = group_gemm<T, Out>(index, op, blockIdx.z);
  const std::int64_t col0 = blockIdx.x * static_cast<std::int64_t>(kTile);
  if (col0 >= p.n) return;
  __shared__ float a_tile[kDepth][kTile];
  __shared__ float b_tile[kDepth][kTile];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  for (std::int64_t row0 = blockIdx.y * static_cast<std::int64_t>(kTile); row0 < p.m;
       row0 += static_cast<std::int64_t>(gridDim.y) * kTile) {
    float acc[4][4] = {};
    for (std::int64_t k0 = 0; k0 < p.k; k0 += kDepth) {
      for (int i = threadIdx.x; i < kDepth * kTile; i += kSimtThreads) {
        const int kk = i / kTile, mm = i % kTile;
        const std::int64_t row = row0 + mm, col = col0 + mm, k = k0 + kk;
        a_tile[kk][mm] =
            row < p.m && k < p.k ? static_cast<float>(p.a[row * p.a_m + k * p.a_k]) : 0.0f;
        b_tile[kk][mm] =
            col < p.n && k < p.k ? static_cast<float>(p.b[k * p.b_k + col * p.b_n]) : 0.0f;
      }
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kDepth; ++kk) {
        float a_frag[4], b_frag[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          a_frag[i] = a_tile[kk][ty * 4 + i];
          b_frag[i] = b_tile[kk][tx * 4 + i];
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a_frag[i], b_frag[j], acc[i][j]);
      }
      __syncthreads();
    }
    for (int i = 0; i < 4; ++i) {
      const std::int64_t row = row0 + ty * 4 + i;
      if (row >= p.m) continue;
      for (int j = 0; j < 4; ++j) {
        const std::int64_t col = col0 + tx * 4 + j;
        if (col >= p.n) continue;
        float value = acc[i][j];
        if (p.bias) value += static_cast<float>(p.bias[col]);
        Out& target = p.d[row * p.d_m + col];
        target = static_cast<Out>(op.accumulate ? static_cast<float>(target) + value : value);
      }
    }
  }
}

// The portable GEMM of T groups: into T, or into fp32 where the weight gradient accumulates.
template <typename T>
struct GroupedSimt {
  static void launch(dim3 grid, int threads, cudaStream_t stream, GroupIndex index,
                     GroupedOperands operands) {
    if constexpr (std::is_same_v<T, float>) {
      grouped_simt_kernel<float, float><<<grid, threads, 0, stream>>>(index, operands);
    } else if (operands.accumulate) {
      grouped_simt_kernel<T, float><<<grid, threads, 0, stream>>>(index, operands);
    } else {
      grouped_simt_kernel<T, T><<<grid, threads, 0, stream>>>(index, operands);
    }
  }
};

}  // namespace

// Grid-wide launches over groups: y walks the groups, x a few blocks per group. These kernels
// usually have nothing to do (no failed check, no empty group) and every block exits at once, but
// even that costs about 0.6 ns per block: 1024 blocks per group made them take 80 us each beside a
// 760 us weight gradient of 128 experts. So the whole grid stays near kSpanBlocks blocks (about
// 2 us when there is nothing to write), and the rare group that is written strides over its
// elements.
constexpr std::int64_t kSpanBlocks = 1024;

dim3 span_grid(const GroupedSpan& span, int threads) {
  const std::int64_t per_group = (span.group_elements + threads - 1) / threads;
  MESHLA_ASSERT(span.groups <= kMaxGridY);  // validate_grouped_args refuses more groups
  const std::int64_t cap = std::max<std::int64_t>(kSpanBlocks / span.groups, 1);
  return dim3(static_cast<unsigned>(std::clamp<std::int64_t>(per_group, 1, cap)),
              static_cast<unsigned>(span.groups));
}

void launch_group_index(const GroupIndex& index, DeviceStatus* status, cudaStream_t stream) {
  group_index_kernel<<<1, kIndexThreads, 0, stream>>>(index, status);
  MESHLA_CHECK_CUDA(cudaGetLastError());
}

void launch_poison_if_invalid(const std::int32_t* invalid, const GroupedSpan& span,
                              cudaStream_t stream) {
  poison_kernel<<<span_grid(span, 256), 256, 0, stream>>>(invalid, span);
  MESHLA_CHECK_CUDA(cudaGetLastError());
}

void launch_zero_empty_groups(const GroupIndex& index, const GroupedSpan& span,
                              cudaStream_t stream) {
  zero_empty_kernel<<<span_grid(span, kIndexThreads), kIndexThreads, 0, stream>>>(index, span);
  MESHLA_CHECK_CUDA(cudaGetLastError());
}

void launch_add_group_bias(const GroupIndex& index, void* y, DType dtype, std::int64_t out,
                           const void* bias, std::int64_t bias_group_stride, cudaStream_t stream) {
  // About a thousand blocks striding over the rows, as span_grid's launches.
  const std::int64_t blocks = (index.rows * out + 255) / 256;
  launch_by_dtype<AddGroupBias>(
      dtype, dim3(static_cast<unsigned>(std::clamp<std::int64_t>(blocks, 1, kSpanBlocks))), 256,
      stream, index, y, out, bias, bias_group_stride);
}

void launch_copy_matrices(const Matrices& src, const Matrices& dst, std::int64_t groups,
                          int element_size, CopyMode mode, cudaStream_t stream) {
  // Blocks of 128 threads (a 1000-feature row is one run each), several per SM, taking rows in
  // turn.
  const dim3 grid(static_cast<unsigned>(std::clamp<std::int64_t>(groups * dst.rows, 1, 8192)));
  constexpr int kThreads = 128;
  if (element_size == 2 && mode == CopyMode::kCopy) {
    copy_matrices_kernel<std::uint16_t, CopyMode::kCopy>
        <<<grid, kThreads, 0, stream>>>(src, dst, groups);
  } else if (element_size == 4 && mode == CopyMode::kCopy) {
    copy_matrices_kernel<float, CopyMode::kCopy><<<grid, kThreads, 0, stream>>>(src, dst, groups);
  } else if (element_size == 4) {
    copy_matrices_kernel<float, CopyMode::kAddFloat>
        <<<grid, kThreads, 0, stream>>>(src, dst, groups);
  } else {
    MESHLA_THROW(kInternal, "copy_matrices: " << element_size << "-byte elements, mode "
                                              << static_cast<int>(mode));
  }
  MESHLA_CHECK_CUDA(cudaGetLastError());
}

void launch_bias_grad(const GroupIndex& index, const void* dy, DType dtype, std::int64_t out,
                      float* accumulator, void* dbias, std::int64_t dbias_group_stride,
                      cudaStream_t stream) {
  MESHLA_CHECK_CUDA(cudaMemsetAsync(
      accumulator, 0, sizeof(float) * static_cast<std::size_t>(index.groups * out), stream));
  const std::int64_t row_blocks = (index.rows + kBiasRows - 1) / kBiasRows;
  const dim3 grid(static_cast<unsigned>((out + kBiasThreads - 1) / kBiasThreads),
                  static_cast<unsigned>(std::clamp<std::int64_t>(row_blocks, 1, kMaxGridY)));
  launch_by_dtype<BiasGrad>(dtype, grid, kBiasThreads, stream, index, dy, out, accumulator, dbias,
                            dbias_group_stride);
}

void launch_grouped_simt(const GroupIndex& index, const GroupedOperands& operands, DType dtype,
                         cudaStream_t stream) {
  MESHLA_ASSERT(index.groups <= kMaxGridY);  // validate_grouped_args refuses more groups
  const std::int64_t n =
      operands.pass == GroupedPass::kForward ? operands.out_features : operands.in_features;
  const std::int64_t m_tiles = operands.pass == GroupedPass::kWgrad
                                   ? (operands.out_features + kTile - 1) / kTile
                                   : (index.rows + kTile - 1) / kTile;
  const dim3 grid(static_cast<unsigned>((n + kTile - 1) / kTile),
                  static_cast<unsigned>(std::clamp<std::int64_t>(m_tiles, 1, kMaxGridY)),
                  static_cast<unsigned>(index.groups));
  launch_by_dtype<GroupedSimt>(dtype, grid, kSimtThreads, stream, index, operands);
}

}  // namespace meshla::grouped
