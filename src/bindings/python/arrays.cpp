// Arrays as the bindings take them: DLPack arrays (capsules, or objects with __dlpack__) for
// execution, and ArrayMeta, an array's metadata alone, for the checks that run before anything
// exists on a device (and on a framework's abstract arrays).
#include "bindings/python/bindings.hpp"

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/checks.hpp"

using namespace nanobind::literals;

namespace meshla::bindings {
namespace {

DType dtype_of(const Array& array, const char* name) {
  const nb::dlpack::dtype type = array.dtype();
  const auto code = static_cast<nb::dlpack::dtype_code>(type.code);
  if (type.lanes == 1) {
    if (code == nb::dlpack::dtype_code::Bfloat && type.bits == 16) return DType::kBFloat16;
    if (code == nb::dlpack::dtype_code::Float && type.bits == 16) return DType::kFloat16;
    if (code == nb::dlpack::dtype_code::Float && type.bits == 32) return DType::kFloat32;
    if (code == nb::dlpack::dtype_code::Float && type.bits == 64) return DType::kFloat64;
    if (code == nb::dlpack::dtype_code::Complex && type.bits == 64) return DType::kComplex64;
    if (code == nb::dlpack::dtype_code::Complex && type.bits == 128) return DType::kComplex128;
    if (code == nb::dlpack::dtype_code::Int && type.bits == 32) return DType::kInt32;
    if (code == nb::dlpack::dtype_code::Int && type.bits == 64) return DType::kInt64;
    if (code == nb::dlpack::dtype_code::Float8_E4M3FN && type.bits == 8) {
      return DType::kFloat8E4M3;
    }
    if (code == nb::dlpack::dtype_code::Float8_E5M2 && type.bits == 8) return DType::kFloat8E5M2;
  }
  MESHLA_THROW(kInvalidArgument, name << ": DLPack dtype (code " << int(type.code) << ", "
                                      << int(type.bits) << " bits, " << type.lanes
                                      << " lanes) is not supported");
}

}  // namespace

TensorView view_of(const std::optional<Array>& maybe, const char* name) {
  TensorView view;
  if (!maybe) return view;
  const Array& array = *maybe;
  MESHLA_CHECK_ARG(array.ndim() <= static_cast<std::size_t>(kMaxTensorDims),
                   name << " has " << array.ndim() << " dimensions, more than " << kMaxTensorDims);
  view.data = const_cast<void*>(array.data());
  view.dtype = dtype_of(array, name);
  const int device_type = array.device_type();
  MESHLA_CHECK_ARG(
      device_type == nb::device::cuda::value || device_type == nb::device::cpu::value,
      name << " is on DLPack device type " << device_type << "; meshla takes CUDA or host arrays");
  view.device_kind = device_type == nb::device::cuda::value ? DeviceKind::kCuda : DeviceKind::kCpu;
  view.device = array.device_id();
  view.ndim = static_cast<int>(array.ndim());
  for (int i = 0; i < view.ndim; ++i) {
    view.shape[i] = static_cast<std::int64_t>(array.shape(i));
    view.strides[i] = static_cast<std::int64_t>(array.stride(i));
  }
  return view;
}

void bind_arrays(nb::module_& m) {
  nb::enum_<DType>(m, "DType")
      .value("float32", DType::kFloat32)
      .value("float64", DType::kFloat64)
      .value("float16", DType::kFloat16)
      .value("bfloat16", DType::kBFloat16)
      .value("complex64", DType::kComplex64)
      .value("complex128", DType::kComplex128)
      .value("int32", DType::kInt32)
      .value("int64", DType::kInt64)
      .value("float8_e4m3fn", DType::kFloat8E4M3)
      .value("float8_e5m2", DType::kFloat8E5M2);

  nb::class_<TensorView>(m, "ArrayMeta",
                         "An array as the checks see it: shape, strides (elements), dtype, where "
                         "it is, and its address where it has data (0 for an abstract array).")
      .def(
          "__init__",
          [](TensorView* self, const std::vector<std::int64_t>& shape,
             const std::vector<std::int64_t>& strides, DType dtype, int device, std::uintptr_t data,
             const std::string& name) {
            TensorView view;
            view.ndim = static_cast<int>(shape.size());
            for (int i = 0; i < std::min(view.ndim, kMaxTensorDims); ++i) view.shape[i] = shape[i];
            // A 0-d array would read as an absent one (TensorView::given) in every check.
            MESHLA_CHECK_ARG(
                view.ndim >= 1 && view.ndim <= kMaxTensorDims,
                name << ".shape="
                     << (view.ndim <= kMaxTensorDims ? view.shape_string()
                                                     : std::to_string(view.ndim) + " dimensions")
                     << ": meshla takes arrays of 1 to " << kMaxTensorDims << " dimensions");
            MESHLA_CHECK_ARG(strides.size() == shape.size(), name << ": " << shape.size()
                                                                  << " dimensions but "
                                                                  << strides.size() << " strides");
            view.data = reinterpret_cast<void*>(data);
            view.dtype = dtype;
            view.device_kind = device < 0 ? DeviceKind::kCpu : DeviceKind::kCuda;
            view.device = device < 0 ? 0 : device;
            for (int i = 0; i < view.ndim; ++i) view.strides[i] = strides[i];
            new (self) TensorView(view);
          },
          "shape"_a, "strides"_a, "dtype"_a, "device"_a, "data"_a = 0, "name"_a = "array",
          "`device`: the CUDA ordinal, or -1 for the host; `name` the argument's, for messages "
          "(1 to 4 dimensions are taken).")
      .def_prop_ro("shape", [](const TensorView& view) { return view.shape_string(); });
}

}  // namespace meshla::bindings
