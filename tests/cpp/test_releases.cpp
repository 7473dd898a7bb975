// Releases on threads of their own: each runs off the calling thread, is counted while under way,
// and destroys what it holds there; releases that wait for each other (aborts whose peers abort
// in another order) all finish. No GPU is needed: the device a release selects does not exist
// here, and the release runs all the same.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <future>
#include <memory>
#include <thread>

#include "runtime/releases.hpp"

namespace meshla {
namespace {

constexpr std::chrono::seconds kPatience{10};

// Polls until no release is under way, for kPatience at most; whether none is.
bool all_released() {
  const auto deadline = std::chrono::steady_clock::now() + kPatience;
  while (detail::releases_under_way() != 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return detail::releases_under_way() == 0;
}

TEST(Releases, RunOffTheCallerAndAreCountedUntilWhatTheyHoldIsGone) {
  ASSERT_TRUE(all_released());
  std::promise<void> finish;
  std::shared_future<void> may_finish = finish.get_future().share();
  std::promise<std::thread::id> started;
  std::future<std::thread::id> ran_on = started.get_future();
  auto held = std::make_shared<int>(0);
  std::weak_ptr<int> watch = held;
  detail::release_on_own_thread(0, [may_finish, held = std::move(held), &started] {
    started.set_value(std::this_thread::get_id());
    may_finish.wait();
  });
  ASSERT_EQ(ran_on.wait_for(kPatience), std::future_status::ready) << "the release never ran";
  EXPECT_NE(ran_on.get(), std::this_thread::get_id());
  EXPECT_EQ(detail::releases_under_way(), 1);
  EXPECT_FALSE(watch.expired()) << "what the release holds went before it ran";
  finish.set_value();
  EXPECT_TRUE(all_released());
  EXPECT_TRUE(watch.expired()) << "what the release holds outlived it";
}

// Two ranks' aborts in opposite orders, seen from one process: each release waits until the other
// has begun. Releases taking turns on one thread would wait forever here.
TEST(Releases, ThatWaitForEachOtherAllFinish) {
  ASSERT_TRUE(all_released());
  std::promise<void> first_began;
  std::promise<void> second_began;
  std::shared_future<void> first = first_began.get_future().share();
  std::shared_future<void> second = second_began.get_future().share();
  std::promise<bool> first_saw;
  std::promise<bool> second_saw;
  std::future<bool> first_result = first_saw.get_future();
  std::future<bool> second_result = second_saw.get_future();
  detail::release_on_own_thread(0, [&first_began, second, &first_saw] {
    first_began.set_value();
    first_saw.set_value(second.wait_for(kPatience) == std::future_status::ready);
  });
  detail::release_on_own_thread(0, [&second_began, first, &second_saw] {
    second_began.set_value();
    second_saw.set_value(first.wait_for(kPatience) == std::future_status::ready);
  });
  ASSERT_EQ(first_result.wait_for(2 * kPatience), std::future_status::ready);
  ASSERT_EQ(second_result.wait_for(2 * kPatience), std::future_status::ready);
  EXPECT_TRUE(first_result.get()) << "the first release waited in vain for the second";
  EXPECT_TRUE(second_result.get()) << "the second release waited in vain for the first";
  EXPECT_TRUE(all_released());
}

// At the process's end: begin_process_exit waits for the releases under way, and a release asked
// for after it is left unrun, with what it holds. In a child process, since the process's end
// cannot be undone.
TEST(ReleasesDeathTest, AfterTheProcessBeginsToEndAreLeftUnrun) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        std::promise<void> finish;
        std::shared_future<void> may_finish = finish.get_future().share();
        std::atomic<bool> first_ran = false;
        detail::release_on_own_thread(0, [may_finish, &first_ran] {
          may_finish.wait();
          first_ran = true;
        });
        std::thread finisher([&finish] {
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
          finish.set_value();
        });
        detail::begin_process_exit();  // waits for the first release
        const bool waited = first_ran;
        finisher.join();
        std::atomic<bool> second_ran = false;
        detail::release_on_own_thread(0, [&second_ran] { second_ran = true; });
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        std::exit(waited && !second_ran && detail::releases_under_way() == 0 ? 0 : 1);
      },
      testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace meshla
