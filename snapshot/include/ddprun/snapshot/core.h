// ReplicationCore: the pure core of --snapshot-dir replication, one machine in the shape of
// RendezvousState. It holds the version table and what is wanted from whom (SnapshotReplica),
// pairs a rename's two events (RenamePairs), chooses who is told of a version (relayTargets,
// SnapshotRelays, stepping over nodes that do not answer), and decides what is installed,
// linked, copied, deleted or kept. Events go in (a file looked at, renamed or deleted here; a
// peer's announcement; a round's holdings; a fetch, link, install or deletion done; time), and
// actions come out through an outbox (look at a file, hold and serve a version, announce, fetch,
// link, install, delete, keep or drop a copy, cancel a fetch, hand a synced round on), in the
// order the shell is to carry them out. The shell (replicator.h) does every file operation, RPC
// and thread, and tells the core what came of each. No files, sockets, threads or sleeps here:
// time comes from the Clock, and nextDeadline() says when tick() is due.
//
// What a node does with a version (docs/architecture.md, "Snapshot replication"):
// - A file this node's workers completed is looked at (hashed) one at a time, in the order
//   completed, and gets its version (SnapshotReplica::onLocalWrite); from 64 MiB on it is
//   announced first and hashed while the others fetch it. A rename within the directory makes the
//   new name a version of the same inode without a hash; a deletion is a version too.
// - A new version is announced down a chain of the round's nodes that starts at its writer
//   (relayTargets); a node passes it on as soon as its own fetch starts, serving it as it arrives.
//   A node that does not take an announcement is stepped over and told again every second while
//   the round lasts.
// - What is newer elsewhere is fetched from a holder (a renamed version from this node's own file
//   of the old name: linked, else copied) and installed only if still newer; what failed is tried
//   from the next holder.
// - At a round's start every node publishes its holdings and learns every node's; the round is
//   handed on (SyncDone) once nothing wanted is left to fetch.
//
// Threading: not thread-safe; one owner (the replicator's loop, or a test). Lifetime: a value
// that outlives nothing it was given but the Clock.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "ddprun/common/clock.h"
#include "ddprun/common/log_throttle.h"
#include "ddprun/common/status.h"
#include "ddprun/snapshot/relays.h"
#include "ddprun/snapshot/rename_pairs.h"
#include "ddprun/snapshot/replica.h"
#include "ddprun/snapshot/version.h"

