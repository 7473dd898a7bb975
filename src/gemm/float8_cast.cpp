#include "gemm/float8_cast.hpp"
#include "core/checks.hpp"
#include "core/cuda_handles.hpp"
#include "meshla/float8.hpp"

namespace meshla {
namespace {

using detail::Float8Layout;

std::int64_t scale_count(const Float8Layout& layout, Float8Scales scales) {
  switch (scales) {
    case Float8Scales::kRows:
      return layout.rows;
    case Float8Scales::kColumns:
      return layout.cols;
    default:
      return 1;
  }
}

const char* scales_name(Float8Scales scales) {
  switch (scales) {
    case Float8Scales::kRows:
      return "one per row of t";
    case Float8Scales::kColumns:
      return "one per column of t";
    default:
      return "one for t";
  }
}

Float8Layout layout_of(const TensorView& t, const char* function) {
  MESHLA_CHECK_ARG(t.data != nullptr, function << ": t is absent");
  // A stride along an extent of one is never followed (torch leaves such strides arbitrary).
  MESHLA_CHECK_ARG(
      t.ndim == 2 && (t.strides[1] == 1 || t.shape[1] <= 1) &&
          (t.strides[0] >= t.shape[1] || t.shape[0] <= 1),
      function << ": t must be a 2-D array of unit-stride rows, got shape " << t.shape_string());
  MESHLA_CHECK_ARG(t.device_kind == DeviceKind::kCuda,
                   function << ": t is on " << t.place_string() << ", not a CUDA device");
  MESHLA_CHECK_ARG(
      t.dtype == DType::kBFloat16 || t.dtype == DType::kFloat16 || t.dtype == DType::kFloat32,
      function << ": t is " << dtype_name(t.dtype) << "; expected bfloat16, float16 or float32");
  return {.dtype = t.dtype,
          .rows = t.shape[0],
          .cols = t.shape[1],
          .pitch = t.shape[0] > 1 ? t.strides[0] : t.shape[1]};
}

void check_place(const TensorView& out, const char* function, const char* name,
                 const TensorView& t) {
  MESHLA_CHECK_ARG(
      out.device_kind == t.device_kind && out.device == t.device,
      function << ": " << name << " is on " << out.place_string() << ", t on " << t.place_string());
}

// `count` contiguous float32 values on t's device: amax or the multipliers.
void check_scales(const TensorView& scales, const char* function, const char* name,
                  const TensorView& t, std::int64_t count) {
  MESHLA_CHECK_ARG(scales.dtype == DType::kFloat32 && scales.numel() == count &&
                       scales.is_row_major_contiguous(),
                   function << ": " << name << " must be " << count
                            << " contiguous float32 values for t " << t.shape_string() << ", got "
                            << dtype_name(scales.dtype) << " " << scales.shape_string());
  check_place(scales, function, name, t);
}

// A contiguous float8 [rows, cols] on t's device: q or q_transposed.
void check_float8(const TensorView& out, const char* name, const TensorView& t, std::int64_t rows,
                  std::int64_t cols) {
  MESHLA_CHECK_ARG(is_float8(out.dtype) && out.ndim == 2 && out.shape[0] == rows &&
                       out.shape[1] == cols && out.is_row_major_contiguous(),
                   "float8_cast: " << name << " must be a contiguous float8 [" << rows << ", "
                                   << cols << "] for t " << t.shape_string() << ", got "
                                   << dtype_name(out.dtype) << " " << out.shape_string());
  check_place(out, "float8_cast", name, t);
}

}  // namespace

void float8_amax(const TensorView& t, Float8Scales scales, const TensorView& amax,
                 cudaStream_t stream) {
  const Float8Layout layout = layout_of(t, "float8_amax");
  check_scales(amax, "float8_amax", "amax", t, scale_count(layout, scales));
  detail::DeviceGuard guard(t.device);
  detail::launch_float8_amax(t.data, layout, scales, static_cast<float*>(amax.data), stream);
}

void float8_cast(const TensorView& t, Float8Scales scales, const TensorView& multiplier,
                 const TensorView& q, const TensorView& q_transposed, cudaStream_t stream) {
  const Float8Layout layout = layout_of(t, "float8_cast");
  MESHLA_CHECK_ARG(multiplier.data != nullptr,
                   "float8_cast: multiplier is absent (" << scales_name(scales) << ")");
  check_scales(multiplier, "float8_cast", "multiplier", t, scale_count(layout, scales));
  MESHLA_CHECK_ARG(q.data != nullptr || q_transposed.data != nullptr,
                   "float8_cast: neither q nor q_transposed is given");
  if (q.data != nullptr) check_float8(q, "q", t, layout.rows, layout.cols);
  if (q_transposed.data != nullptr) {
    check_float8(q_transposed, "q_transposed", t, layout.cols, layout.rows);
  }
  MESHLA_CHECK_ARG(
      q.data == nullptr || q_transposed.data == nullptr || q.dtype == q_transposed.dtype,
      "float8_cast: q is " << dtype_name(q.dtype) << " and q_transposed "
                           << dtype_name(q_transposed.dtype) << "; one dtype");
  const DType dtype = q.data != nullptr ? q.dtype : q_transposed.dtype;
  detail::DeviceGuard guard(t.device);
  detail::launch_float8_cast(t.data, layout, scales, static_cast<const float*>(multiplier.data),
                             dtype, q.data, q_transposed.data, stream);
}

}  // namespace meshla
