// Whether two GPUs of this host are linked by NVLink, as NVML (the driver's management library)
// reports it. The symmetric backend is chosen automatically only over NVLink: CUDA peer access
// over PCIe maps the memory too, but there the copy engines' pushes contend with the host's
// traffic and NCCL's ring is the better default.
#pragma once

#include <string>

namespace meshla::detail {

// "" when NVML reports NVLink peer-to-peer as available between the GPUs at these PCI bus ids
// (as cudaDeviceGetPCIBusId writes them), else why not: no NVLink between them, or NVML could not
// be loaded or asked. libnvidia-ml is loaded at the first call and kept for the process's life:
// it comes with the driver, so libmeshla loads on machines without one (building needs only
// nvml.h). Thread-safe.
std::string why_not_nvlink(const char* pci_bus_id, const char* peer_pci_bus_id);

}  // namespace meshla::detail