namespace ddprun::snapshot {

// Which file a name is: what the shell's stat says of it. A version held here is served from the
// inode it was announced with; the core compares these to tell this node's own files (a copy it
// installed, a file renamed) from new content.
struct FileId {
  uint64_t dev = 0;
  uint64_t ino = 0;
  int64_t mtime_ns = 0;
  uint64_t size = 0;
  bool sameInode(const FileId& o) const { return dev == o.dev && ino == o.ino; }
  // The same inode, unchanged since (its modification time).
  bool sameFile(const FileId& o) const { return sameInode(o) && mtime_ns == o.mtime_ns; }
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

struct CoreOptions {
  SnapshotReplicaOptions replica;
  // From this size on, a completed file is announced at once and hashed while the others fetch it
  // (its CRC-32 follows the last chunk of every stream); smaller ones are hashed first (under
  // 15 ms), which keeps their announcements self-contained.
  uint64_t announce_before_hash = uint64_t{64} << 20;
  // A node that did not take an announcement is told again this often while the round lasts.
  Duration announce_retry = std::chrono::seconds(1);
  // How long a file deleted here because another node renamed it is kept for the copy under its
  // new name, in case the deletion arrived first.
  Duration keep_renamed_for = std::chrono::seconds(10);
  // Announcements that came while a round's holdings were awaited: the newest this many wait.
  size_t max_unverified = 1024;
};

// ---- Actions: what the shell carries out, in the order given --------------------------------

// Look at the file `name` (open, stat, hash) off the loop, then onLooked(). `held`: the file this
// node holds as `name` (the same one: nothing to do); `renamed`: the file it holds under the name
// this one was renamed from (the same one: a rename, no hash). Files of `hash_below` bytes or more
// are not hashed (onLooked kLarge).
struct Look {
  std::string name;
  std::optional<FileId> held;
  std::optional<FileId> renamed;
  uint64_t hash_below = 0;
};
// Where the file of a version held now comes from.
enum class HoldFile {
  kOpened,   // the file the shell opened for this event (the look's, the start's scan)
  kNone,     // a deletion: nothing to serve
  kCrcKnown  // the file held already; its CRC-32 is known now (version.crc32)
};
// This node holds `version` of its name now, and serves it (a version still being hashed with a
// CRC-32 to follow, which the shell's Hash sets).
struct Hold {
  SnapshotVersion version;
  FileId id;
  HoldFile file = HoldFile::kOpened;
};
// Hash the file held as `name` at `version` (announced before its hash) off the loop, set its
// pending CRC-32 for the streams that wait for it, then onHashed().
struct Hash {
  std::string name;
  uint64_t version = 0;
};
// Tell each line of peers, in order, that `version` (written by `origin`) can be fetched from
// `source`: each line's first peer, then while one does not take it the next; then
// onAnnounced() with those that did not.
struct Announce {
  SnapshotVersion version;
  std::string source;
  std::string origin;
  std::vector<std::vector<std::string>> lines;
  uint64_t round = 0;
};
// An announcement to tell a peer again.
struct Unannounced {
  SnapshotVersion version;
  std::string source;
  std::string origin;
  std::string peer;
  uint64_t round = 0;
};
// Tell `peer` these again, in order, until one is not taken; then onAnnouncedAgain().
struct AnnounceAgain {
  std::string peer;
  std::vector<Unannounced> items;
};
// Fetch transfer.file from transfer.source into a temp file beside the name, checked; or, with
// `copy_from`, copy it from this node's own file (the name's held file, or with `from_kept` the
// copy kept under that name), fetching it from the source if the copy fails. `serve_arriving`:
// serve it on as it arrives. `prompt`: a round's sync waits for it (the workers are stopped).
// Then onFetched().
struct Fetch {
  SnapshotTransfer transfer;
  std::string copy_from;
  bool from_kept = false;
  bool serve_arriving = false;
  bool prompt = false;
};
// Link the file at `from` (a name held, or a kept copy's hidden name; relative to the directory)
// to a temp file beside transfer.file's name, if it is still the file `expect` (no copy, no
// space); then onLinked().
struct Link {
  SnapshotTransfer transfer;
  std::string from;
  FileId expect;
};
// Rename the checked copy at `temp` over transfer.file's name and serve it (what was held stays
// held and served if the rename fails); then onInstalled(). `taken`: how it came, for the log.
struct Install {
  SnapshotTransfer transfer;
  std::string temp;
  std::string taken;
};
// Remove a temp file that is not installed.
struct Discard {
  std::string temp;
};
// Delete this node's copy of transfer.file's name (a deletion another node made), holding the
// tombstone; with `set_aside`, rename it aside to a hidden name instead and keep it (open, and
// there when the rename worked) for the new name it was renamed to. Then onDeleted().
struct Delete {
  SnapshotTransfer transfer;
  bool set_aside = false;
};
// Let go of the copy kept under `name` (its hidden file removed).
struct DropKept {
  std::string name;
};
// End the fetch of `name` now, with `why`.
struct CancelFetch {
  std::string name;
  Status why;
};
// The version table's text, to write when it changed.
struct RecordTable {
  std::string text;
};
// The round of sync `generation` is in sync: hand it on.
struct SyncDone {
  uint64_t generation = 0;
};

using Action = std::variant<Look, Hold, Hash, Announce, AnnounceAgain, Fetch, Link, Install,
                            Discard, Delete, DropKept, CancelFetch, RecordTable, SyncDone>;

// ---- Events: what the shell tells the core ---------------------------------------------------

// A file found when the agent started (regular, its content hashed).
struct Existing {
  std::string name;
  uint64_t size = 0;
  uint32_t crc32 = 0;
  FileId id;
};
// What a Look found.
struct Looked {
  enum class Kind {
    kGone,        // no file of that name (deleted, or renamed away)
    kUnopened,    // it cannot be opened (`why`; not for a missing file)
    kNotAFile,    // not a regular file
    kSame,        // the file held already (Look::held)
    kRenamed,     // the file held under the name it was renamed from (Look::renamed)
    kLarge,       // not hashed (Look::hash_below): announced first, hashed after (Hash)
    kHashed,      // hashed: size and crc32
    kUnreadable,  // opened, but reading it failed (`why`)
  };
  Kind kind = Kind::kGone;
  FileId id;
  uint64_t size = 0;
  uint32_t crc32 = 0;
  std::string why;
};
// A Fetch's end: `status`, and for a copy that arrived, its verified CRC-32 and temp file.
struct Fetched {
  SnapshotTransfer transfer;
  Status status;
  uint32_t crc32 = 0;
  std::string temp;
  bool copied = false;  // copied from this node's own file (Fetch::copy_from)
};
// A Link's end: the temp file linked, or empty when it could not be.
struct Linked {
  SnapshotTransfer transfer;
  std::string temp;
};
// An Install's end.
struct Installed {
  SnapshotTransfer transfer;
  std::string taken;
  Status status;
  FileId id;  // of the file now held, when status is OK
};
// A Delete's end: where the file was set aside ("" when it was removed, or kept open only).
struct Deleted {
  SnapshotTransfer transfer;
  Status status;
  bool kept = false;  // set aside (or kept open) for its new name
  std::string aside;
};
// An Announce's end: the peers that did not take it (why, and whether the next node of their
// line was told instead).
struct Announced {
  Announce announce;
  struct Failure {
    std::string peer;
    std::string why;
    bool stepped = false;
  };
  std::vector<Failure> failed;
};

class ReplicationCore {
 public:
  ReplicationCore(CoreOptions options, const Clock& clock);

