// The claimed grouped kernels' tile marks and their rule for splitting the last tiles
// (gemm/sm90_tile_marks.hpp), on the host: the GPU suite sees only what they add up to.
#include <gtest/gtest.h>

#include <cstdint>

#include "gemm/sm90_tile_marks.hpp"

namespace meshla::gemm {
namespace {

TEST(TileMark, WholeTileKeepsItsResidue) {
  for (const int residue : {0, 1, 17, 63}) {
    const std::int32_t mark = TileMark::of(residue);
    EXPECT_NE(mark & TileMark::kValid, 0);
    EXPECT_EQ(TileMark::k_residue(mark), residue);
    EXPECT_FALSE(TileMark::split(mark));
    EXPECT_FALSE(TileMark::second_half(mark));
  }
}

TEST(TileMark, HalvesCarryTheirHalfTheSplitAndTheSlotAtEveryFieldsWidest) {
  for (const std::uint32_t slot : {0u, 1u, static_cast<std::uint32_t>(TileMark::kMaxSlots - 1)}) {
    for (const int k_split : {4, 56, static_cast<int>(TileMark::kMaxKSplit)}) {
      for (const bool second : {false, true}) {
        for (const int residue : {0, 63}) {
          const std::int32_t half = TileMark::halved(TileMark::of(residue), second, k_split, slot);
          EXPECT_GT(half, 0) << "slot " << slot << " reached the sign bit";
          EXPECT_NE(half & TileMark::kValid, 0);
          EXPECT_TRUE(TileMark::split(half));
          EXPECT_EQ(TileMark::second_half(half), second);
          EXPECT_EQ(TileMark::k_split(half), k_split);
          EXPECT_EQ(TileMark::slot(half), slot);
          // The K residue lies in the last k-tile, which only the second half runs.
          EXPECT_EQ(TileMark::k_residue(half), second ? residue : 0);
        }
      }
    }
  }
}

constexpr std::uint32_t kH100Sms = 132;
constexpr std::int64_t kDeepSeekKTiles = 7168 / 64;

TEST(SplitTailTiles, ANearlyEmptyLastWaveIsSplit) {
  // DeepSeek-V3 with 32 experts, uniform: 4096 tiles, 31 waves and 4 tiles.
  EXPECT_EQ(split_tail_tiles(4096, kH100Sms, kDeepSeekKTiles), 8u);
  // A last wave of 8 tiles (an eighth of a wave's tiles split), and of 9.
  EXPECT_EQ(split_capacity(kH100Sms), 16u);
  EXPECT_EQ(split_tail_tiles(5 * kH100Sms + 8, kH100Sms, kDeepSeekKTiles), 16u);
  EXPECT_EQ(split_tail_tiles(5 * kH100Sms + 9, kH100Sms, kDeepSeekKTiles), 0u);
}

TEST(SplitTailTiles, FullOrHalfFullLastWavesAreNot) {
  EXPECT_EQ(split_tail_tiles(3960, kH100Sms, kDeepSeekKTiles), 0u);  // 30 waves
  // DeepSeek-V3 with 32 experts, skewed: the last wave holds 124 tiles.
  EXPECT_EQ(split_tail_tiles(4216, kH100Sms, kDeepSeekKTiles), 0u);
}

TEST(SplitTailTiles, NeverMoreThanTheTiles) {
  // Three tiles: the whole call is a last wave of 3.
  EXPECT_EQ(split_tail_tiles(3, kH100Sms, kDeepSeekKTiles), 3u);
}

TEST(SplitTailTiles, OnlyWhereEachHalfHasItsKTilesAndTheMarkItsField) {
  EXPECT_EQ(split_tail_tiles(4096, kH100Sms, 2 * kMinSplitKTiles - 1), 0u);
  EXPECT_EQ(split_tail_tiles(4096, kH100Sms, 2 * kMinSplitKTiles), 8u);
  EXPECT_EQ(split_tail_tiles(4096, kH100Sms, 2 * std::int64_t{TileMark::kMaxKSplit}), 8u);
  EXPECT_EQ(split_tail_tiles(4096, kH100Sms, 2 * std::int64_t{TileMark::kMaxKSplit} + 2), 0u);
  EXPECT_EQ(split_tail_tiles(4096, 0, kDeepSeekKTiles), 0u);
}

TEST(SplitTailTiles, HopperSmCountsFitTheMarksSlots) {
  for (const std::uint32_t sms : {114u, kH100Sms, 144u}) {
    EXPECT_LE(split_capacity(sms), static_cast<std::uint32_t>(TileMark::kMaxSlots));
  }
}

}  // namespace
}  // namespace meshla::gemm
