#include "meshla/matmul.hpp"

#include <algorithm>
#include <array>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "core/cuda_checks.hpp"
#include "core/cuda_handles.hpp"
#include "core/cuda_types.hpp"
#include "gemm/random_fill.hpp"
#include "gemm/sm90_rowwise_fp8_gemm.hpp"

namespace meshla {
namespace {

constexpr std::size_t kWorkspaceBytes = kMatmulWorkspaceBytes;
// Heuristic candidates timed by prepare(), and timed runs of each.
constexpr int kCandidates = 8;
constexpr int kTuneRepeats = 5;

// Two timing events, destroyed with the scope.
struct TimingEvents {
  explicit TimingEvents(int device) {
    detail::DeviceGuard guard(device);
    MESHLA_CHECK_CUDA(cudaEventCreate(&start));
    if (cudaEventCreate(&stop) != cudaSuccess) {
      cudaEventDestroy(start);
      MESHLA_THROW(kCuda, "matmul: cudaEventCreate failed while tuning");
    }
  }
  ~TimingEvents() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  TimingEvents(const TimingEvents&) = delete;
  TimingEvents& operator=(const TimingEvents&) = delete;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
};

// Owns one cuBLASLt object; members of this type free what a throwing constructor made.
template <typename Handle, cublasStatus_t (*Destroy)(Handle)>
class LtOwned {
 public:
  LtOwned() = default;
  ~LtOwned() {
    if (handle_ != nullptr) Destroy(handle_);
  }
  LtOwned(const LtOwned&) = delete;
  LtOwned& operator=(const LtOwned&) = delete;
  Handle get() const { return handle_; }
  Handle* out() { return &handle_; }  // for the Create call

 private:
  Handle handle_ = nullptr;
};

bool is_16_or_32_bit_float(DType dtype) {
  return dtype == DType::kBFloat16 || dtype == DType::kFloat16 || dtype == DType::kFloat32;
}

DType b_dtype_of(const MatmulShape& s) { return s.b_dtype.value_or(s.dtype); }
DType out_dtype_of(const MatmulShape& s) { return s.out_dtype.value_or(s.dtype); }

// Largest power of two up to 256 dividing the address and every step from it.
std::uint32_t alignment_of(const void* pointer, std::int64_t pitch_bytes,
                           std::int64_t batch_stride_bytes) {
  std::uint64_t bits = reinterpret_cast<std::uint64_t>(pointer) | 256u |
                       static_cast<std::uint64_t>(pitch_bytes) |
                       static_cast<std::uint64_t>(batch_stride_bytes);
  return static_cast<std::uint32_t>(bits & (~bits + 1));
}

struct Alignments {
  std::uint32_t a = 256, b = 256, d = 256, addend = 256, bias = 256;
  auto tie() const { return std::tie(a, b, d, addend, bias); }
};

// Null operands count as fully aligned. Alignments past 16 bytes choose the same kernels, so they
// are folded to 16 to keep the cache small.
Alignments alignments_of(const MatmulShape& s, const MatmulOperands& ops) {
  const auto size = [](DType dtype) { return static_cast<std::int64_t>(dtype_size(dtype)); };
  const std::int64_t a_element = size(s.dtype), b_element = size(b_dtype_of(s));
  const std::int64_t element = size(out_dtype_of(s));  // d's, the addend's and the bias's
  Alignments align;
  align.a = alignment_of(ops.a, s.lda * a_element, s.batch_stride_a * a_element);
  align.b = alignment_of(ops.b, s.ldb * b_element, 0);
  align.d = alignment_of(ops.d, s.ldd * element, s.batch_stride_d * element);
  if (s.addend)
    align.addend = alignment_of(ops.addend, s.ldd * element, s.batch_stride_d * element);
  if (s.bias) align.bias = alignment_of(ops.bias, 0, 0);
  for (std::uint32_t* value : {&align.a, &align.b, &align.d, &align.addend, &align.bias}) {
    *value = std::min<std::uint32_t>(*value, 16);
  }
  return align;
}

struct ResolvedShape {
  MatmulShape shape;
  Alignments alignments;

