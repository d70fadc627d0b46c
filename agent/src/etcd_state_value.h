// The value the etcd-v3 rendezvous stores under <prefix>/state, and a reader that gets from it
// what an agent needs on each pushed change without parsing the whole run.
//
// One transaction writes one value:
//   "v2;" <next deadline or "-"> ";" <n>":" <round changes> <m>":" <join answers> <snapshot>
// - the round changes of the transaction (what watchers are pushed);
// - the join answers: what the transaction answered to each join it completed or failed (the
//   JoinDone entries of its outbox, the gRPC server's replies), so a waiting joiner finds its
//   rank by its call id in a record of a few bytes per joiner instead of importing the snapshot;
// - the next deadline of the run, so an agent arms its tick timer without parsing the snapshot;
// - the run's snapshot (RendezvousState::exportRun), parsed only when an agent needs the state.
// A value without the "v2;" tag (written before join answers existed) reads with no answers.
// Every read is bounds checked: a damaged value is INVALID_ARGUMENT, never a crash.
//
// Threading: pure functions and an immutable value type; StateValue shares the stored bytes
// (copying one is cheap) and may be read from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ddprun/common/clock.h"
#include "ddprun/common/status.h"
#include "ddprun/rendezvous/state.h"
#include "ddprun/rendezvous/types.h"

namespace ddprun::agent {

std::string encodeStateValue(const std::vector<rendezvous::RendezvousState::Change>& changes,
                             const std::vector<rendezvous::RendezvousState::JoinDone>& answers,
                             const std::string& snapshot, std::optional<TimePoint> next_deadline);

class StateValue {
 public:
  // An empty `stored` (no key) reads as no changes, no answers, an empty snapshot. Only the
  // header (deadline, changes) is parsed here; answers and the snapshot when asked for.
  static StatusOr<StateValue> parse(std::shared_ptr<const std::string> stored);

  StateValue();

  const std::vector<rendezvous::RoundChange>& changes() const { return changes_; }
  std::optional<TimePoint> nextDeadline() const { return next_deadline_; }
  std::string_view snapshot() const;
  // What the writing transaction answered to join call `call`; nullopt when it did not answer it
  // (or the record is damaged: the caller then learns the outcome from the snapshot).
  std::optional<StatusOr<rendezvous::RoundInfo>> joinAnswer(uint64_t call) const;

 private:
  std::shared_ptr<const std::string> stored_;
  std::vector<rendezvous::RoundChange> changes_;
  std::optional<TimePoint> next_deadline_;
  size_t answers_begin_ = 0, answers_end_ = 0, snapshot_begin_ = 0;
};

}  // namespace ddprun::agent
