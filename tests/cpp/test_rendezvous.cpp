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
    EXPECT_NE(errors[index].find("participants 2 of 4 had not arrived"), std::string::npos)
        << errors[index];
  }
  // The meeting waits for its late participant, which learns at once that it was given up.
  EXPECT_EQ(open_meetings(), 1u);
  const auto start = std::chrono::steady_clock::now();
  try {
    meet(
        {"potrs/missing", 0}, 2, 4, nullptr, [&](const std::vector<void*>&) { ran = true; }, 5s);
    FAIL() << "the late participant ran";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kTimeout);
    EXPECT_NE(std::string(error.what()).find("participants 2 of 4 had not arrived"),
              std::string::npos)
        << error.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1s);
  EXPECT_FALSE(ran.load());
  EXPECT_EQ(open_meetings(), 0u);
}

TEST(Rendezvous, AParticipantThatCannotComeFailsTheOthersAtOnce) {
  // Participant 0 waits, participant 1's preparation fails, participant 2 comes after that.
  std::atomic<bool> ran{false};
  const auto start = std::chrono::steady_clock::now();
  const auto errors = on_threads(3, [&](int index) {
    if (index == 1) {
      std::this_thread::sleep_for(50ms);
      abandon({"syevd/abandoned", 0}, 1, 3,
              Error(ErrorCode::kCuda, "eigh: XLA could not allocate 4096 bytes of workspace"));
      return;
    }
    if (index == 2) std::this_thread::sleep_for(150ms);
    meet(
        {"syevd/abandoned", 0}, index, 3, nullptr, [&](const std::vector<void*>&) { ran = true; },
        30s);
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);  // not the 30 s timeout
  EXPECT_FALSE(ran.load());
  EXPECT_EQ(errors[1], "");
  for (int index : {0, 2}) {
    EXPECT_NE(errors[index].find("participant 1 failed before the meeting: eigh: XLA could not "
                                 "allocate 4096 bytes of workspace"),
              std::string::npos)
        << errors[index];
  }
  EXPECT_EQ(open_meetings(), 0u);
}

TEST(Rendezvous, TheOthersWaitForTheWorkPastTheTimeout) {
  // The work uses every participant's value: none may return before it ends, even past the
  // timeout (their callers would free what it still writes).
  constexpr int kCount = 3;
  std::vector<int> written(kCount, 0);
  std::vector<int> seen_on_return(kCount, -1);
  const auto errors = on_threads(kCount, [&](int index) {
    meet(
        {"potri/long", 0}, index, kCount, &written[index],
        [&](const std::vector<void*>& values) {
          std::this_thread::sleep_for(300ms);
          for (void* value : values) *static_cast<int*>(value) = 1;
        },
        50ms);
    seen_on_return[index] = written[index];
  });
  for (int index = 0; index < kCount; ++index) {
    EXPECT_EQ(errors[index], "");
    EXPECT_EQ(seen_on_return[index], 1) << "participant " << index << " returned before the work";
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
    timed_out += error.find("participants 1 of 2 had not arrived") != std::string::npos;
  }
  EXPECT_EQ(refused, 1);
  EXPECT_EQ(timed_out, 1);
  EXPECT_THROW(meet(
                   {"twice", 0}, 1, 2, nullptr, [](const std::vector<void*>&) {}, 1s),
               Error);  // the real participant 1, late
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

TEST(DeviceGroups, FindsTheGroupAndPlaceOfADevice) {
  // Two groups of two: {6, 4} and {1, 3}.
  const std::vector<std::int64_t> mesh{6, 4, 1, 3};
  const DeviceGroup first = find_device_group(mesh, 2, 4, "eigh");
  EXPECT_EQ(first.devices, (std::vector<int>{6, 4}));
  EXPECT_EQ(first.index, 1);
  const DeviceGroup second = find_device_group(mesh, 2, 1, "eigh");
  EXPECT_EQ(second.devices, (std::vector<int>{1, 3}));
  EXPECT_EQ(second.index, 0);
  EXPECT_EQ(find_device_group(mesh, 4, 3, "eigh").index, 3);
}

TEST(DeviceGroups, RejectsDevicesOutsideTheMeshAndRaggedGroups) {
  const std::vector<std::int64_t> mesh{0, 1, 2, 3};
  try {
    find_device_group(mesh, 2, 7, "cholesky_solve");
    FAIL() << "cuda:7 accepted";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(error.what()).find("cholesky_solve: cuda:7 is not in the mesh"),
              std::string::npos)
        << error.what();
  }
  EXPECT_THROW(find_device_group(mesh, 3, 0, "eigh"), Error);
  EXPECT_THROW(find_device_group(mesh, 0, 0, "eigh"), Error);
}

TEST(CallNumbering, CountsPerKeyParticipantAndRun) {
  CallNumbering numbering;
  EXPECT_EQ(numbering.next("potrf/cuda:0:1", 0, 7), 0u);
  EXPECT_EQ(numbering.next("potrf/cuda:0:1", 0, 7), 1u);
  EXPECT_EQ(numbering.next("potrf/cuda:0:1", 1, 7), 0u);  // the other GPU's own count
  EXPECT_EQ(numbering.next("potrf/cuda:2:3", 0, 7), 0u);  // another mesh
  EXPECT_EQ(numbering.next("potrf/cuda:0:1", 1, 7), 1u);
  EXPECT_EQ(numbering.next("potrf/cuda:0:1", 0, 8), 0u);  // a new run starts again
  EXPECT_EQ(numbering.next("potrf/cuda:0:1", 0, 8), 1u);
  EXPECT_EQ(numbering.next("potrf/cuda:0:1", 0, 7), 2u);  // and an overlapping run goes on
}

TEST(CallNumbering, KeepsTheRunsUsedLast) {
  CallNumbering numbering;
  const std::string key = "syevd/cuda:0:1:2:3";
  for (std::int64_t run = 0; run < 1000; ++run) {
    EXPECT_EQ(numbering.next(key, 2, run), 0u);
    // A long run that calls between the short ones keeps its count.
    EXPECT_EQ(numbering.next(key, 2, -1), static_cast<std::uint64_t>(run));
  }
  EXPECT_EQ(numbering.runs_kept(key, 2), CallNumbering::kRunsKept);
  EXPECT_EQ(numbering.next(key, 2, 999), 1u);  // among the last used
  EXPECT_EQ(numbering.next(key, 2, 3), 0u);    // long dropped: counted afresh
}

}  // namespace
}  // namespace meshla::solver
