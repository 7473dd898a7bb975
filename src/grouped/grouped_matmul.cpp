#include "meshla/grouped_matmul.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <iterator>

#include "core/alignment.hpp"
#include "core/cuda_checks.hpp"
#include "core/cuda_handles.hpp"
#include "grouped/grouped_kernels.hpp"
#include "grouped/grouped_validation.hpp"
#include "grouped/sm90_grouped_passes.hpp"

namespace meshla {

using grouped::CutlassWorkspace;

namespace {

// The weight layout of the call this thread is running, as its caller made it: run() runs a kInOut
// call, and a padded one, by calling itself on other arguments (kOutIn, aligned), while the group
// sizes' errors its device-side check finds must name the caller's function and arguments.
thread_local const WeightLayout* t_caller_layout = nullptr;

// Holds the outermost run()'s layout for the calls it makes.
class CallerLayout {
 public:
  explicit CallerLayout(WeightLayout layout)
      : layout_(t_caller_layout ? *t_caller_layout : layout), outermost_(!t_caller_layout) {
    if (outermost_) t_caller_layout = &layout_;
  }
  ~CallerLayout() {
    if (outermost_) t_caller_layout = nullptr;
  }
  CallerLayout(const CallerLayout&) = delete;
  CallerLayout& operator=(const CallerLayout&) = delete;

  WeightLayout layout() const { return layout_; }