  auto key() const {
    const MatmulShape& s = shape;
    return std::tuple_cat(
        std::make_tuple(static_cast<int>(s.dtype), static_cast<int>(b_dtype_of(s)),
                        static_cast<int>(out_dtype_of(s)), static_cast<int>(s.scaling), s.m, s.n,
                        s.k, s.trans_b, s.batch, s.lda, s.ldb, s.ldd, s.batch_stride_a,
                        s.batch_stride_d, s.bias, s.addend, s.sm_count),
        alignments.tie());
  }
};

using Key = decltype(std::declval<ResolvedShape>().key());

MatmulShape with_packed_pitches(MatmulShape shape) {
  if (shape.lda == 0) shape.lda = shape.k;
  if (shape.ldb == 0) shape.ldb = shape.trans_b ? shape.k : shape.n;
  if (shape.ldd == 0) shape.ldd = shape.n;
  return shape;
}

void check_packed_shape(const MatmulShape& s) {
  MESHLA_CHECK_ARG(s.m >= 0 && s.n >= 0 && s.k >= 0,
                   "matmul: negative extent in m=" << s.m << ", n=" << s.n << ", k=" << s.k);
  MESHLA_CHECK_ARG(s.batch >= 1, "matmul: batch=" << s.batch << " must be at least 1");
  MESHLA_CHECK_ARG(s.lda >= s.k, "matmul: lda=" << s.lda << " is smaller than k=" << s.k);
  MESHLA_CHECK_ARG(s.ldb >= (s.trans_b ? s.k : s.n),
                   "matmul: ldb=" << s.ldb << " is smaller than the row length "
                                  << (s.trans_b ? s.k : s.n) << " of b ("
                                  << (s.trans_b ? "[n, k]" : "[k, n]") << ", n=" << s.n
                                  << ", k=" << s.k << ")");
  MESHLA_CHECK_ARG(s.ldd >= s.n, "matmul: ldd=" << s.ldd << " is smaller than n=" << s.n);
  MESHLA_CHECK_ARG(s.sm_count >= 0, "matmul: sm_count=" << s.sm_count << " is negative");
  const DType b_dtype = b_dtype_of(s), out_dtype = out_dtype_of(s);
  if (!is_float8(s.dtype) && !is_float8(b_dtype)) {
    MESHLA_CHECK(kNotImplemented, is_16_or_32_bit_float(s.dtype),
                 "matmul: dtype " << dtype_name(s.dtype)
                                  << " is not supported; use bfloat16, float16 or float32 (or "
                                     "float8 with scales)");
    MESHLA_CHECK_ARG(b_dtype == s.dtype && out_dtype == s.dtype,
                     "matmul: a " << dtype_name(s.dtype) << " product takes b and d of its dtype, "
                                  << "not b " << dtype_name(b_dtype) << " and d "
                                  << dtype_name(out_dtype));
    MESHLA_CHECK_ARG(s.scaling == MatmulScaling::kNone,
                     "matmul: scales apply to float8 operands, not " << dtype_name(s.dtype));
    return;
  }
  MESHLA_CHECK_ARG(is_float8(s.dtype) && is_float8(b_dtype),
                   "matmul: a (" << dtype_name(s.dtype) << ") and b (" << dtype_name(b_dtype)
                                 << ") must both be float8");
  MESHLA_CHECK(kNotImplemented, s.dtype != DType::kFloat8E5M2 || b_dtype != DType::kFloat8E5M2,
               "matmul: cuBLASLt has no float8_e5m2 x float8_e5m2 GEMM; make one operand "
               "float8_e4m3fn");
  MESHLA_CHECK_ARG(is_16_or_32_bit_float(out_dtype),
                   "matmul: a float8 product's d is bfloat16, float16 or float32, not "
                       << dtype_name(out_dtype));
  MESHLA_CHECK_ARG(s.scaling != MatmulScaling::kNone,
                   "matmul: float8 operands need their scales (tensorwise or rowwise)");
  MESHLA_CHECK(kNotImplemented, s.trans_b,
               "matmul: float8 needs b stored [n, k] (trans_b): cuBLASLt's fp8 GEMM reads both "
               "operands along k");
  MESHLA_CHECK_ARG(s.k % 16 == 0 && s.lda % 16 == 0 && s.ldb % 16 == 0,
                   "matmul: float8 rows must start 16 bytes apart: k=" << s.k << ", lda=" << s.lda
                                                                       << " and ldb=" << s.ldb
                                                                       << " must be multiples "
                                                                          "of 16");
  MESHLA_CHECK(kNotImplemented, !s.addend, "matmul: a float8 product takes no addend");
  MESHLA_CHECK(kNotImplemented, !s.bias || out_dtype != DType::kFloat32,
               "matmul: a float8 product with a float32 d takes no bias");
  MESHLA_CHECK(kNotImplemented, s.scaling != MatmulScaling::kRowwise || s.batch == 1,
               "matmul: rowwise scales take a batch of 1, not " << s.batch);
  MESHLA_CHECK(kNotImplemented,
               s.scaling != MatmulScaling::kRowwise || out_dtype != DType::kFloat16,
               "matmul: a rowwise float8 product's d is bfloat16 or float32, not float16");
}

// The cuBLASLt objects for one shape and alignment, made once.
class Descriptors {
 public:
  Descriptors(cublasLtHandle_t handle, const ResolvedShape& resolved, std::size_t workspace_bytes) {
    const MatmulShape& s = resolved.shape;
    const cudaDataType_t a_type = detail::cuda_data_type(s.dtype);
    const cudaDataType_t b_type = detail::cuda_data_type(b_dtype_of(s));
    const cudaDataType_t type = detail::cuda_data_type(out_dtype_of(s));  // d's and the bias's
    MESHLA_CHECK_CUBLAS(cublasLtMatmulDescCreate(desc_.out(), CUBLAS_COMPUTE_32F, CUDA_R_32F));
    scaled_ = s.scaling != MatmulScaling::kNone;
    if (s.scaling == MatmulScaling::kRowwise) {
      // One float per row of cuBLAS's A (our b: per output column) and of its B (our a: per row).
      const std::int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
      for (const auto attribute :
           {CUBLASLT_MATMUL_DESC_A_SCALE_MODE, CUBLASLT_MATMUL_DESC_B_SCALE_MODE}) {
        MESHLA_CHECK_CUBLAS(
            cublasLtMatmulDescSetAttribute(desc_.get(), attribute, &mode, sizeof(mode)));
      }
    }
    // Row-major d = a @ op(b) is column-major d^T = op(b)^T a^T: cuBLAS's first operand is b.
    const cublasOperation_t op_b = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_n = CUBLAS_OP_N;
    MESHLA_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc_.get(), CUBLASLT_MATMUL_DESC_TRANSA,
                                                       &op_b, sizeof(op_b)));
    MESHLA_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc_.get(), CUBLASLT_MATMUL_DESC_TRANSB,
                                                       &op_n, sizeof(op_n)));
    if (s.bias) {
      const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
      MESHLA_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc_.get(), CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                         &epilogue, sizeof(epilogue)));
      MESHLA_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(
          desc_.get(), CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &type, sizeof(type)));
    }
    if (s.sm_count > 0) {
      MESHLA_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(
          desc_.get(), CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &s.sm_count, sizeof(s.sm_count)));
    }
    if (s.trans_b) {
      MESHLA_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(layout_b_.out(), b_type, s.k, s.n, s.ldb));
    } else {
      MESHLA_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(layout_b_.out(), b_type, s.n, s.k, s.ldb));
    }
    MESHLA_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(layout_a_.out(), a_type, s.k, s.m, s.lda));
    MESHLA_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(layout_d_.out(), type, s.n, s.m, s.ldd));
    if (s.batch > 1) {
      set_batch(layout_b_.get(), s.batch, 0);  // b is shared by the batch
      set_batch(layout_a_.get(), s.batch, s.batch_stride_a);
      set_batch(layout_d_.get(), s.batch, s.batch_stride_d);
    }
    choose_algorithm(handle, resolved, workspace_bytes);
  }

  Descriptors(const Descriptors&) = delete;
  Descriptors& operator=(const Descriptors&) = delete;

  void run(cublasLtHandle_t handle, const MatmulOperands& ops, bool addend, void* workspace,
           std::size_t workspace_bytes, cudaStream_t stream) {
    launch(algorithm_, handle, ops, addend, workspace, workspace_bytes, stream);
  }

  // Times every candidate on `ops` (scratch data) and keeps the fastest: the heuristic's first
  // choice is often not it, above all under an SM count target.
  bool needs_tuning() const { return !tuned_ && candidates_.size() >= 2; }

  void tune(cublasLtHandle_t handle, const MatmulOperands& ops, bool addend, void* workspace,
            std::size_t workspace_bytes, cudaStream_t stream, int device) {
    if (!needs_tuning()) return;
    float best = std::numeric_limits<float>::infinity();
    cublasLtMatmulAlgo_t best_algorithm = candidates_.front();
    for (const cublasLtMatmulAlgo_t& candidate : candidates_) {
      launch(candidate, handle, ops, addend, workspace, workspace_bytes, stream);  // warm-up
      TimingEvents events(device);
      MESHLA_CHECK_CUDA(cudaEventRecord(events.start, stream));
      for (int i = 0; i < kTuneRepeats; ++i) {
        launch(candidate, handle, ops, addend, workspace, workspace_bytes, stream);
      }
      MESHLA_CHECK_CUDA(cudaEventRecord(events.stop, stream));
      MESHLA_CHECK_CUDA(cudaEventSynchronize(events.stop));
      float elapsed = 0;
      MESHLA_CHECK_CUDA(cudaEventElapsedTime(&elapsed, events.start, events.stop));
      if (elapsed < best) {
        best = elapsed;
        best_algorithm = candidate;
      }
    }
    algorithm_ = best_algorithm;
    tuned_ = true;
  }

 private:
  static void set_batch(cublasLtMatrixLayout_t layout, int batch, std::int64_t stride) {
    MESHLA_CHECK_CUBLAS(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                         &batch, sizeof(batch)));
    MESHLA_CHECK_CUBLAS(cublasLtMatrixLayoutSetAttribute(
        layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
  }

  void choose_algorithm(cublasLtHandle_t handle, const ResolvedShape& resolved,
                        std::size_t workspace_bytes) {
    MESHLA_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(preference_.out()));
    auto set = [&](cublasLtMatmulPreferenceAttributes_t attribute, auto value) {
      MESHLA_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(preference_.get(), attribute, &value,
                                                               sizeof(value)));
    };
    set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<std::uint64_t>(workspace_bytes));
    const Alignments& align = resolved.alignments;
    // cuBLAS's A is our b, its B our a, its C the addend (or d), its D our d.
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align.b);
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align.a);
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, std::min(align.addend, align.d));
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align.d);
    std::array<cublasLtMatmulHeuristicResult_t, kCandidates> results{};
    int found = 0;
    MESHLA_CHECK_CUBLAS(cublasLtMatmulAlgoGetHeuristic(
        handle, desc_.get(), layout_b_.get(), layout_a_.get(), layout_d_.get(), layout_d_.get(),
        preference_.get(), kCandidates, results.data(), &found));
    const MatmulShape& s = resolved.shape;
    if (found == 0) {
      MESHLA_THROW(kNotImplemented, "matmul: cuBLASLt has no algorithm for "
                                        << dtype_name(s.dtype) << " m=" << s.m << ", n=" << s.n
                                        << ", k=" << s.k << ", batch=" << s.batch
                                        << ", trans_b=" << s.trans_b);
    }
    for (int i = 0; i < found; ++i) candidates_.push_back(results[i].algo);
    algorithm_ = candidates_.front();
  }

  void launch(const cublasLtMatmulAlgo_t& algorithm, cublasLtHandle_t handle,
              const MatmulOperands& ops, bool addend, void* workspace, std::size_t workspace_bytes,
              cudaStream_t stream) {
    if (ops.bias != nullptr) {
      MESHLA_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(
          desc_.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ops.bias, sizeof(ops.bias)));
    }
    if (scaled_) {  // cuBLAS's A is our b, its B our a
      MESHLA_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(
          desc_.get(), CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ops.b_scale, sizeof(ops.b_scale)));
      MESHLA_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(
          desc_.get(), CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &ops.a_scale, sizeof(ops.a_scale)));
    }
    const float alpha = 1.0f;
    const float beta = addend ? 1.0f : 0.0f;
    const void* c = addend ? ops.addend : ops.d;
    MESHLA_CHECK_CUBLAS(cublasLtMatmul(
        handle, desc_.get(), &alpha, ops.b, layout_b_.get(), ops.a, layout_a_.get(), &beta, c,
        layout_d_.get(), ops.d, layout_d_.get(), &algorithm, workspace, workspace_bytes, stream));
  }

  LtOwned<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy> desc_;
  LtOwned<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy> layout_a_;
  LtOwned<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy> layout_b_;
  LtOwned<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy> layout_d_;
  LtOwned<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy> preference_;
  cublasLtMatmulAlgo_t algorithm_{};
  std::vector<cublasLtMatmulAlgo_t> candidates_;
  bool tuned_ = false;
  bool scaled_ = false;  // float8: the scale pointers are set at each launch
};

