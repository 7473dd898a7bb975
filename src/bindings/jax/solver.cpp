#include "bindings/jax/solver.hpp"

#include <chrono>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>

#include "bindings/jax/ffi_common.hpp"
#include "core/alignment.hpp"
#include "core/checks.hpp"
#include "core/timeout.hpp"
#include "meshla/dense_solver.hpp"
#include "meshla/process_solver.hpp"
#include "solver/rendezvous.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace meshla::jax_ffi {
namespace {

// The DenseSolvers of this process, one per ordered list of CUDA ordinals (the registry's key).
// Created by the first call on a list, kept for the process (a cuSolverMg handle costs tens of
// milliseconds), destroyed by release_solvers() at interpreter exit.
class SolverRegistry {
 public:
  std::shared_ptr<DenseSolver> get(const std::vector<int>& devices) {
    std::lock_guard lock(mutex_);
    auto& solver = solvers_[devices];
    if (!solver) solver = std::make_shared<DenseSolver>(devices);
    return solver;
  }
  void clear() {
    std::lock_guard lock(mutex_);
    solvers_.clear();
  }

 private:
  std::mutex mutex_;
  std::map<std::vector<int>, std::shared_ptr<DenseSolver>> solvers_;
};

SolverRegistry& solvers() {
  static SolverRegistry registry;
  return registry;
}

// The ProcessSolvers of this process by (group, CUDA ordinal): a mesh axis's groups with one GPU
// in each process, registered by meshla.jax when it traces a call with engine="cusolvermp"
// (making each is collective over its group's processes).
GroupParts<ProcessSolver>& process_solvers() {
  static GroupParts<ProcessSolver> registry("solver group");
  return registry;
}

// Call numbers of this process's solver handlers (see solver::CallNumbering).
solver::CallNumbering& call_numbering() {
  static solver::CallNumbering numbering;
  return numbering;
}

// `bytes` of XLA's scratch on `ordinal`, aligned to 256 bytes as the solvers want (XLA aligns
// scratch to at most 16).
TensorView workspace_from(ffi::ScratchAllocator& scratch, std::size_t bytes, int ordinal,
                          const char* name) {
  const std::optional<void*> memory = scratch.Allocate(bytes + detail::kWorkspaceAlignment, 16);
  MESHLA_CHECK(
      kCuda, memory.has_value(),
      name << ": XLA could not allocate " << bytes << " bytes of workspace on cuda:" << ordinal);
  void* aligned =
      reinterpret_cast<void*>(detail::align_up(reinterpret_cast<std::uintptr_t>(*memory)));
  return make_tensor_view(aligned, DType::kInt32, {static_cast<std::int64_t>(bytes / 4)}, ordinal);
}

// One GPU's part of a call: allocate its workspace from XLA, meet the other GPUs of its group;
// the first GPU's thread runs the call for all of them. A GPU whose preparation fails says so to
// the meeting, which would otherwise keep the others waiting for it until their timeout.
void participate(SolverOp op, const SolverProblem& problem, SolverShard shard, int ordinal,
                 ffi::ScratchAllocator& scratch, std::int64_t run_id,
                 ffi::Span<const std::int64_t> devices, std::int64_t group_size, double timeout_s) {
  const char* name = solver_op_name(op).data();
  const std::chrono::milliseconds timeout = detail::timeout_from_seconds(timeout_s);
  const solver::DeviceGroup group = solver::find_device_group(
      std::vector<std::int64_t>(devices.begin(), devices.end()), group_size, ordinal, name);
  const int count = static_cast<int>(group.devices.size());
  // Calls are numbered per op and GPUs within each run; a meeting is one call of one run.
  std::ostringstream calls;
  calls << name << "/cuda";
  for (int device : group.devices) calls << ":" << device;
  const solver::MeetingId id{calls.str() + "/run " + std::to_string(run_id),
                             call_numbering().next(calls.str(), group.index, run_id)};
  std::shared_ptr<DenseSolver> solver;
  try {
    solver = solvers().get(group.devices);
    shard.workspace =
        workspace_from(scratch, solver->workspace_bytes(op, problem, group.index), ordinal, name);
  } catch (const Error& error) {
    solver::abandon(id, group.index, count, error);
    throw;
  } catch (const std::exception& error) {
    solver::abandon(id, group.index, count, Error(ErrorCode::kInternal, error.what()));
    throw;
  }
  solver::meet(
      id, group.index, count, &shard,
      [&](const std::vector<void*>& values) {
        std::vector<SolverShard> shards;
        for (void* value : values) shards.push_back(*static_cast<SolverShard*>(value));
        solver->run(op, problem, shards);
      },
      timeout);
}

SolverShard shard_on(cudaStream_t stream, int ordinal, const ffi::AnyBuffer& a,
                     ffi::Result<ffi::Buffer<ffi::S32>>& info) {
  SolverShard shard;
  shard.stream = stream;
  shard.a = view_of(a, ordinal, "a");
  shard.info = make_tensor_view(info->untyped_data(), DType::kInt32, {}, ordinal);
  return shard;
}

// A right-hand-side solve's shard (A, B, X, info) and problem, for either engine; the Cholesky
// solve adds log det A's output.
std::pair<SolverShard, SolverProblem> rhs_solve_call(cudaStream_t stream, int ordinal,
                                                     const ffi::AnyBuffer& a,
                                                     const ffi::AnyBuffer& b,
                                                     ffi::Result<ffi::AnyBuffer>& x,
                                                     ffi::Result<ffi::Buffer<ffi::S32>>& info,
                                                     std::int64_t tile, bool overwrite_a) {
  SolverShard shard = shard_on(stream, ordinal, a, info);
  shard.b = view_of(b, ordinal, "b");
  shard.out = view_of(*x, ordinal, "x");
  const SolverProblem problem{.n = a.dimensions().back(),
                              .dtype = shard.a.dtype,
                              .nrhs = b.dimensions().back(),
                              .tile = tile,
                              .overwrite_a = overwrite_a};
  return {shard, problem};
}

// This process's rank of a call on cuSOLVERMp (engine="cusolvermp"): its group's ProcessSolver
// on this GPU, its workspace from XLA. No rendezvous: one GPU a process, and the solver's own
// collectives are the meeting.
void run_on_process_solver(SolverOp op, std::int64_t group, int ordinal,
                           ffi::ScratchAllocator& scratch, SolverShard shard,
                           const SolverProblem& problem) {
  const std::shared_ptr<ProcessSolver> solver =
      process_solvers().find(group, ordinal, solver_op_name(op));
  // A workspace XLA could not give still goes into the run, which the ranks start only once
  // every one of them can (without it the others would wait in the first collective); this
  // rank then raises the allocation's error.
  std::optional<Error> allocation;
  try {
    shard.workspace = workspace_from(scratch, solver->workspace_bytes(op, problem), ordinal,
                                     solver_op_name(op).data());
  } catch (const Error& error) {
    allocation = error;
  }
  try {
    solver->run(op, problem, shard);
  } catch (const Error&) {
    if (allocation) throw *allocation;
    throw;
  }
}

// `working` is the output XLA aliases to `a` when the caller lets the solver work in A's buffer
// (a zero-size placeholder otherwise: then n/P needs padding and the solver works in scratch).
bool works_in_a(const ffi::AnyBuffer& a, const ffi::AnyBuffer& working) {
  return working.element_count() > 0 && working.untyped_data() == a.untyped_data();
}

}  // namespace

