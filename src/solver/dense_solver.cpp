// cuSolverMg is deprecated in CUDA 13 but still shipped, and it is the only multi-GPU dense
// solver in the toolkit that one thread can drive over the GPUs of one process (issue 5 chose it).
#define DISABLE_CUSOLVERMG_DEPRECATED

#include "meshla/dense_solver.hpp"

#include <cusolverDn.h>
#include <cusolverMg.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <complex>
#include <cstdint>
#include <mutex>
#include <optional>
#include <set>
#include <string>

#include "core/alignment.hpp"
#include "core/cuda_checks.hpp"
#include "core/cuda_handles.hpp"
#include "core/cuda_types.hpp"
#include "solver/block_cyclic.hpp"
#include "solver/block_cyclic_cholesky.hpp"
#include "solver/cusolver_checks.hpp"
#include "solver/solver_kernels.hpp"
#include "solver/solver_validation.hpp"

namespace meshla {
namespace {

using solver::BlockCyclicLayout;
using solver::is_complex;
using solver::PartPointers;
using solver::real_dtype;

using detail::align_up;

// Owns a cuSolverMg matrix descriptor.
class MatrixDescriptor {
 public:
  MatrixDescriptor(std::int64_t rows, std::int64_t columns, std::int64_t column_tile, DType dtype,
                   cudaLibMgGrid_t grid) {
    MESHLA_CHECK_CUSOLVER(cusolverMgCreateMatrixDesc(&descriptor_, rows, columns, rows, column_tile,
                                                     detail::cuda_data_type(dtype), grid));
  }
  ~MatrixDescriptor() { cusolverMgDestroyMatrixDesc(descriptor_); }
  MatrixDescriptor(const MatrixDescriptor&) = delete;
  MatrixDescriptor& operator=(const MatrixDescriptor&) = delete;
  cudaLibMgMatrixDesc_t get() const { return descriptor_; }

