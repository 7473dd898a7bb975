// The symmetric backend's host-side layout and its config rules: every rank's blocks are covered
// exactly once, and kAuto falls back to NCCL whenever the symmetric backend cannot run a config.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <set>
#include <vector>

#include "collective/symmetric/peer_plan.hpp"
#include "collective/validation.hpp"
#include "comm/nvlink.hpp"
#include "meshla/error.hpp"

namespace meshla::collective {
namespace {

TEST(PeerPlan, RingPeersVisitEveryOtherRankOnce) {
  for (int tp = 1; tp <= 8; ++tp) {
    for (int rank = 0; rank < tp; ++rank) {
      const std::vector<int> peers = ring_peers(tp, rank);
      ASSERT_EQ(static_cast<int>(peers.size()), tp - 1);
      std::set<int> seen(peers.begin(), peers.end());
      EXPECT_EQ(static_cast<int>(seen.size()), tp - 1);
      EXPECT_EQ(seen.count(rank), 0u);
      if (tp > 1) EXPECT_EQ(peers.front(), (rank + 1) % tp);
    }
  }
}

// The batches cover every received block once, keep the arrival order (a batch waits for its
// last block, so no block may come before one that arrives earlier), start with the first
// arrival alone and hold at most two blocks, sorted so that the batch stride is positive.
TEST(PeerPlan, ArrivalBatchesCoverTheArrivalsInOrder) {
  for (int tp = 1; tp <= 8; ++tp) {
    for (int rank = 0; rank < tp; ++rank) {
      const std::vector<int> sources = arrival_order(tp, rank);
      const std::vector<std::vector<int>> batches = arrival_batches(tp, rank);
      std::vector<int> covered;
      for (const std::vector<int>& batch : batches) {
        ASSERT_FALSE(batch.empty());
        EXPECT_LE(batch.size(), 2u);
        EXPECT_TRUE(std::is_sorted(batch.begin(), batch.end()));
        // Members of a batch are consecutive arrivals: compare as sets with the next arrivals.
        std::vector<int> expected(
            sources.begin() + static_cast<std::ptrdiff_t>(covered.size()),
            sources.begin() + static_cast<std::ptrdiff_t>(covered.size() + batch.size()));
        std::sort(expected.begin(), expected.end());
        EXPECT_EQ(batch, expected) << "tp=" << tp << " rank=" << rank;
        covered.insert(covered.end(), batch.begin(), batch.end());
      }
      EXPECT_EQ(covered.size(), sources.size());
      if (tp > 1) EXPECT_EQ(batches.front(), std::vector<int>{sources.front()});
    }
  }
}

// Rank q's d-th push (ring_peers) goes to q+d, so rank r hears from r-1 first, then r-2, ...:
// arrival_order must list every other rank once, in that order.
TEST(PeerPlan, ArrivalOrderFollowsThePushOrder) {
  for (int tp = 1; tp <= 8; ++tp) {
    for (int rank = 0; rank < tp; ++rank) {
      const std::vector<int> sources = arrival_order(tp, rank);
      ASSERT_EQ(static_cast<int>(sources.size()), tp - 1);
      for (std::size_t i = 0; i < sources.size(); ++i) {
        const std::vector<int> pushes = ring_peers(tp, sources[i]);
        EXPECT_EQ(pushes[i], rank) << "tp=" << tp << " rank=" << rank << " source " << sources[i];
      }
      EXPECT_EQ(std::set<int>(sources.begin(), sources.end()).size(), sources.size());
    }
  }
}

// Every output row of a reduce-scatter or all-reduce belongs to exactly one (owner, round)
// sub-block, and each owner's sub-blocks tile its own contiguous rows in round order.
TEST(PeerPlan, SubBlocksTileTheRows) {
  for (int tp = 1; tp <= 8; ++tp) {
    for (int rounds = 1; rounds <= 4; ++rounds) {
      const std::int64_t m = static_cast<std::int64_t>(tp) * rounds * 3;
      const std::int64_t sub = m / tp / rounds;
      std::vector<int> covered(static_cast<std::size_t>(m), 0);
      for (int owner = 0; owner < tp; ++owner) {
        for (int round = 0; round < rounds; ++round) {
          const std::int64_t begin = sub_block_begin(m, tp, rounds, owner, round);
          EXPECT_EQ(begin, owner * (m / tp) + round * sub);
          for (std::int64_t row = begin; row < begin + sub; ++row) ++covered[row];
        }
      }
      for (std::int64_t row = 0; row < m; ++row) EXPECT_EQ(covered[row], 1);
    }
  }
}

void expect_error(const std::function<void()>& call, ErrorCode code, const std::string& text) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one mentioning " << text;
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), code) << error.what();
    EXPECT_NE(std::string(error.what()).find(text), std::string::npos) << error.what();
  }
}

