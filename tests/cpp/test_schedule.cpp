// Simulates every rank of a schedule on the CPU and checks, for tp = 1..8, every op, algorithm
// and chunk count: each product term is computed exactly once, every read sees data that an
// earlier task in the declared order wrote, every region is written at most once, every send
// meets a receive of the same size, the ranks never deadlock, and every output row ends up with
// exactly the sum it should hold.
#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <map>
#include <optional>
#include <sstream>

#include "collective/schedule.hpp"
#include "meshla/error.hpp"

namespace meshla::collective {
namespace {

// A row's symbolic value: a multiset of terms (source row, rank). Rank kRaw marks an input row
// of a before any product; kBias marks the bias added to that row.
constexpr int kRaw = -1;
constexpr int kBias = -2;
using Term = std::pair<std::int64_t, int>;
using Row = std::optional<std::vector<Term>>;  // nullopt: never written

struct Failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

#define SIM_CHECK(condition, message)    \
  do {                                   \
    if (!(condition)) {                  \
      std::ostringstream sim_message_;   \
      sim_message_ << message;           \
      throw Failure(sim_message_.str()); \
    }                                    \
  } while (false)

struct RankState {
  Schedule schedule;
  std::map<Buffer, std::vector<Row>> buffers;
  std::size_t gemms_done = 0;
  std::size_t comms_done = 0;
  bool posted = false;                 // current comm task has read its sources
  std::vector<std::vector<Row>> sent;  // payload of a posted collective or copy
};

using Mailbox = std::map<std::pair<int, int>, std::deque<std::vector<Row>>>;  // (from, to)

class Simulator {
 public:
  Simulator(const ScheduleParams& base, bool gemm_first) : gemm_first_(gemm_first) {
    for (int rank = 0; rank < base.tp; ++rank) {
      ScheduleParams params = base;
      params.rank = rank;
      RankState state{.schedule = make_schedule(params)};
      const Schedule& s = state.schedule;
      state.buffers[Buffer::kInput].resize(s.input_rows);
      state.buffers[Buffer::kGathered].resize(s.gathered_rows);
      state.buffers[Buffer::kPartial].resize(s.partial_rows);
      state.buffers[Buffer::kOutput].resize(s.output_rows);
      const std::int64_t first =
          base.op == CollectiveOp::kAllGatherMatmul ? rank * s.input_rows : 0;
      for (std::int64_t i = 0; i < s.input_rows; ++i) {
        state.buffers[Buffer::kInput][i] = std::vector<Term>{{first + i, kRaw}};
      }
      ranks_.push_back(std::move(state));
    }
  }

  void run() {
    while (true) {
      bool progress = gemm_first_ ? (run_gemms() || step_comms()) : (step_comms() || run_gemms());
      if (!progress) break;
    }
    for (std::size_t r = 0; r < ranks_.size(); ++r) {
      const RankState& state = ranks_[r];
      SIM_CHECK(state.gemms_done == state.schedule.gemms.size() &&
                    state.comms_done == state.schedule.comms.size(),
                "deadlock: rank " << r << " stopped at gemm " << state.gemms_done << "/"
                                  << state.schedule.gemms.size() << ", comm " << state.comms_done
                                  << "/" << state.schedule.comms.size());
    }
    for (const auto& [pair, queue] : mailbox_) {
      SIM_CHECK(queue.empty(), "a send from rank " << pair.first << " to rank " << pair.second
                                                   << " was never received");
    }
  }

  const std::vector<RankState>& ranks() const { return ranks_; }

 private:
  Row& row(RankState& state, Buffer buffer, std::int64_t index, const char* what) {
    auto& rows = state.buffers[buffer];
    SIM_CHECK(index >= 0 && index < static_cast<std::int64_t>(rows.size()),
              what << " row " << index << " outside buffer " << buffer_name(buffer) << " of "
                   << rows.size() << " rows");
    return rows[index];
  }

