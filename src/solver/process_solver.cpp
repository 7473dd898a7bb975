#include "meshla/process_solver.hpp"

#include <algorithm>
#include <cmath>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <vector>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "comm/comm_state.hpp"
#include "core/checks.hpp"
#include "core/cuda_checks.hpp"
#include "core/cuda_handles.hpp"
#include "core/cuda_types.hpp"
#include "runtime/execution_order.hpp"
#include "runtime/releases.hpp"
#include "solver/block_cyclic.hpp"
#include "solver/cusolver_checks.hpp"
#include "solver/solver_kernels.hpp"
#include "solver/solver_validation.hpp"

#ifdef MESHLA_WITH_CUSOLVERMP
#include "solver/cusolvermp/cusolvermp_library.hpp"
#endif

namespace meshla {

int ProcessSolver::max_ranks() { return solver::kMaxParts; }

#ifdef MESHLA_WITH_CUSOLVERMP
namespace {

using solver::BlockCyclicLayout;
using solver::CusolverMpLibrary;

const CusolverMpLibrary& library() {
  std::string why;
  const CusolverMpLibrary* loaded = solver::cusolvermp_library(&why);
  MESHLA_CHECK(kNotImplemented, loaded != nullptr,
               "ProcessSolver: cuSOLVERMp is not available: " << why);
  return *loaded;
}

// cuSOLVERMp allows one handle per process and GPU: every ProcessSolver on a device shares it,
// and the mutex makes their calls take turns. Its stream is one of its own (cuSOLVERMp refuses
// the default stream), ordered after the caller's by an event in each run.
struct Handle {
  Handle(const CusolverMpLibrary& l, int device) : lib(l) {
    detail::DeviceGuard guard(device);
    MESHLA_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const cusolverStatus_t created = lib.create(&handle, device, stream);
    if (created != CUSOLVER_STATUS_SUCCESS) {
      cudaStreamDestroy(stream);
      MESHLA_CHECK_CUSOLVER(created);
    }
    int version = 0;
    const cusolverStatus_t status = lib.get_version(handle, &version);
    if (status != CUSOLVER_STATUS_SUCCESS || version / 100 != CUSOLVERMP_VERSION / 100) {
      lib.destroy(handle);
      cudaStreamDestroy(stream);
      std::ostringstream message;
      message << "ProcessSolver: loaded cuSOLVERMp " << version / 1000 << "." << version / 100 % 10
              << " but meshla was built against " << CUSOLVERMP_VER_MAJOR << "."
              << CUSOLVERMP_VER_MINOR
              << " (pip install nvidia-cusolvermp-cu13==" << CUSOLVERMP_VER_MAJOR << "."
              << CUSOLVERMP_VER_MINOR << ".*)";
      throw Error(ErrorCode::kNotImplemented, message.str());
    }
  }
  ~Handle() {
    lib.destroy(handle);
    cudaStreamDestroy(stream);
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  const CusolverMpLibrary& lib;
  cudaStream_t stream = nullptr;
  cusolverMpHandle_t handle = nullptr;
  std::mutex calls;
};

std::shared_ptr<Handle> handle_on(int device) {
  static std::mutex mutex;
  static std::map<int, std::weak_ptr<Handle>> handles;
  std::lock_guard<std::mutex> lock(mutex);
  std::shared_ptr<Handle> handle = handles[device].lock();
  if (handle == nullptr) {
    handle = std::make_shared<Handle>(library(), device);
    handles[device] = handle;
  }
  return handle;
}

// The largest tile the automatic choice gives cuSOLVERMp.
constexpr std::int64_t kLargestTile = 1024;

std::size_t aligned(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

// A descriptor that ends with the scope that made it.
class MatrixDescriptor {
 public:
  MatrixDescriptor(const CusolverMpLibrary& lib, cusolverMpGrid_t grid, DType dtype,
                   std::int64_t rows, std::int64_t cols, std::int64_t row_block,
                   std::int64_t col_block, std::int64_t ld)
      : lib_(lib) {
    MESHLA_CHECK_CUSOLVER(lib_.create_matrix(&desc_, grid, detail::cuda_data_type(dtype), rows,
                                             cols, row_block, col_block, 0, 0, ld));
  }
  ~MatrixDescriptor() { lib_.destroy_matrix(desc_); }
  MatrixDescriptor(const MatrixDescriptor&) = delete;
  MatrixDescriptor& operator=(const MatrixDescriptor&) = delete;
  cusolverMpMatrixDescriptor_t get() const { return desc_; }

 private:
  const CusolverMpLibrary& lib_;
  cusolverMpMatrixDescriptor_t desc_ = nullptr;
};

// cuSOLVERMp's device workspace, stream-ordered: its size is known only from queries that need
// the matrices' own pointers (0.8 refuses null ones). A failed allocation is kept, not thrown:
// the ranks agree on it before the collective calls (ProcessSolver::run).
class StreamAllocation {
 public:
  StreamAllocation(std::size_t bytes, cudaStream_t stream) : stream_(stream) {
    if (bytes > 0) status_ = cudaMallocAsync(&data_, bytes, stream);
  }
  ~StreamAllocation() {
    if (data_ != nullptr) cudaFreeAsync(data_, stream_);
  }
  StreamAllocation(const StreamAllocation&) = delete;
  StreamAllocation& operator=(const StreamAllocation&) = delete;
  void* get() const { return data_; }
  cudaError_t status() const { return status_; }

 private:
  cudaStream_t stream_;
  void* data_ = nullptr;
  cudaError_t status_ = cudaSuccess;
};

// Device scalars of a run: what every rank agrees on after each step. `info` (the last
// cuSOLVERMp call's) and `failed` are all-reduced by max, `info_min` (a copy of info) by min, so
// that a parameter error (a negative info) reported by any rank reaches every rank.
struct Scalars {
  int info;
  int failed;  // a cuSOLVERMp call returned an error status on this rank
  int info_min;
  int unused;
  double log_sum;  // this rank's Σ log diag L, then the group's
};

}  // namespace

struct ProcessSolver::Impl {
  explicit Impl(Communicator c)
      : comm(std::move(c)),
        order(comm.device(), detail::rank_description(*comm.state()), comm.timeout()) {}
  // The grid's destruction is collective (every rank of the grid takes part): off the thread
  // that lets go (release_on_own_thread), so that a peer that is late, or gone, blocks no caller.
  // It deregisters memory from the NCCL communicator, which must outlive it; it takes no handle
  // lock (a run on another grid of the handle may be waiting for this rank's peers).
  ~Impl() {
    if (grid == nullptr) return;
    detail::release_on_own_thread(
        comm.device(), [handle = handle, state = comm.state(), grid = grid, flag = ready_flag] {
          handle->lib.destroy_grid(grid);
          cudaFree(flag);
        });
  }
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  Communicator comm;
  // The runs on the handle's stream, watched: every wait on the peers (NCCL's and cuSOLVERMp's
  // collectives have no bound of their own) ends the process after the communicator's timeout
  // with the watchdog's message, instead of waiting forever for a rank that died.
  detail::ExecutionOrder order;
  std::shared_ptr<Handle> handle;
  cusolverMpGrid_t grid = nullptr;
  // Where the ranks agree that each can start a run (its own memory: a rank's workspace may be
  // what is missing).
  int* ready_flag = nullptr;

