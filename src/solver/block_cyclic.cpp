#include "solver/block_cyclic.hpp"

#include <iterator>

#include "core/checks.hpp"

namespace meshla::solver {

BlockCyclicLayout make_block_cyclic_layout(std::int64_t n, std::int64_t parts, std::int64_t tile,
                                           std::int64_t largest) {
  MESHLA_CHECK_ARG(n >= 1, "dense solver: n=" << n << " must be at least 1");
  MESHLA_CHECK_ARG(parts >= 1, "dense solver: parts=" << parts << " must be at least 1");
  MESHLA_CHECK_ARG(n % parts == 0, "dense solver: n=" << n << " rows are not divisible by the "
                                                      << parts << " GPUs holding them");
  MESHLA_CHECK_ARG(tile >= 0, "dense solver: tile=" << tile << " must be positive (0: automatic)");
  BlockCyclicLayout layout;
  layout.n = n;
  layout.parts = parts;
  layout.tile = tile == 0 ? choose_tile(n, parts, largest) : tile;
  layout.rows_per_part = n / parts;
  layout.tiles_per_part = (layout.rows_per_part + layout.tile - 1) / layout.tile;
  // cuSolverMg takes the order as a 32-bit int.
  MESHLA_CHECK_ARG(layout.padded_n() <= INT32_MAX,
                   "dense solver: n=" << n << " (padded to " << layout.padded_n() << " for tile="
                                      << layout.tile << ") exceeds cuSolverMg's 32-bit order");
  return layout;
}

std::int64_t choose_tile(std::int64_t n, std::int64_t parts, std::int64_t largest) {
  MESHLA_CHECK_ARG(n >= 1 && parts >= 1 && n % parts == 0,
                   "choose_tile: n=" << n << " is not a positive multiple of parts=" << parts);
  const std::int64_t rows = n / parts;
  // Measured on 4x H200 (bench/results/dense_solver_*): cuSolverMg's potrf runs fastest with
  // the largest tiles, 2048 columns, down to one or two tiles per GPU.
  if (rows <= largest) return rows;  // one tile per part
  constexpr std::int64_t kCandidates[] = {2048, 1024, 768, 512, 384, 256, 192, 128, 96, 64};
  for (std::int64_t tile : kCandidates) {
    if (tile <= largest && rows % tile == 0) return tile;
  }
  // No candidate divides rows: the largest whose padding stays within 1/16 of the rows.
  for (std::int64_t tile : kCandidates) {
    const std::int64_t padding = (rows + tile - 1) / tile * tile - rows;
    if (tile <= largest && 16 * padding <= rows) return tile;
  }
  return kCandidates[std::size(kCandidates) - 1];  // pads fewer than 64 of over `largest` rows
}

}  // namespace meshla::solver
