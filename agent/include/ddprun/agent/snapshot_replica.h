// SnapshotReplica: the pure core of --snapshot-dir replication (issue 11). For one node it keeps
// the version table (which complete version of each file this node holds), gives a file this
// node's workers completed its job-wide version, learns which nodes hold which versions, and
// decides which transfers to run, from which holder, and what happens when one fails. No I/O, no
// time, no gRPC: the agent's shell (agent/src/snapshot_replicator.h) watches the directory, runs
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
//   retryGivenUp() (the shell calls it at each round's start) or when a newer one appears.
//
// Threading: none (the agent's loop thread). Lifetime: a plain value.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "ddprun/common/status.h"

namespace ddprun::agent {

struct SnapshotVersion {
  std::string name;
  uint64_t version = 0;
  uint64_t size = 0;
  uint32_t crc32 = 0;
  // Announced by its writer while the hash ran: crc32 is unknown (0), a fetch learns it from the
  // source.
  bool crc_pending = false;
  // This version deletes the file (a tombstone: size and crc32 are 0). Held like any version, so
  // that older versions of the name are not fetched back; applied by deleting the file.
  bool deleted = false;
  // A hint that travels with an announcement, not part of the version (neither compared nor
  // recorded): its writer renamed `moved_from`, held there at `moved_from_version`, to this name.
  // A node holding that version may copy its own file instead of fetching (the copy is checked
  // against crc32 as a fetch is).
  std::string moved_from{};
  uint64_t moved_from_version = 0;
  // On a deletion, the same hint the other way: the file was renamed to `moved_to`.
  std::string moved_to{};
  bool operator==(const SnapshotVersion& o) const {
    return name == o.name && version == o.version && size == o.size && crc32 == o.crc32 &&
           crc_pending == o.crc_pending && deleted == o.deleted;
  }
  // The same version, as far as both know: equal, or one of them without its CRC-32 yet.
  bool sameContent(const SnapshotVersion& o) const {
    return name == o.name && version == o.version && size == o.size && deleted == o.deleted &&
           (crc_pending || o.crc_pending || crc32 == o.crc32);
  }
  // Whether this version is to replace `o`, a version of the same name: a higher number; at the
  // same number (two nodes wrote the name in one round, each numbering above the same last
  // version), the greater content, so that every node ends with the same bytes: a file over a
  // tombstone, then the larger size, then the larger CRC-32. Content still being hashed decides
  // nothing until its CRC-32 is known (the next round's holdings carry it), and neither does that
  // of version 0 (files no agent recorded: which is newer is unknown, so each node keeps its own).
  bool supersedes(const SnapshotVersion& o) const {
    if (version != o.version) return version > o.version;
    if (version == 0 || crc_pending || o.crc_pending) return false;
    return std::make_tuple(!deleted, size, crc32) > std::make_tuple(!o.deleted, o.size, o.crc32);
  }
};

inline uint64_t makeSnapshotVersion(uint64_t round, uint32_t sequence) {
  return (round << 32) | sequence;
}

// A version of a round below 2^31, which every job stays in. The version table records no other,
// and a peer's other is refused (holdings, announcements): this node numbers its own writes above
// every version seen, and would otherwise wrap round to numbers older than what it holds.
inline bool isPossibleVersion(uint64_t version) { return (version >> 32) < (uint64_t{1} << 31); }

// A name the replicator handles: a file's path relative to the snapshot directory ("snapshot.pt",
// "checkpoint-500/optimizer.pt", "step_100/.metadata"), at most kMaxReplicatedName bytes, whose
// every '/'-separated part is replicated (isReplicatedPart).
inline constexpr size_t kMaxReplicatedName = 1024;
bool isReplicatedName(const std::string& name);
// One part of such a path: a file or directory name of at most 255 bytes, not "." or "..", without
// control characters, not a temp file (containing ".tmp", as the SDK's and PyTorch's writers name
// theirs before the rename, and as torch.distributed.checkpoint writes ".metadata.tmp"), not the
// agent's own (starting with ".ddprun"). Other hidden names are replicated (".metadata").
// `top`: the part names something directly in the snapshot directory, where "lost+found" (the
// directory is a file system's root) is not replicated either.
bool isReplicatedPart(std::string_view part, bool top);

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
  int self_index = 0;            // this node's group rank: spreads first tries over the holders
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
  // This node's group rank in the current round (spreads first tries over the holders).
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

// Who tells whom about a new version: the nodes of the round form a chain that starts at the
// writer `origin` (indices are group ranks), each node telling the next one once its own fetch
// of the version starts. Every node serves what it fetches as it arrives (a pipelined relay), so
// every node's uplink carries one copy, the writer's too, and the last node holds the version
// about one copy's time plus a few chunks per node after the first: between hosts on 1 Gbit/s
// links, a binomial tree (the writer sending log2(nodes) copies) took 2x one copy with 4 nodes,
// the chain 1.1-1.2x. Every node but the writer is told exactly once. Returns group ranks.
std::vector<int> relayTargets(int origin, int self, int nodes);

// The announcements a node was told and passes on down the chain they came by (relayTargets from
// their origin), kept by content. Two nodes that wrote a name in one round may announce the same
// number with other bytes, each down a chain of its own: each is passed on along its own chain,
// so that the greater content reaches every node (the lesser one's chain ends at the first node
// that holds the greater). Kept by number alone, a node told of both passed the greater on along
// the lesser's chain, which ends one node earlier where the greater's does not: that node was
// never told of it and kept other bytes until the next round's sync.
// Threading: none (the agent's loop thread). Lifetime: a plain value.
class SnapshotRelays {
 public:
  // This node was told of `v` by the chain `origin` (an endpoint) starts. Older versions of the
  // name are forgotten, and `v` is ignored when a newer one was told. The same content told again
  // keeps the chain it came by first, and is to be passed on again if it was passed on as it
  // arrived (passedEarly: a retry of its fetch serves it again).
  void told(const SnapshotVersion& v, const std::string& origin);
  // The origin of the chain that told this node of `v`, passed on or not; nullopt when it was
  // not told (or passed on once its copy was complete).
  std::optional<std::string> origin(const SnapshotVersion& v) const;
  // `v` is passed on now: its origin when it is still to be passed on, else nullopt (each content
  // is passed on once). `early`: passed on as it arrives (its fetch started), and remembered.
  std::optional<std::string> pass(const SnapshotVersion& v, bool early);
  // `v` was passed on as it arrived: a failure of its fetch is the subtree's too.
  bool passedEarly(const SnapshotVersion& v) const;
  // Forgets what was told of every name `keep` says no to (a round's start: names no longer
  // wanted are not passed on, and a peer's many names do not stay here).
  void forgetUnless(const std::function<bool(const std::string&)>& keep);
  size_t size() const { return told_.size(); }

