// FakeControlChannel: records what the supervisor sends each worker on the control channel, and
// holds what a worker sent that the agent has not read yet (`unread`), which drain() hands to
// `reader` (the supervisor under test).
#pragma once

#include <functional>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "ddprun/agent/supervisor.h"

namespace ddprun::testing {

class FakeControlChannel : public agent::ControlChannel {
 public:
  bool send(int pid, const ControlMessage& message) override {
    if (closed.count(pid)) return false;
    sent.push_back({pid, message});
    return true;
  }
  // The messages of `type` sent to `pid`, oldest first.
  std::vector<ControlMessage> to(int pid, ControlType type) const {
    std::vector<ControlMessage> out;
    for (const auto& [p, m] : sent) {
      if (p == pid && m.type == type) out.push_back(m);
    }
    return out;
  }

  void drain(int pid) override {
    auto it = unread.find(pid);
    if (it == unread.end()) return;
    auto lines = std::move(it->second);
    unread.erase(it);
    for (const auto& m : lines) reader(pid, m);
  }

  std::vector<std::pair<int, ControlMessage>> sent;
  std::set<int> closed;
  std::map<int, std::vector<ControlMessage>> unread;
  std::function<void(int, const ControlMessage&)> reader;
};

}  // namespace ddprun::testing
