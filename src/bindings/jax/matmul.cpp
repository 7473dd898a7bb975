#include "bindings/jax/matmul.hpp"

#include <cstdint>

#include "bindings/jax/ffi_common.hpp"
#include "core/alignment.hpp"
#include "meshla/matmul.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace meshla::jax_ffi {
namespace {

PerDevice<Matmul>& matmuls() {
  static PerDevice<Matmul> registry;
  return registry;
}

// out [m, n] = a [m, k] @ b [n, k]ᵀ of float8 operands, each scaled back by its float32 scales
// (one, or one per row with `rowwise`), as torch._scaled_mm. meshla.jax makes the call from
// operands it cast itself, so a shape that does not match is its bug (kInternal); the GEMM's own
// rules (dtypes, alignment) are the core's, in its words.
ffi::Error scaled_matmul(cudaStream_t stream, std::int32_t device, ffi::AnyBuffer a,
                         ffi::AnyBuffer b, ffi::AnyBuffer a_scale, ffi::AnyBuffer b_scale,
                         ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace,
                         std::int32_t rowwise) {
  return guarded([&] {
    const TensorView va = view_of(a, device, "a"), vb = view_of(b, device, "b");
    const TensorView vout = view_of(*out, device, "out");
    MESHLA_CHECK(kInternal,
                 va.ndim == 2 && vb.ndim == 2 && vout.ndim == 2 && va.shape[1] == vb.shape[1] &&
                     vout.shape[0] == va.shape[0] && vout.shape[1] == vb.shape[0],
                 "scaled_matmul: a " << va.shape_string() << " @ b " << vb.shape_string()
                                     << "ᵀ into out " << vout.shape_string());
    MatmulShape shape;
    shape.dtype = va.dtype;
    if (vb.dtype != va.dtype) shape.b_dtype = vb.dtype;
    shape.out_dtype = vout.dtype;
    shape.scaling = rowwise != 0 ? MatmulScaling::kRowwise : MatmulScaling::kTensorwise;
    shape.m = va.shape[0];
    shape.n = vb.shape[0];
    shape.k = va.shape[1];
    shape.trans_b = true;
    MESHLA_CHECK(kInternal,
                 a_scale.element_type() == ffi::DataType::F32 &&
                     b_scale.element_type() == ffi::DataType::F32 &&
                     a_scale.element_count() == static_cast<std::size_t>(rowwise ? shape.m : 1) &&
                     b_scale.element_count() == static_cast<std::size_t>(rowwise ? shape.n : 1),
                 "scaled_matmul: " << a_scale.element_count() << " and " << b_scale.element_count()
                                   << " scales for a " << va.shape_string() << " and b "
                                   << vb.shape_string());
    // XLA aligns its buffers to fewer bytes than the GEMM wants (256): meshla.jax asks for that
    // many more, and the workspace starts at the first boundary.
    const auto address = reinterpret_cast<std::uintptr_t>(workspace->untyped_data());
    const std::size_t skipped = detail::align_up(address) - address;
    MESHLA_CHECK(kInternal, workspace->size_bytes() >= skipped + kMatmulWorkspaceBytes,
                 "scaled_matmul: a workspace of " << workspace->size_bytes() << " bytes");
    const MatmulOperands operands{.a = va.data,
                                  .b = vb.data,
                                  .d = vout.data,
                                  .a_scale = static_cast<const float*>(a_scale.untyped_data()),
                                  .b_scale = static_cast<const float*>(b_scale.untyped_data()),
                                  .workspace = reinterpret_cast<void*>(address + skipped)};
    matmuls().with_engine(device, [&](Matmul& matmul) { matmul.run(shape, operands, stream); });
  });
}

}  // namespace

// a, b, a_scale, b_scale; the product and the call's workspace (a result XLA allocates, so that
// calls it runs at once do not share one); rowwise (1) or tensorwise (0) scales. Matmul::run
// only enqueues (no allocation, no host wait), so XLA may capture the call in a command buffer.
XLA_FFI_DEFINE_HANDLER_SYMBOL(meshla_scaled_matmul, scaled_matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<std::int32_t>("rowwise"),
                              {ffi::Traits::kCmdBufferCompatible});

std::vector<std::pair<std::string, void*>> matmul_targets() {
  return {{"meshla_scaled_matmul", reinterpret_cast<void*>(&meshla_scaled_matmul)}};
}

void release_matmuls() { matmuls().clear(); }

}  // namespace meshla::jax_ffi
