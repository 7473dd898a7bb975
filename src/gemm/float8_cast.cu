#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>

#include "core/cuda_checks.hpp"
#include "gemm/float8_cast.hpp"

namespace meshla::detail {
namespace {

// Tiles of 64 x 64 values, a block of 32 x 8 threads: each thread takes two neighbouring columns
// (a warp reads 64 consecutive values of a row) and every eighth row of the tile.
constexpr int kTile = 64;
constexpr int kThreadsX = 32;
constexpr int kThreadsY = 8;
constexpr int kRowThreads = 256;  // a block per row in the row and tensor maxima

// |x|'s bits. For non-negative floats, and NaN (whose bits exceed infinity's), the order of the
// bits read as unsigned integers is the order of the values, so that integer maxima (and
// atomicMax on the float's memory) find the largest magnitude and keep NaN.
__device__ unsigned magnitude_bits(float x) { return __float_as_uint(x) & 0x7fffffffu; }

// The maximum over a block of kRowThreads threads, in thread 0.
__device__ unsigned block_max(unsigned value) {
  __shared__ unsigned warps[kRowThreads / 32];
  value = __reduce_max_sync(0xffffffffu, value);
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = value;
  __syncthreads();
  value = threadIdx.x < kRowThreads / 32 ? warps[threadIdx.x] : 0u;
  if (threadIdx.x < 32) value = __reduce_max_sync(0xffffffffu, value);
  __syncthreads();  // warps[] is read before a next call writes it
  return value;
}

// Rows as runs of kVec values (16-byte loads where rows and pitch allow it).
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Run {
  T values[kVec];
};

// Each row's largest magnitude (per_row) or the whole array's (atomicMax into amax[0], zeroed).
template <typename T, int kVec>
__global__ void row_maxima(const T* t, Float8Layout layout, unsigned* amax, bool per_row) {
  unsigned whole = 0;
  for (std::int64_t r = blockIdx.x; r < layout.rows; r += gridDim.x) {
    const T* row = t + r * layout.pitch;
    unsigned value = 0;
    for (std::int64_t c = threadIdx.x * kVec; c < layout.cols; c += kRowThreads * kVec) {
      const Run<T, kVec> run = *reinterpret_cast<const Run<T, kVec>*>(row + c);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        value = max(value, magnitude_bits(static_cast<float>(run.values[j])));
      }
    }
    if (per_row) {
      value = block_max(value);
      if (threadIdx.x == 0) amax[r] = value;
    } else {
      whole = max(whole, value);
    }
  }
  if (!per_row) {
    whole = block_max(whole);
    if (threadIdx.x == 0) atomicMax(amax, whole);
  }
}

// Each column's largest magnitude over `rows_per_block` rows of a tile's 64 columns, combined
// across blocks by atomicMax into amax (zeroed).
template <typename T>
__global__ void column_maxima(const T* t, Float8Layout layout, std::int64_t rows_per_block,
                              unsigned* amax) {
  __shared__ unsigned partial[kThreadsY][kTile];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const std::int64_t c = blockIdx.x * static_cast<std::int64_t>(kTile) + 2 * tx;
  const std::int64_t begin = blockIdx.y * rows_per_block;
  const std::int64_t end =
      begin + rows_per_block < layout.rows ? begin + rows_per_block : layout.rows;
  unsigned value[2] = {0, 0};
  for (std::int64_t r = begin + ty; r < end; r += kThreadsY) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (c + j < layout.cols) {
        value[j] = max(value[j], magnitude_bits(static_cast<float>(t[r * layout.pitch + c + j])));
      }
    }
  }
  partial[ty][2 * tx] = value[0];
  partial[ty][2 * tx + 1] = value[1];
  __syncthreads();
  if (ty != 0) return;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    if (c + j >= layout.cols) continue;
    unsigned column = 0;
    for (int y = 0; y < kThreadsY; ++y) column = max(column, partial[y][2 * tx + j]);
    atomicMax(amax + c + j, column);
  }
}

// q and/or its transpose of the 64 x 64 tile at (r0, c0): the tile's float8 bytes pass through
// shared memory so that both are written a row at a time.
template <typename T, __nv_fp8_interpretation_t kFormat>
__device__ void cast_tile(const T* t, const Float8Layout& layout, Float8Scales scales,
                          const float* multiplier, std::uint8_t* q, std::uint8_t* q_transposed,
                          std::int64_t r0, std::int64_t c0, std::uint8_t (*tile)[kTile + 4]) {
  const int tx = threadIdx.x, ty = threadIdx.y;
  const std::int64_t c = c0 + 2 * tx;
  float column_multiplier[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    column_multiplier[j] = scales == Float8Scales::kTensor ? multiplier[0]
                           : scales == Float8Scales::kColumns && c + j < layout.cols
                               ? multiplier[c + j]
                               : 0.0f;
  }
  for (int i = ty; i < kTile; i += kThreadsY) {
    const std::int64_t r = r0 + i;
    if (r >= layout.rows) break;
    const float row_multiplier = scales == Float8Scales::kRows ? multiplier[r] : 0.0f;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (c + j >= layout.cols) continue;
      const float scale = scales == Float8Scales::kRows ? row_multiplier : column_multiplier[j];
      const float product = __fmul_rn(static_cast<float>(t[r * layout.pitch + c + j]), scale);
      const std::uint8_t value = __nv_cvt_float_to_fp8(product, __NV_SATFINITE, kFormat);
      if (q != nullptr) q[r * layout.cols + c + j] = value;
      tile[i][2 * tx + j] = value;
    }
  }
  if (q_transposed == nullptr) return;
  __syncthreads();
  // Row c0 + i of the transpose holds column c0 + i of the tile; a thread writes two of its bytes.
  const std::int64_t r = r0 + 2 * tx;
  for (int i = ty; i < kTile; i += kThreadsY) {
    const std::int64_t row = c0 + i;
    if (row >= layout.cols) break;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (r + j < layout.rows) q_transposed[row * layout.rows + r + j] = tile[2 * tx + j][i];
    }
  }
}

