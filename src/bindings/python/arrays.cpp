#include "bindings/python/bindings.hpp"

#include "core/checks.hpp"

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

DType parse_dtype(const std::string& name) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16, DType::kFloat32, DType::kFloat64,
                      DType::kComplex64, DType::kComplex128, DType::kInt32, DType::kInt64}) {
    if (dtype_name(dtype) == name) return dtype;
  }
  MESHLA_THROW(kInvalidArgument, "dtype '" << name << "' is not a meshla dtype");
}

}  // namespace meshla::bindings
