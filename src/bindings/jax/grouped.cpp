#include "bindings/jax/grouped.hpp"

#include <cstdint>
#include <utility>

#include "bindings/jax/ffi_common.hpp"
#include "core/alignment.hpp"
#include "meshla/grouped_matmul.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace meshla::jax_ffi {
namespace {

// One GroupedMatmul per GPU. Its host-mapped record carries a call's failed check of the group
// sizes to the next call on that GPU, which returns it as XLA's error.
PerDevice<GroupedMatmul>& engines() {
  static PerDevice<GroupedMatmul> registry;
  return registry;
}

// meshla.jax's weight_layout attribute: WeightLayout's value.
WeightLayout layout_of(std::int32_t weight_layout) {
  MESHLA_CHECK(kInternal,
               weight_layout == static_cast<std::int32_t>(WeightLayout::kOutIn) ||
                   weight_layout == static_cast<std::int32_t>(WeightLayout::kInOut),
               "grouped: weight_layout=" << weight_layout);
  return static_cast<WeightLayout>(weight_layout);
}

// A zero-size buffer stands for an absent bias.
TensorView present_or_absent(const ffi::AnyBuffer& buffer, int device, const char* name) {
  return buffer.element_count() == 0 ? TensorView{} : view_of(buffer, device, name);
}

ffi::Error run(GroupedPass pass, cudaStream_t stream, int device, GroupedMatmulArgs args,
               const ffi::AnyBuffer& workspace, std::int32_t weight_layout) {
  return guarded([&] {
    args.weight_layout = layout_of(weight_layout);
    // XLA aligns its buffers to fewer bytes than the pass wants (256): meshla.jax asks for that
    // many more, and the workspace starts at the first boundary.
    const auto address = reinterpret_cast<std::uintptr_t>(workspace.untyped_data());
    const std::size_t skipped = detail::align_up(address) - address;
    MESHLA_CHECK(kInternal, workspace.size_bytes() >= skipped,
                 "grouped_linear: a workspace of " << workspace.size_bytes() << " bytes");
    args.workspace = make_tensor_view(
        reinterpret_cast<void*>(address + skipped), DType::kInt32,
        {static_cast<std::int64_t>((workspace.size_bytes() - skipped) / 4)}, device);
    engines().with_engine(device, [&](GroupedMatmul& engine) { engine.run(pass, args, stream); });
  });
}

ffi::Error forward(cudaStream_t stream, std::int32_t device, ffi::AnyBuffer m_splits,
                   ffi::AnyBuffer x, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                   ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> workspace,
                   std::int32_t weight_layout) {
  return run(GroupedPass::kForward, stream, device,
             {.m_splits = view_of(m_splits, device, "m_splits"),
              .x = view_of(x, device, "x"),
              .weight = view_of(weight, device, "weight"),
              .bias = present_or_absent(bias, device, "bias"),
              .y = view_of(*y, device, "y")},
             *workspace, weight_layout);
}

ffi::Error dgrad(cudaStream_t stream, std::int32_t device, ffi::AnyBuffer m_splits,
                 ffi::AnyBuffer dy, ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> dx,
                 ffi::Result<ffi::AnyBuffer> workspace, std::int32_t weight_layout) {
  return run(GroupedPass::kDgrad, stream, device,
             {.m_splits = view_of(m_splits, device, "m_splits"),
              .dy = view_of(dy, device, "dy"),
              .weight = view_of(weight, device, "weight"),
              .dx = view_of(*dx, device, "dx")},
             *workspace, weight_layout);
}

ffi::Error wgrad(cudaStream_t stream, std::int32_t device, ffi::AnyBuffer m_splits,
                 ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dweight,
                 ffi::Result<ffi::AnyBuffer> workspace, std::int32_t weight_layout) {
  return run(GroupedPass::kWgrad, stream, device,
             {.m_splits = view_of(m_splits, device, "m_splits"),
              .x = view_of(x, device, "x"),
              .dy = view_of(dy, device, "dy"),
              .dweight = view_of(*dweight, device, "dweight")},
             *workspace, weight_layout);
}

ffi::Error bias_grad(cudaStream_t stream, std::int32_t device, ffi::AnyBuffer m_splits,
                     ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> dbias,
                     ffi::Result<ffi::AnyBuffer> workspace, std::int32_t weight_layout) {
  return run(GroupedPass::kBiasGrad, stream, device,
             {.m_splits = view_of(m_splits, device, "m_splits"),
              .dy = view_of(dy, device, "dy"),
              .dbias = view_of(*dbias, device, "dbias")},
             *workspace, weight_layout);
}

// A pass's binding: m_splits and its `Arrays - 1` operands, then its output and the workspace,
// and the weight_layout attribute, WeightLayout's value (the bias gradient's: the words of its
// errors).
template <int Arrays, typename Binding>
auto pass_binding(Binding binding) {
  if constexpr (Arrays == 0) {
    return std::move(binding)
        .template Ret<ffi::AnyBuffer>()
        .template Ret<ffi::AnyBuffer>()
        .template Attr<std::int32_t>("weight_layout");
  } else {
    return pass_binding<Arrays - 1>(std::move(binding).template Arg<ffi::AnyBuffer>());
  }
}

template <int Arrays>
auto pass_binding() {
  return pass_binding<Arrays>(
      ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>());
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(meshla_grouped_forward, forward, pass_binding<4>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(meshla_grouped_dgrad, dgrad, pass_binding<3>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(meshla_grouped_wgrad, wgrad, pass_binding<3>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(meshla_grouped_bias_grad, bias_grad, pass_binding<2>(),
                              {ffi::Traits::kCmdBufferCompatible});

std::vector<std::pair<std::string, void*>> grouped_targets() {
  return {{"meshla_grouped_forward", reinterpret_cast<void*>(&meshla_grouped_forward)},
          {"meshla_grouped_dgrad", reinterpret_cast<void*>(&meshla_grouped_dgrad)},
          {"meshla_grouped_wgrad", reinterpret_cast<void*>(&meshla_grouped_wgrad)},
          {"meshla_grouped_bias_grad", reinterpret_cast<void*>(&meshla_grouped_bias_grad)}};
}

void release_grouped() { engines().clear(); }

}  // namespace meshla::jax_ffi
