// RendezvousClient: how the agent's supervisor talks to the rendezvous for its run. The
// single-node implementation (local_rendezvous.h) completes every round at once; the multi-node
// one (multinode_rendezvous.h) speaks to a RendezvousBackend (rendezvous_backend.h).
//
// Threading: called from the agent's event-loop thread only; every callback is invoked on that
// thread, never inline from the call that passed it (so the caller's state is consistent).
// Lifetime: outlives the supervisor that uses it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "ddprun/agent/worker_env.h"
#include "ddprun/common/clock.h"
#include "ddprun/common/status.h"
#include "ddprun/rendezvous/types.h"

namespace ddprun::agent {

using rendezvous::FailureKind;

class RendezvousClient {
 public:
  using RoundCallback = std::function<void(StatusOr<RoundInfo>)>;
  using StatusCallback = std::function<void(Status)>;
  virtual ~RendezvousClient() = default;

  // Joins the next round; `done` runs once with the round or the reason there is none.
  virtual void nextRound(RoundCallback done) = 0;
  // This node's workers failed (kWorkers: every node charges a restart), or its in-place recovery
  // did (kRecovery: charged already when it began): every node must restart into a new round.
  virtual void reportFailure(FailureKind kind) = 0;
  // Graceful departure (SIGTERM): the others re-form without this node at once. Calls in flight
  // (a join) are abandoned; their callbacks may still run and must be ignored by the caller.
  virtual void leave() = 0;
  // Exit barrier (SPEC §4): this node's workers all succeeded. `done` runs once every other node
  // still in the job has finished too; with isRoundAbandoned() when one of them stopped its
  // workers and went on to a newer round instead (the job ends only when one round's workers all
  // finish: this node joins that round); or with the reason the wait ended early. Never later
  // than about `timeout` from now.
  virtual void exitBarrier(Duration timeout, StatusCallback done) = 0;
  // The agent is done with the run. After a success: say so, and the node that closes the run
  // waits (bounded) for the others to say so too before closing it. After a failure past the
  // restart budget: close the run. After leave(): nothing more. `done` runs once that is said or
  // given up (bounded: the rendezvous may be gone).
  virtual void shutdown(bool succeeded, bool left, std::function<void()> done) = 0;
  // The round this node's workers run in (for metrics); 0 before the first.
  virtual uint64_t currentRound() const = 0;
  // The newest round this node heard is forming (0: none heard of). A round handed to nextRound's
  // callback below it was superseded while it was on its way (a node left, joined or failed
  // meanwhile): the supervisor joins the newer one instead of starting workers in it.
  virtual uint64_t formingRound() const { return 0; }
};

// The exit barrier's answer when another node left the round for a newer one before its workers
// finished (ABORTED; the barrier's other ends never carry that code).
inline Status roundAbandoned(std::string message) {
  return Status(StatusCode::kAborted, std::move(message));
}
inline bool isRoundAbandoned(const Status& st) { return st.code() == StatusCode::kAborted; }

// True when `round`, from `client`'s nextRound, was superseded on its way (formingRound).
inline bool isSuperseded(const RendezvousClient& client, const RoundInfo& round) {
  return round.round >= 0 && client.formingRound() > static_cast<uint64_t>(round.round);
}

}  // namespace ddprun::agent