  // One call's shapes and where meshla's buffers sit in the caller's workspace. B' has square
  // tiles like A' (cuSOLVERMp wants square ones for A; B alike): its column blocks of `tile`
  // columns are dealt round-robin to the ranks, so with nrhs <= tile (the usual case) the first
  // rank holds all of B'.
  struct Plan {
    BlockCyclicLayout layout;
    std::int64_t ld = 0;              // padded order: rows of A' and B'
    std::int64_t rhs_blocks = 0;      // B's column blocks
    std::int64_t my_rhs_columns = 0;  // this rank's columns of B' (NUMROC)
    bool in_place = false;            // A's own memory is the working matrix (overwrite_a)
    bool general = false;             // the LU solve: A' from every rank's rows of A
    std::size_t working = 0;          // A' (absent in place)
    std::size_t panel = 0;            // one tile of columns, for renumbering in place
    std::size_t outgoing = 0;         // LU: this rank's rows of A, cut by the ranks' columns
    std::size_t incoming = 0;         // LU: every rank's rows of A in this rank's columns
    std::size_t pivots = 0;           // LU: getrf's pivots, one per local column (int64)
    std::size_t gathered = 0;         // every rank's B rows, row-major
    std::size_t rhs = 0;              // B' = X' whole, column-major (ld x nrhs)
    std::size_t my_rhs = 0;           // this rank's column blocks of B', its local array
    std::size_t scalars = 0;          // Scalars
    std::size_t total = 0;
  };

