// Python bindings of the collective matmul (meshla/collective_matmul.hpp).
#include <nanobind/stl/string.h>

#include <string>

#include "bindings/python/bindings.hpp"
#include "meshla/collective_matmul.hpp"

using namespace nanobind::literals;

namespace meshla::bindings {
namespace {

// A plan of the group (CollectiveMatmul, AllGather) as Python holds it. Destroying a plan waits
// for its group's last execution; with one process driving several GPUs (local_groups), that
// execution may wait for a peer rank's thread, which needs the GIL to enqueue its part. So the
// plan goes with the GIL released, as it is built and executed.
template <typename Plan>
class PythonPlan : public Plan {
 public:
  using Plan::Plan;
  PythonPlan(const PythonPlan&) = delete;
  PythonPlan& operator=(const PythonPlan&) = delete;
  ~PythonPlan() {
    nb::gil_scoped_release release;
    Plan last = std::move(static_cast<Plan&>(*this));
  }
};
using PythonCollectiveMatmul = PythonPlan<CollectiveMatmul>;
using PythonAllGather = PythonPlan<AllGather>;

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

  nb::class_<PythonCollectiveMatmul>(m, "CollectiveMatmul",
                                     "A collective-matmul plan for one shape on one communicator.")
      .def(
          "__init__",
          [](PythonCollectiveMatmul* self, const Communicator& comm, CollectiveOp op,
             const std::string& dtype, std::int64_t m_rows, std::int64_t n, std::int64_t k,
             Algorithm algorithm, Backend backend, bool trans_b, bool bias, bool return_gathered,
             int chunks, int comm_sms, int comm_ctas) {
            CollectiveMatmulConfig config{.op = op,
                                          .algorithm = algorithm,
                                          .backend = backend,
                                          .dtype = parse_dtype(dtype),
                                          .m = m_rows,
                                          .n = n,
                                          .k = k,
                                          .trans_b = trans_b,
                                          .bias = bias,
                                          .return_gathered = return_gathered,
                                          .chunks = chunks,
                                          .comm_sms = comm_sms,
                                          .comm_ctas = comm_ctas};
            nb::gil_scoped_release release;
            new (self) PythonCollectiveMatmul(comm, config);
          },
          "comm"_a, "op"_a, "dtype"_a, "m"_a, "n"_a, "k"_a, "algorithm"_a = Algorithm::kAuto,
          "backend"_a = Backend::kAuto, "trans_b"_a = false, "bias"_a = false,
          "return_gathered"_a = false, "chunks"_a = 0, "comm_sms"_a = -1, "comm_ctas"_a = 0)
      .def(
          "execute",
          [](PythonCollectiveMatmul& plan, const Array& a, const Array& b,
             const std::optional<Array>& bias, const Array& out,
             const std::optional<Array>& gathered, std::uintptr_t stream) {
            CollectiveMatmulArgs args{.a = view_of(a, "a"),
                                      .b = view_of(b, "b"),
                                      .bias = view_of(bias, "bias"),
                                      .out = view_of(out, "out"),
                                      .gathered = view_of(gathered, "gathered")};
            nb::gil_scoped_release release;
            plan.execute(args, to_stream(stream));
          },
          "a"_a, "b"_a, "bias"_a.none(), "out"_a, "gathered"_a.none(), "stream"_a,
          "Enqueues the op on `stream` (a cudaStream_t as an integer).")
      .def_prop_ro("algorithm",
                   [](const PythonCollectiveMatmul& p) { return p.config().algorithm; })
      .def_prop_ro("backend", [](const PythonCollectiveMatmul& p) { return p.config().backend; })
      .def_prop_ro("chunks", [](const PythonCollectiveMatmul& p) { return p.config().chunks; })
      .def_prop_ro("comm_sms", [](const PythonCollectiveMatmul& p) { return p.config().comm_sms; })
      .def_prop_ro("comm_ctas",
                   [](const PythonCollectiveMatmul& p) { return p.config().comm_ctas; })
      .def_prop_ro("communicator",
                   [](const PythonCollectiveMatmul& p) { return p.communicator(); });

  nb::class_<PythonAllGather>(m, "AllGather",
                              "An all-gather of [rows, cols] per rank on one communicator, in "
                              "the order of its group's collective matmuls.")
      .def(
          "__init__",
          [](PythonAllGather* self, const Communicator& comm, const std::string& dtype,
             std::int64_t rows, std::int64_t cols) {
            const AllGatherConfig config{.dtype = parse_dtype(dtype), .rows = rows, .cols = cols};
            nb::gil_scoped_release release;
            new (self) PythonAllGather(comm, config);
          },
          "comm"_a, "dtype"_a, "rows"_a, "cols"_a)
      .def(
          "execute",
          [](PythonAllGather& plan, const Array& rows, const Array& gathered,
             std::uintptr_t stream) {
            const TensorView rows_view = view_of(rows, "rows");
            const TensorView gathered_view = view_of(gathered, "gathered");
            nb::gil_scoped_release release;
            plan.execute(rows_view, gathered_view, to_stream(stream));
          },
          "rows"_a, "gathered"_a, "stream"_a,
          "Enqueues the all-gather of `rows` into `gathered` on `stream` (a cudaStream_t).");
}

}  // namespace meshla::bindings
