// Host checks of DenseSolver calls: every argument error names the argument, the shard and the
// shapes. No GPU needed: the views point at fake addresses that are never dereferenced.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "meshla/error.hpp"
#include "solver/solver_validation.hpp"

namespace meshla::solver {
namespace {

void* fake_address(std::uintptr_t slot) { return reinterpret_cast<void*>(0x10000 * slot); }

struct Call {
  SolverOp op = SolverOp::kCholeskySolve;
  SolverProblem problem{.n = 8, .dtype = DType::kFloat64, .nrhs = 2};
  std::vector<int> devices{3, 5};
  std::vector<SolverShard> shards;
  std::vector<std::size_t> workspace_bytes{4096, 1024};

  Call() {
    for (int part = 0; part < 2; ++part) {
      const int device = devices[part];
      const std::uintptr_t base = 16 * (part + 1);
      SolverShard shard;
      shard.a = make_tensor_view(fake_address(base), DType::kFloat64, {4, 8}, device);
      shard.b = make_tensor_view(fake_address(base + 1), DType::kFloat64, {4, 2}, device);
      shard.out = make_tensor_view(fake_address(base + 2), DType::kFloat64, {4, 2}, device);
      shard.logdet = make_tensor_view(fake_address(base + 3), DType::kFloat64, {}, device);
      shard.workspace = make_tensor_view(fake_address(base + 4), DType::kInt64, {512}, device);
      shards.push_back(shard);
    }
  }

  void check() const {
    check_solver_problem(op, problem);
    check_solver_shards(op, problem,
                        make_block_cyclic_layout(problem.n, 2, 2, kLargestCholeskyTile), devices,
                        shards, workspace_bytes);
  }
};

// Runs `check` on a call changed by `change` and expects kInvalidArgument mentioning `expected`.
void expect_rejected(const std::function<void(Call&)>& change, const std::string& expected) {
  Call call;
  change(call);
  try {
    call.check();
    FAIL() << "accepted; expected an error mentioning '" << expected << "'";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument) << error.what();
    EXPECT_NE(std::string(error.what()).find(expected), std::string::npos) << error.what();
  }
}

TEST(SolverValidation, AcceptsWellFormedCalls) {
  Call solve;
  EXPECT_NO_THROW(solve.check());
  Call inverse;
  inverse.op = SolverOp::kCholeskyInverse;
  for (SolverShard& shard : inverse.shards) {
    shard.out = shard.a;  // written over A
  }
  inverse.problem.overwrite_a = true;
  EXPECT_NO_THROW(inverse.check());
  Call eigen;
  eigen.op = SolverOp::kEigen;
  eigen.problem.dtype = DType::kComplex64;
  for (int part = 0; part < 2; ++part) {
    SolverShard& shard = eigen.shards[part];
    const int device = eigen.devices[part];
    shard.a = make_tensor_view(fake_address(100 + part), DType::kComplex64, {4, 8}, device);
    shard.out = make_tensor_view(fake_address(200 + part), DType::kComplex64, {4, 8}, device);
    shard.eigenvalues = make_tensor_view(fake_address(300 + part), DType::kFloat32, {8}, device);
  }
  EXPECT_NO_THROW(eigen.check());
}

TEST(SolverValidation, RejectsBadProblems) {
  expect_rejected([](Call& c) { c.problem.dtype = DType::kBFloat16; },
                  "bfloat16 is not float32, float64, complex64 or complex128");
  expect_rejected([](Call& c) { c.problem.nrhs = 257; }, "nrhs=257");
  expect_rejected([](Call& c) { c.problem.nrhs = 0; }, "nrhs=0");
}

TEST(SolverLayout, TheInverseIsBoundedByCusolverDnPotrisThirtyTwoBitSizes) {
  // 46340^2 < 2^31 <= 46341^2, padding included: 46340 / 4 = 11585 rows, which meshla's own tile
  // (2048) pads to 12288 a GPU. The inverse then takes one unpadded tile a GPU; the solve keeps it.
  EXPECT_EQ(solver_layout(SolverOp::kCholeskySolve, 46340, 4, 0).padded_n(), 49152);
  const BlockCyclicLayout largest = solver_layout(SolverOp::kCholeskyInverse, 46340, 4, 0);
  EXPECT_EQ(largest.padded_n(), 46340);
  EXPECT_EQ(largest.tile, 11585);
  EXPECT_EQ(solver_layout(SolverOp::kCholeskyInverse, 16384, 2, 0).tile, 2048);  // as the solve
  for (const auto& [n, tile] : {std::pair<std::int64_t, std::int64_t>{46344, 0}, {46340, 4096}}) {
    try {
      solver_layout(SolverOp::kCholeskyInverse, n, 4, tile);
      FAIL() << "an inverse of n=" << n << " with tile=" << tile << " was taken";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kNotImplemented);
      EXPECT_NE(std::string(error.what()).find("cholesky_inverse: n=" + std::to_string(n)),
                std::string::npos)
          << error.what();
    }
  }
}

