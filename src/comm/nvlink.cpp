#include "comm/nvlink.hpp"

#include <dlfcn.h>

#include <sstream>

#include <nvml.h>

#include "core/shared_library.hpp"

namespace meshla::detail {
namespace {

struct Nvml {
  std::string why;  // empty once loaded and initialised
  decltype(&nvmlDeviceGetHandleByPciBusId_v2) device_by_pci_bus_id = nullptr;
  decltype(&nvmlDeviceGetP2PStatus) p2p_status = nullptr;
  decltype(&nvmlErrorString) error_string = nullptr;
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
  decltype(&nvmlInit_v2) init = nullptr;
  resolve_symbol(library, "NVML", "nvmlInit_v2", &init, &nvml.why);
  resolve_symbol(library, "NVML", "nvmlErrorString", &nvml.error_string, &nvml.why);
  resolve_symbol(library, "NVML", "nvmlDeviceGetHandleByPciBusId_v2", &nvml.device_by_pci_bus_id,
                 &nvml.why);
  resolve_symbol(library, "NVML", "nvmlDeviceGetP2PStatus", &nvml.p2p_status, &nvml.why);
  if (!nvml.why.empty()) return nvml;
  if (const nvmlReturn_t status = init(); status != NVML_SUCCESS) {
    nvml.why = std::string("NVML's nvmlInit_v2 failed: ") + nvml.error_string(status);
  }
  return nvml;
}

const char* p2p_status_name(nvmlGpuP2PStatus_t status) {
  switch (status) {
    case NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED:
      return "chipset not supported";
    case NVML_P2P_STATUS_GPU_NOT_SUPPORTED:
      return "GPU not supported";
    case NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED:
      return "I/O hub topology not supported";
    case NVML_P2P_STATUS_DISABLED_BY_REGKEY:
      return "disabled by registry key";
    case NVML_P2P_STATUS_NOT_SUPPORTED:
      return "not supported";
    default:
      return "unknown";
  }
}

}  // namespace

std::string why_not_nvlink(const char* pci_bus_id, const char* peer_pci_bus_id) {
  static const Nvml nvml = load();
  if (!nvml.why.empty()) return nvml.why;
  nvmlDevice_t devices[2] = {};
  const char* ids[2] = {pci_bus_id, peer_pci_bus_id};
  for (int i = 0; i < 2; ++i) {
    if (const nvmlReturn_t status = nvml.device_by_pci_bus_id(ids[i], &devices[i]);
        status != NVML_SUCCESS) {
      return std::string("NVML does not know the GPU at PCI bus id ") + ids[i] + ": " +
             nvml.error_string(status);
    }
  }
  nvmlGpuP2PStatus_t p2p = NVML_P2P_STATUS_UNKNOWN;
  if (const nvmlReturn_t status =
          nvml.p2p_status(devices[0], devices[1], NVML_P2P_CAPS_INDEX_NVLINK, &p2p);
      status != NVML_SUCCESS) {
    return std::string("NVML cannot say whether ") + pci_bus_id + " and " + peer_pci_bus_id +
           " share NVLink: " + nvml.error_string(status);
  }
  if (p2p == NVML_P2P_STATUS_OK) return {};
  std::ostringstream why;
  why << "NVML reports no NVLink between " << pci_bus_id << " and " << peer_pci_bus_id << " ("
      << p2p_status_name(p2p) << ")";
  return why.str();
}

}  // namespace meshla::detail
