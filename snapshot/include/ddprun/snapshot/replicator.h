// Replicator: the shell of --snapshot-dir replication around the pure ReplicationCore (core.h),
// and what the agent uses of it. It wires
// - a DirWatcher (inotify on the directory and every directory below it) that tells the core what
//   this node's workers completed, renamed or deleted;
// - the Holdings: what this node holds and serves to the others (from the inode each version was
//   announced with), the copies it installs and deletes, and the directory's version table
//   (.ddprun-versions), so that what it held keeps its version when the agent starts again;
// - the transport's SnapshotServer (transfer.h), answering announcements and serving holdings;
// - one TransferPool of threads for what blocks (looking at and hashing files, fetching,
//   announcing through the Announcer), each result posted back to the loop;
// and carries out the core's actions, telling the core what came of each. Before a round's
// workers start (syncRound), it publishes what this node holds through the rendezvous' key-value
// store (a HoldingsBoard), learns what every node of the round holds, and hands the round on once
// the newest version of each file is here.
//
// Threading: the agent's loop thread owns the replicator, its core and its holdings table; the
// pool's threads and the server's gRPC threads only post results to the loop, and read the
// served-file table under its mutex (Holdings). Lifetime: create on the loop thread before it
// runs; destroy after the loop stopped (the destructor cancels fetches and joins the pool).
#pragma once

#include <boost/asio/io_context.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ddprun/common/clock.h"
#include "ddprun/common/status.h"
#include "ddprun/snapshot/core.h"
#include "ddprun/snapshot/limits.h"
#include "ddprun/snapshot/transfer.h"

namespace ddprun::snapshot {

struct ReplicatorOptions {
  std::string dir;
  std::string run_id;
  std::string local_addr;  // advertised host; the service listens on it (a name: on 0.0.0.0)
  TransferSecurity security;
  ServeFault fault;                             // test hook (DDPRUN_SNAPSHOT_FAULT)
  size_t fetch_streams = kDefaultFetchStreams;  // DDPRUN_SNAPSHOT_STREAMS
  // Waiting for the others' holdings at a round's start: past it the round starts with the nodes
  // whose holdings came, and takes the others in as theirs come.
  Duration holdings_timeout = std::chrono::seconds(15);
  SnapshotLimits limits;  // --snapshot-limits: bounds against peers that misbehave
};

// The key-value store a round's holdings travel through (the rendezvous'), as the replicator
// needs it. Callbacks run on the replicator's loop.
class HoldingsBoard {
 public:
  virtual ~HoldingsBoard() = default;
  virtual void put(const std::string& key, const std::string& value,
                   std::function<void(Status)> done) = 0;
  // The keys' values in order once all exist, or DEADLINE_EXCEEDED after `timeout`.
  virtual void waitAll(const std::vector<std::string>& keys, Duration timeout,
                       std::function<void(StatusOr<std::vector<std::string>>)> done) = 0;
};

// The first segment of the keys holdings are published under (common/round_key.h).
inline constexpr char kHoldingsKeys[] = "snapshot";
// The keys under which the replicating nodes of group ranks `ranks` publish their holdings for
// round `round`, in that order: "snapshot/<round, 20 digits>/<rank>".
std::vector<std::string> holdingsKeys(uint64_t round, const std::vector<int>& ranks);

// INVALID_ARGUMENT: a --snapshot-dir that is missing, not a directory or not writable.
Status checkSnapshotDir(const std::string& dir);
// DDPRUN_SNAPSHOT_FAULT=in-flight:N | at-source:N | slow:MS | slow-hash:MS | late-holdings:MS
// (test hook); INVALID_ARGUMENT when malformed.
StatusOr<ServeFault> parseSnapshotFault(const std::string& text);
// DDPRUN_SNAPSHOT_STREAMS=N: at most N streams at once for one large fetch (1-16; empty: the
// default); INVALID_ARGUMENT naming the variable otherwise.
StatusOr<size_t> parseSnapshotStreams(const std::string& text);
// Removes the temp files that writers killed mid-write left under `dir` (at any depth, no
// symlink followed): "<name>.tmp.<pid>.<number>", as the worker SDK's atomic writes name them,
// whose process <pid> is gone. The relative paths removed. The agent calls it when a job ends
// (a snapshot write killed by SIGXFSZ or SIGKILL otherwise leaves its bytes until the next
// start).
std::vector<std::string> removeDeadWritersTempFiles(const std::string& dir);

class Replicator {
 public:
  static StatusOr<std::unique_ptr<Replicator>> start(boost::asio::io_context& io,
                                                     ReplicatorOptions options);
  ~Replicator();
  Replicator(const Replicator&) = delete;
  Replicator& operator=(const Replicator&) = delete;

  // Publishes this node's holdings for round `round` (this node is `group_rank`) on `board`,
  // learns those of the nodes `ranks` (the group ranks of the round's nodes that replicate,
  // ascending, this one's among them; the others ran without --snapshot-dir and are neither waited
  // for nor told of versions), fetches what is newer elsewhere, then calls `done` (on the loop).
  // Never fails: what cannot be fetched is logged and the previous version stays. A sync still open
  // when the next begins is handed on as it is. `board` must outlive the sync.
  void syncRound(uint64_t round, int group_rank, std::vector<int> ranks, HoldingsBoard& board,
                 std::function<void()> done);
  // How much whenQuiet waits for, each level including the ones before it.
  enum class Quiet {
    // What the workers wrote has its version: every event read, every file looked at (hashed),
    // every name renamed away settled; the version table records it.
    kVersioned,
    // And nothing is being fetched or announced here.
    kReplicated,
    // And no other node is fetching from here.
    kServed,
  };
  // Calls `done` (on the loop) once the replicator has been quiet to `level` for `grace`, or
  // after `bound` at the latest. A round's sync waits for kVersioned before this node publishes
  // its holdings; the end of a job waits for more, so that the last version written reaches
  // every node.
  void whenQuiet(Quiet level, Duration grace, Duration bound, std::function<void()> done);
  const SnapshotMetrics& metrics() const;
  const std::string& endpoint() const;

  struct Parts;

 private:
  explicit Replicator(std::unique_ptr<Parts> parts);
  std::unique_ptr<Parts> parts_;
};

}  // namespace ddprun::snapshot