std::string reason(CollectiveMatmulConfig config, int tp) {
  return symmetric_unsupported(config, tp);
}

TEST(PeerPlan, NamesWhatTheSymmetricBackendCannotRun) {
  const CollectiveMatmulConfig ag{.op = CollectiveOp::kAllGatherMatmul, .m = 64, .n = 8, .k = 8};
  EXPECT_EQ(reason(ag, 4), "");
  CollectiveMatmulConfig c = ag;
  c.algorithm = Algorithm::kPipelined;
  EXPECT_NE(reason(c, 4).find("runs algorithm=ring only, not pipelined"), std::string::npos);
  c = ag;
  c.comm_ctas = 4;
  EXPECT_NE(reason(c, 4).find("comm_ctas=4"), std::string::npos);
  c = ag;
  c.m = 66;
  EXPECT_NE(reason(c, 4).find("m=66 is not divisible by tp_size=4"), std::string::npos);
  c = ag;
  c.chunks = 2;
  EXPECT_NE(reason(c, 4).find("chunks=2"), std::string::npos);
  CollectiveMatmulConfig rs = ag;
  rs.op = CollectiveOp::kMatmulReduceScatter;
  rs.chunks = 3;
  EXPECT_NE(reason(rs, 4).find("chunks=3 rounds do not divide the m/tp_size=16 rows"),
            std::string::npos);
  rs.chunks = 4;
  EXPECT_EQ(reason(rs, 4), "");
}

TEST(PeerPlan, AutoPicksSymmetricOnlyOverNvlinkAndWithASupportedConfig) {
  const CollectiveMatmulConfig ar{.op = CollectiveOp::kMatmulAllReduce, .m = 64, .n = 8, .k = 8};
  EXPECT_EQ(resolve_config(ar, 4, PeerReach::kNvlink).backend, Backend::kSymmetric);
  EXPECT_EQ(resolve_config(ar, 4, PeerReach::kNvlink).algorithm, Algorithm::kRing);
  EXPECT_EQ(resolve_config(ar, 4, PeerReach::kNvlink).chunks, 1);  // 16 rows per rank: too few
  EXPECT_EQ(resolve_config(ar, 4, PeerReach::kNvlink).comm_sms, 0);
  EXPECT_EQ(resolve_config(ar, 4, PeerReach::kNone).backend, Backend::kNccl);
  // Peer access over PCIe maps the memory, but only NVLink makes the symmetric backend the default.
  EXPECT_EQ(resolve_config(ar, 4, PeerReach::kMapped).backend, Backend::kNccl);
  CollectiveMatmulConfig forced = ar;
  forced.backend = Backend::kSymmetric;
  EXPECT_EQ(resolve_config(forced, 4, PeerReach::kMapped).backend, Backend::kSymmetric);
  EXPECT_EQ(resolve_config(ar, 1, PeerReach::kNvlink).backend, Backend::kNccl);
  CollectiveMatmulConfig uneven = ar;
  uneven.m = 63;  // all-reduce accepts any m on NCCL, not on the symmetric backend
  EXPECT_EQ(resolve_config(uneven, 4, PeerReach::kNvlink).backend, Backend::kNccl);
  CollectiveMatmulConfig sequential = ar;
  sequential.algorithm = Algorithm::kSequential;
  EXPECT_EQ(resolve_config(sequential, 4, PeerReach::kNvlink).backend, Backend::kNccl);
}

