// Host-side layout of the symmetric (copy-engine) backend: which rows each rank computes, sends
// and receives, and in what order. Pure functions, tested on the CPU.
//
// all_gather_matmul: rank r multiplies its own block first, straight from its input, while it
// pushes that block into slot r of every peer's gathered buffer. Then it multiplies the blocks
// that arrived, as the few contiguous row ranges they form.
//
// matmul_reduce_scatter / matmul_all_reduce, in `rounds` rounds: each rank's output rows are cut
// into `rounds` equal sub-blocks. In round i rank r multiplies sub-block i of every peer's rows
// (peers in ring order, r+1 first, so that the peers do not all push to the same rank at once),
// pushing each product into the owner's inbox; its own sub-block comes last, then it sums its
// inbox. An all-reduce then pushes each summed sub-block to every peer, while the next round's
// GEMMs run.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "meshla/collective_matmul.hpp"

namespace meshla::overlap {

// Peers of `rank` in ring order: rank+1, rank+2, ... (mod tp).
std::vector<int> ring_peers(int tp, int rank);

// Consecutive ranks [first, first + count).
struct RankRange {
  int first = 0;
  int count = 0;
};

// The ranks other than `rank` as the fewest contiguous ranges, those after `rank` first.
std::vector<RankRange> other_ranks(int tp, int rank);

// First row of round `round`'s sub-block of `owner`'s rows, for a reduce-scatter or all-reduce of
// m rows.
std::int64_t sub_block_begin(std::int64_t m, int tp, int rounds, int owner, int round);

// Why the symmetric backend cannot run `config` on tp ranks, or "" when it can. Used to reject a
// request for it and to let kAuto fall back to NCCL.
std::string symmetric_unsupported(const CollectiveMatmulConfig& config, int tp);

// Default rounds of a reduce-scatter or all-reduce on the symmetric backend.
int default_rounds(CollectiveOp op, int tp, std::int64_t m);

}  // namespace meshla::overlap
