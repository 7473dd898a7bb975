// The Python extension _meshla: the communicator, the process's runtime, and each pillar's
// bindings (collective.cpp, grouped.cpp, solver.cpp). meshla::Error leaves as the matching Python
// exception.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <string>

#include "bindings/python/bindings.hpp"
#include "core/checks.hpp"
#include "core/timeout.hpp"
#include "meshla/communicator.hpp"
#include "meshla/error.hpp"
#include "runtime/releases.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace meshla::bindings {
namespace {

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

}  // namespace
}  // namespace meshla::bindings

NB_MODULE(_meshla, m) {
  using namespace meshla;
  bindings::translate_errors();

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
  bindings::bind_arrays(m);
  bindings::bind_collective(m);
  bindings::bind_grouped(m);
  bindings::bind_matmul(m);
  bindings::bind_solver(m);
  bindings::bind_jax(m);
}
