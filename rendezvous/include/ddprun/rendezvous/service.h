// rendezvous::Service: the seam between the agent's multi-node protocol (the agent's
// multinode_rendezvous.h: rounds into RoundInfo, the master address, static node ranks,
// heartbeats, the exit barrier) and the service that holds a run's state. Two backends implement
// it: ddprun's gRPC rendezvous (the agent's grpc_rendezvous_service.h) and etcd v3
// (ddprun/etcd/rendezvous_service.h). An implementation is bound to one run id. It lives in the
// rendezvous core, beside the plain types it speaks, so that both the agent and the etcd adapter
// (a component below the agent) include it; the agent calls it RendezvousService.
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

namespace ddprun::rendezvous {

// How hard one call tries. Unset fields take the service's defaults (each attempt bounded by the
// read timeout; an unreachable service retried up to the join timeout).
struct CallPolicy {
  std::optional<Duration> attempt_timeout;  // deadline of one attempt
  std::optional<Duration> retry_for;        // how long an unreachable service is retried
};

class Service {
 public:
  template <typename T>
  using Done = std::function<void(StatusOr<T>)>;
  using StatusDone = std::function<void(Status)>;
  using ChangeSink = std::function<void(const RoundChange&)>;

  virtual ~Service() = default;

  // Blocks (asynchronously) until this node's round completes; pass the previous round's node
  // id to keep the group rank.
  virtual void join(const JoinRequest& req, Done<RoundInfo> done) = 0;
  // NOT_FOUND: the service no longer counts this node (declared dead); join again.
  virtual void heartbeat(const std::string& node_id, CallPolicy policy, Done<RunStatus> done) = 0;
  virtual void leave(const std::string& node_id, CallPolicy policy, StatusDone done) = 0;
  // Returns the round every node must join next.
  virtual void reportFailure(const std::string& node_id, uint64_t round, FailureKind kind,
                             Done<uint64_t> done) = 0;
  virtual void close(CallPolicy policy, StatusDone done) = 0;
  // The rank-0 node of `round` publishes its workers' master address; others wait for it
  // (ABORTED when a later round completed first: join again).
  virtual void publishMaster(const std::string& node_id, uint64_t round,
                             const MasterAddress& master, StatusDone done) = 0;
  virtual void waitMaster(uint64_t round, Duration timeout, Done<MasterAddress> done) = 0;
  // The run's key-value store. kvWait answers the keys' values in order once all exist, or
  // DEADLINE_EXCEEDED after `timeout`.
  virtual void kvSet(const std::string& key, const std::string& value, CallPolicy policy,
                     StatusDone done) = 0;
  virtual void kvWait(const std::vector<std::string>& keys, Duration timeout, CallPolicy policy,
                      Done<std::vector<std::string>> done) = 0;
  // Deletes every key k with from <= k < to (OK when there was none).
  virtual void kvDeleteRange(const std::string& from, const std::string& to, CallPolicy policy,
                             StatusDone done) = 0;
  // Subscribes to the run's round changes (a snapshot first, again after every reconnect) until
  // stopWatch(); a second watch() replaces the first.
  virtual void watch(const std::string& node_id, ChangeSink on_change) = 0;
  virtual void stopWatch() = 0;
  // Every call in flight completes with CANCELLED (e.g. a join when the agent leaves).
  virtual void cancelAll() = 0;
  // An UNAVAILABLE status with what the user should check about this service (address, TLS).
  virtual Status explainUnavailable(const Status& status) const = 0;
};

}  // namespace ddprun::rendezvous
