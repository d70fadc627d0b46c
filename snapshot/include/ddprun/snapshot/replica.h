// SnapshotReplica: the pure core of --snapshot-dir replication (issue 11). For one node it keeps
// the version table (which complete version of each file this node holds), gives a file this
// node's workers completed its job-wide version, learns which nodes hold which versions, and
// decides which transfers to run, from which holder, and what happens when one fails. No I/O, no
// time, no gRPC: the shell (replicator.h) watches the directory, runs
// the transfers and renames copies into place, and tells this core what happened.
//
// The rules:
// - A version number is (round << 32) | sequence: rounds are agreed through the rendezvous and
//   only increase, so a version written in a later round is newer than any of an earlier one;
//   within a round a node numbers its writes above every version it has seen. The highest
//   version of a name wins; two nodes that wrote a name in the same round may pick the same
//   number, and then the greater content wins (SnapshotVersion::supersedes), so that they do
//   not keep different bytes under one version. A file present when the agent starts keeps the
//   version the directory's version table (encodeVersionTable) recorded for that very content; any
//   other has version 0 (unknown, older than every version written).
// - A file deleted here gets a version too (a tombstone, numbered as a write): a node holding an
//   older version deletes its copy, and older versions are not fetched back. Only the newest
//   `max_tombstones` deletions are kept (a job that writes a new name every epoch and deletes
//   the old ones would otherwise grow its holdings and version table without end); an older
//   deletion is forgotten, and a peer's announcement of it is ignored unless this node still
//   holds a copy it would delete. What that gives up: a node away through more than
//   `max_tombstones` deletions may bring back a file deleted while it was away.
// - What a node holds is only ever replaced by a newer complete, verified copy: the previous
//   version stays in place until then, and a transfer that fails changes nothing.
// - A failed transfer is retried from the next holder, up to `max_attempts`; no space for it
//   (RESOURCE_EXHAUSTED) is not retried. A version given up is tried again only after
//   retryGivenUp() (the shell calls it at each round's start) or when a newer one appears;
//   one given up after its holders failed it gets one more attempt from each holder of it
//   announced later (a relay whose own fetch failed names the node it fetched from, and its
//   subtree may have spent its attempts on the relay's failure before that news came).
//
// Threading: none (the agent's loop thread). Lifetime: a plain value.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "ddprun/snapshot/version.h"

namespace ddprun::snapshot {

// One transfer the shell should run now.
struct SnapshotTransfer {
  SnapshotVersion file;
  std::string source;  // HOST:PORT of a holder
  int attempt = 1;     // 1 for the first try of this version
};

// kRefused: this node will not apply it (a path through a symlink): given up, as kNoSpace.
enum class TransferOutcome { kOk, kCorrupt, kNoSpace, kFailed, kCancelled, kRefused };

struct SnapshotReplicaOptions {
  int max_attempts = 4;          // per version, over all its holders
  int self_index = 0;            // this node's index in the round: spreads first tries over holders
  size_t max_tombstones = 1024;  // deletions kept, the newest ones
  // Names heard of and not held (waiting to be fetched): at most this many per holder, and in all
  // (--snapshot-limits names_per_peer, names). A peer that announces names without end costs a
  // bounded amount of memory; past the bound its new names are refused (onHolder).
  size_t max_names_per_holder = 65536;
  size_t max_pending_names = 131072;
};

// What onHolder made of what it was told.
enum class HolderNews {
  kTaken,              // wanted, or another holder of what is wanted
  kIgnored,            // not newer than what is held (or a name that is not replicated)
  kTooManyFromHolder,  // a new name, and the holder has max_names_per_holder waiting here
  kTooManyNames,       // a new name, and max_pending_names names wait here
};

class SnapshotReplica {
 public:
  explicit SnapshotReplica(SnapshotReplicaOptions options = {});

