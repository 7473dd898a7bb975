// Index math between the layout frameworks give a distributed matrix and the one cuSolverMg
// factors. Pure arithmetic, callable from host and device code, unit-tested on the CPU.
//
// A framework shards an n x n matrix by rows: part p (of P) holds rows [p*r, (p+1)*r), r = n/P,
// row-major. Read as column-major, that memory is columns [p*r, (p+1)*r) of Aᵀ, which is A itself
// for a symmetric matrix (conj(A) for a Hermitian one). cuSolverMg wants a 1-D column
// block-cyclic layout: tiles of T columns dealt round-robin to the parts. Moving whole columns
// between GPUs would cost one network pass over the matrix; instead meshla *renumbers* them:
// part p's local tile s is declared to be global tile s*P + p. That is the symmetric permutation
// A' = Π A Πᵀ, so besides the columns (which stay where they are) the rows must be renumbered the
// same way, which is a row shuffle inside every local column: local memory traffic only.
//
// Solving A' x' = Π b gives x = Πᵀ x', log det A' = log det A, A'⁻¹ = Π A⁻¹ Πᵀ and the
// eigenvectors of A' are Π V, so every routine is answered exactly from the permuted problem.
//
// When r is not a multiple of T, each part's last tile is completed with padding columns (and the
// matching padding rows): zero off the diagonal and a chosen value on it, which decouples them
// from A. The padded order is n' = P * ceil(r/T) * T.
#pragma once

#include <cstdint>

#include "core/host_device.hpp"

namespace meshla::solver {

struct BlockCyclicLayout {
  std::int64_t n = 0;               // order of A
  std::int64_t parts = 1;           // GPUs, each holding rows_per_part consecutive rows
  std::int64_t tile = 1;            // columns per tile of the block-cyclic layout
  std::int64_t rows_per_part = 0;   // n / parts
  std::int64_t tiles_per_part = 0;  // ceil(rows_per_part / tile)

  // Order of the padded matrix cuSolverMg factors.
  MESHLA_HOST_DEVICE std::int64_t padded_n() const { return parts * tiles_per_part * tile; }
  // Columns each part holds in the solver's layout (its local array is padded_n() x this).
  MESHLA_HOST_DEVICE std::int64_t local_columns() const { return tiles_per_part * tile; }
  MESHLA_HOST_DEVICE bool padded() const { return padded_n() != n; }
  // Whether any row or column moves: not where one part holds everything, or every part one tile,
  // with no padding (the solver's order is then the original order, and the kernels that convert
  // between them are copies, or nothing where the working array is the input itself).
  MESHLA_HOST_DEVICE bool renumbers() const {
    return padded() || (parts > 1 && tiles_per_part > 1);
  }

  // Solver tile `t` (rows t*tile to (t+1)*tile - 1 of the solver's order) holds original rows
  // [first, first + count) in order, then padding: the unit in which the conversion kernels copy,
  // so that their index arithmetic is done once per tile and not per element.
  struct TileRows {
    std::int64_t first;
    std::int64_t count;
  };
  MESHLA_HOST_DEVICE TileRows original_rows_of_tile(std::int64_t t) const {
    const std::int64_t part = t % parts;
    const std::int64_t local = t / parts * tile;
    const std::int64_t left = rows_per_part - local;
    return {part * rows_per_part + local, left < 0 ? 0 : (left < tile ? left : tile)};
  }

  // Solver index of original row/column `original` (0 <= original < n).
  MESHLA_HOST_DEVICE std::int64_t solver_index(std::int64_t original) const {
    const std::int64_t part = original / rows_per_part;
    const std::int64_t local = original - part * rows_per_part;
    return solver_index_of_local(part, local);
  }

  // Solver index of the local column `local` (0 <= local < local_columns()) of `part`; the
  // original column is part*rows_per_part + local when local < rows_per_part, padding otherwise.
  MESHLA_HOST_DEVICE std::int64_t solver_index_of_local(std::int64_t part,
                                                        std::int64_t local) const {
    const std::int64_t slot = local / tile;
    return (slot * parts + part) * tile + (local - slot * tile);
  }

  // Original index of solver index `solver`, or -1 for padding.
  MESHLA_HOST_DEVICE std::int64_t original_index(std::int64_t solver) const {
    const std::int64_t local = local_of_solver(solver);
    if (local >= rows_per_part) return -1;
    return owner_of_solver(solver) * rows_per_part + local;
  }

  // The part that holds solver column `solver`, and its local column there.
  MESHLA_HOST_DEVICE std::int64_t owner_of_solver(std::int64_t solver) const {
    return (solver / tile) % parts;
  }
  MESHLA_HOST_DEVICE std::int64_t local_of_solver(std::int64_t solver) const {
    return (solver / (tile * parts)) * tile + solver % tile;
  }
};

// Checks the arguments (n divisible by parts, tile >= 1) and builds the layout; tile == 0 picks
// one with choose_tile(n, parts, largest).
BlockCyclicLayout make_block_cyclic_layout(std::int64_t n, std::int64_t parts, std::int64_t tile,
                                           std::int64_t largest);

// The largest tiles of the solvers' own choice: cuSolverMg's potrf was measured fastest with
// 2048-column tiles (4x H200), and its syevd refuses tiles over 1024 columns
// (CUSOLVER_STATUS_INVALID_VALUE; one H100, CUDA 13.0), which is also the most it is given.
constexpr std::int64_t kLargestCholeskyTile = 2048;
constexpr std::int64_t kLargestEigenTile = 1024;
// cuSolverMg's getrf takes tiles of up to 512 columns: 513 and above returned
// CUSOLVER_STATUS_INVALID_VALUE (info -6, the tile's descriptor; 2x H200, CUDA 13.0, 2026-11-28).
constexpr std::int64_t kLargestLuTile = 512;

// The tile meshla uses when the caller gives none: n/parts itself up to `largest` rows per GPU
// (one tile each), else the largest of 2048, 1024, ... 64 up to `largest` that divides n/parts,
// else the largest that pads at most 1/16 of the rows.
std::int64_t choose_tile(std::int64_t n, std::int64_t parts, std::int64_t largest);

}  // namespace meshla::solver
