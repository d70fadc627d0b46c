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
// - Runs do not live forever (a daemon serves many jobs): once a closed run has no open watch
//   stream (its watchers got the kClosed change) it shrinks to a tombstone that keeps refusing
//   joins for RunRetention::closed_run_ttl; a run nobody uses (no live node, no watch stream, no
//   pending wait, no key written) for idle_run_ttl is dropped with its key-value store, and its id
//   is free again. Collection happens in tick(), like every other expiry.
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

// Limits that protect the server from bad input and bound its memory. The quotas are far above
// what jobs store (a few short keys per node and round) and answer RESOURCE_EXHAUSTED naming the
// limit; ddprun-rendezvous has a flag for each (the embedded server keeps these defaults).
struct StateLimits {
  size_t max_value_bytes = 1 << 20;
  size_t max_key_bytes = 4096;
  size_t max_id_bytes = 1024;  // run ids, node ids, addresses
  // Key-value quotas. Bytes count keys plus values.
  size_t max_run_keys = 65536;          // keys of one run id
  size_t max_run_kv_bytes = 16u << 20;  // bytes of one run id
  size_t max_kv_bytes = 256u << 20;     // bytes of all run ids together
  // Bounds that keep WORLD_SIZE (a sum of local world sizes, uint32) from wrapping.
  uint32_t max_local_world_size = 1u << 15;
  uint32_t max_nodes = 1u << 16;
  // Nodes of one run waiting beyond nnodes MAX (spares). A node new to the run is refused while
  // this many wait: spares cost a pending join each, and without it many client connections could
  // park any number of them (the per-connection stream bound is per connection).
  size_t max_run_spares = 1024;
  // Runs held at once (closed ones until they shrink to their tombstones). A join that would
  // create one more is refused: each holds ~1.6 KB with its node, and a node may heartbeat as
  // seldom as it likes, so without it a client could create runs without end.
  size_t max_runs = 65536;
  // The values one KvWait is answered with, together: what a gRPC message carries (4 MiB). Past
  // it the wait fails with RESOURCE_EXHAUSTED; without it a 1 KB request naming a 1 MiB key many
  // times would be answered with a copy each.
  size_t max_wait_answer_bytes = (4u << 20) - (64u << 10);
};

// How long the state keeps what jobs leave behind.
struct RunRetention {
  // A closed run's tombstone (id, close time, reason) refuses joins this long after the close.
  Duration closed_run_ttl = std::chrono::hours(1);
  // A run (or a key-value space without a run) unused this long is dropped with its keys. Long
  // enough for a job whose every node crashed to restart them all and find its store again.
  Duration idle_run_ttl = std::chrono::minutes(10);
  // Tombstones beyond this many are evicted oldest close first.
  size_t max_tombstones = 100000;
  // A closed run is shrunk to its tombstone at the latest this long after its close, even while
  // a watch stream (a stuck client that never takes the kClosed message) is still open.
  Duration closed_drain_timeout = std::chrono::minutes(1);
};

// What the state holds, for tests, logs and gauges.
struct StateCensus {
  size_t runs = 0;         // full runs, closed ones not yet shrunk included
  size_t closed_runs = 0;  // of those, closed (waiting for their watchers to be told)
  size_t tombstones = 0;
  size_t kv_spaces = 0;  // run ids with a key-value store
  size_t watch_streams = 0;
  size_t kv_bytes = 0;  // keys plus values held, all runs
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
  struct MasterDone {
    CallId id;
    StatusOr<MasterAddress> master;  // a waitMaster's answer
  };
  struct Change {
    std::string run_id;
    RoundChange change;
  };
  struct Outbox {
    std::vector<JoinDone> joins;
    std::vector<WaitDone> waits;
    std::vector<MasterDone> masters;
    std::vector<Change> changes;
    bool empty() const {
      return joins.empty() && waits.empty() && masters.empty() && changes.empty();
    }
  };

  explicit RendezvousState(StateLimits limits = {}, RunRetention retention = {});
  ~RendezvousState();
  RendezvousState(const RendezvousState&) = delete;
  RendezvousState& operator=(const RendezvousState&) = delete;

