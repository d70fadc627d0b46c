// RendezvousState: the pure state machine of the rendezvous server, for every run it knows.
//
// Semantics of torchrun's dynamic rendezvous, held by one actor instead of a shared blob:
// - A round forms from joiners. Below min_nodes they wait; at min_nodes a last-call window opens
//   (re-armed by each further joiner, as torchrun); at max_nodes the round completes at once.
// - A node arriving after completion (with room below max) opens the next round at once and a
//   kRoundPending change is pushed: the participants of the completed round must re-join it.
//   When the room is taken, the node waits as a spare and is promoted when a participant goes.
// - A re-forming round knows who it expects (the survivors of the last round); it completes as
//   soon as all of them re-joined, without waiting out the last call.
// - Nodes heartbeat; a node without a pending join that misses heartbeat_misses beats is dead.
//   A participant that dies, leaves or reports a failure opens the next round for the survivors,
//   which waits to refill if fewer than min_nodes remain.
// - Group ranks are stable: a node keeps its last rank when it is still below the group size;
//   the others fill the free ranks. Ranks are contiguous 0..n-1.
// - Close refuses later joins with FAILED_PRECONDITION.
//
// Time is passed in; nothing here blocks, sleeps or does I/O. Results of long operations (joins,
// key waits) and pushed changes are collected in an outbox the caller drains after each call.
// Threading: not thread-safe; one owner (the server's io thread, or a test).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "ddprun/common/clock.h"
#include "ddprun/common/status.h"
#include "ddprun/rendezvous/types.h"

namespace ddprun::rendezvous {

// Limits that protect the server from bad input.
struct StateLimits {
  size_t max_value_bytes = 1 << 20;
  size_t max_key_bytes = 4096;
  size_t max_id_bytes = 1024;
};

class RendezvousState {
 public:
  using CallId = uint64_t;  // chosen by the caller, unique among its pending calls

  struct JoinDone {
    CallId id;
    StatusOr<RoundInfo> result;
  };
  struct WaitDone {
    CallId id;
    StatusOr<std::vector<std::string>> values;  // in the order of the keys waited for
  };
  struct Change {
    std::string run_id;
    RoundChange change;
  };
  struct Outbox {
    std::vector<JoinDone> joins;
    std::vector<WaitDone> waits;
    std::vector<Change> changes;
    bool empty() const { return joins.empty() && waits.empty() && changes.empty(); }
  };

  explicit RendezvousState(StateLimits limits = {});
  ~RendezvousState();
  RendezvousState(const RendezvousState&) = delete;
  RendezvousState& operator=(const RendezvousState&) = delete;

  // Starts a join; its result (possibly at once, possibly an error) arrives in the outbox.
  void join(CallId id, const JoinRequest& req, TimePoint now);
  // The caller went away (gRPC cancellation): forget the pending join without answering it.
  void cancelJoin(CallId id, TimePoint now);

  StatusOr<RunStatus> heartbeat(const std::string& run_id, const std::string& node_id,
                                TimePoint now);
  Status leave(const std::string& run_id, const std::string& node_id, TimePoint now);
  // A node's Watch stream ended without the node leaving: when its agent died, the kernel closed
  // its connection. The node becomes suspect: unless it heartbeats or watches again within one
  // heartbeat interval, it is declared dead (a live agent's next beat clears it; a dead one is
  // found in about one interval instead of interval x misses).
  void watchLost(const std::string& run_id, const std::string& node_id, TimePoint now);
  // The node subscribed again: no longer suspect.
  void watchStarted(const std::string& run_id, const std::string& node_id);
  // Returns the round every node must join next. Reports for a superseded round are absorbed
  // into the round already forming, so N nodes reporting one failure cost one round.
  StatusOr<uint64_t> reportFailure(const std::string& run_id, const std::string& node_id,
                                   uint64_t round, TimePoint now);
  Status close(const std::string& run_id, TimePoint now);
  StatusOr<RunStatus> status(const std::string& run_id) const;

  // Only the rank-0 node of `round` may publish; waiters on the round's master are answered.
  Status publishMaster(const std::string& run_id, const std::string& node_id, uint64_t round,
                       const MasterAddress& master, TimePoint now);
  // Long-poll for the master of `round`; the answer (one value "addr:port") arrives in the outbox.
  // ABORTED once a later round completed without the master of `round` published (rank 0 of
  // `round` can publish until then, even while the next round is forming).
  void waitMaster(CallId id, const std::string& run_id, uint64_t round, Duration timeout,
                  TimePoint now);

  // Key-value store per run id (run ids need no join to use it). Keys under "__ddprun/" are the
  // server's own (master addresses): readable, not writable.
  Status kvSet(const std::string& run_id, const std::string& key, std::string value, TimePoint now);
  StatusOr<std::string> kvGet(const std::string& run_id, const std::string& key) const;
  StatusOr<int64_t> kvAdd(const std::string& run_id, const std::string& key, int64_t delta,
                          TimePoint now);
  StatusOr<std::string> kvCompareSet(const std::string& run_id, const std::string& key,
                                     const std::string& expected, std::string desired,
                                     TimePoint now);
  StatusOr<bool> kvDelete(const std::string& run_id, const std::string& key);
  void kvWait(CallId id, const std::string& run_id, std::vector<std::string> keys, Duration timeout,
              TimePoint now);
  void cancelWait(CallId id);

  // Expires last calls, join and wait timeouts and heartbeats due at `now`.
  void tick(TimePoint now);
  // The earliest time tick() has something to do, if any.
  std::optional<TimePoint> nextDeadline() const;

  Outbox drain();

  // Fails every pending join and wait with `status` (server shutdown).
  void abortAll(const Status& status);

 private:
  struct Run;
  struct Node;
  Run* findRun(const std::string& run_id);
  const Run* findRun(const std::string& run_id) const;
  Status validateKey(const std::string& run_id, const std::string& key) const;
  Status validateWrite(const std::string& run_id, const std::string& key) const;
  void addToRound(Run& run, Node& node, TimePoint now);
  void openRound(Run& run, ChangeReason reason, const std::string& cause, TimePoint now);
  void promoteSpares(Run& run, TimePoint now);
  void completeRound(Run& run, TimePoint now);
  void removeNode(Run& run, const std::string& node_id, ChangeReason reason,
                  std::optional<Status> join_status, TimePoint now);
  void detachFromRound(Run& run, Node& node);
  void finishJoin(Node& node, StatusOr<RoundInfo> result);
  void notifyKeys(const std::string& run_id, const std::string& key);
  void abortMasterWaits(const Run& run);
  void push(Run& run, ChangeKind kind, ChangeReason reason, const std::string& node_id,
            uint64_t round);
  RunStatus statusOf(const Run& run) const;

  StateLimits limits_;
  std::map<std::string, std::unique_ptr<Run>> runs_;
  // Pending joins: call id -> (run id, node id).
  std::unordered_map<CallId, std::pair<std::string, std::string>> joins_;
  struct Wait {
    std::string run_id;
    std::vector<std::string> keys;
    TimePoint deadline;
    uint64_t master_round = 0;  // a waitMaster: fails once a later round completed
  };
  std::unordered_map<CallId, Wait> waits_;
  std::map<std::string, std::map<std::string, std::string>> kv_;
  uint64_t next_node_seq_ = 1;
  // Times at which tick() has something to check (join/wait deadlines, last calls, heartbeat
  // expiries); a set, so the many joins of one instant cost one entry.
  std::set<TimePoint> deadlines_;
  Outbox outbox_;
};

}  // namespace ddprun::rendezvous
