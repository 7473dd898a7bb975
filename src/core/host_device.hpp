// Functions that run on the host and on the device: __host__ __device__ under nvcc, plain functions
// in translation units for the host alone (the CPU tests among them).
#pragma once

#ifdef __CUDACC__
#define MESHLA_HOST_DEVICE __host__ __device__
#else
#define MESHLA_HOST_DEVICE
#endif