// The device's cuBLASLt handle, made on first use and kept for the process's life: a registry
// keyed by device. cublasLtDestroy invalidates the CUDA graph captures under way on the device,
// whatever their thread and capture mode, and plans go at moments no thread chose (with the last
// graph that held them, on a thread of their own). A cuBLASLt handle keeps no per-call state (the
// stream, workspace and algorithm are each call's), so the plans of a device share it, from any
// thread.
cublasLtHandle_t device_handle(int device) {
  static std::mutex* const mutex = new std::mutex();
  static auto* const handles = new std::map<int, cublasLtHandle_t>();
  std::lock_guard lock(*mutex);
  cublasLtHandle_t& handle = (*handles)[device];
  if (handle == nullptr) {
    detail::DeviceGuard guard(device);
    MESHLA_CHECK_CUBLAS(cublasLtCreate(&handle));
  }
  return handle;
}

int device_attribute(int device, cudaDeviceAttr attribute) {
  int value = 0;
  MESHLA_CHECK_CUDA(cudaDeviceGetAttribute(&value, attribute, device));
  return value;
}

}  // namespace

struct Matmul::Impl {
  explicit Impl(int device_)
      : device(device_),
        handle(device_handle(device_)),
        workspace(device_, kWorkspaceBytes),
        sm_count(device_attribute(device_, cudaDevAttrMultiProcessorCount)),
        capability(10 * device_attribute(device_, cudaDevAttrComputeCapabilityMajor) +
                   device_attribute(device_, cudaDevAttrComputeCapabilityMinor)) {}

