#include "overlap/peer_plan.hpp"

#include <sstream>

namespace meshla::overlap {

std::vector<int> ring_peers(int tp, int rank) {
  std::vector<int> peers;
  for (int distance = 1; distance < tp; ++distance) peers.push_back((rank + distance) % tp);
  return peers;
}

std::vector<RankRange> other_ranks(int tp, int rank) {
  std::vector<RankRange> ranges;
  if (rank + 1 < tp) ranges.push_back({rank + 1, tp - rank - 1});
  if (rank > 0) ranges.push_back({0, rank});
  return ranges;
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
  }
  return why.str();
}

int default_rounds(CollectiveOp op, int tp, std::int64_t m) {
  // A reduce-scatter's last sum waits for every rank's last product, whatever the rounds; an
  // all-reduce's pushes of the sums overlap the next round's GEMMs, so it takes two.
  if (op != CollectiveOp::kMatmulAllReduce) return 1;
  return (m / tp) % 2 == 0 ? 2 : 1;
}

}  // namespace meshla::overlap
