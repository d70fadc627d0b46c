// SnapshotReplicator: the shell of --snapshot-dir replication (issue 11) around the pure
// SnapshotReplica (snapshot_replica.h). It
// - watches the directory with inotify (IN_CLOSE_WRITE, IN_MOVED_TO, IN_DELETE, IN_MOVED_FROM)
//   and announces every file a worker completed or deleted there to the other agents of the
//   round;
// - records the versions it holds in the directory's version table (.ddprun-versions), so that
//   they keep their versions when the agent starts again;
// - serves the versions this node holds to the others (rendezvous/snapshot_transfer.h), each
//   from the inode it was announced with;
// - fetches newer versions announced or held elsewhere into a temp file in the directory, and
//   renames a complete, verified copy into place (never a partial or corrupt one);
// - passes an announced version on down the announcement tree (relayTargets) as soon as its own
//   fetch starts, serving it to that subtree as it arrives (a pipelined relay): a version reaches
//   all nodes in about one copy's time rather than one per level of the tree;
// - before a round's workers start (SnapshotSyncClient, below), publishes what this node holds in
//   the rendezvous' key-value store, reads what every node of the round holds, and fetches the
//   newest version of each file before the round is handed to the supervisor.
//
// Threading: the agent's loop thread owns everything but two things. Transfers and announcements
// block, so each runs on a thread of its own that only posts its result back to the loop. The
// replication server's gRPC threads read the table of served files under `served_mu_` and post
// announcements to the loop. Hashing a file a worker completed runs on such a thread too, one
// file at a time. Lifetime: create on the loop thread before it runs; destroy after the loop
// stopped (the destructor cancels transfers and joins their threads).
#pragma once

#include <sys/stat.h>

#include <array>
#include <atomic>
#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/steady_timer.hpp>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "../../snapshot/src/files.h"  // until the replicator moves to snapshot/
#include "ddprun/agent/config.h"
#include "ddprun/agent/rendezvous_client.h"
#include "ddprun/agent/rendezvous_service.h"
#include "ddprun/common/log_throttle.h"
#include "ddprun/snapshot/relays.h"
#include "ddprun/snapshot/rename_pairs.h"
#include "ddprun/snapshot/replica.h"
#include "ddprun/snapshot/transfer.h"

namespace ddprun::agent {

using snapshot::HolderNews;
using snapshot::kRenamePairWait;
using snapshot::RenamePairs;
using snapshot::SnapshotRelays;
using snapshot::SnapshotReplica;
using snapshot::SnapshotReplicaOptions;
using snapshot::SnapshotTransfer;
using snapshot::SnapshotVersion;
using snapshot::TransferOutcome;

struct SnapshotReplicatorOptions {
  std::string dir;
  std::string run_id;
  std::string local_addr;  // advertised host; the service listens on it (a name: on 0.0.0.0)
  snapshot::TransferSecurity security;
  snapshot::ServeFault fault;                             // test hook (DDPRUN_SNAPSHOT_FAULT)
  size_t fetch_streams = snapshot::kDefaultFetchStreams;  // DDPRUN_SNAPSHOT_STREAMS
  Duration holdings_timeout = std::chrono::seconds(15);   // waiting for the others' holdings
  SnapshotLimits limits;  // --snapshot-limits: bounds against peers that misbehave
};

// What /metrics shows.
struct SnapshotMetrics {
  uint64_t versions_fetched = 0;
  uint64_t bytes_fetched = 0;
  uint64_t versions_written = 0;  // completed here by this node's workers
  uint64_t transfer_failures = 0;
  uint64_t versions_copied = 0;  // renamed elsewhere: copied from this node's own file instead
  double last_lag_seconds = 0;   // from learning of a version to holding it, for the last fetch
  uint64_t newest_version = 0;   // highest version held of any file
};

// INVALID_ARGUMENT: a --snapshot-dir that is missing, not a directory or not writable.
Status checkSnapshotDir(const std::string& dir);
// DDPRUN_SNAPSHOT_FAULT=in-flight:N | at-source:N | slow:MS | slow-hash:MS (test hook);
// INVALID_ARGUMENT when malformed.
StatusOr<snapshot::ServeFault> parseSnapshotFault(const std::string& text);

// DDPRUN_SNAPSHOT_STREAMS=N: at most N streams at once for one large fetch (1-16; empty: the
// default); INVALID_ARGUMENT naming the variable otherwise.
StatusOr<size_t> parseSnapshotStreams(const std::string& text);

// The agent keeps one open descriptor per replicated file name (its current version, served
// from that inode): the soft limit on open files is raised to the hard one. Workers inherit it;
// a program that kept under the old limit sees no descriptor numbers it did not see before.
// Returns the soft limit in force.
uint64_t raiseOpenFileLimit();

class SnapshotReplicator {
 public:
  static StatusOr<std::unique_ptr<SnapshotReplicator>> start(boost::asio::io_context& io,
                                                             SnapshotReplicatorOptions options);
  ~SnapshotReplicator();

