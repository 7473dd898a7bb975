// The rendezvous of the GPU-driving threads of one process: every participant's value reaches
// the leader in order, the leader's error reaches everyone, a missing participant ends in a
// timeout naming it, repeated calls and two meshes in flight never mix, and no meeting outlives
// its call.
#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <thread>

#include "meshla/error.hpp"
#include "solver/rendezvous.hpp"

namespace meshla::solver {
namespace {

using namespace std::chrono_literals;

// Runs `body(index)` on `count` threads at once and returns what each threw ("" if nothing).
template <typename Body>
std::vector<std::string> on_threads(int count, Body body) {
  std::vector<std::string> errors(count);
  std::vector<std::thread> threads;
  for (int i = 0; i < count; ++i) {
    threads.emplace_back([&, i] {
      try {
        body(i);
      } catch (const std::exception& error) {
        errors[i] = error.what();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  return errors;
}

TEST(Rendezvous, LeaderSeesEveryValueInOrderOverRepeatedCalls) {
  constexpr int kCount = 4;
  std::vector<int> shards(kCount);
  std::atomic<int> runs{0};
  const auto errors = on_threads(kCount, [&](int index) {
    for (std::uint64_t call = 0; call < 200; ++call) {
      meet(
          {"potrf/mesh-a", call}, index, kCount, &shards[index],
          [&](const std::vector<void*>& values) {
            ASSERT_EQ(values.size(), static_cast<std::size_t>(kCount));
            for (int i = 0; i < kCount; ++i) EXPECT_EQ(values[i], &shards[i]);
            ++runs;
          },
          5s);
    }
  });
  for (const auto& error : errors) EXPECT_EQ(error, "");
  EXPECT_EQ(runs.load(), 200);  // once per call, by the leader only
  EXPECT_EQ(open_meetings(), 0u);
}

TEST(Rendezvous, LeaderErrorReachesEveryParticipant) {
  const auto errors = on_threads(3, [&](int index) {
    meet(
        {"potrf/failing", 0}, index, 3, nullptr,
        [](const std::vector<void*>&) {
          throw Error(ErrorCode::kCusolver, "cusolverMgPotrf failed: not positive definite");
        },
        5s);
  });
  for (const auto& error : errors) {
    EXPECT_EQ(error, "cusolverMgPotrf failed: not positive definite");
  }
  EXPECT_EQ(open_meetings(), 0u);
}

TEST(Rendezvous, MissingParticipantEndsInATimeoutNamingIt) {
  std::atomic<bool> ran{false};
  const auto errors = on_threads(4, [&](int index) {
    if (index == 2) return;  // this GPU's handler never comes
    meet(
        {"potrs/missing", 0}, index, 4, nullptr, [&](const std::vector<void*>&) { ran = true; },
        200ms);
  });
  EXPECT_FALSE(ran.load());
  for (int index : {0, 1, 3}) {
    EXPECT_NE(errors[index].find("participants 2 of 4 never arrived"), std::string::npos)
        << errors[index];
  }
  EXPECT_EQ(open_meetings(), 0u);
}

TEST(Rendezvous, TwoMeshesInFlightDoNotMix) {
  // Two 2-GPU meshes of one process, driven by four threads interleaving their calls.
  std::vector<int> mesh_a(2), mesh_b(2);
  const auto errors = on_threads(4, [&](int thread) {
    const bool in_a = thread < 2;
    const int index = thread % 2;
    auto& shards = in_a ? mesh_a : mesh_b;
    for (std::uint64_t call = 0; call < 100; ++call) {
      meet(
          {in_a ? "syevd/mesh-a" : "syevd/mesh-b", call}, index, 2, &shards[index],
          [&](const std::vector<void*>& values) {
            EXPECT_EQ(values[0], &shards[0]);
            EXPECT_EQ(values[1], &shards[1]);
          },
          5s);
    }
  });
  for (const auto& error : errors) EXPECT_EQ(error, "");
  EXPECT_EQ(open_meetings(), 0u);
}

TEST(Rendezvous, RejectsBadParticipants) {
  EXPECT_THROW(meet(
                   {"bad", 0}, 3, 3, nullptr, [](const std::vector<void*>&) {}, 1s),
               Error);
  const auto errors = on_threads(2, [&](int index) {
    // Both claim to be participant 0 of 2: the second is refused, the first times out.
    (void)index;
    meet(
        {"twice", 0}, 0, 2, nullptr, [](const std::vector<void*>&) {}, 200ms);
  });
  int refused = 0, timed_out = 0;
  for (const auto& error : errors) {
    refused += error.find("arrived twice") != std::string::npos;
    timed_out += error.find("never arrived") != std::string::npos;
  }
  EXPECT_EQ(refused, 1);
  EXPECT_EQ(timed_out, 1);
  EXPECT_EQ(open_meetings(), 0u);
}

TEST(Rendezvous, SingleParticipantRunsAtOnce) {
  int value = 7;
  int seen = 0;
  meet(
      {"one-gpu", 0}, 0, 1, &value,
      [&](const std::vector<void*>& values) { seen = *static_cast<int*>(values[0]); }, 1s);
  EXPECT_EQ(seen, 7);
}

}  // namespace
}  // namespace meshla::solver
