// What every file of the Python extension shares: arrays as they arrive (DLPack capsules, or
// objects with __dlpack__) turned into TensorViews, dtype names, streams as integers, and the
// registration of each pillar's bindings. The only C++ that knows nanobind is in this folder.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>

#include <cuda_runtime_api.h>

#include "meshla/tensor.hpp"

namespace meshla::bindings {

namespace nb = nanobind;

using Array = nb::ndarray<nb::ro>;

// The view of an array (empty for None); `name` is the argument's, for messages.
TensorView view_of(const std::optional<Array>& maybe, const char* name);

// An ArrayMeta argument, or an absent array (empty view) for None.
inline TensorView meta_or_absent(const std::optional<TensorView>& meta) {
  return meta ? *meta : TensorView{};
}

inline cudaStream_t to_stream(std::uintptr_t stream) {
  return reinterpret_cast<cudaStream_t>(stream);
}

// Binds DType, ArrayMeta (a TensorView from an array's metadata) and each pillar.
void bind_arrays(nb::module_& m);
void bind_collective(nb::module_& m);
void bind_grouped(nb::module_& m);
void bind_matmul(nb::module_& m);
void bind_solver(nb::module_& m);
void bind_jax(nb::module_& m);

}  // namespace meshla::bindings
