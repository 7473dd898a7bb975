// Host-side checks of a collective matmul's config and arguments. Pure functions, so CI tests
// every message on the CPU.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "meshla/collective_matmul.hpp"

namespace meshla::collective {

// How the group's ranks reach each other's memory (detail::ask_for_peer_access), as far as the
// backend choice goes: the symmetric backend runs where the memory is mapped, and is chosen
// automatically only where every pair of GPUs is linked by NVLink (trivially so for one rank).
enum class PeerReach { kNone, kMapped, kNvlink };

// Checks the config against the group size and resolves every kAuto and chunks == 0, given how
// the group's ranks reach each other's memory (kNone when the caller did not ask). Throws
// kInvalidArgument or kNotImplemented with a message that names the op and the shapes.
CollectiveMatmulConfig resolve_config(const CollectiveMatmulConfig& config, int tp,
                                      PeerReach reach = PeerReach::kNone);

// What resolve_config refuses of `config` whatever the group's hardware: resolved as on a group
// whose ranks map each other's memory where the backend is symmetric, and as on a group without
// NVLink otherwise (auto then resolves to nccl; on NVLink it may pick symmetric, whose shape rules
// it only takes where they hold, else nccl's). What describe_call applies before any plan exists.
void check_request(const CollectiveMatmulConfig& config, int tp);

// Checks one call's arrays against a resolved config on the plan's device.
void validate_args(const CollectiveMatmulConfig& config, int tp, int device,
                   const CollectiveMatmulArgs& args);

// Checks an all_gather plan's config: positive rows and cols, a dtype of the collective matmuls.
void check_all_gather_config(const AllGatherConfig& config);

// Checks one all_gather's arrays: `rows` [rows, cols], `gathered` [tp * rows, cols], on the
// plan's device and dtype, contiguous, not overlapping.
void validate_all_gather(const AllGatherConfig& config, int tp, int device, const TensorView& rows,
                         const TensorView& gathered);

// A config as the group's ranks exchange it to check that they agree: every field, in a record
// without padding bytes (a struct's padding would differ between ranks that agree).
enum ConfigField : std::size_t {
  kFieldOp,
  kFieldAlgorithm,
  kFieldBackend,
  kFieldDtype,
  kFieldM,
  kFieldN,
  kFieldK,
  kFieldTransB,
  kFieldBias,
  kFieldReturnGathered,
  kFieldChunks,
  kFieldCommSms,
  kFieldCommCtas,
  kFieldBDtype,    // -1: unset (a's)
  kFieldOutDtype,  // -1: unset (a's)
  kFieldScaling,
  kConfigFields
};
using ConfigRecord = std::array<std::int64_t, kConfigFields>;
ConfigRecord config_record(const CollectiveMatmulConfig& config);

// Throws kInvalidArgument, naming the ranks and the fields that differ, unless every rank's
// record (records[rank], gathered from the whole group) equals this rank's. A group whose ranks
// build different plans would write at offsets their peers do not expect, or wait forever for
// data that never comes; every rank gets the same records, so every rank throws.
void require_same_config(const std::vector<ConfigRecord>& records, int rank);

}  // namespace meshla::collective
