#include "solver/rendezvous.hpp"

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>

#include "core/checks.hpp"

namespace meshla::solver {
namespace {

struct Meeting {
  explicit Meeting(int count) : values(count, nullptr), arrived(count, false) {}

  std::mutex mutex;
  std::condition_variable changed;
  std::vector<void*> values;
  std::vector<bool> arrived;
  int arrivals = 0;
  int present = 0;        // arrived and not yet left
  bool finished = false;  // the work ran, or the meeting was given up or abandoned
  bool given_up = false;  // a participant timed out waiting for the others
  std::string missing;    // who had not arrived when it was given up
  // What the work threw, kept as code and text so that every participant throws its own copy
  // (one exception object shared by several threads would be released by whichever ends last).
  std::optional<std::pair<ErrorCode, std::string>> error;
};

// The open meetings of this process, by (key, generation). An entry lives from the first arrival
// to the departure of the last participant; a meeting given up or abandoned stays until every
// participant has come, so that a late one learns what happened at once.
class Registry {
 public:
  std::shared_ptr<Meeting> join(const MeetingId& id, int count) {
    std::lock_guard lock(mutex_);
    auto& meeting = meetings_[{id.key, id.generation}];
    if (!meeting) meeting = std::make_shared<Meeting>(count);
    return meeting;
  }

  // Called with the meeting's mutex not held, after the participant left it.
  void leave(const MeetingId& id, const std::shared_ptr<Meeting>& meeting) {
    std::lock_guard lock(mutex_);
    std::lock_guard meeting_lock(meeting->mutex);
    auto found = meetings_.find({id.key, id.generation});
    const bool awaited =
        meeting->finished && static_cast<std::size_t>(meeting->arrivals) < meeting->values.size();
    if (found != meetings_.end() && found->second == meeting && meeting->present == 0 && !awaited) {
      meetings_.erase(found);
    }
  }

  std::size_t size() {
    std::lock_guard lock(mutex_);
    return meetings_.size();
  }

