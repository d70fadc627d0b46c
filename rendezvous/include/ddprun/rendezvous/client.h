// Client: the agent's side of the rendezvous service, over gRPC.
//
// Every call has a deadline and is retried with exponential backoff while the server is
// UNAVAILABLE (restarting, not up yet) for up to `retry_timeout`; any other error is returned
// at once. A Watch re-subscribes by itself when its stream breaks; the first message of every
// (re)subscription is a kSnapshot, so a watcher never misses a change across a reconnect.
//
// Threading: all methods are thread-safe and blocking (call them off the agent's event loop).
// Watch callbacks run on a gRPC callback thread, one at a time per watch: keep them short and
// non-blocking (post to your event loop), and never destroy a Watch from its own callback.
// cancelAll() unblocks every call in flight.
// Lifetime: destroy every Watch before its Client.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ddprun/common/clock.h"
#include "ddprun/common/status.h"
#include "ddprun/rendezvous/types.h"

namespace ddprun::rendezvous {

struct ClientOptions {
  std::string endpoint;           // HOST:PORT of the rendezvous server
  std::string token;              // sent as "authorization: Bearer <token>" when non-empty
  std::string tls_root_cert_pem;  // non-empty: TLS, trusting this certificate
  std::string tls_server_name;    // overrides the name checked against the certificate
  Duration rpc_timeout = std::chrono::seconds(30);    // deadline of each short call
  Duration retry_timeout = std::chrono::seconds(60);  // how long UNAVAILABLE is retried
  Duration initial_backoff = std::chrono::milliseconds(50);
  Duration max_backoff = std::chrono::seconds(1);
};

// A running subscription; destroying it ends the stream and waits until no callback runs.
class Watch {
 public:
  virtual ~Watch() = default;
};

// Heartbeats a node on a thread of its own until destroyed (see Client::keepAlive).
class KeepAlive {
 public:
  virtual ~KeepAlive() = default;
};

class Client {
 public:
  using ChangeCallback = std::function<void(const RoundChange&)>;
  // Called when a stream breaks (before re-subscribing); informational.
  using BreakCallback = std::function<void(const Status&)>;

  explicit Client(ClientOptions options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Blocks until this node's round completes (or join_timeout, a closed run, bad input).
  // Pass the node id of the previous round (RoundInfo::node_id) to keep the group rank.
  StatusOr<RoundInfo> join(const JoinRequest& req, bool include_participants = true);
  // join() on a thread of the client's own; `done` runs on that thread (post it to your event
  // loop; do not destroy the client from it). Destroying the client cancels and waits for async
  // joins still running.
  void joinAsync(const JoinRequest& req, std::function<void(StatusOr<RoundInfo>)> done,
                 bool include_participants = true);
  StatusOr<RunStatus> heartbeat(const std::string& run_id, const std::string& node_id);
  Status leave(const std::string& run_id, const std::string& node_id);
  // Returns the round every node must join next.
  StatusOr<uint64_t> reportFailure(const std::string& run_id, const std::string& node_id,
                                   uint64_t round);
  Status close(const std::string& run_id);
  // The rank-0 node of `round` publishes the master address of its workers.
  Status publishMaster(const std::string& run_id, const std::string& node_id, uint64_t round,
                       const MasterAddress& master);
  // Waits up to `timeout` for the master of `round` to be published; ABORTED when a later round
  // completed before that happened (join again instead).
  StatusOr<MasterAddress> waitMaster(const std::string& run_id, uint64_t round, Duration timeout);

  Status kvSet(const std::string& run_id, const std::string& key, const std::string& value);
  StatusOr<std::string> kvGet(const std::string& run_id, const std::string& key);
  StatusOr<int64_t> kvAdd(const std::string& run_id, const std::string& key, int64_t delta);
  // c10d compareSet: returns the value after the operation.
  StatusOr<std::string> kvCompareSet(const std::string& run_id, const std::string& key,
                                     const std::string& expected, const std::string& desired);
  // Values of `keys`, in order, once all exist; DEADLINE_EXCEEDED after `timeout`.
  StatusOr<std::vector<std::string>> kvWait(const std::string& run_id,
                                            const std::vector<std::string>& keys, Duration timeout);
  StatusOr<bool> kvDelete(const std::string& run_id, const std::string& key);

  // Heartbeats (run_id, node_id) every `interval` until the returned object is destroyed. Each
  // beat is one attempt with `interval` as its deadline; `on_error` runs on the keep-alive's
  // thread for every failed beat (NOT_FOUND: the server declared the node dead, join again).
  std::unique_ptr<KeepAlive> keepAlive(const std::string& run_id, const std::string& node_id,
                                       Duration interval,
                                       std::function<void(const Status&)> on_error = {});

  std::unique_ptr<Watch> watch(const std::string& run_id, const std::string& node_id,
                               ChangeCallback on_change, BreakCallback on_break = {});

  // Cancels every call in flight (they return CANCELLED), e.g. on SIGTERM mid-join.
  void cancelAll();

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace ddprun::rendezvous
