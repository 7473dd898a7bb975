// Rendezvous of the host threads that drive the GPUs of one process for one collective call.
//
// Under jax.jit + shard_map with one process driving several GPUs, XLA calls an FFI handler once
// per GPU, each on its own thread, each seeing only its own shard; cuSolverMg must be called from
// ONE thread holding every GPU's pointer. meet() bridges the two: the threads of one call meet,
// publish one value each (a shard pointer) in a table owned by that call, participant 0 runs the
// work with the whole table while the others wait, and what the work throws reaches every
// participant. Meetings live in this process only (no shared memory, no files) and are removed
// when their call ends, so nothing leaks between calls or between jobs on one machine. Exported
// for the JAX bindings (MESHLA_API), whose handlers are those threads.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "meshla/error.hpp"
#include "meshla/export.hpp"

namespace meshla::solver {

struct MeetingId {
  std::string key;           // names the mesh and the operation, e.g. "potrf/mesh-7f3a"
  std::uint64_t generation;  // the call's number; every participant counts its calls of `key`
};

// Participant `index` of `count` arrives at meeting `id` with `value`. Participant 0 runs
// `leader_work` once every participant has arrived, with the values in participant order; the
// others wait for it. Every participant returns when the work is done, and throws a meshla::Error
// with the code and message of what the work threw (kInternal for other exception types).
// Arrival is bounded by `timeout`: past it every waiting participant throws kTimeout naming the
// participants that did not arrive, and so does each of them when it comes. The work is not:
// it uses every participant's value (their buffers), so the others wait for it to end however
// long it takes, saying so on stderr once `timeout` has passed; returning earlier would let
// their callers free memory the work still writes.
MESHLA_API void meet(const MeetingId& id, int index, int count, void* value,
                     const std::function<void(const std::vector<void*>& values)>& leader_work,
                     std::chrono::milliseconds timeout);

// Participant `index` of `count` cannot take part: its own preparation failed with `error`
// before it could arrive. The meeting fails with that error, so that the others, already there
// or still to come, throw it at once instead of waiting for this participant until their timeout.
MESHLA_API void abandon(const MeetingId& id, int index, int count, const Error& error);

// Meetings currently open in this process (for tests: zero once every call has returned).
std::size_t open_meetings();

// The GPUs one call meets over, and this GPU's place among them. `mesh` lists the CUDA ordinals
// of every group of a mesh, group after group, `group_size` each; `device` must be in it.
struct DeviceGroup {
  std::vector<int> devices;
  int index = -1;
};
MESHLA_API DeviceGroup find_device_group(const std::vector<std::int64_t>& mesh,
                                         std::int64_t group_size, int device,
                                         std::string_view what);

// Numbers the calls each participant makes to one key within one run of a program (an XLA
// execution), so that the n-th call on one GPU meets the n-th on the others
// (MeetingId::generation). Runs may overlap, so each keeps its own count; only the kRunsKept
// runs of a key and participant used last are kept, so that a program that runs a million
// times does not keep a million counts.
class MESHLA_API CallNumbering {
 public:
  static constexpr std::size_t kRunsKept = 64;

  std::uint64_t next(const std::string& key, int participant, std::int64_t run_id);

  // Runs counted for `key` and `participant` (for tests).
  std::size_t runs_kept(const std::string& key, int participant);

 private:
  struct Count {
    std::uint64_t calls = 0;
    std::uint64_t last_use = 0;
  };
  std::mutex mutex_;
  std::uint64_t uses_ = 0;
  std::map<std::pair<std::string, int>, std::map<std::int64_t, Count>> counts_;
};

}  // namespace meshla::solver
