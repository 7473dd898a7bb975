#include "bindings/jax/collective.hpp"

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "bindings/jax/ffi_common.hpp"
#include "core/checks.hpp"
#include "meshla/collective_matmul.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace meshla::jax_ffi {
namespace {

// One GPU's part of a group: its communicator's plans. XLA runs each device's work on a thread
// of its own, but two executables may run at once (called from two Python threads), so the plans
// are looked up and built under the part's lock.
class GroupPart {
 public:
  explicit GroupPart(const Communicator& comm) : plans_(comm) {}

  // The plan of the call (checked; built on its first preparation, collectively: every rank's
  // handler prepares the same call). Valid while the part lives.
  CollectiveMatmul& matmul(const CollectiveMatmulConfig& request,
                           const CollectiveMatmulArgs& args) {
    std::lock_guard lock(mutex_);
    const Communicator& comm = plans_.communicator();
    return plans_.matmul(describe_call(request, args, comm.size(), comm.device()));
  }

 private:
  std::mutex mutex_;
  CollectivePlans plans_;
};

// Every registered group's parts in this process.
GroupParts<GroupPart>& groups() {
  static GroupParts<GroupPart> registry("tensor-parallel group");
  return registry;
}

// The call as its attributes and buffers describe it (bias, gathered and the scales absent where
// they have no element; a float8 call's product dtype is its output's).
struct Call {
  CollectiveMatmulConfig request;
  CollectiveMatmulArgs args;
};

TensorView present_or_absent(const ffi::AnyBuffer& buffer, int device, const char* name) {
  return buffer.element_count() == 0 ? TensorView{} : view_of(buffer, device, name);
}

Call call_of(CollectiveOp op, int device, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
             const ffi::AnyBuffer& bias, const ffi::AnyBuffer& a_scale,
             const ffi::AnyBuffer& b_scale, const ffi::AnyBuffer& out,
             const ffi::AnyBuffer* gathered, bool trans_b, std::int64_t algorithm,
             std::int64_t backend, std::int64_t chunks, std::int64_t comm_sms,
             std::int64_t comm_ctas) {
  Call call;
  call.request = {.op = op,
                  .algorithm = static_cast<Algorithm>(algorithm),
                  .backend = static_cast<Backend>(backend),
                  .trans_b = trans_b,
                  .return_gathered = gathered != nullptr && gathered->element_count() > 0,
                  .chunks = static_cast<int>(chunks),
                  .comm_sms = static_cast<int>(comm_sms),
                  .comm_ctas = static_cast<int>(comm_ctas)};
  call.args = {.a = view_of(a, device, "a"),
               .b = view_of(b, device, "b"),
               .bias = present_or_absent(bias, device, "bias"),
               .out = view_of(out, device, "out"),
               .gathered = gathered == nullptr ? TensorView{}
                                               : present_or_absent(*gathered, device, "gathered"),
               .a_scale = present_or_absent(a_scale, device, "a_scale"),
               .b_scale = present_or_absent(b_scale, device, "b_scale")};
  if (is_float8(call.args.a.dtype)) call.request.out_dtype = call.args.out.dtype;
  return call;
}

std::shared_ptr<GroupPart> part_for(std::int64_t group, int device, const Call& call) {
  return groups().find(group, device, collective_op_name(call.request.op));
}

// The stages of one op: prepare builds the plan, execute enqueues it. `gathered` only for
// all_gather_matmul.
template <CollectiveOp op>
struct Stages {
  static ffi::Error prepare(std::int32_t device, ffi::AnyBuffer a, ffi::AnyBuffer b,
                            ffi::AnyBuffer bias, ffi::AnyBuffer a_scale, ffi::AnyBuffer b_scale,
                            ffi::Result<ffi::AnyBuffer> out, const ffi::AnyBuffer* gathered,
                            std::int64_t group, bool trans_b, std::int64_t algorithm,
                            std::int64_t backend, std::int64_t chunks, std::int64_t comm_sms,
                            std::int64_t comm_ctas) {
    return guarded([&] {
      const Call call = call_of(op, device, a, b, bias, a_scale, b_scale, *out, gathered, trans_b,
                                algorithm, backend, chunks, comm_sms, comm_ctas);
      part_for(group, device, call)->matmul(call.request, call.args);
    });
  }