  std::vector<Row> read(RankState& state, Rows at, std::int64_t count, const char* what) {
    std::vector<Row> out;
    for (std::int64_t i = 0; i < count; ++i) {
      Row& source = row(state, at.buffer, at.begin + i, what);
      SIM_CHECK(source.has_value(), what << " reads row " << at.begin + i << " of "
                                         << buffer_name(at.buffer) << " before it is written");
      out.push_back(source);
    }
    return out;
  }

  void write(RankState& state, Rows at, const std::vector<Row>& values, const char* what) {
    for (std::size_t i = 0; i < values.size(); ++i) {
      Row& target = row(state, at.buffer, at.begin + static_cast<std::int64_t>(i), what);
      SIM_CHECK(!target.has_value(), what << " writes row " << at.begin + i << " of "
                                          << buffer_name(at.buffer) << " a second time");
      target = values[i];
    }
  }

  bool run_gemms() {
    bool any = false;
    for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
      RankState& state = ranks_[r];
      while (state.gemms_done < state.schedule.gemms.size()) {
        const GemmTask& gemm = state.schedule.gemms[state.gemms_done];
        if (gemm.wait_comm >= static_cast<int>(state.comms_done)) break;
        for (int b = 0; b < gemm.batch; ++b) {
          std::vector<Row> a =
              read(state, {gemm.a.buffer, gemm.a.begin + b * gemm.a_stride}, gemm.rows, "gemm a");
          std::vector<Row> addend;
          if (gemm.has_addend) addend = read(state, gemm.addend, gemm.rows, "gemm addend");
          std::vector<Row> d;
          for (std::int64_t i = 0; i < gemm.rows; ++i) {
            SIM_CHECK(a[i]->size() == 1 && a[i]->front().second == kRaw,
                      "gemm a row is not an input row of a");
            std::vector<Term> terms{{a[i]->front().first, r}};
            if (gemm.bias) terms.push_back({a[i]->front().first, kBias});
            if (gemm.has_addend) terms.insert(terms.end(), addend[i]->begin(), addend[i]->end());
            d.push_back(terms);
          }
          write(state, {gemm.d.buffer, gemm.d.begin + b * gemm.d_stride}, d, "gemm d");
        }
        ++state.gemms_done;
        any = true;
      }
    }
    return any;
  }