ffi::Error cholesky_solve(cudaStream_t stream, std::int32_t ordinal, ffi::ScratchAllocator scratch,
                          ffi::RunId run_id, ffi::AnyBuffer a, ffi::AnyBuffer b,
                          ffi::Result<ffi::AnyBuffer> x, ffi::Result<ffi::AnyBuffer> logdet,
                          ffi::Result<ffi::Buffer<ffi::S32>> info,
                          ffi::Result<ffi::AnyBuffer> working,
                          ffi::Span<const std::int64_t> devices, std::int64_t group_size,
                          std::int64_t tile, double timeout_s) {
  return guarded([&] {
    auto [shard, problem] =
        rhs_solve_call(stream, ordinal, a, b, x, info, tile, works_in_a(a, *working));
    shard.logdet = view_of(*logdet, ordinal, "logdet");
    participate(SolverOp::kCholeskySolve, problem, shard, ordinal, scratch, run_id.run_id, devices,
                group_size, timeout_s);
  });
}

ffi::Error process_cholesky_solve(cudaStream_t stream, std::int32_t ordinal,
                                  ffi::ScratchAllocator scratch, ffi::AnyBuffer a, ffi::AnyBuffer b,
                                  ffi::Result<ffi::AnyBuffer> x, ffi::Result<ffi::AnyBuffer> logdet,
                                  ffi::Result<ffi::Buffer<ffi::S32>> info, std::int64_t group,
                                  std::int64_t tile) {
  return guarded([&] {
    auto [shard, problem] = rhs_solve_call(stream, ordinal, a, b, x, info, tile, false);
    shard.logdet = view_of(*logdet, ordinal, "logdet");
    run_on_process_solver(SolverOp::kCholeskySolve, group, ordinal, scratch, shard, problem);
  });
}

ffi::Error process_lu_solve(cudaStream_t stream, std::int32_t ordinal,
                            ffi::ScratchAllocator scratch, ffi::AnyBuffer a, ffi::AnyBuffer b,
                            ffi::Result<ffi::AnyBuffer> x, ffi::Result<ffi::Buffer<ffi::S32>> info,
                            std::int64_t group, std::int64_t tile) {
  return guarded([&] {
    const auto [shard, problem] = rhs_solve_call(stream, ordinal, a, b, x, info, tile, false);
    run_on_process_solver(SolverOp::kLuSolve, group, ordinal, scratch, shard, problem);
  });
}

