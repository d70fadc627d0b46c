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
  // The agent's loop has ended: on success wait (bounded) for the other nodes to finish (the
  // exit barrier), then close the run unless this node merely left. Blocking; called once,
  // from the agent's thread after its event loop stopped.
  virtual void finish(bool succeeded, bool left) = 0;
};

}  // namespace ddprun::agent
