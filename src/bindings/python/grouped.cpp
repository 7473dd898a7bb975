// Python bindings of the grouped GEMM (meshla/grouped_matmul.hpp).
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "bindings/python/bindings.hpp"
#include "meshla/grouped_matmul.hpp"

using namespace nanobind::literals;

namespace meshla::bindings {
namespace {

using Meta = std::optional<TensorView>;

// One pass's arrays as metadata (ArrayMeta, host arrays too): check_grouped_call's and
// workspace_bytes's arguments.
GroupedMatmulArgs metas_of(const TensorView& m_splits, const Meta& x, const Meta& dy,
                           const Meta& weight, const Meta& bias, const Meta& y, const Meta& dx,
                           const Meta& dweight, const Meta& dbias, bool accumulate,
                           const Meta& dweight_addresses, WeightLayout weight_layout) {
  return {.m_splits = m_splits,
          .x = meta_or_absent(x),
          .dy = meta_or_absent(dy),
          .weight = meta_or_absent(weight),
          .bias = meta_or_absent(bias),
          .y = meta_or_absent(y),
          .dx = meta_or_absent(dx),
          .dweight = meta_or_absent(dweight),
          .dbias = meta_or_absent(dbias),
          .dweight_addresses = meta_or_absent(dweight_addresses),
          .accumulate = accumulate,
          .weight_layout = weight_layout};
}

}  // namespace

void bind_grouped(nb::module_& m) {
  nb::enum_<GroupedPass>(m, "GroupedPass")
      .value("forward", GroupedPass::kForward)
      .value("dgrad", GroupedPass::kDgrad)
      .value("wgrad", GroupedPass::kWgrad)
      .value("bias_grad", GroupedPass::kBiasGrad);
  nb::enum_<WeightLayout>(m, "WeightLayout")
      .value("out_in", WeightLayout::kOutIn)
      .value("in_out", WeightLayout::kInOut);

  m.def(
      "packed_group_stride",
      [](std::int64_t out_features, std::int64_t in_features, DType dtype) {
        return packed_group_stride(out_features, in_features, dtype);
      },
      "out_features"_a, "in_features"_a, "dtype"_a,
      "Elements between groups of a packed [G, out, in] buffer whose groups start on 256-byte "
      "boundaries.");

  m.def(
      "check_grouped_call",
      [](GroupedPass pass, const TensorView& m_splits, const Meta& x, const Meta& dy,
         const Meta& weight, const Meta& bias, const Meta& y, const Meta& dx, const Meta& dweight,
         const Meta& dbias, bool accumulate, const Meta& dweight_addresses,
         WeightLayout weight_layout) {
        check_grouped_call(pass, metas_of(m_splits, x, dy, weight, bias, y, dx, dweight, dbias,
                                          accumulate, dweight_addresses, weight_layout));
      },
      "grouped_pass"_a, "m_splits"_a, "x"_a.none() = nb::none(), "dy"_a.none() = nb::none(),
      "weight"_a.none() = nb::none(), "bias"_a.none() = nb::none(), "y"_a.none() = nb::none(),
      "dx"_a.none() = nb::none(), "dweight"_a.none() = nb::none(), "dbias"_a.none() = nb::none(),
      "accumulate"_a = false, "dweight_addresses"_a.none() = nb::none(),
      "weight_layout"_a = WeightLayout::kOutIn,
      "Checks one pass's arrays (ArrayMeta, host arrays too) as GroupedMatmul.run would.");

  m.def(
      "check_group_sizes",
      [](const std::vector<std::int64_t>& sizes, std::int64_t rows, WeightLayout weight_layout) {
        check_group_sizes(sizes.data(), static_cast<std::int64_t>(sizes.size()), rows,
                          weight_layout);
      },
      "sizes"_a, "rows"_a, "weight_layout"_a = WeightLayout::kOutIn,
      "Raises ValueError for a negative size or sizes not summing to `rows`, in the words of the "
      "device-side check for a call of `weight_layout`'s function.");

  nb::class_<GroupedMatmul>(m, "GroupedMatmul",
                            "Grouped GEMM of one device (see meshla/grouped_matmul.hpp).")
      .def(nb::init<int>(), "device"_a)
      .def(
          "workspace_bytes",
          [](const GroupedMatmul& self, GroupedPass pass, const TensorView& m_splits, const Meta& x,
             const Meta& dy, const Meta& weight, const Meta& bias, const Meta& y, const Meta& dx,
             const Meta& dweight, const Meta& dbias, bool accumulate, const Meta& dweight_addresses,
             WeightLayout weight_layout) {
            return self.workspace_bytes(
                pass, metas_of(m_splits, x, dy, weight, bias, y, dx, dweight, dbias, accumulate,
                               dweight_addresses, weight_layout));
          },
          "grouped_pass"_a, "m_splits"_a, "x"_a.none() = nb::none(), "dy"_a.none() = nb::none(),
          "weight"_a.none() = nb::none(), "bias"_a.none() = nb::none(), "y"_a.none() = nb::none(),
          "dx"_a.none() = nb::none(), "dweight"_a.none() = nb::none(),
          "dbias"_a.none() = nb::none(), "accumulate"_a = false,
          "dweight_addresses"_a.none() = nb::none(), "weight_layout"_a = WeightLayout::kOutIn,
          "Bytes of workspace of one pass on these arrays (ArrayMeta), checked as run() checks.")
      .def(
          "run",
          [](GroupedMatmul& self, GroupedPass pass, const Array& m_splits, const Array& workspace,
             std::uintptr_t stream, const std::optional<Array>& x, const std::optional<Array>& dy,
             const std::optional<Array>& weight, const std::optional<Array>& bias,
             const std::optional<Array>& y, const std::optional<Array>& dx,
             const std::optional<Array>& dweight, const std::optional<Array>& dbias,
             bool accumulate, const std::optional<Array>& dweight_addresses,
             WeightLayout weight_layout) {
            GroupedMatmulArgs args{
                .m_splits = view_of(m_splits, "m_splits"),
                .x = view_of(x, "x"),
                .dy = view_of(dy, "dy"),
                .weight = view_of(weight, "weight"),
                .bias = view_of(bias, "bias"),
                .y = view_of(y, "y"),
                .dx = view_of(dx, "dx"),
                .dweight = view_of(dweight, "dweight"),
                .dbias = view_of(dbias, "dbias"),
                .dweight_addresses = view_of(dweight_addresses, "dweight_addresses"),
                .accumulate = accumulate,
                .workspace = view_of(workspace, "workspace"),
                .weight_layout = weight_layout};
            nb::gil_scoped_release release;
            self.run(pass, args, to_stream(stream));
          },
          "grouped_pass"_a, "m_splits"_a, "workspace"_a, "stream"_a, "x"_a.none() = nb::none(),
          "dy"_a.none() = nb::none(), "weight"_a.none() = nb::none(), "bias"_a.none() = nb::none(),
          "y"_a.none() = nb::none(), "dx"_a.none() = nb::none(), "dweight"_a.none() = nb::none(),
          "dbias"_a.none() = nb::none(), "accumulate"_a = false,
          "dweight_addresses"_a.none() = nb::none(), "weight_layout"_a = WeightLayout::kOutIn,
          "Enqueues one pass on `stream` (a cudaStream_t as an integer).")
      .def(
          "check_device_errors",
          [](GroupedMatmul& self, std::uintptr_t stream) {
            nb::gil_scoped_release release;
            self.check_device_errors(to_stream(stream));
          },
          "stream"_a,
          "Waits for `stream`, then raises the error a call's device-side check recorded.")
      .def_prop_ro("device", &GroupedMatmul::device);
}

}  // namespace meshla::bindings