  // Publishes this node's holdings for `round`, learns every node's, fetches what is newer
  // elsewhere, then calls `done` (on the loop). Never fails: what cannot be fetched is logged and
  // the previous version stays.
  void syncRound(const RoundInfo& round, RendezvousService& service, std::function<void()> done);
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
  const SnapshotMetrics& metrics() const { return metrics_; }
  const std::string& endpoint() const { return endpoint_; }

 private:
  struct Held {
    snapshot::ServedFile served;
    dev_t dev = 0;
    ino_t ino = 0;
    int64_t mtime_ns = 0;
  };
  SnapshotReplicator(boost::asio::io_context& io, SnapshotReplicatorOptions options);
  Status init();
  // The directory's version table, if it is one (else a warning, and nothing).
  std::map<std::string, SnapshotVersion> readVersionTable();
  // Rewrites the version table after what is held changed (a warning when it cannot).
  void recordVersions();
  void scanExisting();
  // Watches the directory `rel` (relative to the snapshot dir; "" is the dir itself, watched by
  // init) and every replicated directory below it, each watched before it is read: a file
  // completed meanwhile is seen twice, never missed. Returns the relative paths of what is in
  // them other than directories (replicated names or not).
  std::vector<std::string> watchTree(const std::string& rel);
  // `files` (relative paths found by watchTree) but those some other process holds open for
  // writing: each is looked at once its IN_CLOSE_WRITE comes (its directory is watched), not
  // announced half-written first.
  std::vector<std::string> closedFiles(std::vector<std::string> files) const;
  // Stops watching the directory `rel` and those below it (renamed or deleted), and looks again
  // at every file held there: their deletions are versions.
  void forgetTree(const std::string& rel);
  // Stops watching the directory `rel` and those below it.
  void unwatchTree(const std::string& rel);
  // The names renamed away (renamed_away_) whose IN_MOVED_TO did not come within
  // kRenamePairWait (rename_pairs.h), with nothing more queued: they left the directory, and are
  // looked at again (their deletions are versions). Looks again when the next of them is due.
  void notRenamedWithin();
  // Events lost (the kernel's queue overflowed): every file there and every file held is looked
  // at again.
  void rescan();
  // Looks again at every file held whose name starts with `prefix` (one that is gone: its
  // deletion is a version).
  void lookAgainAtHeld(const std::string& prefix);
  void watchDir();
  // An inotify event for `name` in the directory watched as `wd`.
  // (`cookie` pairs a rename's IN_MOVED_FROM and IN_MOVED_TO.)
  void onWatchEvent(int wd, uint32_t mask, uint32_t cookie, const std::string& name);
  void onDirEvent(const std::string& name);
  // A warning for a file or directory not replicated because its path is too long (the first
  // few named).
  void warnIfTooLong(const std::string& name);
  void hashNext();
  void onHashed(const std::string& name, std::shared_ptr<snapshot::OpenFile> file,
                const struct stat& st, bool same,
                const StatusOr<std::pair<uint64_t, uint32_t>>& crc);
  // A large completed file: announced now, hashed on a thread while others fetch it.
  void announceThenHash(const std::string& name, std::shared_ptr<snapshot::OpenFile> file,
                        const struct stat& st);
  // `name` is the file held as `from` at `from_version` until this node's workers renamed it
  // (same inode): its new version is announced with the rename as a hint, so that nodes holding
  // `from` copy their own.
  void onRenamed(const std::string& name, const std::string& from, uint64_t from_version,
                 std::shared_ptr<snapshot::OpenFile> file, const struct stat& st);
  // The file this node holds that `v` is a renamed copy of (v.moved_from at that version and
  // content), if any: linked or copied here instead of fetched. Also one in kept_for_copy_.
  std::shared_ptr<const snapshot::OpenFile> localCopyOf(const SnapshotVersion& v);
  // Whether the file `name`, held as `before` and deleted because another node renamed it to
  // `moved_to`, is worth keeping a while for its new name: not when it was linked there already.
  bool worthKeeping(const std::string& moved_to, const Held& before) const;
  // Renames the file `name` out of the way to a hidden name (kRecvPrefix) at the top of the
  // directory instead of deleting it, so its new name can be linked to it; that name, or ""
  // when it cannot be (then it is deleted and kept open for a copy).
  std::string setAside(const std::string& name);
  // Keeps `before` (and the file set aside at `aside`, if any) for the copy under the new name a
  // while (kept_for_copy_), then lets go of it.
  void keepForCopy(const std::string& name, const Held& before, std::string aside);
  // Lets go of what is kept for `name` at once (its new name is linked or being copied).
  void dropKept(const std::string& name);
  // Arms the timer that lets go of the kept copies whose time is up.
  void dropKeptCopiesLater();
  // No file `name` any more: if one was held, its deletion is a version, announced as a write.
  // `moved_to`: it was renamed to that name (onRenamed).
  void onDeleted(const std::string& name, const std::string& moved_to = "");
  // A version this node's workers wrote (or a deletion): held and served here, announced down
  // the tree (the log line ends with `note`).
  void publishWritten(const SnapshotVersion& v, Held held, const std::string& note);
  // This node holds that very file (same inode and mtime) as its current version of `name`.
  bool holdsAlready(const std::string& name, const struct stat& st) const;
  bool isQuiet(Quiet level) const;
  // Whether inotify events wait to be read.
  bool eventsQueued() const;
  // syncRound's second half: publishes what this node (group rank `me`) holds under `prefix`,
  // reads every node's (`keys`), learns their holdings, then calls `finish`.
  void publishHoldings(RendezvousService& service, const std::string& prefix,
                       const std::vector<std::string>& keys, uint64_t generation, int me,
                       std::function<void()> finish);
  // An announcement of `v` (held at `source`, written by `origin`): taken only from a node of the
  // round (its source among the round's endpoints); others are ignored, named in a throttled
  // warning.
  void onAnnounce(const SnapshotVersion& v, const std::string& source, const std::string& origin);
  // The round's nodes are known (its holdings arrived, or will not): the announcements that
  // waited for them are looked at.
  void nodesKnown();
  // replica_.onHolder, with a throttled warning when the name is refused (the bounds on names
  // waiting here); false then.
  bool tookHolder(const SnapshotVersion& v, const std::string& source);
  // Announces `v` (held at `source`, written by `origin`) to the given group ranks. A node that
  // does not take it (stopped, gone, not yet out of the round) is stepped over: the next node of
  // the chain is told instead, so that the rest of the chain is not held up until the next round.
  // It is told again every kAnnounceRetry while this round lasts, and until it answers, later
  // announcements step over it without trying it (one warning per node).
  void announce(const SnapshotVersion& v, const std::string& source, const std::string& origin,
                const std::vector<int>& ranks);
  // Arms the timer that tells unannounced_ again: each node on one thread, its announcements one
  // after another until one is not taken (the rest waits for the next time).
  void announceAgainLater();
  struct Unannounced;
  void announceAgain(const std::string& peer, std::vector<Unannounced> list);
  // Keeps `u` to tell again: one per node and name, the newest (SnapshotVersion::supersedes).
  void keepToTellAgain(Unannounced u);
  // Passes an announcement on down the tree (relayTargets), once per version.
  void relay(const SnapshotVersion& v, const std::string& source);
  // The group ranks this node passes `v` on to (relayTargets; `origin` set), if it was told of
  // `v` with the round's tree; else none.
  std::vector<int> subtree(const SnapshotVersion& v, std::string* origin) const;
  // The group ranks this node passes an announcement on to in the chain `origin` starts; none
  // when `origin` is not a node of this round.
  std::vector<int> chainAfter(const std::string& origin) const;
  // The group rank this round of the node serving at `endpoint`; -1 when it is not one of them.
  int rankOf(const std::string& endpoint) const;
  // A fetch of `v` starts: if this node passes `v` on, it serves `v` as it arrives and tells
  // its subtree so at once (a pipelined relay), instead of once the copy is complete. Returns
  // what the fetch reports its progress to, and in `pending` where the verified CRC-32 goes
  // when `v`'s is not known yet; nullptr when nothing is passed on.
  std::shared_ptr<snapshot::ArrivingFile> serveArriving(
      const SnapshotVersion& v, std::shared_ptr<snapshot::PendingCrc>* pending);
  void pump();
  // A deletion another node made: this node's copy is deleted (no fetch), and the deletion
  // passed on down the tree.
  void applyDeletion(const SnapshotTransfer& t);
  // `taken`: the version came from this node's own file of the old name ("copied from NAME",
  // "linked from NAME"), not from t.source.
  void onFetched(const SnapshotTransfer& t, const Status& st, const std::string& temp,
                 TimePoint started, const std::string& taken);
  // A renamed version whose old name this node still holds as that very file (localCopyOf), or
  // set aside when the old name's deletion came first: linked under `temp` (no copy, no space).
  // False when it cannot be (then it is copied).
  bool linkHeld(const SnapshotVersion& v, const std::string& temp);
  void maybeFinishSync();
  // A new round's nodes serve at `live`: fetches from any other source end now, and other
  // sources are not tried again.
  void dropGoneSources(const std::vector<std::string>& live);
  // Records what this node holds of `name` (and serves). The version it replaces is released
  // off the loop (releaseOffLoop).
  void setHeld(const std::string& name, Held held);
  // Deletions the core forgot (its max_tombstones) are no longer held here or recorded; true
  // when there were any. Called where the core may forget one: a local deletion, one applied
  // from another node, the version table read at start.
  bool dropForgottenDeletions();
  // Undoes a setHeld whose file operation failed: `before` held again, or nothing of `name`.
  void restoreHeld(const std::string& name, const std::optional<Held>& before);
  // Drops a reference to a file on a thread of its own: closing the last descriptor of a file
  // that was renamed over frees its blocks and page cache in close() (here 100 MiB took ~26 ms,
  // 1 GiB ~220 ms), which on the loop delayed the next version's announcement by as much.
  void releaseOffLoop(std::shared_ptr<const snapshot::OpenFile> file);
  // How an offLoop thread runs. kBackground: bulk work (hashing, fetching) that the workers'
  // training comes before (runAsBackground). kPrompt: the few system calls and small RPCs a
  // replication waits on (looking at a completed file, announcing it) at the agent's own
  // priority: as background work they would wait for whatever CPU the workers leave. Fetches
  // that a round's sync waits for are prompt too: this node's workers are stopped then, and their
  // start waits for the fetch.
  enum class Urgency { kBackground, kPrompt };
  // Which threads offLoop work counts against (each pool runs at most so many at once).
  enum class Pool { kGeneral, kFetch };
  // Runs `work` on a thread of its own; `then` runs on the loop afterwards (unless destroyed).
  // When its pool has no thread free, the work waits its turn (first come, first served).
  void offLoop(std::function<void()> work, std::function<void()> then,
               Urgency urgency = Urgency::kBackground, Pool pool = Pool::kGeneral);
  // Starts work waiting in `pool` while it has threads free.
  void startWaiting(Pool pool);
  std::string path(const std::string& name) const { return options_.dir + "/" + name; }
  // The name relative to the directory of a path(name).
  std::string relativeName(const std::string& full) const {
    return full.substr(options_.dir.size() + 1);
  }

