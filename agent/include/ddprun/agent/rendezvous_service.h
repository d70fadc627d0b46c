// RendezvousService: the seam between the agent's multi-node protocol (multinode_rendezvous.h:
// rounds into RoundInfo, the master address, static node ranks, heartbeats, the exit barrier) and
// the service that holds a run's state. ddprun's gRPC rendezvous implements it today
// (grpc_rendezvous_service.h); an etcd v3 backend implements the same operations next. An
// implementation is bound to one run id.
//
// Threading: called from the agent's event-loop thread only. Every callback is posted to that
// loop, never run inline and never on another thread. Lifetime: created before and destroyed
// after the MultiNodeRendezvous that uses it; destroying it abandons calls in flight (their
// callbacks do not run).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "ddprun/common/clock.h"
#include "ddprun/common/status.h"
#include "ddprun/rendezvous/types.h"

namespace ddprun::agent {

// How hard one call tries. Unset fields take the service's defaults (each attempt bounded by the
// read timeout; an unreachable service retried up to the join timeout).
struct CallPolicy {
  std::optional<Duration> attempt_timeout;  // deadline of one attempt
  std::optional<Duration> retry_for;        // how long an unreachable service is retried
};

class RendezvousService {
 public:
  template <typename T>
  using Done = std::function<void(StatusOr<T>)>;
  using StatusDone = std::function<void(Status)>;
  using ChangeSink = std::function<void(const rendezvous::RoundChange&)>;

  virtual ~RendezvousService() = default;

  // Blocks (asynchronously) until this node's round completes; pass the previous round's node
  // id to keep the group rank.
  virtual void join(const rendezvous::JoinRequest& req, Done<rendezvous::RoundInfo> done) = 0;
  // NOT_FOUND: the service no longer counts this node (declared dead); join again.
  virtual void heartbeat(const std::string& node_id, CallPolicy policy,
                         Done<rendezvous::RunStatus> done) = 0;
  virtual void leave(const std::string& node_id, CallPolicy policy, StatusDone done) = 0;
  // Returns the round every node must join next.
  virtual void reportFailure(const std::string& node_id, uint64_t round, Done<uint64_t> done) = 0;
  virtual void close(CallPolicy policy, StatusDone done) = 0;
  // The rank-0 node of `round` publishes its workers' master address; others wait for it
  // (ABORTED when a later round completed first: join again).
  virtual void publishMaster(const std::string& node_id, uint64_t round,
                             const rendezvous::MasterAddress& master, StatusDone done) = 0;
  virtual void waitMaster(uint64_t round, Duration timeout,
                          Done<rendezvous::MasterAddress> done) = 0;
  // The run's key-value store. kvWait answers the keys' values in order once all exist, or
  // DEADLINE_EXCEEDED after `timeout`.
  virtual void kvSet(const std::string& key, const std::string& value, CallPolicy policy,
                     StatusDone done) = 0;
  virtual void kvWait(const std::vector<std::string>& keys, Duration timeout, CallPolicy policy,
                      Done<std::vector<std::string>> done) = 0;
  // Subscribes to the run's round changes (a snapshot first, again after every reconnect) until
  // stopWatch(); a second watch() replaces the first.
  virtual void watch(const std::string& node_id, ChangeSink on_change) = 0;
  virtual void stopWatch() = 0;
  // Every call in flight completes with CANCELLED (e.g. a join when the agent leaves).
  virtual void cancelAll() = 0;
  // An UNAVAILABLE status with what the user should check about this service (address, TLS).
  virtual Status explainUnavailable(const Status& status) const = 0;
};

}  // namespace ddprun::agent
