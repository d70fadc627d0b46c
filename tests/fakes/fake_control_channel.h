// FakeControlChannel: records what the supervisor sends each worker on the control channel.
#pragma once

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

  std::vector<std::pair<int, ControlMessage>> sent;
  std::set<int> closed;
};

}  // namespace ddprun::testing