  // A file this node already had when the agent started: `version` is what the version table
  // recorded for this content (recordedVersion), 0 when nothing. Versions written here later
  // number above it.
  void adoptExisting(const std::string& name, uint64_t size, uint32_t crc32, uint64_t version = 0);
  // A deletion the version table recorded, of a file that is still absent.
  void adoptDeleted(const std::string& name, uint64_t version);
  // This node's workers completed `name` with this content during `round`: it is held now and
  // the returned version is what to announce. Transfers of older versions of it are dropped.
  SnapshotVersion onLocalWrite(const std::string& name, uint64_t size, uint32_t crc32,
                               uint64_t round);
  // The same before the hash is known (a large file is announced while it is hashed); the
  // CRC-32 follows with onCrcKnown().
  SnapshotVersion onLocalWritePending(const std::string& name, uint64_t size, uint64_t round);
  // This node's workers renamed `from` to `name` during `round`: the file `name` is the very file
  // held as `from` at `from_version` (the shell checked its inode), so it needs no hash. Returns
  // the version to announce, with the rename as its hint (moved_from); nullopt when `from` is not
  // held at that version (a newer copy was installed meanwhile) with a known CRC-32 (then the
  // file is hashed as any other). The deletion of `from` is onLocalDelete's.
  std::optional<SnapshotVersion> onLocalRename(const std::string& name, const std::string& from,
                                               uint64_t from_version, uint64_t round);
  // This node's workers deleted `name` during `round`: the returned tombstone is what to announce;
  // nullopt when nothing of it was held (or its deletion already was).
  std::optional<SnapshotVersion> onLocalDelete(const std::string& name, uint64_t round);
  // The CRC-32 of the held `version` of `name` is known now (hashed here, or verified by a fetch).
  // Nothing happens when another version is held by then.
  void onCrcKnown(const std::string& name, uint64_t version, uint32_t crc32);
  // `source` holds `v`. A version not newer than the one held is ignored, and a name new here is
  // refused past the bounds (max_names_per_holder, max_pending_names).
  HolderNews onHolder(const SnapshotVersion& v, const std::string& source);
  // The transfers to start now: at most one per name, none for a name with one running. One of a
  // tombstone (file.deleted) fetches nothing: the shell deletes its copy.
  std::vector<SnapshotTransfer> takeTransfers();
  // Whether a complete verified copy of `v` may replace what is held (checked just before the
  // rename: a newer version may have arrived meanwhile).
  bool shouldInstall(const SnapshotVersion& v) const;
  // A transfer started by takeTransfers() ended; kOk means its copy was renamed into place (or
  // shouldInstall said no).
  void onTransferDone(const SnapshotTransfer& t, TransferOutcome outcome);
  // Versions given up become wanted again (their holders are asked once more).
  void retryGivenUp();
  // A new round's nodes serve at `live`: holders elsewhere (nodes gone, or stopped and left out of
  // the round) are not asked again, and a version that no live node holds is wanted no more
  // (what is held stays): the newest version that a live node was heard to hold (onHolder) and
  // that is newer than the one held is wanted instead. A transfer from a gone holder that still
  // runs fails on its own (the shell ends it) and is retried from a live one.
  void keepSources(const std::vector<std::string>& live);
  // This node's index among the current round's replicating nodes, in group-rank order (spreads
  // first tries over the holders).
  void setSelfIndex(int index) { options_.self_index = index; }

  // Something is wanted and not given up, or a transfer runs.
  bool busy() const;
  const std::map<std::string, SnapshotVersion>& held() const { return held_; }
  std::vector<SnapshotVersion> heldList() const;
  std::optional<SnapshotVersion> held(const std::string& name) const;
  // The version `name` is wanted at, if any (not given up).
  std::optional<uint64_t> wanted(const std::string& name) const;
  uint64_t maxVersionSeen() const { return max_seen_; }
  // The newest deletion forgotten (max_tombstones), 0 when none was.
  uint64_t forgottenDeletions() const { return forgotten_; }
  // Names heard of and not held, in all and from `holder` (what the bounds count).
  size_t pendingNames() const { return heard_.size(); }
  size_t namesFrom(const std::string& holder) const;

 private:
  struct Want {
    SnapshotVersion target;
    std::vector<std::string> sources;
    size_t next_source = 0;
    int attempts = 0;
    bool running = false;
    bool given_up = false;
    bool failed_out = false;  // given up after max_attempts failures (not for want of space)
  };
  bool newerThanHeld(const SnapshotVersion& v) const;
  // Newer than held, and not a deletion that was forgotten (max_tombstones) of a name not held.
  bool worthFetching(const SnapshotVersion& v) const;
  // Forgets what was heard of `name` that is not worth fetching (any more), and what holders not
  // in `live` hold (unless null).
  void pruneHeard(const std::string& name, const std::vector<std::string>* live = nullptr);
  // `w` (of `name`) has no holder left: wants instead the newest version, newer than the one held,
  // that a holder still heard of holds (keeping w.running). False when there is none.
  bool fallBack(const std::string& name, Want& w);
  // Forgets the oldest deletions beyond max_tombstones.
  void trimTombstones();

  SnapshotReplicaOptions options_;
  std::map<std::string, SnapshotVersion> held_;
  std::map<std::string, Want> wants_;
  // Per name, the newest version each holder was heard to hold (onHolder), while newer than the
  // one held here: what a want whose holders are gone falls back to (keepSources).
  std::map<std::string, std::map<std::string, SnapshotVersion>> heard_;
  std::map<std::string, size_t> heard_by_holder_;  // entries of heard_ per holder
  uint64_t max_seen_ = 0;
  uint64_t forgotten_ = 0;
};

}  // namespace ddprun::snapshot