 private:
  cudaLibMgMatrixDesc_t descriptor_ = nullptr;
};

// Where one call's pieces live in a part's workspace, and where the solver works.
struct WorkspaceLayout {
  std::size_t solver = 0;   // cuSolverMg's own workspace, lwork elements
  std::size_t factor = 0;   // meshla's Cholesky factorization (CholeskyWorkspace)
  std::size_t working = 0;  // the working array, when it is neither `a` nor `out`
  std::size_t panel = 0;    // one tile of columns, for shuffling rows in place
  std::size_t rhs = 0;      // B' on part 0
  std::size_t pivots = 0;   // getrf's pivots (the LU solve): the part's, or on one GPU all n
  std::size_t scalars = 0;  // two float64 reductions
  // The first GPU's cusolverDn call (runs_cusolver_dn): the whole matrix gathered from the other
  // GPUs (the inverse over several), the call's workspace, the eigenvalues it writes to the device,
  // and its info.
  std::size_t gathered = 0;
  std::size_t dense = 0;
  std::size_t dense_bytes = 0;       // its device workspace's size
  std::size_t dense_host_bytes = 0;  // and its host workspace's
  std::size_t values = 0;
  std::size_t info = 0;
  std::size_t total = 0;
};

// Where the solver's working array is: A's shards (overwrite_a), the inverse's output, or the
// workspace. In place (working == a or out) needs n/P to be a multiple of the tile (no padding).
enum class Working { kA, kOut, kWorkspace };

bool uses_meshla_cholesky(SolverOp op, const SolverProblem& problem) {
  return (op == SolverOp::kCholeskySolve || op == SolverOp::kCholeskyInverse) &&
         problem.cholesky == CholeskyFactorization::kMeshla;
}

bool is_eigen(SolverOp op) { return op == SolverOp::kEigen || op == SolverOp::kEigenvalues; }

cusolverEigMode_t eigen_mode(SolverOp op) {
  return op == SolverOp::kEigen ? CUSOLVER_EIG_MODE_VECTOR : CUSOLVER_EIG_MODE_NOVECTOR;
}

// Whether the op's routine after the factorization runs cusolverDn's on the first GPU instead of
// cuSolverMg's over all of them (the LU solve: its factorization too, on one GPU). The inverse
// always does (solver_layout bounds its size): cuSolverMg's potri returns wrong inverses on several
// GPUs once n passes 2048 (2x H200, CUDA 13.0, 2026-11-27: residual 0.7 to 3.2 at n=3072 to 8192,
// whichever factorization, tile and padding), so over several GPUs the factor is gathered onto the
// first; on one, cusolverDn's potri was the faster anyway (0.27 s against 0.35 s at n=16384, one
// H100). On one GPU also the solve after meshla's factorization (cuSolverMg's potrs took a quarter
// longer at n=16384 and synchronised the host after every tile) and the eigensolver (cuSolverMg's
// syevd took 1.71 s at n=8192, cusolverDn's 0.61 s).
bool runs_cusolver_dn(SolverOp op, const SolverProblem& problem, const BlockCyclicLayout& layout) {
  if (op == SolverOp::kCholeskyInverse) return true;
  if (layout.parts != 1) return false;
  return is_eigen(op) || uses_meshla_cholesky(op, problem) || op == SolverOp::kLuSolve;
}

// Whether cuSolverMg factors A (the reference factorization, cholesky=cusolvermg).
bool factors_with_cusolvermg(SolverOp op, const SolverProblem& problem) {
  return (op == SolverOp::kCholeskySolve || op == SolverOp::kCholeskyInverse) &&
         !uses_meshla_cholesky(op, problem);
}

// cusolverDn's potri (it has no generic 64-bit form): its workspace in elements, and the call.
int potri_workspace(cusolverDnHandle_t handle, DType dtype, int n) {
  int lwork = 0;
  const cublasFillMode_t lower = CUBLAS_FILL_MODE_LOWER;
  switch (dtype) {
    case DType::kFloat32:
      MESHLA_CHECK_CUSOLVER(cusolverDnSpotri_bufferSize(handle, lower, n, nullptr, n, &lwork));
      break;
    case DType::kFloat64:
      MESHLA_CHECK_CUSOLVER(cusolverDnDpotri_bufferSize(handle, lower, n, nullptr, n, &lwork));
      break;
    case DType::kComplex64:
      MESHLA_CHECK_CUSOLVER(cusolverDnCpotri_bufferSize(handle, lower, n, nullptr, n, &lwork));
      break;
    default:
      MESHLA_ASSERT(dtype == DType::kComplex128);
      MESHLA_CHECK_CUSOLVER(cusolverDnZpotri_bufferSize(handle, lower, n, nullptr, n, &lwork));
  }
  return lwork;
}

void potri(cusolverDnHandle_t handle, DType dtype, int n, void* a, void* work, int lwork,
           int* info) {
  const cublasFillMode_t lower = CUBLAS_FILL_MODE_LOWER;
  switch (dtype) {
    case DType::kFloat32:
      MESHLA_CHECK_CUSOLVER(cusolverDnSpotri(handle, lower, n, static_cast<float*>(a), n,
                                             static_cast<float*>(work), lwork, info));
      break;
    case DType::kFloat64:
      MESHLA_CHECK_CUSOLVER(cusolverDnDpotri(handle, lower, n, static_cast<double*>(a), n,
                                             static_cast<double*>(work), lwork, info));
      break;
    case DType::kComplex64:
      MESHLA_CHECK_CUSOLVER(cusolverDnCpotri(handle, lower, n, static_cast<cuComplex*>(a), n,
                                             static_cast<cuComplex*>(work), lwork, info));
      break;
    default:
      MESHLA_ASSERT(dtype == DType::kComplex128);
      MESHLA_CHECK_CUSOLVER(cusolverDnZpotri(handle, lower, n, static_cast<cuDoubleComplex*>(a), n,
                                             static_cast<cuDoubleComplex*>(work), lwork, info));
  }
}

enum class TileCopy { kGather, kScatter };

// Over several GPUs, copies the lower triangle of every tile of columns between the parts' working
// arrays and `whole`, the matrix in the solver's order on the first GPU (ld = padded_n() rows):
// solver tile t is local tile t / parts of part t % parts. Enqueued on `stream`, the first GPU's;
// the caller orders it after the parts' own work. On one GPU the working array is the whole.
void copy_lower_tiles(DType dtype, const PartPointers& working, void* whole,
                      const BlockCyclicLayout& layout, TileCopy direction, cudaStream_t stream) {
  if (layout.parts == 1) return;
  const std::size_t element = dtype_size(dtype);
  const std::int64_t ld = layout.padded_n();
  const std::size_t pitch = static_cast<std::size_t>(ld) * element;
  for (std::int64_t t = 0; t < ld / layout.tile; ++t) {
    // Rows from the tile's diagonal down: the rest of its columns is upper triangle.
    const std::int64_t first_row = t * layout.tile;
    const std::size_t offset = static_cast<std::size_t>(first_row) * element;
    char* gathered = static_cast<char*>(whole) + static_cast<std::size_t>(first_row) * pitch;
    char* local = static_cast<char*>(working.data[t % layout.parts]) +
                  static_cast<std::size_t>(t / layout.parts * layout.tile) * pitch;
    char* to = (direction == TileCopy::kGather ? gathered : local) + offset;
    const char* from = (direction == TileCopy::kGather ? local : gathered) + offset;
    MESHLA_CHECK_CUDA(cudaMemcpy2DAsync(
        to, pitch, from, pitch, static_cast<std::size_t>(ld - first_row) * element,
        static_cast<std::size_t>(layout.tile), cudaMemcpyDeviceToDevice, stream));
  }
}

Working working_location(SolverOp op, const SolverProblem& problem,
                         const BlockCyclicLayout& layout) {
  if (problem.overwrite_a) return Working::kA;  // never padded (DenseSolver::Impl::layout)
  if (layout.padded()) return Working::kWorkspace;
  return op == SolverOp::kCholeskyInverse ? Working::kOut : Working::kWorkspace;
}

}  // namespace

std::string_view solver_op_name(SolverOp op) {
  switch (op) {
    case SolverOp::kCholeskySolve:
      return "cholesky_solve";
    case SolverOp::kCholeskyInverse:
      return "cholesky_inverse";
    case SolverOp::kEigen:
      return "eigh";
    case SolverOp::kEigenvalues:
      return "eigvalsh";
    case SolverOp::kLuSolve:
      return "lu_solve";
  }
  return "dense solver";
}

struct DenseSolver::Impl {
  std::vector<int> devices;
  std::optional<solver::BlockCyclicCholesky> cholesky;
  cusolverMgHandle_t handle = nullptr;
  cudaLibMgGrid_t grid = nullptr;
  std::mutex mutex;