  // ---- Start: the directory as the agent found it.
  // `table`: the version table the directory held (decodeVersionTable; empty when none), and
  // `existing` every replicated regular file there. Each is held at the version the table
  // recorded for that content (version 0 otherwise); deletions the table recorded of files still
  // absent stay deletions.
  void start(const std::map<std::string, SnapshotVersion>& table,
             const std::vector<Existing>& existing);
  // Where this node serves (HOST:PORT): the source it announces.
  void setEndpoint(std::string endpoint) { endpoint_ = std::move(endpoint); }

  // ---- Local changes (the directory watcher's events).
  // Something happened to `name` (completed, deleted, or found in a directory that appeared):
  // it is looked at, after what waits already.
  void onChanged(const std::string& name);
  // `name` was renamed away (IN_MOVED_FROM with `cookie`): a rename within the directory if its
  // IN_MOVED_TO follows, else gone (settled()).
  void onMovedFrom(uint32_t cookie, const std::string& name, bool dir);
  // `name` appeared by a rename (`cookie`; 0: from outside) or was made (a directory, with the
  // files found in it, `files`). A rename paired with its IN_MOVED_FROM names the files' old
  // names: those held as the same inode are versions without a hash.
  void onMovedTo(uint32_t cookie, const std::string& name, bool dir,
                 const std::vector<std::string>& files);
  // The directory `name` is gone (deleted, or renamed away and not back): what was held below it
  // is looked at again (their deletions are versions).
  void onDirGone(const std::string& name);
  // Events were lost: `files` (every file there) and everything held are looked at again.
  void onRescan(const std::vector<std::string>& files);
  // No more events are queued to be read: names renamed away whose IN_MOVED_TO did not come
  // within kRenamePairWait are gone.
  void settled();
  void onLooked(const std::string& name, const Looked& looked);
  void onHashed(const std::string& name, uint64_t version, const StatusOr<uint32_t>& crc32);

  // ---- Peers.
  // Another node announced `v`, held at `source` and written by `origin`.
  void onAnnounce(const SnapshotVersion& v, const std::string& source, const std::string& origin);
  void onAnnounced(const Announced& done);
  // `told` of the AnnounceAgain's items were taken, in order.
  void onAnnouncedAgain(const AnnounceAgain& again, size_t told);

