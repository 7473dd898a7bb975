// cuSOLVERMp, opened at run time, as cuBLASMp is (collective/cublasmp/cublasmp_library.hpp):
// libmeshla loads without it, and the process solver reports why it is missing when asked for.
//
// Built against cuSOLVERMp 0.8, the last release that runs on NCCL 2.28 (0.9 needs cuBLASMp 0.10
// and so NCCL 2.29); it takes the NCCL communicator itself for its process grid.
#pragma once

#include <string>

#include <cusolverMp.h>

namespace meshla::solver {

struct CusolverMpLibrary {
  decltype(&cusolverMpCreate) create;
  decltype(&cusolverMpDestroy) destroy;
  decltype(&cusolverMpGetVersion) get_version;
  decltype(&cusolverMpCreateDeviceGrid) create_grid;
  decltype(&cusolverMpDestroyGrid) destroy_grid;
  decltype(&cusolverMpCreateMatrixDesc) create_matrix;
  decltype(&cusolverMpDestroyMatrixDesc) destroy_matrix;
  decltype(&cusolverMpPotrf_bufferSize) potrf_buffer_size;
  decltype(&cusolverMpPotrf) potrf;
  decltype(&cusolverMpPotrs_bufferSize) potrs_buffer_size;
  decltype(&cusolverMpPotrs) potrs;
  decltype(&cusolverMpGetrf_bufferSize) getrf_buffer_size;
  decltype(&cusolverMpGetrf) getrf;
  decltype(&cusolverMpGetrs_bufferSize) getrs_buffer_size;
  decltype(&cusolverMpGetrs) getrs;
};

// The library, opened once per process (MESHLA_CUSOLVERMP_LIBRARY names the file; otherwise
// libcusolverMp.so.0 on libmeshla's run path, which includes the nvidia-cusolvermp-cu13 wheel
// beside an installed meshla). nullptr, with `why` set, when it cannot be opened or lacks a
// function meshla calls. Its version is checked against the header's once a handle exists
// (cusolverMpGetVersion takes one): see ProcessSolver.
const CusolverMpLibrary* cusolvermp_library(std::string* why);

}  // namespace meshla::solver
