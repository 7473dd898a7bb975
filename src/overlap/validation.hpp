// Host-side checks of a collective matmul's config and arguments. Pure functions, so CI tests
// every message on the CPU.
#pragma once

#include "meshla/collective_matmul.hpp"

namespace meshla::overlap {

// Checks the config against the group size and resolves every kAuto and chunks == 0, given
// whether the group's ranks map each other's memory (detail::enable_peer_access; false when
// the caller did not ask). Throws kInvalidArgument or kNotImplemented with a message that names
// the op and the shapes.
CollectiveMatmulConfig resolve_config(const CollectiveMatmulConfig& config, int tp,
                                      bool peer_access = false);

// Checks one call's arrays against a resolved config on the plan's device.
void validate_args(const CollectiveMatmulConfig& config, int tp, int device,
                   const CollectiveMatmulArgs& args);

}  // namespace meshla::overlap
