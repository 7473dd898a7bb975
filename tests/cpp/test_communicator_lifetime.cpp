// Shared ownership of a communicator: every copy and every user keeps the NCCL communicator
// alive, it is released exactly once, after its last user, whatever the order of release. A fake
// release function stands in for NCCL, so this runs without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "comm/comm_state.hpp"
#include "meshla/communicator.hpp"

namespace meshla {
namespace {

struct Recorder {
  int releases = 0;
  ncclComm_t released = nullptr;
};

ncclComm_t fake_handle() { return reinterpret_cast<ncclComm_t>(0x1234); }

Communicator make_fake(Recorder& recorder) {
  auto state = std::make_shared<detail::CommState>(
      fake_handle(), 1, 4, 0, std::chrono::milliseconds(1000), [&recorder](ncclComm_t comm) {
        ++recorder.releases;
        recorder.released = comm;
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
      EXPECT_EQ(recorder.releases, 0) << "released with holders left";
      const int holder = order[step];
      if (holder < 3) {
        owners[holder].reset();
      } else {
        users[holder - 3].reset();
      }
    }
    EXPECT_EQ(recorder.releases, 1);
    EXPECT_EQ(recorder.released, fake_handle());
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
  EXPECT_EQ(recorder.releases, 0);
}

}  // namespace
}  // namespace meshla