  static ffi::Error execute(cudaStream_t stream, std::int32_t device, ffi::AnyBuffer a,
                            ffi::AnyBuffer b, ffi::AnyBuffer bias, ffi::AnyBuffer a_scale,
                            ffi::AnyBuffer b_scale, ffi::Result<ffi::AnyBuffer> out,
                            const ffi::AnyBuffer* gathered, std::int64_t group, bool trans_b,
                            std::int64_t algorithm, std::int64_t backend, std::int64_t chunks,
                            std::int64_t comm_sms, std::int64_t comm_ctas) {
    return guarded([&] {
      const Call call = call_of(op, device, a, b, bias, a_scale, b_scale, *out, gathered, trans_b,
                                algorithm, backend, chunks, comm_sms, comm_ctas);
      // The part (and so its plan) is held until the work is enqueued.
      const std::shared_ptr<GroupPart> part = part_for(group, device, call);
      part->matmul(call.request, call.args).execute(call.args, stream);
    });
  }
};

ffi::Error all_gather_prepare(std::int32_t device, ffi::AnyBuffer a, ffi::AnyBuffer b,
                              ffi::AnyBuffer bias, ffi::AnyBuffer a_scale, ffi::AnyBuffer b_scale,
                              ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> gathered,
                              std::int64_t group, bool trans_b, std::int64_t algorithm,
                              std::int64_t backend, std::int64_t chunks, std::int64_t comm_sms,
                              std::int64_t comm_ctas) {
  return Stages<CollectiveOp::kAllGatherMatmul>::prepare(device, a, b, bias, a_scale, b_scale, out,
                                                         &*gathered, group, trans_b, algorithm,
                                                         backend, chunks, comm_sms, comm_ctas);
}

ffi::Error all_gather_execute(cudaStream_t stream, std::int32_t device, ffi::AnyBuffer a,
                              ffi::AnyBuffer b, ffi::AnyBuffer bias, ffi::AnyBuffer a_scale,
                              ffi::AnyBuffer b_scale, ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::AnyBuffer> gathered, std::int64_t group,
                              bool trans_b, std::int64_t algorithm, std::int64_t backend,
                              std::int64_t chunks, std::int64_t comm_sms, std::int64_t comm_ctas) {
  return Stages<CollectiveOp::kAllGatherMatmul>::execute(
      stream, device, a, b, bias, a_scale, b_scale, out, &*gathered, group, trans_b, algorithm,
      backend, chunks, comm_sms, comm_ctas);
}

template <CollectiveOp op>
ffi::Error reduction_prepare(std::int32_t device, ffi::AnyBuffer a, ffi::AnyBuffer b,
                             ffi::AnyBuffer bias, ffi::AnyBuffer a_scale, ffi::AnyBuffer b_scale,
                             ffi::Result<ffi::AnyBuffer> out, std::int64_t group, bool trans_b,
                             std::int64_t algorithm, std::int64_t backend, std::int64_t chunks,
                             std::int64_t comm_sms, std::int64_t comm_ctas) {
  return Stages<op>::prepare(device, a, b, bias, a_scale, b_scale, out, nullptr, group, trans_b,
                             algorithm, backend, chunks, comm_sms, comm_ctas);
}

template <CollectiveOp op>
ffi::Error reduction_execute(cudaStream_t stream, std::int32_t device, ffi::AnyBuffer a,
                             ffi::AnyBuffer b, ffi::AnyBuffer bias, ffi::AnyBuffer a_scale,
                             ffi::AnyBuffer b_scale, ffi::Result<ffi::AnyBuffer> out,
                             std::int64_t group, bool trans_b, std::int64_t algorithm,
                             std::int64_t backend, std::int64_t chunks, std::int64_t comm_sms,
                             std::int64_t comm_ctas) {
  return Stages<op>::execute(stream, device, a, b, bias, a_scale, b_scale, out, nullptr, group,
                             trans_b, algorithm, backend, chunks, comm_sms, comm_ctas);
}

// The attributes every collective handler takes: the group, the layout of b, and the tuning.
template <typename Binding>
auto with_attributes(Binding&& binding) {
  return std::move(binding)
      .template Attr<std::int64_t>("group")
      .template Attr<bool>("trans_b")
      .template Attr<std::int64_t>("algorithm")
      .template Attr<std::int64_t>("backend")
      .template Attr<std::int64_t>("chunks")
      .template Attr<std::int64_t>("comm_sms")
      .template Attr<std::int64_t>("comm_ctas");
}

// a, b, bias, a_scale, b_scale (float8 only; the absent ones empty), and the product.
template <typename Binding>
auto with_operands(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>();
}

// The operands of each stage: prepare knows the device, execute also XLA's stream.
auto prepare_operands() { return with_operands(ffi::Ffi::BindPrepare().Ctx<ffi::DeviceOrdinal>()); }

auto execute_operands() {
  return with_operands(
      ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>());
}

}  // namespace

// Execute only enqueues the same work for the same buffers: XLA may capture it in a command
// buffer (a CUDA graph), which holds the plan while it lives.
XLA_FFI_DEFINE_HANDLER_SYMBOL(meshla_all_gather_matmul_prepare, all_gather_prepare,
                              with_attributes(prepare_operands().Ret<ffi::AnyBuffer>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(meshla_all_gather_matmul_execute, all_gather_execute,
                              with_attributes(execute_operands().Ret<ffi::AnyBuffer>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(meshla_matmul_reduce_scatter_prepare,
                              reduction_prepare<CollectiveOp::kMatmulReduceScatter>,
                              with_attributes(prepare_operands()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(meshla_matmul_reduce_scatter_execute,
                              reduction_execute<CollectiveOp::kMatmulReduceScatter>,
                              with_attributes(execute_operands()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(meshla_matmul_all_reduce_prepare,
                              reduction_prepare<CollectiveOp::kMatmulAllReduce>,
                              with_attributes(prepare_operands()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(meshla_matmul_all_reduce_execute,
                              reduction_execute<CollectiveOp::kMatmulAllReduce>,
                              with_attributes(execute_operands()),
                              {ffi::Traits::kCmdBufferCompatible});

void register_group(std::int64_t group, const Communicator& comm) {
  groups().add(group, comm.device(), std::make_shared<GroupPart>(comm));
}

std::vector<std::pair<std::string, std::vector<std::pair<std::string, void*>>>>
collective_targets() {
  const auto stages = [](auto* prepare, auto* execute) {
    return std::vector<std::pair<std::string, void*>>{
        {"prepare", reinterpret_cast<void*>(prepare)},
        {"execute", reinterpret_cast<void*>(execute)}};
  };
  return {{"meshla_all_gather_matmul",
           stages(&meshla_all_gather_matmul_prepare, &meshla_all_gather_matmul_execute)},
          {"meshla_matmul_reduce_scatter",
           stages(&meshla_matmul_reduce_scatter_prepare, &meshla_matmul_reduce_scatter_execute)},
          {"meshla_matmul_all_reduce",
           stages(&meshla_matmul_all_reduce_prepare, &meshla_matmul_all_reduce_execute)}};
}

void release_groups() { groups().clear(); }

}  // namespace meshla::jax_ffi