TEST(PeerPlan, AllReduceTakesTwoRoundsOfAtLeast512Rows) {
  EXPECT_EQ(default_rounds(CollectiveOp::kMatmulAllReduce, 4, 8192), 2);
  EXPECT_EQ(default_rounds(CollectiveOp::kMatmulAllReduce, 4, 4096), 2);
  EXPECT_EQ(default_rounds(CollectiveOp::kMatmulAllReduce, 2, 16384), 2);
  EXPECT_EQ(default_rounds(CollectiveOp::kMatmulAllReduce, 4, 2048), 1);
  EXPECT_EQ(default_rounds(CollectiveOp::kMatmulAllReduce, 4, 4100), 1);  // 1025 rows per rank
  EXPECT_EQ(default_rounds(CollectiveOp::kMatmulReduceScatter, 4, 8192), 1);
}

TEST(PeerPlan, ForcedSymmetricExplainsWhyItCannotRun) {
  CollectiveMatmulConfig c{.op = CollectiveOp::kMatmulReduceScatter,
                           .algorithm = Algorithm::kSequential,
                           .backend = Backend::kSymmetric,
                           .m = 64,
                           .n = 8,
                           .k = 8};
  expect_error([&] { resolve_config(c, 4, PeerReach::kNvlink); }, ErrorCode::kNotImplemented,
               "use backend=nccl");
  c.algorithm = Algorithm::kRing;
  c.chunks = 5;
  expect_error([&] { resolve_config(c, 4, PeerReach::kNvlink); }, ErrorCode::kInvalidArgument,
               "chunks=5");
  c.chunks = 0;
  expect_error([&] { resolve_config(c, 4, PeerReach::kNone); }, ErrorCode::kNotImplemented,
               "CUDA peer access");
}

// Without NVML (machines without the NVIDIA driver, such as CI's) or for GPUs it does not know,
// the answer is no, with a reason that names NVML; never an exception or a crash.
TEST(PeerPlan, NvlinkQuestionAnswersNoWithAReasonWhereNvmlCannotTell) {
  const std::string why = detail::why_not_nvlink("0000:ff:1f.0", "0000:fe:1f.0");
  EXPECT_NE(why.find("NVML"), std::string::npos) << why;
}

// The workspace a plan asks for holds every flag and every byte the executor addresses: the
// all-gather's slots, the reduce ops' inbox[round][source] and staged products, and the
// all-reduce's summed rows after the inbox.
TEST(PeerPlan, WorkspaceSizesHoldEverythingAPlanAddresses) {
  for (const CollectiveOp op : {CollectiveOp::kAllGatherMatmul, CollectiveOp::kMatmulReduceScatter,
                                CollectiveOp::kMatmulAllReduce}) {
    for (const int tp : {1, 2, 4, 8}) {
      CollectiveMatmulConfig requested{
          .op = op, .backend = Backend::kSymmetric, .m = 1024 * tp, .n = 96, .k = 40};
      const CollectiveMatmulConfig c = resolve_config(requested, tp, PeerReach::kNvlink);
      const std::int64_t element = 2;  // bfloat16
      const collective::GroupWorkspace::Sizes sizes = symmetric_workspace_sizes(c, tp);
      const int rounds = op == CollectiveOp::kAllGatherMatmul ? 1 : c.chunks;
      EXPECT_EQ(sizes.signal_bytes, static_cast<std::size_t>(tp * (1 + 2 * rounds) * 4));
      if (op == CollectiveOp::kAllGatherMatmul) {
        EXPECT_EQ(sizes.data_bytes, static_cast<std::size_t>(c.m * c.k * element));  // tp slots
        EXPECT_EQ(sizes.scratch_bytes, 0u);
        continue;
      }
      const std::int64_t sub_bytes = c.m / tp / rounds * c.n * element;
      const std::int64_t inbox_end = rounds * tp * sub_bytes;
      EXPECT_EQ(sizes.scratch_bytes, static_cast<std::size_t>(inbox_end));
      std::int64_t data_end = inbox_end;
      if (op == CollectiveOp::kMatmulAllReduce) {
        for (int owner = 0; owner < tp; ++owner) {
          for (int round = 0; round < rounds; ++round) {
            const std::int64_t row = sub_block_begin(c.m, tp, rounds, owner, round);
            data_end = std::max(data_end, inbox_end + (row + c.m / tp / rounds) * c.n * element);
          }
        }
      }
      EXPECT_EQ(sizes.data_bytes, static_cast<std::size_t>(data_end)) << collective_op_name(op);
    }
  }
}

