#include "solver/solver_kernels.hpp"

#include <cuComplex.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cub/block/block_reduce.cuh>

#include "core/cuda_checks.hpp"

namespace meshla::solver {
namespace {

using Index = std::int64_t;

// Arithmetic the kernels need, for the four element types.
template <typename T>
struct Element;

template <>
struct Element<float> {
  static __device__ float conj(float x) { return x; }
  static __device__ double real(float x) { return x; }
  static __device__ double abs(float x) { return fabsf(x); }
  static __host__ __device__ float of_real(double x) { return static_cast<float>(x); }
  static __device__ float nan() { return __int_as_float(0x7fc00000); }
};

template <>
struct Element<double> {
  static __device__ double conj(double x) { return x; }
  static __device__ double real(double x) { return x; }
  static __device__ double abs(double x) { return fabs(x); }
  static __host__ __device__ double of_real(double x) { return x; }
  static __device__ double nan() { return __longlong_as_double(0x7ff8000000000000LL); }
};

template <>
struct Element<cuFloatComplex> {
  static __device__ cuFloatComplex conj(cuFloatComplex x) { return cuConjf(x); }
  static __device__ double real(cuFloatComplex x) { return x.x; }
  static __device__ double abs(cuFloatComplex x) { return cuCabsf(x); }
  static __host__ __device__ cuFloatComplex of_real(double x) {
    return make_cuFloatComplex(static_cast<float>(x), 0.0f);
  }
  static __device__ cuFloatComplex nan() {
    return make_cuFloatComplex(Element<float>::nan(), Element<float>::nan());
  }
};

template <>
struct Element<cuDoubleComplex> {
  static __device__ cuDoubleComplex conj(cuDoubleComplex x) { return cuConj(x); }
  static __device__ double real(cuDoubleComplex x) { return x.x; }
  static __device__ double abs(cuDoubleComplex x) { return cuCabs(x); }
  static __host__ __device__ cuDoubleComplex of_real(double x) {
    return make_cuDoubleComplex(x, 0.0);
  }
  static __device__ cuDoubleComplex nan() {
    return make_cuDoubleComplex(Element<double>::nan(), Element<double>::nan());
  }
};

template <typename T>
__device__ T maybe_conj(T x, bool conjugate) {
  return conjugate ? Element<T>::conj(x) : x;
}

template <typename T>
__device__ T zero() {
  return Element<T>::of_real(0.0);
}

constexpr int kThreads = 256;
constexpr int kTile = 32;     // transposing kernels move kTile x kTile blocks through shared memory
constexpr int kTileRows = 8;  // ... with kTile x kTileRows threads
constexpr Index kMaxGridY = 65535;

unsigned blocks_for(Index work, Index limit) {
  return static_cast<unsigned>(std::clamp<Index>((work + kThreads - 1) / kThreads, 1, limit));
}

// The conversions between the original and the solver's row order copy runs of rows: solver tile t
// holds original rows [first, first + count) in order (original_rows_of_tile). A block copies a
// segment of at most kSegmentRows rows of one tile in one column, having done the tile's index
// arithmetic once. Done per element, its 64-bit divisions held the copy at a third of the memory
// bandwidth (one H100, float64, n about 16000: 4.0 ms a matrix, by segments 1.5-1.6 ms).
constexpr Index kSegmentRows = 4 * kThreads;

__host__ __device__ Index segments_per_tile(const BlockCyclicLayout& layout) {
  return (layout.tile + kSegmentRows - 1) / kSegmentRows;
}

__host__ __device__ Index segment_count(const BlockCyclicLayout& layout) {
  return layout.padded_n() / layout.tile * segments_per_tile(layout);
}

// Segment `segment` of the solver order: its tile, and its rows [begin, end) within the tile.
struct Segment {
  Index tile;
  Index begin;
  Index end;
};

__device__ Segment segment_of(const BlockCyclicLayout& layout, Index segment) {
  const Index per_tile = segments_per_tile(layout);
  const Index begin = segment % per_tile * kSegmentRows;
  return {segment / per_tile, begin, min(begin + kSegmentRows, layout.tile)};
}

template <typename T>
__global__ void rows_to_solver_order_kernel(const T* src, Index src_ld, T* dst, Index dst_ld,
                                            BlockCyclicLayout layout, Index part, Index first,
                                            Index columns, T pad_diagonal) {
  const Index segments = segment_count(layout);
  for (Index c = blockIdx.y; c < columns; c += gridDim.y) {
    const Index local = first + c;
    const Index diagonal = layout.solver_index_of_local(part, local);
    const bool real_column = local < layout.rows_per_part;
    for (Index index = blockIdx.x; index < segments; index += gridDim.x) {
      const Segment segment = segment_of(layout, index);
      const BlockCyclicLayout::TileRows rows = layout.original_rows_of_tile(segment.tile);
      const Index real_rows = real_column ? rows.count : 0;
      const Index tile_start = segment.tile * layout.tile;
      const T* from = src + c * src_ld + rows.first;
      T* to = dst + c * dst_ld + tile_start;
      for (Index i = segment.begin + threadIdx.x; i < segment.end; i += blockDim.x) {
        to[i] = i < real_rows ? from[i] : (tile_start + i == diagonal ? pad_diagonal : zero<T>());
      }
    }
  }
}

template <typename T>
__global__ void rows_to_original_order_kernel(const T* src, Index src_ld, T* dst, Index dst_ld,
                                              BlockCyclicLayout layout, Index columns) {
  const Index segments = segment_count(layout);
  for (Index c = blockIdx.y; c < columns; c += gridDim.y) {
    for (Index index = blockIdx.x; index < segments; index += gridDim.x) {
      const Segment segment = segment_of(layout, index);
      const BlockCyclicLayout::TileRows rows = layout.original_rows_of_tile(segment.tile);
      const T* from = src + c * src_ld + segment.tile * layout.tile;
      T* to = dst + c * dst_ld + rows.first;
      for (Index i = segment.begin + threadIdx.x; i < min(segment.end, rows.count);
           i += blockDim.x) {
        to[i] = from[i];
      }
    }
  }
}

template <typename T>
__global__ void gather_rhs_kernel(PartPointers shards, T* dst, Index ld, BlockCyclicLayout layout,
                                  Index nrhs, bool conjugate) {
  const Index rows = layout.padded_n();
  for (Index idx = blockIdx.x * Index(blockDim.x) + threadIdx.x; idx < rows * nrhs;
       idx += Index(gridDim.x) * blockDim.x) {
    const Index r = idx % rows;
    const Index c = idx / rows;
    const Index original = layout.original_index(r);
    T value = zero<T>();
    if (original >= 0) {
      const Index owner = original / layout.rows_per_part;
      const Index local = original - owner * layout.rows_per_part;
      value = maybe_conj(static_cast<const T*>(shards.data[owner])[local * nrhs + c], conjugate);
    }
    dst[c * ld + r] = value;
  }
}

template <typename T>
__global__ void scatter_solution_kernel(const T* src, Index ld, T* x, BlockCyclicLayout layout,
                                        Index part, Index nrhs, bool conjugate) {
  const Index count = layout.rows_per_part * nrhs;
  for (Index idx = blockIdx.x * Index(blockDim.x) + threadIdx.x; idx < count;
       idx += Index(gridDim.x) * blockDim.x) {
    const Index i = idx / nrhs;
    const Index c = idx - i * nrhs;
    const Index s = layout.solver_index(part * layout.rows_per_part + i);
    x[idx] = maybe_conj(src[c * ld + s], conjugate);
  }
}

// Block (x: kTile solver rows r, y: kTile local columns) of a general A' = Π A Πᵀ: element
// (r, g), g the local column's solver index, is A[original(r), original(g)], read from the row
// block of the part that holds original row r. Loaded along the local columns (contiguous in
// that row), stored along r (contiguous in the working column).
template <typename T>
__global__ void columns_to_solver_order_kernel(PartPointers shards, Index shard_ld,
                                               Index shard_column0, T* dst, Index ld,
                                               BlockCyclicLayout layout, Index part,
                                               T pad_diagonal) {
  __shared__ T tile[kTile][kTile + 1];
  const Index r0 = Index(blockIdx.x) * kTile;
  const Index l0 = Index(blockIdx.y) * kTile;
  const Index rows = layout.padded_n();
  const Index locals = layout.local_columns();
  for (int j = threadIdx.y; j < kTile; j += kTileRows) {
    const Index r = r0 + j;
    const Index local = l0 + threadIdx.x;
    if (r < rows && local < locals) {
      const Index original_row = layout.original_index(r);
      T value = r == layout.solver_index_of_local(part, local) ? pad_diagonal : zero<T>();
      if (original_row >= 0 && local < layout.rows_per_part) {
        const Index owner = original_row / layout.rows_per_part;
        const T* row = static_cast<const T*>(shards.data[owner]) +
                       (original_row - owner * layout.rows_per_part) * shard_ld;
        value = row[shard_column0 + local];
      }
      tile[j][threadIdx.x] = value;
    }
  }
  __syncthreads();
  for (int j = threadIdx.y; j < kTile; j += kTileRows) {
    const Index local = l0 + j;
    const Index r = r0 + threadIdx.x;
    if (r < rows && local < locals) dst[local * ld + r] = tile[threadIdx.x][j];
  }
}

// Block (x: kTile solver rows r, y: kTile local columns) of the strict upper triangle: element
// (r, g) with g the local column's solver index and r < g becomes conj(M[g, r]), which is row g of
// solver column r (held by owner(r)). Loaded along g (contiguous in column r), stored along r.
template <typename T>
__global__ void mirror_lower_to_upper_kernel(PartPointers working, Index ld,
                                             BlockCyclicLayout layout, Index part) {
  __shared__ T tile[kTile][kTile + 1];
  const Index r0 = Index(blockIdx.x) * kTile;
  const Index l0 = Index(blockIdx.y) * kTile;
  const Index rows = layout.padded_n();
  const Index locals = layout.local_columns();
  for (int j = threadIdx.y; j < kTile; j += kTileRows) {
    const Index r = r0 + j;
    const Index local = l0 + threadIdx.x;
    if (r < rows && local < locals) {
      const Index g = layout.solver_index_of_local(part, local);
      if (r < g) {
        const T* column = static_cast<const T*>(working.data[layout.owner_of_solver(r)]) +
                          layout.local_of_solver(r) * ld;
        tile[j][threadIdx.x] = Element<T>::conj(column[g]);
      }
    }
  }
  __syncthreads();
  T* own = static_cast<T*>(working.data[part]);
  for (int j = threadIdx.y; j < kTile; j += kTileRows) {
    const Index local = l0 + j;
    const Index r = r0 + threadIdx.x;
    if (r < rows && local < locals && r < layout.solver_index_of_local(part, local)) {
      own[local * ld + r] = tile[threadIdx.x][j];
    }
  }
}

// Block (x: kTile eigenvector columns c, y: kTile rows i of the part's block of V): loaded along
// the solver rows of column c (contiguous), stored along c (contiguous in the row-major output).
template <typename T>
__global__ void gather_eigenvectors_kernel(PartPointers working, Index ld, T* out,
                                           BlockCyclicLayout layout, Index part, bool conjugate) {
  __shared__ T tile[kTile][kTile + 1];
  const Index c0 = Index(blockIdx.x) * kTile;
  const Index i0 = Index(blockIdx.y) * kTile;
  const Index n = layout.n;
  for (int j = threadIdx.y; j < kTile; j += kTileRows) {
    const Index c = c0 + j;
    const Index i = i0 + threadIdx.x;
    if (c < n && i < layout.rows_per_part) {
      const T* column = static_cast<const T*>(working.data[layout.owner_of_solver(c)]) +
                        layout.local_of_solver(c) * ld;
      tile[j][threadIdx.x] =
          maybe_conj(column[layout.solver_index(part * layout.rows_per_part + i)], conjugate);
    }
  }
  __syncthreads();
  for (int j = threadIdx.y; j < kTile; j += kTileRows) {
    const Index i = i0 + j;
    const Index c = c0 + threadIdx.x;
    if (c < n && i < layout.rows_per_part) out[i * n + c] = tile[threadIdx.x][j];
  }
}

template <typename T>
__global__ void sum_log_diagonal_kernel(const T* working, Index ld, BlockCyclicLayout layout,
                                        Index part, double* result) {
  using Reduce = cub::BlockReduce<double, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  double sum = 0.0;
  for (Index local = threadIdx.x; local < layout.local_columns(); local += blockDim.x) {
    // Padding columns hold 1 on the diagonal: log 1 = 0.
    sum += log(Element<T>::real(working[local * ld + layout.solver_index_of_local(part, local)]));
  }
  const double total = Reduce(storage).Sum(sum);
  if (threadIdx.x == 0) *result = total;
}

template <typename T>
__global__ void mark_zero_pivot_kernel(const T* working, Index ld, BlockCyclicLayout layout,
                                       Index part, int* info) {
  __shared__ int first;
  if (threadIdx.x == 0) first = INT_MAX;
  __syncthreads();
  for (Index local = threadIdx.x; local < layout.local_columns(); local += blockDim.x) {
    // Padding columns hold 1 on the diagonal.
    const Index j = layout.solver_index_of_local(part, local);
    if (Element<T>::abs(working[local * ld + j]) == 0.0) atomicMin(&first, static_cast<int>(j));
  }
  __syncthreads();
  if (threadIdx.x == 0 && *info == 0 && first != INT_MAX) *info = first + 1;
}

template <typename T>
__global__ void max_abs_row_sum_kernel(const T* shard, Index rows, Index n, double* result) {
  using Reduce = cub::BlockReduce<double, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  for (Index row = blockIdx.x; row < rows; row += gridDim.x) {
    double sum = 0.0;
    for (Index q = threadIdx.x; q < n; q += blockDim.x) sum += Element<T>::abs(shard[row * n + q]);
    const double total = Reduce(storage).Sum(sum);
    // Non-negative doubles order like their bit patterns, so an integer max is a double max.
    if (threadIdx.x == 0) {
      atomicMax(reinterpret_cast<unsigned long long*>(result),
                static_cast<unsigned long long>(__double_as_longlong(total)));
    }
    __syncthreads();  // the reduction's storage is reused by the next row
  }
}

template <typename T>
__global__ void fill_nan_kernel(T* data, Index count) {
  for (Index idx = blockIdx.x * Index(blockDim.x) + threadIdx.x; idx < count;
       idx += Index(gridDim.x) * blockDim.x) {
    data[idx] = Element<T>::nan();
  }
}

template <typename Function>
void dispatch(DType dtype, const char* what, Function&& function) {
  switch (dtype) {
    case DType::kFloat32:
      return function(float{});
    case DType::kFloat64:
      return function(double{});
    case DType::kComplex64:
      return function(cuFloatComplex{});
    case DType::kComplex128:
      return function(cuDoubleComplex{});
    default:
      MESHLA_THROW(kInvalidArgument, what << ": dtype " << dtype_name(dtype)
                                          << " is not float32, float64, complex64 or complex128");
  }
}

// The conversions' grid: segments of the solver order along x, columns along y.
dim3 segment_grid(const BlockCyclicLayout& layout, Index columns) {
  return dim3(static_cast<unsigned>(std::clamp<Index>(segment_count(layout), 1, 4096)),
              static_cast<unsigned>(std::clamp<Index>(columns, 1, 16384)));
}

}  // namespace

void rows_to_solver_order(DType dtype, const void* src, Index src_ld, void* dst, Index dst_ld,
                          const BlockCyclicLayout& layout, Index part, Index first, Index columns,
                          double pad_diagonal, cudaStream_t stream) {
  if (columns == 0) return;
  dispatch(dtype, "rows_to_solver_order", [&](auto type) {
    using T = decltype(type);
    rows_to_solver_order_kernel<T><<<segment_grid(layout, columns), kThreads, 0, stream>>>(
        static_cast<const T*>(src), src_ld, static_cast<T*>(dst), dst_ld, layout, part, first,
        columns, Element<T>::of_real(pad_diagonal));
  });
  MESHLA_CHECK_CUDA(cudaGetLastError());
}

void columns_to_solver_order(DType dtype, const PartPointers& shards, Index shard_ld,
                             Index shard_column0, void* dst, Index ld,
                             const BlockCyclicLayout& layout, Index part, double pad_diagonal,
                             cudaStream_t stream) {
  const Index row_tiles = (layout.padded_n() + kTile - 1) / kTile;
  const Index column_tiles = (layout.local_columns() + kTile - 1) / kTile;
  MESHLA_CHECK_ARG(column_tiles <= kMaxGridY,
                   "columns_to_solver_order: " << layout.local_columns()
                                               << " local columns exceed the kernel's grid");
  dispatch(dtype, "columns_to_solver_order", [&](auto type) {
    using T = decltype(type);
    columns_to_solver_order_kernel<T>
        <<<dim3(static_cast<unsigned>(row_tiles), static_cast<unsigned>(column_tiles)),
           dim3(kTile, kTileRows), 0, stream>>>(shards, shard_ld, shard_column0,
                                                static_cast<T*>(dst), ld, layout, part,
                                                Element<T>::of_real(pad_diagonal));
  });
  MESHLA_CHECK_CUDA(cudaGetLastError());
}

void rows_to_original_order(DType dtype, const void* src, Index src_ld, void* dst, Index dst_ld,
                            const BlockCyclicLayout& layout, Index columns, cudaStream_t stream) {
  if (columns == 0) return;
  dispatch(dtype, "rows_to_original_order", [&](auto type) {
    using T = decltype(type);
    rows_to_original_order_kernel<T><<<segment_grid(layout, columns), kThreads, 0, stream>>>(
        static_cast<const T*>(src), src_ld, static_cast<T*>(dst), dst_ld, layout, columns);
  });
  MESHLA_CHECK_CUDA(cudaGetLastError());
}

void gather_rhs(DType dtype, const PartPointers& shards, void* dst, Index ld,
                const BlockCyclicLayout& layout, Index nrhs, bool conjugate, cudaStream_t stream) {
  dispatch(dtype, "gather_rhs", [&](auto type) {
    using T = decltype(type);
    gather_rhs_kernel<T><<<blocks_for(layout.padded_n() * nrhs, 4096), kThreads, 0, stream>>>(
        shards, static_cast<T*>(dst), ld, layout, nrhs, conjugate);
  });
  MESHLA_CHECK_CUDA(cudaGetLastError());
}

void scatter_solution(DType dtype, const void* src, Index ld, void* x,
                      const BlockCyclicLayout& layout, Index part, Index nrhs, bool conjugate,
                      cudaStream_t stream) {
  dispatch(dtype, "scatter_solution", [&](auto type) {
    using T = decltype(type);
    scatter_solution_kernel<T>
        <<<blocks_for(layout.rows_per_part * nrhs, 4096), kThreads, 0, stream>>>(
            static_cast<const T*>(src), ld, static_cast<T*>(x), layout, part, nrhs, conjugate);
  });
  MESHLA_CHECK_CUDA(cudaGetLastError());
}

void mirror_lower_to_upper(DType dtype, const PartPointers& working, Index ld,
                           const BlockCyclicLayout& layout, Index part, cudaStream_t stream) {
  const Index row_tiles = (layout.padded_n() + kTile - 1) / kTile;
  const Index column_tiles = (layout.local_columns() + kTile - 1) / kTile;
  MESHLA_CHECK_ARG(column_tiles <= kMaxGridY,
                   "mirror_lower_to_upper: " << layout.local_columns()
                                             << " local columns exceed the kernel's grid");
  dispatch(dtype, "mirror_lower_to_upper", [&](auto type) {
    using T = decltype(type);
    mirror_lower_to_upper_kernel<T>
        <<<dim3(static_cast<unsigned>(row_tiles), static_cast<unsigned>(column_tiles)),
           dim3(kTile, kTileRows), 0, stream>>>(working, ld, layout, part);
  });
  MESHLA_CHECK_CUDA(cudaGetLastError());
}

void gather_eigenvectors(DType dtype, const PartPointers& working, Index ld, void* out,
                         const BlockCyclicLayout& layout, Index part, bool conjugate,
                         cudaStream_t stream) {
  const Index column_tiles = (layout.n + kTile - 1) / kTile;
  const Index row_tiles = (layout.rows_per_part + kTile - 1) / kTile;
  MESHLA_CHECK_ARG(row_tiles <= kMaxGridY,
                   "gather_eigenvectors: " << layout.rows_per_part << " rows exceed the grid");
  dispatch(dtype, "gather_eigenvectors", [&](auto type) {
    using T = decltype(type);
    gather_eigenvectors_kernel<T>
        <<<dim3(static_cast<unsigned>(column_tiles), static_cast<unsigned>(row_tiles)),
           dim3(kTile, kTileRows), 0, stream>>>(working, ld, static_cast<T*>(out), layout, part,
                                                conjugate);
  });
  MESHLA_CHECK_CUDA(cudaGetLastError());
}

void sum_log_diagonal(DType dtype, const void* working, Index ld, const BlockCyclicLayout& layout,
                      Index part, double* result, cudaStream_t stream) {
  dispatch(dtype, "sum_log_diagonal", [&](auto type) {
    using T = decltype(type);
    sum_log_diagonal_kernel<T>
        <<<1, kThreads, 0, stream>>>(static_cast<const T*>(working), ld, layout, part, result);
  });
  MESHLA_CHECK_CUDA(cudaGetLastError());
}

void mark_zero_pivot(DType dtype, const void* working, Index ld, const BlockCyclicLayout& layout,
                     Index part, int* info, cudaStream_t stream) {
  dispatch(dtype, "mark_zero_pivot", [&](auto type) {
    using T = decltype(type);
    mark_zero_pivot_kernel<T>
        <<<1, kThreads, 0, stream>>>(static_cast<const T*>(working), ld, layout, part, info);
  });
  MESHLA_CHECK_CUDA(cudaGetLastError());
}

void max_abs_row_sum(DType dtype, const void* shard, Index rows, Index n, double* result,
                     cudaStream_t stream) {
  dispatch(dtype, "max_abs_row_sum", [&](auto type) {
    using T = decltype(type);
    max_abs_row_sum_kernel<T>
        <<<static_cast<unsigned>(std::clamp<Index>(rows, 1, 4096)), kThreads, 0, stream>>>(
            static_cast<const T*>(shard), rows, n, result);
  });
  MESHLA_CHECK_CUDA(cudaGetLastError());
}

void fill_nan(DType dtype, void* data, Index count, cudaStream_t stream) {
  if (count == 0) return;
  dispatch(dtype, "fill_nan", [&](auto type) {
    using T = decltype(type);
    fill_nan_kernel<T>
        <<<blocks_for(count, 4096), kThreads, 0, stream>>>(static_cast<T*>(data), count);
  });
  MESHLA_CHECK_CUDA(cudaGetLastError());
}

}  // namespace meshla::solver