  boost::asio::io_context& io_;
  SnapshotReplicatorOptions options_;
  SnapshotReplica replica_;
  std::unique_ptr<snapshot::SnapshotServer> server_;
  std::string endpoint_;
  std::unique_ptr<boost::asio::posix::stream_descriptor> inotify_;
  std::vector<char> event_buf_;
  std::map<int, std::string> watched_;      // watch descriptor → directory, relative ("" the top)
  int unwatched_dirs_ = 0;                  // directories that could not be watched (firstFew)
  int long_names_ = 0;                      // paths too long to be replicated (firstFew)
  int overflows_ = 0;                       // inotify queue overflows (firstFew)
  int impossible_versions_ = 0;             // announcements of versions refused (firstFew)
  std::map<std::string, Held> held_files_;  // loop thread
  // Renamed away, by the rename's cookie, until its IN_MOVED_TO came or it is gone.
  RenamePairs renamed_away_{kRenamePairWait};
  std::unique_ptr<boost::asio::steady_timer> renamed_away_timer_;
  bool renamed_away_timer_armed_ = false;
  // Names renamed within the directory, to what they were called before: taken when the file is
  // next looked at (hashNext).
  std::map<std::string, std::string> renamed_from_;
  // The other way: names renamed away (onRenamed), to their new names, until looked at again.
  std::map<std::string, std::string> renamed_to_;
  // Files deleted here because another node renamed them, kept a while for their new name in
  // case the deletion came first (by name): set aside under a hidden name (`aside`; linked from
  // there), else open only (copied).
  struct KeptCopy {
    Held held;
    TimePoint until;
    std::string aside{};  // relative to the directory
  };
  std::map<std::string, KeptCopy> kept_for_copy_;
  std::unique_ptr<boost::asio::steady_timer> kept_timer_;
  bool kept_timer_armed_ = false;
  std::string recorded_table_;  // what the version table file holds
  bool table_failing_ = false;  // the last write of it failed (warned once)
  bool recording_ = false;      // the version table is kept (after the start's scan)
  mutable std::mutex served_mu_;
  std::map<std::string, snapshot::ServedFile> served_;  // guarded by served_mu_
  // Versions being fetched here that are served on as they arrive (serveArriving).
  std::map<std::string, snapshot::ServedFile> arriving_;  // guarded by served_mu_
  std::vector<std::string> nodes_;  // every node's endpoint this round, by group rank
  int self_rank_ = -1;
  // Whether nodes_ is the round's (round_): false from a round's sync until its holdings came.
  bool nodes_known_ = false;
  struct Unverified {
    SnapshotVersion version;
    std::string source;
    std::string origin;
  };
  // Announcements that came while nodes_known_ was false, the newest kMaxUnverified.
  static constexpr size_t kMaxUnverified = 1024;
  std::deque<Unverified> unverified_;
  LogThrottle ignored_log_{std::chrono::seconds(60)};  // announcements from outside the round
  LogThrottle names_log_{std::chrono::seconds(60)};    // names refused past the bounds
  // Fetch failures, by source: 20 lines a minute each.
  LogThrottle fetch_log_{std::chrono::seconds(60), 1024, 20};
  LogThrottle gave_up_log_{std::chrono::seconds(60), 1024, 20};  // versions given up, by source
  // Announcements to pass on once the version is held (or given up), and those passed on as the
  // version arrived (serveArriving).
  SnapshotRelays relays_;
  uint64_t round_ = 0;
  std::map<std::string, std::pair<uint64_t, TimePoint>> first_heard_;  // name → version, when
  std::function<void()> sync_done_;
  int announcing_ = 0;                  // announcement threads running
  std::deque<std::string> hash_queue_;  // completed files waiting to be hashed and announced
  bool hashing_ = false;
  int unopened_files_ = 0;  // completed files that could not be opened (firstFew)
  // Announcements a node did not take, to tell it again (announce).
  struct Unannounced {
    SnapshotVersion version;
    std::string source;
    std::string origin;
    std::string peer;
    uint64_t round = 0;
  };
  std::vector<Unannounced> unannounced_;
  // Nodes that did not answer an announcement and have not answered one since (this round).
  std::set<std::string> unanswering_;
  std::unique_ptr<boost::asio::steady_timer> announce_timer_;
  bool announce_timer_armed_ = false;
  uint64_t sync_generation_ = 0;
  SnapshotMetrics metrics_;
  // The fetches under way: name → source, and what ends it (the agent stopping, or its source
  // not a node of the next round: a source that stopped answering would hold the round's sync
  // until the fetch's deadline).
  std::map<std::string, std::pair<std::string, std::shared_ptr<snapshot::FetchCancel>>> fetching_;
  std::map<uint64_t, std::thread> threads_;
  struct Work {
    std::function<void()> work;
    std::function<void()> then;
    Urgency urgency;
  };
  struct PoolSlots {
    size_t running = 0;        // threads of the pool running
    std::deque<Work> waiting;  // its work waiting for one
  };
  std::array<PoolSlots, 2> pools_;  // by Pool
  uint64_t next_thread_ = 0;
  std::shared_ptr<int> alive_ = std::make_shared<int>(0);
};

// The RendezvousClient the supervisor sees when --snapshot-dir is set on a multi-node job: every
// round comes from `inner`, and is handed on only after the replicator synced the directory.
class SnapshotSyncClient final : public RendezvousClient {
 public:
  SnapshotSyncClient(RendezvousClient& inner, RendezvousService& service,
                     SnapshotReplicator& replicator)
      : inner_(inner), service_(service), replicator_(replicator) {}
  void nextRound(RoundCallback done) override;
  void reportFailure() override { inner_.reportFailure(); }
  void leave() override { inner_.leave(); }
  // A node arrives at the exit barrier once what it writes is announced and what it was told
  // of is fetched; after a success it departs once the others stopped fetching from it (both
  // bounded), so the job's last snapshot reaches every node.
  void exitBarrier(Duration timeout, StatusCallback done) override;
  void shutdown(bool succeeded, bool left, std::function<void()> done) override;
  uint64_t currentRound() const override { return inner_.currentRound(); }

 private:
  RendezvousClient& inner_;
  RendezvousService& service_;
  SnapshotReplicator& replicator_;
};

}  // namespace ddprun::agent
