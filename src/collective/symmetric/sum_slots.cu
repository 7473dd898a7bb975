#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "collective/symmetric/sum_slots.hpp"
#include "core/cuda_checks.hpp"

namespace meshla::collective {
namespace {

// Elements per 16-byte vector.
template <typename T>
constexpr int kLanes = 16 / sizeof(T);

template <typename T>
struct alignas(16) Vector {
  T lane[kLanes<T>];
};

// Where a sum goes: this rank's output and, for an all-reduce's last round, peers' memory.
template <typename T>
struct Outputs {
  T* at[kMaxSumOutputs];
  int count;
};

// Each thread sums whole 16-byte vectors; the caller guarantees alignment and a count that is a
// multiple of the vector width.
template <typename T>
__global__ void sum_slots_kernel(const Vector<T>* slots, std::int64_t slot_stride, int slot_count,
                                 std::int64_t vectors, Outputs<Vector<T>> outs) {
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       i < vectors; i += step) {
    float sum[kLanes<T>] = {};
    for (int slot = 0; slot < slot_count; ++slot) {
      const Vector<T> v = slots[slot * slot_stride + i];
#pragma unroll
      for (int lane = 0; lane < kLanes<T>; ++lane) sum[lane] += static_cast<float>(v.lane[lane]);
    }
    Vector<T> result;
#pragma unroll
    for (int lane = 0; lane < kLanes<T>; ++lane) result.lane[lane] = static_cast<T>(sum[lane]);
    for (int o = 0; o < outs.count; ++o) outs.at[o][i] = result;
  }
}

template <typename T>
__global__ void sum_slots_scalar_kernel(const T* slots, std::int64_t slot_stride, int slot_count,
                                        std::int64_t count, Outputs<T> outs) {
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += step) {
    float sum = 0.0f;
    for (int slot = 0; slot < slot_count; ++slot) {
      sum += static_cast<float>(slots[slot * slot_stride + i]);
    }
    const T result = static_cast<T>(sum);
    for (int o = 0; o < outs.count; ++o) outs.at[o][i] = result;
  }
}

int grid_for(std::int64_t items, int threads) {
  // A few waves of blocks over the device; the loops stride over the rest.
  return static_cast<int>(std::clamp<std::int64_t>((items + threads - 1) / threads, 1, 1024));
}

template <typename U>
Outputs<U> outputs_of(void* const* outs, int out_count) {
  Outputs<U> result{};
  result.count = out_count;
  for (int o = 0; o < out_count; ++o) result.at[o] = static_cast<U*>(outs[o]);
  return result;
}

template <typename T>
void launch(const void* slots_base, std::int64_t slot_stride, int slots, std::int64_t count,
            void* const* outs, int out_count, cudaStream_t stream) {
  constexpr int kThreads = 512;
  const auto aligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; };
  if (count % kLanes<T> == 0 && slot_stride % kLanes<T> == 0 && aligned(slots_base) &&
      std::all_of(outs, outs + out_count, aligned)) {
    const std::int64_t vectors = count / kLanes<T>;
    sum_slots_kernel<T><<<grid_for(vectors, kThreads), kThreads, 0, stream>>>(
        static_cast<const Vector<T>*>(slots_base), slot_stride / kLanes<T>, slots, vectors,
        outputs_of<Vector<T>>(outs, out_count));
  } else {
    sum_slots_scalar_kernel<T><<<grid_for(count, kThreads), kThreads, 0, stream>>>(
        static_cast<const T*>(slots_base), slot_stride, slots, count,
        outputs_of<T>(outs, out_count));
  }
  MESHLA_CHECK_CUDA(cudaGetLastError());
}

template <typename T>
void load() {
  cudaFuncAttributes attributes{};
  MESHLA_CHECK_CUDA(cudaFuncGetAttributes(&attributes, sum_slots_kernel<T>));
  MESHLA_CHECK_CUDA(cudaFuncGetAttributes(&attributes, sum_slots_scalar_kernel<T>));
}

}  // namespace

void load_sum_slots(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return load<__nv_bfloat16>();
    case DType::kFloat16:
      return load<__half>();
    case DType::kFloat32:
      return load<float>();
    default:
      MESHLA_THROW(kNotImplemented, "sum_slots: dtype " << dtype_name(dtype));
  }
}

void sum_slots(DType dtype, const void* slots_base, std::int64_t slot_stride, int slots,
               std::int64_t count, void* const* outs, int out_count, cudaStream_t stream) {
  MESHLA_ASSERT(out_count > 0);
  if (count == 0) return;
  // More outputs than one launch carries: each further launch sums again for the next ones.
  if (out_count > kMaxSumOutputs) {
    sum_slots(dtype, slots_base, slot_stride, slots, count, outs, kMaxSumOutputs, stream);
    return sum_slots(dtype, slots_base, slot_stride, slots, count, outs + kMaxSumOutputs,
                     out_count - kMaxSumOutputs, stream);
  }
  switch (dtype) {
    case DType::kBFloat16:
      return launch<__nv_bfloat16>(slots_base, slot_stride, slots, count, outs, out_count, stream);
    case DType::kFloat16:
      return launch<__half>(slots_base, slot_stride, slots, count, outs, out_count, stream);
    case DType::kFloat32:
      return launch<float>(slots_base, slot_stride, slots, count, outs, out_count, stream);
    default:
      MESHLA_THROW(kNotImplemented, "sum_slots: dtype " << dtype_name(dtype));
  }
}

}  // namespace meshla::collective