  ~Impl() {
    if (grid != nullptr) cusolverMgDestroyGrid(grid);
    if (handle != nullptr) cusolverMgDestroy(handle);
  }

  int parts() const { return static_cast<int>(devices.size()); }

  BlockCyclicLayout layout(SolverOp op, const SolverProblem& problem) const {
    return solver::check_solver_call(op, problem, parts());
  }

  std::int64_t query_lwork(SolverOp op, const SolverProblem& problem,
                           const BlockCyclicLayout& layout) {
    const bool mg_routine = !runs_cusolver_dn(op, problem, layout);
    if (!mg_routine && !factors_with_cusolvermg(op, problem)) return 1;  // cuSolverMg runs nothing
    const int n = static_cast<int>(layout.padded_n());
    const cudaDataType type = detail::cuda_data_type(problem.dtype);
    MatrixDescriptor a(n, n, layout.tile, problem.dtype, grid);
    // The size queries read no array: cuSolverMg sizes the workspace from the descriptors.
    std::vector<void*> arrays(devices.size(), nullptr);
    std::int64_t lwork = 0;
    std::int64_t second = 0;
    // cusolverMgPotrf's workspace only when it factors (meshla's factorization brings its own).
    if (factors_with_cusolvermg(op, problem)) {
      MESHLA_CHECK_CUSOLVER(cusolverMgPotrf_bufferSize(handle, CUBLAS_FILL_MODE_LOWER, n,
                                                       arrays.data(), 1, 1, a.get(), type, &lwork));
    }
    if (!mg_routine) return std::max<std::int64_t>(lwork, 1);
    switch (op) {
      case SolverOp::kCholeskySolve: {
        MatrixDescriptor b(n, problem.nrhs, problem.nrhs, problem.dtype, grid);
        MESHLA_CHECK_CUSOLVER(cusolverMgPotrs_bufferSize(
            handle, CUBLAS_FILL_MODE_LOWER, n, static_cast<int>(problem.nrhs), arrays.data(), 1, 1,
            a.get(), arrays.data(), 1, 1, b.get(), type, &second));
        break;
      }
      case SolverOp::kCholeskyInverse:  // runs_cusolver_dn
        MESHLA_ASSERT(!mg_routine);
        break;
      case SolverOp::kLuSolve: {
        MatrixDescriptor b(n, problem.nrhs, problem.nrhs, problem.dtype, grid);
        std::vector<int*> pivots(devices.size(), nullptr);
        MESHLA_CHECK_CUSOLVER(cusolverMgGetrf_bufferSize(handle, n, n, arrays.data(), 1, 1, a.get(),
                                                         pivots.data(), type, &lwork));
        MESHLA_CHECK_CUSOLVER(cusolverMgGetrs_bufferSize(
            handle, CUBLAS_OP_N, n, static_cast<int>(problem.nrhs), arrays.data(), 1, 1, a.get(),
            pivots.data(), arrays.data(), 1, 1, b.get(), type, &second));
        break;
      }
      case SolverOp::kEigen:
      case SolverOp::kEigenvalues: {
        std::vector<double> eigenvalues(static_cast<std::size_t>(n));
        MESHLA_CHECK_CUSOLVER(cusolverMgSyevd_bufferSize(
            handle, eigen_mode(op), CUBLAS_FILL_MODE_LOWER, n, arrays.data(), 1, 1, a.get(),
            eigenvalues.data(), detail::cuda_data_type(real_dtype(problem.dtype)), type, &lwork));
        break;
      }
    }
    return std::max<std::int64_t>({lwork, second, 1});
  }

  // cusolverDn's device workspace for `op` on the first GPU (runs_cusolver_dn), and its host
  // workspace in `host_bytes` (syevd's and getrf's; potrs, potri and getrs take none).
  std::size_t dense_bytes(SolverOp op, const SolverProblem& problem,
                          const BlockCyclicLayout& layout, std::size_t* host_bytes) const {
    *host_bytes = 0;
    detail::DeviceGuard guard(devices[0]);
    if (op == SolverOp::kCholeskySolve) return 0;
    if (op == SolverOp::kCholeskyInverse) {
      return static_cast<std::size_t>(potri_workspace(cholesky->dense_handle(0), problem.dtype,
                                                      static_cast<int>(layout.padded_n()))) *
             dtype_size(problem.dtype);
    }
    const cudaDataType type = detail::cuda_data_type(problem.dtype);
    std::size_t device_bytes = 0;
    if (op == SolverOp::kLuSolve) {
      MESHLA_CHECK_CUSOLVER(cusolverDnXgetrf_bufferSize(
          cholesky->dense_handle(0), cholesky->dense_params(0), layout.padded_n(),
          layout.padded_n(), type, nullptr, layout.padded_n(), type, &device_bytes, host_bytes));
      return device_bytes;
    }
    MESHLA_CHECK_CUSOLVER(cusolverDnXsyevd_bufferSize(
        cholesky->dense_handle(0), cholesky->dense_params(0), eigen_mode(op),
        CUBLAS_FILL_MODE_LOWER, layout.padded_n(), type, nullptr, layout.padded_n(),
        detail::cuda_data_type(real_dtype(problem.dtype)), nullptr, type, &device_bytes,
        host_bytes));
    return device_bytes;
  }

