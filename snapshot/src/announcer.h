// Announcer: carries out the core's Announce and AnnounceAgain actions: the blocking announce
// calls of the transport (transfer.h), one line of peers after another, on the transfer pool at
// the agent's priority (a replication waits on them), and the outcome back on the loop.
// Threading: the loop thread calls it; the calls run on the pool. Lifetime: within the pool's.
#pragma once

#include <functional>
#include <string>

#include "ddprun/snapshot/core.h"
#include "ddprun/snapshot/transfer.h"
#include "transfer_pool.h"

namespace ddprun::snapshot {

class Announcer {
 public:
  Announcer(TransferPool& pool, std::string run_id, TransferSecurity security)
      : pool_(pool), run_id_(std::move(run_id)), security_(std::move(security)) {}

  // Tells each line of `a`: its first peer, then while one does not take it the next; `done`
  // (on the loop) gets the peers that did not.
  void announce(const Announce& a, std::function<void(const Announced&)> done);
  // Tells `again.peer` its items in order until one is not taken; `done` gets how many were.
  void announceAgain(const AnnounceAgain& again, std::function<void(size_t)> done);

 private:
  SnapshotPeer peer(const std::string& endpoint) const {
    return SnapshotPeer{endpoint, run_id_, security_};
  }

  TransferPool& pool_;
  const std::string run_id_;
  const TransferSecurity security_;
};

}  // namespace ddprun::snapshot