// Rowwise float8 scales are read 16 bytes aligned: where a symmetric plan's GEMMs would start off
// a 4-row boundary (default rounds included), auto falls back to nccl, whose sequential GEMMs start
// at row 0, and a request for symmetric says why.
TEST(PeerPlan, RowwiseRowsOffFourRowBoundariesFallBackToNcclUnderAuto) {
  CollectiveMatmulConfig c{.op = CollectiveOp::kMatmulAllReduce,
                           .dtype = DType::kFloat8E4M3,
                           .out_dtype = DType::kBFloat16,
                           .scaling = MatmulScaling::kRowwise,
                           .m = 4112,  // 1028 rows a rank, two default rounds of 514
                           .n = 16,
                           .k = 16,
                           .trans_b = true};
  EXPECT_EQ(resolve_config(c, 4, PeerReach::kNvlink).backend, Backend::kNccl);
  c.backend = Backend::kSymmetric;
  expect_error([&] { resolve_config(c, 4, PeerReach::kNvlink); }, ErrorCode::kNotImplemented,
               "backend=symmetric with algorithm=ring and chunks=2 starts a GEMM at row 514");
  c.chunks = 1;  // one round: every rank's block starts at a multiple of 1028
  EXPECT_EQ(resolve_config(c, 4, PeerReach::kNvlink).backend, Backend::kSymmetric);
  c.backend = Backend::kAuto;
  c.chunks = 0;
  c.scaling = MatmulScaling::kTensorwise;  // one scale: any row will do
  EXPECT_EQ(resolve_config(c, 4, PeerReach::kNvlink).backend, Backend::kSymmetric);
}

// A float8 plan moves a's one-byte rows (rowwise: their scales after them, 256-byte aligned) and
// sums its partial products in the output dtype.
TEST(PeerPlan, Float8WorkspaceHoldsOneByteRowsTheirScalesAndOutputDtypeSums) {
  CollectiveMatmulConfig gather{.op = CollectiveOp::kAllGatherMatmul,
                                .backend = Backend::kSymmetric,
                                .dtype = DType::kFloat8E4M3,
                                .out_dtype = DType::kBFloat16,
                                .scaling = MatmulScaling::kRowwise,
                                .m = 2 * 100,
                                .n = 96,
                                .k = 48,
                                .trans_b = true};
  const CollectiveMatmulConfig c = resolve_config(gather, 2, PeerReach::kNvlink);
  EXPECT_EQ(gathered_scales_offset(c), 9728u);  // 200 x 48 bytes, aligned up to 256
  EXPECT_EQ(symmetric_workspace_sizes(c, 2).data_bytes, 9728u + 200 * sizeof(float));
  gather.scaling = MatmulScaling::kTensorwise;
  EXPECT_EQ(symmetric_workspace_sizes(resolve_config(gather, 2, PeerReach::kNvlink), 2).data_bytes,
            200u * 48);
  CollectiveMatmulConfig reduce = gather;
  reduce.op = CollectiveOp::kMatmulReduceScatter;
  reduce.out_dtype = DType::kFloat32;
  const collective::GroupWorkspace::Sizes sizes =
      symmetric_workspace_sizes(resolve_config(reduce, 2, PeerReach::kNvlink), 2);
  EXPECT_EQ(sizes.data_bytes, 200u * 96 * sizeof(float));
  EXPECT_EQ(sizes.scratch_bytes, 200u * 96 * sizeof(float));
}

}  // namespace
}  // namespace meshla::collective
