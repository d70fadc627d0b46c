// RoundKeys: the keys a node publishes in the run's key-value store for each round (its job
// identity, its snapshot holdings, its --node-rank, its exit barrier's marks) are deleted once a
// later round forms, so that the store holds about one round's worth. Kept, they would fill the
// run's quota over a long job's rounds (ddprun-rendezvous --max-run-kv-bytes, --max-run-keys;
// kv_max_bytes=, kv_max_keys= over etcd): a write past it is refused, and a node whose holdings
// cannot be published starts its rounds without knowing the others. The lowest node of each round
// deletes, in one range, every key of its kind published for a round below (common/round_key.h):
// those of nodes gone since, of rounds it did not take part in, and any written late, after the
// previous round's deletion. Threading: the agent's loop thread. Lifetime: within `service`'s.
#pragma once

#include <cstdint>
#include <string>

#include "ddprun/agent/rendezvous_service.h"
#include "ddprun/common/log.h"
#include "ddprun/common/round_key.h"

namespace ddprun::agent {

class RoundKeys {
 public:
  // `kind`: the keys' first segment ("job", "snapshot", "static_rank", "exit_barrier").
  RoundKeys(RendezvousService& service, std::string kind)
      : service_(service), kind_(std::move(kind)) {}

  // This node takes part in round `round` as its `self`-th node in rank order (0: the lowest):
  // the lowest node deletes every key of the kind below `round`. Called after this node's own
  // key of `round` was written, or its write failed (on etcd, calls are queued one at a time), or
  // with the round before (the exit barrier's marks of the round before are still read). A
  // rendezvous server that restarted without its state numbers its rounds from 1 again: the keys
  // of its rounds below are deleted as any others.
  void tookPart(uint64_t round, size_t self) {
    if (self != 0 || round == deleted_below_) return;
    deleted_below_ = round;
    // Not deleted (the rendezvous unreachable for 5 s): the next round's lowest node deletes them.
    CallPolicy brief;
    brief.retry_for = std::chrono::seconds(5);
    service_.kvDeleteRange(
        kind_ + "/", roundKeyPrefix(kind_, round), brief, [kind = kind_, round](Status st) {
          if (st.isOk()) return;
          // A rendezvous daemon of an older release: said once (it concerns every kind).
          static bool told_unimplemented = false;
          if (st.code() == StatusCode::kUnimplemented && !told_unimplemented) {
            told_unimplemented = true;
            logger("agent")->warn("{}", st.message());
            return;
          }
          logger("agent")->debug("the {} keys of rounds below {} were not deleted: {}", kind, round,
                                 st.message());
        });
  }

 private:
  RendezvousService& service_;
  const std::string kind_;
  uint64_t deleted_below_ = 0;
};

}  // namespace ddprun::agent
