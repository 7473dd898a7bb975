// Argument checks and throws that build their message with stream syntax:
//   MESHLA_CHECK_ARG(m % tp == 0, "all_gather_matmul: m=" << m << " is not divisible by ...");
// Pure host code: no CUDA header, so pure host logic (schedules, layouts) stays CPU-testable.
#pragma once

#include <sstream>

#include "meshla/error.hpp"

#define MESHLA_THROW(code, message_stream)                                   \
  do {                                                                       \
    std::ostringstream meshla_message_;                                      \
    meshla_message_ << message_stream;                                       \
    throw ::meshla::Error(::meshla::ErrorCode::code, meshla_message_.str()); \
  } while (false)

#define MESHLA_CHECK_ARG(condition, message_stream)                   \
  do {                                                                \
    if (!(condition)) MESHLA_THROW(kInvalidArgument, message_stream); \
  } while (false)

// A condition whose failure is reported with the given error code.
#define MESHLA_CHECK(code, condition, message_stream)     \
  do {                                                    \
    if (!(condition)) MESHLA_THROW(code, message_stream); \
  } while (false)

// A broken invariant of meshla itself, not of the caller's input.
#define MESHLA_ASSERT(condition)                                                                \
  do {                                                                                          \
    if (!(condition))                                                                           \
      MESHLA_THROW(kInternal,                                                                   \
                   "internal check failed: " #condition " at " << __FILE__ << ":" << __LINE__); \
  } while (false)