  // `lwork` from query_lwork(), which every part shares.
  WorkspaceLayout workspace_layout(SolverOp op, const SolverProblem& problem, int part,
                                   std::int64_t lwork) const {
    const BlockCyclicLayout layout = this->layout(op, problem);
    const std::size_t element = dtype_size(problem.dtype);
    WorkspaceLayout w;
    std::size_t offset = align_up(static_cast<std::size_t>(lwork) * element);
    const Working where = working_location(op, problem, layout);
    if (where == Working::kWorkspace) {
      w.working = offset;
      offset +=
          align_up(static_cast<std::size_t>(layout.padded_n() * layout.local_columns()) * element);
    }
    // Rows are shuffled in place, one tile of columns at a time through the panel, when the
    // working array is A itself, or when the inverse is written over its own working array (and
    // some row moves).
    const bool in_place_panels =
        layout.renumbers() && (where == Working::kA ||
                               (op == SolverOp::kCholeskyInverse && where != Working::kWorkspace));
    if (in_place_panels) {
      w.panel = offset;
      offset += align_up(static_cast<std::size_t>(layout.n * layout.tile) * element);
    }
    if ((op == SolverOp::kCholeskySolve || op == SolverOp::kLuSolve) && part == 0) {
      w.rhs = offset;
      offset += align_up(static_cast<std::size_t>(layout.padded_n() * problem.nrhs) * element);
    }
    if (op == SolverOp::kLuSolve) {
      // cuSolverMg's pivots are 32-bit, one per local column; cusolverDn's 64-bit, one per row.
      w.pivots = offset;
      offset += align_up(layout.parts == 1
                             ? static_cast<std::size_t>(layout.padded_n()) * sizeof(std::int64_t)
                             : static_cast<std::size_t>(layout.local_columns()) * sizeof(int));
    }
    if (uses_meshla_cholesky(op, problem)) {
      w.factor = offset;
      offset += align_up(cholesky->workspace(problem.dtype, layout).total);
    }
    w.scalars = offset;
    offset += detail::kWorkspaceAlignment;
    if (runs_cusolver_dn(op, problem, layout) && part == 0) {
      if (layout.parts > 1) {
        w.gathered = offset;
        offset +=
            align_up(static_cast<std::size_t>(layout.padded_n() * layout.padded_n()) * element);
      }
      w.dense = offset;
      w.dense_bytes = dense_bytes(op, problem, layout, &w.dense_host_bytes);
      offset += align_up(w.dense_bytes);
      if (is_eigen(op)) {
        w.values = offset;
        offset += align_up(static_cast<std::size_t>(layout.padded_n()) *
                           dtype_size(real_dtype(problem.dtype)));
      }
      w.info = offset;
      offset += detail::kWorkspaceAlignment;
    }
    w.total = offset;
    return w;
  }
};

DenseSolver::DenseSolver(std::vector<int> devices) : impl_(std::make_unique<Impl>()) {
  MESHLA_CHECK_ARG(
      !devices.empty() && devices.size() <= solver::kMaxParts,
      "DenseSolver: " << devices.size() << " devices; cuSolverMg takes 1 to " << solver::kMaxParts);
  MESHLA_CHECK_ARG(std::set<int>(devices.begin(), devices.end()).size() == devices.size(),
                   "DenseSolver: a device appears twice in the list");
  int count = 0;
  MESHLA_CHECK_CUDA(cudaGetDeviceCount(&count));
  for (int device : devices) {
    MESHLA_CHECK_ARG(device >= 0 && device < count, "DenseSolver: device "
                                                        << device << " is not one of the " << count
                                                        << " visible CUDA devices");
  }
  // The layout kernels read their peers' working arrays directly.
  for (int device : devices) {
    detail::DeviceGuard guard(device);
    for (int peer : devices) {
      if (peer == device) continue;
      int can_access = 0;
      MESHLA_CHECK_CUDA(cudaDeviceCanAccessPeer(&can_access, device, peer));
      MESHLA_CHECK(kNotImplemented, can_access == 1,
                   "DenseSolver: cuda:" << device << " cannot access cuda:" << peer
                                        << "; the solver needs peer access between its GPUs");
      const cudaError_t status = cudaDeviceEnablePeerAccess(peer, 0);
      if (status == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // clears the sticky-free "already enabled" status
      } else {
        MESHLA_CHECK_CUDA(status);
      }
    }
  }
  impl_->devices = std::move(devices);
  impl_->cholesky.emplace(impl_->devices);
  detail::DeviceGuard guard(impl_->devices[0]);
  MESHLA_CHECK_CUSOLVER(cusolverMgCreate(&impl_->handle));
  MESHLA_CHECK_CUSOLVER(
      cusolverMgDeviceSelect(impl_->handle, impl_->parts(), impl_->devices.data()));
  MESHLA_CHECK_CUSOLVER(cusolverMgCreateDeviceGrid(
      &impl_->grid, 1, impl_->parts(), impl_->devices.data(), CUDALIBMG_GRID_MAPPING_COL_MAJOR));
}

DenseSolver::~DenseSolver() = default;
DenseSolver::DenseSolver(DenseSolver&&) noexcept = default;
DenseSolver& DenseSolver::operator=(DenseSolver&&) noexcept = default;

const std::vector<int>& DenseSolver::devices() const { return impl_->devices; }

std::int64_t DenseSolver::tile(SolverOp op, const SolverProblem& problem) const {
  return impl_->layout(op, problem).tile;
}

std::size_t DenseSolver::workspace_bytes(SolverOp op, const SolverProblem& problem,
                                         int part) const {
  MESHLA_CHECK_ARG(part >= 0 && part < impl_->parts(),
                   solver_op_name(op)
                       << ": part " << part << " of a solver over " << impl_->parts() << " GPUs");
  std::lock_guard lock(impl_->mutex);
  const std::int64_t lwork = impl_->query_lwork(op, problem, impl_->layout(op, problem));
  return impl_->workspace_layout(op, problem, part, lwork).total;
}

SolverResult DenseSolver::run(SolverOp op, const SolverProblem& problem,
                              const std::vector<SolverShard>& shards) {
  Impl& self = *impl_;
  std::lock_guard lock(self.mutex);
  const BlockCyclicLayout layout = self.layout(op, problem);
  const int parts = self.parts();
  std::vector<WorkspaceLayout> workspaces;
  const std::int64_t lwork = self.query_lwork(op, problem, layout);
  for (int part = 0; part < parts; ++part) {
    workspaces.push_back(self.workspace_layout(op, problem, part, lwork));
  }
  std::vector<std::size_t> workspace_bytes;
  for (const WorkspaceLayout& workspace : workspaces) workspace_bytes.push_back(workspace.total);
  solver::check_solver_shards(op, problem, layout, self.devices, shards, workspace_bytes);

  const DType dtype = problem.dtype;
  const std::size_t element = dtype_size(dtype);
  const bool complex = is_complex(dtype);
  const std::int64_t n = layout.n;
  const std::int64_t ld = layout.padded_n();
  const Working where = working_location(op, problem, layout);
  auto workspace = [&](int part, std::size_t offset) {
    return static_cast<char*>(shards[part].workspace.data) + offset;
  };
  auto scalars = [&](int part) {
    return reinterpret_cast<double*>(workspace(part, workspaces[part].scalars));
  };
  PartPointers working;
  for (int part = 0; part < parts; ++part) {
    working.data[part] = where == Working::kA     ? shards[part].a.data
                         : where == Working::kOut ? shards[part].out.data
                                                  : workspace(part, workspaces[part].working);
  }
  auto for_each_part = [&](auto&& body) {
    for (int part = 0; part < parts; ++part) {
      detail::DeviceGuard guard(self.devices[part]);
      body(part, shards[part].stream);
    }
  };
  auto synchronize_streams = [&] {
    for_each_part(
        [](int, cudaStream_t stream) { MESHLA_CHECK_CUDA(cudaStreamSynchronize(stream)); });
  };
  // cuSolverMg works on streams of its own: wait for whole devices around it.
  auto synchronize_devices = [&] {
    for_each_part([](int, cudaStream_t) { MESHLA_CHECK_CUDA(cudaDeviceSynchronize()); });
  };
  synchronize_streams();  // the inputs are ready, on every part

  // Padding must not mix with A: 1 on the diagonal for a Cholesky factor; for the eigensolver a
  // value above every eigenvalue of A (twice the Gershgorin bound, plus one), so that the padded
  // eigenpairs are the last ones and are dropped.
  double pad_diagonal = 1.0;
  if (layout.padded() && is_eigen(op)) {
    for_each_part([&](int part, cudaStream_t stream) {
      MESHLA_CHECK_CUDA(cudaMemsetAsync(scalars(part), 0, sizeof(double), stream));
      solver::max_abs_row_sum(dtype, shards[part].a.data, layout.rows_per_part, n, scalars(part),
                              stream);
    });
    double bound = 0.0;
    for_each_part([&](int part, cudaStream_t stream) {
      double part_bound = 0.0;
      MESHLA_CHECK_CUDA(cudaMemcpyAsync(&part_bound, scalars(part), sizeof(double),
                                        cudaMemcpyDeviceToHost, stream));
      MESHLA_CHECK_CUDA(cudaStreamSynchronize(stream));
      bound = std::max(bound, part_bound);
    });
    pad_diagonal = 2.0 * bound + 1.0;
  }

  // A's rows into the solver's order: in place, nothing to do where no row moves. A general A's
  // columns over several GPUs: from every part's rows (on one GPU the LU solve works on the
  // rows as they are: Aᵀ column-major, which getrs solves transposed).
  PartPointers a_parts;
  for (int part = 0; part < parts; ++part) a_parts.data[part] = shards[part].a.data;
  const bool general_columns = op == SolverOp::kLuSolve && parts > 1;
  for_each_part([&](int part, cudaStream_t stream) {
    const SolverShard& shard = shards[part];
    if (general_columns) {
      solver::columns_to_solver_order(dtype, a_parts, n, part * layout.rows_per_part,
                                      working.data[part], ld, layout, part, pad_diagonal, stream);
    } else if (where == Working::kA) {
      if (!layout.renumbers()) return;
      void* panel = workspace(part, workspaces[part].panel);
      for (std::int64_t first = 0; first < layout.local_columns(); first += layout.tile) {
        char* columns = static_cast<char*>(shard.a.data) + first * n * element;
        MESHLA_CHECK_CUDA(cudaMemcpyAsync(panel, columns, n * layout.tile * element,
                                          cudaMemcpyDeviceToDevice, stream));
        solver::rows_to_solver_order(dtype, panel, n, columns, ld, layout, part, first, layout.tile,
                                     pad_diagonal, stream);
      }
    } else {
      solver::rows_to_solver_order(dtype, shard.a.data, n, working.data[part], ld, layout, part, 0,
                                   layout.local_columns(), pad_diagonal, stream);
    }
  });
  PartPointers rhs_parts;
  void* rhs = nullptr;
  // The Cholesky solve works on conj(A) for a complex A (its rows read as columns), so on
  // conj(B); the LU solve on A itself.
  const bool conjugates = complex && op == SolverOp::kCholeskySolve;
  if (op == SolverOp::kCholeskySolve || op == SolverOp::kLuSolve) {
    for (int part = 0; part < parts; ++part) rhs_parts.data[part] = shards[part].b.data;
    rhs = workspace(0, workspaces[0].rhs);
    detail::DeviceGuard guard(self.devices[0]);
    solver::gather_rhs(dtype, rhs_parts, rhs, ld, layout, problem.nrhs, conjugates,
                       shards[0].stream);
  }
  synchronize_streams();

  std::vector<void*> arrays(working.data, working.data + parts);
  std::vector<void*> work(parts);
  for (int part = 0; part < parts; ++part) work[part] = workspace(part, workspaces[part].solver);
  const int order = static_cast<int>(ld);
  const cudaDataType type = detail::cuda_data_type(dtype);
  MatrixDescriptor descriptor_a(ld, ld, layout.tile, dtype, self.grid);
  SolverResult result;
  const auto solver_start = std::chrono::steady_clock::now();
  {
    detail::DeviceGuard guard(self.devices[0]);
    switch (op) {
      case SolverOp::kCholeskySolve:
      case SolverOp::kCholeskyInverse: {
        if (uses_meshla_cholesky(op, problem)) {
          std::vector<void*> factor_work(parts);
          std::vector<cudaStream_t> streams(parts);
          for (int part = 0; part < parts; ++part) {
            factor_work[part] = workspace(part, workspaces[part].factor);
            streams[part] = shards[part].stream;
          }
          result.info = self.cholesky->factor(dtype, working, layout, factor_work, streams);
          break;
        }
        const cusolverStatus_t status =
            cusolverMgPotrf(self.handle, CUBLAS_FILL_MODE_LOWER, order, arrays.data(), 1, 1,
                            descriptor_a.get(), type, work.data(), lwork, &result.info);
        // Unlike cusolverDn, cuSolverMg fails a factorization that meets a non-positive pivot
        // with CUSOLVER_STATUS_INTERNAL_ERROR, not always setting info. Its arguments were
        // checked above, so that status is read as "not positive definite" (info > 0).
        if (status == CUSOLVER_STATUS_INTERNAL_ERROR && result.info >= 0) {
          result.info = std::max(result.info, 1);
        } else {
          MESHLA_CHECK_CUSOLVER(status);
        }
        break;
      }
      case SolverOp::kLuSolve: {
        if (layout.parts == 1) break;  // cusolverDn's, below
        std::vector<int*> pivots(parts);
        for (int part = 0; part < parts; ++part) {
          pivots[part] = reinterpret_cast<int*>(workspace(part, workspaces[part].pivots));
        }
        MESHLA_CHECK_CUSOLVER(cusolverMgGetrf(self.handle, order, order, arrays.data(), 1, 1,
                                              descriptor_a.get(), pivots.data(), type, work.data(),
                                              lwork, &result.info));
        if (result.info == 0) {
          MatrixDescriptor descriptor_b(ld, problem.nrhs, problem.nrhs, dtype, self.grid);
          std::vector<void*> rhs_arrays(parts, nullptr);
          rhs_arrays[0] = rhs;
          MESHLA_CHECK_CUSOLVER(cusolverMgGetrs(
              self.handle, CUBLAS_OP_N, order, static_cast<int>(problem.nrhs), arrays.data(), 1, 1,
              descriptor_a.get(), pivots.data(), rhs_arrays.data(), 1, 1, descriptor_b.get(), type,
              work.data(), lwork, &result.info));
        }
        break;
      }
      case SolverOp::kEigen:
      case SolverOp::kEigenvalues:
        break;
    }
    // One GPU's cusolverDn call, on part 0's stream (runs_cusolver_dn); its info, read back.
    const bool dense = runs_cusolver_dn(op, problem, layout);
    int* dense_info = reinterpret_cast<int*>(workspace(0, workspaces[0].info));
    auto read_dense_info = [&] {
      MESHLA_CHECK_CUDA(cudaMemcpyAsync(&result.info, dense_info, sizeof(int),
                                        cudaMemcpyDeviceToHost, shards[0].stream));
      MESHLA_CHECK_CUDA(cudaStreamSynchronize(shards[0].stream));
    };
    if (dense) {
      MESHLA_CHECK_CUSOLVER(cusolverDnSetStream(self.cholesky->dense_handle(0), shards[0].stream));
    }
    if (op == SolverOp::kLuSolve && dense) {
      // The working array is A's rows read column-major, Aᵀ: factored, then solved transposed.
      const WorkspaceLayout& w = workspaces[0];
      std::vector<char> host_work(std::max<std::size_t>(w.dense_host_bytes, 1));
      auto* pivots = reinterpret_cast<std::int64_t*>(workspace(0, w.pivots));
      MESHLA_CHECK_CUSOLVER(
          cusolverDnXgetrf(self.cholesky->dense_handle(0), self.cholesky->dense_params(0), ld, ld,
                           type, working.data[0], ld, pivots, type, workspace(0, w.dense),
                           w.dense_bytes, host_work.data(), w.dense_host_bytes, dense_info));
      read_dense_info();
      if (result.info == 0) {
        MESHLA_CHECK_CUSOLVER(cusolverDnXgetrs(
            self.cholesky->dense_handle(0), self.cholesky->dense_params(0), CUBLAS_OP_T, ld,
            problem.nrhs, type, working.data[0], ld, pivots, type, rhs, ld, dense_info));
        read_dense_info();
      }
    }
    if (op == SolverOp::kCholeskySolve && result.info == 0 && dense) {
      MESHLA_CHECK_CUSOLVER(cusolverDnXpotrs(
          self.cholesky->dense_handle(0), self.cholesky->dense_params(0), CUBLAS_FILL_MODE_LOWER,
          ld, problem.nrhs, type, working.data[0], ld, type, rhs, ld, dense_info));
      read_dense_info();
    } else if (op == SolverOp::kCholeskySolve && result.info == 0) {
      MatrixDescriptor descriptor_b(ld, problem.nrhs, problem.nrhs, dtype, self.grid);
      std::vector<void*> rhs_arrays(parts, nullptr);
      rhs_arrays[0] = rhs;
      MESHLA_CHECK_CUSOLVER(cusolverMgPotrs(
          self.handle, CUBLAS_FILL_MODE_LOWER, order, static_cast<int>(problem.nrhs), arrays.data(),
          1, 1, descriptor_a.get(), rhs_arrays.data(), 1, 1, descriptor_b.get(), type, work.data(),
          lwork, &result.info));
    }
    if (op == SolverOp::kCholeskyInverse && result.info == 0) {
      // cuSolverMg factors on streams of its own; meshla's factorization on the parts' streams,
      // which the first GPU's gather must follow.
      if (factors_with_cusolvermg(op, problem)) synchronize_devices();
      if (parts > 1) synchronize_streams();
      void* whole = parts == 1 ? working.data[0] : workspace(0, workspaces[0].gathered);
      copy_lower_tiles(dtype, working, whole, layout, TileCopy::kGather, shards[0].stream);
      potri(self.cholesky->dense_handle(0), dtype, order, whole, workspace(0, workspaces[0].dense),
            static_cast<int>(workspaces[0].dense_bytes / element), dense_info);
      read_dense_info();
      if (result.info == 0) {
        copy_lower_tiles(dtype, working, whole, layout, TileCopy::kScatter, shards[0].stream);
      }
    }
    if (is_eigen(op)) {
      const cudaDataType real_type = detail::cuda_data_type(real_dtype(dtype));
      std::vector<double> values64(static_cast<std::size_t>(ld));
      std::vector<float> values32(real_type == CUDA_R_32F ? static_cast<std::size_t>(ld) : 0);
      void* values = real_type == CUDA_R_32F ? static_cast<void*>(values32.data())
                                             : static_cast<void*>(values64.data());
      if (dense) {
        // cusolverDn writes the eigenvalues to the device.
        const WorkspaceLayout& w = workspaces[0];
        std::vector<char> host_work(std::max<std::size_t>(w.dense_host_bytes, 1));
        void* device_values = workspace(0, workspaces[0].values);
        MESHLA_CHECK_CUSOLVER(
            cusolverDnXsyevd(self.cholesky->dense_handle(0), self.cholesky->dense_params(0),
                             eigen_mode(op), CUBLAS_FILL_MODE_LOWER, ld, type, working.data[0], ld,
                             real_type, device_values, type, workspace(0, workspaces[0].dense),
                             w.dense_bytes, host_work.data(), w.dense_host_bytes, dense_info));
        MESHLA_CHECK_CUDA(cudaMemcpyAsync(values, device_values, ld * dtype_size(real_dtype(dtype)),
                                          cudaMemcpyDeviceToHost, shards[0].stream));
        read_dense_info();  // after the values' copy, on the same stream: both are on the host
      } else {
        MESHLA_CHECK_CUSOLVER(cusolverMgSyevd(
            self.handle, eigen_mode(op), CUBLAS_FILL_MODE_LOWER, order, arrays.data(), 1, 1,
            descriptor_a.get(), values, real_type, type, work.data(), lwork, &result.info));
      }
      if (real_type == CUDA_R_32F) std::copy(values32.begin(), values32.end(), values64.begin());
      values64.resize(static_cast<std::size_t>(n));  // the padded eigenvalues are the largest
      result.eigenvalues = std::move(values64);
    }
  }
  synchronize_devices();
  result.solver_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - solver_start).count();
  MESHLA_CHECK(kCusolver, result.info >= 0,
               solver_op_name(op) << ": cuSOLVER reports parameter " << -result.info
                                  << " as wrong (n=" << n << ", tile=" << layout.tile << ")");
  const bool failed = result.info > 0;

