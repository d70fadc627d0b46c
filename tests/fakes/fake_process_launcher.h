// FakeProcessLauncher: records spawns and signals instead of touching processes. Tests decide
// when "processes" exit by calling the supervisor's onWorkerExit with the pids handed out here.
#pragma once

#include <map>
#include <set>
#include <utility>
#include <vector>

#include "ddprun/agent/process.h"

namespace ddprun::testing {

class FakeProcessLauncher final : public agent::ProcessLauncher {
 public:
  StatusOr<int> spawn(const agent::WorkerLaunch& launch) override {
    if (fail_local_ranks.count(launch.local_rank)) {
      return failedPrecondition("cannot execute " + launch.argv.at(0));
    }
    int pid = next_pid_++;
    spawned.push_back({pid, launch});
    alive.insert(pid);
    return pid;
  }
  void signalGroup(int pid, int sig) override { signals.push_back({pid, sig}); }
  void forceEnd(int pid) override { forced.push_back(pid); }

  // pids spawned so far, in order
  std::vector<int> pids() const {
    std::vector<int> out;
    for (const auto& s : spawned) out.push_back(s.first);
    return out;
  }
  int signalsSent(int sig) const {
    int n = 0;
    for (const auto& s : signals) n += s.second == sig ? 1 : 0;
    return n;
  }

  std::vector<std::pair<int, agent::WorkerLaunch>> spawned;
  std::vector<std::pair<int, int>> signals;  // (pid, sig)
  std::vector<int> forced;                   // forceEnd(pid)
  std::set<int> alive;
  std::set<int> fail_local_ranks;  // spawn fails for these local ranks

 private:
  int next_pid_ = 1000;
};

}  // namespace ddprun::testing
