// Does a GEMM overlap a concurrent transfer on one GPU? Times a cuBLASLt GEMM (through meshla's
// Matmul, with and without an SM count target) alone, a transfer alone (an SM copy kernel with a
// fixed number of thread blocks, standing in for NCCL's kernels, or a copy-engine memcpy), and
// both at once on two streams, the transfer's at high priority. Prints one row per combination:
// if the pair overlaps, `both` is close to max(gemm, transfer) and `gemm_in_both` close to `gemm`.
//
//   meshla_overlap_probe [iterations]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "meshla/matmul.hpp"

#include "probe_check.hpp"

namespace {

__global__ void fill(__nv_bfloat16* data, size_t count, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x) {
    data[i] = __float2bfloat16(scale * __sinf(0.37f * float(i % 100003)));
  }
}

__global__ void sm_copy(const int4* src, int4* dst, size_t count) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x) {
    dst[i] = src[i];
  }
}

struct Timer {
  cudaEvent_t start, stop;
  Timer() {
    PROBE_CHECK(cudaEventCreate(&start));
    PROBE_CHECK(cudaEventCreate(&stop));
  }
  ~Timer() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;
  float ms() {
    PROBE_CHECK(cudaEventSynchronize(stop));
    float value = 0;
    PROBE_CHECK(cudaEventElapsedTime(&value, start, stop));
    return value;
  }
};

// Milliseconds per call of `work` (which enqueues on `stream`), after one warm-up call.
template <typename Work>
float ms_per_call(Work work, cudaStream_t stream, int iterations) {
  Timer timer;
  work();
  PROBE_CHECK(cudaEventRecord(timer.start, stream));
  for (int i = 0; i < iterations; ++i) work();
  PROBE_CHECK(cudaEventRecord(timer.stop, stream));
  return timer.ms() / iterations;
}

}  // namespace

int main(int argc, char** argv) {
  const int iterations = argc > 1 ? std::atoi(argv[1]) : 10;
  cudaDeviceProp props{};
  PROBE_CHECK(cudaGetDeviceProperties(&props, 0));
  const int sms = props.multiProcessorCount;
  const std::int64_t max_rows = 8192, n = 7168, k = 8192;
  // Three ring passes of a 2048-row block of a [*, 8192] bf16 activation: 96 MiB.
  const size_t transfer_bytes = size_t(3) * 2048 * k * 2;

  __nv_bfloat16 *a, *b, *d;
  void *src, *dst;
  PROBE_CHECK(cudaMalloc(&a, max_rows * k * 2));
  PROBE_CHECK(cudaMalloc(&b, k * n * 2));
  PROBE_CHECK(cudaMalloc(&d, max_rows * n * 2));
  PROBE_CHECK(cudaMalloc(&src, transfer_bytes));
  PROBE_CHECK(cudaMalloc(&dst, transfer_bytes));
  fill<<<1024, 256>>>(a, max_rows * k, 1.0f);
  fill<<<1024, 256>>>(b, k * n, 0.01f);
  fill<<<1024, 256>>>(static_cast<__nv_bfloat16*>(src), transfer_bytes / 2, 1.0f);
  PROBE_CHECK(cudaDeviceSynchronize());

  int least = 0, greatest = 0;
  PROBE_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t compute, transfer;
  PROBE_CHECK(cudaStreamCreateWithPriority(&compute, cudaStreamNonBlocking, least));
  PROBE_CHECK(cudaStreamCreateWithPriority(&transfer, cudaStreamNonBlocking, greatest));
  cudaEvent_t fork;
  PROBE_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));

  meshla::Matmul matmul(0);
  std::printf("%s, %d SMs, %d iterations\n", props.name, sms, iterations);
  std::printf("%6s %6s %-10s %9s %9s %9s %12s\n", "rows", "sm_cap", "transfer", "gemm_ms",
              "xfer_ms", "both_ms", "gemm_in_both");
  for (std::int64_t rows : {std::int64_t(2048), max_rows}) {
    for (int cap : {0, sms - 8, sms - 16}) {
      meshla::MatmulShape shape{
          .dtype = meshla::DType::kBFloat16, .m = rows, .n = n, .k = k, .sm_count = cap};
      matmul.prepare(shape);
      const meshla::MatmulOperands ops{.a = a, .b = b, .d = d};
      auto gemm = [&] { matmul.run(shape, ops, compute); };
      const float gemm_ms = ms_per_call(gemm, compute, iterations);
      for (int blocks : {0, 8, 16, 32}) {  // 0: copy engine (cudaMemcpyAsync)
        auto move = [&] {
          if (blocks == 0) {
            PROBE_CHECK(
                cudaMemcpyAsync(dst, src, transfer_bytes, cudaMemcpyDeviceToDevice, transfer));
          } else {
            sm_copy<<<blocks, 512, 0, transfer>>>(static_cast<const int4*>(src),
                                                  static_cast<int4*>(dst), transfer_bytes / 16);
          }
        };
        const float transfer_ms = ms_per_call(move, transfer, iterations);
        // Together: each iteration forks the transfer off the compute stream, then joins it.
        Timer both;
        std::vector<Timer> gemm_parts(iterations);
        PROBE_CHECK(cudaDeviceSynchronize());
        PROBE_CHECK(cudaEventRecord(both.start, compute));
        for (Timer& part : gemm_parts) {
          PROBE_CHECK(cudaEventRecord(fork, compute));
          PROBE_CHECK(cudaStreamWaitEvent(transfer, fork, 0));
          move();
          PROBE_CHECK(cudaEventRecord(part.start, compute));
          gemm();
          PROBE_CHECK(cudaEventRecord(part.stop, compute));
          PROBE_CHECK(cudaEventRecord(fork, transfer));
          PROBE_CHECK(cudaStreamWaitEvent(compute, fork, 0));
        }
        PROBE_CHECK(cudaEventRecord(both.stop, compute));
        float gemm_in_both = 0;
        for (Timer& part : gemm_parts) gemm_in_both += part.ms();
        const float both_ms = both.ms() / iterations;
        std::printf("%6lld %6d %-10s %9.3f %9.3f %9.3f %12.3f\n", static_cast<long long>(rows), cap,
                    blocks == 0 ? "copy-eng" : (std::to_string(blocks) + "-cta").c_str(), gemm_ms,
                    transfer_ms, both_ms, gemm_in_both / iterations);
      }
    }
  }
  return 0;
}