ffi::Error lu_solve(cudaStream_t stream, std::int32_t ordinal, ffi::ScratchAllocator scratch,
                    ffi::RunId run_id, ffi::AnyBuffer a, ffi::AnyBuffer b,
                    ffi::Result<ffi::AnyBuffer> x, ffi::Result<ffi::Buffer<ffi::S32>> info,
                    ffi::Result<ffi::AnyBuffer> working, ffi::Span<const std::int64_t> devices,
                    std::int64_t group_size, std::int64_t tile, double timeout_s) {
  return guarded([&] {
    const auto [shard, problem] =
        rhs_solve_call(stream, ordinal, a, b, x, info, tile, works_in_a(a, *working));
    participate(SolverOp::kLuSolve, problem, shard, ordinal, scratch, run_id.run_id, devices,
                group_size, timeout_s);
  });
}

ffi::Error cholesky_inverse(cudaStream_t stream, std::int32_t ordinal,
                            ffi::ScratchAllocator scratch, ffi::RunId run_id, ffi::AnyBuffer a,
                            ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::Buffer<ffi::S32>> info,
                            ffi::Span<const std::int64_t> devices, std::int64_t group_size,
                            std::int64_t tile, double timeout_s) {
  return guarded([&] {
    SolverShard shard = shard_on(stream, ordinal, a, info);
    shard.out = view_of(*out, ordinal, "out");
    const SolverProblem problem{.n = a.dimensions().back(),
                                .dtype = shard.a.dtype,
                                .tile = tile,
                                .overwrite_a = out->untyped_data() == a.untyped_data()};
    participate(SolverOp::kCholeskyInverse, problem, shard, ordinal, scratch, run_id.run_id,
                devices, group_size, timeout_s);
  });
}

ffi::Error eigh(cudaStream_t stream, std::int32_t ordinal, ffi::ScratchAllocator scratch,
                ffi::RunId run_id, ffi::AnyBuffer a, ffi::Result<ffi::AnyBuffer> eigenvalues,
                ffi::Result<ffi::AnyBuffer> vectors, ffi::Result<ffi::Buffer<ffi::S32>> info,
                ffi::Result<ffi::AnyBuffer> working, ffi::Span<const std::int64_t> devices,
                std::int64_t group_size, std::int64_t tile, double timeout_s) {
  return guarded([&] {
    SolverShard shard = shard_on(stream, ordinal, a, info);
    shard.eigenvalues = view_of(*eigenvalues, ordinal, "eigenvalues");
    shard.out = view_of(*vectors, ordinal, "eigenvectors");
    const SolverProblem problem{.n = a.dimensions().back(),
                                .dtype = shard.a.dtype,
                                .tile = tile,
                                .overwrite_a = works_in_a(a, *working)};
    participate(SolverOp::kEigen, problem, shard, ordinal, scratch, run_id.run_id, devices,
                group_size, timeout_s);
  });
}

ffi::Error eigvalsh(cudaStream_t stream, std::int32_t ordinal, ffi::ScratchAllocator scratch,
                    ffi::RunId run_id, ffi::AnyBuffer a, ffi::Result<ffi::AnyBuffer> eigenvalues,
                    ffi::Result<ffi::Buffer<ffi::S32>> info, ffi::Result<ffi::AnyBuffer> working,
                    ffi::Span<const std::int64_t> devices, std::int64_t group_size,
                    std::int64_t tile, double timeout_s) {
  return guarded([&] {
    SolverShard shard = shard_on(stream, ordinal, a, info);
    shard.eigenvalues = view_of(*eigenvalues, ordinal, "eigenvalues");
    const SolverProblem problem{.n = a.dimensions().back(),
                                .dtype = shard.a.dtype,
                                .tile = tile,
                                .overwrite_a = works_in_a(a, *working)};
    participate(SolverOp::kEigenvalues, problem, shard, ordinal, scratch, run_id.run_id, devices,
                group_size, timeout_s);
  });
}

// Every handler: the caller's stream, its GPU, XLA's allocator and the run id, then buffers, then
// the mesh (devices, group_size), the tile (0: automatic) and the rendezvous timeout.
#define MESHLA_SOLVER_CONTEXT()                 \
  ffi::Ffi::Bind()                              \
      .Ctx<ffi::PlatformStream<cudaStream_t>>() \
      .Ctx<ffi::DeviceOrdinal>()                \
      .Ctx<ffi::ScratchAllocator>()             \
      .Ctx<ffi::RunId>()