  Plan plan(SolverOp op, const SolverProblem& problem) const {
    MESHLA_CHECK(kNotImplemented, op == SolverOp::kCholeskySolve || op == SolverOp::kLuSolve,
                 solver_op_name(op) << ": across processes only cholesky_solve and lu_solve run "
                                       "on cuSOLVERMp so far");
    const int ranks = comm.size();
    Plan p;
    // The call's checks, in the words either engine gives; then cuSOLVERMp's own tiles: at most
    // 1024 by default (cuSolverMg's up to 2048 would leave it one or two a rank; JAXMg measured
    // its cuSOLVERMp solves fastest with 1024, issue 39; not yet measured here), the LU solve's
    // within cuSolverMg's limit so that a tile means the same to either engine, and on one rank
    // tiles too (cuSolverMg's one-GPU LU takes the whole matrix as one, cusolverDn's way).
    p.layout = solver::check_solver_call(op, problem, ranks);
    const bool general = op == SolverOp::kLuSolve;
    if (problem.tile == 0 || (general && ranks == 1)) {
      p.layout = solver::make_block_cyclic_layout(
          problem.n, ranks, problem.tile,
          general ? std::min(kLargestTile, solver::kLargestLuTile) : kLargestTile);
    }
    p.ld = p.layout.padded_n();
    p.rhs_blocks = (problem.nrhs + p.layout.tile - 1) / p.layout.tile;
    for (std::int64_t block = comm.rank(); block < p.rhs_blocks; block += ranks) {
      p.my_rhs_columns += std::min(p.layout.tile, problem.nrhs - block * p.layout.tile);
    }
    // A's own memory is the working matrix only for the Cholesky solve, and where its tiles do
    // not pad (overwrite_a permits, it does not oblige); the LU solve's columns come from every
    // rank.
    p.in_place = problem.overwrite_a && !general && !p.layout.padded();
    p.general = general;
    const std::size_t element = dtype_size(problem.dtype);
    std::size_t offset = 0;
    auto take = [&](std::size_t bytes) {
      const std::size_t at = offset;
      offset += aligned(bytes);
      return at;
    };
    if (p.in_place) {
      p.panel = take(static_cast<std::size_t>(p.layout.n * p.layout.tile) * element);
    } else {
      p.working = take(static_cast<std::size_t>(p.ld * p.layout.local_columns()) * element);
    }
    if (p.general) {
      const std::size_t block =
          static_cast<std::size_t>(p.layout.rows_per_part * p.layout.rows_per_part) * element;
      p.outgoing = take(ranks * block);
      p.incoming = take(ranks * block);
      p.pivots = take(static_cast<std::size_t>(p.layout.local_columns()) * sizeof(std::int64_t));
    }
    p.gathered = take(static_cast<std::size_t>(p.layout.n * problem.nrhs) * element);
    p.rhs = take(static_cast<std::size_t>(p.ld * problem.nrhs) * element);
    // At least a column, so that a rank holding none of B' still names memory of its own.
    p.my_rhs = take(static_cast<std::size_t>(p.ld * std::max<std::int64_t>(p.my_rhs_columns, 1)) *
                    element);
    p.scalars = take(sizeof(Scalars));
    p.total = offset;
    return p;
  }
};

ProcessSolver::ProcessSolver(Communicator comm) {
  MESHLA_CHECK(kNotImplemented, comm.size() <= max_ranks(),
               "ProcessSolver: " << comm.size() << " ranks; at most " << max_ranks()
                                 << " so far (B's gather)");
  impl_ = std::make_unique<Impl>(std::move(comm));
  Impl& self = *impl_;
  self.handle = handle_on(self.comm.device());
  detail::DeviceGuard guard(self.comm.device());
  std::lock_guard<std::mutex> lock(self.handle->calls);
  MESHLA_CHECK_CUSOLVER(self.handle->lib.create_grid(self.handle->handle, &self.grid,
                                                     self.comm.state()->comm, 1, self.comm.size(),
                                                     CUSOLVERMP_GRID_MAPPING_COL_MAJOR));
  MESHLA_CHECK_CUDA(cudaMalloc(&self.ready_flag, sizeof(int)));  // freed with the grid
}

ProcessSolver::~ProcessSolver() = default;
ProcessSolver::ProcessSolver(ProcessSolver&&) noexcept = default;
ProcessSolver& ProcessSolver::operator=(ProcessSolver&&) noexcept = default;

std::string ProcessSolver::unavailable_reason() {
  std::string why;
  return solver::cusolvermp_library(&why) == nullptr ? why : std::string();
}

int ProcessSolver::rank() const { return impl_->comm.rank(); }
int ProcessSolver::size() const { return impl_->comm.size(); }

std::int64_t ProcessSolver::tile(SolverOp op, const SolverProblem& problem) const {
  return impl_->plan(op, problem).layout.tile;
}

std::size_t ProcessSolver::workspace_bytes(SolverOp op, const SolverProblem& problem) const {
  return impl_->plan(op, problem).total;
}

SolverResult ProcessSolver::run(SolverOp op, const SolverProblem& problem,
                                const SolverShard& shard) {
  Impl& self = *impl_;
  const int rank = self.comm.rank();
  const int ranks = self.comm.size();
  const int device = self.comm.device();
  detail::DeviceGuard guard(device);
  std::lock_guard<std::mutex> lock(self.handle->calls);
  const Impl::Plan p = self.plan(op, problem);
  const std::string_view name = solver_op_name(op);
  cudaStream_t stream = self.handle->stream;
  // The run is watched from each host wait (wait_for_peers) until it is done; an error ends the
  // watched run and waits for what is queued (the caller's workspace may be in use).
  const char* run_name =
      op == SolverOp::kLuSolve ? "lu_solve (cuSOLVERMp)" : "cholesky_solve (cuSOLVERMp)";
  self.order.begin(stream, run_name);
  struct EndOnError {
    detail::ExecutionOrder& order;
    cudaStream_t stream;
    int exceptions = std::uncaught_exceptions();
    ~EndOnError() {
      if (std::uncaught_exceptions() > exceptions) {
        order.end_after_failure(stream);
        cudaStreamSynchronize(stream);
      }
    }
  } end_on_error{self.order, stream};
  auto wait_for_peers = [&] {
    self.order.end(stream);
    MESHLA_CHECK_CUDA(cudaStreamSynchronize(stream));
    self.order.begin(stream, run_name);
  };
  // Every rank's shard checked, then agreed on, before any collective: a rank whose part is
  // wrong or missing (a workspace its caller could not allocate, say) would otherwise leave the
  // others waiting in the first one.
  std::optional<Error> not_ready;
  try {
    solver::check_solver_shard(op, problem, p.layout, ranks, rank, device, shard, p.total);
  } catch (const Error& error) {
    not_ready = error;
  }
  const int failed_here_at_start = not_ready.has_value();
  MESHLA_CHECK_CUDA(cudaMemcpyAsync(self.ready_flag, &failed_here_at_start, sizeof(int),
                                    cudaMemcpyHostToDevice, stream));
  MESHLA_CHECK_NCCL(ncclAllReduce(self.ready_flag, self.ready_flag, 1, ncclInt32, ncclMax,
                                  self.comm.state()->comm, stream));
  int failed_at_start = 0;
  MESHLA_CHECK_CUDA(cudaMemcpyAsync(&failed_at_start, self.ready_flag, sizeof(int),
                                    cudaMemcpyDeviceToHost, stream));
  wait_for_peers();
  if (not_ready) throw *not_ready;
  MESHLA_CHECK_ARG(failed_at_start == 0,
                   name << ": another rank of the group could not start the call (its error is "
                           "raised there)");
  const BlockCyclicLayout& layout = p.layout;
  const CusolverMpLibrary& lib = self.handle->lib;
  const DType dtype = problem.dtype;
  const std::size_t element = dtype_size(dtype);
  const std::int64_t n = layout.n;
  const std::int64_t nrhs = problem.nrhs;
  ncclComm_t nccl = self.comm.state()->comm;
  char* base = static_cast<char*>(shard.workspace.data);

  // The handle's stream, after the caller's (its inputs); run() returns once it is done.
  cudaEvent_t inputs_ready = nullptr;
  MESHLA_CHECK_CUDA(cudaEventCreateWithFlags(&inputs_ready, cudaEventDisableTiming));
  MESHLA_CHECK_CUDA(cudaEventRecord(inputs_ready, shard.stream));
  MESHLA_CHECK_CUDA(cudaStreamWaitEvent(stream, inputs_ready, 0));
  MESHLA_CHECK_CUDA(cudaEventDestroy(inputs_ready));

  // A' into the working array. The Cholesky solve's: this rank's rows read as columns, shuffled
  // inside this GPU (block_cyclic.hpp). The LU solve's: A's columns, which every rank's rows cut:
  // each rank sends every other its r x r block of them, then the columns are put together.
  void* working = p.in_place ? shard.a.data : base + p.working;
  if (p.general) {
    const std::int64_t r = layout.rows_per_part;
    const std::size_t block = static_cast<std::size_t>(r * r) * element;
    char* outgoing = base + p.outgoing;
    char* incoming = base + p.incoming;
    for (int peer = 0; peer < ranks; ++peer) {  // this rank's rows, the peer's columns
      MESHLA_CHECK_CUDA(
          cudaMemcpy2DAsync((peer == rank ? incoming : outgoing) + peer * block, r * element,
                            static_cast<const char*>(shard.a.data) + peer * r * element,
                            n * element, r * element, r, cudaMemcpyDeviceToDevice, stream));
    }
    {
      detail::NcclGroup group;
      for (int peer = 0; peer < ranks; ++peer) {
        if (peer == rank) continue;
        MESHLA_CHECK_NCCL(ncclSend(outgoing + peer * block, block, ncclInt8, peer, nccl, stream));
        MESHLA_CHECK_NCCL(ncclRecv(incoming + peer * block, block, ncclInt8, peer, nccl, stream));
      }
      MESHLA_CHECK_NCCL(group.end());
    }
    solver::PartPointers rows;
    for (int peer = 0; peer < ranks; ++peer) rows.data[peer] = incoming + peer * block;
    solver::columns_to_solver_order(dtype, rows, r, 0, working, p.ld, layout, rank, 1.0, stream);
  } else if (!p.in_place) {
    solver::rows_to_solver_order(dtype, shard.a.data, n, working, p.ld, layout, rank, 0,
                                 layout.local_columns(), 1.0, stream);
  } else if (layout.renumbers()) {
    for (std::int64_t first = 0; first < layout.local_columns(); first += layout.tile) {
      char* columns = static_cast<char*>(shard.a.data) + first * n * element;
      MESHLA_CHECK_CUDA(cudaMemcpyAsync(base + p.panel, columns, n * layout.tile * element,
                                        cudaMemcpyDeviceToDevice, stream));
      solver::rows_to_solver_order(dtype, base + p.panel, n, columns, p.ld, layout, rank, first,
                                   layout.tile, 1.0, stream);
    }
  }

  // B' on every rank in the solver's order (conj(B) for a complex A in the Cholesky solve: the
  // rows of A read as columns are conj(A)), its padding rows and columns zero.
  const bool conjugates = solver::is_complex(dtype) && !p.general;
  char* gathered = base + p.gathered;
  char* rhs = base + p.rhs;
  const std::size_t block_bytes = static_cast<std::size_t>(layout.rows_per_part * nrhs) * element;
  MESHLA_CHECK_NCCL(ncclAllGather(shard.b.data, gathered, block_bytes, ncclInt8, nccl, stream));
  MESHLA_CHECK_CUDA(
      cudaMemsetAsync(rhs, 0, static_cast<std::size_t>(p.ld * nrhs) * element, stream));
  solver::PartPointers blocks;
  for (int part = 0; part < ranks; ++part) blocks.data[part] = gathered + part * block_bytes;
  solver::gather_rhs(dtype, blocks, rhs, p.ld, layout, nrhs, conjugates, stream);

  // Factor, then solve: every rank makes every call.
  auto* scalars = reinterpret_cast<Scalars*>(base + p.scalars);
  MESHLA_CHECK_CUDA(cudaMemsetAsync(scalars, 0, sizeof(Scalars), stream));
  // The group's infos and failures so far: every rank learns of any rank's before the next
  // collective call, so that all make it or none does.
  auto agree = [&](bool failed_here) {
    const int failed = failed_here ? 1 : 0;
    MESHLA_CHECK_CUDA(
        cudaMemcpyAsync(&scalars->failed, &failed, sizeof(int), cudaMemcpyHostToDevice, stream));
    MESHLA_CHECK_CUDA(cudaMemcpyAsync(&scalars->info_min, &scalars->info, sizeof(int),
                                      cudaMemcpyDeviceToDevice, stream));
    MESHLA_CHECK_NCCL(
        ncclAllReduce(&scalars->info, &scalars->info, 2, ncclInt32, ncclMax, nccl, stream));
    MESHLA_CHECK_NCCL(
        ncclAllReduce(&scalars->info_min, &scalars->info_min, 1, ncclInt32, ncclMin, nccl, stream));
    Scalars agreed{};
    MESHLA_CHECK_CUDA(
        cudaMemcpyAsync(&agreed, scalars, sizeof(Scalars), cudaMemcpyDeviceToHost, stream));
    wait_for_peers();
    return agreed;
  };
  MatrixDescriptor a_desc(lib, self.grid, dtype, p.ld, p.ld, layout.tile, layout.tile, p.ld);
  MatrixDescriptor b_desc(lib, self.grid, dtype, p.ld, nrhs, layout.tile, layout.tile, p.ld);
  const cudaDataType_t type = detail::cuda_data_type(dtype);
  // This rank's column blocks of B' (block c is on rank c % P, at c / P in its local array), and
  // where each block is in B' whole and in its owner's local array.
  char* my_columns = base + p.my_rhs;
  const std::size_t tile_bytes = static_cast<std::size_t>(layout.tile * p.ld) * element;
  auto block_bytes_of = [&](std::int64_t block) {
    return static_cast<std::size_t>(std::min(layout.tile, nrhs - block * layout.tile) * p.ld) *
           element;
  };
  for (std::int64_t block = rank; block < p.rhs_blocks; block += ranks) {
    MESHLA_CHECK_CUDA(cudaMemcpyAsync(my_columns + block / ranks * tile_bytes,
                                      rhs + block * tile_bytes, block_bytes_of(block),
                                      cudaMemcpyDeviceToDevice, stream));
  }
  // A call's error status is kept (the first, with the call's name) until every rank knows of
  // it: thrown at once, it would leave the other ranks waiting in the next collective.
  cusolverStatus_t failed_status = CUSOLVER_STATUS_SUCCESS;
  const char* failed_call = nullptr;
  auto keep = [&](const char* call, cusolverStatus_t status) {
    if (failed_status != CUSOLVER_STATUS_SUCCESS || status == CUSOLVER_STATUS_SUCCESS) return;
    failed_status = status;
    failed_call = call;
  };
  auto this_rank = [&] {
    return failed_call == nullptr
               ? std::string()
               : std::string(" (this one: ") + failed_call + " returned " +
                     std::string(solver::cusolver_status_name(failed_status)) + ")";
  };
  cusolverMpHandle_t handle = self.handle->handle;
  auto* pivots = reinterpret_cast<std::int64_t*>(base + p.pivots);
  std::size_t factor_device = 0, factor_host = 0, solve_device = 0, solve_host = 0;
  if (p.general) {
    keep("getrf_bufferSize", lib.getrf_buffer_size(handle, p.ld, p.ld, working, 1, 1, a_desc.get(),
                                                   pivots, type, &factor_device, &factor_host));
    keep("getrs_bufferSize",
         lib.getrs_buffer_size(handle, CUBLAS_OP_N, p.ld, 1, working, 1, 1, a_desc.get(), pivots,
                               my_columns, 1, 1, b_desc.get(), type, &solve_device, &solve_host));
  } else {
    keep("potrf_bufferSize",
         lib.potrf_buffer_size(handle, CUBLAS_FILL_MODE_LOWER, p.ld, working, 1, 1, a_desc.get(),
                               type, &factor_device, &factor_host));
    keep("potrs_bufferSize",
         lib.potrs_buffer_size(handle, CUBLAS_FILL_MODE_LOWER, p.ld, 1, working, 1, 1, a_desc.get(),
                               my_columns, 1, 1, b_desc.get(), type, &solve_device, &solve_host));
  }
  const std::size_t device_bytes = std::max(factor_device, solve_device);
  StreamAllocation device_work(device_bytes, stream);
  std::vector<std::byte> factor_work(factor_host), solve_work(solve_host);
  const Scalars sized = agree(failed_call != nullptr || device_work.status() != cudaSuccess);
  MESHLA_CHECK(
      kCusolver, sized.failed == 0,
      name << ": cuSOLVERMp's workspace could not be sized or allocated on a rank of the "
              "group"
           << (device_work.status() != cudaSuccess
                   ? std::string(" (this one: ") + cudaGetErrorString(device_work.status()) + ")"
                   : this_rank())
           << " (n=" << n << ", tile=" << layout.tile << ")");
  auto check_parameters = [&](const Scalars& agreed) {
    MESHLA_CHECK(kCusolver, agreed.info_min >= 0,
                 name << ": cuSOLVERMp reports parameter " << -agreed.info_min
                      << " as wrong (n=" << n << ", tile=" << layout.tile << ")");
  };
  auto check_calls = [&](const Scalars& agreed) {
    MESHLA_CHECK(kCusolver, agreed.failed == 0,
                 name << ": a cuSOLVERMp call failed on a rank of the group" << this_rank()
                      << " (n=" << n << ", tile=" << layout.tile << ")");
  };

  if (p.general) {
    keep("getrf",
         lib.getrf(handle, p.ld, p.ld, working, 1, 1, a_desc.get(), pivots, type, device_work.get(),
                   device_bytes, factor_work.data(), factor_host, &scalars->info));
    solver::mark_zero_pivot(dtype, working, p.ld, layout, rank, &scalars->info, stream);
  } else {
    keep("potrf", lib.potrf(handle, CUBLAS_FILL_MODE_LOWER, p.ld, working, 1, 1, a_desc.get(), type,
                            device_work.get(), device_bytes, factor_work.data(), factor_host,
                            &scalars->info));
  }
  const Scalars factored = agree(failed_call != nullptr);
  check_parameters(factored);
  SolverResult result;
  // A matrix that is not positive definite (singular, for the LU solve) is an answer, info > 0,
  // whatever status the factorization returned with it (cuSOLVERMp 0.8's potrf returned
  // CUSOLVER_STATUS_INTERNAL_ERROR with one, and its getrf info 0 for a zero pivot, which
  // mark_zero_pivot finds: bench/NOTES.md 112); the solves are not made.
  result.info = factored.info;
  const bool failed = result.info > 0;
  if (!failed) {
    check_calls(factored);
    // One right-hand side at a time (cuSOLVERMp 0.8's potrs and getrs take one: its
    // documentation), each column JB of B' on the rank whose block holds it.
    for (std::int64_t column = 0; column < nrhs; ++column) {
      if (p.general) {
        keep("getrs", lib.getrs(handle, CUBLAS_OP_N, p.ld, 1, working, 1, 1, a_desc.get(), pivots,
                                my_columns, 1, column + 1, b_desc.get(), type, device_work.get(),
                                device_bytes, solve_work.data(), solve_host, &scalars->info));
      } else {
        keep("potrs",
             lib.potrs(handle, CUBLAS_FILL_MODE_LOWER, p.ld, 1, working, 1, 1, a_desc.get(),
                       my_columns, 1, column + 1, b_desc.get(), type, device_work.get(),
                       device_bytes, solve_work.data(), solve_host, &scalars->info));
      }
    }
    const Scalars solved = agree(failed_call != nullptr);
    check_calls(solved);
    check_parameters(solved);
    // X' whole on every rank: each solved column block from its owner.
    detail::NcclGroup group;
    for (std::int64_t block = 0; block < p.rhs_blocks; ++block) {
      const int owner = static_cast<int>(block % ranks);
      // Only the owner's send buffer is read; the others name the block's place in X'.
      char* send =
          owner == rank ? my_columns + block / ranks * tile_bytes : rhs + block * tile_bytes;
      MESHLA_CHECK_NCCL(ncclBroadcast(send, rhs + block * tile_bytes, block_bytes_of(block),
                                      ncclInt8, owner, nccl, stream));
    }
    MESHLA_CHECK_NCCL(group.end());
  }

  // Outputs: this rank's rows of X; the Cholesky solve's log det A = Σ log L_jj² over every
  // rank's diagonal.
  if (failed) {
    solver::fill_nan(dtype, shard.out.data, shard.out.numel(), stream);
    result.logdet = std::nan("");
  } else {
    solver::scatter_solution(dtype, rhs, p.ld, shard.out.data, layout, rank, nrhs, conjugates,
                             stream);
  }
  if (!failed && !p.general) {
    solver::sum_log_diagonal(dtype, working, p.ld, layout, rank, &scalars->log_sum, stream);
    MESHLA_CHECK_NCCL(
        ncclAllReduce(&scalars->log_sum, &scalars->log_sum, 1, ncclFloat64, ncclSum, nccl, stream));
    double sum = 0.0;
    MESHLA_CHECK_CUDA(
        cudaMemcpyAsync(&sum, &scalars->log_sum, sizeof(double), cudaMemcpyDeviceToHost, stream));
    wait_for_peers();
    result.logdet = 2.0 * sum;
  }
  if (shard.info.data != nullptr) {
    MESHLA_CHECK_CUDA(cudaMemcpyAsync(shard.info.data, &result.info, sizeof(int),
                                      cudaMemcpyHostToDevice, stream));
  }
  if (shard.logdet.data != nullptr && !p.general) {
    const float logdet32 = static_cast<float>(result.logdet);
    const bool wide = shard.logdet.dtype == DType::kFloat64;
    MESHLA_CHECK_CUDA(cudaMemcpyAsync(
        shard.logdet.data, wide ? static_cast<const void*>(&result.logdet) : &logdet32,
        wide ? sizeof(double) : sizeof(float), cudaMemcpyHostToDevice, stream));
  }
  // The outputs are written, and the host values' copies read pageable memory that ends here.
  self.order.end(stream);
  MESHLA_CHECK_CUDA(cudaStreamSynchronize(stream));
  return result;
}

#else  // built without cuSOLVERMp's header: every use says so

namespace {

constexpr const char* kBuiltWithout =
    "meshla was built without cuSOLVERMp (MESHLA_WITH_CUSOLVERMP=OFF: pip install "
    "nvidia-cusolvermp-cu13==0.8.* before building meshla)";

[[noreturn]] void built_without() {
  MESHLA_THROW(kNotImplemented, "ProcessSolver: " << kBuiltWithout);
}

}  // namespace

struct ProcessSolver::Impl {};

ProcessSolver::ProcessSolver(Communicator) { built_without(); }
ProcessSolver::~ProcessSolver() = default;
ProcessSolver::ProcessSolver(ProcessSolver&&) noexcept = default;
ProcessSolver& ProcessSolver::operator=(ProcessSolver&&) noexcept = default;
std::string ProcessSolver::unavailable_reason() { return kBuiltWithout; }
int ProcessSolver::rank() const { built_without(); }
int ProcessSolver::size() const { built_without(); }
std::int64_t ProcessSolver::tile(SolverOp, const SolverProblem&) const { built_without(); }
std::size_t ProcessSolver::workspace_bytes(SolverOp, const SolverProblem&) const {
  built_without();
}
SolverResult ProcessSolver::run(SolverOp, const SolverProblem&, const SolverShard&) {
  built_without();
}

#endif

}  // namespace meshla
