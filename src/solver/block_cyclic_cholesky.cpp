#include "solver/block_cyclic_cholesky.hpp"

#include <cublas_v2.h>
#include <cusolverDn.h>

#include <algorithm>
#include <array>
#include <utility>

#include "core/alignment.hpp"
#include "core/cuda_checks.hpp"
#include "core/cuda_handles.hpp"
#include "core/cuda_types.hpp"
#include "solver/cusolver_checks.hpp"
#include "solver/solver_validation.hpp"

namespace meshla::solver {
namespace {

using detail::align_up;

bool is_double_precision(DType dtype) {
  return dtype == DType::kFloat64 || dtype == DType::kComplex128;
}

// -1 and 1 as the GEMM's and trsm's scalar type (a complex scalar is two reals, real part first).
struct Scalars {
  std::array<double, 2> minus_one64{-1.0, 0.0}, one64{1.0, 0.0};
  std::array<float, 2> minus_one32{-1.0f, 0.0f}, one32{1.0f, 0.0f};
  const void* minus_one(DType dtype) const {
    return is_double_precision(dtype) ? static_cast<const void*>(minus_one64.data())
                                      : static_cast<const void*>(minus_one32.data());
  }
  const void* one(DType dtype) const {
    return is_double_precision(dtype) ? static_cast<const void*>(one64.data())
                                      : static_cast<const void*>(one32.data());
  }
};

// B := B L⁻ᴴ for the lower-triangular L (the rows of a panel below its diagonal tile).
void solve_right_adjoint(cublasHandle_t handle, DType dtype, int rows, int columns,
                         const void* lower, int ld_lower, void* b, int ld_b) {
  const Scalars scalars;
  const cublasSideMode_t side = CUBLAS_SIDE_RIGHT;
  const cublasFillMode_t fill = CUBLAS_FILL_MODE_LOWER;
  const cublasOperation_t op = is_complex(dtype) ? CUBLAS_OP_C : CUBLAS_OP_T;
  const cublasDiagType_t diag = CUBLAS_DIAG_NON_UNIT;
  switch (dtype) {
    case DType::kFloat32:
      MESHLA_CHECK_CUBLAS(cublasStrsm(handle, side, fill, op, diag, rows, columns,
                                      static_cast<const float*>(scalars.one(dtype)),
                                      static_cast<const float*>(lower), ld_lower,
                                      static_cast<float*>(b), ld_b));
      return;
    case DType::kFloat64:
      MESHLA_CHECK_CUBLAS(cublasDtrsm(handle, side, fill, op, diag, rows, columns,
                                      static_cast<const double*>(scalars.one(dtype)),
                                      static_cast<const double*>(lower), ld_lower,
                                      static_cast<double*>(b), ld_b));
      return;
    case DType::kComplex64:
      MESHLA_CHECK_CUBLAS(cublasCtrsm(handle, side, fill, op, diag, rows, columns,
                                      static_cast<const cuComplex*>(scalars.one(dtype)),
                                      static_cast<const cuComplex*>(lower), ld_lower,
                                      static_cast<cuComplex*>(b), ld_b));
      return;
    case DType::kComplex128:
      MESHLA_CHECK_CUBLAS(cublasZtrsm(handle, side, fill, op, diag, rows, columns,
                                      static_cast<const cuDoubleComplex*>(scalars.one(dtype)),
                                      static_cast<const cuDoubleComplex*>(lower), ld_lower,
                                      static_cast<cuDoubleComplex*>(b), ld_b));
      return;
    default:
      MESHLA_THROW(kInvalidArgument,
                   "cholesky: dtype " << dtype_name(dtype) << " is not supported");
  }
}

}  // namespace

CholeskyWorkspace cholesky_workspace(DType dtype, const BlockCyclicLayout& layout,
                                     std::size_t potrf_bytes) {
  const std::size_t element = dtype_size(dtype);
  CholeskyWorkspace w;
  std::size_t offset = 0;
  w.panels = offset;
  offset += 2 * align_up(static_cast<std::size_t>(layout.padded_n() * layout.tile) * element);
  w.potrf = offset;
  offset += align_up(std::max<std::size_t>(potrf_bytes, 1));
  w.pivots = offset;
  offset += align_up(static_cast<std::size_t>(layout.tiles_per_part) * sizeof(int));
  w.total = offset;
  return w;
}

std::vector<CholeskyStep> cholesky_schedule(const BlockCyclicLayout& layout) {
  using Kind = CholeskyStep::Kind;
  const int parts = static_cast<int>(layout.parts);
  const std::int64_t tiles = layout.parts * layout.tiles_per_part;
  auto owner = [&](std::int64_t k) { return static_cast<int>(k % parts); };
  std::vector<CholeskyStep> steps{{Kind::kFactor, owner(0), 0}};
  for (std::int64_t k = 0; k < tiles; ++k) {
    for (int p = 0; p < parts; ++p) {
      if (p != owner(k)) steps.push_back({Kind::kCopy, p, k});
    }
    for (int p = 0; p < parts; ++p) {
      // Look-ahead: the next panel's tile is updated and factored before the rest of step k.
      const bool owns_next = k + 1 < tiles && owner(k + 1) == p;
      if (owns_next) {
        steps.push_back({Kind::kUpdate, p, k, k + 1});
        steps.push_back({Kind::kFactor, p, k + 1});
      }
      // The part's other tiles after k: global tiles p, p + parts, ... past k (+1 if done).
      std::int64_t j = (k + 1) + ((p - (k + 1)) % parts + parts) % parts;
      if (owns_next) j += parts;
      for (; j < tiles; j += parts) steps.push_back({Kind::kUpdate, p, k, j});
      if (p != owner(k)) steps.push_back({Kind::kRelease, p, k});
    }
  }
  return steps;
}

int first_failed_pivot(const BlockCyclicLayout& layout,
                       const std::vector<std::vector<int>>& pivots) {
  const std::int64_t tiles = layout.parts * layout.tiles_per_part;
  for (std::int64_t k = 0; k < tiles; ++k) {
    const int info = pivots[static_cast<std::size_t>(k % layout.parts)]
                           [static_cast<std::size_t>(k / layout.parts)];
    if (info > 0) return static_cast<int>(k * layout.tile + info);
  }
  return 0;
}

// One part's GPU: its handles, a copy stream, and the events that order panels and buffers.
struct Part {
  explicit Part(int device)
      : device(device),
        copies(device, /*high_priority=*/true),
        started(device),
        panel_ready(device),
        copied{detail::Event(device), detail::Event(device)},
        consumed{detail::Event(device), detail::Event(device)} {
    detail::DeviceGuard guard(device);
    MESHLA_CHECK_CUBLAS(cublasCreate(&blas));
    MESHLA_CHECK_CUSOLVER(cusolverDnCreate(&dense));
    MESHLA_CHECK_CUSOLVER(cusolverDnCreateParams(&params));
  }
  ~Part() {
    detail::DeviceGuard guard(device);
    if (params != nullptr) cusolverDnDestroyParams(params);
    if (dense != nullptr) cusolverDnDestroy(dense);
    if (blas != nullptr) cublasDestroy(blas);
  }
  Part(const Part&) = delete;
  Part& operator=(const Part&) = delete;

