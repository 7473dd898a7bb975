#include "collective/cublasmp/cublasmp_layout.hpp"

namespace meshla::collective {

CublasMpLayout cublasmp_layout(const CollectiveMatmulConfig& c, std::int64_t p) {
  CublasMpLayout layout{};
  layout.transpose_a = c.trans_b;
  if (c.op == CollectiveOp::kAllGatherMatmul) {
    layout.shape = {c.n * p, c.m, c.k};
    layout.a = c.trans_b ? CublasMpOperand{c.k, c.n * p, c.k, c.n, false}
                         : CublasMpOperand{c.n * p, c.k, c.n, c.k, true};
    layout.b = CublasMpOperand{c.k, c.m, c.k, c.m / p, false};
    layout.d = CublasMpOperand{c.n * p, c.m, c.n, c.m / p, true};
    layout.out_rows = c.m;
    return layout;
  }
  layout.shape = {c.n, c.m, c.k * p};
  layout.a = c.trans_b ? CublasMpOperand{c.k * p, c.n, c.k, c.n, true}
                       : CublasMpOperand{c.n, c.k * p, c.n, c.k, false};
  if (c.op == CollectiveOp::kMatmulReduceScatter) {
    layout.b = CublasMpOperand{c.k * p, c.m, c.k, c.m / p, true};
    layout.d = CublasMpOperand{c.n, c.m, c.n, c.m / p, false};
    layout.out_rows = c.m / p;
  } else {
    layout.b = CublasMpOperand{c.k * p, c.m, c.k, c.m, true};
    layout.d = CublasMpOperand{c.n, c.m * p, c.n, c.m, false};
    layout.out_rows = c.m;
  }
  return layout;
}

}  // namespace meshla::collective
