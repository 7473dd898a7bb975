// Python bindings of the dense solvers (meshla/dense_solver.hpp).
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "bindings/python/bindings.hpp"
#include "core/checks.hpp"
#include "meshla/dense_solver.hpp"
#include "meshla/process_solver.hpp"
#include "solver/block_cyclic.hpp"
#include "solver/solver_validation.hpp"

using namespace nanobind::literals;

namespace meshla::bindings {
namespace {

CholeskyFactorization parse_cholesky(const std::string& name) {
  if (name == "meshla") return CholeskyFactorization::kMeshla;
  if (name == "cusolvermg") return CholeskyFactorization::kCusolverMg;
  MESHLA_THROW(kInvalidArgument,
               "cholesky='" << name << "' is not one of 'meshla' and 'cusolvermg'");
}

// The problem as the Python front ends describe it (dtype and factorization by name).
SolverProblem problem_of(std::int64_t n, DType dtype, std::int64_t nrhs, std::int64_t tile,
                         bool overwrite_a, const std::string& cholesky) {
  return SolverProblem{.n = n,
                       .dtype = dtype,
                       .nrhs = nrhs,
                       .tile = tile,
                       .overwrite_a = overwrite_a,
                       .cholesky = parse_cholesky(cholesky)};
}

}  // namespace

void bind_solver(nb::module_& m) {
  nb::enum_<SolverOp>(m, "SolverOp")
      .value("cholesky_solve", SolverOp::kCholeskySolve)
      .value("cholesky_inverse", SolverOp::kCholeskyInverse)
      .value("eigh", SolverOp::kEigen)
      .value("eigvalsh", SolverOp::kEigenvalues)
      .value("lu_solve", SolverOp::kLuSolve);

  m.def(
      "solver_call",
      [](SolverOp op, std::int64_t n, DType dtype, std::int64_t nrhs, std::int64_t parts,
         std::int64_t tile, bool overwrite_a) {
        const solver::BlockCyclicLayout layout = solver::check_solver_call(
            op, problem_of(n, dtype, nrhs, tile, overwrite_a, "meshla"), parts);
        return std::make_tuple(layout.tile, layout.padded());
      },
      "op"_a, "n"_a, "dtype"_a, "nrhs"_a, "parts"_a, "tile"_a = 0, "overwrite_a"_a = false,
      "Checks a call of `op` of order n over `parts` GPUs on its metadata alone (dtype, "
      "right-hand sides, tile, overwrite_a; what the GPUs would refuse, also for CPU arrays) and "
      "returns (tile, padded): the tile it runs with (tile=0: meshla's choice) and whether n/parts "
      "is padded to a multiple of it.");

  m.def(
      "tall_qr_call",
      [](const std::string& name, std::int64_t m, std::int64_t n, DType dtype, std::int64_t parts,
         std::int64_t nrhs) { solver::check_tall_qr_call(name, m, n, dtype, parts, nrhs); },
      "name"_a, "m"_a, "n"_a, "dtype"_a, "parts"_a, "nrhs"_a = 0,
      "Checks a tall-skinny QR call (qr, least_squares, svd, polar) of an [m, n] a over `parts` "
      "devices: the dtype, an even split of the rows, m >= n (NotImplementedError otherwise); "
      "raises in `name`'s words.");

  m.def(
      "rhs_block",
      [](const std::string& name, const std::string& b, const std::vector<std::int64_t>& b_shape,
         DType b_dtype, std::int64_t a_rows, DType a_dtype, bool vector_ok) {
        solver::check_rhs_block(name, b, b_shape, b_dtype, a_rows, a_dtype, vector_ok);
      },
      "name"_a, "b"_a, "b_shape"_a, "b_dtype"_a, "a_rows"_a, "a_dtype"_a, "vector_ok"_a = false,
      "Checks a right-hand side's row block beside a's (2-D, or 1-D where vector_ok; a's rows "
      "and dtype); raises ValueError in `name`'s words, naming the block `b`.");

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
          [](const DenseSolver& self, SolverOp op, std::int64_t n, DType dtype, std::int64_t nrhs,
             std::int64_t tile, bool overwrite_a, int part, const std::string& cholesky) {
            const SolverProblem problem = problem_of(n, dtype, nrhs, tile, overwrite_a, cholesky);
            nb::gil_scoped_release release;
            return self.workspace_bytes(op, problem, part);
          },
          "op"_a, "n"_a, "dtype"_a, "nrhs"_a, "tile"_a, "overwrite_a"_a, "part"_a,
          "cholesky"_a = "meshla")
      .def(
          "run",
          [](DenseSolver& self, SolverOp op, std::int64_t n, DType dtype, std::int64_t nrhs,
             std::int64_t tile, bool overwrite_a, const std::vector<std::optional<Array>>& a,
             const std::vector<std::optional<Array>>& b,
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
            const SolverProblem problem = problem_of(n, dtype, nrhs, tile, overwrite_a, cholesky);
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

  nb::class_<ProcessSolver>(m, "ProcessSolver",
                            "cuSOLVERMp over one GPU in each process of a communicator's group "
                            "(see meshla/process_solver.hpp).")
      .def(
          "__init__",
          [](ProcessSolver* self, Communicator comm) {
            nb::gil_scoped_release release;
            new (self) ProcessSolver(std::move(comm));
          },
          "comm"_a, "Collective over the communicator's ranks.")
      .def_static("unavailable_reason", &ProcessSolver::unavailable_reason,
                  "Why cuSOLVERMp cannot run in this process; '' where it can.")
      .def_static("max_ranks", &ProcessSolver::max_ranks, "The most ranks a solver takes.")
      .def_prop_ro("rank", &ProcessSolver::rank)
      .def_prop_ro("size", &ProcessSolver::size)
      .def(
          "workspace_bytes",
          [](const ProcessSolver& self, SolverOp op, std::int64_t n, DType dtype, std::int64_t nrhs,
             std::int64_t tile, bool overwrite_a) {
            const SolverProblem problem = problem_of(n, dtype, nrhs, tile, overwrite_a, "meshla");
            nb::gil_scoped_release release;
            return self.workspace_bytes(op, problem);
          },
          "op"_a, "n"_a, "dtype"_a, "nrhs"_a, "tile"_a, "overwrite_a"_a)
      .def(
          "run",
          [](ProcessSolver& self, SolverOp op, std::int64_t n, DType dtype, std::int64_t nrhs,
             std::int64_t tile, bool overwrite_a, const Array& a, const Array& b, const Array& out,
             const std::optional<Array>& logdet, const Array& workspace, std::uintptr_t stream) {
            const SolverShard shard{.a = view_of(a, "a"),
                                    .b = view_of(b, "b"),
                                    .out = view_of(out, "out"),
                                    .logdet = view_of(logdet, "logdet"),
                                    .workspace = view_of(workspace, "workspace"),
                                    .stream = to_stream(stream)};
            const SolverProblem problem = problem_of(n, dtype, nrhs, tile, overwrite_a, "meshla");
            nb::gil_scoped_release release;
            const SolverResult result = self.run(op, problem, shard);
            return std::make_tuple(result.info, result.logdet);
          },
          "op"_a, "n"_a, "dtype"_a, "nrhs"_a, "tile"_a, "overwrite_a"_a, "a"_a, "b"_a, "out"_a,
          "logdet"_a, "workspace"_a, "stream"_a,
          "This rank's part of a collective call: its row blocks of a, b and out (logdet None or "
          "a scalar); returns (info, logdet), the same on every rank.");
}

}  // namespace meshla::bindings
