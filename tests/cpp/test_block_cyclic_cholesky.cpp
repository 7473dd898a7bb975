// meshla's own block-cyclic Cholesky schedule, run on the host: each step is carried out on
// per-part local arrays with plain loops, in the order the GPUs' streams are fed, while the test
// checks every step's preconditions (a panel is read only after it was factored and copied, a
// panel buffer is rewritten only after its readers released it, every tile gets each update once
// and in order). The resulting factor must reproduce A in its lower triangle.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "solver/block_cyclic.hpp"
#include "solver/block_cyclic_cholesky.hpp"

namespace meshla::solver {
namespace {

using Kind = CholeskyStep::Kind;

struct Case {
  std::int64_t n, parts, tile;
};

class CholeskyScheduleTest : public ::testing::TestWithParam<Case> {};

TEST_P(CholeskyScheduleTest, FactorsTheMatrixWithEveryStepInOrder) {
  const Case c = GetParam();
  const BlockCyclicLayout layout =
      make_block_cyclic_layout(c.n, c.parts, c.tile, kLargestCholeskyTile);
  const std::int64_t ld = layout.padded_n(), tile = layout.tile, tiles = ld / tile;
  const int parts = static_cast<int>(layout.parts);
  // A' = M Mᵀ + ld I in solver order, spread over the parts' local arrays.
  std::mt19937_64 rng(42);
  std::normal_distribution<double> normal;
  std::vector<double> m(static_cast<std::size_t>(ld * ld)), a(m.size());
  for (double& v : m) v = normal(rng);
  for (std::int64_t i = 0; i < ld; ++i) {
    for (std::int64_t j = 0; j < ld; ++j) {
      double sum = i == j ? static_cast<double>(ld) : 0.0;
      for (std::int64_t q = 0; q < ld; ++q) sum += m[i * ld + q] * m[j * ld + q];
      a[i * ld + j] = sum;
    }
  }
  std::vector<std::vector<double>> local(parts);
  for (int p = 0; p < parts; ++p) {
    local[p].resize(static_cast<std::size_t>(ld * layout.local_columns()));
    for (std::int64_t col = 0; col < layout.local_columns(); ++col) {
      const std::int64_t global = layout.solver_index_of_local(p, col);
      for (std::int64_t r = 0; r < ld; ++r) local[p][col * ld + r] = a[r * ld + global];
    }
  }
  auto owner = [&](std::int64_t k) { return static_cast<int>(k % parts); };
  auto column = [&](int p, std::int64_t k, std::int64_t col_in_tile) {
    return &local[p][(k / parts * tile + col_in_tile) * ld];
  };
  std::vector<std::vector<std::vector<double>>> buffers(
      parts, std::vector<std::vector<double>>(2, std::vector<double>(ld * tile)));
  std::vector<std::vector<std::int64_t>> holds(parts, std::vector<std::int64_t>(2, -1));
  std::vector<std::int64_t> updates(tiles, 0);
  std::vector<bool> factored(tiles, false);

  for (const CholeskyStep& step : cholesky_schedule(layout)) {
    const int p = step.part;
    const std::int64_t k = step.k;
    const int slot = static_cast<int>(k % 2);
    switch (step.kind) {
      case Kind::kFactor: {
        ASSERT_EQ(p, owner(k));
        ASSERT_FALSE(factored[k]) << "tile " << k << " factored twice";
        ASSERT_EQ(updates[k], k) << "tile " << k << " factored before all its updates";
        // Diagonal tile: unblocked Cholesky; rows below: B := B L⁻ᵀ.
        for (std::int64_t j = 0; j < tile; ++j) {
          double* cj = column(p, k, j);
          const std::int64_t d = k * tile + j;
          for (std::int64_t q = 0; q < j; ++q) {
            const double* cq = column(p, k, q);
            for (std::int64_t r = d; r < ld; ++r) cj[r] -= cq[r] * cq[d];
          }
          ASSERT_GT(cj[d], 0.0);
          const double pivot = std::sqrt(cj[d]);
          for (std::int64_t r = d; r < ld; ++r) cj[r] /= pivot;
        }
        factored[k] = true;
        break;
      }
      case Kind::kCopy:
        ASSERT_NE(p, owner(k)) << "the owner copies its own panel";
        ASSERT_TRUE(factored[k]) << "panel " << k << " copied before it was factored";
        ASSERT_EQ(holds[p][slot], -1) << "part " << p << " overwrites panel " << holds[p][slot];
        for (std::int64_t col = 0; col < tile; ++col) {
          for (std::int64_t r = k * tile; r < ld; ++r) {
            buffers[p][slot][col * ld + (r - k * tile)] = column(owner(k), k, col)[r];
          }
        }
        holds[p][slot] = k;
        break;
      case Kind::kUpdate: {
        const std::int64_t j = step.j;
        ASSERT_EQ(owner(j), p);
        ASSERT_GT(j, k);
        ASSERT_TRUE(factored[k]);
        ASSERT_FALSE(factored[j]) << "tile " << j << " updated after it was factored";
        ASSERT_EQ(updates[j], k) << "tile " << j << " gets panel " << k << " out of order";
        if (p != owner(k)) ASSERT_EQ(holds[p][slot], k) << "panel " << k << " is not in its buffer";
        // Panel element (global row r, column q of tile k).
        auto panel = [&](std::int64_t r, std::int64_t q) {
          return p == owner(k) ? column(p, k, q)[r] : buffers[p][slot][q * ld + (r - k * tile)];
        };
        for (std::int64_t col = 0; col < tile; ++col) {
          double* target = column(p, j, col);
          for (std::int64_t r = j * tile; r < ld; ++r) {
            for (std::int64_t q = 0; q < tile; ++q) {
              target[r] -= panel(r, q) * panel(j * tile + col, q);
            }
          }
        }
        ++updates[j];
        break;
      }
      case Kind::kRelease:
        ASSERT_EQ(holds[p][slot], k);
        holds[p][slot] = -1;
        break;
    }
  }
  for (std::int64_t k = 0; k < tiles; ++k) ASSERT_TRUE(factored[k]) << "tile " << k;

  // L Lᵀ = A' on the lower triangle.
  auto l = [&](std::int64_t r, std::int64_t col) {
    if (r < col) return 0.0;
    const std::int64_t k = col / tile;
    return column(owner(k), k, col % tile)[r];
  };
  double worst = 0.0;
  for (std::int64_t r = 0; r < ld; ++r) {
    for (std::int64_t col = 0; col <= r; ++col) {
      double sum = 0.0;
      for (std::int64_t q = 0; q <= col; ++q) sum += l(r, q) * l(col, q);
      worst = std::max(worst, std::abs(sum - a[r * ld + col]) / static_cast<double>(ld));
    }
  }
  EXPECT_LT(worst, 1e-10);
}

INSTANTIATE_TEST_SUITE_P(Layouts, CholeskyScheduleTest,
                         ::testing::Values(Case{1, 1, 1}, Case{8, 1, 2}, Case{12, 2, 2},
                                           Case{24, 4, 2}, Case{20, 4, 2}, Case{48, 4, 4},
                                           Case{18, 3, 3}, Case{32, 2, 16}));

TEST(CholeskySchedule, FirstFailedPivotIsTheEarliestInSolverOrder) {
  const BlockCyclicLayout layout =
      make_block_cyclic_layout(16, 2, 2, kLargestCholeskyTile);  // 8 tiles of 2
  // pivots[part][s] is global tile s * 2 + part.
  std::vector<std::vector<int>> pivots{{0, 0, 0, 1}, {0, 0, 0, 0}};
  EXPECT_EQ(first_failed_pivot(layout, pivots), 6 * 2 + 1);
  pivots[1][1] = 2;  // global tile 3, its second pivot
  EXPECT_EQ(first_failed_pivot(layout, pivots), 3 * 2 + 2);
  EXPECT_EQ(first_failed_pivot(layout, {{0, 0, 0, 0}, {0, 0, 0, 0}}), 0);
}

TEST(CholeskySchedule, WorkspaceHoldsTwoPanelsAlignedPieces) {
  const BlockCyclicLayout layout =
      make_block_cyclic_layout(1000, 4, 64, kLargestCholeskyTile);  // 250 rows: 4 tiles
  const CholeskyWorkspace w = cholesky_workspace(DType::kFloat64, layout, 1000);
  const std::size_t panel = static_cast<std::size_t>(layout.padded_n() * 64) * 8;
  EXPECT_GE(w.potrf - w.panels, 2 * panel);
  EXPECT_GE(w.pivots - w.potrf, 1000u);
  EXPECT_GE(w.total - w.pivots, 4 * sizeof(int));
  for (std::size_t offset : {w.panels, w.potrf, w.pivots, w.total}) EXPECT_EQ(offset % 256, 0u);
}

}  // namespace
}  // namespace meshla::solver