#define MESHLA_SOLVER_ATTRIBUTES(binding)                \
  binding.Attr<ffi::Span<const std::int64_t>>("devices") \
      .Attr<std::int64_t>("group_size")                  \
      .Attr<std::int64_t>("tile")                        \
      .Attr<double>("timeout_s")

XLA_FFI_DEFINE_HANDLER_SYMBOL(meshla_cholesky_solve, cholesky_solve,
                              MESHLA_SOLVER_ATTRIBUTES(MESHLA_SOLVER_CONTEXT()
                                                           .Arg<ffi::AnyBuffer>()
                                                           .Arg<ffi::AnyBuffer>()
                                                           .Ret<ffi::AnyBuffer>()
                                                           .Ret<ffi::AnyBuffer>()
                                                           .Ret<ffi::Buffer<ffi::S32>>()
                                                           .Ret<ffi::AnyBuffer>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(meshla_lu_solve, lu_solve,
                              MESHLA_SOLVER_ATTRIBUTES(MESHLA_SOLVER_CONTEXT()
                                                           .Arg<ffi::AnyBuffer>()
                                                           .Arg<ffi::AnyBuffer>()
                                                           .Ret<ffi::AnyBuffer>()
                                                           .Ret<ffi::Buffer<ffi::S32>>()
                                                           .Ret<ffi::AnyBuffer>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(meshla_cholesky_inverse, cholesky_inverse,
                              MESHLA_SOLVER_ATTRIBUTES(MESHLA_SOLVER_CONTEXT()
                                                           .Arg<ffi::AnyBuffer>()
                                                           .Ret<ffi::AnyBuffer>()
                                                           .Ret<ffi::Buffer<ffi::S32>>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(meshla_eigh, eigh,
                              MESHLA_SOLVER_ATTRIBUTES(MESHLA_SOLVER_CONTEXT()
                                                           .Arg<ffi::AnyBuffer>()
                                                           .Ret<ffi::AnyBuffer>()
                                                           .Ret<ffi::AnyBuffer>()
                                                           .Ret<ffi::Buffer<ffi::S32>>()
                                                           .Ret<ffi::AnyBuffer>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(meshla_eigvalsh, eigvalsh,
                              MESHLA_SOLVER_ATTRIBUTES(MESHLA_SOLVER_CONTEXT()
                                                           .Arg<ffi::AnyBuffer>()
                                                           .Ret<ffi::AnyBuffer>()
                                                           .Ret<ffi::Buffer<ffi::S32>>()
                                                           .Ret<ffi::AnyBuffer>()));

// The engine="cusolvermp" handlers: the caller's stream, its GPU and XLA's allocator, then A and
// B, then the outputs, then the solver group and the tile (0: the engine's choice).
#define MESHLA_PROCESS_SOLVER(outputs)                           \
  ffi::Ffi::Bind()                                               \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()                  \
      .Ctx<ffi::DeviceOrdinal>()                                 \
      .Ctx<ffi::ScratchAllocator>()                              \
      .Arg<ffi::AnyBuffer>()                                     \
      .Arg<ffi::AnyBuffer>() outputs.Attr<std::int64_t>("group") \
      .Attr<std::int64_t>("tile")

XLA_FFI_DEFINE_HANDLER_SYMBOL(meshla_process_cholesky_solve, process_cholesky_solve,
                              MESHLA_PROCESS_SOLVER(.Ret<ffi::AnyBuffer>()
                                                        .Ret<ffi::AnyBuffer>()
                                                        .Ret<ffi::Buffer<ffi::S32>>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    meshla_process_lu_solve, process_lu_solve,
    MESHLA_PROCESS_SOLVER(.Ret<ffi::AnyBuffer>().Ret<ffi::Buffer<ffi::S32>>()));

std::vector<std::pair<std::string, void*>> targets() {
  return {
      {"meshla_cholesky_solve", reinterpret_cast<void*>(&meshla_cholesky_solve)},
      {"meshla_lu_solve", reinterpret_cast<void*>(&meshla_lu_solve)},
      {"meshla_cholesky_inverse", reinterpret_cast<void*>(&meshla_cholesky_inverse)},
      {"meshla_eigh", reinterpret_cast<void*>(&meshla_eigh)},
      {"meshla_eigvalsh", reinterpret_cast<void*>(&meshla_eigvalsh)},
      {"meshla_process_cholesky_solve", reinterpret_cast<void*>(&meshla_process_cholesky_solve)},
      {"meshla_process_lu_solve", reinterpret_cast<void*>(&meshla_process_lu_solve)}};
}

void register_process_solver(std::int64_t group, const Communicator& comm) {
  process_solvers().add(group, comm.device(), std::make_shared<ProcessSolver>(comm));
}

void release_solvers() {
  solvers().clear();
  process_solvers().clear();
}

}  // namespace meshla::jax_ffi