  // fp8 tensor cores came with Ada and Hopper (compute capability 8.9). On Hopper rowwise scales
  // have only meshla's kernel: CUDA 13.0's cuBLASLt refuses outer-vector scales on sm_90.
  void check_runs(const MatmulShape& shape) const {
    MESHLA_CHECK(kNotImplemented, shape.scaling == MatmulScaling::kNone || capability >= 89,
                 "matmul: float8 needs compute capability 8.9 or newer; cuda:"
                     << device << " is " << capability / 10 << "." << capability % 10);
    MESHLA_CHECK(
        kNotImplemented,
        shape.scaling != MatmulScaling::kRowwise || capability != 90 || runs_cutlass(shape),
        "matmul: rowwise float8 on sm_90 runs meshla's Hopper kernel, which "
        "MESHLA_PORTABLE=1 turns off (cuBLASLt has no outer-vector scales there)");
  }

  // Rowwise fp8 on Hopper runs meshla's CUTLASS kernel (sm90_rowwise_fp8_gemm.hpp), which needs
  // no tuning; elsewhere cuBLASLt's outer-vector scales.
  bool runs_cutlass(const MatmulShape& shape) const {
    return shape.scaling == MatmulScaling::kRowwise && detail::runs_hopper_kernels(device);
  }

  Descriptors& lookup(const ResolvedShape& resolved) {
    auto key = resolved.key();
    auto found = cache.find(key);
    if (found != cache.end()) return *found->second;
    auto made = std::make_unique<Descriptors>(handle, resolved, workspace.bytes());
    return *cache.emplace(key, std::move(made)).first->second;
  }

