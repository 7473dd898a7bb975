// The cuBLASMp backend of collective matmul: cuBLASMp's own AG+GEMM, GEMM+RS (its split
// peer-to-peer algorithm) and GEMM+AR (unoverlapped) on the plan's NCCL communicator. cuBLASMp 0.7
// starts NVSHMEM over the ranks of the first grid a process creates, so a process serves one
// cuBLASMp group: the ranks of its first communicator.
//
// The layouts (which of cuBLASMp's operands is which array) are
// collective/cublasmp/cublasmp_layout.hpp's. The bias is added by meshla after cuBLASMp returns:
// cuBLASMp before 0.9 adds an epilogue bias to GEMM+AR once per rank, and a reduced product must
// carry it once.
#include <array>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "collective/cublasmp/add_bias.hpp"
#include "collective/cublasmp/cublasmp_layout.hpp"
#include "collective/cublasmp/cublasmp_library.hpp"
#include "collective/executor.hpp"
#include "comm/comm_state.hpp"
#include "core/cuda_checks.hpp"
#include "core/cuda_handles.hpp"
#include "core/cuda_types.hpp"

namespace meshla::collective {
namespace {

template <typename Handle>
using Owned = std::unique_ptr<std::remove_pointer_t<Handle>, std::function<void(Handle)>>;

// Device workspace on NVSHMEM's symmetric heap, where cuBLASMp 0.7's overlapped algorithms need
// it. nvshmem_malloc and nvshmem_free are collective: every rank of the group allocates and frees
// its plans' workspaces in the same order.
class SymmetricWorkspace {
 public:
  SymmetricWorkspace(const CublasMpLibrary& library, std::size_t bytes)
      : library_(library), bytes_(bytes) {
    if (bytes == 0) return;
    data_ = library.nvshmem_malloc(bytes);
    MESHLA_CHECK(kCuda, data_ != nullptr,
                 "backend=cublasmp: nvshmem_malloc(" << bytes
                                                     << ") failed; NVSHMEM's symmetric heap is "
                                                        "full (see NVSHMEM_SYMMETRIC_SIZE)");
  }
  ~SymmetricWorkspace() {
    if (data_ != nullptr) library_.nvshmem_free(data_);
  }
  SymmetricWorkspace(const SymmetricWorkspace&) = delete;
  SymmetricWorkspace& operator=(const SymmetricWorkspace&) = delete;
  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

 private:
  const CublasMpLibrary& library_;
  std::size_t bytes_;
  void* data_ = nullptr;
};

// The cuBLASMp handle and process grids of one communicator, shared by all its plans: each grid
// takes one of NVSHMEM's few teams (32 by default, and running out aborts the process), so plans
// must not make their own. Holds the communicator, so it never outlives it.
struct GroupContext {
  GroupContext(const CublasMpLibrary& library, const Communicator& comm_)
      : comm(comm_), stream(comm_.device(), /*high_priority=*/false) {
    cublasMpHandle_t raw_handle = nullptr;
    MESHLA_CHECK_CUBLASMP(library.create(&raw_handle, stream.get()));
    handle = Owned<cublasMpHandle_t>(raw_handle, library.destroy);
    // The first grid of the process starts NVSHMEM over this communicator's ranks.
    grid_rows = make_grid(library, comm.size(), 1, CUBLASMP_GRID_LAYOUT_COL_MAJOR);
    grid_columns = make_grid(library, 1, comm.size(), CUBLASMP_GRID_LAYOUT_ROW_MAJOR);
  }
  ~GroupContext() {
    detail::DeviceGuard guard(comm.device());
    grid_columns.reset();
    grid_rows.reset();
    handle.reset();
  }
  GroupContext(const GroupContext&) = delete;
  GroupContext& operator=(const GroupContext&) = delete;

