#include "meshla/tensor.hpp"

#include <sstream>

#include "core/checks.hpp"

namespace meshla {

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kComplex64:
      return "complex64";
    case DType::kComplex128:
      return "complex128";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kFloat8E4M3:
      return "float8_e4m3fn";
    case DType::kFloat8E5M2:
      return "float8_e5m2";
  }
  return "unknown";
}

bool is_float8(DType dtype) { return dtype == DType::kFloat8E4M3 || dtype == DType::kFloat8E5M2; }

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      return 1;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat64:
    case DType::kComplex64:
    case DType::kInt64:
      return 8;
    case DType::kComplex128:
      return 16;
  }
  return 0;
}

std::int64_t TensorView::numel() const {
  std::int64_t count = 1;
  for (int i = 0; i < ndim; ++i) count *= shape[i];
  return count;
}

bool TensorView::is_row_major_contiguous() const {
  // An empty array has no element to misplace, whatever its strides: torch's .contiguous() hands
  // an expanded empty gradient (strides 0) back unchanged.
  if (numel() == 0) return true;
  std::int64_t expected = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    // Extent-1 dimensions may carry any stride (DLPack producers differ here).
    if (shape[i] != 1 && strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

std::string TensorView::shape_string() const {
  std::ostringstream out;
  out << "[";
  for (int i = 0; i < ndim; ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

std::string TensorView::place_string() const {
  return device_kind == DeviceKind::kCpu ? "cpu" : "cuda:" + std::to_string(device);
}

TensorView make_tensor_view(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                            int device, DeviceKind device_kind) {
  MESHLA_CHECK_ARG(shape.size() <= kMaxTensorDims,
                   "make_tensor_view: " << shape.size() << " dimensions exceed the maximum of "
                                        << kMaxTensorDims);
  TensorView view{.data = data, .dtype = dtype, .device_kind = device_kind, .device = device};
  view.ndim = static_cast<int>(shape.size());
  int i = 0;
  for (std::int64_t extent : shape) view.shape[i++] = extent;
  std::int64_t stride = 1;
  for (int d = view.ndim - 1; d >= 0; --d) {
    view.strides[d] = stride;
    stride *= view.shape[d];
  }
  return view;
}

}  // namespace meshla