  // ---- Rounds. A round's sync: beginRound(), the shell waits for versioned() (bounded), then
  // publishes holdings() and reads every node's: onHoldingsNotPublished() when the first fails,
  // else onHoldings(); the core fetches what is newer and says SyncDone.
  // The round's replicating nodes are counted in group-rank order, the nodes that run without
  // --snapshot-dir left out: `index` is this node's place among them (its group rank when every
  // node replicates). Returns the sync's generation (a previous sync still open is handed on as
  // it is).
  uint64_t beginRound(uint64_t round, int index);
  uint64_t generation() const { return generation_; }
  uint64_t roundNumber() const { return round_.number; }
  // What this node publishes for the round.
  std::string holdings() const;
  void onHoldingsNotPublished(uint64_t generation, const Status& why);
  // Every replicating node's holdings, by index (or why none could be read).
  void onHoldings(uint64_t generation, const StatusOr<std::vector<std::string>>& values);
  // Not every node's holdings came within the shell's bound: those that did, by index (nothing
  // for a node whose did not). The round starts with the nodes that published theirs; the others
  // are not announced to, and their announcements wait (a few, the newest kept), until
  // onLateHoldings takes them in.
  void onSomeHoldings(uint64_t generation, const std::vector<std::optional<std::string>>& values);
  // The holdings of node `index`, missing from onSomeHoldings, came: it is a node of the round
  // from now on, and is told what this node holds of the round that its holdings lack (it read
  // the others' holdings as they were at the round's start).
  void onLateHoldings(uint64_t generation, size_t index, const std::string& value);

  // ---- Transfers.
  void onFetched(const Fetched& done);
  void onLinked(const Linked& done);
  void onInstalled(const Installed& done);
  void onDeleted(const Deleted& done);

  // ---- Time.
  // Copies kept past their time are let go; announcements are told again when due.
  void tick();
  std::optional<TimePoint> nextDeadline() const;

  // The actions to carry out, in order (the shell drains after every event it gave).
  std::vector<Action> drain();

  // What the workers wrote has its version: nothing is being looked at or waits to be, and no
  // name renamed away is waiting for its pair (the shell adds: no event left unread).
  bool versioned() const;
  // And nothing is being fetched or announced here.
  bool replicated() const;
  const SnapshotMetrics& metrics() const { return metrics_; }
  const SnapshotReplica& replica() const { return replica_; }
  const std::string& endpoint() const { return endpoint_; }

 private:
  // The look at one file that runs (one at a time, in the order completed).
  struct Looking {
    std::deque<std::string> queue;
    bool running = false;
    std::string name;
    std::string from;  // the name it was renamed from, when Look::renamed was given
    uint64_t from_version = 0;
    std::string moved_to;  // its new name, when it was renamed away (onRenamed)
  };
  // Renames within the directory: names renamed in, to their old names (taken when looked at),
  // and names renamed away, to their new names (for their deletion's hint).
  struct Renames {
    RenamePairs pairs{kRenamePairWait};
    std::map<std::string, std::string> from;
    std::map<std::string, std::string> to;
  };
  // A file deleted here because another node renamed it, kept for its new name.
  struct Kept {
    SnapshotVersion version;
    FileId id;
    TimePoint until;
    std::string aside;  // relative to the directory; empty: kept open only (copied)
  };
  // The round as far as it is known: its replicating nodes' endpoints, in group-rank order, once
  // their holdings came.
  struct Round {
    uint64_t number = 0;
    int rank = -1;  // this node's index among them (beginRound)
    std::vector<std::string> nodes;
    int self = -1;  // `rank`, once `nodes` is the round's
    bool nodes_known = false;
    struct Unverified {
      SnapshotVersion version;
      std::string source;
      std::string origin;
    };
    std::deque<Unverified> unverified;  // announcements that came before its nodes were known
    std::set<size_t> missing;           // nodes whose holdings did not come (onSomeHoldings)
    bool holdings_in = false;           // its holdings came (or will not): once a round
    bool syncing = false;               // and SyncDone is due once nothing is wanted
  };
  struct Announcing {
    std::vector<Unannounced> again;     // to tell again, one per node and name
    std::set<std::string> unanswering;  // nodes that did not answer (this round)
    std::optional<TimePoint> retry_at;
    int in_flight = 0;
  };
  struct Running {  // a fetch, copy or link under way
    std::string source;
    TimePoint started;
    bool cancelled = false;
  };
  // Warnings a peer or the file system can cause over and over: throttled, or the first few.
  struct Warnings {
    LogThrottle ignored{std::chrono::seconds(60)};          // announcements from outside the round
    LogThrottle names{std::chrono::seconds(60)};            // names refused past the bounds
    LogThrottle fetch{std::chrono::seconds(60), 1024, 20};  // fetch failures, by source
    LogThrottle gave_up{std::chrono::seconds(60), 1024, 20};  // versions given up, by source
    int unopened = 0;
    int impossible_versions = 0;
  };