TEST(SolverLayout, TheEigensolverTakesTilesUpTo1024OnSeveralGpus) {
  // cuSolverMg's syevd refuses larger tiles; the Cholesky ops choose up to 2048.
  EXPECT_EQ(solver_layout(SolverOp::kCholeskySolve, 8192, 1, 0).tile, 2048);
  EXPECT_EQ(solver_layout(SolverOp::kCholeskyInverse, 4 * 2048, 4, 0).tile, 2048);
  EXPECT_EQ(solver_layout(SolverOp::kEigenvalues, 4 * 2048, 4, 0).tile, 1024);
  EXPECT_EQ(solver_layout(SolverOp::kEigen, 4 * 1000, 4, 0).tile, 1000);  // one tile a GPU
  EXPECT_EQ(solver_layout(SolverOp::kEigen, 2 * 1500, 2, 0).tile, 768);   // 1536: pads 36
  EXPECT_EQ(solver_layout(SolverOp::kCholeskySolve, 2 * 1500, 2, 0).tile, 1500);
  EXPECT_EQ(solver_layout(SolverOp::kEigen, 2 * 8192, 2, 1024).tile, 1024);
  EXPECT_EQ(solver_layout(SolverOp::kCholeskySolve, 8192, 1, 4096).tile, 4096);
  // One GPU runs cusolverDn's syevd, which has no tiles: the whole matrix is one, unpadded.
  EXPECT_EQ(solver_layout(SolverOp::kEigen, 8192, 1, 0).tile, 8192);
  EXPECT_FALSE(solver_layout(SolverOp::kEigenvalues, 1500, 1, 0).padded());
  EXPECT_EQ(solver_layout(SolverOp::kEigen, 8192, 1, 2048).tile, 2048);
  for (SolverOp op : {SolverOp::kEigen, SolverOp::kEigenvalues}) {
    try {
      solver_layout(op, 2 * 8192, 2, 2048);
      FAIL() << "tile=2048 accepted for " << solver_op_name(op);
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(error.what()).find("tile=2048 exceeds 1024"), std::string::npos)
          << error.what();
    }
  }
}

TEST(SolverValidation, RejectsBadShards) {
  expect_rejected([](Call& c) { c.shards.pop_back(); }, "1 shards for a solver over 2 GPUs");
  expect_rejected(
      [](Call& c) {
        c.shards[1].a = make_tensor_view(fake_address(9), DType::kFloat64, {4, 7}, 5);
      },
      "a of shard 1 has shape [4, 7], expected [4, 8] (n=8 over 2 GPUs)");
  expect_rejected([](Call& c) { c.shards[0].a.device = 5; }, "a of shard 0 is not on cuda:3");
  expect_rejected([](Call& c) { c.shards[0].b.dtype = DType::kFloat32; },
                  "b of shard 0 is float32, expected float64");
  expect_rejected([](Call& c) { c.shards[1].b.data = nullptr; }, "shard 1 has no b");
  expect_rejected([](Call& c) { c.shards[0].logdet.dtype = DType::kFloat32; },
                  "logdet of shard 0 is float32, expected float64");
  expect_rejected([](Call& c) { c.shards[0].out.strides[0] = 4; },
                  "out of shard 0 is not contiguous");
}

TEST(SolverValidation, RejectsOutputsOverA) {
  expect_rejected(
      [](Call& c) {
        c.op = SolverOp::kCholeskyInverse;
        for (SolverShard& shard : c.shards) shard.out = shard.a;
      },
      "out of shard 0 is a; that needs overwrite_a=true");
  expect_rejected(
      [](Call& c) {
        c.op = SolverOp::kEigen;
        c.problem.overwrite_a = true;
        for (SolverShard& shard : c.shards) shard.out = shard.a;
      },
      "eigenvectors (out) of shard 0 cannot be written over a");
}