  // Outputs.
  for_each_part([&](int part, cudaStream_t stream) {
    const SolverShard& shard = shards[part];
    switch (op) {
      case SolverOp::kCholeskySolve:
      case SolverOp::kLuSolve:
        if (failed) {
          solver::fill_nan(dtype, shard.out.data, shard.out.numel(), stream);
        } else {
          solver::scatter_solution(dtype, rhs, ld, shard.out.data, layout, part, problem.nrhs,
                                   conjugates, stream);
          if (op == SolverOp::kCholeskySolve) {
            solver::sum_log_diagonal(dtype, working.data[part], ld, layout, part, scalars(part),
                                     stream);
          }
        }
        break;
      case SolverOp::kCholeskyInverse:
        if (!failed) {
          solver::mirror_lower_to_upper(dtype, working, ld, layout, part, stream);
        }
        break;
      case SolverOp::kEigen:
        if (failed) {
          solver::fill_nan(dtype, shard.out.data, shard.out.numel(), stream);
        } else {
          solver::gather_eigenvectors(dtype, working, ld, shard.out.data, layout, part, complex,
                                      stream);
        }
        break;
      case SolverOp::kEigenvalues:
        break;
    }
  });
  synchronize_streams();  // mirror_lower_to_upper reads every part's lower triangle

