#include "collective/validation.hpp"

#include <algorithm>
#include <string>
#include <vector>

#include "collective/schedule.hpp"
#include "collective/symmetric/peer_plan.hpp"
#include "core/checks.hpp"

namespace meshla::collective {
namespace {

std::string expected_shape(std::int64_t rows, std::int64_t cols) {
  if (rows < 0) return "[" + std::to_string(cols) + "]";
  return "[" + std::to_string(rows) + ", " + std::to_string(cols) + "]";
}

std::string shape_of(const TensorView& view) { return view.shape_string(); }

// Where a group runs (device < 0: on the host, a group of CPU tensors).
std::string group_place(int device) {
  return device < 0 ? "cpu" : "cuda:" + std::to_string(device);
}

// Checks that `view` is where the group runs (device < 0: on the host).
void check_place(std::string_view op, const char* name, const TensorView& view, int device) {
  const bool here = device < 0 ? view.device_kind == DeviceKind::kCpu
                               : view.device_kind == DeviceKind::kCuda && view.device == device;
  MESHLA_CHECK_ARG(here, op << ": " << name << " is on " << view.place_string()
                            << " but the group runs on " << group_place(device));
}

// Checks one array; rows < 0 means a vector of `cols`. `why` (a callable returning the reason for
// the expected shape) runs only on failure, so a passing call builds no string.
// An array given without data (`need_data` false: a framework's abstract array) is checked on
// its metadata.
template <typename Why>
void check_matrix(std::string_view op, const char* name, const TensorView& view, std::int64_t rows,
                  std::int64_t cols, DType dtype, int device, Why why, bool need_data = true) {
  MESHLA_CHECK_ARG(!need_data || view.data != nullptr || rows * cols == 0,
                   op << ": " << name << " is missing; expected " << expected_shape(rows, cols)
                      << " (" << why() << ")");
  check_place(op, name, view, device);
  MESHLA_CHECK_ARG(view.dtype == dtype, op << ": " << name << ".dtype=" << dtype_name(view.dtype)
                                           << " does not match the plan's " << dtype_name(dtype));
  const bool shape_ok =
      (rows < 0 && view.ndim == 1 && view.shape[0] == cols) ||
      (rows >= 0 && view.ndim == 2 && view.shape[0] == rows && view.shape[1] == cols);
  MESHLA_CHECK_ARG(shape_ok, op << ": " << name << ".shape=" << view.shape_string()
                                << " but expected " << expected_shape(rows, cols) << " (" << why()
                                << ")");
  MESHLA_CHECK_ARG(view.is_row_major_contiguous(), op << ": " << name << " with shape "
                                                      << view.shape_string()
                                                      << " must be contiguous row-major");
}

// Whether two arrays share any byte (absent ones share none).
bool views_overlap(const TensorView& x, const TensorView& y) {
  if (x.data == nullptr || y.data == nullptr) return false;
  const auto bytes = [](const TensorView& v) {
    return v.numel() * static_cast<std::int64_t>(dtype_size(v.dtype));
  };
  const char* x0 = static_cast<const char*>(x.data);
  const char* y0 = static_cast<const char*>(y.data);
  return x0 < y0 + bytes(y) && y0 < x0 + bytes(x);
}

bool is_16_or_32_bit_float(DType dtype) {
  return dtype == DType::kBFloat16 || dtype == DType::kFloat16 || dtype == DType::kFloat32;
}

// A scale array of `count` float32 values: [count], or a matrix of them with one extent 1
// ([rows, 1] as torch._scaled_mm takes a's, [1, n] b's); one value is also [] (a 0-d array).
void check_scales(std::string_view op, const char* name, const TensorView& view, std::int64_t count,
                  const std::string& why, int device) {
  MESHLA_CHECK_ARG(view.given(), op << ": " << name
                                    << " is missing: a float8 product needs "
                                       "a_scale and b_scale (float32 on the group's device)");
  check_place(op, name, view, device);
  MESHLA_CHECK_ARG(view.dtype == DType::kFloat32, op << ": " << name
                                                     << ".dtype=" << dtype_name(view.dtype)
                                                     << " but scales are float32");
  const bool vector_like = view.ndim == 0 || view.ndim == 1 ||
                           (view.ndim == 2 && (view.shape[0] == 1 || view.shape[1] == 1));
  MESHLA_CHECK_ARG(vector_like && view.numel() == count && view.is_row_major_contiguous(),
                   op << ": " << name << ".shape=" << view.shape_string() << " but expected "
                      << count << " contiguous value" << (count == 1 ? "" : "s") << " (" << why
                      << ")");
}

// How a float8 call is scaled, from its scales' sizes: one value each is tensorwise, a's rows and
// the product's columns rowwise (torch._scaled_mm's rule).
MatmulScaling scaling_of(std::string_view op, const CollectiveMatmulArgs& args, std::int64_t rows,
                         std::int64_t n) {
  const TensorView& a_scale = args.a_scale;
  const TensorView& b_scale = args.b_scale;
  if (a_scale.numel() == 1 && b_scale.numel() == 1) return MatmulScaling::kTensorwise;
  MESHLA_CHECK_ARG(a_scale.numel() == rows && b_scale.numel() == n,
                   op << ": a_scale.shape=" << a_scale.shape_string() << " and b_scale.shape="
                      << b_scale.shape_string() << ": tensorwise scales hold one value each, "
                      << "rowwise ones one per row of a (" << rows << ") and per column of the "
                      << "product (n=" << n << ")");
  return MatmulScaling::kRowwise;
}

// The float8 rules of the per-rank GEMMs (Matmul's check_matmul_shape, one place for them) in
// the collective op's words.
void check_float8_product(std::string_view op, const CollectiveMatmulConfig& c) {
  const MatmulShape shape{.dtype = c.dtype,
                          .b_dtype = c.b_dtype,
                          .out_dtype = c.out_dtype,
                          .scaling = c.scaling,
                          .m = c.m,
                          .n = c.n,
                          .k = c.k,
                          .trans_b = c.trans_b,
                          .lda = c.k,
                          .ldb = c.k,
                          .bias = c.bias};
  try {
    check_matmul_shape(shape);
  } catch (const Error& error) {
    constexpr std::string_view kPrefix = "matmul: ";
    std::string_view message = error.what();
    if (message.substr(0, kPrefix.size()) == kPrefix) message.remove_prefix(kPrefix.size());
    throw Error(error.code(), std::string(op) + ": " + std::string(message));
  }
}

// Rowwise scales' alignment (rowwise_scale_row_problem) for every GEMM of every rank's NCCL
// schedule (their GEMMs start at different rows), so that no rank throws midway through an
// execution its peers carry on with.
void check_rowwise_scale_rows(const CollectiveMatmulConfig& c, ScheduleParams params) {
  for (params.rank = 0; params.rank < params.tp; ++params.rank) {
    for (const GemmTask& gemm : make_schedule(params).gemms) {
      for (int member = 0; member < gemm.batch; ++member) {
        const std::string why =
            rowwise_scale_row_problem(c, params.tp, gemm.a.begin + member * gemm.a_stride);
        if (!why.empty()) throw Error(ErrorCode::kNotImplemented, why);
      }
    }
  }
}

// cuBLASMp picks its own split and thread blocks; what it runs is fixed by its layouts
// (collective/cublasmp/cublasmp_executor.cpp).
CollectiveMatmulConfig resolve_cublasmp(const CollectiveMatmulConfig& config, int tp) {
  const std::string_view op = collective_op_name(config.op);
  MESHLA_CHECK(
      kNotImplemented, config.dtype == DType::kBFloat16 || config.dtype == DType::kFloat16,
      op << ": backend=cublasmp supports bfloat16 and float16, not " << dtype_name(config.dtype));
  MESHLA_CHECK(kNotImplemented, config.algorithm != Algorithm::kPipelined,
               op << ": backend=cublasmp runs cuBLASMp's split peer-to-peer algorithm "
                     "(algorithm=ring) or no overlap (sequential), not algorithm=pipelined");
  MESHLA_CHECK_ARG(config.chunks == 0, op << ": chunks=" << config.chunks
                                          << " must be 0 with backend=cublasmp, which splits "
                                             "the work itself");
  MESHLA_CHECK_ARG(config.comm_ctas == 0,
                   op << ": comm_ctas=" << config.comm_ctas << " applies to backend=nccl only");
  MESHLA_CHECK(kNotImplemented, !config.return_gathered,
               op << ": backend=cublasmp does not return the gathered a (return_gathered); use "
                     "backend=nccl or symmetric");
  MESHLA_CHECK(kNotImplemented, config.op != CollectiveOp::kMatmulAllReduce || config.trans_b,
               op << ": backend=cublasmp needs b stored [n, k] (trans_b=True); cuBLASMp's "
                     "GEMM+AllReduce takes no other layout");
  MESHLA_CHECK_ARG(config.op == CollectiveOp::kMatmulAllReduce || config.m % tp == 0,
                   op << ": m=" << config.m << " rows are not divisible by tp_size=" << tp);
  // cuBLASMp 0.7 answers NOT_SUPPORTED for GEMM+AllReduce with its split and atomic
  // peer-to-peer algorithms (H200, 2 and 4 ranks, every shape tried); the rest need NVLink
  // multicast, which meshla never uses. Only its unoverlapped form is left.
  const bool all_reduce = config.op == CollectiveOp::kMatmulAllReduce;
  MESHLA_CHECK(kNotImplemented, !all_reduce || config.algorithm != Algorithm::kRing,
               op << ": backend=cublasmp has no overlapped all-reduce without NVLink multicast; "
                     "use algorithm=sequential (or auto) or another backend");
  CollectiveMatmulConfig resolved = config;
  resolved.algorithm = config.algorithm == Algorithm::kSequential || all_reduce
                           ? Algorithm::kSequential
                           : Algorithm::kRing;
  resolved.comm_sms = std::max(config.comm_sms, 0);
  return resolved;
}

// The schedule reads its inputs while writing the outputs on other streams, and the references
// compute from inputs that an output would overwrite: no output may share memory with an input or
// with the other output (arrays without data are not compared).
void check_no_aliases(std::string_view op, const CollectiveMatmulArgs& args) {
  const std::pair<const char*, const TensorView*> inputs[] = {
      {"a", &args.a}, {"b", &args.b}, {"bias", &args.bias}};
  const std::pair<const char*, const TensorView*> outputs[] = {{"out", &args.out},
                                                               {"gathered", &args.gathered}};
  for (const auto& [input_name, input] : inputs) {
    for (const auto& [output_name, output] : outputs) {
      MESHLA_CHECK_ARG(!views_overlap(*input, *output),
                       op << ": " << output_name << " shares memory with the input " << input_name
                          << "; outputs must not alias inputs");
    }
  }
  MESHLA_CHECK_ARG(!views_overlap(args.out, args.gathered),
                   op << ": out and gathered share memory; outputs must not alias");
}

}  // namespace

CollectiveMatmulConfig resolve_config(const CollectiveMatmulConfig& config, int tp,
                                      PeerReach reach) {
  const std::string_view op = collective_op_name(config.op);
  MESHLA_CHECK_ARG(config.m >= 1 && config.n >= 1 && config.k >= 1,
                   op << ": m=" << config.m << ", n=" << config.n << ", k=" << config.k
                      << " must all be positive");
  MESHLA_CHECK_ARG(is_16_or_32_bit_float(config.dtype) || is_float8(config.dtype),
                   op << ": dtype " << dtype_name(config.dtype)
                      << " is not supported; use bfloat16, float16, float32 or float8 (scaled)");
  if (is_float8(config.dtype) || (config.b_dtype && is_float8(*config.b_dtype))) {
    check_float8_product(op, config);
    MESHLA_CHECK(kNotImplemented,
                 !config.return_gathered || config.scaling != MatmulScaling::kRowwise,
                 op << ": return_gathered with rowwise scales would return the gathered rows "
                       "without their scales; gather a_scale yourself, or use tensorwise scales");
  } else {
    MESHLA_CHECK_ARG(config.scaling == MatmulScaling::kNone && !config.b_dtype && !config.out_dtype,
                     op << ": scales, b_dtype and out_dtype apply to float8 operands, not "
                        << dtype_name(config.dtype));
  }
  MESHLA_CHECK_ARG(config.chunks >= 0, op << ": chunks=" << config.chunks << " is negative");
  MESHLA_CHECK_ARG(config.comm_sms >= -1,
                   op << ": comm_sms=" << config.comm_sms << " must be -1 (default) or at least 0");
  MESHLA_CHECK_ARG(config.comm_ctas >= 0, op << ": comm_ctas=" << config.comm_ctas
                                             << " must be 0 (NCCL's choice) or more");
  if (config.backend == Backend::kCublasMp) return resolve_cublasmp(config, tp);
  CollectiveMatmulConfig resolved = config;
  if (config.backend == Backend::kAuto) {
    const bool symmetric =
        reach == PeerReach::kNvlink && tp >= 2 && symmetric_unsupported(config, tp).empty();
    resolved.backend = symmetric ? Backend::kSymmetric : Backend::kNccl;
  }
  if (resolved.backend == Backend::kSymmetric) {
    MESHLA_CHECK(kNotImplemented, reach != PeerReach::kNone,
                 op << ": backend=symmetric needs every rank of the group to map every other "
                       "rank's memory (one host, CUDA peer access, NCCL_P2P_DISABLE unset)");
    const std::string why = symmetric_unsupported(config, tp);
    if (!why.empty()) {
      const bool not_implemented =
          (config.algorithm != Algorithm::kAuto && config.algorithm != Algorithm::kRing) ||
          why == symmetric_rowwise_problem(config, tp);
      throw Error(not_implemented ? ErrorCode::kNotImplemented : ErrorCode::kInvalidArgument, why);
    }
    resolved.algorithm = Algorithm::kRing;
    resolved.comm_sms = std::max(config.comm_sms, 0);
    if (resolved.chunks == 0) {
      resolved.chunks =
          config.op == CollectiveOp::kAllGatherMatmul ? 1 : default_rounds(config.op, tp, config.m);
    }
    return resolved;
  }
  MESHLA_CHECK(kNotImplemented,
               !is_float8(config.dtype) || config.op == CollectiveOp::kAllGatherMatmul ||
                   resolved.algorithm != Algorithm::kRing,
               op << ": algorithm=ring on backend=nccl adds each rank's partial sum in the GEMM's "
                     "epilogue, which a float8 GEMM does not take; use algorithm=pipelined or "
                     "sequential, or backend=symmetric");
  if (resolved.algorithm == Algorithm::kAuto) {
    resolved.algorithm = default_algorithm(config.op, tp, config.m);
  }
  if (resolved.algorithm == Algorithm::kSequential) {
    resolved.comm_sms = 0;
    resolved.comm_ctas = 0;
  } else if (resolved.comm_sms < 0) {
    resolved.comm_sms = default_comm_sms(resolved.op, resolved.algorithm);
  }
  if (resolved.chunks == 0) {
    resolved.chunks = default_chunks(config.op, resolved.algorithm, tp, config.m);
  }
  // Building rank 0's schedule checks divisibility and chunk counts, identical on every rank.
  ScheduleParams params{.op = resolved.op,
                        .algorithm = resolved.algorithm,
                        .tp = tp,
                        .rank = 0,
                        .m = resolved.m,
                        .chunks = resolved.chunks,
                        .bias = resolved.bias,
                        .return_gathered = resolved.return_gathered};
  make_schedule(params);
  if (resolved.scaling == MatmulScaling::kRowwise) check_rowwise_scale_rows(resolved, params);
  return resolved;
}

void validate_args(const CollectiveMatmulConfig& c, int tp, int device,
                   const CollectiveMatmulArgs& args) {
  const std::string_view op = collective_op_name(c.op);
  const auto m_k = [&] { return "m=" + std::to_string(c.m) + ", k=" + std::to_string(c.k); };
  const auto per_rank = [&] {
    return "m=" + std::to_string(c.m) + " / tp_size=" + std::to_string(tp);
  };
  const auto text = [](const char* reason) { return [reason] { return std::string(reason); }; };
  const DType b_dtype = c.b_dtype.value_or(c.dtype);
  const DType out_dtype = product_dtype(c);
  const std::int64_t a_rows = c.op == CollectiveOp::kAllGatherMatmul ? c.m / tp : c.m;
  switch (c.op) {
    case CollectiveOp::kAllGatherMatmul:
      check_matrix(op, "a", args.a, a_rows, c.k, c.dtype, device,
                   [&] { return per_rank() + " rows, k"; });
      break;
    case CollectiveOp::kMatmulReduceScatter:
    case CollectiveOp::kMatmulAllReduce:
      check_matrix(op, "a", args.a, a_rows, c.k, c.dtype, device, [&] { return m_k() + " local"; });
      break;
  }
  if (c.trans_b) {
    check_matrix(op, "b", args.b, c.n, c.k, b_dtype, device, text("trans_b: [n, k]"));
  } else {
    check_matrix(op, "b", args.b, c.k, c.n, b_dtype, device, text("[k, n]"));
  }
  if (c.scaling == MatmulScaling::kNone) {
    MESHLA_CHECK_ARG(!args.a_scale.given() && !args.b_scale.given(),
                     op << ": scales were passed to a plan built without them");
  } else {
    const bool rowwise = c.scaling == MatmulScaling::kRowwise;
    check_scales(op, "a_scale", args.a_scale, rowwise ? a_rows : 1,
                 rowwise ? "one per row of a" : "tensorwise", device);
    check_scales(op, "b_scale", args.b_scale, rowwise ? c.n : 1,
                 rowwise ? "one per column of the product" : "tensorwise", device);
  }
  if (c.bias) {
    check_matrix(op, "bias", args.bias, -1, c.n, out_dtype, device,
                 text("one value per output column"));
  } else {
    MESHLA_CHECK_ARG(args.bias.data == nullptr,
                     op << ": a bias was passed to a plan built without one");
  }
  if (c.op == CollectiveOp::kMatmulReduceScatter) {
    check_matrix(op, "out", args.out, c.m / tp, c.n, out_dtype, device,
                 [&] { return per_rank() + " rows, n"; });
  } else {
    check_matrix(op, "out", args.out, c.m, c.n, out_dtype, device, text("m, n"));
  }
  if (c.return_gathered) {
    check_matrix(op, "gathered", args.gathered, c.m, c.k, c.dtype, device, m_k);
  } else {
    MESHLA_CHECK_ARG(args.gathered.data == nullptr,
                     op << ": a gathered output was passed to a plan built without one");
  }
  check_no_aliases(op, args);
}

void check_request(const CollectiveMatmulConfig& config, int tp) {
  resolve_config(config, tp,
                 config.backend == Backend::kSymmetric ? PeerReach::kMapped : PeerReach::kNone);
}

namespace {

constexpr std::array<const char*, kConfigFields> kConfigFieldNames = {
    "op",        "algorithm", "backend",   "dtype",           "m",      "n",
    "k",         "trans_b",   "bias",      "return_gathered", "chunks", "comm_sms",
    "comm_ctas", "b_dtype",   "out_dtype", "scaling"};

std::string_view scaling_name(MatmulScaling scaling) {
  switch (scaling) {
    case MatmulScaling::kNone:
      return "none";
    case MatmulScaling::kTensorwise:
      return "tensorwise";
    case MatmulScaling::kRowwise:
      return "rowwise";
  }
  return "unknown";
}

std::string field_string(std::size_t field, std::int64_t value) {
  std::string name = std::string(kConfigFieldNames[field]) + "=";
  switch (field) {
    case kFieldOp:
      return name + std::string(collective_op_name(static_cast<CollectiveOp>(value)));
    case kFieldAlgorithm:
      return name + std::string(algorithm_name(static_cast<Algorithm>(value)));
    case kFieldBackend:
      return name + std::string(backend_name(static_cast<Backend>(value)));
    case kFieldDtype:
      return name + std::string(dtype_name(static_cast<DType>(value)));
    case kFieldBDtype:
    case kFieldOutDtype:
      return name + (value < 0 ? std::string("dtype's")
                               : std::string(dtype_name(static_cast<DType>(value))));
    case kFieldScaling:
      return name + std::string(scaling_name(static_cast<MatmulScaling>(value)));
    default:
      return name + std::to_string(value);
  }
}

}  // namespace

ConfigRecord config_record(const CollectiveMatmulConfig& config) {
  ConfigRecord record{};
  record[kFieldOp] = static_cast<std::int64_t>(config.op);
  record[kFieldAlgorithm] = static_cast<std::int64_t>(config.algorithm);
  record[kFieldBackend] = static_cast<std::int64_t>(config.backend);
  record[kFieldDtype] = static_cast<std::int64_t>(config.dtype);
  record[kFieldM] = config.m;
  record[kFieldN] = config.n;
  record[kFieldK] = config.k;
  record[kFieldTransB] = config.trans_b;
  record[kFieldBias] = config.bias;
  record[kFieldReturnGathered] = config.return_gathered;
  record[kFieldChunks] = config.chunks;
  record[kFieldCommSms] = config.comm_sms;
  record[kFieldCommCtas] = config.comm_ctas;
  const auto dtype_or_unset = [](const std::optional<DType>& dtype) -> std::int64_t {
    return dtype ? static_cast<std::int64_t>(*dtype) : -1;
  };
  record[kFieldBDtype] = dtype_or_unset(config.b_dtype);
  record[kFieldOutDtype] = dtype_or_unset(config.out_dtype);
  record[kFieldScaling] = static_cast<std::int64_t>(config.scaling);
  return record;
}

void require_same_config(const std::vector<ConfigRecord>& records, int rank) {
  MESHLA_ASSERT(rank >= 0 && static_cast<std::size_t>(rank) < records.size());
  const ConfigRecord& first = records.front();
  for (std::size_t other = 1; other < records.size(); ++other) {
    if (records[other] == first) continue;
    std::string theirs, first_ones;
    for (std::size_t field = 0; field < kConfigFields; ++field) {
      if (records[other][field] == first[field]) continue;
      const char* separator = theirs.empty() ? "" : ", ";
      theirs += separator + field_string(field, records[other][field]);
      first_ones += separator + field_string(field, first[field]);
    }
    const auto op = static_cast<CollectiveOp>(records[static_cast<std::size_t>(rank)][kFieldOp]);
    MESHLA_THROW(kInvalidArgument, collective_op_name(op)
                                       << ": the ranks of the group built different plans: rank "
                                       << other << " has " << theirs << " where rank 0 has "
                                       << first_ones
                                       << "; every rank must build the plan with the same config");
  }
}

void check_all_gather_config(const AllGatherConfig& c) {
  MESHLA_CHECK_ARG(c.rows >= 1 && c.cols >= 1, "all_gather: rows=" << c.rows << ", cols=" << c.cols
                                                                   << " must both be positive");
  MESHLA_CHECK_ARG(
      c.dtype == DType::kBFloat16 || c.dtype == DType::kFloat16 || c.dtype == DType::kFloat32,
      "all_gather: dtype " << dtype_name(c.dtype)
                           << " is not supported; use bfloat16, float16 or float32");
}

void validate_all_gather(const AllGatherConfig& c, int tp, int device, const TensorView& rows,
                         const TensorView& gathered) {
  const auto per_rank = [] { return std::string("this rank's rows, cols"); };
  check_matrix("all_gather", "rows", rows, c.rows, c.cols, c.dtype, device, per_rank);
  check_matrix("all_gather", "gathered", gathered, c.rows * tp, c.cols, c.dtype, device, [&] {
    return "tp_size=" + std::to_string(tp) + " times rows=" + std::to_string(c.rows) + ", cols";
  });
  MESHLA_CHECK_ARG(!views_overlap(rows, gathered), "all_gather: gathered shares memory with rows");
}

}  // namespace meshla::collective

