// RoundKeys: the keys a node publishes in the run's key-value store for each round (its job
// identity, its snapshot holdings), deleted once it takes part in a later round, so that the store
// holds about one round's worth. Kept, they would fill the run's quota over a long job's rounds
// (ddprun-rendezvous --max-run-kv-bytes, --max-run-keys; kv_max_bytes=, kv_max_keys= over etcd):
// a write past it is refused, and a node whose holdings cannot be published starts its rounds
// without knowing the others. Each node deletes its own key of the round it took part in before;
// the round's lowest node deletes every key of the round it took part in before (those of nodes
// gone since included). A node gone whose next round's lowest node is new leaves its key behind.
// Threading: the agent's loop thread. Lifetime: within `service`'s.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ddprun/agent/rendezvous_service.h"

namespace ddprun::agent {

class RoundKeys {
 public:
  explicit RoundKeys(RendezvousService& service) : service_(service) {}

  // This node takes part in round `round`, whose nodes publish `keys`, in rank order (this node
  // `keys[self]`; `self` 0: it is the round's lowest node). Deletes what the previous round it took
  // part in left (called once its own key of `round` is written: on etcd, writes are queued one at
  // a time). A round numbered below the previous one (a rendezvous server that restarted without
  // its state) deletes nothing: the previous round's keys went with that state.
  void tookPart(uint64_t round, std::vector<std::string> keys, size_t self) {
    if (!keys_.empty() && round > round_) {
      if (self == 0) {
        for (const auto& key : keys_) erase(key);
      } else if (self_ < keys_.size()) {
        erase(keys_[self_]);
      }
    }
    round_ = round;
    keys_ = std::move(keys);
    self_ = self;
  }

 private:
  void erase(const std::string& key) {
    // Not deleted (the rendezvous unreachable for 5 s): the key stays until the run closes.
    CallPolicy brief;
    brief.retry_for = std::chrono::seconds(5);
    service_.kvDelete(key, brief, [](Status) {});
  }

  RendezvousService& service_;
  uint64_t round_ = 0;
  std::vector<std::string> keys_;
  size_t self_ = 0;
};

}  // namespace ddprun::agent