  int device;
  cublasLtHandle_t handle = nullptr;
  detail::DeviceBuffer workspace;
  int sm_count;
  int capability;  // 10 * major + minor
  std::map<Key, std::unique_ptr<Descriptors>> cache;
};

Matmul::Matmul(int device) : impl_(std::make_unique<Impl>(device)) {}
Matmul::~Matmul() = default;
Matmul::Matmul(Matmul&&) noexcept = default;
Matmul& Matmul::operator=(Matmul&&) noexcept = default;

int Matmul::device() const { return impl_->device; }

void check_matmul_shape(const MatmulShape& shape) {
  check_packed_shape(with_packed_pitches(shape));
}

void Matmul::prepare(const MatmulShape& shape) {
  const MatmulShape packed = with_packed_pitches(shape);
  check_packed_shape(packed);
  impl_->check_runs(packed);
  if (packed.m == 0 || packed.n == 0 || impl_->runs_cutlass(packed)) return;
  // Operands as the framework allocators hand them out: aligned far past 16 bytes.
  Descriptors& descriptors = impl_->lookup({packed, alignments_of(packed, MatmulOperands{})});
  if (!descriptors.needs_tuning()) return;
  // Scratch operands of the shape's extent, filled with random data, for timing candidates.
  const DType b_dtype = b_dtype_of(packed), out_dtype = out_dtype_of(packed);
  const auto extent = [](std::int64_t rows, std::int64_t cols, std::int64_t pitch, int batch,
                         std::int64_t batch_stride) {
    return static_cast<std::size_t>((batch - 1) * batch_stride + (rows - 1) * pitch + cols);
  };
  const std::size_t a_count =
      extent(packed.m, packed.k, packed.lda, packed.batch, packed.batch_stride_a);
  const std::size_t b_count = packed.trans_b ? extent(packed.n, packed.k, packed.ldb, 1, 0)
                                             : extent(packed.k, packed.n, packed.ldb, 1, 0);
  const std::size_t d_count =
      extent(packed.m, packed.n, packed.ldd, packed.batch, packed.batch_stride_d);
  const bool rowwise = packed.scaling == MatmulScaling::kRowwise;
  const bool scaled = packed.scaling != MatmulScaling::kNone;
  const int device = impl_->device;
  detail::DeviceGuard guard(device);
  detail::Stream stream(device, /*high_priority=*/false);
  // Stream-ordered: plans tune after their ranks have met, and a cudaFree there could wait for a
  // peer device whose queued work waits for this thread (several GPUs driven from one process).
  // The timing runs have a workspace of their own, so that runs already queued may use the
  // Matmul's meanwhile.
  const auto scratch = [&](std::size_t count, DType dtype) {
    detail::StreamBuffer buffer(count * dtype_size(dtype), stream.get());
    detail::random_fill(buffer.data(), dtype, count, 17, stream.get());
    return buffer;
  };
  detail::StreamBuffer workspace(kWorkspaceBytes, stream.get());
  detail::StreamBuffer a = scratch(a_count, packed.dtype);
  detail::StreamBuffer b = scratch(b_count, b_dtype);
  detail::StreamBuffer d(d_count * dtype_size(out_dtype), stream.get());
  detail::StreamBuffer addend = scratch(packed.addend ? d_count : 0, out_dtype);
  detail::StreamBuffer bias = scratch(packed.bias ? packed.n : 0, out_dtype);
  detail::StreamBuffer a_scale = scratch(scaled ? (rowwise ? packed.m : 1) : 0, DType::kFloat32);
  detail::StreamBuffer b_scale = scratch(scaled ? (rowwise ? packed.n : 1) : 0, DType::kFloat32);
  descriptors.tune(impl_->handle,
                   {.a = a.data(),
                    .b = b.data(),
                    .bias = bias.data(),
                    .addend = addend.data(),
                    .d = d.data(),
                    .a_scale = static_cast<const float*>(a_scale.data()),
                    .b_scale = static_cast<const float*>(b_scale.data())},
                   packed.addend, workspace.data(), workspace.bytes(), stream.get(), device);
  MESHLA_CHECK_CUDA(cudaStreamSynchronize(stream.get()));
}

