// A timeout a caller gives in seconds (the Python front ends' timeout_s), as the milliseconds
// meshla's waits take. Pure host code, CPU-tested.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>

#include "core/checks.hpp"

namespace meshla::detail {

// Positive, finite and at most 30 days: a larger one (1e10 s, or infinity, whose cast to an
// integer is undefined) overflowed the deadline, now() + timeout, which then lay in the past.
inline std::chrono::milliseconds timeout_from_seconds(double seconds) {
  constexpr double kLongest = 30.0 * 24 * 3600;
  MESHLA_CHECK_ARG(
      std::isfinite(seconds) && seconds > 0 && seconds <= kLongest,
      "timeout_s=" << seconds << " must be positive and at most " << kLongest << " (30 days)");
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(seconds * 1000.0)));
}

}  // namespace meshla::detail
