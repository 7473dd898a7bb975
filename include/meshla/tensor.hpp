// Non-owning views of device or host arrays, the currency of the public API. Frameworks hand their
// arrays over through DLPack in the bindings; the core never sees a framework type.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "meshla/export.hpp"

namespace meshla {

enum class DType {
  kFloat32,
  kFloat64,
  kFloat16,
  kBFloat16,
  kComplex64,
  kComplex128,
  kInt32,
  kInt64,
  kFloat8E4M3,  // float8_e4m3fn: finite, no infinities (torch's and JAX's name)
  kFloat8E5M2   // float8_e5m2
};

MESHLA_API std::string_view dtype_name(DType dtype);
MESHLA_API std::size_t dtype_size(DType dtype);
// float8_e4m3fn or float8_e5m2: operands that need scales.
MESHLA_API bool is_float8(DType dtype);

enum class DeviceKind { kCpu, kCuda };

inline constexpr int kMaxTensorDims = 4;

struct MESHLA_API TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  DeviceKind device_kind = DeviceKind::kCuda;
  int device = 0;
  int ndim = 0;
  std::array<std::int64_t, kMaxTensorDims> shape{};
  std::array<std::int64_t, kMaxTensorDims> strides{};  // in elements, as DLPack

  // An array the caller gave (with data, or a framework's abstract array, which has a shape),
  // not an absent one (the default view).
  bool given() const { return data != nullptr || ndim > 0; }
  std::int64_t numel() const;
  bool is_row_major_contiguous() const;
  std::string shape_string() const;  // "[1024, 8192]"
  std::string place_string() const;  // "cpu" or "cuda:3"
};

// A contiguous row-major view of `shape` starting at `data`.
MESHLA_API TensorView make_tensor_view(void* data, DType dtype,
                                       std::initializer_list<std::int64_t> shape, int device,
                                       DeviceKind device_kind = DeviceKind::kCuda);

}  // namespace meshla
