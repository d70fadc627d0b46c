// SnapshotVersion: one version of one file of a replicated --snapshot-dir (issue 11), what makes
// a name replicated, and the two texts versions travel and rest in: the holdings a node publishes
// for a round and the version table it keeps in its directory. Pure values and functions.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "ddprun/common/status.h"

namespace ddprun::snapshot {

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

// A version for people: "<round>.<sequence>".
std::string versionText(uint64_t version);

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

// The holdings a node publishes for a round (in the rendezvous' key-value store): its
// replication endpoint and what it holds, a line each. From 1 KiB of text they are deflated
// ("ddprun-holdings-z1 <size>\n" and the text deflated: file lists shrink ~5-10x, and every node's
// holdings of a round share the run's quota); an agent from before that reads such holdings as
// malformed. decodeHoldings refuses malformed text (INVALID_ARGUMENT), deflated text that states
// more than kMaxHoldingsBytes before anything is allocated, and more than kMaxHeldVersions lines.
// (A value is at most 1 MiB in the rendezvous, 1.5 MiB in etcd: ~7x that deflated, ~100 thousand
// files.)
inline constexpr uint64_t kMaxHoldingsBytes = uint64_t{16} << 20;
inline constexpr size_t kMaxHeldVersions = size_t{1} << 19;
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

}  // namespace ddprun::snapshot
