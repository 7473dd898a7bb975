#include "solver/block_cyclic.hpp"

#include "core/checks.hpp"

namespace meshla::solver {

BlockCyclicLayout make_block_cyclic_layout(std::int64_t n, std::int64_t parts, std::int64_t tile) {
  MESHLA_CHECK_ARG(n >= 1, "dense solver: n=" << n << " must be at least 1");
  MESHLA_CHECK_ARG(parts >= 1, "dense solver: parts=" << parts << " must be at least 1");
  MESHLA_CHECK_ARG(n % parts == 0, "dense solver: n=" << n << " rows are not divisible by the "
                                                      << parts << " GPUs holding them");
  MESHLA_CHECK_ARG(tile >= 0, "dense solver: tile=" << tile << " must be positive (0: automatic)");
  BlockCyclicLayout layout;
  layout.n = n;
  layout.parts = parts;
  layout.tile = tile == 0 ? choose_tile(n, parts) : tile;
  layout.rows_per_part = n / parts;
  layout.tiles_per_part = (layout.rows_per_part + layout.tile - 1) / layout.tile;
  // cuSolverMg takes the order as a 32-bit int.
  MESHLA_CHECK_ARG(layout.padded_n() <= INT32_MAX,
                   "dense solver: n=" << n << " (padded to " << layout.padded_n() << " for tile="
                                      << layout.tile << ") exceeds cuSolverMg's 32-bit order");
  return layout;
}

std::int64_t choose_tile(std::int64_t n, std::int64_t parts) {
  MESHLA_CHECK_ARG(n >= 1 && parts >= 1 && n % parts == 0,
                   "choose_tile: n=" << n << " is not a positive multiple of parts=" << parts);
  const std::int64_t rows = n / parts;
  constexpr std::int64_t kSmallest = 32;
  if (rows <= 4 * kSmallest) return rows;  // one tile per part: nothing to balance
  constexpr std::int64_t kCandidates[] = {1024, 768, 512, 384, 256, 192, 128, 96, 64, kSmallest};
  for (std::int64_t tile : kCandidates) {
    if (rows % tile == 0 && 4 * tile <= rows) return tile;
  }
  // No candidate divides rows: the largest whose padding stays within 1/16 of the rows.
  for (std::int64_t tile : kCandidates) {
    const std::int64_t padding = (rows + tile - 1) / tile * tile - rows;
    if (4 * tile <= rows && 16 * padding <= rows) return tile;
  }
  return kSmallest;  // pads fewer than 32 rows, under 1/4 of them
}

}  // namespace meshla::solver
