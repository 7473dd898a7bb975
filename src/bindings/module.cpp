// The Python extension _meshla: the only C++ that knows nanobind. Arrays arrive through DLPack
// (capsules or objects with __dlpack__), streams as integers, and meshla::Error leaves as the
// matching Python exception.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstring>
#include <optional>
#include <string>

#include "core/checks.hpp"
#include "core/releases.hpp"
#include "core/timeout.hpp"
#include "meshla/meshla.hpp"
#include "solver/block_cyclic.hpp"
#include "solver/solver_validation.hpp"
#ifdef MESHLA_WITH_JAX
#include "bindings/jax_ffi.hpp"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace meshla {
namespace {

using Array = nb::ndarray<nb::ro>;

DType dtype_of(const Array& array, const char* name) {
  const nb::dlpack::dtype type = array.dtype();
  const auto code = static_cast<nb::dlpack::dtype_code>(type.code);
  if (type.lanes == 1) {
    if (code == nb::dlpack::dtype_code::Bfloat && type.bits == 16) return DType::kBFloat16;
    if (code == nb::dlpack::dtype_code::Float && type.bits == 16) return DType::kFloat16;
    if (code == nb::dlpack::dtype_code::Float && type.bits == 32) return DType::kFloat32;
    if (code == nb::dlpack::dtype_code::Float && type.bits == 64) return DType::kFloat64;
    if (code == nb::dlpack::dtype_code::Complex && type.bits == 64) return DType::kComplex64;
    if (code == nb::dlpack::dtype_code::Complex && type.bits == 128) return DType::kComplex128;
    if (code == nb::dlpack::dtype_code::Int && type.bits == 32) return DType::kInt32;
    if (code == nb::dlpack::dtype_code::Int && type.bits == 64) return DType::kInt64;
  }
  MESHLA_THROW(kInvalidArgument, name << ": DLPack dtype (code " << int(type.code) << ", "
                                      << int(type.bits) << " bits, " << type.lanes
                                      << " lanes) is not supported");
}

TensorView view_of(const std::optional<Array>& maybe, const char* name) {
  TensorView view;
  if (!maybe) return view;
  const Array& array = *maybe;
  MESHLA_CHECK_ARG(array.ndim() <= static_cast<std::size_t>(kMaxTensorDims),
                   name << " has " << array.ndim() << " dimensions, more than " << kMaxTensorDims);
  view.data = const_cast<void*>(array.data());
  view.dtype = dtype_of(array, name);
  const int device_type = array.device_type();
  MESHLA_CHECK_ARG(
      device_type == nb::device::cuda::value || device_type == nb::device::cpu::value,
      name << " is on DLPack device type " << device_type << "; meshla takes CUDA or host arrays");
  view.device_kind = device_type == nb::device::cuda::value ? DeviceKind::kCuda : DeviceKind::kCpu;
  view.device = array.device_id();
  view.ndim = static_cast<int>(array.ndim());
  for (int i = 0; i < view.ndim; ++i) {
    view.shape[i] = static_cast<std::int64_t>(array.shape(i));
    view.strides[i] = static_cast<std::int64_t>(array.stride(i));
  }
  return view;
}

DType parse_dtype(const std::string& name) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16, DType::kFloat32, DType::kFloat64,
                      DType::kComplex64, DType::kComplex128, DType::kInt32, DType::kInt64}) {
    if (dtype_name(dtype) == name) return dtype;
  }
  MESHLA_THROW(kInvalidArgument, "dtype '" << name << "' is not a meshla dtype");
}

CholeskyFactorization parse_cholesky(const std::string& name) {
  if (name == "meshla") return CholeskyFactorization::kMeshla;
  if (name == "cusolvermg") return CholeskyFactorization::kCusolverMg;
  MESHLA_THROW(kInvalidArgument,
               "cholesky='" << name << "' is not one of 'meshla' and 'cusolvermg'");
}

