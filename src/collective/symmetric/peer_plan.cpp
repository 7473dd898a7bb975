#include "collective/symmetric/peer_plan.hpp"

#include <algorithm>
#include <sstream>

#include "core/alignment.hpp"

namespace meshla::collective {

std::vector<int> ring_peers(int tp, int rank) {
  std::vector<int> peers;
  for (int distance = 1; distance < tp; ++distance) peers.push_back((rank + distance) % tp);
  return peers;
}

std::vector<int> arrival_order(int tp, int rank) {
  std::vector<int> sources;
  for (int distance = 1; distance < tp; ++distance) sources.push_back((rank - distance + tp) % tp);
  return sources;
}

std::vector<std::vector<int>> arrival_batches(int tp, int rank) {
  const std::vector<int> sources = arrival_order(tp, rank);
  std::vector<std::vector<int>> batches;
  for (std::size_t i = 0; i < sources.size();) {
    const std::size_t count = i == 0 ? 1 : std::min<std::size_t>(2, sources.size() - i);
    std::vector<int> batch(sources.begin() + static_cast<std::ptrdiff_t>(i),
                           sources.begin() + static_cast<std::ptrdiff_t>(i + count));
    std::sort(batch.begin(), batch.end());
    batches.push_back(std::move(batch));
    i += count;
  }
  return batches;
}

std::int64_t sub_block_begin(std::int64_t m, int tp, int rounds, int owner, int round) {
  const std::int64_t per_rank = m / tp;
  return owner * per_rank + round * (per_rank / rounds);
}

std::string symmetric_unsupported(const CollectiveMatmulConfig& c, int tp) {
  std::ostringstream why;
  const std::string_view op = collective_op_name(c.op);
  if (c.algorithm != Algorithm::kAuto && c.algorithm != Algorithm::kRing) {
    why << op << ": backend=symmetric runs algorithm=ring only, not " << algorithm_name(c.algorithm)
        << "; use backend=nccl for it";
  } else if (c.comm_ctas != 0) {
    why << op << ": comm_ctas=" << c.comm_ctas
        << " limits NCCL's thread blocks and applies to backend=nccl only";
  } else if (c.m % tp != 0) {
    why << op << ": m=" << c.m << " is not divisible by tp_size=" << tp
        << " (backend=symmetric moves equal blocks)";
  } else if (c.op == CollectiveOp::kAllGatherMatmul && c.chunks > 1) {
    why << op << ": chunks=" << c.chunks
        << " but backend=symmetric moves each rank's block whole; use chunks=0 or 1";
  } else if (c.op != CollectiveOp::kAllGatherMatmul && c.chunks > 0 && (c.m / tp) % c.chunks != 0) {
    why << op << ": chunks=" << c.chunks << " rounds do not divide the m/tp_size=" << c.m / tp
        << " rows of each rank (m=" << c.m << ", tp_size=" << tp << ")";
  } else {
    why << symmetric_rowwise_problem(c, tp);
  }
  return why.str();
}

std::string symmetric_rowwise_problem(const CollectiveMatmulConfig& c, int tp) {
  if (c.scaling != MatmulScaling::kRowwise) return "";
  const int rounds = c.op == CollectiveOp::kAllGatherMatmul ? 1
                     : c.chunks > 0                         ? c.chunks
                                                            : default_rounds(c.op, tp, c.m);
  CollectiveMatmulConfig resolved = c;  // as the message names the plan
  resolved.backend = Backend::kSymmetric;
  resolved.algorithm = Algorithm::kRing;
  resolved.chunks = rounds;
  for (int owner = 0; owner < tp; ++owner) {
    for (int round = 0; round < rounds; ++round) {
      std::string why =
          rowwise_scale_row_problem(resolved, tp, sub_block_begin(c.m, tp, rounds, owner, round));
      if (!why.empty()) return why;
    }
  }
  return "";
}

std::string rowwise_scale_row_problem(const CollectiveMatmulConfig& c, int tp, std::int64_t row) {
  constexpr std::int64_t kRowsPerScaleVector = 16 / sizeof(float);
  if (row % kRowsPerScaleVector == 0) return "";
  std::ostringstream why;
  why << collective_op_name(c.op)
      << ": rowwise scales are read 16 bytes aligned, but backend=" << backend_name(c.backend)
      << " with algorithm=" << algorithm_name(c.algorithm) << " and chunks=" << c.chunks
      << " starts a GEMM at row " << row << " (m=" << c.m << ", tp_size=" << tp
      << "); use row counts (m/tp_size, chunks of it) that are multiples of " << kRowsPerScaleVector
      << ", or backend=nccl with algorithm=sequential";
  return why.str();
}

int default_rounds(CollectiveOp op, int tp, std::int64_t m) {
  // A reduce-scatter's last sum waits for every rank's last product, whatever the rounds. An
  // all-reduce ends with storing its last summed sub-block into every peer, so a second round
  // shortens that tail, as long as each GEMM keeps at least 512 rows (a full wave of 256x128
  // tiles at n=8192 on 132 SMs). More rounds lost to their smaller GEMMs and their extra
  // pushes: 4x H200, same run, 2 rounds against 4 took 1.22 against 1.28x the GEMM alone at
  // M=8192 tp=4 and 1.05 against 1.10 at M=8192 tp=2 (equal at M=16384 tp=4).
  if (op != CollectiveOp::kMatmulAllReduce) return 1;
  constexpr std::int64_t kMinRows = 512;
  const std::int64_t rows = m / tp;
  return rows % 2 == 0 && rows / 2 >= kMinRows ? 2 : 1;
}

collective::GroupWorkspace::Sizes symmetric_workspace_sizes(const CollectiveMatmulConfig& config,
                                                            int tp) {
  const auto bytes = [](std::int64_t count) { return static_cast<std::size_t>(count); };
  const int rounds = config.op == CollectiveOp::kAllGatherMatmul ? 1 : config.chunks;
  collective::GroupWorkspace::Sizes sizes{.signal_bytes = bytes(tp * (1 + 2 * rounds) * 4)};
  const std::int64_t product =
      config.m * config.n * static_cast<std::int64_t>(dtype_size(product_dtype(config)));
  switch (config.op) {
    case CollectiveOp::kAllGatherMatmul:
      sizes.data_bytes =
          config.scaling == MatmulScaling::kRowwise
              ? gathered_scales_offset(config) + sizeof(float) * bytes(config.m)
              : bytes(config.m * config.k * static_cast<std::int64_t>(dtype_size(config.dtype)));
      break;
    case CollectiveOp::kMatmulReduceScatter:
      sizes.data_bytes = bytes(product);
      sizes.scratch_bytes = bytes(product);
      break;
    case CollectiveOp::kMatmulAllReduce:
      sizes.data_bytes = bytes(2 * product);
      sizes.scratch_bytes = bytes(product);
      break;
  }
  return sizes;
}

std::size_t gathered_scales_offset(const CollectiveMatmulConfig& config) {
  return detail::align_up(static_cast<std::size_t>(config.m * config.k) * dtype_size(config.dtype));
}

}  // namespace meshla::collective