void Matmul::run(const MatmulShape& shape, const MatmulOperands& ops, cudaStream_t stream) {
  const MatmulShape packed = with_packed_pitches(shape);
  check_packed_shape(packed);
  impl_->check_runs(packed);
  if (packed.m == 0 || packed.n == 0) return;
  MESHLA_CHECK_ARG(ops.a && ops.b && ops.d,
                   "matmul: a, b and d must be non-null (m=" << packed.m << ", n=" << packed.n
                                                             << ", k=" << packed.k << ")");
  MESHLA_CHECK_ARG(!packed.bias || ops.bias, "matmul: the shape asks for a bias but none is given");
  MESHLA_CHECK_ARG(!packed.addend || ops.addend,
                   "matmul: the shape asks for an addend but none is given");
  MESHLA_CHECK_ARG(packed.scaling == MatmulScaling::kNone || (ops.a_scale && ops.b_scale),
                   "matmul: a float8 product needs a_scale and b_scale");
  MESHLA_CHECK_ARG(reinterpret_cast<std::uintptr_t>(ops.workspace) % 256 == 0,
                   "matmul: the call's workspace is not 256-byte aligned");
  void* workspace = ops.workspace != nullptr ? ops.workspace : impl_->workspace.data();
  detail::DeviceGuard guard(impl_->device);
  if (impl_->runs_cutlass(packed)) {
    gemm::run_sm90_rowwise_fp8(packed, ops, impl_->device,
                               packed.sm_count > 0 ? packed.sm_count : impl_->sm_count, workspace,
                               kWorkspaceBytes, stream);
    return;
  }
  impl_->lookup({packed, alignments_of(packed, ops)})
      .run(impl_->handle, ops, packed.addend, workspace, kWorkspaceBytes, stream);
}

}  // namespace meshla
