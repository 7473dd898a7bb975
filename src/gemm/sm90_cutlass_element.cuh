// meshla's dtypes as CUTLASS's element types, for the Hopper kernels of gemm/ (the grouped GEMM
// and the rowwise-scaled fp8 GEMM): one table, each kernel instantiating the ones it takes.
#pragma once

#include <cutlass/numeric_types.h>

#include "meshla/tensor.hpp"

namespace meshla::gemm {

template <DType dtype>
struct CutlassElement;
template <>
struct CutlassElement<DType::kBFloat16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct CutlassElement<DType::kFloat16> {
  using type = cutlass::half_t;
};
template <>
struct CutlassElement<DType::kFloat32> {
  using type = float;
};
template <>
struct CutlassElement<DType::kFloat8E4M3> {
  using type = cutlass::float_e4m3_t;
};
template <>
struct CutlassElement<DType::kFloat8E5M2> {
  using type = cutlass::float_e5m2_t;
};

}  // namespace meshla::gemm
