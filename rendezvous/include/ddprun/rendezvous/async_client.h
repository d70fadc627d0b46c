// AsyncClient: the agent's side of the rendezvous service, for a caller with one Asio event loop
// and no threads of its own. Every call is asynchronous and completes through a callback POSTED to
// the caller's io_context: never run inline, never on a gRPC thread.
//
// Every call has a deadline per attempt (`rpc_timeout`, or the server-side wait plus 10 s for
// join/waitMaster/kvWait) and is retried with exponential backoff (`initial_backoff` ..
// `max_backoff`, waiting on an Asio timer on the io_context, no sleeping thread) while the server
// is UNAVAILABLE, for up to `retry_timeout` (0: one attempt); any other error completes the call at
// once. CallOptions override both per call.
//
// Over TLS, before the first attempt the client waits (bounded by the call's retry timeout, with
// the same backoff) until the endpoint accepts TCP connections, probing with Asio's async
// connect: gRPC 1.51 (Debian 12) never completes a handshake on a TLS channel whose first
// connection attempts were refused, so an agent that starts before its rendezvous would otherwise
// wait out its whole join timeout. Once a connection was accepted the probe is not repeated.
//
// Threading: methods may be called from any thread (the agent calls them from its io thread).
// `io` must be run by one thread (the loop's own state of the client is not locked); callbacks
// run there, one at a time. A Watch's on_change is posted to `io` as well. No thread of its own
// (Asio may resolve a host name on its internal resolver thread for the TLS probe).
// Lifetime: `io` must outlive the client. The destructor (and cancelAll) cancels the calls in
// flight; after the destructor returned no callback of this client runs and nothing more is posted
// to `io` (it waits for the cancelled calls' completions, which come promptly on gRPC's threads);
// it may be destroyed from inside one of its callbacks. Destroy every Watch before its client.
#pragma once

#include <boost/asio/io_context.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ddprun/common/clock.h"
#include "ddprun/common/status.h"
#include "ddprun/rendezvous/types.h"

namespace ddprun::rendezvous {

struct ClientOptions {
  std::string endpoint;           // HOST:PORT (or [V6]:PORT) of the rendezvous server
  std::string token;              // sent as "authorization: Bearer <token>" when non-empty
  std::string tls_root_cert_pem;  // non-empty: TLS, trusting this certificate
  std::string tls_server_name;    // overrides the name checked against the certificate
  Duration rpc_timeout = std::chrono::seconds(30);    // deadline of each short call
  Duration retry_timeout = std::chrono::seconds(60);  // how long UNAVAILABLE is retried
  Duration initial_backoff = std::chrono::milliseconds(50);
  Duration max_backoff = std::chrono::seconds(1);
  // While calls are retried because the server cannot be reached, a warning this often (the
  // endpoint, for how long, the last error): a join may retry for its whole join_timeout.
  Duration unreachable_notice_every = std::chrono::seconds(30);
};

// Per-call overrides of ClientOptions.
struct CallOptions {
  std::optional<Duration> rpc_timeout;    // deadline of one attempt
  std::optional<Duration> retry_timeout;  // how long UNAVAILABLE is retried (0: one attempt)
};

// A running subscription to a run's round changes. It re-subscribes by itself (backoff
// initial_backoff .. max_backoff) when its stream breaks; the first message of every
// (re)subscription is a kSnapshot, so a watcher never misses a change across a reconnect.
// Destroying it ends the stream; after the destructor returned no callback of it runs (it may be
// destroyed from inside its own callback).
class Watch {
 public:
  virtual ~Watch() = default;
};

class AsyncClient {
 public:
  template <typename T>
  using Done = std::function<void(StatusOr<T>)>;
  using StatusDone = std::function<void(Status)>;
  using ChangeCallback = std::function<void(const RoundChange&)>;
  // Called when a watch stream breaks (before re-subscribing); informational.
  using BreakCallback = std::function<void(const Status&)>;

  AsyncClient(boost::asio::io_context& io, ClientOptions options);
  ~AsyncClient();
  AsyncClient(const AsyncClient&) = delete;
  AsyncClient& operator=(const AsyncClient&) = delete;

  // Completes when this node's round completes (or join_timeout, a closed run, bad input). Pass
  // the node id of the previous round (RoundInfo::node_id) to keep the group rank. The attempt
  // deadline defaults to join_timeout + 10 s (the server answers join_timeout itself).
  void join(const JoinRequest& req, Done<RoundInfo> done, CallOptions o = {},
            bool include_participants = true);
  // NOT_FOUND: the server declared the node dead (or it left): join again.
  void heartbeat(const std::string& run, const std::string& node, Done<RunStatus> done,
                 CallOptions o = {});
  void leave(const std::string& run, const std::string& node, StatusDone done, CallOptions o = {});
  // Completes with the round every node must join next.
  void reportFailure(const std::string& run, const std::string& node, uint64_t round,
                     FailureKind kind, Done<uint64_t> done, CallOptions o = {});
  void close(const std::string& run, StatusDone done, CallOptions o = {});
  // The rank-0 node of `round` publishes the master address of its workers.
  void publishMaster(const std::string& run, const std::string& node, uint64_t round,
                     const MasterAddress& m, StatusDone done, CallOptions o = {});
  // Waits up to `timeout` for the master of `round`; ABORTED when a later round completed before
  // it was published (join again instead).
  void waitMaster(const std::string& run, uint64_t round, Duration timeout,
                  Done<MasterAddress> done, CallOptions o = {});

  void kvSet(const std::string& run, const std::string& key, const std::string& value,
             StatusDone done, CallOptions o = {});
  void kvGet(const std::string& run, const std::string& key, Done<std::string> done,
             CallOptions o = {});
  // Not idempotent: retried only while the server is UNAVAILABLE (the add did not happen).
  void kvAdd(const std::string& run, const std::string& key, int64_t delta, Done<int64_t> done,
             CallOptions o = {});
  // c10d compareSet: completes with the value after the operation.
  void kvCompareSet(const std::string& run, const std::string& key, const std::string& expected,
                    const std::string& desired, Done<std::string> done, CallOptions o = {});
  // Values of `keys`, in order, once all exist; DEADLINE_EXCEEDED after `timeout`.
  void kvWait(const std::string& run, const std::vector<std::string>& keys, Duration timeout,
              Done<std::vector<std::string>> done, CallOptions o = {});
  void kvDelete(const std::string& run, const std::string& key, Done<bool> done,
                CallOptions o = {});
  // Deletes every key k with from <= k < to; the number deleted (0 from a server that predates
  // ranges, which deletes `from` alone).
  void kvDeleteRange(const std::string& run, const std::string& from, const std::string& to,
                     Done<uint64_t> done, CallOptions o = {});

  // Round changes of `run` (`node` may be empty: an observer). on_change and on_break are posted
  // to `io`. Destroying the Watch ends it.
  std::unique_ptr<Watch> watch(const std::string& run, const std::string& node,
                               ChangeCallback on_change, BreakCallback on_break = {});

  // Every call in flight completes with CANCELLED (its callback still posted), e.g. on SIGTERM
  // mid-join. Calls started afterwards are not affected.
  void cancelAll();

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace ddprun::rendezvous