 private:
  std::mutex mutex_;
  std::map<std::pair<std::string, std::uint64_t>, std::shared_ptr<Meeting>> meetings_;
};

Registry& registry() {
  static Registry instance;
  return instance;
}

std::string describe(const MeetingId& id) {
  std::ostringstream out;
  out << "rendezvous '" << id.key << "' call " << id.generation;
  return out.str();
}

std::string missing_participants(const Meeting& meeting) {
  std::ostringstream out;
  const char* separator = "";
  for (std::size_t i = 0; i < meeting.arrived.size(); ++i) {
    if (!meeting.arrived[i]) {
      out << separator << i;
      separator = ", ";
    }
  }
  return out.str();
}

}  // namespace

void meet(const MeetingId& id, int index, int count, void* value,
          const std::function<void(const std::vector<void*>& values)>& leader_work,
          std::chrono::milliseconds timeout) {
  MESHLA_CHECK_ARG(count >= 1, describe(id) << ": count=" << count << " must be at least 1");
  MESHLA_CHECK_ARG(index >= 0 && index < count,
                   describe(id) << ": participant " << index << " is outside [0, " << count << ")");
  std::shared_ptr<Meeting> meeting = registry().join(id, count);
  std::unique_lock lock(meeting->mutex);
  // Leaves the meeting on every path once arrived, so that the registry drops the meeting with
  // its last participant.
  struct Departure {
    const MeetingId& id;
    const std::shared_ptr<Meeting>& meeting;
    std::unique_lock<std::mutex>& lock;
    ~Departure() {
      if (!lock.owns_lock()) lock.lock();
      --meeting->present;
      lock.unlock();
      registry().leave(id, meeting);
    }
  };
  ++meeting->present;
  Departure departure{id, meeting, lock};
  MESHLA_CHECK_ARG(static_cast<int>(meeting->values.size()) == count,
                   describe(id) << ": participant " << index << " expects " << count
                                << " participants, an earlier one " << meeting->values.size());
  MESHLA_CHECK_ARG(!meeting->arrived[index], describe(id)
                                                 << ": participant " << index << " arrived twice");
  meeting->arrived[index] = true;
  meeting->values[index] = value;
  ++meeting->arrivals;
  meeting->changed.notify_all();

  const auto arrival_deadline = std::chrono::steady_clock::now() + timeout;
  const bool everyone = meeting->changed.wait_until(
      lock, arrival_deadline, [&] { return meeting->arrivals == count || meeting->finished; });
  if (!everyone) {
    // Give the meeting up, so that the participants already waiting stop too.
    meeting->finished = true;
    meeting->given_up = true;
    meeting->missing = missing_participants(*meeting);
    meeting->changed.notify_all();
  } else if (index == 0 && !meeting->finished) {
    const std::vector<void*> values = meeting->values;
    lock.unlock();
    std::optional<std::pair<ErrorCode, std::string>> error;
    try {
      leader_work(values);
    } catch (const Error& thrown) {
      error.emplace(thrown.code(), thrown.what());
    } catch (const std::exception& thrown) {
      error.emplace(ErrorCode::kInternal, thrown.what());
    } catch (...) {
      error.emplace(ErrorCode::kInternal,
                    describe(id) + ": the work threw a non-standard exception");
    }
    lock.lock();
    meeting->error = std::move(error);
    meeting->finished = true;
    meeting->changed.notify_all();
  } else if (!meeting->changed.wait_for(lock, timeout, [&] { return meeting->finished; })) {
    std::fprintf(stderr,
                 "meshla: %s: participant %d has waited %lld ms for participant 0's work, which "
                 "uses its buffers; waiting for it to end\n",
                 describe(id).c_str(), index, static_cast<long long>(timeout.count()));
    meeting->changed.wait(lock, [&] { return meeting->finished; });
  }
  MESHLA_CHECK(kTimeout, !meeting->given_up,
               describe(id) << ": given up after " << timeout.count() << " ms; participants "
                            << meeting->missing << " of " << count << " had not arrived");
  if (meeting->error) throw Error(meeting->error->first, meeting->error->second);
}

void abandon(const MeetingId& id, int index, int count, const Error& error) {
  std::shared_ptr<Meeting> meeting = registry().join(id, count);
  {
    std::lock_guard lock(meeting->mutex);
    const bool fits = static_cast<int>(meeting->values.size()) == count && index >= 0 &&
                      index < count && !meeting->arrived[index];
    if (fits) {
      meeting->arrived[index] = true;
      ++meeting->arrivals;
    }
    if (!meeting->finished) {
      meeting->finished = true;
      std::ostringstream message;
      message << describe(id) << ": participant " << index
              << " failed before the meeting: " << error.what();
      meeting->error.emplace(error.code(), message.str());
      meeting->changed.notify_all();
    }
  }
  registry().leave(id, meeting);
}

std::size_t open_meetings() { return registry().size(); }

DeviceGroup find_device_group(const std::vector<std::int64_t>& mesh, std::int64_t group_size,
                              int device, std::string_view what) {
  MESHLA_CHECK_ARG(group_size >= 1 && mesh.size() % group_size == 0,
                   what << ": " << mesh.size() << " devices do not form groups of " << group_size);
  for (std::size_t i = 0; i < mesh.size(); ++i) {
    if (mesh[i] != device) continue;
    DeviceGroup group;
    const std::size_t first = i / group_size * group_size;
    for (std::int64_t j = 0; j < group_size; ++j) {
      group.devices.push_back(static_cast<int>(mesh[first + j]));
    }
    group.index = static_cast<int>(i - first);
    return group;
  }
  MESHLA_THROW(kInvalidArgument,
               what << ": cuda:" << device << " is not in the mesh the call was built for");
}

std::uint64_t CallNumbering::next(const std::string& key, int participant, std::int64_t run_id) {
  std::lock_guard lock(mutex_);
  std::map<std::int64_t, Count>& runs = counts_[{key, participant}];
  Count& count = runs[run_id];
  count.last_use = ++uses_;
  const std::uint64_t number = count.calls++;
  if (runs.size() > kRunsKept) {
    runs.erase(std::min_element(runs.begin(), runs.end(), [](const auto& a, const auto& b) {
      return a.second.last_use < b.second.last_use;
    }));
  }
  return number;
}

std::size_t CallNumbering::runs_kept(const std::string& key, int participant) {
  std::lock_guard lock(mutex_);
  const auto found = counts_.find({key, participant});
  return found == counts_.end() ? 0 : found->second.size();
}

}  // namespace meshla::solver
