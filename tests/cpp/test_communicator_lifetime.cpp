// Shared ownership of a communicator: every copy and every user keeps the NCCL communicator
// alive, it is released exactly once, after its last user, whatever the order of release. A fake
// release function stands in for NCCL, so this runs without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <numeric>
#include <random>
#include <thread>

#include "comm/comm_state.hpp"
#include "meshla/communicator.hpp"
#include "runtime/releases.hpp"

namespace meshla {
namespace {

struct Recorder {
  std::vector<ncclComm_t> released;
};

ncclComm_t fake_handle() { return reinterpret_cast<ncclComm_t>(0x1234); }
ncclComm_t fake_bootstrap() { return reinterpret_cast<ncclComm_t>(0x5678); }

Communicator make_fake(Recorder& recorder) {
  auto state = std::make_shared<detail::CommState>(
      fake_handle(), fake_bootstrap(), 1, 4, 0, std::chrono::milliseconds(1000),
      [&recorder](std::vector<ncclComm_t> comms) {
        recorder.released.insert(recorder.released.end(), comms.begin(), comms.end());
      });
  return Communicator(std::move(state));
}

// Stands in for a plan or solver: holds the communicator it was built with.
struct User {
  Communicator comm;
};

TEST(CommunicatorLifetime, ReleasedOnceAfterTheLastOwnerInAnyOrder) {
  std::mt19937 random(7);
  for (int trial = 0; trial < 50; ++trial) {
    Recorder recorder;
    std::vector<std::optional<Communicator>> owners;
    std::vector<std::optional<User>> users;
    {
      Communicator original = make_fake(recorder);
      for (int i = 0; i < 3; ++i) owners.emplace_back(original);
      for (int i = 0; i < 3; ++i) users.emplace_back(User{original});
    }
    // Six holders, dropped in a random order; the handle dies with the last one only.
    std::vector<int> order(6);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), random);
    for (std::size_t step = 0; step < order.size(); ++step) {
      EXPECT_TRUE(recorder.released.empty()) << "released with holders left";
      const int holder = order[step];
      if (holder < 3) {
        owners[holder].reset();
      } else {
        users[holder - 3].reset();
      }
    }
    // Each communicator exactly once: the working one, then its bootstrap.
    EXPECT_EQ(recorder.released, (std::vector<ncclComm_t>{fake_handle(), fake_bootstrap()}));
  }
}

TEST(CommunicatorLifetime, CopiesShareOneState) {
  Recorder recorder;
  Communicator first = make_fake(recorder);
  Communicator second = first;
  EXPECT_EQ(first.state().get(), second.state().get());
  EXPECT_EQ(second.rank(), 1);
  EXPECT_EQ(second.size(), 4);
  Communicator moved = std::move(first);
  EXPECT_EQ(moved.state().get(), second.state().get());
  EXPECT_TRUE(recorder.released.empty());
}

}  // namespace
}  // namespace meshla

namespace meshla {
namespace {

// A layer's resource of a group (CommState::resource): counts its instances alive.
struct CountedResource {
  static inline std::atomic<int> alive{0};
  explicit CountedResource(const detail::CommState&) { ++alive; }
  ~CountedResource() { --alive; }
};

TEST(CommunicatorLifetime, AResourceIsMadeOncePerGroupAndGoesWithTheCommunicator) {
  Recorder recorder;
  {
    Communicator comm = make_fake(recorder);
    const auto first = comm.state()->resource<CountedResource>();
    EXPECT_EQ(first, comm.state()->resource<CountedResource>());
    EXPECT_EQ(CountedResource::alive.load(), 1);
  }
  // Released on a thread of its own once the last owner has let go.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (CountedResource::alive.load() != 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(CountedResource::alive.load(), 0);
  EXPECT_EQ(recorder.released.size(), 2u);
}

}  // namespace
}  // namespace meshla
