// Times cuSOLVERMp's Cholesky factorization (potrf) on a 2-D block-cyclic process grid, for issue
// 5's question: does cuSOLVERMp over P GPUs scale better than cuSolverMg's 1-D layout (2.62x on 4
// H200 at n=65536 fp64)? A measurement tool, not part of the library: a shared library driven by
// bench/cusolvermp_potrf.py under torchrun, which hands every rank the NCCL unique id.
//
// Each repetition regenerates a diagonally dominant symmetric A (so it is positive definite) in
// place, then times potrf alone with events on the rank's stream.
#include <cuda_runtime.h>
#include <cusolverMp.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>

namespace {

struct Failure {
  std::string what;
};

#define PROBE_CHECK(call, ok_value)                                   \
  do {                                                                \
    const auto status_ = (call);                                      \
    if (status_ != (ok_value)) {                                      \
      throw Failure{std::string(#call) + " failed with status " +     \
                    std::to_string(static_cast<long long>(status_))}; \
    }                                                                 \
  } while (0)

// The global index of local row (or column) `local` of process coordinate `coordinate` in a
// block-cyclic distribution starting at process 0.
__device__ std::int64_t global_index(std::int64_t local, std::int64_t block, int coordinate,
                                     int processes) {
  return (local / block * processes + coordinate) * block + local % block;
}

// A(i, j) = n on the diagonal, a value in [-0.5, 0.5) that depends only on {i, j} elsewhere.
__global__ void fill_spd(double* a, std::int64_t rows, std::int64_t cols, std::int64_t lld,
                         std::int64_t n, std::int64_t block, int my_row, int my_col, int nprow,
                         int npcol, unsigned seed) {
  const std::int64_t count = rows * cols;
  for (std::int64_t k = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; k < count;
       k += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t lr = k % rows;
    const std::int64_t lc = k / rows;
    const std::int64_t i = global_index(lr, block, my_row, nprow);
    const std::int64_t j = global_index(lc, block, my_col, npcol);
    double value = static_cast<double>(n);
    if (i != j) {
      std::uint64_t h = (static_cast<std::uint64_t>(i < j ? i : j) << 32) ^
                        static_cast<std::uint64_t>(i < j ? j : i) ^ seed;
      h ^= h >> 33;
      h *= 0xff51afd7ed558ccdull;
      h ^= h >> 33;
      value = static_cast<double>(h >> 11) / 9007199254740992.0 - 0.5;
    }
    a[lc * lld + lr] = value;
  }
}

}  // namespace

// Waits for `event` until `seconds` have passed. A rank whose peer failed (out of memory, say)
// would otherwise wait forever inside cuSOLVERMp's NCCL calls; the caller aborts the communicator.
void wait_or_throw(cudaEvent_t event, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  cudaError_t status;
  while ((status = cudaEventQuery(event)) == cudaErrorNotReady) {
    if (std::chrono::steady_clock::now() > deadline) {
      throw Failure{"potrf did not finish within " + std::to_string(seconds) + " s"};
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  PROBE_CHECK(status, cudaSuccess);
}

// Writes a fresh NCCL unique id (128 bytes) for the ranks of one measurement; returns 0 on success.
extern "C" int cusolvermp_unique_id(void* out) {
  ncclUniqueId id;
  if (ncclGetUniqueId(&id) != ncclSuccess) return 1;
  __builtin_memcpy(out, &id, sizeof(id));
  return 0;
}

// Returns 0 and fills seconds[0..reps) and *info, or returns 1 with the failing call in `error`.
extern "C" int cusolvermp_potrf_seconds(const void* unique_id, int rank, int size, int device,
                                        int nprow, int npcol, long long n, long long block,
                                        int reps, double timeout_seconds, double* seconds,
                                        int* info, char* error, int error_bytes) {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  cusolverMpHandle_t handle = nullptr;
  cusolverMpGrid_t grid = nullptr;
  cusolverMpMatrixDescriptor_t desc = nullptr;
  double* a = nullptr;
  void* device_work = nullptr;
  int* device_info = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  int result = 0;
  try {
    PROBE_CHECK(cudaSetDevice(device), cudaSuccess);
    ncclUniqueId id;
    static_assert(sizeof(id) == 128);
    __builtin_memcpy(&id, unique_id, sizeof(id));
    PROBE_CHECK(ncclCommInitRank(&comm, size, id, rank), ncclSuccess);
    PROBE_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    PROBE_CHECK(cudaEventCreate(&start), cudaSuccess);
    PROBE_CHECK(cudaEventCreate(&stop), cudaSuccess);
    PROBE_CHECK(cusolverMpCreate(&handle, device, stream), CUSOLVER_STATUS_SUCCESS);
    PROBE_CHECK(cusolverMpCreateDeviceGrid(handle, &grid, comm, nprow, npcol,
                                           CUSOLVERMP_GRID_MAPPING_COL_MAJOR),
                CUSOLVER_STATUS_SUCCESS);
    // Column-major process mapping: rank = row + col * nprow.
    const int my_row = rank % nprow;
    const int my_col = rank / nprow;
    const std::int64_t rows = cusolverMpNUMROC(n, block, my_row, 0, nprow);
    const std::int64_t cols = cusolverMpNUMROC(n, block, my_col, 0, npcol);
    const std::int64_t lld = rows > 1 ? rows : 1;
    PROBE_CHECK(cudaMalloc(&a, sizeof(double) * lld * (cols > 1 ? cols : 1)), cudaSuccess);
    PROBE_CHECK(cudaMalloc(&device_info, sizeof(int)), cudaSuccess);
    PROBE_CHECK(cusolverMpCreateMatrixDesc(&desc, grid, CUDA_R_64F, n, n, block, block, 0, 0, lld),
                CUSOLVER_STATUS_SUCCESS);
    std::size_t device_bytes = 0, host_bytes = 0;
    PROBE_CHECK(cusolverMpPotrf_bufferSize(handle, CUBLAS_FILL_MODE_LOWER, n, a, 1, 1, desc,
                                           CUDA_R_64F, &device_bytes, &host_bytes),
                CUSOLVER_STATUS_SUCCESS);
    if (cudaMalloc(&device_work, device_bytes > 0 ? device_bytes : 1) != cudaSuccess) {
      std::size_t free_bytes = 0, total_bytes = 0;
      cudaMemGetInfo(&free_bytes, &total_bytes);
      throw Failure{"cusolverMpPotrf_bufferSize asked for " + std::to_string(device_bytes) +
                    " device bytes; " + std::to_string(free_bytes) + " of " +
                    std::to_string(total_bytes) + " are free"};
    }
    std::string host_work(host_bytes, '\0');
    for (int rep = 0; rep < reps; ++rep) {
      fill_spd<<<1024, 256, 0, stream>>>(a, rows, cols, lld, n, block, my_row, my_col, nprow, npcol,
                                         1234u + rep);
      PROBE_CHECK(cudaGetLastError(), cudaSuccess);
      PROBE_CHECK(cudaStreamSynchronize(stream), cudaSuccess);
      PROBE_CHECK(cudaEventRecord(start, stream), cudaSuccess);
      PROBE_CHECK(
          cusolverMpPotrf(handle, CUBLAS_FILL_MODE_LOWER, n, a, 1, 1, desc, CUDA_R_64F, device_work,
                          device_bytes, host_work.data(), host_bytes, device_info),
          CUSOLVER_STATUS_SUCCESS);
      PROBE_CHECK(cudaEventRecord(stop, stream), cudaSuccess);
      wait_or_throw(stop, timeout_seconds);
      float ms = 0;
      PROBE_CHECK(cudaEventElapsedTime(&ms, start, stop), cudaSuccess);
      seconds[rep] = ms / 1000.0;
    }
    PROBE_CHECK(cudaMemcpy(info, device_info, sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
  } catch (const Failure& failure) {
    std::snprintf(error, static_cast<std::size_t>(error_bytes), "%s", failure.what.c_str());
    result = 1;
    // Ends this rank's pending NCCL work (and lets the peers' time out) instead of waiting on it.
    if (comm) ncclCommAbort(comm);
    comm = nullptr;
  }
  if (desc) cusolverMpDestroyMatrixDesc(desc);
  if (grid) cusolverMpDestroyGrid(grid);
  if (handle) cusolverMpDestroy(handle);
  cudaFree(device_work);
  cudaFree(device_info);
  cudaFree(a);
  if (start) cudaEventDestroy(start);
  if (stop) cudaEventDestroy(stop);
  if (stream) cudaStreamDestroy(stream);
  if (comm) ncclCommDestroy(comm);
  return result;
}