  Owned<cublasMpGrid_t> make_grid(const CublasMpLibrary& library, std::int64_t rows,
                                  std::int64_t cols, cublasMpGridLayout_t layout) const {
    cublasMpGrid_t grid = nullptr;
    MESHLA_CHECK_CUBLASMP(library.grid_create(rows, cols, layout, comm.state()->comm, &grid));
    return Owned<cublasMpGrid_t>(grid, library.grid_destroy);
  }

  Communicator comm;
  detail::Stream stream;  // the handle's stream outside execute(): creation and warm-ups
  Owned<cublasMpHandle_t> handle;
  Owned<cublasMpGrid_t> grid_rows;     // P x 1
  Owned<cublasMpGrid_t> grid_columns;  // 1 x P
};

// Registry of the live contexts, keyed by the communicator state they serve (one context per
// communicator, for as long as one of its plans lives).
std::shared_ptr<GroupContext> group_context(const CublasMpLibrary& library,
                                            const Communicator& comm) {
  static std::mutex mutex;
  static std::map<const detail::CommState*, std::weak_ptr<GroupContext>> contexts;
  static int nvshmem_ranks = 0;  // size of the group NVSHMEM was started over; 0 before that
  const std::lock_guard<std::mutex> lock(mutex);
  std::erase_if(contexts, [](const auto& entry) { return entry.second.expired(); });
  std::weak_ptr<GroupContext>& slot = contexts[comm.state().get()];
  std::shared_ptr<GroupContext> context = slot.lock();
  if (context == nullptr) {
    MESHLA_CHECK(kNotImplemented, nvshmem_ranks == 0 || nvshmem_ranks == comm.size(),
                 "backend=cublasmp: this process started cuBLASMp's NVSHMEM over a group of "
                     << nvshmem_ranks << " ranks and cannot use it for a group of " << comm.size()
                     << "; use one cuBLASMp group per process");
    context = std::make_shared<GroupContext>(library, comm);
    nvshmem_ranks = comm.size();
    slot = context;
  }
  return context;
}

class CublasMpExecutor final : public Executor {
 public:
  CublasMpExecutor(const CublasMpLibrary& library, const Communicator& comm,
                   const CollectiveMatmulConfig& config)
      : Executor(plan_order(comm)),
        library_(library),
        context_(group_context(library, comm)),
        config_(config),
        tp_(comm.size()) {
    const CollectiveMatmulConfig& c = config;
    const CublasMpLayout layout = cublasmp_layout(c, tp_);
    shape_ = layout.shape;
    out_rows_ = layout.out_rows;
    a_desc_ = describe(layout.a);
    b_desc_ = describe(layout.b);
    d_desc_ = describe(layout.d);

    cublasMpMatmulDescriptor_t matmul = nullptr;
    MESHLA_CHECK_CUBLASMP(library.matmul_descriptor_create(&matmul, CUBLAS_COMPUTE_32F));
    matmul_desc_ = Owned<cublasMpMatmulDescriptor_t>(matmul, library.matmul_descriptor_destroy);
    set_attribute(CUBLASMP_MATMUL_DESCRIPTOR_ATTRIBUTE_TRANSA,
                  layout.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N);
    set_attribute(CUBLASMP_MATMUL_DESCRIPTOR_ATTRIBUTE_TRANSB, CUBLAS_OP_N);
    // Never the default or multicast algorithms: NVLink multicast can take a shared host's GPUs
    // out of service.
    set_attribute(CUBLASMP_MATMUL_DESCRIPTOR_ATTRIBUTE_ALGO_TYPE,
                  c.algorithm == Algorithm::kSequential ? CUBLASMP_MATMUL_ALGO_TYPE_NO_OVERLAP
                                                        : CUBLASMP_MATMUL_ALGO_TYPE_SPLIT_P2P);
    if (c.op == CollectiveOp::kMatmulAllReduce) {
      set_attribute(CUBLASMP_MATMUL_DESCRIPTOR_ATTRIBUTE_EPILOGUE,
                    CUBLASMP_MATMUL_EPILOGUE_ALLREDUCE);
    }
    if (c.comm_sms > 0) {
      set_attribute(CUBLASMP_MATMUL_DESCRIPTOR_ATTRIBUTE_COMMUNICATION_SM_COUNT, c.comm_sms);
    }
    warm_up();
  }