  // Posts every ready comm task, then completes what can complete. True if anything moved.
  bool step_comms() {
    bool any = false;
    for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
      RankState& state = ranks_[r];
      if (state.posted || state.comms_done == state.schedule.comms.size()) continue;
      const CommTask& task = state.schedule.comms[state.comms_done];
      if (task.wait_gemm >= static_cast<int>(state.gemms_done)) continue;
      state.posted = true;
      any = true;
      state.sent.clear();
      if (task.kind == CommKind::kSendRecv) {
        for (const Transfer& send : task.sends) {
          SIM_CHECK(send.peer != r && send.peer >= 0 && send.peer < static_cast<int>(ranks_.size()),
                    "rank " << r << " sends to invalid peer " << send.peer);
          mailbox_[{r, send.peer}].push_back(read(state, send.at, send.rows, "send"));
        }
      } else {
        const std::int64_t rows =
            task.kind == CommKind::kReduceScatter ? task.rows * ranks_.size() : task.rows;
        state.sent.push_back(read(state, task.src, rows, "collective source"));
      }
    }
    for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) any |= try_complete(r);
    return any;
  }

  bool try_complete(int r) {
    RankState& state = ranks_[r];
    if (!state.posted) return false;
    const CommTask& task = state.schedule.comms[state.comms_done];
    switch (task.kind) {
      case CommKind::kCopy:
        write(state, task.dst, state.sent[0], "copy");
        break;
      case CommKind::kSendRecv: {
        std::map<int, std::size_t> needed;
        for (const Transfer& recv : task.recvs) ++needed[recv.peer];
        for (const auto& [peer, count] : needed) {
          if (mailbox_[{peer, r}].size() < count) return false;
        }
        for (const Transfer& recv : task.recvs) {
          auto& queue = mailbox_[{recv.peer, r}];
          std::vector<Row> payload = std::move(queue.front());
          queue.pop_front();
          SIM_CHECK(static_cast<std::int64_t>(payload.size()) == recv.rows,
                    "rank " << r << " receives " << recv.rows << " rows from rank " << recv.peer
                            << " which sent " << payload.size());
          write(state, recv.at, payload, "recv");
        }
        break;
      }
      default:
        return complete_collective(task);
    }
    finish(state);
    return true;
  }

  bool complete_collective(const CommTask& task) {
    for (RankState& other : ranks_) {
      if (!other.posted) return false;
      const CommTask& theirs = other.schedule.comms[other.comms_done];
      SIM_CHECK(theirs.kind == task.kind && theirs.rows == task.rows,
                "ranks disagree on a collective: "
                    << comm_kind_name(task.kind) << " of " << task.rows << " rows against "
                    << comm_kind_name(theirs.kind) << " of " << theirs.rows);
    }
    const auto tp = static_cast<std::int64_t>(ranks_.size());
    auto merge = [&](std::int64_t source_row) {
      std::vector<Term> terms;
      for (RankState& other : ranks_) {
        const auto& part = *other.sent[0][source_row];
        terms.insert(terms.end(), part.begin(), part.end());
      }
      return Row(terms);
    };
    for (std::int64_t r = 0; r < tp; ++r) {
      RankState& state = ranks_[r];
      std::vector<Row> result;
      for (std::int64_t i = 0; i < task.rows * (task.kind == CommKind::kAllGather ? tp : 1); ++i) {
        switch (task.kind) {
          case CommKind::kAllGather:
            result.push_back(ranks_[i / task.rows].sent[0][i % task.rows]);
            break;
          case CommKind::kReduceScatter:
            result.push_back(merge(r * task.rows + i));
            break;
          default:
            result.push_back(merge(i));
        }
      }
      write(state, state.schedule.comms[state.comms_done].dst, result, "collective");
    }
    for (RankState& state : ranks_) finish(state);
    return true;
  }

  static void finish(RankState& state) {
    state.posted = false;
    ++state.comms_done;
  }

  bool gemm_first_;
  std::vector<RankState> ranks_;
  Mailbox mailbox_;
};

std::vector<Term> sorted(std::vector<Term> terms) {
  std::sort(terms.begin(), terms.end());
  return terms;
}

// The value every output row must hold.
void check_outputs(const ScheduleParams& p, const std::vector<RankState>& ranks) {
  const std::int64_t block = p.m / p.tp;
  for (int r = 0; r < p.tp; ++r) {
    const auto& out = ranks[r].buffers.at(Buffer::kOutput);
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(out.size()); ++i) {
      SIM_CHECK(out[i].has_value(), "rank " << r << " output row " << i << " is never written");
      std::int64_t source = i;
      if (p.op == CollectiveOp::kMatmulReduceScatter) source = r * block + i;
      std::vector<Term> expected;
      if (p.op == CollectiveOp::kAllGatherMatmul) {
        expected.push_back({source, r});
      } else {
        for (int q = 0; q < p.tp; ++q) expected.push_back({source, q});
      }
      if (p.bias) expected.push_back({source, kBias});
      SIM_CHECK(sorted(*out[i]) == sorted(expected),
                "rank " << r << " output row " << i << " holds " << out[i]->size()
                        << " terms, not its expected " << expected.size());
    }
    if (p.return_gathered) {
      const auto& gathered = ranks[r].buffers.at(Buffer::kGathered);
      for (std::int64_t i = 0; i < p.m; ++i) {
        const std::vector<Term> raw{{i, kRaw}};
        SIM_CHECK(gathered[i].has_value() && sorted(*gathered[i]) == raw,
                  "rank " << r << " gathered row " << i << " is wrong or missing");
      }
    }
  }
}

