// Python bindings of the GEMM every compute step is built on (meshla/matmul.hpp): a Matmul on one
// device, run on arrays, for the GPU suite's checks of each dtype (fp8 included) and for tools.
#include <nanobind/stl/string.h>

#include <string>

#include "bindings/python/bindings.hpp"
#include "core/checks.hpp"
#include "meshla/float8.hpp"
#include "meshla/matmul.hpp"

using namespace nanobind::literals;

namespace meshla::bindings {
namespace {

// The rows of a 2-D array: their count, length and pitch. The GEMM reads rows (unit stride).
struct Rows {
  std::int64_t count = 0, length = 0, pitch = 0;
};

Rows rows_of(const TensorView& view, const char* name, int device) {
  MESHLA_CHECK_ARG(view.ndim == 2 && view.strides[1] == 1 && view.strides[0] >= view.shape[1],
                   "matmul: " << name << " must be a 2-D array of unit-stride rows, got shape "
                              << view.shape_string());
  MESHLA_CHECK_ARG(
      view.device_kind == DeviceKind::kCuda && view.device == device,
      "matmul: " << name << " is on " << view.place_string() << ", not cuda:" << device);
  return {view.shape[0], view.shape[1], view.strides[0]};
}

const float* scale_of(const TensorView& view, const char* name, std::int64_t count, int device) {
  if (view.data == nullptr) return nullptr;
  MESHLA_CHECK_ARG(
      view.dtype == DType::kFloat32 && view.numel() == count && view.is_row_major_contiguous(),
      "matmul: " << name << " must be " << count << " contiguous float32 values, got "
                 << dtype_name(view.dtype) << " " << view.shape_string());
  MESHLA_CHECK_ARG(
      view.device_kind == DeviceKind::kCuda && view.device == device,
      "matmul: " << name << " is on " << view.place_string() << ", not cuda:" << device);
  return static_cast<const float*>(view.data);
}

MatmulScaling scaling_of(const std::string& name) {
  if (name == "none") return MatmulScaling::kNone;
  if (name == "tensorwise") return MatmulScaling::kTensorwise;
  MESHLA_CHECK_ARG(name == "rowwise",
                   "matmul: scaling=" << name << " is not one of none, tensorwise, rowwise");
  return MatmulScaling::kRowwise;
}

Float8Scales float8_scales_of(const std::string& name, const char* function) {
  if (name == "tensor") return Float8Scales::kTensor;
  if (name == "rows") return Float8Scales::kRows;
  MESHLA_CHECK_ARG(name == "columns",
                   function << ": scales=" << name << " is not one of tensor, rows, columns");
  return Float8Scales::kColumns;
}

}  // namespace

void bind_matmul(nb::module_& m) {
  nb::class_<Matmul>(m, "Matmul",
                     "meshla's GEMM on one device (meshla/matmul.hpp): d = a @ op(b) (+ bias), "
                     "fp8 operands scaled.")
      .def(nb::init<int>(), "device"_a)
      .def(
          "run",
          [](Matmul& matmul, const Array& a, const Array& b, const Array& d,
             const std::optional<Array>& bias, bool trans_b, const std::string& scaling,
             const std::optional<Array>& a_scale, const std::optional<Array>& b_scale,
             std::uintptr_t stream, const std::optional<Array>& workspace) {
            const int device = matmul.device();
            const TensorView va = view_of(a, "a"), vb = view_of(b, "b"), vd = view_of(d, "d");
            const TensorView vbias = view_of(bias, "bias");
            const TensorView vworkspace = view_of(workspace, "workspace");
            if (vworkspace.data != nullptr) {
              MESHLA_CHECK_ARG(
                  vworkspace.device_kind == DeviceKind::kCuda && vworkspace.device == device &&
                      static_cast<std::size_t>(vworkspace.numel()) * dtype_size(vworkspace.dtype) >=
                          kMatmulWorkspaceBytes,
                  "matmul: workspace must be "
                      << kMatmulWorkspaceBytes << " bytes on cuda:" << device << ", got "
                      << vworkspace.shape_string() << " " << dtype_name(vworkspace.dtype) << " on "
                      << vworkspace.place_string());
            }
            const Rows ra = rows_of(va, "a", device), rb = rows_of(vb, "b", device);
            const Rows rd = rows_of(vd, "d", device);
            const std::int64_t k = trans_b ? rb.length : rb.count;
            const std::int64_t n = trans_b ? rb.count : rb.length;
            MESHLA_CHECK_ARG(ra.length == k && rd.count == ra.count && rd.length == n,
                             "matmul: a " << va.shape_string() << " @ b " << vb.shape_string()
                                          << (trans_b ? " (trans_b)" : "") << " does not make d "
                                          << vd.shape_string());
            if (vbias.data != nullptr) {
              MESHLA_CHECK_ARG(vbias.ndim == 1 && vbias.shape[0] == n && vbias.dtype == vd.dtype,
                               "matmul: bias must be [" << n << "] of d's dtype, got "
                                                        << dtype_name(vbias.dtype) << " "
                                                        << vbias.shape_string());
            }
            const MatmulScaling scales = scaling_of(scaling);
            const bool rowwise = scales == MatmulScaling::kRowwise;
            const MatmulShape shape{.dtype = va.dtype,
                                    .b_dtype = vb.dtype,
                                    .out_dtype = vd.dtype,
                                    .scaling = scales,
                                    .m = ra.count,
                                    .n = n,
                                    .k = k,
                                    .trans_b = trans_b,
                                    .lda = ra.pitch,
                                    .ldb = rb.pitch,
                                    .ldd = rd.pitch,
                                    .bias = vbias.data != nullptr};
            matmul.run(shape,
                       {.a = va.data,
                        .b = vb.data,
                        .bias = vbias.data,
                        .d = vd.data,
                        .a_scale = scale_of(view_of(a_scale, "a_scale"), "a_scale",
                                            rowwise ? ra.count : 1, device),
                        .b_scale = scale_of(view_of(b_scale, "b_scale"), "b_scale", rowwise ? n : 1,
                                            device),
                        .workspace = vworkspace.data},
                       to_stream(stream));
          },
          "a"_a, "b"_a, "d"_a, "bias"_a.none() = nb::none(), "trans_b"_a = false,
          "scaling"_a = "none", "a_scale"_a.none() = nb::none(), "b_scale"_a.none() = nb::none(),
          "stream"_a = 0, "workspace"_a.none() = nb::none(),
          "Enqueues d = a @ op(b) (+ bias) on `stream` (a cudaStream_t as an integer): a [m, k], "
          "b [k, n] or with trans_b [n, k], d [m, n], dtypes from the arrays; fp8 a and b with "
          "scaling 'tensorwise' (a_scale, b_scale one float32 each) or 'rowwise' (m and n); "
          "`workspace`, matmul_workspace_bytes of the device's memory for this call alone (None: "
          "the Matmul's, shared by its calls, which must then run one after another).")
      .def_prop_ro("device", &Matmul::device);
  m.attr("matmul_workspace_bytes") = kMatmulWorkspaceBytes;
  m.def(
      "check_scaled_matmul",
      [](DType a, DType b, DType out, std::int64_t m, std::int64_t n, std::int64_t k,
         bool rowwise) {
        check_matmul_shape(
            {.dtype = a,
             .b_dtype = b,
             .out_dtype = out,
             .scaling = rowwise ? MatmulScaling::kRowwise : MatmulScaling::kTensorwise,
             .m = m,
             .n = n,
             .k = k,
             .trans_b = true});
      },
      "a"_a, "b"_a, "out"_a, "m"_a, "n"_a, "k"_a, "rowwise"_a,
      "Raises ValueError (NotImplementedError) where the GEMM's rules refuse a [m, k] @ b [n, k]ᵀ "
      "of float8 operands into `out` with tensorwise or rowwise scales: the checks Matmul.run "
      "makes, on the shape alone.");
  m.def(
      "float8_amax",
      [](const Array& t, const std::string& scales, const Array& amax, std::uintptr_t stream) {
        float8_amax(view_of(t, "t"), float8_scales_of(scales, "float8_amax"), view_of(amax, "amax"),
                    to_stream(stream));
      },
      "t"_a, "scales"_a, "amax"_a, "stream"_a,
      "Enqueues amax = the largest magnitude of t [rows, cols] (16- or 32-bit, on a GPU) over "
      "each group of values that shares a scale (scales: 'tensor', 'rows' or 'columns'), float32, "
      "NaN where a value is (meshla/float8.hpp).");
  m.def(
      "float8_cast",
      [](const Array& t, const std::string& scales, const Array& multiplier,
         const std::optional<Array>& q, const std::optional<Array>& q_transposed,
         std::uintptr_t stream) {
        float8_cast(view_of(t, "t"), float8_scales_of(scales, "float8_cast"),
                    view_of(multiplier, "multiplier"), view_of(q, "q"),
                    view_of(q_transposed, "q_transposed"), to_stream(stream));
      },
      "t"_a, "scales"_a, "multiplier"_a, "q"_a.none(), "q_transposed"_a.none(), "stream"_a,
      "Enqueues q = float8(t * multiplier) ([rows, cols]) and/or its transpose ([cols, rows]), "
      "float8 arrays given, the product rounded once to float32 and saturated to the float8 "
      "dtype's largest finite value; multiplier as float8_amax's amax (meshla/float8.hpp).");
}

}  // namespace meshla::bindings
