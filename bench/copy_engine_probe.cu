// How fast do copy engines move data between the GPUs of one process, alone and while every GPU
// runs a GEMM? The symmetric backend's pushes are cudaMemcpyAsync into peer memory; this times
// the patterns it could use: one push, a push and a pull at once (the two directions of a link),
// one GPU pushing to every peer at once (one stream per peer) or one after another (one stream),
// and a local copy. Each pattern runs alone, then again while a cuBLAS GEMM (bf16, 8192 x 7168 x
// 8192) runs on every GPU. Prints the best of 5 timings of each, in GB/s of data moved.
//
//   meshla_copy_engine_probe     (every visible GPU, at least 2, peer access between all)
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "probe_check.hpp"

namespace {

constexpr std::size_t kBytes = std::size_t{256} << 20;
constexpr int kGemmM = 8192, kGemmN = 7168, kGemmK = 8192;

struct Gpu {
  void* source = nullptr;             // kBytes, copied from
  void* target = nullptr;             // kBytes per GPU: slot p is written by GPU p
  std::vector<cudaStream_t> streams;  // one per GPU, for copies
  cudaStream_t gemm_stream = nullptr;
  cublasHandle_t blas = nullptr;
  void *a = nullptr, *b = nullptr, *c = nullptr;  // the GEMM's operands
};

class Probe {
 public:
  Probe() {
    int count = 0;
    PROBE_CHECK(cudaGetDeviceCount(&count));
    if (count < 2) {
      std::fprintf(stderr, "needs at least 2 GPUs, found %d\n", count);
      std::exit(1);
    }
    gpus_.resize(static_cast<std::size_t>(count));
    for (int d = 0; d < count; ++d) {
      Gpu& gpu = gpus_[static_cast<std::size_t>(d)];
      PROBE_CHECK(cudaSetDevice(d));
      for (int peer = 0; peer < count; ++peer) {
        if (peer != d) PROBE_CHECK(cudaDeviceEnablePeerAccess(peer, 0));
      }
      PROBE_CHECK(cudaMalloc(&gpu.source, kBytes));
      PROBE_CHECK(cudaMalloc(&gpu.target, kBytes * static_cast<std::size_t>(count)));
      gpu.streams.resize(static_cast<std::size_t>(count));
      for (cudaStream_t& stream : gpu.streams) {
        PROBE_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      }
      PROBE_CHECK(cudaStreamCreateWithFlags(&gpu.gemm_stream, cudaStreamNonBlocking));
      if (cublasCreate(&gpu.blas) != CUBLAS_STATUS_SUCCESS) std::exit(1);
      cublasSetStream(gpu.blas, gpu.gemm_stream);
      PROBE_CHECK(cudaMalloc(&gpu.a, std::size_t{2} * kGemmM * kGemmK));
      PROBE_CHECK(cudaMalloc(&gpu.b, std::size_t{2} * kGemmK * kGemmN));
      PROBE_CHECK(cudaMalloc(&gpu.c, std::size_t{2} * kGemmM * kGemmN));
      PROBE_CHECK(cudaMemset(gpu.a, 0, std::size_t{2} * kGemmM * kGemmK));
      PROBE_CHECK(cudaMemset(gpu.b, 0, std::size_t{2} * kGemmK * kGemmN));
    }
  }

  int count() const { return static_cast<int>(gpus_.size()); }

  // GPU `from` copies kBytes into GPU `to`'s slot `from`, on GPU `issuer`'s stream `stream`.
  void copy(int from, int to, int issuer, int stream) {
    char* target = static_cast<char*>(gpu(to).target) + kBytes * static_cast<std::size_t>(from);
    PROBE_CHECK(cudaMemcpyAsync(target, gpu(from).source, kBytes, cudaMemcpyDefault,
                                gpu(issuer).streams[static_cast<std::size_t>(stream)]));
  }

  // Prints the best of 5 timings of `issue` (which moves `copies` x kBytes), alone or during
  // `gemms` GEMMs on every GPU (enough to outlast the copies).
  void time(const char* name, int copies, const std::function<void()>& issue, int gemms) {
    double best = 1e30;
    for (int repeat = 0; repeat < 6; ++repeat) {
      synchronize();
      for (int d = 0; d < count(); ++d) {
        PROBE_CHECK(cudaSetDevice(d));
        for (int i = 0; i < gemms; ++i) gemm(gpu(d));
      }
      const auto start = now();
      issue();
      for (int d = 0; d < count(); ++d) {
        for (cudaStream_t stream : gpu(d).streams) PROBE_CHECK(cudaStreamSynchronize(stream));
      }
      const double seconds = now() - start;
      if (repeat > 0 && seconds < best) best = seconds;  // the first is a warm-up
    }
    synchronize();
    std::printf("%-64s %8.3f ms %7.1f GB/s\n", name, best * 1e3,
                static_cast<double>(copies) * kBytes / best / 1e9);
  }

 private:
  Gpu& gpu(int d) { return gpus_[static_cast<std::size_t>(d)]; }

  static double now() {
    timespec t{};
    clock_gettime(CLOCK_MONOTONIC, &t);
    return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
  }

  void synchronize() {
    for (int d = 0; d < count(); ++d) {
      PROBE_CHECK(cudaSetDevice(d));
      PROBE_CHECK(cudaDeviceSynchronize());
    }
  }

  static void gemm(Gpu& gpu) {
    const float one = 1, zero = 0;
    cublasGemmEx(gpu.blas, CUBLAS_OP_N, CUBLAS_OP_N, kGemmN, kGemmM, kGemmK, &one, gpu.b,
                 CUDA_R_16BF, kGemmN, gpu.a, CUDA_R_16BF, kGemmK, &zero, gpu.c, CUDA_R_16BF, kGemmN,
                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  }

  std::vector<Gpu> gpus_;
};

}  // namespace

int main() {
  Probe probe;
  const int peers = probe.count() - 1;
  std::printf("%d GPUs, %zu MiB per copy\n", probe.count(), kBytes >> 20);
  for (const int gemms : {0, 4}) {
    std::printf(gemms == 0 ? "-- alone\n" : "-- while every GPU runs GEMMs\n");
    probe.time(
        "push 0 -> 1", 1, [&] { probe.copy(0, 1, 0, 0); }, gemms);
    probe.time(
        "push 0 -> 1 and pull 1 -> 0, both issued by GPU 0", 2,
        [&] {
          probe.copy(0, 1, 0, 0);
          probe.copy(1, 0, 0, 1);
        },
        gemms);
    probe.time(
        "GPU 0 pushes to every peer, one stream each", peers,
        [&] {
          for (int p = 1; p <= peers; ++p) probe.copy(0, p, 0, p);
        },
        gemms);
    probe.time(
        "GPU 0 pushes to every peer, one stream", peers,
        [&] {
          for (int p = 1; p <= peers; ++p) probe.copy(0, p, 0, 0);
        },
        gemms);
    probe.time(
        "every GPU pushes to every peer, one stream per peer", peers * probe.count(),
        [&] {
          for (int g = 0; g < probe.count(); ++g) {
            for (int p = 0; p < probe.count(); ++p) {
              if (p != g) probe.copy(g, p, g, p);
            }
          }
        },
        gemms);
    probe.time(
        "local copy on GPU 0", 1, [&] { probe.copy(0, 0, 0, 0); }, gemms);
  }
  return 0;
}