TEST(SolverValidation, RejectsSmallOrMisalignedWorkspace) {
  expect_rejected([](Call& c) { c.workspace_bytes[0] = 8192; },
                  "workspace of shard 0 has 4096 bytes, workspace_bytes() asks 8192");
  expect_rejected(
      [](Call& c) {
        c.shards[1].workspace.data = static_cast<char*>(c.shards[1].workspace.data) + 16;
      },
      "workspace of shard 1 is not 256-byte aligned");
  expect_rejected([](Call& c) { c.shards[1].workspace.device = 3; },
                  "shard 1 has no workspace on cuda:5");
}

TEST(SolverValidation, RealTypes) {
  EXPECT_EQ(real_dtype(DType::kComplex128), DType::kFloat64);
  EXPECT_EQ(real_dtype(DType::kComplex64), DType::kFloat32);
  EXPECT_EQ(real_dtype(DType::kFloat32), DType::kFloat32);
  EXPECT_TRUE(is_complex(DType::kComplex64));
  EXPECT_FALSE(is_complex(DType::kFloat64));
}

TEST(SolverCall, ChecksTheProblemTheLayoutAndOverwriteAOnMetadata) {
  const SolverProblem solve{.n = 20, .dtype = DType::kFloat64, .nrhs = 1, .tile = 0};
  EXPECT_EQ(check_solver_call(SolverOp::kCholeskySolve, solve, 4).tile, 5);
  SolverProblem bad = solve;
  bad.nrhs = 300;
  EXPECT_THROW(check_solver_call(SolverOp::kCholeskySolve, bad, 4), Error);
  bad = solve;
  bad.dtype = DType::kBFloat16;
  EXPECT_THROW(check_solver_call(SolverOp::kCholeskySolve, bad, 4), Error);
  bad = solve;
  bad.tile = 3;  // pads 5 rows a GPU to 6
  bad.overwrite_a = true;
  try {
    check_solver_call(SolverOp::kCholeskySolve, bad, 4);
    FAIL() << "overwrite_a taken with a padded layout";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("overwrite_a needs n/GPUs = 20/4"), std::string::npos);
  }
  const SolverProblem eigen{.n = 8192, .dtype = DType::kFloat32, .tile = 4096};
  EXPECT_THROW(check_solver_call(SolverOp::kEigen, eigen, 2), Error);  // syevd's tile limit
}

TEST(SolverCall, TheLuSolveTakesRightHandSidesTilesUpTo512AndOverwriteAOnOneGpu) {
  const SolverProblem solve{.n = 4096, .dtype = DType::kComplex128, .nrhs = 3};
  EXPECT_EQ(check_solver_call(SolverOp::kLuSolve, solve, 2).tile, 512);   // getrf's largest
  EXPECT_EQ(check_solver_call(SolverOp::kLuSolve, solve, 1).tile, 4096);  // cusolverDn: no tiles
  SolverProblem large_tile = solve;
  large_tile.tile = 768;
  EXPECT_EQ(check_solver_call(SolverOp::kLuSolve, large_tile, 1).tile, 4096);  // never padded
  SolverProblem negative_tile = solve;
  negative_tile.tile = -1;
  EXPECT_THROW(check_solver_call(SolverOp::kLuSolve, negative_tile, 1), Error);
  try {
    check_solver_call(SolverOp::kLuSolve, large_tile, 2);
    FAIL() << "tile=768 taken on two GPUs";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what())
                  .find("lu_solve: tile=768 exceeds 512, the largest tile "
                        "cuSolverMg's getrf takes"),
              std::string::npos)
        << error.what();
  }
  SolverProblem bad = solve;
  bad.nrhs = 0;
  try {
    check_solver_call(SolverOp::kLuSolve, bad, 2);
    FAIL() << "nrhs=0 taken";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("lu_solve: nrhs=0 right-hand sides"),
              std::string::npos)
        << error.what();
  }
  SolverProblem in_place = solve;
  in_place.overwrite_a = true;
  EXPECT_NO_THROW(check_solver_call(SolverOp::kLuSolve, in_place, 1));
  try {
    check_solver_call(SolverOp::kLuSolve, in_place, 2);
    FAIL() << "overwrite_a taken on two GPUs";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kNotImplemented);
    EXPECT_NE(std::string(error.what()).find("lu_solve: overwrite_a on 2 GPUs"), std::string::npos)
        << error.what();
  }
}

