// The meeting that the threads of one process hold after enqueuing their parts of a collective:
// nobody leaves before everyone has arrived, repeated meetings pair the ranks' n-th calls, a rank
// that never comes ends in a timeout naming the run, and a broken meeting refuses later arrivals.
#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "comm/enqueue_meeting.hpp"
#include "meshla/error.hpp"

namespace meshla::detail {
namespace {

using namespace std::chrono_literals;

TEST(EnqueueMeeting, NobodyLeavesBeforeTheLastArrives) {
  constexpr int kRanks = 3;
  constexpr int kMeetings = 200;
  EnqueueMeeting meeting(kRanks);
  // arrivals[m]: how many ranks had arrived at meeting m; each rank, on leaving it, must see all.
  std::vector<std::atomic<int>> arrivals(kMeetings);
  std::atomic<int> early_leaves{0};
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kRanks; ++rank) {
    threads.emplace_back([&, rank] {
      for (int m = 0; m < kMeetings; ++m) {
        if (rank == m % kRanks) std::this_thread::sleep_for(50us);  // a late rank, in turn
        arrivals[m].fetch_add(1);
        meeting.arrive(rank, "test", 10s);
        if (arrivals[m].load() != kRanks) early_leaves.fetch_add(1);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(early_leaves.load(), 0);
}

TEST(EnqueueMeeting, OneRankMeetsAlone) {
  EnqueueMeeting meeting(1);
  meeting.arrive(0, "test", 1ms);
  meeting.arrive(0, "test", 1ms);
}

TEST(EnqueueMeeting, AMissingRankEndsInATimeoutThenEveryArrivalIsRefused) {
  EnqueueMeeting meeting(2);
  try {
    meeting.arrive(0, "all_gather_matmul (backend=nccl)", 50ms);
    FAIL() << "the meeting returned without rank 1";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kTimeout);
    const std::string message = error.what();
    EXPECT_NE(message.find("all_gather_matmul (backend=nccl) on rank 0"), std::string::npos)
        << message;
    EXPECT_NE(message.find("within 50 ms"), std::string::npos) << message;
  }
  try {
    meeting.arrive(1, "matmul_all_reduce (backend=nccl)", 10s);
    FAIL() << "a broken meeting took an arrival";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kTimeout);
    EXPECT_NE(std::string(error.what()).find("no longer pair"), std::string::npos);
  }
}

TEST(EnqueueMeeting, RefusesNoRanks) { EXPECT_THROW(EnqueueMeeting(0), Error); }

}  // namespace
}  // namespace meshla::detail
