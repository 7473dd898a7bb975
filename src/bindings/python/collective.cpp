// Python bindings of the collective matmul (meshla/collective_matmul.hpp): describe_call on
// arrays' metadata, the group's plan cache, and the plans' execution.
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <array>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

#include "bindings/python/bindings.hpp"
#include "meshla/collective_matmul.hpp"

using namespace nanobind::literals;

namespace meshla::bindings {
namespace {

// A group's plans as Python holds them. Letting go of a plan waits for its group's last execution;
// with one process driving several GPUs (local_groups), that execution may wait for a peer rank's
// thread, which needs the GIL to enqueue its part. So plans are built, run and let go of with the
// GIL released.
class PythonPlans : public CollectivePlans {
 public:
  using CollectivePlans::CollectivePlans;
  PythonPlans(const PythonPlans&) = delete;
  PythonPlans& operator=(const PythonPlans&) = delete;
  ~PythonPlans() {
    nb::gil_scoped_release release;
    clear();
  }
};

// A call's request: the op, its layout options, its tuning and a float8 call's output dtype
// (describe_call fills in the rest).
CollectiveMatmulConfig request_of(CollectiveOp op, bool trans_b, bool return_gathered,
                                  Algorithm algorithm, Backend backend, int chunks, int comm_sms,
                                  int comm_ctas, std::optional<DType> out_dtype = std::nullopt) {
  return {.op = op,
          .algorithm = algorithm,
          .backend = backend,
          .out_dtype = out_dtype,
          .trans_b = trans_b,
          .return_gathered = return_gathered,
          .chunks = chunks,
          .comm_sms = comm_sms,
          .comm_ctas = comm_ctas};
}

std::string scaling_name(MatmulScaling scaling) {
  switch (scaling) {
    case MatmulScaling::kTensorwise:
      return "tensorwise";
    case MatmulScaling::kRowwise:
      return "rowwise";
    default:
      return "none";
  }
}

// The arguments of a plan's execution on packed row-major arrays at these addresses (0: absent),
// each of the shape its config gives it. The plan checks them against its config as it would any
// arrays; only their shapes are taken on trust, from a caller that described the call with these
// arrays' metadata (describe_call) and made them contiguous.
CollectiveMatmulArgs packed_args(const CollectiveMatmul& plan, std::uintptr_t a, std::uintptr_t b,
                                 std::uintptr_t bias, std::uintptr_t out, std::uintptr_t gathered,
                                 std::uintptr_t a_scale, std::uintptr_t b_scale) {
  const CollectiveMatmulConfig& c = plan.config();
  const int tp = plan.communicator().size();
  const int device = plan.communicator().device();
  const auto view = [&](std::uintptr_t address, DType dtype,
                        std::initializer_list<std::int64_t> shape) {
    return address == 0 ? TensorView{}
                        : make_tensor_view(reinterpret_cast<void*>(address), dtype, shape, device);
  };
  const std::array<std::int64_t, 2> product = product_shape(c, tp);
  const DType b_dtype = c.b_dtype.value_or(c.dtype);
  const DType out_dtype = product_dtype(c);
  const std::int64_t rows = c.op == CollectiveOp::kAllGatherMatmul ? c.m / tp : c.m;
  const bool rowwise = c.scaling == MatmulScaling::kRowwise;
  return {.a = view(a, c.dtype, {rows, c.k}),
          .b = c.trans_b ? view(b, b_dtype, {c.n, c.k}) : view(b, b_dtype, {c.k, c.n}),
          .bias = view(bias, out_dtype, {c.n}),
          .out = view(out, out_dtype, {product[0], product[1]}),
          .gathered = view(gathered, c.dtype, {c.m, c.k}),
          .a_scale = view(a_scale, DType::kFloat32, {rowwise ? rows : 1}),
          .b_scale = view(b_scale, DType::kFloat32, {rowwise ? c.n : 1})};
}

}  // namespace

void bind_collective(nb::module_& m) {
  nb::enum_<CollectiveOp>(m, "CollectiveOp")
      .value("all_gather_matmul", CollectiveOp::kAllGatherMatmul)
      .value("matmul_reduce_scatter", CollectiveOp::kMatmulReduceScatter)
      .value("matmul_all_reduce", CollectiveOp::kMatmulAllReduce);

  nb::enum_<Algorithm>(m, "Algorithm")
      .value("auto", Algorithm::kAuto)
      .value("sequential", Algorithm::kSequential)
      .value("pipelined", Algorithm::kPipelined)
      .value("ring", Algorithm::kRing);

  nb::enum_<Backend>(m, "Backend")
      .value("auto", Backend::kAuto)
      .value("nccl", Backend::kNccl)
      .value("symmetric", Backend::kSymmetric)
      .value("cublasmp", Backend::kCublasMp);

  m.def("backend_unavailable_reason", &backend_unavailable_reason, "backend"_a,
        "Why the collective-matmul backend cannot run in this process, or '' when it can.");

  nb::class_<CollectiveMatmulConfig>(
      m, "CollectiveMatmulConfig",
      "A collective matmul's config: the op, its shapes and its tuning (describe_call's).")
      .def(
          "__init__",
          [](CollectiveMatmulConfig* self, CollectiveOp op, DType dtype, std::int64_t m_rows,
             std::int64_t n, std::int64_t k, bool trans_b, bool bias, bool return_gathered,
             Algorithm algorithm, Backend backend, int chunks, int comm_sms, int comm_ctas) {
            CollectiveMatmulConfig config = request_of(op, trans_b, return_gathered, algorithm,
                                                       backend, chunks, comm_sms, comm_ctas);
            config.dtype = dtype;
            config.m = m_rows;
            config.n = n;
            config.k = k;
            config.bias = bias;
            new (self) CollectiveMatmulConfig(config);
          },
          "op"_a, "dtype"_a, "m"_a, "n"_a, "k"_a, "trans_b"_a = false, "bias"_a = false,
          "return_gathered"_a = false, "algorithm"_a = Algorithm::kAuto,
          "backend"_a = Backend::kAuto, "chunks"_a = 0, "comm_sms"_a = -1, "comm_ctas"_a = 0)
      .def_ro("op", &CollectiveMatmulConfig::op)
      .def_ro("dtype", &CollectiveMatmulConfig::dtype)
      .def_ro("m", &CollectiveMatmulConfig::m)
      .def_ro("n", &CollectiveMatmulConfig::n)
      .def_ro("k", &CollectiveMatmulConfig::k)
      .def_ro("trans_b", &CollectiveMatmulConfig::trans_b)
      .def_ro("bias", &CollectiveMatmulConfig::bias)
      .def_ro("return_gathered", &CollectiveMatmulConfig::return_gathered)
      .def_ro("algorithm", &CollectiveMatmulConfig::algorithm)
      .def_ro("backend", &CollectiveMatmulConfig::backend)
      .def_ro("chunks", &CollectiveMatmulConfig::chunks)
      .def_ro("comm_sms", &CollectiveMatmulConfig::comm_sms)
      .def_ro("comm_ctas", &CollectiveMatmulConfig::comm_ctas)
      .def_prop_ro(
          "out_dtype", [](const CollectiveMatmulConfig& config) { return product_dtype(config); },
          "The product's dtype (out, bias): out_dtype for float8, else dtype.")
      .def_prop_ro(
          "b_dtype",
          [](const CollectiveMatmulConfig& config) {
            return config.b_dtype.value_or(config.dtype);
          },
          "b's dtype.")
      .def_prop_ro(
          "scaling",
          [](const CollectiveMatmulConfig& config) { return scaling_name(config.scaling); },
          "'none', 'tensorwise' or 'rowwise' (float8).")
      .def(
          "product_shape",
          [](const CollectiveMatmulConfig& config, int tp) { return product_shape(config, tp); },
          "tp"_a, "[rows, cols] of the product on each rank of a group of `tp`.");

  m.def(
      "describe_call",
      [](CollectiveOp op, const TensorView& a, const TensorView& b,
         const std::optional<TensorView>& bias, const std::optional<TensorView>& out,
         const std::optional<TensorView>& gathered, bool trans_b, bool return_gathered, int tp,
         int device, Algorithm algorithm, int chunks, int comm_sms, int comm_ctas, Backend backend,
         const std::optional<TensorView>& a_scale, const std::optional<TensorView>& b_scale,
         std::optional<DType> out_dtype) {
        const CollectiveMatmulConfig request =
            request_of(op, trans_b, return_gathered, algorithm, backend, chunks, comm_sms,
                       comm_ctas, out_dtype);
        const CollectiveMatmulArgs args{.a = a,
                                        .b = b,
                                        .bias = meta_or_absent(bias),
                                        .out = meta_or_absent(out),
                                        .gathered = meta_or_absent(gathered),
                                        .a_scale = meta_or_absent(a_scale),
                                        .b_scale = meta_or_absent(b_scale)};
        return describe_call(request, args, tp, device);
      },
      "op"_a, "a"_a, "b"_a, "bias"_a.none(), "out"_a.none(), "gathered"_a.none(), "trans_b"_a,
      "return_gathered"_a, "tp"_a, "device"_a, "algorithm"_a, "chunks"_a, "comm_sms"_a,
      "comm_ctas"_a, "backend"_a, "a_scale"_a.none() = nb::none(), "b_scale"_a.none() = nb::none(),
      "out_dtype"_a.none() = nb::none(),
      "Checks one call on its arrays' metadata (ArrayMeta) for a group of `tp` on `device` (-1: "
      "CPU tensors) and returns the config its plan is built with (see "
      "meshla/collective_matmul.hpp).");

  nb::class_<CollectiveMatmul>(m, "CollectiveMatmul",
                               "A collective-matmul plan for one config on one group.")
      .def(
          "execute",
          [](CollectiveMatmul& plan, std::uintptr_t a, std::uintptr_t b, std::uintptr_t bias,
             std::uintptr_t out, std::uintptr_t gathered, std::uintptr_t stream,
             std::uintptr_t a_scale, std::uintptr_t b_scale) {
            const CollectiveMatmulArgs args =
                packed_args(plan, a, b, bias, out, gathered, a_scale, b_scale);
            nb::gil_scoped_release release;
            plan.execute(args, to_stream(stream));
          },
          "a"_a, "b"_a, "bias"_a, "out"_a, "gathered"_a, "stream"_a, "a_scale"_a = 0,
          "b_scale"_a = 0,
          "Enqueues the op on `stream` (a cudaStream_t as an integer) on contiguous arrays at "
          "these device addresses (0: no bias, no gathered output), of the shapes and dtype of "
          "the config that describe_call gave for them: addresses rather than DLPack arrays, "
          "which cost a small call's host time several microseconds more.")
      .def_prop_ro("config", &CollectiveMatmul::config,
                   "The config with backend, algorithm and chunks resolved.")
      .def_prop_ro("communicator", &CollectiveMatmul::communicator);

  nb::class_<AllGather>(m, "AllGather",
                        "An all-gather of [rows, cols] per rank on one group, in the order of its "
                        "collective matmuls.")
      .def(
          "execute",
          [](AllGather& plan, const Array& rows, const Array& gathered, std::uintptr_t stream) {
            const TensorView rows_view = view_of(rows, "rows");
            const TensorView gathered_view = view_of(gathered, "gathered");
            nb::gil_scoped_release release;
            plan.execute(rows_view, gathered_view, to_stream(stream));
          },
          "rows"_a, "gathered"_a, "stream"_a,
          "Enqueues the all-gather of `rows` into `gathered` on `stream` (a cudaStream_t).");

  nb::class_<PythonPlans>(m, "CollectivePlans",
                          "A group's plans by config, built on first use (collectively).")
      .def(nb::init<Communicator>(), "comm"_a)
      .def(
          "matmul",
          [](PythonPlans& plans, const CollectiveMatmulConfig& config) -> CollectiveMatmul& {
            nb::gil_scoped_release release;
            return plans.matmul(config);
          },
          "config"_a, nb::rv_policy::reference_internal,
          "The group's plan for `config` (describe_call's), built on first use: every rank asks "
          "for the same configs in the same order.")
      .def(
          "all_gather",
          [](PythonPlans& plans, DType dtype, std::int64_t rows, std::int64_t cols) -> AllGather& {
            nb::gil_scoped_release release;
            return plans.all_gather({.dtype = dtype, .rows = rows, .cols = cols});
          },
          "dtype"_a, "rows"_a, "cols"_a, nb::rv_policy::reference_internal,
          "The group's all-gather of [rows, cols] a rank, built on first use.")
      .def(
          "clear",
          [](PythonPlans& plans) {
            nb::gil_scoped_release release;
            plans.clear();
          },
          "Lets go of every plan (each waits for its last execution).")
      .def("__len__", &PythonPlans::size)
      .def_prop_ro("communicator", &PythonPlans::communicator);
}

}  // namespace meshla::bindings
