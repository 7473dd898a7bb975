// The renumbering between framework row blocks and cuSolverMg's block-cyclic layout.
#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "meshla/error.hpp"
#include "solver/block_cyclic.hpp"

namespace meshla::solver {
namespace {

struct Case {
  std::int64_t n, parts, tile;
};

class BlockCyclicLayoutTest : public ::testing::TestWithParam<Case> {};

TEST_P(BlockCyclicLayoutTest, RenumberingIsAPermutationThatKeepsColumnsInPlace) {
  const Case c = GetParam();
  const BlockCyclicLayout layout =
      make_block_cyclic_layout(c.n, c.parts, c.tile, kLargestCholeskyTile);
  EXPECT_EQ(layout.padded_n() % (layout.parts * layout.tile), 0);
  EXPECT_GE(layout.local_columns(), layout.rows_per_part);
  EXPECT_LT(layout.local_columns() - layout.rows_per_part, layout.tile);

  std::set<std::int64_t> seen;
  for (std::int64_t original = 0; original < c.n; ++original) {
    const std::int64_t solver = layout.solver_index(original);
    ASSERT_GE(solver, 0);
    ASSERT_LT(solver, layout.padded_n());
    EXPECT_TRUE(seen.insert(solver).second) << "solver index " << solver << " used twice";
    EXPECT_EQ(layout.original_index(solver), original);
    // The column stays on the GPU and at the local position it arrived in.
    const std::int64_t part = original / layout.rows_per_part;
    const std::int64_t local = original % layout.rows_per_part;
    EXPECT_EQ(layout.owner_of_solver(solver), part);
    EXPECT_EQ(layout.local_of_solver(solver), local);
    EXPECT_EQ(layout.solver_index_of_local(part, local), solver);
  }
  std::int64_t padding = 0;
  for (std::int64_t solver = 0; solver < layout.padded_n(); ++solver) {
    // cuSolverMg's 1-D column block-cyclic layout: tile t lives on part t % parts, local slot
    // t / parts.
    const std::int64_t t = solver / layout.tile;
    EXPECT_EQ(layout.owner_of_solver(solver), t % layout.parts);
    EXPECT_EQ(layout.local_of_solver(solver),
              t / layout.parts * layout.tile + solver % layout.tile);
    if (layout.original_index(solver) < 0) ++padding;
  }
  EXPECT_EQ(padding, layout.padded_n() - c.n);
  EXPECT_EQ(layout.padded(), padding > 0);

  // Tile by tile, as the conversion kernels copy: a run of original rows, then padding.
  for (std::int64_t t = 0; t < layout.padded_n() / layout.tile; ++t) {
    const BlockCyclicLayout::TileRows rows = layout.original_rows_of_tile(t);
    for (std::int64_t i = 0; i < layout.tile; ++i) {
      ASSERT_EQ(layout.original_index(t * layout.tile + i), i < rows.count ? rows.first + i : -1)
          << "tile " << t << ", row " << i;
    }
  }
  // renumbers() is false exactly where every row keeps its index.
  bool moves = layout.padded();
  for (std::int64_t original = 0; original < c.n; ++original) {
    moves = moves || layout.solver_index(original) != original;
  }
  EXPECT_EQ(layout.renumbers(), moves);
}

// A symmetric matrix read through the renumbering, as every part's local array holds it after
// rows_to_solver_order, is Π A Πᵀ padded with the identity.
TEST_P(BlockCyclicLayoutTest, LocalArraysHoldTheSymmetricPermutation) {
  const Case c = GetParam();
  if (c.n > 300) GTEST_SKIP() << "checked on the small cases";
  const BlockCyclicLayout layout =
      make_block_cyclic_layout(c.n, c.parts, c.tile, kLargestCholeskyTile);
  auto a = [](std::int64_t i, std::int64_t j) { return 1.0 / (1.0 + i + j) + (i == j ? 3.0 : 0); };
  const std::int64_t ld = layout.padded_n();
  std::vector<std::vector<double>> local(c.parts);
  for (std::int64_t part = 0; part < c.parts; ++part) {
    local[part].assign(ld * layout.local_columns(), 0.0);
    for (std::int64_t l = 0; l < layout.local_columns(); ++l) {
      for (std::int64_t r = 0; r < ld; ++r) {
        const std::int64_t q = layout.original_index(r);
        const bool real = l < layout.rows_per_part && q >= 0;
        // Row-major shard element (local row l, column q) is A[part*rows + l, q].
        local[part][l * ld + r] = real ? a(part * layout.rows_per_part + l, q)
                                       : (r == layout.solver_index_of_local(part, l) ? 1.0 : 0.0);
      }
    }
  }
  for (std::int64_t column = 0; column < ld; ++column) {
    const auto& array = local[layout.owner_of_solver(column)];
    const std::int64_t l = layout.local_of_solver(column);
    for (std::int64_t row = 0; row < ld; ++row) {
      const std::int64_t i = layout.original_index(row);
      const std::int64_t j = layout.original_index(column);
      const double expected = (i >= 0 && j >= 0) ? a(i, j) : (row == column ? 1.0 : 0.0);
      ASSERT_EQ(array[l * ld + row], expected) << "A'[" << row << ", " << column << "]";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, BlockCyclicLayoutTest,
                         ::testing::Values(Case{1, 1, 0}, Case{2, 2, 0}, Case{12, 4, 3},
                                           Case{12, 4, 2}, Case{14, 2, 3}, Case{40, 4, 4},
                                           Case{96, 3, 5}, Case{200, 4, 16}, Case{4000, 4, 0},
                                           Case{4096, 1, 512}, Case{65536, 4, 1024}));

TEST(ChooseTile, PrefersTheLargestDivisorUpTo2048) {
  EXPECT_EQ(choose_tile(65536, 4, kLargestCholeskyTile), 2048);
  EXPECT_EQ(choose_tile(16384, 4, kLargestCholeskyTile), 2048);
  EXPECT_EQ(choose_tile(8192, 4, kLargestCholeskyTile), 2048);  // one tile per GPU
  EXPECT_EQ(choose_tile(4 * 3072, 4, kLargestCholeskyTile), 1024);
  EXPECT_EQ(choose_tile(4 * 6144, 4, kLargestCholeskyTile), 2048);
  EXPECT_EQ(choose_tile(100, 4, kLargestCholeskyTile), 25);  // small: one tile per GPU
  EXPECT_EQ(choose_tile(4000, 4, kLargestCholeskyTile), 1000);
}

TEST(ChooseTile, PadsLittleWhenNothingDivides) {
  // 3000 rows per GPU past 2048: 2048 would pad to 4096; 1024 pads to 3072 (2.4%).
  EXPECT_EQ(choose_tile(4 * 3000, 4, kLargestCholeskyTile), 1024);
  const std::int64_t rows = 4099;  // prime
  const std::int64_t tile = choose_tile(rows * 2, 2, kLargestCholeskyTile);
  EXPECT_LE(16 * ((rows + tile - 1) / tile * tile - rows), rows);
}

TEST(BlockCyclicLayout, RejectsBadArguments) {
  EXPECT_THROW(make_block_cyclic_layout(10, 4, 0, kLargestCholeskyTile), Error);
  EXPECT_THROW(make_block_cyclic_layout(0, 1, 0, kLargestCholeskyTile), Error);
  EXPECT_THROW(make_block_cyclic_layout(8, 2, -1, kLargestCholeskyTile), Error);
  try {
    make_block_cyclic_layout(10, 4, 0, kLargestCholeskyTile);
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(error.what()).find("n=10"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace meshla::solver