 private:
  struct Told {
    SnapshotVersion version;
    std::string origin;
    bool early = false;  // passed on as it arrived; else still to be passed on
  };
  // Where `v`'s content is in told_[v.name], if it was told.
  std::optional<size_t> indexOf(const SnapshotVersion& v) const;
  std::map<std::string, std::vector<Told>> told_;  // by name: the newest number's contents
};

// The holdings a node publishes for a round (in the rendezvous' key-value store): its
// replication endpoint and what it holds. decodeHoldings refuses malformed text (INVALID_ARGUMENT).
std::string encodeHoldings(const std::string& endpoint, const std::vector<SnapshotVersion>& held);
StatusOr<std::pair<std::string, std::vector<SnapshotVersion>>> decodeHoldings(
    const std::string& text);

// The version table an agent keeps in its directory (.ddprun-versions), so that what it held
// keeps its version when the agent starts again (a job restarted as a whole, a Slurm requeue):
// otherwise every node's file would be version 0 and nodes that held different versions would
// keep them. Only versions with a known CRC-32 are recorded (a version 0 has nothing to keep);
// deletions are (their tombstones keep a deleted file from being fetched back).
// decodeVersionTable refuses a table that is not one (INVALID_ARGUMENT naming the line); a
// version from round 2^31 on is refused too (no job gets there; the numbers above it must stay).
std::string encodeVersionTable(const std::vector<SnapshotVersion>& held);
StatusOr<std::map<std::string, SnapshotVersion>> decodeVersionTable(const std::string& text);
// The version `table` recorded for `name` when the file still has that content (size and CRC-32
// equal); 0 otherwise (changed since, never recorded, or recorded as deleted).
uint64_t recordedVersion(const std::map<std::string, SnapshotVersion>& table,
                         const std::string& name, uint64_t size, uint32_t crc32);

}  // namespace ddprun::agent