// Row tiles along blockIdx.x, column tiles along blockIdx.y, as many as the grid's second
// dimension holds (65535) at a time.
template <typename T, __nv_fp8_interpretation_t kFormat>
__global__ void cast_tiles(const T* t, Float8Layout layout, Float8Scales scales,
                           const float* multiplier, std::uint8_t* q, std::uint8_t* q_transposed) {
  __shared__ std::uint8_t tile[kTile][kTile + 4];
  const std::int64_t r0 = blockIdx.x * static_cast<std::int64_t>(kTile);
  for (std::int64_t c0 = blockIdx.y * static_cast<std::int64_t>(kTile); c0 < layout.cols;
       c0 += gridDim.y * static_cast<std::int64_t>(kTile)) {
    cast_tile<T, kFormat>(t, layout, scales, multiplier, q, q_transposed, r0, c0, tile);
    __syncthreads();  // the tile is read before the next one is written
  }
}

template <typename T>
void launch_amax(const T* t, const Float8Layout& layout, Float8Scales scales, unsigned* amax,
                 cudaStream_t stream) {
  if (scales == Float8Scales::kColumns) {
    if (layout.rows == 0 || layout.cols == 0) return;
    // Row chunks along the grid's second dimension (at most 65535), 256 rows or more each.
    const std::int64_t rows_per_block = std::max<std::int64_t>(256, (layout.rows + 65534) / 65535);
    const dim3 grid(static_cast<unsigned>((layout.cols + kTile - 1) / kTile),
                    static_cast<unsigned>((layout.rows + rows_per_block - 1) / rows_per_block));
    column_maxima<T>
        <<<grid, dim3(kThreadsX, kThreadsY), 0, stream>>>(t, layout, rows_per_block, amax);
    return;
  }
  if (layout.rows == 0) return;
  const bool per_row = scales == Float8Scales::kRows;
  const unsigned blocks =
      static_cast<unsigned>(per_row ? std::min<std::int64_t>(layout.rows, 1 << 30)
                                    : std::min<std::int64_t>(layout.rows, 4096));
  constexpr int kVec = 16 / sizeof(T);
  const bool runs = layout.cols % kVec == 0 && layout.pitch % kVec == 0 &&
                    reinterpret_cast<std::uintptr_t>(t) % 16 == 0;
  if (runs) {
    row_maxima<T, kVec><<<blocks, kRowThreads, 0, stream>>>(t, layout, amax, per_row);
  } else {
    row_maxima<T, 1><<<blocks, kRowThreads, 0, stream>>>(t, layout, amax, per_row);
  }
}

template <typename T>
void launch_cast(const T* t, const Float8Layout& layout, Float8Scales scales,
                 const float* multiplier, DType dtype, void* q, void* q_transposed,
                 cudaStream_t stream) {
  if (layout.rows == 0 || layout.cols == 0) return;
  const dim3 grid(
      static_cast<unsigned>((layout.rows + kTile - 1) / kTile),
      static_cast<unsigned>(std::min<std::int64_t>((layout.cols + kTile - 1) / kTile, 65535)));
  const dim3 block(kThreadsX, kThreadsY);
  auto* out = static_cast<std::uint8_t*>(q);
  auto* out_transposed = static_cast<std::uint8_t*>(q_transposed);
  if (dtype == DType::kFloat8E4M3) {
    cast_tiles<T, __NV_E4M3>
        <<<grid, block, 0, stream>>>(t, layout, scales, multiplier, out, out_transposed);
  } else {
    cast_tiles<T, __NV_E5M2>
        <<<grid, block, 0, stream>>>(t, layout, scales, multiplier, out, out_transposed);
  }
}

template <class Launch>
void by_dtype(DType dtype, const void* t, Launch&& launch) {
  switch (dtype) {
    case DType::kBFloat16:
      return launch(static_cast<const __nv_bfloat16*>(t));
    case DType::kFloat16:
      return launch(static_cast<const __half*>(t));
    default:
      return launch(static_cast<const float*>(t));
  }
}

}  // namespace

void launch_float8_amax(const void* t, const Float8Layout& layout, Float8Scales scales, float* amax,
                        cudaStream_t stream) {
  auto* bits = reinterpret_cast<unsigned*>(amax);
  if (scales != Float8Scales::kRows) {
    const std::int64_t count = scales == Float8Scales::kColumns ? layout.cols : 1;
    MESHLA_CHECK_CUDA(cudaMemsetAsync(bits, 0, count * sizeof(float), stream));
  }
  by_dtype(layout.dtype, t, [&](auto typed) { launch_amax(typed, layout, scales, bits, stream); });
  MESHLA_CHECK_CUDA(cudaGetLastError());
}

void launch_float8_cast(const void* t, const Float8Layout& layout, Float8Scales scales,
                        const float* multiplier, DType dtype, void* q, void* q_transposed,
                        cudaStream_t stream) {
  by_dtype(layout.dtype, t, [&](auto typed) {
    launch_cast(typed, layout, scales, multiplier, dtype, q, q_transposed, stream);
  });
  MESHLA_CHECK_CUDA(cudaGetLastError());
}

}  // namespace meshla::detail