  // In this order, with the plan's device current: the workspace and descriptors go before the
  // grids they belong to (the shared context, which goes last).
  ~CublasMpExecutor() override {
    detail::DeviceGuard guard(context_->comm.device());
    workspace_.reset();
    matmul_desc_.reset();
    d_desc_.reset();
    b_desc_.reset();
    a_desc_.reset();
  }
  CublasMpExecutor(const CublasMpExecutor&) = delete;
  CublasMpExecutor& operator=(const CublasMpExecutor&) = delete;

  void enqueue(const CollectiveMatmulArgs& args, cudaStream_t stream) override {
    MESHLA_CHECK_CUBLASMP(library_.stream_set(context_->handle.get(), stream));
    matmul(args.b.data, args.a.data, args.out.data);
    if (config_.bias) {
      add_bias(config_.dtype, args.out.data, out_rows_, config_.n, args.bias.data, stream);
    }
  }

 private:
  Owned<cublasMpMatrixDescriptor_t> describe(const CublasMpOperand& o) {
    cublasMpMatrixDescriptor_t desc = nullptr;
    // Column-major local blocks: the leading dimension is the block's row count.
    MESHLA_CHECK_CUBLASMP(library_.matrix_descriptor_create(
        o.rows, o.cols, o.row_block, o.col_block, 0, 0, o.row_block,
        detail::cuda_data_type(config_.dtype),
        o.rows_over_ranks ? context_->grid_rows.get() : context_->grid_columns.get(), &desc));
    return Owned<cublasMpMatrixDescriptor_t>(desc, library_.matrix_descriptor_destroy);
  }

  template <typename Value>
  void set_attribute(cublasMpMatmulDescriptorAttribute_t attribute, Value value) {
    MESHLA_CHECK_CUBLASMP(library_.matmul_descriptor_attribute_set(matmul_desc_.get(), attribute,
                                                                   &value, sizeof(value)));
  }

  // D = A B with this plan's descriptors; A is meshla's b, B its a.
  void matmul(const void* a, const void* b, void* d) {
    const float alpha = 1.0f;
    const float beta = 0.0f;
    MESHLA_CHECK_CUBLASMP(library_.matmul(context_->handle.get(), matmul_desc_.get(), shape_[0],
                                          shape_[1], shape_[2], &alpha, a, 1, 1, a_desc_.get(), b,
                                          1, 1, b_desc_.get(), &beta, nullptr, 1, 1, nullptr, d, 1,
                                          1, d_desc_.get(), workspace_->data(), workspace_->bytes(),
                                          host_workspace_.data(), host_workspace_.size()));
  }

