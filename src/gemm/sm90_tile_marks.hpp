// What a claimed tile's mark tells the mainloop (TileMark), and which of the tile order's last
// tiles are split in two halves of their k-tiles (split_tail_tiles). Plain constexpr code, shared
// by the grouped kernels (sm90_claiming_scheduler.cuh, sm90_grouped_gemm.cuh) and the CPU tests.
#pragma once

#include <cstdint>

#include "core/host_device.hpp"

namespace meshla::gemm {

// What the mainloop may leave out of a claimed tile, marked in its is_valid_tile (TileMark): when a
// tile's contraction (K) is not a whole number of k-tiles, TMA fills its last k-tile past K with
// zeros; the MMAs of the k-blocks that hold only zeros need not run.
// A split tile's half (TileOrder::split_tiles) is marked too: which half, the k-tile where the
// second half starts, and the tile's slot.
struct TileMark {
  static constexpr std::int32_t kValid = 1;
  static constexpr int kResidueShift = 1;  // 6 bits: K mod the k-tile, 0 for a whole k-tile
  static constexpr std::int32_t kSplit = 1 << 8;
  static constexpr std::int32_t kSecondHalf = 1 << 9;
  static constexpr int kKSplitShift = 10;  // 11 bits
  static constexpr int kSlotShift = 21;    // 10 bits
  static constexpr std::int32_t kMaxKSplit = (1 << (kSlotShift - kKSplitShift)) - 1;
  static constexpr std::int32_t kMaxSlots = 1 << (31 - kSlotShift);

  MESHLA_HOST_DEVICE static constexpr std::int32_t of(int k_residue) {
    return kValid | k_residue << kResidueShift;
  }
  // A whole tile's mark as the half of a split tile: the first (k-tiles [0, k_split)) or the
  // second (the rest, and the K residue, which lies in the last k-tile).
  MESHLA_HOST_DEVICE static constexpr std::int32_t halved(std::int32_t mark, bool second,
                                                          int k_split, std::uint32_t slot) {
    const std::int32_t kept = second ? mark : kValid;
    return kept | kSplit | (second ? kSecondHalf : 0) | k_split << kKSplitShift |
           static_cast<std::int32_t>(slot) << kSlotShift;
  }
  MESHLA_HOST_DEVICE static constexpr int k_residue(std::int32_t mark) {
    return (mark >> kResidueShift) & 63;
  }
  MESHLA_HOST_DEVICE static constexpr bool split(std::int32_t mark) { return (mark & kSplit) != 0; }
  MESHLA_HOST_DEVICE static constexpr bool second_half(std::int32_t mark) {
    return (mark & kSecondHalf) != 0;
  }
  MESHLA_HOST_DEVICE static constexpr int k_split(std::int32_t mark) {
    return (mark >> kKSplitShift) & kMaxKSplit;
  }
  MESHLA_HOST_DEVICE static constexpr std::uint32_t slot(std::int32_t mark) {
    return static_cast<std::uint32_t>(mark) >> kSlotShift;
  }
};

// A split tile's halves each run at least this many k-tiles.
constexpr std::int64_t kMinSplitKTiles = 4;

// How many of the tile order's last tiles a launch on `sms` CTAs may split: an eighth of a wave.
MESHLA_HOST_DEVICE constexpr std::uint32_t split_capacity(std::uint32_t sms) { return sms / 8; }

// How many of the tile order's last tiles to claim in two halves of their k-tiles (TileOrder::
// split_tiles), for `tiles` tiles of `k_tiles` k-tiles each on `sms` CTAs. The CTAs take the
// tiles in waves. Where the last wave holds r tiles, splitting the order's 2r last tiles lets the
// CTAs that take the unsplit tiles and the first halves take the second halves too, and the call
// ends half a tile sooner. Measured on DeepSeek-like shapes (K = 7168) at the power limit
// (bench/NOTES.md, experiment 54): 1.3% faster where 8 tiles were split, 0.7-0.8% slower where
// 72 and 128 were (last waves a quarter and a half full), so only a last wave at most a sixteenth
// full is split (2r at most split_capacity).
MESHLA_HOST_DEVICE constexpr std::uint32_t split_tail_tiles(std::uint64_t tiles, std::uint32_t sms,
                                                            std::int64_t k_tiles) {
  if (sms == 0 || k_tiles < 2 * kMinSplitKTiles || k_tiles / 2 > TileMark::kMaxKSplit) return 0;
  const std::uint64_t split = 2 * (tiles % sms);
  if (split == 0 || split > split_capacity(sms)) return 0;
  return static_cast<std::uint32_t>(split < tiles ? split : tiles);
}

}  // namespace meshla::gemm