TEST(SolverValidation, TheLuSolveTakesBAndOutAndNoLogdet) {
  Call lu;
  lu.op = SolverOp::kLuSolve;
  lu.shards[0].logdet = make_tensor_view(fake_address(800), DType::kInt32, {3}, 3);
  EXPECT_NO_THROW(lu.check());  // a logdet it does not write is not checked
  lu.shards[1].b = make_tensor_view(fake_address(900), DType::kFloat64, {4, 3}, 5);
  try {
    lu.check();
    FAIL() << "a b of 3 columns taken for nrhs=2";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what())
                  .find("lu_solve: b of shard 1 has shape [4, 3], expected "
                        "[4, 2]"),
              std::string::npos)
        << error.what();
  }
}

TEST(SolverCall, TheTallSkinnyQrNeedsAAtLeastAsTallAsItIsWide) {
  EXPECT_NO_THROW(check_tall_qr_call("qr", 4096, 256, DType::kComplex64, 4, 0));
  EXPECT_NO_THROW(check_tall_qr_call("qr", 1024, 256, DType::kFloat64, 4, 0));  // square blocks
  EXPECT_NO_THROW(check_tall_qr_call("qr", 1000, 256, DType::kFloat64, 4, 0));  // blocks wider
  EXPECT_NO_THROW(check_tall_qr_call("qr", 256, 256, DType::kFloat32, 2, 0));   // square A
  const auto refused = [](std::int64_t m, std::int64_t n, DType dtype, std::int64_t parts,
                          std::int64_t nrhs, ErrorCode code, const std::string& expected) {
    try {
      check_tall_qr_call("least_squares", m, n, dtype, parts, nrhs);
      FAIL() << "accepted; expected '" << expected << "'";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), code) << error.what();
      EXPECT_NE(std::string(error.what()).find(expected), std::string::npos) << error.what();
    }
  };
  refused(200, 256, DType::kFloat64, 4, 1, ErrorCode::kNotImplemented,
          "least_squares: a is [200, 256], wider than tall; the QR-based routines take m >= n");
  refused(1002, 8, DType::kFloat64, 4, 1, ErrorCode::kInvalidArgument,
          "least_squares: a's 1002 rows do not split evenly over 4 devices");
  refused(64, 8, DType::kBFloat16, 2, 1, ErrorCode::kInvalidArgument,
          "least_squares: dtype bfloat16 is not float32, float64, complex64 or complex128");
  refused(64, 0, DType::kFloat32, 2, 1, ErrorCode::kInvalidArgument,
          "least_squares: a is [64, 0]; it needs rows and columns");
}

TEST(SolverCall, ARightHandSideBlockHasAsRowsAndDtype) {
  EXPECT_NO_THROW(
      check_rhs_block("lu_solve", "b", {512, 3}, DType::kFloat64, 512, DType::kFloat64));
  EXPECT_NO_THROW(
      check_rhs_block("least_squares", "b", {512}, DType::kFloat32, 512, DType::kFloat32, true));
  const auto refused = [](std::vector<std::int64_t> shape, DType dtype, bool vector_ok,
                          const std::string& expected) {
    try {
      check_rhs_block("cho_solve", "b_shards[1]", shape, dtype, 512, DType::kFloat64, vector_ok);
      FAIL() << "accepted; expected '" << expected << "'";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument) << error.what();
      EXPECT_NE(std::string(error.what()).find(expected), std::string::npos) << error.what();
    }
  };
  refused({256, 1}, DType::kFloat64, false,
          "cho_solve: b_shards[1] is [256, 1] float64; expected [512, nrhs] float64: a's rows "
          "and dtype");
  refused({512, 1}, DType::kFloat32, false, "b_shards[1] is [512, 1] float32; expected");
  refused({512}, DType::kFloat64, false, "b_shards[1] is [512] float64; expected [512, nrhs]");
  refused({}, DType::kFloat64, true, "b_shards[1] is [] float64; expected [512] or [512, nrhs]");
  refused({512, 1, 1}, DType::kFloat64, true, "is [512, 1, 1] float64");
}

}  // namespace
}  // namespace meshla::solver
