// Config resolution and argument checks of collective matmul: every message names the op, the
// argument and the shapes.
#include <gtest/gtest.h>

#include <array>
#include <functional>
#include <tuple>
#include <utility>
#include <vector>

#include "collective/cublasmp/cublasmp_layout.hpp"
#include "collective/validation.hpp"
#include "error_message.hpp"
#include "meshla/error.hpp"

namespace meshla::collective {
namespace {

// Fake device addresses: validation never dereferences them.
void* fake_address(std::uintptr_t offset) { return reinterpret_cast<void*>(0x100000 + offset); }

struct Case {
  CollectiveMatmulConfig config;
  CollectiveMatmulArgs args;
};

Case all_gather_case(int tp) {
  Case c;
  c.config = {.op = CollectiveOp::kAllGatherMatmul,
              .algorithm = Algorithm::kRing,
              .dtype = DType::kBFloat16,
              .m = 64,
              .n = 48,
              .k = 32};
  c.config = resolve_config(c.config, tp);
  c.args.a = make_tensor_view(fake_address(0), DType::kBFloat16, {64 / tp, 32}, 0);
  c.args.b = make_tensor_view(fake_address(1 << 20), DType::kBFloat16, {32, 48}, 0);
  c.args.out = make_tensor_view(fake_address(2 << 20), DType::kBFloat16, {64, 48}, 0);
  return c;
}

TEST(Validation, AcceptsMatchingArguments) {
  Case c = all_gather_case(4);
  EXPECT_NO_THROW(validate_args(c.config, 4, 0, c.args));
}

TEST(Validation, ResolvesAutoAndChunks) {
  const CollectiveMatmulConfig resolved =
      resolve_config({.op = CollectiveOp::kMatmulReduceScatter, .m = 64, .n = 8, .k = 8}, 4);
  EXPECT_EQ(resolved.algorithm, Algorithm::kSequential);
  EXPECT_EQ(resolved.chunks, 1);
  EXPECT_EQ(resolved.comm_sms, 0);
  const CollectiveMatmulConfig ring = resolve_config({.op = CollectiveOp::kMatmulReduceScatter,
                                                      .algorithm = Algorithm::kRing,
                                                      .m = 64,
                                                      .n = 8,
                                                      .k = 8},
                                                     4);
  EXPECT_EQ(ring.chunks, 2);
  EXPECT_EQ(ring.comm_sms, 8);
  EXPECT_EQ(
      resolve_config({.op = CollectiveOp::kMatmulAllReduce, .m = 8, .n = 8, .k = 8}, 1).algorithm,
      Algorithm::kSequential);
}

TEST(Validation, NamesTheWrongShape) {
  Case c = all_gather_case(4);
  c.args.a = make_tensor_view(fake_address(0), DType::kBFloat16, {15, 32}, 0);
  const std::string message =
      message_of([&] { validate_args(c.config, 4, 0, c.args); }, ErrorCode::kInvalidArgument);
  EXPECT_NE(message.find("all_gather_matmul: a.shape=[15, 32] but expected [16, 32]"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("m=64 / tp_size=4"), std::string::npos) << message;
}

TEST(Validation, TransposedWeightShape) {
  Case c = all_gather_case(2);
  c.config.trans_b = true;
  c.args.a = make_tensor_view(fake_address(0), DType::kBFloat16, {32, 32}, 0);
  const std::string message =
      message_of([&] { validate_args(c.config, 2, 0, c.args); }, ErrorCode::kInvalidArgument);
  EXPECT_NE(message.find("b.shape=[32, 48] but expected [48, 32] (trans_b: [n, k])"),
            std::string::npos)
      << message;
}

TEST(Validation, DtypeDeviceAndLayout) {
  Case c = all_gather_case(4);
  c.args.b.dtype = DType::kFloat32;
  EXPECT_NE(message_of([&] { validate_args(c.config, 4, 0, c.args); }, ErrorCode::kInvalidArgument)
                .find("b.dtype=float32 does not match the plan's bfloat16"),
            std::string::npos);

  c = all_gather_case(4);
  c.args.out.device = 3;
  EXPECT_NE(message_of([&] { validate_args(c.config, 4, 0, c.args); }, ErrorCode::kInvalidArgument)
                .find("out is on cuda:3 but the group runs on cuda:0"),
            std::string::npos);

  c = all_gather_case(4);
  std::swap(c.args.b.strides[0], c.args.b.strides[1]);  // a transposed view
  EXPECT_NE(message_of([&] { validate_args(c.config, 4, 0, c.args); }, ErrorCode::kInvalidArgument)
                .find("must be contiguous row-major"),
            std::string::npos);

  c = all_gather_case(4);
  c.args.a.device_kind = DeviceKind::kCpu;
  EXPECT_NE(message_of([&] { validate_args(c.config, 4, 0, c.args); }, ErrorCode::kInvalidArgument)
                .find("a is on cpu but the group runs on cuda:0"),
            std::string::npos);
}

TEST(Validation, BiasAndGatheredMustMatchThePlan) {
  Case c = all_gather_case(4);
  c.args.bias = make_tensor_view(fake_address(3 << 20), DType::kBFloat16, {48}, 0);
  EXPECT_NE(message_of([&] { validate_args(c.config, 4, 0, c.args); }, ErrorCode::kInvalidArgument)
                .find("a bias was passed to a plan built without one"),
            std::string::npos);

  c = all_gather_case(4);
  c.config.bias = true;
  c.args.bias = make_tensor_view(fake_address(3 << 20), DType::kBFloat16, {47}, 0);
  EXPECT_NE(message_of([&] { validate_args(c.config, 4, 0, c.args); }, ErrorCode::kInvalidArgument)
                .find("bias.shape=[47] but expected [48]"),
            std::string::npos);

  c = all_gather_case(4);
  c.config.return_gathered = true;
  EXPECT_NE(message_of([&] { validate_args(c.config, 4, 0, c.args); }, ErrorCode::kInvalidArgument)
                .find("gathered is missing; expected [64, 32] (m=64, k=32)"),
            std::string::npos);
}

TEST(Validation, OutputsMustNotAliasInputs) {
  Case c = all_gather_case(4);
  c.args.out.data = c.args.b.data;
  EXPECT_NE(message_of([&] { validate_args(c.config, 4, 0, c.args); }, ErrorCode::kInvalidArgument)
                .find("out shares memory with the input b"),
            std::string::npos);
}

TEST(Validation, ConfigErrors) {
  EXPECT_NE(message_of(
                [] {
                  resolve_config(
                      {.op = CollectiveOp::kMatmulReduceScatter, .m = 10, .n = 8, .k = 8}, 4);
                },
                ErrorCode::kInvalidArgument)
                .find("matmul_reduce_scatter: m=10 rows are not divisible by tp_size=4"),
            std::string::npos);
  EXPECT_NE(message_of(
                [] {
                  resolve_config({.op = CollectiveOp::kAllGatherMatmul,
                                  .dtype = DType::kFloat64,
                                  .m = 8,
                                  .n = 8,
                                  .k = 8},
                                 2);
                },
                ErrorCode::kInvalidArgument)
                .find("dtype float64 is not supported"),
            std::string::npos);
  EXPECT_NE(
      message_of(
          [] { resolve_config({.op = CollectiveOp::kAllGatherMatmul, .m = 8, .n = 0, .k = 8}, 2); },
          ErrorCode::kInvalidArgument)
          .find("n=0"),
      std::string::npos);
  message_of(
      [] {
        resolve_config({.op = CollectiveOp::kMatmulAllReduce,
                        .algorithm = Algorithm::kRing,
                        .m = 10,
                        .n = 8,
                        .k = 8},
                       4);
      },
      ErrorCode::kNotImplemented);
}

CollectiveMatmulConfig cublasmp_config(CollectiveOp op) {
  return {.op = op, .backend = Backend::kCublasMp, .m = 64, .n = 8, .k = 8, .trans_b = true};
}

std::string cublasmp_error(const CollectiveMatmulConfig& config, ErrorCode expected) {
  return message_of([&] { resolve_config(config, 4); }, expected);
}

TEST(Validation, CublasMpResolvesItsOwnAlgorithm) {
  const CollectiveMatmulConfig resolved =
      resolve_config(cublasmp_config(CollectiveOp::kMatmulReduceScatter), 4);
  EXPECT_EQ(resolved.backend, Backend::kCublasMp);
  EXPECT_EQ(resolved.algorithm, Algorithm::kRing);
  EXPECT_EQ(resolved.comm_sms, 0);
  EXPECT_EQ(resolved.chunks, 0);
  CollectiveMatmulConfig sequential = cublasmp_config(CollectiveOp::kAllGatherMatmul);
  sequential.algorithm = Algorithm::kSequential;
  sequential.trans_b = false;
  EXPECT_EQ(resolve_config(sequential, 4).algorithm, Algorithm::kSequential);
  // No overlapped all-reduce without multicast: auto resolves to cuBLASMp's unoverlapped one.
  EXPECT_EQ(resolve_config(cublasmp_config(CollectiveOp::kMatmulAllReduce), 4).algorithm,
            Algorithm::kSequential);
  // kAuto never picks cuBLASMp.
  CollectiveMatmulConfig automatic = cublasmp_config(CollectiveOp::kAllGatherMatmul);
  automatic.backend = Backend::kAuto;
  EXPECT_NE(resolve_config(automatic, 4, PeerReach::kNvlink).backend, Backend::kCublasMp);
}

TEST(Validation, CublasMpConfigErrors) {
  CollectiveMatmulConfig c = cublasmp_config(CollectiveOp::kAllGatherMatmul);
  c.dtype = DType::kFloat32;
  EXPECT_NE(cublasmp_error(c, ErrorCode::kNotImplemented)
                .find("all_gather_matmul: backend=cublasmp supports bfloat16 and float16, not "
                      "float32"),
            std::string::npos);
  c = cublasmp_config(CollectiveOp::kAllGatherMatmul);
  c.algorithm = Algorithm::kPipelined;
  EXPECT_NE(cublasmp_error(c, ErrorCode::kNotImplemented).find("not algorithm=pipelined"),
            std::string::npos);
  c = cublasmp_config(CollectiveOp::kMatmulAllReduce);
  c.algorithm = Algorithm::kRing;
  EXPECT_NE(cublasmp_error(c, ErrorCode::kNotImplemented)
                .find("no overlapped all-reduce without NVLink multicast"),
            std::string::npos);
  c = cublasmp_config(CollectiveOp::kMatmulReduceScatter);
  c.chunks = 2;
  EXPECT_NE(cublasmp_error(c, ErrorCode::kInvalidArgument).find("chunks=2 must be 0"),
            std::string::npos);
  c = cublasmp_config(CollectiveOp::kMatmulReduceScatter);
  c.comm_ctas = 8;
  EXPECT_NE(cublasmp_error(c, ErrorCode::kInvalidArgument).find("comm_ctas=8"), std::string::npos);
  c = cublasmp_config(CollectiveOp::kAllGatherMatmul);
  c.return_gathered = true;
  EXPECT_NE(cublasmp_error(c, ErrorCode::kNotImplemented).find("return_gathered"),
            std::string::npos);
  c = cublasmp_config(CollectiveOp::kMatmulAllReduce);
  c.trans_b = false;
  EXPECT_NE(cublasmp_error(c, ErrorCode::kNotImplemented).find("trans_b=True"), std::string::npos);
  c = cublasmp_config(CollectiveOp::kMatmulReduceScatter);
  c.m = 10;
  EXPECT_NE(cublasmp_error(c, ErrorCode::kInvalidArgument)
                .find("matmul_reduce_scatter: m=10 rows are not divisible by tp_size=4"),
            std::string::npos);
  c = cublasmp_config(CollectiveOp::kMatmulAllReduce);
  c.m = 10;  // all-reduce keeps every row on every rank
  EXPECT_NO_THROW(resolve_config(c, 4));
}

// cuBLASMp's column-major view of a row-major [r, c] array is c x r: each rank's block of A, B
// and D must be exactly meshla's b, a and out, and the global shapes must agree with m, n, k.
TEST(Validation, CublasMpBlocksAreMeshlasArrays) {
  const std::int64_t p = 4, m = 64, n = 24, k = 40;
  for (const CollectiveOp op : {CollectiveOp::kAllGatherMatmul, CollectiveOp::kMatmulReduceScatter,
                                CollectiveOp::kMatmulAllReduce}) {
    for (const bool trans_b : {true, false}) {
      if (op == CollectiveOp::kMatmulAllReduce && !trans_b) continue;
      const CollectiveMatmulConfig config{
          .op = op, .backend = Backend::kCublasMp, .m = m, .n = n, .k = k, .trans_b = trans_b};
      const CublasMpLayout layout = cublasmp_layout(resolve_config(config, p), p);
      SCOPED_TRACE(std::string(collective_op_name(op)) + (trans_b ? " trans_b" : ""));
      const bool gather = op == CollectiveOp::kAllGatherMatmul;
      const std::int64_t a_rows = gather ? m / p : m;
      const std::int64_t out_rows = op == CollectiveOp::kMatmulReduceScatter ? m / p : m;
      // A rank's local matrix: one block along the split dimension, all of the other one.
      const auto local = [](const CublasMpOperand& o) {
        return std::pair{o.rows_over_ranks ? o.row_block : o.rows,
                         o.rows_over_ranks ? o.cols : o.col_block};
      };
      for (const CublasMpOperand& o : {layout.a, layout.b, layout.d}) {
        EXPECT_EQ(o.rows_over_ranks ? o.rows : o.cols,
                  (o.rows_over_ranks ? o.row_block : o.col_block) * p);
        // The executor passes row_block as the leading dimension: it must be the local rows.
        EXPECT_EQ(o.row_block, local(o).first);
      }
      // B's local matrix is a [a_rows, k], A's is b ([n, k] with trans_b, else [k, n]), D's is
      // out [out_rows, n], each seen column-major.
      EXPECT_EQ(local(layout.b), std::pair(k, a_rows));
      EXPECT_EQ(local(layout.a), trans_b ? std::pair(k, n) : std::pair(n, k));
      EXPECT_EQ(local(layout.d), std::pair(n, out_rows));
      EXPECT_EQ(layout.transpose_a, trans_b);
      EXPECT_EQ(layout.out_rows, out_rows);
      // op(A) is shape[0] x shape[2], B is shape[2] x shape[1], D is shape[0] x shape[1]
      // (the all-reduce's D holds one shape[1] block per rank).
      const std::int64_t a_out = trans_b ? layout.a.cols : layout.a.rows;
      const std::int64_t a_inner = trans_b ? layout.a.rows : layout.a.cols;
      EXPECT_EQ(a_out, layout.shape[0]);
      EXPECT_EQ(a_inner, layout.shape[2]);
      EXPECT_EQ(layout.b.rows, layout.shape[2]);
      EXPECT_EQ(layout.b.cols, layout.shape[1]);
      EXPECT_EQ(layout.d.rows, layout.shape[0]);
      EXPECT_EQ(layout.d.cols, layout.shape[1] * (op == CollectiveOp::kMatmulAllReduce ? p : 1));
      // The contraction is the full k: all-gather holds it whole, the others split it over ranks.
      EXPECT_EQ(layout.shape[2], gather ? k : k * p);
      EXPECT_EQ(layout.shape[1], m);
    }
  }
}

TEST(Validation, RanksMustBuildTheSamePlan) {
  const CollectiveMatmulConfig config = all_gather_case(2).config;
  const ConfigRecord record = config_record(config);
  // Agreeing ranks pass, from every rank's side.
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_NO_THROW(require_same_config({record, record, record, record}, rank));
  }
  // Every field takes part: a change to any one of them is a disagreement.
  for (std::size_t field = 0; field < kConfigFields; ++field) {
    ConfigRecord other = record;
    other[field] += 1;
    EXPECT_THROW(require_same_config({record, other}, 0), Error) << "field " << field;
  }
  // Rank 2 was given fewer rows and no bias: every rank names rank 2 and both values.
  CollectiveMatmulConfig fewer = config;
  fewer.m = 32;
  fewer.bias = true;
  const ConfigRecord theirs = config_record(fewer);
  for (int rank = 0; rank < 3; ++rank) {
    const std::string message = message_of(
        [&] {
          require_same_config({record, record, theirs}, rank);
        },
        ErrorCode::kInvalidArgument);
    EXPECT_NE(message.find("all_gather_matmul: the ranks of the group built different plans: "
                           "rank 2 has m=32, bias=1 where rank 0 has m=64, bias=0"),
              std::string::npos)
        << message;
  }
  // Enumerations are named.
  CollectiveMatmulConfig other = config;
  other.backend = config.backend == Backend::kNccl ? Backend::kSymmetric : Backend::kNccl;
  other.dtype = DType::kFloat32;
  const std::string message = message_of(
      [&] {
        require_same_config({config_record(other), record}, 1);
      },
      ErrorCode::kInvalidArgument);
  EXPECT_NE(message.find("rank 1 has backend=" + std::string(backend_name(config.backend)) +
                         ", dtype=bfloat16 where rank 0 has backend=" +
                         std::string(backend_name(other.backend)) + ", dtype=float32"),
            std::string::npos)
      << message;
}

TEST(Backends, OnlyCublasMpCanBeMissing) {
  EXPECT_EQ(backend_unavailable_reason(Backend::kNccl), "");
  EXPECT_EQ(backend_unavailable_reason(Backend::kSymmetric), "");
  EXPECT_EQ(backend_name(Backend::kCublasMp), "cublasmp");
  // Where it is missing (a build without it, or no cuBLASMp, NVSHMEM or driver here), the reason
  // says which.
  const std::string reason = backend_unavailable_reason(Backend::kCublasMp);
  if (!reason.empty()) {
    EXPECT_TRUE(reason.find("MESHLA_WITH_CUBLASMP") != std::string::npos ||
                reason.find("cuBLASMp") != std::string::npos ||
                reason.find("libcublasmp") != std::string::npos)
        << reason;
  }
}

// all_gather's arrays: [rows, cols] rows, [tp * rows, cols] gathered, each error naming the array
// and the shapes; and its dtypes, those of the collective matmuls.
TEST(Validation, AllGatherChecksItsArrays) {
  const AllGatherConfig config{.dtype = DType::kBFloat16, .rows = 8, .cols = 16};
  EXPECT_NE(message_of([] { check_all_gather_config({.rows = 0, .cols = 16}); },
                       ErrorCode::kInvalidArgument)
                .find("rows=0, cols=16 must both be positive"),
            std::string::npos);
  EXPECT_NE(
      message_of([] { check_all_gather_config({.dtype = DType::kFloat64, .rows = 8, .cols = 16}); },
                 ErrorCode::kInvalidArgument)
          .find("all_gather: dtype float64 is not supported"),
      std::string::npos);
  const TensorView in = make_tensor_view(fake_address(0), DType::kBFloat16, {8, 16}, 0);
  const TensorView out = make_tensor_view(fake_address(1 << 20), DType::kBFloat16, {32, 16}, 0);
  EXPECT_NO_THROW(validate_all_gather(config, 4, 0, in, out));
  const TensorView short_out =
      make_tensor_view(fake_address(1 << 20), DType::kBFloat16, {16, 16}, 0);
  EXPECT_NE(
      message_of([&] { validate_all_gather(config, 4, 0, in, short_out); },
                 ErrorCode::kInvalidArgument)
          .find("gathered.shape=[16, 16] but expected [32, 16] (tp_size=4 times rows=8, cols)"),
      std::string::npos);
  const TensorView float_in = make_tensor_view(fake_address(0), DType::kFloat32, {8, 16}, 0);
  EXPECT_NE(message_of([&] { validate_all_gather(config, 4, 0, float_in, out); },
                       ErrorCode::kInvalidArgument)
                .find("rows.dtype=float32 does not match the plan's bfloat16"),
            std::string::npos);
  const TensorView overlapping = make_tensor_view(fake_address(128), DType::kBFloat16, {32, 16}, 0);
  EXPECT_NE(message_of([&] { validate_all_gather(config, 4, 0, in, overlapping); },
                       ErrorCode::kInvalidArgument)
                .find("gathered shares memory with rows"),
            std::string::npos);
}

// describe_call: the checks every front end and the CPU references share, on metadata alone.
struct Call {
  CollectiveMatmulConfig request{.op = CollectiveOp::kAllGatherMatmul};
  CollectiveMatmulArgs args;
  int tp = 2;
  int device = -1;  // a group of CPU tensors
  CollectiveMatmulConfig describe() const { return describe_call(request, args, tp, device); }
};

// Host arrays without data: a framework's abstract arrays.
TensorView host(DType dtype, std::initializer_list<std::int64_t> shape) {
  return make_tensor_view(nullptr, dtype, shape, 0, DeviceKind::kCpu);
}

Call all_gather_call() {
  Call c;
  c.args.a = host(DType::kFloat32, {4, 8});
  c.args.b = host(DType::kFloat32, {8, 5});
  return c;
}

TEST(DescribeCall, FillsTheConfigAPlanIsBuiltWith) {
  Call c = all_gather_call();
  c.request.trans_b = false;
  c.args.bias = host(DType::kFloat32, {5});
  const CollectiveMatmulConfig config = c.describe();
  EXPECT_EQ(config.m, 8);  // tp times a's rows
  EXPECT_EQ(config.n, 5);
  EXPECT_EQ(config.k, 8);
  EXPECT_EQ(config.dtype, DType::kFloat32);
  EXPECT_TRUE(config.bias);
  EXPECT_EQ(product_shape(config, 2), (std::array<std::int64_t, 2>{8, 5}));
  c.request.op = CollectiveOp::kMatmulReduceScatter;
  EXPECT_EQ(product_shape(c.describe(), 2), (std::array<std::int64_t, 2>{2, 5}));
  c.request.op = CollectiveOp::kMatmulAllReduce;
  c.args.b = host(DType::kFloat32, {5, 8});
  c.request.trans_b = true;
  EXPECT_EQ(product_shape(c.describe(), 2), (std::array<std::int64_t, 2>{4, 5}));
}

TEST(DescribeCall, NamesTheArgumentAndTheShapes) {
  const std::pair<std::function<void(Call&)>, const char*> cases[] = {
      {[](Call& c) {
         c.args.b = host(DType::kFloat32, {6, 5});
       },
       "all_gather_matmul: b.shape=[6, 5] ([k, n]) does not match a.shape=[4, 8]: the "
       "contraction needs k=8"},
      {[](Call& c) {
         c.args.a = host(DType::kFloat32, {4, 8, 1});
       },
       "all_gather_matmul: a must be a 2-D array, got [4, 8, 1]"},
      {[](Call& c) { c.args.b = TensorView{}; }, "b must be a 2-D array, got none"},
      {[](Call& c) {
         c.args.a.dtype = DType::kFloat64;
         c.args.b.dtype = DType::kFloat64;
       },
       "a.dtype=float64 is not supported; use bfloat16, float16, float32 or float8 (scaled)"},
      {[](Call& c) { c.args.b.dtype = DType::kFloat16; },
       "b.dtype=float16 but a.dtype=float32; they must match"},
      {[](Call& c) { c.args.bias = host(DType::kFloat32, {4}); },
       "bias.shape=[4] but expected [5]"},
      {[](Call& c) {
         c.args.out = host(DType::kFloat32, {4, 4});
       },
       "out.shape=[4, 4] but expected [8, 5] (m, n)"},
      {[](Call& c) {
         c.args.gathered = host(DType::kFloat32, {8, 8});
       },
       "a gathered output is given but return_gathered=False"},
      {[](Call& c) {
         c.request.op = CollectiveOp::kMatmulReduceScatter;
         c.args.a = host(DType::kFloat32, {5, 8});
       },
       "matmul_reduce_scatter: a.shape[0]=5 is not divisible by tp_size=2"},
      {[](Call& c) { c.device = 0; }, "a is on cpu but the group runs on cuda:0"},
      {[](Call& c) { c.request.chunks = -1; }, "chunks=-1 is negative"},
      {[](Call& c) { c.request.comm_ctas = -5; }, "comm_ctas=-5 must be 0"},
  };
  for (const auto& [change, expected] : cases) {
    Call c = all_gather_call();
    change(c);
    const std::string message = message_of([&] { c.describe(); }, ErrorCode::kInvalidArgument);
    EXPECT_NE(message.find(expected), std::string::npos) << message;
  }
}

TEST(DescribeCall, RefusesWhatThePlanWouldWhateverTheHardware) {
  // A symmetric plan runs only the ring; on CPU tensors the request is refused as on CUDA ones.
  Call c = all_gather_call();
  c.request.op = CollectiveOp::kMatmulAllReduce;
  c.request.backend = Backend::kSymmetric;
  c.request.algorithm = Algorithm::kSequential;
  c.request.trans_b = true;
  c.args.b = host(DType::kFloat32, {5, 8});
  message_of([&] { c.describe(); }, ErrorCode::kNotImplemented);
  c.request.backend = Backend::kCublasMp;
  c.request.algorithm = Algorithm::kAuto;
  EXPECT_NE(message_of([&] { c.describe(); }, ErrorCode::kNotImplemented)
                .find("backend=cublasmp supports bfloat16 and float16"),
            std::string::npos);
}

TEST(DescribeCall, OutputsMustNotAliasInputsWhereTheArraysHaveData) {
  Call c = all_gather_call();
  c.args.a = make_tensor_view(fake_address(0), DType::kFloat32, {4, 8}, 0, DeviceKind::kCpu);
  c.args.b = make_tensor_view(fake_address(1 << 20), DType::kFloat32, {8, 5}, 0, DeviceKind::kCpu);
  c.args.out =
      make_tensor_view(fake_address(1 << 20), DType::kFloat32, {8, 5}, 0, DeviceKind::kCpu);
  EXPECT_NE(message_of([&] { c.describe(); }, ErrorCode::kInvalidArgument)
                .find("out shares memory with the input b"),
            std::string::npos);
}

// A float8 reduce-scatter on two ranks of CPU arrays: a [4, 32] e4m3, b [16, 32] e4m3 ([n, k]).
Call float8_call(std::int64_t a_scales, std::int64_t b_scales) {
  Call c;
  c.request.op = CollectiveOp::kMatmulReduceScatter;
  c.request.trans_b = true;
  c.args.a = host(DType::kFloat8E4M3, {4, 32});
  c.args.b = host(DType::kFloat8E4M3, {16, 32});
  c.args.a_scale = host(DType::kFloat32, {a_scales});
  c.args.b_scale = host(DType::kFloat32, {b_scales});
  return c;
}

TEST(DescribeCall, Float8ScalesDecideTheScalingAndTheProductIsInOutDtype) {
  Call tensorwise = float8_call(1, 1);
  CollectiveMatmulConfig config = tensorwise.describe();
  EXPECT_EQ(config.scaling, MatmulScaling::kTensorwise);
  EXPECT_EQ(product_dtype(config), DType::kBFloat16);  // the default
  EXPECT_EQ(config.b_dtype, DType::kFloat8E4M3);
  Call rowwise = float8_call(4, 16);
  rowwise.request.out_dtype = DType::kFloat32;
  rowwise.args.a_scale = host(DType::kFloat32, {4, 1});  // torch._scaled_mm's shapes
  rowwise.args.b_scale = host(DType::kFloat32, {1, 16});
  config = rowwise.describe();
  EXPECT_EQ(config.scaling, MatmulScaling::kRowwise);
  EXPECT_EQ(product_dtype(config), DType::kFloat32);
  // The ranks' records carry the new fields: a plan of another out_dtype is another plan.
  EXPECT_NE(config_record(config), config_record(tensorwise.describe()));
  // Over NVLink auto runs float8 on the copy engines, as it does 16-bit products.
  Call gather = float8_call(1, 1);
  gather.request.op = CollectiveOp::kAllGatherMatmul;
  EXPECT_EQ(resolve_config(gather.describe(), 2, PeerReach::kNvlink).backend, Backend::kSymmetric);
}

// float8_call's reduce-scatter with `rows` rows of a and rowwise scales.
void rowwise_rows(Call& c, std::int64_t rows) {
  c.args.a = host(DType::kFloat8E4M3, {rows, 32});
  c.args.a_scale = host(DType::kFloat32, {rows});
  c.args.b_scale = host(DType::kFloat32, {16});
}

TEST(DescribeCall, Float8MessagesNameTheScalesAndWhatFp8GemmsCannotTake) {
  const std::tuple<std::function<void(Call&)>, ErrorCode, const char*> cases[] = {
      {[](Call& c) { c.args.a_scale = TensorView{}; }, ErrorCode::kInvalidArgument,
       "matmul_reduce_scatter: a_scale is missing: a float8 product needs a_scale and b_scale"},
      {[](Call& c) { c.args.b_scale = host(DType::kFloat32, {3}); }, ErrorCode::kInvalidArgument,
       "a_scale.shape=[1] and b_scale.shape=[3]: tensorwise scales hold one value each, rowwise "
       "ones one per row of a (4) and per column of the product (n=16)"},
      {[](Call& c) { c.args.a_scale = host(DType::kFloat16, {1}); }, ErrorCode::kInvalidArgument,
       "a_scale.dtype=float16 but scales are float32"},
      {[](Call& c) { c.args.bias = host(DType::kFloat8E4M3, {16}); }, ErrorCode::kInvalidArgument,
       "bias.dtype=float8_e4m3fn but out_dtype=bfloat16"},
      {[](Call& c) {
         c.args.a = host(DType::kFloat8E5M2, {4, 32});
         c.args.b = host(DType::kFloat8E5M2, {16, 32});
       },
       ErrorCode::kNotImplemented,
       "matmul_reduce_scatter: cuBLASLt has no float8_e5m2 x float8_e5m2 GEMM"},
      {[](Call& c) {
         c.request.trans_b = false;
         c.args.b = host(DType::kFloat8E4M3, {32, 16});
       },
       ErrorCode::kNotImplemented, "float8 needs b stored [n, k] (trans_b)"},
      {[](Call& c) { c.request.algorithm = Algorithm::kRing; }, ErrorCode::kNotImplemented,
       "algorithm=ring on backend=nccl adds each rank's partial sum in the GEMM's epilogue"},
      {[](Call& c) {
         // Rowwise on the copy engines: rank 1's rows start at row 6 of 12.
         c.request.backend = Backend::kSymmetric;
         rowwise_rows(c, 12);
       },
       ErrorCode::kNotImplemented,
       "rowwise scales are read 16 bytes aligned, but backend=symmetric with algorithm=ring and "
       "chunks=1 starts a GEMM at row 6"},
      {[](Call& c) {
         c.request.op = CollectiveOp::kAllGatherMatmul;
         c.request.return_gathered = true;
         c.args.a_scale = host(DType::kFloat32, {4});
         c.args.b_scale = host(DType::kFloat32, {16});
       },
       ErrorCode::kNotImplemented, "return_gathered with rowwise scales"},
      {[](Call& c) {
         c.args.a = host(DType::kBFloat16, {4, 32});
         c.args.b = host(DType::kBFloat16, {16, 32});
       },
       ErrorCode::kInvalidArgument, "scales apply to float8 operands, not bfloat16"},
      {[](Call& c) {
         c.args.a = host(DType::kBFloat16, {4, 32});
       },
       ErrorCode::kInvalidArgument,
       "a.dtype=bfloat16 and b.dtype=float8_e4m3fn: a float8 product takes float8 a and b"},
      {[](Call& c) { c.args.b_scale = TensorView{}; }, ErrorCode::kInvalidArgument,
       "b_scale is missing"},
      {[](Call& c) {
         // Rowwise, pipelined: 2 ranks' 6 rows in 3 chunks of 2 start GEMMs at rows 2, 4, 6...
         c.request.algorithm = Algorithm::kPipelined;
         c.request.chunks = 3;
         rowwise_rows(c, 12);
       },
       ErrorCode::kNotImplemented,
       "rowwise scales are read 16 bytes aligned, but backend=nccl with algorithm=pipelined and "
       "chunks=3 starts a GEMM at row "},
  };
  for (const auto& [change, code, expected] : cases) {
    Call c = float8_call(1, 1);
    change(c);
    const std::string message = message_of([&] { c.describe(); }, code);
    EXPECT_NE(message.find(expected), std::string::npos) << message;
  }
  Call c = all_gather_call();
  c.request.out_dtype = DType::kFloat32;
  EXPECT_NE(message_of([&] { c.describe(); }, ErrorCode::kInvalidArgument)
                .find("out_dtype applies to float8 operands"),
            std::string::npos);
}

}  // namespace
}  // namespace meshla::collective
