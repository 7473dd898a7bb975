// The alignment meshla gives every piece it carves out of a workspace: 256 bytes, what cuBLAS,
// cuSOLVER and vectorized kernels want of a base address.
#pragma once

#include <cstddef>

namespace meshla::detail {

inline constexpr std::size_t kWorkspaceAlignment = 256;

constexpr std::size_t align_up(std::size_t bytes) {
  return (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

}  // namespace meshla::detail