  // The check every call makes of the ids it names, Watch included: a run id that is non-empty,
  // and ids of at most max_id_bytes without control bytes (they reach logs and messages).
  Status validateIds(const std::string& run_id, const std::string& node_id = {}) const;

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
  // The messages a new watch stream on `run_id` starts with: a kSnapshot of the run as it is now
  // (round: the pending one, else the last completed; an unknown run reads as all zero), then a
  // kClosed when the run is closed or tombstoned (the stream ends after it).
  std::vector<RoundChange> watchSnapshot(const std::string& run_id) const;
  // A watch stream on `run_id` (of a node or an observer) opened / ended for whatever reason; the
  // server calls each once per stream. A run with an open stream is never collected, and a closed
  // run keeps its full state until its last stream ended (its watchers took kClosed).
  void watchOpened(const std::string& run_id, TimePoint now);
  void watchClosed(const std::string& run_id, TimePoint now);
  // Returns the round every node must join next. Reports for a superseded round are absorbed
  // into the round already forming, so N nodes reporting one failure cost one round. The round
  // opened tells why: kFailureReported, or kRecoveryFailed for FailureKind::kRecovery.
  StatusOr<uint64_t> reportFailure(const std::string& run_id, const std::string& node_id,
                                   uint64_t round, TimePoint now,
                                   FailureKind kind = FailureKind::kWorkers);
  // Refuses later joins; the run's watchers get kClosed. `reason` is kept in its tombstone.
  Status close(const std::string& run_id, TimePoint now, std::string reason = "by a client");
  // A tombstoned run reports closed (its round counters are gone: 0).
  StatusOr<RunStatus> status(const std::string& run_id) const;

  // Only the rank-0 node of `round` may publish; waiters on the round's master are answered.
  Status publishMaster(const std::string& run_id, const std::string& node_id, uint64_t round,
                       const MasterAddress& master, TimePoint now);
  // Long-poll for the master of `round`; the answer arrives in the outbox (Outbox::masters).
  // ABORTED once a later round completed without the master of `round` published (rank 0 of
  // `round` can publish until then, even while the next round is forming).
  void waitMaster(CallId id, const std::string& run_id, uint64_t round, Duration timeout,
                  TimePoint now);
  // The published master of `round`, if any.
  std::optional<MasterAddress> masterOf(const std::string& run_id, uint64_t round) const;

  // Key-value store per run id (run ids need no join to use it). Keys under "__ddprun/" are the
  // server's own: readable, not writable. "__ddprun/master/<round>" reads the published master of
  // that round as "addr:port" (derived from the typed master, which is what the run holds).
  Status kvSet(const std::string& run_id, const std::string& key, std::string value, TimePoint now);
  StatusOr<std::string> kvGet(const std::string& run_id, const std::string& key) const;
  StatusOr<int64_t> kvAdd(const std::string& run_id, const std::string& key, int64_t delta,
                          TimePoint now);
  StatusOr<std::string> kvCompareSet(const std::string& run_id, const std::string& key,
                                     const std::string& expected, std::string desired,
                                     TimePoint now);
  StatusOr<bool> kvDelete(const std::string& run_id, const std::string& key, TimePoint now);
  // Deletes every key k with from <= k < to (as etcd's DeleteRange); returns how many. A range
  // that is empty or covers the reserved keys is INVALID_ARGUMENT.
  StatusOr<size_t> kvDeleteRange(const std::string& run_id, const std::string& from,
                                 const std::string& to, TimePoint now);
  void kvWait(CallId id, const std::string& run_id, std::vector<std::string> keys, Duration timeout,
              TimePoint now);
  void cancelWait(CallId id, TimePoint now);

  // Expires last calls, join and wait timeouts and heartbeats due at `now`, and collects closed,
  // expired and abandoned runs (see RunRetention).
  void tick(TimePoint now);
  // The earliest time tick() has something to do, if any.
  std::optional<TimePoint> nextDeadline() const;

  Outbox drain();

  // Snapshots of one run, for backends that keep a run's state in a shared store and apply each
  // request through this same code (the etcd-v3 backend: import the stored run, apply, export,
  // write back if the store still holds what was read). A snapshot holds the run's rounds, nodes
  // (pending joins with their call ids), masters and close; not its key-value store, waits or
  // watch streams. A closed run that was shrunk exports as its tombstone. TimePoints are written
  // as they are: callers that share snapshots between machines pass wall-clock TimePoints.
  // exportRun of an unknown run is empty.
  std::string exportRun(const std::string& run_id) const;
  // Replaces what this state holds of the snapshot's run (an empty snapshot: nothing; INVALID_
  // ARGUMENT for a snapshot this code cannot read). Pending joins come back with their call ids.
  Status importRun(const std::string& run_id, const std::string& snapshot);
  // Declares a node dead now (its etcd lease expired), as a missed heartbeat would: a participant's
  // death opens the next round. NOT_FOUND when the state does not hold the node.
  Status declareDead(const std::string& run_id, const std::string& node_id, TimePoint now);
  // Where a node's join stands, for a joiner that learns of rounds from a shared store: the round
  // it completed (the node is a participant of the completed round and has no join pending),
  // nullopt while its join is pending, NOT_FOUND when the node is gone (its join timed out, or it
  // was declared dead), FAILED_PRECONDITION when the run is closed.
  StatusOr<std::optional<RoundInfo>> joinOutcome(const std::string& run_id,
                                                 const std::string& node_id) const;
  // The ids of the run's live nodes (participants, joiners, spares); empty for an unknown run.
  std::vector<std::string> nodeIds(const std::string& run_id) const;

  StateCensus census() const;
  const RunRetention& retention() const { return retention_; }

