#include "comm/nvlink.hpp"

#include <dlfcn.h>

#include <sstream>

#include "core/shared_library.hpp"

namespace meshla::detail {
namespace {

// NVML's C interface as its documentation gives it (nvml.h is not part of the CUDA toolkit
// installed here): enums are int-sized, a device handle is an opaque pointer.
using NvmlReturn = int;
using NvmlDevice = struct NvmlDeviceOpaque*;
constexpr NvmlReturn kNvmlSuccess = 0;
constexpr int kP2PCapsIndexNvlink = 2;  // NVML_P2P_CAPS_INDEX_NVLINK
constexpr int kP2PStatusOk = 0;         // NVML_P2P_STATUS_OK

struct Nvml {
  std::string why;  // empty once loaded and initialised
  NvmlReturn (*device_by_pci_bus_id)(const char*, NvmlDevice*) = nullptr;
  NvmlReturn (*p2p_status)(NvmlDevice, NvmlDevice, int, int*) = nullptr;
  const char* (*error_string)(NvmlReturn) = nullptr;
};

Nvml load() {
  Nvml nvml;
  // Never closed nor shut down: the answer is asked once per group, and initialising NVML again
  // for each would cost more than keeping it.
  void* library = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* error = dlerror();
    nvml.why =
        std::string("NVML (libnvidia-ml.so.1, part of the NVIDIA driver) cannot be loaded: ") +
        (error != nullptr ? error : "unknown error");
    return nvml;
  }
  NvmlReturn (*init)() = nullptr;
  resolve_symbol(library, "NVML", "nvmlInit_v2", &init, &nvml.why);
  resolve_symbol(library, "NVML", "nvmlErrorString", &nvml.error_string, &nvml.why);
  resolve_symbol(library, "NVML", "nvmlDeviceGetHandleByPciBusId_v2", &nvml.device_by_pci_bus_id,
                 &nvml.why);
  resolve_symbol(library, "NVML", "nvmlDeviceGetP2PStatus", &nvml.p2p_status, &nvml.why);
  if (!nvml.why.empty()) return nvml;
  if (const NvmlReturn status = init(); status != kNvmlSuccess) {
    nvml.why = std::string("nvmlInit failed: ") + nvml.error_string(status);
  }
  return nvml;
}

// nvmlGpuP2PStatus_t's values from 1 on, by their documented meaning.
const char* p2p_status_name(int status) {
  static constexpr const char* kNames[] = {"chipset not supported", "GPU not supported",
                                           "I/O hub topology not supported",
                                           "disabled by registry key", "not supported"};
  return status >= 1 && status <= 5 ? kNames[status - 1] : "unknown";
}

}  // namespace

std::string why_not_nvlink(const char* pci_bus_id, const char* peer_pci_bus_id) {
  static const Nvml nvml = load();
  if (!nvml.why.empty()) return nvml.why;
  NvmlDevice devices[2] = {};
  const char* ids[2] = {pci_bus_id, peer_pci_bus_id};
  for (int i = 0; i < 2; ++i) {
    if (const NvmlReturn status = nvml.device_by_pci_bus_id(ids[i], &devices[i]);
        status != kNvmlSuccess) {
      return std::string("NVML does not know the GPU at PCI bus id ") + ids[i] + ": " +
             nvml.error_string(status);
    }
  }
  int p2p = -1;
  if (const NvmlReturn status = nvml.p2p_status(devices[0], devices[1], kP2PCapsIndexNvlink, &p2p);
      status != kNvmlSuccess) {
    return std::string("NVML cannot say whether ") + pci_bus_id + " and " + peer_pci_bus_id +
           " share NVLink: " + nvml.error_string(status);
  }
  if (p2p == kP2PStatusOk) return {};
  std::ostringstream why;
  why << "NVML reports no NVLink between " << pci_bus_id << " and " << peer_pci_bus_id << " ("
      << p2p_status_name(p2p) << ")";
  return why.str();
}

}  // namespace meshla::detail
