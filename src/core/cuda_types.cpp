#include "core/cuda_types.hpp"

#include "core/checks.hpp"

namespace meshla::detail {

cudaDataType_t cuda_data_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return CUDA_R_32F;
    case DType::kFloat64:
      return CUDA_R_64F;
    case DType::kFloat16:
      return CUDA_R_16F;
    case DType::kBFloat16:
      return CUDA_R_16BF;
    case DType::kComplex64:
      return CUDA_C_32F;
    case DType::kComplex128:
      return CUDA_C_64F;
    case DType::kFloat8E4M3:
      return CUDA_R_8F_E4M3;
    case DType::kFloat8E5M2:
      return CUDA_R_8F_E5M2;
    default:
      MESHLA_THROW(kNotImplemented, "no CUDA library data type for dtype " << dtype_name(dtype));
  }
}

}  // namespace meshla::detail