namespace meshla {

CollectiveMatmulConfig describe_call(const CollectiveMatmulConfig& request,
                                     const CollectiveMatmulArgs& args, int tp, int device) {
  const std::string_view op = collective_op_name(request.op);
  MESHLA_CHECK_ARG(tp >= 1, op << ": tp_size=" << tp << " must be at least 1");
  const std::pair<const char*, const TensorView*> operands[] = {{"a", &args.a}, {"b", &args.b}};
  for (const auto& [name, view] : operands) {
    MESHLA_CHECK_ARG(view->given() && view->ndim == 2,
                     op << ": " << name << " must be a 2-D array, got "
                        << (view->given() ? collective::shape_of(*view) : std::string("none")));
  }
  const TensorView& a = args.a;
  const TensorView& b = args.b;
  const bool float8 = is_float8(a.dtype) || is_float8(b.dtype);
  MESHLA_CHECK_ARG(collective::is_16_or_32_bit_float(a.dtype) || is_float8(a.dtype),
                   op << ": a.dtype=" << dtype_name(a.dtype)
                      << " is not supported; use bfloat16, float16, float32 or float8 (scaled)");
  collective::check_place(op, "a", a, device);
  // A float8 product's bias is in its output dtype; b is the other float8 operand (the GEMM's
  // rules check the pair).
  const DType out_dtype = float8 ? request.out_dtype.value_or(DType::kBFloat16) : a.dtype;
  MESHLA_CHECK_ARG(float8 || !request.out_dtype, op << ": out_dtype applies to float8 operands; a "
                                                    << dtype_name(a.dtype)
                                                    << " product is in its own dtype");
  const std::pair<const char*, const TensorView*> others[] = {{"b", &b}, {"bias", &args.bias}};
  for (const auto& [name, view] : others) {
    if (!view->given()) continue;
    const bool is_b = view == &b;
    if (!float8 || !is_b) {
      const DType expected = is_b ? a.dtype : out_dtype;
      MESHLA_CHECK_ARG(view->dtype == expected,
                       op << ": " << name << ".dtype=" << dtype_name(view->dtype) << " but "
                          << (is_b || !float8 ? "a.dtype=" : "out_dtype=") << dtype_name(expected)
                          << "; they must match");
    }
    collective::check_place(op, name, *view, device);
  }
  MESHLA_CHECK_ARG(float8 || (!args.a_scale.given() && !args.b_scale.given()),
                   op << ": scales apply to float8 operands, not " << dtype_name(a.dtype));
  const std::int64_t k_of_b = request.trans_b ? b.shape[1] : b.shape[0];
  MESHLA_CHECK_ARG(k_of_b == a.shape[1],
                   op << ": b.shape=" << collective::shape_of(b) << " ("
                      << (request.trans_b ? "[n, k]" : "[k, n]") << ") does not match a.shape="
                      << collective::shape_of(a) << ": the contraction needs k=" << a.shape[1]);
  const std::int64_t n = request.trans_b ? b.shape[0] : b.shape[1];
  if (args.bias.given()) {
    MESHLA_CHECK_ARG(args.bias.ndim == 1 && args.bias.shape[0] == n,
                     op << ": bias.shape=" << collective::shape_of(args.bias) << " but expected ["
                        << n << "] (one value per output column)");
  }
  const bool gathers = request.op == CollectiveOp::kAllGatherMatmul;
  MESHLA_CHECK_ARG(gathers || !request.return_gathered,
                   op << ": return_gathered applies to all_gather_matmul only");
  MESHLA_CHECK_ARG(request.return_gathered || !args.gathered.given(),
                   op << ": a gathered output is given but return_gathered=False");
  if (request.op == CollectiveOp::kMatmulReduceScatter) {
    MESHLA_CHECK_ARG(a.shape[0] % tp == 0,
                     op << ": a.shape[0]=" << a.shape[0] << " is not divisible by tp_size=" << tp);
  }
  CollectiveMatmulConfig config = request;
  config.dtype = a.dtype;
  config.m = gathers ? a.shape[0] * tp : a.shape[0];
  config.n = n;
  config.k = a.shape[1];
  config.bias = args.bias.given();
  if (float8) {
    // Both operands float8 and both scales given, before the scales' sizes say how they scale.
    MESHLA_CHECK_ARG(is_float8(a.dtype) && is_float8(b.dtype),
                     op << ": a.dtype=" << dtype_name(a.dtype) << " and b.dtype="
                        << dtype_name(b.dtype) << ": a float8 product takes float8 a and b");
    for (const auto& [name, scale] :
         {std::pair{"a_scale", &args.a_scale}, std::pair{"b_scale", &args.b_scale}}) {
      MESHLA_CHECK_ARG(scale->given(), op << ": " << name
                                          << " is missing: a float8 product needs a_scale and "
                                             "b_scale (float32 on the group's device)");
    }
    config.b_dtype = b.dtype;
    config.out_dtype = out_dtype;
    config.scaling = collective::scaling_of(op, args, a.shape[0], n);
    const bool rowwise = config.scaling == MatmulScaling::kRowwise;
    collective::check_scales(op, "a_scale", args.a_scale, rowwise ? a.shape[0] : 1,
                             rowwise ? "one per row of a" : "tensorwise", device);
    collective::check_scales(op, "b_scale", args.b_scale, rowwise ? n : 1,
                             rowwise ? "one per column of the product" : "tensorwise", device);
  }
  collective::check_request(config, tp);
  // The outputs given, on their metadata (an absent one is the caller's to make at its shape).
  const std::array<std::int64_t, 2> product = product_shape(config, tp);
  if (args.out.given()) {
    collective::check_matrix(
        op, "out", args.out, product[0], product[1], product_dtype(config), device,
        [&] {
          return gathers || request.op == CollectiveOp::kMatmulAllReduce ? "m, n" : "m/tp, n";
        },
        false);
  }
  if (args.gathered.given()) {
    collective::check_matrix(
        op, "gathered", args.gathered, config.m, config.k, config.dtype, device,
        [] { return "m, k"; }, false);
  }
  collective::check_no_aliases(op, args);
  return config;
}

std::array<std::int64_t, 2> product_shape(const CollectiveMatmulConfig& config, int tp) {
  return {config.op == CollectiveOp::kMatmulReduceScatter ? config.m / tp : config.m, config.n};
}

DType product_dtype(const CollectiveMatmulConfig& config) {
  return config.out_dtype.value_or(config.dtype);
}

}  // namespace meshla