  int device;
  cublasHandle_t blas = nullptr;
  cusolverDnHandle_t dense = nullptr;
  cusolverDnParams_t params = nullptr;
  detail::Stream copies;
  detail::Event started;      // the caller's stream reached the factorization
  detail::Event panel_ready;  // this part's latest panel is factored
  detail::Event copied[2];    // panel buffer s holds its panel
  detail::Event consumed[2];  // the updates that read panel buffer s are enqueued before this
  std::vector<char> host_workspace;
};

struct BlockCyclicCholesky::Impl {
  std::vector<std::unique_ptr<Part>> parts;

  // One GPU holds the whole matrix in one column-major array: cusolverDn factors it in one call.
  // Otherwise cusolverDn factors one diagonal tile at a time.
  std::int64_t potrf_order(const BlockCyclicLayout& layout) const {
    return parts.size() == 1 ? layout.padded_n() : layout.tile;
  }

  std::size_t potrf_bytes(DType dtype, const BlockCyclicLayout& layout, std::size_t* host_bytes) {
    Part& part = *parts.front();
    detail::DeviceGuard guard(part.device);
    const cudaDataType type = detail::cuda_data_type(dtype);
    std::size_t device_bytes = 0;
    MESHLA_CHECK_CUSOLVER(cusolverDnXpotrf_bufferSize(
        part.dense, part.params, CUBLAS_FILL_MODE_LOWER, potrf_order(layout), type, nullptr,
        layout.padded_n(), type, &device_bytes, host_bytes));
    return device_bytes;
  }
};

BlockCyclicCholesky::BlockCyclicCholesky(const std::vector<int>& devices)
    : impl_(std::make_unique<Impl>()) {
  for (int device : devices) impl_->parts.push_back(std::make_unique<Part>(device));
}

BlockCyclicCholesky::~BlockCyclicCholesky() = default;
BlockCyclicCholesky::BlockCyclicCholesky(BlockCyclicCholesky&&) noexcept = default;
BlockCyclicCholesky& BlockCyclicCholesky::operator=(BlockCyclicCholesky&&) noexcept = default;

CholeskyWorkspace BlockCyclicCholesky::workspace(DType dtype,
                                                 const BlockCyclicLayout& layout) const {
  std::size_t host_bytes = 0;
  return cholesky_workspace(dtype, layout, impl_->potrf_bytes(dtype, layout, &host_bytes));
}

int BlockCyclicCholesky::factor(DType dtype, const PartPointers& working,
                                const BlockCyclicLayout& layout,
                                const std::vector<void*>& workspaces,
                                const std::vector<cudaStream_t>& streams) {
  std::vector<std::unique_ptr<Part>>& parts = impl_->parts;
  const int count = static_cast<int>(parts.size());
  MESHLA_CHECK_ARG(layout.parts == count && static_cast<int>(workspaces.size()) == count &&
                       static_cast<int>(streams.size()) == count,
                   "cholesky: " << layout.parts << " layout parts, " << workspaces.size()
                                << " workspaces and " << streams.size() << " streams for " << count
                                << " GPUs");
  std::size_t host_bytes = 0;
  const std::size_t potrf_bytes = impl_->potrf_bytes(dtype, layout, &host_bytes);
  const CholeskyWorkspace w = cholesky_workspace(dtype, layout, potrf_bytes);
  const std::size_t element = dtype_size(dtype);
  const std::int64_t ld = layout.padded_n();
  const std::int64_t tile = layout.tile;
  const cudaDataType type = detail::cuda_data_type(dtype);
  const cublasComputeType_t compute =
      is_double_precision(dtype) ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F;
  const cublasOperation_t adjoint = is_complex(dtype) ? CUBLAS_OP_C : CUBLAS_OP_T;
  const Scalars scalars;

  auto owner = [&](std::int64_t k) { return static_cast<int>(k % count); };
  auto local_column = [&](std::int64_t k) { return k / count * tile; };
  // Element (row, local column) of a part's working array.
  auto at = [&](int part, std::int64_t row, std::int64_t column) {
    return static_cast<char*>(working.data[part]) +
           (column * ld + row) * static_cast<std::int64_t>(element);
  };
  auto buffer = [&](int part, std::int64_t k) {
    return static_cast<char*>(workspaces[part]) + w.panels +
           (k % 2) * align_up(static_cast<std::size_t>(ld * tile) * element);
  };
  // Row k*tile of panel k as `part` reads it (leading dimension ld either way): the owner's own
  // columns, or the copy in a panel buffer, whose row 0 is row k*tile.
  auto panel = [&](int part, std::int64_t k) {
    return part == owner(k) ? at(part, k * tile, local_column(k)) : buffer(part, k);
  };

  for (int p = 0; p < count; ++p) {
    Part& part = *parts[p];
    detail::DeviceGuard guard(part.device);
    MESHLA_CHECK_CUBLAS(cublasSetStream(part.blas, streams[p]));
    MESHLA_CHECK_CUSOLVER(cusolverDnSetStream(part.dense, streams[p]));
    part.host_workspace.resize(std::max<std::size_t>(host_bytes, 1));
    // Panel buffers are rewritten only after the caller's earlier work on this stream.
    MESHLA_CHECK_CUDA(cudaEventRecord(part.started.get(), streams[p]));
    MESHLA_CHECK_CUDA(cudaStreamWaitEvent(part.copies.get(), part.started.get(), 0));
  }

  if (count == 1) {
    Part& part = *parts.front();
    detail::DeviceGuard guard(part.device);
    int* info = reinterpret_cast<int*>(static_cast<char*>(workspaces[0]) + w.pivots);
    MESHLA_CHECK_CUSOLVER(cusolverDnXpotrf(part.dense, part.params, CUBLAS_FILL_MODE_LOWER, ld,
                                           type, working.data[0], ld, type,
                                           static_cast<char*>(workspaces[0]) + w.potrf, potrf_bytes,
                                           part.host_workspace.data(), host_bytes, info));
    int host_info = 0;
    MESHLA_CHECK_CUDA(
        cudaMemcpyAsync(&host_info, info, sizeof(int), cudaMemcpyDeviceToHost, streams[0]));
    MESHLA_CHECK_CUDA(cudaStreamSynchronize(streams[0]));
    return host_info;
  }

  auto factor_tile = [&](std::int64_t k) {
    const int o = owner(k);
    Part& part = *parts[o];
    char* diagonal = at(o, k * tile, local_column(k));
    int* info = reinterpret_cast<int*>(static_cast<char*>(workspaces[o]) + w.pivots) + k / count;
    MESHLA_CHECK_CUSOLVER(cusolverDnXpotrf(part.dense, part.params, CUBLAS_FILL_MODE_LOWER, tile,
                                           type, diagonal, ld, type,
                                           static_cast<char*>(workspaces[o]) + w.potrf, potrf_bytes,
                                           part.host_workspace.data(), host_bytes, info));
    const std::int64_t below = ld - (k + 1) * tile;
    if (below > 0) {
      solve_right_adjoint(part.blas, dtype, static_cast<int>(below), static_cast<int>(tile),
                          diagonal, static_cast<int>(ld), diagonal + tile * element,
                          static_cast<int>(ld));
    }
    MESHLA_CHECK_CUDA(cudaEventRecord(part.panel_ready.get(), streams[o]));
  };
  // Tile column j of part p minus L[j*tile:, k] L[j*tile : (j+1)*tile, k]ᴴ.
  auto update = [&](int p, std::int64_t k, std::int64_t j) {
    const char* source = panel(p, k) + (j - k) * tile * static_cast<std::int64_t>(element);
    MESHLA_CHECK_CUBLAS(cublasGemmEx(parts[p]->blas, CUBLAS_OP_N, adjoint,
                                     static_cast<int>(ld - j * tile), static_cast<int>(tile),
                                     static_cast<int>(tile), scalars.minus_one(dtype), source, type,
                                     static_cast<int>(ld), source, type, static_cast<int>(ld),
                                     scalars.one(dtype), at(p, j * tile, local_column(j)), type,
                                     static_cast<int>(ld), compute, CUBLAS_GEMM_DEFAULT));
  };

  for (const CholeskyStep& step : cholesky_schedule(layout)) {
    const int p = step.part;
    const std::int64_t k = step.k;
    const int slot = static_cast<int>(k % 2);
    Part& part = *parts[p];
    detail::DeviceGuard guard(part.device);
    switch (step.kind) {
      case CholeskyStep::Kind::kFactor:
        factor_tile(k);
        break;
      case CholeskyStep::Kind::kCopy: {
        // On the copy stream, once the buffer's last readers and the panel are done.
        const int o = owner(k);
        cudaStream_t copies = part.copies.get();
        MESHLA_CHECK_CUDA(cudaStreamWaitEvent(copies, part.consumed[slot].get(), 0));
        MESHLA_CHECK_CUDA(cudaStreamWaitEvent(copies, parts[o]->panel_ready.get(), 0));
        const std::size_t pitch = static_cast<std::size_t>(ld) * element;
        const std::size_t width = static_cast<std::size_t>(ld - k * tile) * element;
        cudaMemcpy3DPeerParms copy = {};
        copy.srcPtr = make_cudaPitchedPtr(at(o, k * tile, local_column(k)), pitch, width,
                                          static_cast<std::size_t>(tile));
        copy.srcDevice = parts[o]->device;
        copy.dstPtr =
            make_cudaPitchedPtr(buffer(p, k), pitch, width, static_cast<std::size_t>(tile));
        copy.dstDevice = part.device;
        copy.extent = make_cudaExtent(width, static_cast<std::size_t>(tile), 1);
        MESHLA_CHECK_CUDA(cudaMemcpy3DPeerAsync(&copy, copies));
        MESHLA_CHECK_CUDA(cudaEventRecord(part.copied[slot].get(), copies));
        MESHLA_CHECK_CUDA(cudaStreamWaitEvent(streams[p], part.copied[slot].get(), 0));
        break;
      }
      case CholeskyStep::Kind::kUpdate:
        update(p, k, step.j);
        break;
      case CholeskyStep::Kind::kRelease:
        MESHLA_CHECK_CUDA(cudaEventRecord(part.consumed[slot].get(), streams[p]));
        break;
    }
  }

  std::vector<std::vector<int>> pivots(static_cast<std::size_t>(count));
  for (int p = 0; p < count; ++p) {
    detail::DeviceGuard guard(parts[p]->device);
    pivots[p].resize(static_cast<std::size_t>(layout.tiles_per_part));
    MESHLA_CHECK_CUDA(
        cudaMemcpyAsync(pivots[p].data(), static_cast<char*>(workspaces[p]) + w.pivots,
                        pivots[p].size() * sizeof(int), cudaMemcpyDeviceToHost, streams[p]));
  }
  for (int p = 0; p < count; ++p) {
    detail::DeviceGuard guard(parts[p]->device);
    MESHLA_CHECK_CUDA(cudaStreamSynchronize(streams[p]));
  }
  return first_failed_pivot(layout, pivots);
}

cusolverDnHandle_t BlockCyclicCholesky::dense_handle(int part) const {
  return impl_->parts.at(static_cast<std::size_t>(part))->dense;
}

cusolverDnParams_t BlockCyclicCholesky::dense_params(int part) const {
  return impl_->parts.at(static_cast<std::size_t>(part))->params;
}

}  // namespace meshla::solver
