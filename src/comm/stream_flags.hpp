// Stream-ordered 32-bit flags in device memory, local or mapped from a peer, set and awaited by
// the GPU's front end (cuStreamWriteValue32 / cuStreamWaitValue32): no kernel, no SM. They order
// copy-engine transfers between ranks without taking SMs from the GEMM, and they are captured
// into CUDA graphs like any other stream work.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace meshla::detail {

// Sets *flag = value once the stream's earlier work (copies into peer memory included) is
// visible to whoever sees the new value.
void write_flag(cudaStream_t stream, std::uint32_t* flag, std::uint32_t value);

// Holds the stream's later work until *flag == value.
void wait_flag(cudaStream_t stream, std::uint32_t* flag, std::uint32_t value);

}  // namespace meshla::detail