 private:
  WeightLayout layout_;
  bool outermost_;
};

// The pass that runs a WeightLayout::kInOut pass on the [G, out, in] kernels (see WeightLayout).
GroupedPass pass_on_out_in_kernels(GroupedPass pass) {
  switch (pass) {
    case GroupedPass::kForward:
      return GroupedPass::kDgrad;
    case GroupedPass::kDgrad:
      return GroupedPass::kForward;
    default:
      return pass;
  }
}

// The group index a pass built in `args.workspace`, `offset` bytes in (workspace_layout's first
// parts; a padded call's are those of its inner call).
grouped::GroupIndex group_index_of(const GroupedMatmulArgs& args,
                                   const grouped::GroupedShape& shape, std::size_t offset = 0) {
  auto* base = static_cast<char*>(args.workspace.data) + offset;
  const grouped::WorkspaceLayout layout = grouped::workspace_layout(shape.groups, 0);
  return {args.m_splits.data,
          reinterpret_cast<std::int64_t*>(base + layout.offsets),
          reinterpret_cast<std::int32_t*>(base + layout.invalid),
          shape.groups,
          shape.rows,
          args.m_splits.dtype == DType::kInt32};
}

// A checked kInOut call as the [G, out, in] call of the transposed problem: the weights'
// [G, in, out] is that problem's [G, out, in], x and dy trade places, and the output stays.
GroupedMatmulArgs as_out_in(GroupedPass pass, const GroupedMatmulArgs& args) {
  GroupedMatmulArgs swapped = args;
  swapped.weight_layout = WeightLayout::kOutIn;
  switch (pass) {
    case GroupedPass::kForward:
      swapped.x = {};
      swapped.y = {};
      swapped.bias = {};  // added after the product
      swapped.dy = args.x;
      swapped.dx = args.y;
      break;
    case GroupedPass::kDgrad:
      swapped.dy = {};
      swapped.dx = {};
      swapped.x = args.dy;
      swapped.y = args.dx;
      break;
    case GroupedPass::kWgrad:
      swapped.x = args.dy;
      swapped.dy = args.x;
      break;
    case GroupedPass::kBiasGrad:
      break;
  }
  return swapped;
}

std::int64_t padded_size(std::int64_t features) {
  return (features + grouped::kFeatureMultiple - 1) / grouped::kFeatureMultiple *
         grouped::kFeatureMultiple;
}

// A padded call's workspace (grouped_validation.hpp's PaddedFeatures): the zero-padded copies of
// the operands with unaligned rows, the weights (and bias) and the padded output, each 256-byte
// aligned (offsets; 0 where the pass has none), then the workspace of the aligned call on them.
struct PaddedLayout {
  std::size_t x = 0, dy = 0, weight = 0, bias = 0, out = 0, inner = 0, total = 0;
};

PaddedLayout padded_layout(GroupedPass pass, const grouped::GroupedShape& shape,
                           grouped::PaddedFeatures padded, bool bias, bool accumulate,
                           std::size_t inner_bytes) {
  const auto bytes = [&](std::int64_t elements, DType dtype) {
    return detail::align_up(static_cast<std::size_t>(elements) * dtype_size(dtype));
  };
  const std::int64_t in = padded_size(shape.in_features), out = padded_size(shape.out_features);
  const std::int64_t rows = shape.rows, groups = shape.groups;
  PaddedLayout layout;
  std::size_t end = 0;
  const auto place = [&](std::size_t* offset, std::int64_t elements, DType dtype) {
    *offset = end;
    end += bytes(elements, dtype);
  };
  const bool has_x = pass == GroupedPass::kForward || pass == GroupedPass::kWgrad;
  const bool has_dy = pass == GroupedPass::kDgrad || pass == GroupedPass::kWgrad;
  if (has_x && padded.in) place(&layout.x, rows * in, shape.dtype);
  if (has_dy && padded.out) place(&layout.dy, rows * out, shape.dtype);
  if (pass != GroupedPass::kWgrad) place(&layout.weight, groups * out * in, shape.dtype);
  if (pass == GroupedPass::kForward && bias) place(&layout.bias, groups * out, shape.dtype);
  if (pass == GroupedPass::kForward && padded.out) place(&layout.out, rows * out, shape.dtype);
  if (pass == GroupedPass::kDgrad && padded.in) place(&layout.out, rows * in, shape.dtype);
  if (pass == GroupedPass::kWgrad) {
    place(&layout.out, groups * out * in, accumulate ? DType::kFloat32 : shape.dtype);
  }
  layout.inner = end;
  layout.total = end + inner_bytes;
  return layout;
}

// `view` ([rows, cols] with row pitch strides[0], or [G, rows, cols]) as a set of matrices.
grouped::Matrices matrices_of(const TensorView& view) {
  const bool grouped = view.ndim == 3;
  return {view.data, view.shape[view.ndim - 2], view.shape[view.ndim - 1],
          view.strides[view.ndim - 2], grouped ? view.strides[0] : 0};
}

// The aligned call on zero-padded copies (PaddedLayout): the padding adds zeros to every
// contraction and only columns past the features to the outputs, which are cropped back.
void run_padded(GroupedMatmul& engine, GroupedPass pass, const GroupedMatmulArgs& args,
                const grouped::GroupedShape& shape, const PaddedLayout& layout,
                cudaStream_t stream) {
  auto* base = static_cast<char*>(args.workspace.data);
  const std::int64_t in = padded_size(shape.in_features), out = padded_size(shape.out_features);
  const int element = static_cast<int>(dtype_size(shape.dtype));
  const int device = engine.device();
  const auto matrix_at = [&](std::size_t offset, DType dtype, std::int64_t rows,
                             std::int64_t cols) {
    return make_tensor_view(base + offset, dtype, {rows, cols}, device);
  };
  const auto matrices_at = [&](std::size_t offset, DType dtype, std::int64_t rows,
                               std::int64_t cols) {
    return make_tensor_view(base + offset, dtype, {shape.groups, rows, cols}, device);
  };
  // A zero-padded copy of `view` at `offset`, `rows` x `cols` a matrix.
  const auto copy_in = [&](const TensorView& view, std::size_t offset, std::int64_t rows,
                           std::int64_t cols) {
    const bool grouped = view.ndim == 3;
    const TensorView copy = grouped ? matrices_at(offset, view.dtype, rows, cols)
                                    : matrix_at(offset, view.dtype, rows, cols);
    grouped::launch_copy_matrices(matrices_of(view), matrices_of(copy), grouped ? view.shape[0] : 1,
                                  element, grouped::CopyMode::kCopy, stream);
    return copy;
  };

  GroupedMatmulArgs inner = args;
  inner.workspace = make_tensor_view(
      base + layout.inner, DType::kInt32,
      {static_cast<std::int64_t>((layout.total - layout.inner) / sizeof(std::int32_t))}, device);
  TensorView user_out;  // the caller's output, written from the padded one at the end
  switch (pass) {
    case GroupedPass::kForward:
      if (shape.in_features != in) inner.x = copy_in(args.x, layout.x, shape.rows, in);
      inner.weight = copy_in(args.weight, layout.weight, out, in);
      if (args.bias.given()) inner.bias = copy_in(args.bias, layout.bias, shape.groups, out);
      if (shape.out_features != out) {
        user_out = args.y;
        inner.y = matrix_at(layout.out, shape.dtype, shape.rows, out);
      }
      break;
    case GroupedPass::kDgrad:
      if (shape.out_features != out) inner.dy = copy_in(args.dy, layout.dy, shape.rows, out);
      inner.weight = copy_in(args.weight, layout.weight, out, in);
      if (shape.in_features != in) {
        user_out = args.dx;
        inner.dx = matrix_at(layout.out, shape.dtype, shape.rows, in);
      }
      break;
    case GroupedPass::kWgrad: {
      if (shape.in_features != in) inner.x = copy_in(args.x, layout.x, shape.rows, in);
      if (shape.out_features != out) inner.dy = copy_in(args.dy, layout.dy, shape.rows, out);
      const DType dweight = args.accumulate ? DType::kFloat32 : shape.dtype;
      inner.dweight = matrices_at(layout.out, dweight, out, in);
      inner.dweight_addresses = {};
      if (args.accumulate) {  // accumulate into zeros, then add to the caller's
        MESHLA_CHECK_CUDA(cudaMemsetAsync(
            inner.dweight.data, 0, static_cast<std::size_t>(inner.dweight.numel()) * 4, stream));
      }
      break;
    }
    case GroupedPass::kBiasGrad:
      MESHLA_THROW(kInternal, "grouped_linear bias_grad has no padded form");
  }
  engine.run(pass, inner, stream);

  if (pass == GroupedPass::kWgrad) {
    const TensorView& padded = inner.dweight;
    grouped::Matrices to{args.dweight.data, shape.out_features, shape.in_features, 0, 0};
    if (args.dweight_addresses.given()) {
      to.pitch = shape.in_features;
      to.addresses = static_cast<const std::int64_t*>(args.dweight_addresses.data);
    } else {
      to = matrices_of(args.dweight);
    }
    grouped::launch_copy_matrices(
        matrices_of(padded), to, shape.groups, static_cast<int>(dtype_size(padded.dtype)),
        args.accumulate ? grouped::CopyMode::kAddFloat : grouped::CopyMode::kCopy, stream);
  } else if (user_out.given()) {
    const TensorView& padded = pass == GroupedPass::kForward ? inner.y : inner.dx;
    grouped::launch_copy_matrices(matrices_of(padded), matrices_of(user_out), 1, element,
                                  grouped::CopyMode::kCopy, stream);
  }
}

}  // namespace

struct GroupedMatmul::Impl {
  int device = 0;
  bool hopper = false;  // runs meshla's Hopper kernels (detail::runs_hopper_kernels)
  int sm_count = 0;
  int l2_bytes = 0;
  // Host-mapped, written by the device: one record for the calls of each weight layout, so that
  // an error is reported in the words of the function whose call it was.
  static constexpr WeightLayout kLayouts[] = {WeightLayout::kOutIn, WeightLayout::kInOut};
  grouped::DeviceStatus* statuses = nullptr;

