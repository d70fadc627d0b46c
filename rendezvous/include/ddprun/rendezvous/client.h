// Client: a blocking face of AsyncClient, for tests, benchmarks and tools (the agent uses
// AsyncClient from its event loop).
//
// Every call has a deadline and is retried with exponential backoff while the server is
// UNAVAILABLE (restarting, not up yet) for up to `retry_timeout`; any other error is returned at
// once (AsyncClient's rules, including the TLS listener probe). A Watch re-subscribes by itself
// when its stream breaks; the first message of every (re)subscription is a kSnapshot.
//
// Threading: all methods are thread-safe and blocking. The client runs one thread of its own (an
// io_context driving its AsyncClient); Watch callbacks run there, one at a time: keep them short
// and never call the blocking methods of the same client from them. cancelAll() unblocks every
// call in flight with CANCELLED.
// Lifetime: destroy every Watch before its Client, and no call may be in flight when the Client
// is destroyed (cancelAll() and wait for them first).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ddprun/common/clock.h"
#include "ddprun/common/status.h"
#include "ddprun/rendezvous/async_client.h"
#include "ddprun/rendezvous/types.h"

namespace ddprun::rendezvous {

class Client {
 public:
  using ChangeCallback = AsyncClient::ChangeCallback;
  using BreakCallback = AsyncClient::BreakCallback;

  explicit Client(ClientOptions options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Blocks until this node's round completes (or join_timeout, a closed run, bad input).
  // Pass the node id of the previous round (RoundInfo::node_id) to keep the group rank.
  StatusOr<RoundInfo> join(const JoinRequest& req, bool include_participants = true);
  StatusOr<RunStatus> heartbeat(const std::string& run_id, const std::string& node_id);
  Status leave(const std::string& run_id, const std::string& node_id);
  // Returns the round every node must join next.
  StatusOr<uint64_t> reportFailure(const std::string& run_id, const std::string& node_id,
                                   uint64_t round, FailureKind kind = FailureKind::kWorkers);
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
  StatusOr<uint64_t> kvDeleteRange(const std::string& run_id, const std::string& from,
                                   const std::string& to);

  // Callbacks run on the client's thread (see above).
  std::unique_ptr<Watch> watch(const std::string& run_id, const std::string& node_id,
                               ChangeCallback on_change, BreakCallback on_break = {});

  // Cancels every call in flight (they return CANCELLED), e.g. on SIGTERM mid-join.
  void cancelAll();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace ddprun::rendezvous