  if (op == SolverOp::kCholeskySolve) {
    result.logdet = failed ? std::nan("") : 0.0;
    for_each_part([&](int part, cudaStream_t stream) {
      if (failed) return;
      double part_sum = 0.0;
      MESHLA_CHECK_CUDA(cudaMemcpyAsync(&part_sum, scalars(part), sizeof(double),
                                        cudaMemcpyDeviceToHost, stream));
      MESHLA_CHECK_CUDA(cudaStreamSynchronize(stream));
      result.logdet += part_sum;
    });
    // log det A = Σ log L_jj² over the factor's diagonal.
    result.logdet *= 2.0;
  }
  if (op == SolverOp::kCholeskyInverse) {
    for_each_part([&](int part, cudaStream_t stream) {
      const SolverShard& shard = shards[part];
      if (failed) {
        solver::fill_nan(dtype, shard.out.data, shard.out.numel(), stream);
      } else if (where == Working::kWorkspace) {
        solver::rows_to_original_order(dtype, working.data[part], ld, shard.out.data, n, layout,
                                       layout.rows_per_part, stream);
      } else if (!layout.renumbers()) {
        // The inverse is in the original order already: in `out` itself, or in A (overwrite_a).
        if (working.data[part] != shard.out.data) {
          MESHLA_CHECK_CUDA(cudaMemcpyAsync(shard.out.data, working.data[part],
                                            layout.rows_per_part * n * element,
                                            cudaMemcpyDeviceToDevice, stream));
        }
      } else {
        void* panel = workspace(part, workspaces[part].panel);
        for (std::int64_t first = 0; first < layout.local_columns(); first += layout.tile) {
          char* columns = static_cast<char*>(working.data[part]) + first * ld * element;
          MESHLA_CHECK_CUDA(cudaMemcpyAsync(panel, columns, ld * layout.tile * element,
                                            cudaMemcpyDeviceToDevice, stream));
          solver::rows_to_original_order(dtype, panel, ld,
                                         static_cast<char*>(shard.out.data) + first * n * element,
                                         n, layout, layout.tile, stream);
        }
      }
    });
  }
  if (failed && !result.eigenvalues.empty()) {
    std::fill(result.eigenvalues.begin(), result.eigenvalues.end(), std::nan(""));
  }