  ~Impl() {
    if (statuses) cudaFreeHost(statuses);
  }

  grouped::DeviceStatus* status(WeightLayout caller_layout) const {
    return statuses + (caller_layout == WeightLayout::kInOut ? 1 : 0);
  }

  // The error an earlier call's device-side check left, thrown once and then cleared.
  void throw_recorded_error() {
    for (const WeightLayout layout : kLayouts) {
      volatile grouped::DeviceStatus* record = status(layout);
      const std::int32_t code = record->code;
      if (code == grouped::kStatusOk) continue;
      const std::int32_t group = record->group;
      const std::int64_t value = record->value;
      const std::int64_t rows = record->rows;
      record->code = grouped::kStatusOk;
      const bool negative = code == grouped::kNegativeSize;
      MESHLA_THROW(kInvalidArgument,
                   grouped::group_sizes_error(layout, group, negative ? value : 0,
                                              negative ? 0 : value, rows)
                       << " (found on the device by an earlier call, whose outputs were filled "
                          "with NaN)");
    }
  }

  // Whether `pass` runs on the CUTLASS kernels (bf16, fp16 on Hopper), or on the portable
  // kernel (fp32 anywhere, bf16 and fp16 elsewhere) / the bias kernel.
  bool uses_cutlass(GroupedPass pass, DType dtype) const {
    return hopper && pass != GroupedPass::kBiasGrad &&
           (dtype == DType::kBFloat16 || dtype == DType::kFloat16);
  }

