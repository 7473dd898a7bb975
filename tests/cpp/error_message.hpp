// The message of the meshla::Error that `call` throws, which must carry `expected`; a test
// failure (and "") when it throws none.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "meshla/error.hpp"

namespace meshla {

inline std::string message_of(const std::function<void()>& call, ErrorCode expected) {
  try {
    call();
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), expected) << error.what();
    return error.what();
  }
  ADD_FAILURE() << "no error was raised";
  return "";
}

}  // namespace meshla