  // core_local.cc
  void look(const std::string& name);
  void lookAgainAtHeld(const std::string& prefix);
  void lookNext();
  // This node holds that very file (same inode and mtime) as its current version of `name`.
  bool holdsAlready(const std::string& name, const FileId& id) const;
  void largeLooked(const std::string& name, const Looked& looked);
  void renamedLooked(const std::string& name, const Looked& looked);
  void hashedLooked(const std::string& name, const Looked& looked);
  void deletedHere(const std::string& name, const std::string& moved_to);
  // A version written here: held and served, announced down the chain (the log line ends with
  // `note`).
  void publishWritten(const SnapshotVersion& v, const FileId& id, HoldFile file,
                      const std::string& note);
  // core_peers.cc
  void announce(const SnapshotVersion& v, const std::string& source, const std::string& origin,
                const std::vector<int>& ranks);
  void keepToTellAgain(Unannounced u);
  void tellAgainLater();
  void tellAgain();
  void relay(const SnapshotVersion& v, const std::string& source);
  std::vector<int> subtree(const SnapshotVersion& v, std::string* origin) const;
  std::vector<int> chainAfter(const std::string& origin) const;
  int rankOf(const std::string& endpoint) const;
  bool tookHolder(const SnapshotVersion& v, const std::string& source);
  void heardOf(const SnapshotVersion& v);
  void learnHoldings(const std::vector<std::optional<std::string>>& values);
  // Node `index`'s holdings (decoded): its endpoint, and what it holds that is newer here.
  void learnHoldingsOf(size_t index,
                       const std::pair<std::string, std::vector<SnapshotVersion>>& holdings);
  // Node `index`, whose holdings (`held`) came late, is told what it lacks of the round.
  void tellLateNode(size_t index, const std::vector<SnapshotVersion>& held);
  // Announcements from an unknown source wait while some node's holdings are missing.
  bool keepUnverified(const SnapshotVersion& v, const std::string& source,
                      const std::string& origin);
  void replayUnverified();
  void dropGoneSources();
  void nodesKnown();
  void finishSync(uint64_t generation);
  // core_transfers.cc
  void pump();
  void startTransfer(const SnapshotTransfer& t, bool prompt);
  void applyDeletion(const SnapshotTransfer& t);
  // The name (and whether a kept copy) whose file `v` is a renamed copy of, if this node has it.
  std::optional<std::pair<std::string, bool>> localCopyOf(const SnapshotVersion& v) const;
  // Where a Link of `v` would take its file from, if it can (a held file, or a kept copy set
  // aside), and which file that is.
  std::optional<std::pair<std::string, FileId>> linkSource(const SnapshotVersion& v) const;
  // A copy of `t` is in `temp` (`taken`: how, when not fetched): installed if still newer.
  void arrived(const SnapshotTransfer& t, const std::string& temp, const std::string& taken);
  // Whether the file held as `name`, deleted because another node renamed it to `moved_to`, is
  // worth keeping a while for its new name: not when it was linked there already.
  bool worthKeeping(const std::string& moved_to, const std::string& name) const;
  void keepForCopy(const std::string& name, std::string aside);
  void dropKept(const std::string& name);
  // The transfer `t` ended with `st` (a copy installed: `taken` says how it came).
  void transferDone(const SnapshotTransfer& t, const Status& st, const std::string& taken);
  void logFailure(const SnapshotTransfer& t, const Status& st);
  void maybeFinishSync();
  // core.cc
  // Records that this node holds `v` (and serves it), for the table and the metrics.
  void hold(const SnapshotVersion& v, const FileId& id, HoldFile file);
  // The version table as what is held now says (one per batch of actions).
  void recordTable();
  void emit(Action a) { outbox_.push_back(std::move(a)); }

  CoreOptions options_;
  const Clock& clock_;
  SnapshotReplica replica_;
  SnapshotRelays relays_;
  std::string endpoint_;
  // Names held with a file (not deletions), and which file.
  std::map<std::string, FileId> files_;
  std::map<std::string, Kept> kept_;
  Looking looking_;
  Renames renames_;
  Round round_;
  uint64_t generation_ = 0;
  Announcing announcing_;
  std::map<std::string, Running> running_;
  std::map<std::string, std::pair<uint64_t, TimePoint>> first_heard_;  // name → version, when
  SnapshotMetrics metrics_;
  Warnings warnings_;
  bool recording_ = false;  // the version table is kept (after start())
  std::vector<Action> outbox_;
};

}  // namespace ddprun::snapshot