  // CUTLASS's tables and kernel workspace for the pass; none where it does not use CUTLASS.
  CutlassWorkspace cutlass_workspace(GroupedPass pass, DType dtype, std::int64_t groups) const {
    if (!uses_cutlass(pass, dtype)) return {};
    switch (pass) {
      case GroupedPass::kForward:
        return grouped::cutlass_forward_workspace(dtype, groups, device, sm_count);
      case GroupedPass::kDgrad:
        return grouped::cutlass_dgrad_workspace(dtype, groups, device, sm_count);
      case GroupedPass::kWgrad: {
        const CutlassWorkspace store =
            grouped::cutlass_wgrad_workspace(dtype, groups, device, sm_count);
        const CutlassWorkspace add =
            grouped::cutlass_wgrad_accumulate_workspace(dtype, groups, device, sm_count);
        return {std::max(store.tables, add.tables), std::max(store.kernel, add.kernel)};
      }
      case GroupedPass::kBiasGrad:
        break;
    }
    return {};
  }

  // The pass's part of the workspace: the bias gradient's fp32 sums, or `parts`.
  static std::size_t pass_bytes(GroupedPass pass, std::int64_t groups, std::int64_t out_features,
                                const CutlassWorkspace& parts) {
    if (pass == GroupedPass::kBiasGrad) {
      return sizeof(float) * static_cast<std::size_t>(groups * out_features);
    }
    return detail::align_up(parts.tables) + parts.kernel;
  }

  // Bytes of workspace of a call on aligned features.
  std::size_t aligned_bytes(GroupedPass pass, DType dtype, std::int64_t groups,
                            std::int64_t out_features) const {
    const CutlassWorkspace parts = cutlass_workspace(pass, dtype, groups);
    return grouped::workspace_layout(groups, pass_bytes(pass, groups, out_features, parts)).total;
  }

