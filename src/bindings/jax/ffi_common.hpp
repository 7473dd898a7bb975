// What the XLA FFI handlers share: buffers as TensorViews, and meshla's errors as XLA's (no
// exception crosses into XLA).
#pragma once

#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#include "core/checks.hpp"
#include "meshla/error.hpp"
#include "meshla/tensor.hpp"
#include "xla/ffi/api/ffi.h"

namespace meshla::jax_ffi {

namespace ffi = xla::ffi;

inline DType dtype_of(ffi::DataType type, const char* name) {
  switch (type) {
    case ffi::DataType::F32:
      return DType::kFloat32;
    case ffi::DataType::F64:
      return DType::kFloat64;
    case ffi::DataType::C64:
      return DType::kComplex64;
    case ffi::DataType::C128:
      return DType::kComplex128;
    case ffi::DataType::F16:
      return DType::kFloat16;
    case ffi::DataType::BF16:
      return DType::kBFloat16;
    case ffi::DataType::S32:
      return DType::kInt32;
    case ffi::DataType::S64:
      return DType::kInt64;
    case ffi::DataType::F8E4M3FN:
      return DType::kFloat8E4M3;
    case ffi::DataType::F8E5M2:
      return DType::kFloat8E5M2;
    default:
      MESHLA_THROW(kInvalidArgument, name << ": XLA element type " << static_cast<int>(type)
                                          << " is not one meshla takes");
  }
}

// A buffer of XLA's as a contiguous row-major view on `device`.
inline TensorView view_of(const ffi::AnyBuffer& buffer, int device, const char* name) {
  const ffi::Span<const std::int64_t> dims = buffer.dimensions();
  MESHLA_CHECK_ARG(dims.size() <= static_cast<std::size_t>(kMaxTensorDims),
                   name << " has " << dims.size() << " dimensions");
  TensorView view;
  view.data = buffer.untyped_data();
  view.dtype = dtype_of(buffer.element_type(), name);
  view.device = device;
  view.ndim = static_cast<int>(dims.size());
  std::int64_t stride = 1;
  for (int i = view.ndim - 1; i >= 0; --i) {
    view.shape[i] = dims[i];
    view.strides[i] = stride;
    stride *= dims[i];
  }
  return view;
}

inline ffi::Error to_ffi_error(ErrorCode code, const std::string& message) {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      return ffi::Error(ffi::ErrorCode::kInvalidArgument, message);
    case ErrorCode::kNotImplemented:
      return ffi::Error(ffi::ErrorCode::kUnimplemented, message);
    case ErrorCode::kTimeout:
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, message);
    default:
      return ffi::Error(ffi::ErrorCode::kInternal, message);
  }
}

// Runs `body`, returning its exception as XLA's error.
template <typename Body>
ffi::Error guarded(Body&& body) {
  try {
    body();
    return ffi::Error::Success();
  } catch (const Error& error) {
    return to_ffi_error(error.code(), error.what());
  } catch (const std::exception& error) {
    return ffi::Error::Internal(error.what());
  }
}

// One `Engine` per GPU of this process (an engine constructed from a CUDA ordinal), made by the
// first call on that GPU. Calls on one GPU may come from several threads (two executables at
// once): each runs under its GPU's lock, holding the engine, so that clear() (at interpreter
// exit) lets go of an engine only after the calls that use it.
template <typename Engine>
class PerDevice {
 public:
  template <typename Body>
  void with_engine(int device, Body&& body) {
    std::shared_ptr<Entry> entry;
    {
      std::lock_guard lock(mutex_);
      std::shared_ptr<Entry>& slot = entries_[device];
      if (!slot) slot = std::make_shared<Entry>(device);
      entry = slot;
    }
    std::lock_guard lock(entry->mutex);
    body(entry->engine);
  }

  void clear() {
    std::lock_guard lock(mutex_);
    entries_.clear();
  }

 private:
  struct Entry {
    explicit Entry(int device) : engine(device) {}
    std::mutex mutex;
    Engine engine;
  };
  std::mutex mutex_;
  std::map<int, std::shared_ptr<Entry>> entries_;
};

// What meshla.jax registers for a mesh's groups when it traces a call on it (a collective
// group's communicator parts, a solver group's solvers), by (group number, CUDA ordinal), for
// the handlers of this process to find. `what` names the kind in messages ("tensor-parallel
// group").
template <typename Part>
class GroupParts {
 public:
  explicit GroupParts(const char* what) : what_(what) {}

  void add(std::int64_t group, int device, std::shared_ptr<Part> part) {
    std::lock_guard lock(mutex_);
    MESHLA_CHECK_ARG(
        parts_.try_emplace({group, device}, std::move(part)).second,
        "meshla.jax: " << what_ << " " << group << " already has cuda:" << device << " registered");
  }

  std::shared_ptr<Part> find(std::int64_t group, int device, std::string_view op) {
    std::lock_guard lock(mutex_);
    const auto found = parts_.find({group, device});
    MESHLA_CHECK_ARG(found != parts_.end(),
                     op << ": no " << what_ << " " << group << " holds cuda:" << device
                        << " in this process (meshla.jax makes a group when it traces a call on "
                           "its mesh; was the call traced by another process?)");
    return found->second;
  }

  void clear() {
    std::lock_guard lock(mutex_);
    parts_.clear();
  }

 private:
  const char* what_;
  std::mutex mutex_;
  std::map<std::pair<std::int64_t, int>, std::shared_ptr<Part>> parts_;
};

}  // namespace meshla::jax_ffi