std::string describe(const ScheduleParams& p) {
  std::ostringstream out;
  out << collective_op_name(p.op) << " " << algorithm_name(p.algorithm) << " tp=" << p.tp
      << " m=" << p.m << " chunks=" << p.chunks << " bias=" << p.bias
      << " gathered=" << p.return_gathered;
  return out.str();
}

void simulate_and_check(const ScheduleParams& p) {
  for (bool gemm_first : {true, false}) {
    try {
      Simulator sim(p, gemm_first);
      sim.run();
      check_outputs(p, sim.ranks());
    } catch (const Failure& failure) {
      ADD_FAILURE() << describe(p) << (gemm_first ? " (GEMMs eager)" : " (comms eager)") << ": "
                    << failure.what();
      return;
    }
  }
}

const CollectiveOp kOps[] = {CollectiveOp::kAllGatherMatmul, CollectiveOp::kMatmulReduceScatter,
                             CollectiveOp::kMatmulAllReduce};
const Algorithm kAlgorithms[] = {Algorithm::kSequential, Algorithm::kPipelined, Algorithm::kRing};

TEST(Schedule, EveryOpAlgorithmTpAndChunkCount) {
  int simulated = 0;
  for (int tp = 1; tp <= 8; ++tp) {
    for (CollectiveOp op : kOps) {
      for (Algorithm algorithm : kAlgorithms) {
        for (std::int64_t block : {1, 2, 3, 5, 7}) {
          const std::int64_t m = tp * block;
          const std::int64_t split =
              op == CollectiveOp::kMatmulAllReduce && algorithm == Algorithm::kPipelined ? m
                                                                                         : block;
          const int max_chunks = algorithm == Algorithm::kSequential ? 1 : static_cast<int>(split);
          for (int chunks = 1; chunks <= max_chunks; ++chunks) {
            for (bool bias : {false, true}) {
              for (bool gathered : {false, true}) {
                if (gathered && op != CollectiveOp::kAllGatherMatmul) continue;
                simulate_and_check({.op = op,
                                    .algorithm = algorithm,
                                    .tp = tp,
                                    .m = m,
                                    .chunks = chunks,
                                    .bias = bias,
                                    .return_gathered = gathered});
                ++simulated;
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(simulated, 1000);
}

TEST(Schedule, AllReducePipelinedTakesRowsNotDivisibleByTp) {
  for (int tp = 2; tp <= 8; ++tp) {
    for (std::int64_t m : {std::int64_t{1}, tp - 1L, tp + 1L, 3L * tp - 1}) {
      for (int chunks = 1; chunks <= m; ++chunks) {
        simulate_and_check({.op = CollectiveOp::kMatmulAllReduce,
                            .algorithm = Algorithm::kPipelined,
                            .tp = tp,
                            .m = m,
                            .chunks = chunks});
        simulate_and_check({.op = CollectiveOp::kMatmulAllReduce,
                            .algorithm = Algorithm::kSequential,
                            .tp = tp,
                            .m = m,
                            .chunks = 1});
      }
    }
  }
}

TEST(Schedule, ChunksAreBalancedAndCoverTheRows) {
  for (std::int64_t rows = 1; rows <= 40; ++rows) {
    for (int count = 1; count <= rows; ++count) {
      EXPECT_EQ(chunk_begin(rows, count, 0), 0);
      EXPECT_EQ(chunk_begin(rows, count, count), rows);
      for (int i = 0; i < count; ++i) {
        const std::int64_t size = chunk_begin(rows, count, i + 1) - chunk_begin(rows, count, i);
        EXPECT_TRUE(size == rows / count || size == rows / count + 1) << rows << "/" << count;
      }
    }
  }
}

std::string error_of(const ScheduleParams& p, ErrorCode* code = nullptr) {
  try {
    make_schedule(p);
  } catch (const Error& error) {
    if (code) *code = error.code();
    return error.what();
  }
  return "";
}

TEST(Schedule, RejectsRowsNotDivisibleByTpNamingTheShapes) {
  ErrorCode code{};
  const std::string message = error_of({.op = CollectiveOp::kAllGatherMatmul,
                                        .algorithm = Algorithm::kRing,
                                        .tp = 4,
                                        .m = 1001,
                                        .chunks = 1},
                                       &code);
  EXPECT_EQ(code, ErrorCode::kInvalidArgument);
  EXPECT_NE(message.find("all_gather_matmul"), std::string::npos) << message;
  EXPECT_NE(message.find("m=1001"), std::string::npos) << message;
  EXPECT_NE(message.find("tp_size=4"), std::string::npos) << message;

  EXPECT_NE(error_of({.op = CollectiveOp::kMatmulReduceScatter,
                      .algorithm = Algorithm::kPipelined,
                      .tp = 3,
                      .m = 10,
                      .chunks = 1})
                .find("m=10 rows are not divisible by tp_size=3"),
            std::string::npos);
}

TEST(Schedule, RingAllReduceWithUnevenRowsIsNotImplemented) {
  ErrorCode code{};
  const std::string message = error_of({.op = CollectiveOp::kMatmulAllReduce,
                                        .algorithm = Algorithm::kRing,
                                        .tp = 4,
                                        .m = 10,
                                        .chunks = 1},
                                       &code);
  EXPECT_EQ(code, ErrorCode::kNotImplemented);
  EXPECT_NE(message.find("use pipelined or sequential"), std::string::npos) << message;
}

TEST(Schedule, RejectsMoreChunksThanRows) {
  const std::string message = error_of({.op = CollectiveOp::kAllGatherMatmul,
                                        .algorithm = Algorithm::kPipelined,
                                        .tp = 2,
                                        .m = 8,
                                        .chunks = 5});
  EXPECT_NE(message.find("chunks=5 exceeds the 4 rows"), std::string::npos) << message;
  EXPECT_NE(error_of({.op = CollectiveOp::kAllGatherMatmul,
                      .algorithm = Algorithm::kSequential,
                      .tp = 2,
                      .m = 8,
                      .chunks = 2})
                .find("sequential runs one chunk"),
            std::string::npos);
  EXPECT_NE(error_of({.op = CollectiveOp::kAllGatherMatmul,
                      .algorithm = Algorithm::kRing,
                      .tp = 2,
                      .rank = 2,
                      .m = 8,
                      .chunks = 1})
                .find("rank=2 is outside"),
            std::string::npos);
}

TEST(Schedule, DefaultsAreValidForEveryShape) {
  for (int tp = 1; tp <= 8; ++tp) {
    for (CollectiveOp op : kOps) {
      for (std::int64_t m : {static_cast<std::int64_t>(tp), 4L * tp, 1024L * tp}) {
        const Algorithm algorithm = default_algorithm(op, tp, m);
        const int chunks = default_chunks(op, algorithm, tp, m);
        EXPECT_NO_THROW(
            make_schedule({.op = op, .algorithm = algorithm, .tp = tp, .m = m, .chunks = chunks}));
      }
    }
  }
  EXPECT_EQ(default_algorithm(CollectiveOp::kMatmulAllReduce, 4, 10), Algorithm::kSequential);
  EXPECT_EQ(default_algorithm(CollectiveOp::kAllGatherMatmul, 4, 16384), Algorithm::kPipelined);
  EXPECT_EQ(default_algorithm(CollectiveOp::kAllGatherMatmul, 2, 16384), Algorithm::kSequential);
}

}  // namespace
}  // namespace meshla::collective

namespace meshla::collective {
namespace {

std::vector<bool> overlapping(CollectiveOp op, Algorithm algorithm, int tp, int rank, int chunks,
                              bool return_gathered = false) {
  const Schedule s = make_schedule({.op = op,
                                    .algorithm = algorithm,
                                    .tp = tp,
                                    .rank = rank,
                                    .m = 8L * tp,
                                    .chunks = chunks,
                                    .return_gathered = return_gathered});
  std::vector<bool> marks;
  for (const GemmTask& gemm : s.gemms) marks.push_back(gemm.overlaps_comm);
  return marks;
}

TEST(Schedule, SequentialGemmsRunAlone) {
  for (CollectiveOp op : kOps) {
    EXPECT_EQ(overlapping(op, Algorithm::kSequential, 4, 1, 1), std::vector<bool>{false});
  }
}

TEST(Schedule, OneRankIsItsGemmInPlaceWhateverTheAlgorithm) {
  for (CollectiveOp op : kOps) {
    for (Algorithm algorithm : {Algorithm::kSequential, Algorithm::kPipelined, Algorithm::kRing}) {
      for (bool gathered : {false, true}) {
        if (gathered && op != CollectiveOp::kAllGatherMatmul) continue;
        const Schedule s = make_schedule({.op = op,
                                          .algorithm = algorithm,
                                          .tp = 1,
                                          .m = 6,
                                          .chunks = algorithm == Algorithm::kSequential ? 1 : 3,
                                          .bias = true,
                                          .return_gathered = gathered});
        SCOPED_TRACE(std::string(collective_op_name(op)) + " " +
                     std::string(algorithm_name(algorithm)));
        ASSERT_EQ(s.gemms.size(), 1u);
        EXPECT_EQ(s.gemms[0].a.buffer, Buffer::kInput);
        EXPECT_EQ(s.gemms[0].d.buffer, Buffer::kOutput);
        EXPECT_EQ(s.gemms[0].rows, 6);
        EXPECT_TRUE(s.gemms[0].bias);
        EXPECT_FALSE(s.gemms[0].overlaps_comm);
        EXPECT_EQ(s.partial_rows, 0);
        // The gathered rows are the caller's own, copied out only when asked for.
        ASSERT_EQ(s.comms.size(), gathered ? 1u : 0u);
        if (gathered) EXPECT_EQ(s.comms[0].kind, CommKind::kCopy);
        EXPECT_EQ(s.gathered_rows, gathered ? 6 : 0);
      }
    }
  }
}

TEST(Schedule, OneRankStillRefusesWhatMoreRanksWould) {
  // The one-rank schedule ignores the algorithm's chunks, but not their checks.
  EXPECT_THROW(make_schedule({.op = CollectiveOp::kMatmulReduceScatter,
                              .algorithm = Algorithm::kPipelined,
                              .tp = 1,
                              .m = 6,
                              .chunks = 7}),
               Error);
}

TEST(Schedule, RingAllGatherOverlapsOnlyWhileBlocksTravel) {
  // Own block beside the ring passes; blocks below (arrived mid-ring) beside the last pass;
  // blocks above wait for the last pass and run alone, also when only a copy engine copy follows.
  EXPECT_EQ(overlapping(CollectiveOp::kAllGatherMatmul, Algorithm::kRing, 4, 2, 1),
            (std::vector<bool>{true, true, false}));
  EXPECT_EQ(overlapping(CollectiveOp::kAllGatherMatmul, Algorithm::kRing, 4, 0, 1, true),
            (std::vector<bool>{true, false}));
  EXPECT_EQ(overlapping(CollectiveOp::kAllGatherMatmul, Algorithm::kRing, 1, 0, 1),
            std::vector<bool>{false});
}

TEST(Schedule, PipelinedReduceScatterOverlapsFromTheSecondChunk) {
  EXPECT_EQ(overlapping(CollectiveOp::kMatmulReduceScatter, Algorithm::kPipelined, 4, 3, 3),
            (std::vector<bool>{false, true, true}));
  EXPECT_EQ(overlapping(CollectiveOp::kAllGatherMatmul, Algorithm::kPipelined, 2, 0, 3),
            (std::vector<bool>{true, true, false}));
}

}  // namespace
}  // namespace meshla::collective