  // Sizes the workspaces and runs the op once on zeros, so that cuBLASMp's
  // lazy set-up (NVSHMEM buffers, signals, kernels) happens here and not inside a CUDA-graph
  // capture. The inputs are freed before returning, also when it throws.
  void warm_up() {
    const CollectiveMatmulConfig& c = config_;
    const int device = context_->comm.device();
    const std::size_t element = dtype_size(c.dtype);
    const std::int64_t a_rows = c.op == CollectiveOp::kAllGatherMatmul ? c.m / tp_ : c.m;
    detail::DeviceBuffer a(device, static_cast<std::size_t>(a_rows * c.k) * element);
    detail::DeviceBuffer b(device, static_cast<std::size_t>(c.k * c.n) * element);
    detail::DeviceBuffer d(device, static_cast<std::size_t>(out_rows_ * c.n) * element);
    const cudaStream_t stream = context_->stream.get();
    MESHLA_CHECK_CUDA(cudaMemsetAsync(a.data(), 0, a.bytes(), stream));
    MESHLA_CHECK_CUDA(cudaMemsetAsync(b.data(), 0, b.bytes(), stream));
    const float alpha = 1.0f;
    const float beta = 0.0f;
    std::size_t device_bytes = 0;
    std::size_t host_bytes = 0;
    const cublasMpStatus_t sized = library_.matmul_buffer_size(
        context_->handle.get(), matmul_desc_.get(), shape_[0], shape_[1], shape_[2], &alpha,
        b.data(), 1, 1, a_desc_.get(), a.data(), 1, 1, b_desc_.get(), &beta, nullptr, 1, 1, nullptr,
        d.data(), 1, 1, d_desc_.get(), &device_bytes, &host_bytes);
    MESHLA_CHECK(kNotImplemented, sized != CUBLASMP_STATUS_NOT_SUPPORTED,
                 collective_op_name(c.op)
                     << ": cuBLASMp " << library_.version / 1000 << "."
                     << library_.version / 100 % 10 << " cannot run m=" << c.m << ", n=" << c.n
                     << ", k=" << c.k << ", trans_b=" << c.trans_b << " on " << tp_
                     << " ranks with algorithm=" << algorithm_name(c.algorithm)
                     << " (CUBLASMP_STATUS_NOT_SUPPORTED)");
    MESHLA_CHECK_CUBLASMP(sized);
    workspace_ = std::make_unique<SymmetricWorkspace>(library_, device_bytes);
    host_workspace_.resize(host_bytes);
    MESHLA_CHECK_CUBLASMP(library_.stream_set(context_->handle.get(), stream));
    matmul(b.data(), a.data(), d.data());
    detail::Event done(device);
    MESHLA_CHECK_CUDA(cudaEventRecord(done.get(), stream));
    const std::chrono::milliseconds timeout = context_->comm.timeout();
    const cudaError_t waited = detail::wait_for_event(done.get(), timeout);
    MESHLA_CHECK(kTimeout, waited != cudaErrorNotReady,
                 "backend=cublasmp: the warm-up " << collective_op_name(c.op)
                                                  << " did not finish within " << timeout.count()
                                                  << " ms; is every rank building the same plan?");
    MESHLA_CHECK_CUDA(waited);
  }

  const CublasMpLibrary& library_;
  std::shared_ptr<GroupContext> context_;  // outlives every cuBLASMp object below
  CollectiveMatmulConfig config_;
  std::int64_t tp_;
  std::array<std::int64_t, 3> shape_{};
  std::int64_t out_rows_ = 0;
  Owned<cublasMpMatrixDescriptor_t> a_desc_;
  Owned<cublasMpMatrixDescriptor_t> b_desc_;
  Owned<cublasMpMatrixDescriptor_t> d_desc_;
  Owned<cublasMpMatmulDescriptor_t> matmul_desc_;
  std::unique_ptr<SymmetricWorkspace> workspace_;
  std::vector<std::byte> host_workspace_;
};

}  // namespace

std::unique_ptr<Executor> make_cublasmp_executor(const Communicator& comm,
                                                 const CollectiveMatmulConfig& config) {
  std::string why;
  const CublasMpLibrary* library = cublasmp_library(&why);
  MESHLA_ASSERT(library != nullptr);  // the caller has checked availability on every rank
  MESHLA_CHECK(kNotImplemented, comm.state()->ranks_in_process() == 1,
               collective_op_name(config.op)
                   << ": backend=cublasmp needs one process per GPU (cuBLASMp 0.7 runs on "
                      "NVSHMEM, one process per rank), but this process drives "
                   << comm.state()->ranks_in_process() << " ranks of the group");
  detail::DeviceGuard guard(comm.device());
  return std::make_unique<CublasMpExecutor>(*library, comm, config);
}

}  // namespace meshla::collective
