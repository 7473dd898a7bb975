// Host-side layout of the symmetric (copy-engine) backend: which rows each rank computes, sends
// and receives, and in what order. Pure functions, tested on the CPU.
//
// all_gather_matmul: rank r multiplies its own block first, straight from its input, while it
// pushes that block into slot r of every peer's gathered buffer, peers in ring order. Then it
// multiplies the other blocks in the order they arrive. A GPU's copy engine runs its
// pushes one after another (measured on 4x H200: three 32 MiB pushes took 190, 160 and 150 us in
// sequence, not together), so block r-1 lands first, r-2 second, and so on: each GEMM then
// hides the next block's transfer, where waiting for all blocks before one large GEMM left
// 40% of the transfer time exposed. After the first, the blocks are multiplied two at a time
// (arrival_batches).
//
// matmul_reduce_scatter / matmul_all_reduce, in `rounds` rounds: each rank's output rows are cut
// into `rounds` equal sub-blocks. In round i rank r multiplies sub-block i of every peer's rows
// (peers in ring order, r+1 first, so that the peers do not all push to the same rank at once),
// pushing each product into the owner's inbox; its own sub-block comes last, then it sums its
// inbox. An all-reduce then pushes each summed sub-block to every peer, while the next round's
// GEMMs run; its last round's sum stores itself into every peer on SMs instead.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "collective/group_workspace.hpp"
#include "meshla/collective_matmul.hpp"

namespace meshla::collective {

// Peers of `rank` in ring order: rank+1, rank+2, ... (mod tp).
std::vector<int> ring_peers(int tp, int rank);

// The order in which the other ranks' pushes reach `rank` when every rank pushes to its
// ring_peers in order: rank-1, rank-2, ... (mod tp).
std::vector<int> arrival_order(int tp, int rank);

// all_gather_matmul's GEMMs over the blocks `rank` receives, in order, each a list of source
// ranks in ascending order (the GEMM is batched over them, so its batch stride is positive): the
// first block to arrive alone, as it lands while the own block's GEMM runs, then the others two
// at a time in arrival order. A block of m/tp rows rarely fills whole waves of tiles; two
// batched blocks lose half as much to the last, partial wave.
std::vector<std::vector<int>> arrival_batches(int tp, int rank);

// First row of round `round`'s sub-block of `owner`'s rows, for a reduce-scatter or all-reduce of
// m rows.
std::int64_t sub_block_begin(std::int64_t m, int tp, int rounds, int owner, int round);

// Why the symmetric backend cannot run `config` on tp ranks, or "" when it can. Used to reject a
// request for it and to let kAuto fall back to NCCL.
std::string symmetric_unsupported(const CollectiveMatmulConfig& config, int tp);

// The part of symmetric_unsupported that a float8 call's rowwise scales add (kNotImplemented
// when asked for): a GEMM of the symmetric plan would start at a row whose scales are not 16
// bytes aligned (rowwise_scale_row_problem). "" when there is none or the call is not rowwise.
std::string symmetric_rowwise_problem(const CollectiveMatmulConfig& config, int tp);

// Rowwise scales are read from the first row of each GEMM (and of each batch member) on, 16
// bytes aligned by the Hopper kernel: why a GEMM of `config`'s plan starting at `row` cannot run,
// or "" where the row is a multiple of 4.
std::string rowwise_scale_row_problem(const CollectiveMatmulConfig& config, int tp,
                                      std::int64_t row);

// Default rounds of a reduce-scatter or all-reduce of m rows on the symmetric backend.
int default_rounds(CollectiveOp op, int tp, std::int64_t m);

// The shared memory a resolved symmetric config uses on each of tp ranks:
//   signals  32-bit flags: free[tp], then arrived[rounds][tp], then reduced[rounds][tp]
//   data     all_gather_matmul: the gathered a [m, k], rank q's block at its rows, then (rowwise
//            float8) its rows' scales [m] from gathered_scales_offset on;
//            reduce ops: inbox[round][source], the sub-blocks of partial products this rank owns
//            ([m, n] in all), and for an all-reduce the summed rows of every rank ([m, n]) after it
//   scratch  reduce ops: [round][destination] partial products before their push ([m, n])
// Partial products are in product_dtype(config), a's rows in its dtype (float8: one byte).
collective::GroupWorkspace::Sizes symmetric_workspace_sizes(const CollectiveMatmulConfig& config,
                                                            int tp);

// all_gather_matmul with rowwise float8 scales: where the gathered rows' scales start in data.
std::size_t gathered_scales_offset(const CollectiveMatmulConfig& config);

}  // namespace meshla::collective
