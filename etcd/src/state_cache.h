// StateCache: the run as this agent's watch last delivered it. A new value's header (the next
// deadline, the round changes and join answers of the transaction that wrote it) is read at once
// (O(changes)); its snapshot is imported into a RendezvousState only when something asks for the
// state (a pending join, a master wait, a heartbeat), so an idle agent's cost per change is
// constant. It also keeps the revisions the joins wait for: the state key's mod_revision and the
// newest store revision seen.
//
// Threading: the service's loop only (a plain value it owns).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "ddprun/common/clock.h"
#include "ddprun/common/status.h"
#include "ddprun/rendezvous/state.h"
#include "state_value.h"

namespace ddprun::etcd {

class StateCache {
 public:
  explicit StateCache(std::string run_id) : run_id_(std::move(run_id)) {}

  // A new value of the state key; the parse error (and nothing changes) when its header is
  // damaged.
  Status load(std::shared_ptr<const std::string> stored);
  // The value last loaded: its round changes and join answers.
  const StateValue& value() const { return value_; }
  std::optional<TimePoint> nextDeadline() const { return value_.nextDeadline(); }
  // The run, imported from the last value on first use after each load (an import error is
  // logged; the state then stays as it was).
  rendezvous::RendezvousState& state();

  // The state key's mod_revision, and the newest store revision the watch delivered.
  int64_t stateRevision() const { return state_rev_; }
  int64_t seenRevision() const { return seen_rev_; }
  void noteStateRevision(int64_t mod) { state_rev_ = mod; }
  void noteSeen(int64_t revision) { seen_rev_ = std::max(seen_rev_, revision); }
  // A full sync at `revision`.
  void resetSeen(int64_t revision) { seen_rev_ = revision; }
  // The store went back: a sync brings the new store's revisions.
  void forgetRevisions() { state_rev_ = seen_rev_ = 0; }

 private:
  const std::string run_id_;
  StateValue value_;
  rendezvous::RendezvousState state_;
  bool stale_ = false;  // value_ is newer than state_
  int64_t state_rev_ = 0;
  int64_t seen_rev_ = 0;
};

}  // namespace ddprun::etcd
