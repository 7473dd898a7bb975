#include "solver/solver_validation.hpp"

#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "core/checks.hpp"

namespace meshla::solver {

DType real_dtype(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kComplex64 ? DType::kFloat32 : DType::kFloat64;
}

bool is_complex(DType dtype) { return dtype == DType::kComplex64 || dtype == DType::kComplex128; }

namespace {

void check_dtype(std::string_view name, DType dtype) {
  MESHLA_CHECK_ARG(dtype == DType::kFloat32 || dtype == DType::kFloat64 ||
                       dtype == DType::kComplex64 || dtype == DType::kComplex128,
                   name << ": dtype " << dtype_name(dtype)
                        << " is not float32, float64, complex64 or complex128");
}

}  // namespace

void check_solver_problem(SolverOp op, const SolverProblem& problem) {
  check_dtype(solver_op_name(op), problem.dtype);
  if (op == SolverOp::kCholeskySolve || op == SolverOp::kLuSolve) {
    MESHLA_CHECK_ARG(problem.nrhs >= 1 && problem.nrhs <= 256,
                     solver_op_name(op) << ": nrhs=" << problem.nrhs
                                        << " right-hand sides; cuSolverMg takes 1 to 256");
  }
}

void check_tall_qr_call(std::string_view name, std::int64_t m, std::int64_t n, DType dtype,
                        std::int64_t parts, std::int64_t nrhs) {
  check_dtype(name, dtype);
  MESHLA_CHECK_ARG(n >= 1 && m >= 1, name << ": a is [" << m << ", " << n << "]; it needs rows "
                                          << "and columns");
  MESHLA_CHECK_ARG(parts >= 1 && m % parts == 0, name << ": a's " << m << " rows do not split "
                                                      << "evenly over " << parts << " devices");
  MESHLA_CHECK(kNotImplemented, m >= n,
               name << ": a is [" << m << ", " << n << "], wider than tall; the QR-based "
                    << "routines take m >= n (wide matrices are not supported yet)");
  MESHLA_CHECK_ARG(nrhs >= 0, name << ": nrhs=" << nrhs << " right-hand sides");
}

void check_rhs_block(std::string_view name, std::string_view b,
                     const std::vector<std::int64_t>& b_shape, DType b_dtype, std::int64_t a_rows,
                     DType a_dtype, bool vector_ok) {
  const bool fits = (b_shape.size() == 2 || (vector_ok && b_shape.size() == 1)) &&
                    b_shape[0] == a_rows && b_dtype == a_dtype;
  if (fits) return;
  std::ostringstream shape;
  shape << "[";
  for (std::size_t dim = 0; dim < b_shape.size(); ++dim) shape << (dim ? ", " : "") << b_shape[dim];
  shape << "]";
  const std::string rows = std::to_string(a_rows);
  MESHLA_THROW(kInvalidArgument,
               name << ": " << b << " is " << shape.str() << " " << dtype_name(b_dtype)
                    << "; expected " << (vector_ok ? "[" + rows + "] or " : "") << "[" << rows
                    << ", nrhs] " << dtype_name(a_dtype) << ": a's rows and dtype");
}

BlockCyclicLayout solver_layout(SolverOp op, std::int64_t n, std::int64_t parts,
                                std::int64_t tile) {
  const bool eigen = op == SolverOp::kEigen || op == SolverOp::kEigenvalues;
  // One GPU runs cusolverDn's syevd or getrf on the whole matrix (dense_solver.cpp): the
  // eigensolver takes any tile, by default one, so that nothing is padded; the LU solve always
  // one (a tile would only pad it).
  if (eigen && parts == 1) return make_block_cyclic_layout(n, parts, tile, n);
  if (op == SolverOp::kLuSolve && parts == 1) {
    make_block_cyclic_layout(n, 1, tile, n);  // the arguments' checks (a negative tile, say)
    return make_block_cyclic_layout(n, 1, n, n);
  }
  // cuSolverMg's syevd and getrf refuse tiles past theirs (CUSOLVER_STATUS_INVALID_VALUE).
  const bool lu = op == SolverOp::kLuSolve;
  const std::int64_t largest =
      eigen ? kLargestEigenTile : (lu ? kLargestLuTile : kLargestCholeskyTile);
  MESHLA_CHECK_ARG(!(eigen || lu) || tile <= largest,
                   solver_op_name(op) << ": tile=" << tile << " exceeds " << largest
                                      << ", the largest tile cuSolverMg's "
                                      << (lu ? "getrf" : "syevd") << " takes (0: meshla's choice)");
  BlockCyclicLayout layout = make_block_cyclic_layout(n, parts, tile, largest);
  if (op != SolverOp::kCholeskyInverse) return layout;
  // The inverse runs cusolverDn's potri on the first GPU (dense_solver.cpp: cuSolverMg's is wrong
  // on several GPUs), whose sizes are 32-bit: it refused n=49152 (CUSOLVER_STATUS_INVALID_VALUE).
  // Where meshla's own tile pads past that and n itself fits, one unpadded tile a GPU.
  const auto fits = [](std::int64_t order) { return order * order <= kLargestInverseElements; };
  if (tile == 0 && !fits(layout.padded_n()) && fits(n)) {
    layout = make_block_cyclic_layout(n, parts, n / parts, n / parts);
  }
  MESHLA_CHECK(kNotImplemented, fits(layout.padded_n()),
               "cholesky_inverse: n=" << n << " (padded to " << layout.padded_n() << " for tile="
                                      << layout.tile << ") has more than 2^31 - 1 elements, the "
                                      << "most cusolverDn's potri takes (n <= 46340, padding "
                                         "included)");
  return layout;
}

BlockCyclicLayout check_solver_call(SolverOp op, const SolverProblem& problem, std::int64_t parts) {
  check_solver_problem(op, problem);
  MESHLA_CHECK(kNotImplemented, !problem.overwrite_a || op != SolverOp::kLuSolve || parts == 1,
               "lu_solve: overwrite_a on " << parts
                                           << " GPUs: cuSolverMg factors A's columns, "
                                              "which each GPU reads from the others' row blocks "
                                              "into a working copy; pass overwrite_a=False");
  const BlockCyclicLayout layout = solver_layout(op, problem.n, parts, problem.tile);
  MESHLA_CHECK_ARG(!problem.overwrite_a || !layout.padded(),
                   solver_op_name(op) << ": overwrite_a needs n/GPUs = " << problem.n << "/"
                                      << parts << " to be a multiple of the tile (" << layout.tile
                                      << "); pass tile= a divisor of it");
  return layout;
}

void check_solver_shard(SolverOp op, const SolverProblem& problem, const BlockCyclicLayout& layout,
                        int parts, int part, int device, const SolverShard& shard,
                        std::size_t workspace_bytes) {
  const std::string_view name = solver_op_name(op);
  const std::int64_t rows = layout.rows_per_part;
  auto check = [&](const TensorView& view, const char* what, DType dtype,
                   std::initializer_list<std::int64_t> shape) {
    MESHLA_CHECK_ARG(view.data != nullptr, name << ": shard " << part << " has no " << what);
    MESHLA_CHECK_ARG(view.device_kind == DeviceKind::kCuda && view.device == device,
                     name << ": " << what << " of shard " << part << " is not on cuda:" << device);
    MESHLA_CHECK_ARG(view.dtype == dtype, name << ": " << what << " of shard " << part << " is "
                                               << dtype_name(view.dtype) << ", expected "
                                               << dtype_name(dtype));
    bool same = view.ndim == static_cast<int>(shape.size());
    int dim = 0;
    for (std::int64_t extent : shape) same = same && view.shape[dim++] == extent;
    std::ostringstream expected;
    expected << "[";
    const char* separator = "";
    for (std::int64_t extent : shape) {
      expected << separator << extent;
      separator = ", ";
    }
    expected << "]";
    MESHLA_CHECK_ARG(same, name << ": " << what << " of shard " << part << " has shape "
                                << view.shape_string() << ", expected " << expected.str()
                                << " (n=" << layout.n << " over " << parts << " GPUs)");
    MESHLA_CHECK_ARG(view.is_row_major_contiguous(),
                     name << ": " << what << " of shard " << part << " is not contiguous");
  };
  check(shard.a, "a", problem.dtype, {rows, layout.n});
  switch (op) {
    case SolverOp::kLuSolve:
    case SolverOp::kCholeskySolve:
      check(shard.b, "b", problem.dtype, {rows, problem.nrhs});
      check(shard.out, "out", problem.dtype, {rows, problem.nrhs});
      if (op == SolverOp::kCholeskySolve && shard.logdet.data != nullptr) {
        check(shard.logdet, "logdet", real_dtype(problem.dtype), {});
      }
      break;
    case SolverOp::kCholeskyInverse:
      check(shard.out, "out", problem.dtype, {rows, layout.n});
      MESHLA_CHECK_ARG(shard.out.data != shard.a.data || problem.overwrite_a,
                       name << ": out of shard " << part << " is a; that needs overwrite_a=true");
      break;
    case SolverOp::kEigen:
      check(shard.out, "out", problem.dtype, {rows, layout.n});
      MESHLA_CHECK_ARG(shard.out.data != shard.a.data, name << ": the eigenvectors (out) of shard "
                                                            << part << " cannot be written over a");
      [[fallthrough]];
    case SolverOp::kEigenvalues:
      if (shard.eigenvalues.data != nullptr) {
        check(shard.eigenvalues, "eigenvalues", real_dtype(problem.dtype), {layout.n});
      }
      break;
  }
  if (shard.info.data != nullptr) check(shard.info, "info", DType::kInt32, {});
  MESHLA_CHECK_ARG(shard.workspace.data != nullptr &&
                       shard.workspace.device_kind == DeviceKind::kCuda &&
                       shard.workspace.device == device,
                   name << ": shard " << part << " has no workspace on cuda:" << device);
  const std::size_t bytes =
      static_cast<std::size_t>(shard.workspace.numel()) * dtype_size(shard.workspace.dtype);
  MESHLA_CHECK_ARG(bytes >= workspace_bytes, name << ": workspace of shard " << part << " has "
                                                  << bytes << " bytes, workspace_bytes() asks "
                                                  << workspace_bytes);
  MESHLA_CHECK_ARG(reinterpret_cast<std::uintptr_t>(shard.workspace.data) % 256 == 0,
                   name << ": workspace of shard " << part << " is not 256-byte aligned");
}

void check_solver_shards(SolverOp op, const SolverProblem& problem, const BlockCyclicLayout& layout,
                         const std::vector<int>& devices, const std::vector<SolverShard>& shards,
                         const std::vector<std::size_t>& workspace_bytes) {
  const int parts = static_cast<int>(devices.size());
  MESHLA_CHECK_ARG(static_cast<int>(shards.size()) == parts,
                   solver_op_name(op) << ": " << shards.size() << " shards for a solver over "
                                      << parts << " GPUs");
  for (int part = 0; part < parts; ++part) {
    check_solver_shard(op, problem, layout, parts, part, devices[part], shards[part],
                       workspace_bytes[part]);
  }
}

}  // namespace meshla::solver