cudaStream_t to_stream(std::uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

void translate_errors() {
  nb::register_exception_translator([](const std::exception_ptr& thrown, void*) {
    try {
      std::rethrow_exception(thrown);
    } catch (const Error& error) {
      switch (error.code()) {
        case ErrorCode::kInvalidArgument:
          PyErr_SetString(PyExc_ValueError, error.what());
          break;
        case ErrorCode::kNotImplemented:
          PyErr_SetString(PyExc_NotImplementedError, error.what());
          break;
        case ErrorCode::kTimeout:
          PyErr_SetString(PyExc_TimeoutError, error.what());
          break;
        default:
          PyErr_SetString(PyExc_RuntimeError, error.what());
      }
    }
  });
}

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
}  // namespace meshla

NB_MODULE(_meshla, m) {
  using namespace meshla;
  translate_errors();

  m.def(
      "unique_id",
      [] {
        const UniqueId id = make_unique_id();
        return nb::bytes(reinterpret_cast<const char*>(id.bytes.data()), id.bytes.size());
      },
      "A fresh NCCL unique id (128 bytes) to hand to every rank of a new group.");

  nb::class_<Communicator>(m, "Communicator",
                           "Shared handle to one NCCL communicator; plans keep it alive.")
      .def(
          "__init__",
          [](Communicator* self, nb::bytes id, int rank, int size, int device, double timeout_s) {
            MESHLA_CHECK_ARG(id.size() == UniqueId::kSize, "Communicator: unique_id has "
                                                               << id.size() << " bytes, expected "
                                                               << UniqueId::kSize);
            UniqueId unique;
            std::memcpy(unique.bytes.data(), id.c_str(), UniqueId::kSize);
            CommunicatorOptions options{.timeout = detail::timeout_from_seconds(timeout_s)};
            nb::gil_scoped_release release;
            new (self) Communicator(Communicator::create(unique, rank, size, device, options));
          },
          "unique_id"_a, "rank"_a, "size"_a, "device"_a, "timeout_s"_a = 300.0)
      .def_static(
          "create_local",
          [](const std::vector<int>& devices, double timeout_s) {
            CommunicatorOptions options{.timeout = detail::timeout_from_seconds(timeout_s)};
            nb::gil_scoped_release release;
            return Communicator::create_local(devices, options);
          },
          "devices"_a, "timeout_s"_a = 300.0,
          "One communicator per device for a group driven by this process, in device order.")
      .def_prop_ro("rank", &Communicator::rank)
      .def_prop_ro("size", &Communicator::size)
      .def_prop_ro("device", &Communicator::device)
      .def("__repr__", [](const Communicator& c) {
        return "Communicator(rank=" + std::to_string(c.rank()) +
               ", size=" + std::to_string(c.size()) + ", device=" + std::to_string(c.device()) +
               ")";
      });

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

  m.def("set_leak_warnings", &nb::set_leak_warnings, "enabled"_a,
        "Whether nanobind reports objects of these bindings still alive when the extension is "
        "torn down (on by default).");
  m.def("begin_process_exit", &detail::begin_process_exit, nb::call_guard<nb::gil_scoped_release>(),
        "The process is ending: waits a few seconds at most for the releases under way, and "
        "leaves what is let go of from now on (communicators, plans held by CUDA graphs) to the "
        "process's end instead of releasing it (an abort waits for the peers to abort too, or to "
        "exit).");
  m.def("releases_under_way", &detail::releases_under_way,
        "How many releases are still running on threads of their own: communicators being "
        "aborted (an abort returns once the peers have ended them too), plans let go of by the "
        "CUDA graphs that captured them.");
  m.def(
      "communicator_holders", [](const Communicator& c) { return c.state().use_count(); }, "comm"_a,
      "How many handles share the communicator's state: its Communicator objects and those of the "
      "plans made on it, which CUDA graphs that captured their runs keep (for tests and "
      "diagnostics).");
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

  nb::enum_<GroupedPass>(m, "GroupedPass")
      .value("forward", GroupedPass::kForward)
      .value("dgrad", GroupedPass::kDgrad)
      .value("wgrad", GroupedPass::kWgrad)
      .value("bias_grad", GroupedPass::kBiasGrad);

  m.def(
      "packed_group_stride",
      [](std::int64_t out_features, std::int64_t in_features, const std::string& dtype) {
        return packed_group_stride(out_features, in_features, parse_dtype(dtype));
      },
      "out_features"_a, "in_features"_a, "dtype"_a,
      "Elements between groups of a packed [G, out, in] buffer whose groups start on 256-byte "
      "boundaries.");

  nb::class_<GroupedMatmul>(m, "GroupedMatmul",
                            "Grouped GEMM of one device (see meshla/grouped_matmul.hpp).")
      .def(nb::init<int>(), "device"_a)
      .def(
          "workspace_bytes",
          [](const GroupedMatmul& self, GroupedPass pass, const std::string& dtype,
             std::int64_t num_groups, std::int64_t out_features) {
            return self.workspace_bytes(pass, parse_dtype(dtype), num_groups, out_features);
          },
          "grouped_pass"_a, "dtype"_a, "num_groups"_a, "out_features"_a)
      .def(
          "run",
          [](GroupedMatmul& self, GroupedPass pass, const Array& m_splits, const Array& workspace,
             std::uintptr_t stream, const std::optional<Array>& x, const std::optional<Array>& dy,
             const std::optional<Array>& weight, const std::optional<Array>& bias,
             const std::optional<Array>& y, const std::optional<Array>& dx,
             const std::optional<Array>& dweight, const std::optional<Array>& dbias,
             bool accumulate, const std::optional<Array>& dweight_addresses) {
            GroupedMatmulArgs args{
                .m_splits = view_of(m_splits, "m_splits"),
                .x = view_of(x, "x"),
                .dy = view_of(dy, "dy"),
                .weight = view_of(weight, "weight"),
                .bias = view_of(bias, "bias"),
                .y = view_of(y, "y"),
                .dx = view_of(dx, "dx"),
                .dweight = view_of(dweight, "dweight"),
                .dbias = view_of(dbias, "dbias"),
                .dweight_addresses = view_of(dweight_addresses, "dweight_addresses"),
                .accumulate = accumulate,
                .workspace = view_of(workspace, "workspace")};
            nb::gil_scoped_release release;
            self.run(pass, args, to_stream(stream));
          },
          "grouped_pass"_a, "m_splits"_a, "workspace"_a, "stream"_a, "x"_a.none() = nb::none(),
          "dy"_a.none() = nb::none(), "weight"_a.none() = nb::none(), "bias"_a.none() = nb::none(),
          "y"_a.none() = nb::none(), "dx"_a.none() = nb::none(), "dweight"_a.none() = nb::none(),
          "dbias"_a.none() = nb::none(), "accumulate"_a = false,
          "dweight_addresses"_a.none() = nb::none(),
          "Enqueues one pass on `stream` (a cudaStream_t as an integer).")
      .def(
          "check_device_errors",
          [](GroupedMatmul& self, std::uintptr_t stream) {
            nb::gil_scoped_release release;
            self.check_device_errors(to_stream(stream));
          },
          "stream"_a,
          "Waits for `stream`, then raises the error a call's device-side check recorded.")
      .def_prop_ro("device", &GroupedMatmul::device);

  nb::enum_<SolverOp>(m, "SolverOp")
      .value("cholesky_solve", SolverOp::kCholeskySolve)
      .value("cholesky_inverse", SolverOp::kCholeskyInverse)
      .value("eigh", SolverOp::kEigen)
      .value("eigvalsh", SolverOp::kEigenvalues);

  m.def(
      "solver_layout",
      [](SolverOp op, std::int64_t n, std::int64_t parts, std::int64_t tile) {
        const solver::BlockCyclicLayout layout = solver::solver_layout(op, n, parts, tile);
        return std::make_tuple(layout.tile, layout.padded());
      },
      "op"_a, "n"_a, "parts"_a, "tile"_a = 0,
      "(tile, padded): the tile a dense solver over `parts` GPUs uses for `op` of order n "
      "(tile=0: its own choice), and whether n/parts needs padding to a multiple of it.");

  nb::class_<DenseSolver>(m, "DenseSolver",
                          "cuSolverMg over the GPUs of this process, cusolverDn on one (see "
                          "meshla/dense_solver.hpp).")
      .def(
          "__init__",
          [](DenseSolver* self, const std::vector<int>& devices) {
            nb::gil_scoped_release release;
            new (self) DenseSolver(devices);
          },
          "devices"_a)
      .def_prop_ro("devices", &DenseSolver::devices)
      .def(
          "workspace_bytes",
          [](const DenseSolver& self, SolverOp op, std::int64_t n, const std::string& dtype,
             std::int64_t nrhs, std::int64_t tile, bool overwrite_a, int part,
             const std::string& cholesky) {
            const SolverProblem problem{.n = n,
                                        .dtype = parse_dtype(dtype),
                                        .nrhs = nrhs,
                                        .tile = tile,
                                        .overwrite_a = overwrite_a,
                                        .cholesky = parse_cholesky(cholesky)};
            nb::gil_scoped_release release;
            return self.workspace_bytes(op, problem, part);
          },
          "op"_a, "n"_a, "dtype"_a, "nrhs"_a, "tile"_a, "overwrite_a"_a, "part"_a,
          "cholesky"_a = "meshla")
      .def(
          "run",
          [](DenseSolver& self, SolverOp op, std::int64_t n, const std::string& dtype,
             std::int64_t nrhs, std::int64_t tile, bool overwrite_a,
             const std::vector<std::optional<Array>>& a, const std::vector<std::optional<Array>>& b,
             const std::vector<std::optional<Array>>& out,
             const std::vector<std::optional<Array>>& eigenvalues,
             const std::vector<std::optional<Array>>& logdet,
             const std::vector<std::optional<Array>>& workspace,
             const std::vector<std::uintptr_t>& streams, const std::string& cholesky) {
            const std::size_t parts = self.devices().size();
            for (const auto* list : {&a, &b, &out, &eigenvalues, &logdet, &workspace}) {
              MESHLA_CHECK_ARG(list->size() == parts, solver_op_name(op)
                                                          << ": " << list->size()
                                                          << " entries in a per-GPU list for "
                                                          << parts << " GPUs");
            }
            MESHLA_CHECK_ARG(streams.size() == parts, solver_op_name(op)
                                                          << ": " << streams.size()
                                                          << " streams for " << parts << " GPUs");
            std::vector<SolverShard> shards(parts);
            for (std::size_t part = 0; part < parts; ++part) {
              shards[part] = SolverShard{.a = view_of(a[part], "a"),
                                         .b = view_of(b[part], "b"),
                                         .out = view_of(out[part], "out"),
                                         .eigenvalues = view_of(eigenvalues[part], "eigenvalues"),
                                         .logdet = view_of(logdet[part], "logdet"),
                                         .workspace = view_of(workspace[part], "workspace"),
                                         .stream = to_stream(streams[part])};
            }
            const SolverProblem problem{.n = n,
                                        .dtype = parse_dtype(dtype),
                                        .nrhs = nrhs,
                                        .tile = tile,
                                        .overwrite_a = overwrite_a,
                                        .cholesky = parse_cholesky(cholesky)};
            nb::gil_scoped_release release;
            const SolverResult result = self.run(op, problem, shards);
            return std::make_tuple(result.info, result.logdet, result.eigenvalues,
                                   result.solver_seconds);
          },
          "op"_a, "n"_a, "dtype"_a, "nrhs"_a, "tile"_a, "overwrite_a"_a, "a"_a, "b"_a, "out"_a,
          "eigenvalues"_a, "logdet"_a, "workspace"_a, "streams"_a, "cholesky"_a = "meshla",
          "Runs one call over per-GPU lists (None where an op takes no such array); returns "
          "(info, logdet, eigenvalues, seconds in the factorization and the cuSOLVER routines). "
          "cholesky: "
          "who factors A, 'meshla' or 'cusolvermg' (the reference).");

#ifdef MESHLA_WITH_JAX
  m.def(
      "jax_ffi_targets",
      [] {
        nb::dict targets;
        for (const auto& [name, handler] : jax_ffi::targets()) {
          targets[nb::str(name.c_str())] = nb::capsule(handler);
        }
        return targets;
      },
      "XLA FFI handlers of the dense solvers, by target name, for the CUDA platform.");
  m.def(
      "release_jax_solvers",
      [] {
        nb::gil_scoped_release release;
        jax_ffi::release_solvers();
      },
      "Destroys the DenseSolvers the JAX handlers created.");
  m.attr("with_jax") = true;
#else
  m.attr("with_jax") = false;
#endif
}
