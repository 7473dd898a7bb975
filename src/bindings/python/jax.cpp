// The XLA FFI handlers' targets and the JAX front end's groups (bindings/jax/), for meshla.jax.
// Built only with jaxlib's FFI headers; without them the module says so (with_jax).
#include <nanobind/stl/string.h>

#include <string>

#include "bindings/python/bindings.hpp"
#ifdef MESHLA_WITH_JAX
#include "bindings/jax/collective.hpp"
#include "bindings/jax/grouped.hpp"
#include "bindings/jax/matmul.hpp"
#include "bindings/jax/solver.hpp"
#endif

using namespace nanobind::literals;

namespace meshla::bindings {

void bind_jax(nb::module_& m) {
#ifdef MESHLA_WITH_JAX
  m.def(
      "jax_ffi_targets",
      [] {
        nb::dict targets;
        for (const auto& [name, handler] : jax_ffi::targets()) {
          targets[nb::str(name.c_str())] = nb::capsule(handler);
        }
        for (const auto& [name, handler] : jax_ffi::grouped_targets()) {
          targets[nb::str(name.c_str())] = nb::capsule(handler);
        }
        for (const auto& [name, handler] : jax_ffi::matmul_targets()) {
          targets[nb::str(name.c_str())] = nb::capsule(handler);
        }
        for (const auto& [name, stages] : jax_ffi::collective_targets()) {
          nb::dict by_stage;
          for (const auto& [stage, handler] : stages) {
            by_stage[nb::str(stage.c_str())] = nb::capsule(handler);
          }
          targets[nb::str(name.c_str())] = by_stage;
        }
        return targets;
      },
      "XLA FFI handlers by target name (a capsule, or a dict of them by stage), for the CUDA "
      "platform.");
  m.def("register_jax_group", &jax_ffi::register_group, "group"_a, "comm"_a,
        "Registers `comm` as its GPU's part of meshla.jax's tensor-parallel group `group`.");
  m.def(
      "register_jax_process_solver",
      [](std::int64_t group, const Communicator& comm) {
        nb::gil_scoped_release release;
        jax_ffi::register_process_solver(group, comm);
      },
      "group"_a, "comm"_a,
      "Makes `comm`'s GPU's cuSOLVERMp solver in meshla.jax's solver group `group` (collective "
      "over the communicator's ranks).");
  m.def(
      "release_jax",
      [] {
        nb::gil_scoped_release release;
        jax_ffi::release_groups();
        jax_ffi::release_solvers();
        jax_ffi::release_grouped();
        jax_ffi::release_matmuls();
      },
      "Lets go of the JAX handlers' groups, plans, DenseSolvers, ProcessSolvers, GroupedMatmuls "
      "and Matmuls (at interpreter exit).");
  m.attr("with_jax") = true;
#else
  m.attr("with_jax") = false;
#endif
}

}  // namespace meshla::bindings
