// RendezvousClient: how the agent's supervisor talks to the rendezvous for its run. The
// single-node implementation (local_rendezvous.h) completes every round at once; the multi-node
// one speaks gRPC. Callbacks are always invoked on the agent's event-loop thread.
#pragma once

#include <functional>

#include "ddprun/agent/worker_env.h"
#include "ddprun/common/status.h"

namespace ddprun::agent {

class RendezvousClient {
 public:
  using RoundCallback = std::function<void(StatusOr<RoundInfo>)>;
  virtual ~RendezvousClient() = default;

  // Joins the next round; `done` runs once with the round or the reason there is none.
  virtual void nextRound(RoundCallback done) = 0;
  // This node's workers failed: every node must restart into a new round.
  virtual void reportFailure() = 0;
  // Graceful departure (SIGTERM): the others re-form without this node at once.
  virtual void leave() = 0;
  // The job is over (success or restart budget spent): later joins are refused.
  virtual void close() = 0;
};

}  // namespace ddprun::agent
