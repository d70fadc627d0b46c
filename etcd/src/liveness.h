// Liveness: which nodes hold an alive key (etcd deletes it with the lease of a node's agent), which
// of them this agent already asked to declare dead, and the grace after the watch broke: leases
// that lapsed during an outage are renewed by their agents (a fresh lease, the alive keys put
// again) once etcd is back, so deaths wait that long.
//
// Threading: the service's loop only (a plain value it owns).
#pragma once

#include <chrono>
#include <set>
#include <string>
#include <vector>

namespace ddprun::etcd {

class Liveness {
 public:
  using Time = std::chrono::steady_clock::time_point;

  // A full picture follows: reset(), then present() for each alive key.
  void reset() { alive_.clear(); }
  void present(const std::string& node) { alive_.insert(node); }
  // An alive key was put (again): the node may be declared dead again when it goes.
  void up(const std::string& node) {
    alive_.insert(node);
    asked_.erase(node);
  }
  void down(const std::string& node) { alive_.erase(node); }
  // The nodes of `nodes` without an alive key.
  std::vector<std::string> missing(const std::vector<std::string>& nodes) const {
    std::vector<std::string> out;
    for (const std::string& node : nodes) {
      if (alive_.count(node) == 0) out.push_back(node);
    }
    return out;
  }
  // True the first time `node` is to be declared dead (until its alive key comes back).
  bool askDead(const std::string& node) { return asked_.insert(node).second; }

  void graceUntil(Time until) { grace_until_ = until; }
  Time graceEnd() const { return grace_until_; }
  bool inGrace(Time now) const { return now < grace_until_; }

 private:
  std::set<std::string> alive_;
  std::set<std::string> asked_;  // declared dead by this agent, not alive since
  Time grace_until_{};
};

}  // namespace ddprun::etcd