  // Host results into the shards' device outputs.
  for_each_part([&](int part, cudaStream_t stream) {
    const SolverShard& shard = shards[part];
    if (shard.info.data != nullptr) {
      MESHLA_CHECK_CUDA(cudaMemcpyAsync(shard.info.data, &result.info, sizeof(int),
                                        cudaMemcpyHostToDevice, stream));
    }
    if (op == SolverOp::kCholeskySolve && shard.logdet.data != nullptr) {
      const float logdet32 = static_cast<float>(result.logdet);
      const bool wide = shard.logdet.dtype == DType::kFloat64;
      // Pageable sources: each copy has left the host value when cudaMemcpyAsync returns.
      MESHLA_CHECK_CUDA(cudaMemcpyAsync(
          shard.logdet.data, wide ? static_cast<const void*>(&result.logdet) : &logdet32,
          wide ? sizeof(double) : sizeof(float), cudaMemcpyHostToDevice, stream));
    }
    if (shard.eigenvalues.data != nullptr) {
      if (shard.eigenvalues.dtype == DType::kFloat64) {
        MESHLA_CHECK_CUDA(cudaMemcpyAsync(shard.eigenvalues.data, result.eigenvalues.data(),
                                          n * sizeof(double), cudaMemcpyHostToDevice, stream));
      } else {
        const std::vector<float> values(result.eigenvalues.begin(), result.eigenvalues.end());
        MESHLA_CHECK_CUDA(cudaMemcpyAsync(shard.eigenvalues.data, values.data(), n * sizeof(float),
                                          cudaMemcpyHostToDevice, stream));
        MESHLA_CHECK_CUDA(cudaStreamSynchronize(stream));  // `values` dies at scope end
      }
    }
  });
  synchronize_streams();
  return result;
}

}  // namespace meshla