  // Fails every pending join and wait with `status` (server shutdown).
  void abortAll(const Status& status);

 private:
  struct Run;
  struct Node;
  struct KvSpace {
    std::map<std::string, std::string> data;
    size_t bytes = 0;         // keys plus values of `data`
    TimePoint last_active{};  // last write or wait
  };
  struct Tombstone {
    TimePoint closed_at;
    std::string reason;
  };
  Run* findRun(const std::string& run_id);
  const Run* findRun(const std::string& run_id) const;
  // The completed round as `node_id`, its participant at `group_rank`, sees it (master included).
  RoundInfo participantInfo(const Run& run, const std::string& node_id, uint32_t group_rank) const;
  Status validateKey(const std::string& run_id, const std::string& key) const;
  Status validateWrite(const std::string& run_id, const std::string& key) const;
  // Stores `value` under `key` within the quotas (RESOURCE_EXHAUSTED naming the limit otherwise).
  Status store(const std::string& run_id, const std::string& key, std::string value, TimePoint now);
  // Drops a run id's key-value space, and its bytes from the total.
  void dropKvSpace(const std::string& run_id);
  void addToRound(Run& run, Node& node, TimePoint now);
  void openRound(Run& run, ChangeReason reason, const std::string& cause, TimePoint now);
  void promoteSpares(Run& run, TimePoint now);
  void completeRound(Run& run, TimePoint now);
  void removeNode(Run& run, const std::string& node_id, ChangeReason reason,
                  std::optional<Status> join_status, TimePoint now);
  void detachFromRound(Run& run, Node& node);
  void finishJoin(Node& node, StatusOr<RoundInfo> result);
  void notifyKeys(const std::string& run_id, const std::string& key, TimePoint now);
  void abortMasterWaits(const Run& run);
  void answerMasterWaits(const Run& run, uint64_t round);
  // Whether `key` of `run_id` has a value, and the value (reserved keys derived from typed state).
  bool hasKey(const std::string& run_id, const std::string& key) const;
  std::optional<std::string> lookup(const std::string& run_id, const std::string& key) const;
  // The values of `keys` (all present), or RESOURCE_EXHAUSTED past max_wait_answer_bytes.
  StatusOr<std::vector<std::string>> waitAnswer(const std::string& run_id,
                                                const std::vector<std::string>& keys) const;
  // Answers a pending wait (a key wait or a waitMaster) with an error and forgets it.
  void failWait(CallId id, Status status);
  // tick(), by concern: key and master waits, joins and last calls, heartbeats.
  void expireWaits(TimePoint now);
  void expireJoins(Run& run, TimePoint now);
  void expireHeartbeats(Run& run, TimePoint now);
  void push(Run& run, ChangeKind kind, ChangeReason reason, const std::string& node_id,
            uint64_t round);
  RunStatus statusOf(const Run& run) const;
  const Tombstone* findTombstone(const std::string& run_id) const;
  KvSpace& kvSpace(const std::string& run_id, TimePoint now);
  // Records use of `run_id` (a write, a wait, a stream ending): its idle clock restarts.
  void touch(const std::string& run_id, TimePoint now);
  // Schedules a collection check for a run that may have just become unused.
  void noteMaybeIdle(Run& run, TimePoint now);
  void scheduleCollect(TimePoint at);
  void collect(TimePoint now);
  void bury(const std::string& run_id, TimePoint closed_at, std::string reason, TimePoint now);

  StateLimits limits_;
  RunRetention retention_;
  std::map<std::string, std::unique_ptr<Run>> runs_;
  std::unordered_map<std::string, Tombstone> tombstones_;
  std::set<std::pair<TimePoint, std::string>> tombstones_by_close_;  // eviction and expiry order
  std::unordered_map<std::string, uint32_t> watchers_;               // open streams per run id
  size_t closed_runs_ = 0;    // runs_ entries closed but not yet shrunk (census() is O(1))
  size_t watch_streams_ = 0;  // sum of watchers_
  // Pending joins: call id -> (run id, node id).
  std::unordered_map<CallId, std::pair<std::string, std::string>> joins_;
  struct Wait {
    std::string run_id;
    std::vector<std::string> keys;  // a key wait; empty for a waitMaster
    TimePoint deadline;
    bool master = false;        // a waitMaster: answered in Outbox::masters
    uint64_t master_round = 0;  // its round: fails once a later round completed
  };
  std::unordered_map<CallId, Wait> waits_;
  std::map<std::string, KvSpace> kv_;
  size_t kv_bytes_ = 0;  // sum of KvSpace::bytes
  uint64_t next_node_seq_ = 1;
  // Times at which tick() has something to check (join/wait deadlines, last calls, heartbeat
  // expiries); a set, so the many joins of one instant cost one entry.
  std::set<TimePoint> deadlines_;
  Outbox outbox_;
};

}  // namespace ddprun::rendezvous
