// The measurement probes' (bench/*_probe.cu) one error check: a failed CUDA runtime call prints
// itself and its error and ends the probe.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>

#define PROBE_CHECK(call)                                                          \
  do {                                                                             \
    cudaError_t status_ = (call);                                                  \
    if (status_ != cudaSuccess) {                                                  \
      std::fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(status_)); \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)