  // The padded copies' layout of a call whose 16-bit features are not all aligned.
  PaddedLayout padded(GroupedPass pass, const GroupedMatmulArgs& args,
                      const grouped::GroupedShape& shape, grouped::PaddedFeatures features) const {
    return padded_layout(
        pass, shape, features, args.bias.given(), args.accumulate,
        aligned_bytes(pass, shape.dtype, shape.groups, padded_size(shape.out_features)));
  }
};

GroupedMatmul::GroupedMatmul(int device) : impl_(std::make_unique<Impl>()) {
  impl_->device = device;
  impl_->hopper = detail::runs_hopper_kernels(device);
  detail::DeviceGuard guard(device);
  MESHLA_CHECK_CUDA(
      cudaDeviceGetAttribute(&impl_->sm_count, cudaDevAttrMultiProcessorCount, device));
  MESHLA_CHECK_CUDA(cudaDeviceGetAttribute(&impl_->l2_bytes, cudaDevAttrL2CacheSize, device));
  // The engine is often made at its first call, which may come inside a CUDA graph capture
  // (torch.cuda.graph): there an allocation invalidates the capture unless this thread's capture
  // mode is relaxed. The status records outlive every call and are not part of any graph.
  constexpr std::size_t records = std::size(Impl::kLayouts);
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  MESHLA_CHECK_CUDA(cudaThreadExchangeStreamCaptureMode(&mode));
  const cudaError_t allocated =
      cudaHostAlloc(reinterpret_cast<void**>(&impl_->statuses),
                    records * sizeof(grouped::DeviceStatus), cudaHostAllocMapped);
  MESHLA_CHECK_CUDA(cudaThreadExchangeStreamCaptureMode(&mode));
  MESHLA_CHECK_CUDA(allocated);
  std::fill(impl_->statuses, impl_->statuses + records, grouped::DeviceStatus{});
}

GroupedMatmul::~GroupedMatmul() = default;
GroupedMatmul::GroupedMatmul(GroupedMatmul&&) noexcept = default;
GroupedMatmul& GroupedMatmul::operator=(GroupedMatmul&&) noexcept = default;

int GroupedMatmul::device() const { return impl_->device; }

std::size_t GroupedMatmul::workspace_bytes(GroupedPass pass, const GroupedMatmulArgs& args) const {
  const grouped::GroupedShape shape = grouped::validate_grouped_args(pass, args);
  if (args.weight_layout == WeightLayout::kInOut) {
    return workspace_bytes(pass_on_out_in_kernels(pass), as_out_in(pass, args));
  }
  const grouped::PaddedFeatures features = grouped::padded_features(shape);
  if (impl_->uses_cutlass(pass, shape.dtype) && features.any()) {
    return impl_->padded(pass, args, shape, features).total;
  }
  return impl_->aligned_bytes(pass, shape.dtype, shape.groups, shape.out_features);
}

void GroupedMatmul::check_device_errors(cudaStream_t stream) {
  MESHLA_CHECK_CUDA(cudaStreamSynchronize(stream));
  impl_->throw_recorded_error();
}

void GroupedMatmul::run(GroupedPass pass, const GroupedMatmulArgs& args, cudaStream_t stream) {
  impl_->throw_recorded_error();
  const CallerLayout caller(args.weight_layout);
  const grouped::GroupedShape shape = grouped::validate_grouped_args(pass, args);
  if (args.weight_layout == WeightLayout::kInOut) {
    const GroupedPass executed = pass_on_out_in_kernels(pass);
    const GroupedMatmulArgs swapped = as_out_in(pass, args);
    run(executed, swapped, stream);
    if (pass == GroupedPass::kForward && args.bias.given()) {
      // The group index the product's call built: after the padded copies where it ran padded.
      const grouped::GroupedShape executed_shape =
          grouped::validate_grouped_args(executed, swapped);
      const grouped::PaddedFeatures features = grouped::padded_features(executed_shape);
      const std::size_t index_offset =
          impl_->uses_cutlass(executed, shape.dtype) && features.any()
              ? impl_->padded(executed, swapped, executed_shape, features).inner
              : 0;
      detail::DeviceGuard guard(impl_->device);
      grouped::launch_add_group_bias(group_index_of(args, shape, index_offset), args.y.data,
                                     shape.dtype, shape.out_features, args.bias.data,
                                     args.bias.strides[0], stream);
    }
    return;
  }
  MESHLA_CHECK_ARG(args.m_splits.device_kind == DeviceKind::kCuda,
                   "grouped_linear " << grouped_pass_name(pass)
                                     << ": m_splits must be a CUDA tensor: its sizes are read on "
                                        "the device");
  MESHLA_CHECK_ARG(args.m_splits.device == impl_->device,
                   "grouped_linear " << grouped_pass_name(pass)
                                     << ": tensors are on cuda:" << args.m_splits.device
                                     << " but this GroupedMatmul is for cuda:" << impl_->device);
  // The CUTLASS passes (bf16, fp16 on Hopper) build the index, poison a failed call's output and
  // zero empty groups' weight gradients in their table kernel; the others launch each.
  const bool cutlass_pass = impl_->uses_cutlass(pass, shape.dtype);
  const CutlassWorkspace parts = impl_->cutlass_workspace(pass, shape.dtype, shape.groups);
  const grouped::WorkspaceLayout layout = grouped::workspace_layout(
      shape.groups, Impl::pass_bytes(pass, shape.groups, shape.out_features, parts));
  const grouped::PaddedFeatures features = grouped::padded_features(shape);
  const bool padded = cutlass_pass && features.any();
  // Sized once: each padded layout asks CUTLASS for the aligned call's workspace.
  const PaddedLayout padded_parts =
      padded ? impl_->padded(pass, args, shape, features) : PaddedLayout{};
  const std::size_t required = padded ? padded_parts.total : layout.total;
  const TensorView& ws = args.workspace;
  MESHLA_CHECK_ARG(ws.ndim >= 1 && ws.device_kind == DeviceKind::kCuda &&
                       ws.device == impl_->device && ws.is_row_major_contiguous() &&
                       static_cast<std::size_t>(ws.numel()) * dtype_size(ws.dtype) >= required,
                   "grouped_linear "
                       << grouped_pass_name(pass) << ": workspace.shape=" << ws.shape_string()
                       << " must be a contiguous CUDA buffer on cuda:" << impl_->device
                       << " of at least " << required << " bytes (workspace_bytes)");
  MESHLA_CHECK_ARG(reinterpret_cast<std::uintptr_t>(ws.data) % 256 == 0,
                   "grouped_linear: workspace must start on a 256-byte boundary");

  detail::DeviceGuard guard(impl_->device);
  if (padded) {
    run_padded(*this, pass, args, shape, padded_parts, stream);
    return;
  }
  auto* base = static_cast<char*>(ws.data);
  const grouped::GroupIndex index = group_index_of(args, shape);
  grouped::DeviceStatus* const status = impl_->status(caller.layout());
  if (!cutlass_pass) grouped::launch_group_index(index, status, stream);

  if (pass == GroupedPass::kBiasGrad) {
    grouped::launch_bias_grad(index, args.dy.data, shape.dtype, shape.out_features,
                              reinterpret_cast<float*>(base + layout.pass), args.dbias.data,
                              args.dbias.strides[0], stream);
    grouped::launch_poison_if_invalid(
        index.invalid,
        {args.dbias.data, shape.dtype, shape.groups, shape.out_features, args.dbias.strides[0]},
        stream);
    return;
  }

  const TensorView& out = pass == GroupedPass::kForward ? args.y
                          : pass == GroupedPass::kDgrad ? args.dx
                                                        : args.dweight;
  const bool has_weight = pass != GroupedPass::kWgrad;
  // Accumulated weight gradients given one address a group (dweight_addresses), not as dweight.
  const auto* addresses = pass == GroupedPass::kWgrad
                              ? static_cast<const std::int64_t*>(args.dweight_addresses.data)
                              : nullptr;
  const bool has_bias = pass == GroupedPass::kForward && args.bias.given();
  const grouped::GroupedOperands operands{
      pass,
      shape.in_features,
      shape.out_features,
      args.x.data,
      args.dy.data,
      has_weight ? args.weight.data : nullptr,
      has_weight ? args.weight.strides[0] : 0,
      has_bias ? args.bias.data : nullptr,
      has_bias ? args.bias.strides[0] : 0,
      out.data,
      pass == GroupedPass::kWgrad && addresses == nullptr ? out.strides[0] : 0,
      pass == GroupedPass::kWgrad && args.accumulate,
      addresses};

  // The output as groups of elements: the whole [rows, features] matrix, or dW's G matrices.
  const grouped::GroupedSpan out_span =
      pass == GroupedPass::kWgrad
          ? grouped::GroupedSpan{out.data,
                                 args.accumulate ? DType::kFloat32 : out.dtype,
                                 shape.groups,
                                 shape.out_features * shape.in_features,
                                 addresses != nullptr ? 0 : out.strides[0],
                                 addresses}
          : grouped::GroupedSpan{out.data, out.dtype, 1, out.numel(), out.numel()};

  if (!cutlass_pass) {
    grouped::launch_grouped_simt(index, operands, shape.dtype, stream);
    if (pass == GroupedPass::kWgrad && !args.accumulate) {
      grouped::launch_zero_empty_groups(index, out_span, stream);
    }
    grouped::launch_poison_if_invalid(index.invalid, out_span, stream);
  } else {
    char* tables = base + layout.pass;
    const grouped::CutlassCall call{index,
                                    status,
                                    operands,
                                    out_span,
                                    shape.dtype,
                                    tables,
                                    tables + detail::align_up(parts.tables),
                                    impl_->device,
                                    impl_->sm_count,
                                    impl_->l2_bytes};
    switch (pass) {
      case GroupedPass::kForward:
        grouped::cutlass_forward(call, stream);
        break;
      case GroupedPass::kDgrad:
        grouped::cutlass_dgrad(call, stream);
        break;
      default:
        if (args.accumulate) {
          grouped::cutlass_wgrad_accumulate(call, stream);
        } else {
          grouped::cutlass_wgrad(call, stream);
        }
    }
  }
}

}  // namespace meshla
