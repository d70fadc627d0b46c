// ReplicationCore: what this node's workers do in the directory (core.h). Files completed,
// renamed or deleted are looked at one at a time, in the order they came, so that versions follow
// the order of the writes.
#include <algorithm>

#include "ddprun/common/strings.h"
#include "ddprun/snapshot/core.h"
#include "log.h"

namespace ddprun::snapshot {

void ReplicationCore::onChanged(const std::string& name) { look(name); }

void ReplicationCore::onMovedFrom(uint32_t cookie, const std::string& name, bool dir) {
  renames_.pairs.movedFrom(cookie, RenamePairs::Away{name, dir}, clock_.now());
}

void ReplicationCore::onMovedTo(uint32_t cookie, const std::string& name, bool dir,
                                const std::vector<std::string>& files) {
  std::optional<RenamePairs::Away> from;
  if (cookie != 0) {
    from = renames_.pairs.movedTo(cookie);
    if (from && from->dir != dir) from.reset();  // cannot be; treated as unrelated
  }
  if (dir) {
    for (const auto& file : files) {
      // The same file under its name before, if it was held: no hash, no fetch elsewhere.
      if (from && isReplicatedName(file) && startsWith(file, name + "/")) {
        renames_.from[file] = from->name + file.substr(name.size());
      }
      look(file);
    }
    if (from) lookAgainAtHeld(from->name + "/");  // their deletions, after the new names
    return;
  }
  if (from && isReplicatedName(name)) renames_.from[name] = from->name;
  look(name);
  if (from) look(from->name);  // its deletion, after the new name
}

void ReplicationCore::onDirGone(const std::string& name) { lookAgainAtHeld(name + "/"); }

void ReplicationCore::onRescan(const std::vector<std::string>& files) {
  for (const auto& name : files) look(name);
  lookAgainAtHeld("");
}

void ReplicationCore::settled() {
  for (const auto& r : renames_.pairs.gone(clock_.now())) {
    if (r.dir) {
      lookAgainAtHeld(r.name + "/");
    } else {
      look(r.name);
    }
  }
}

void ReplicationCore::look(const std::string& name) {
  if (!isReplicatedName(name)) return;  // the watcher warned of a name too long
  // Several events for one name while it waits: one look at the file (its latest content) is
  // enough.
  auto& queue = looking_.queue;
  if (std::find(queue.begin(), queue.end(), name) == queue.end()) queue.push_back(name);
  lookNext();
}

void ReplicationCore::lookAgainAtHeld(const std::string& prefix) {
  std::vector<std::string> names;
  for (const auto& [name, id] : files_) {
    if (startsWith(name, prefix)) names.push_back(name);
  }
  for (const auto& name : names) look(name);
}

// Its version is assigned when it has been looked at (small files: hashed too). A large file is
// announced before its hash is known and hashed while it is fetched; the next file waits for that
// hash.
void ReplicationCore::lookNext() {
  if (looking_.running || looking_.queue.empty()) return;
  Looking& l = looking_;
  l.running = true;
  l.name = l.queue.front();
  l.queue.pop_front();
  l.from.clear();
  l.from_version = 0;
  l.moved_to.clear();
  Look out;
  out.name = l.name;
  out.hash_below = options_.announce_before_hash;
  if (auto it = files_.find(l.name); it != files_.end()) out.held = it->second;
  // Renamed to another name: its deletion says so.
  if (auto r = renames_.to.find(l.name); r != renames_.to.end()) {
    l.moved_to = std::move(r->second);
    renames_.to.erase(r);
  }
  // Renamed from a name held with a known version and CRC-32: the same inode needs no hash.
  if (auto r = renames_.from.find(l.name); r != renames_.from.end()) {
    const std::string from = std::move(r->second);
    renames_.from.erase(r);
    auto held = replica_.held(from);
    auto id = files_.find(from);
    if (held && id != files_.end() && !held->deleted && !held->crc_pending && held->version != 0) {
      out.renamed = id->second;
      l.from = from;
      l.from_version = held->version;
    }
  }
  emit(std::move(out));
}

void ReplicationCore::onLooked(const std::string& name, const Looked& looked) {
  if (!looking_.running || name != looking_.name) return;  // not the look that runs
  switch (looked.kind) {
    case Looked::Kind::kLarge:
      return largeLooked(name, looked);  // looking on until its hash is in
    case Looked::Kind::kRenamed:
      renamedLooked(name, looked);
      break;
    case Looked::Kind::kGone:
      looking_.running = false;
      deletedHere(name, looking_.moved_to);
      break;
    case Looked::Kind::kUnopened:
      looking_.running = false;
      // Named for the first few files (past a descriptor limit, every later file fails too).
      if (auto more = firstFew(warnings_.unopened)) {
        snapLog()->warn("snapshot dir: {}; {} is not replicated{}", looked.why, name, *more);
      }
      break;
    default:
      looking_.running = false;
      hashedLooked(name, looked);
      break;
  }
  lookNext();
}

bool ReplicationCore::holdsAlready(const std::string& name, const FileId& id) const {
  auto it = files_.find(name);
  return it != files_.end() && it->second.sameFile(id);
}

void ReplicationCore::hashedLooked(const std::string& name, const Looked& looked) {
  if (looked.kind == Looked::Kind::kUnreadable) {
    snapLog()->warn("snapshot dir: cannot read {}: {}", name, looked.why);
    return;
  }
  // Not a regular file, or the very file held (e.g. a copy this node just renamed into place).
  if (looked.kind != Looked::Kind::kHashed) return;
  if (holdsAlready(name, looked.id)) return;  // installed here while it was being hashed
  SnapshotVersion v = replica_.onLocalWrite(name, looked.size, looked.crc32, round_.number);
  publishWritten(v, looked.id, HoldFile::kOpened, "");
}

void ReplicationCore::largeLooked(const std::string& name, const Looked& looked) {
  if (holdsAlready(name, looked.id)) {  // installed here while it was looked at
    looking_.running = false;
    lookNext();
    return;
  }
  const SnapshotVersion v = replica_.onLocalWritePending(name, looked.size, round_.number);
  publishWritten(v, looked.id, HoldFile::kOpened, " while it is hashed");
  emit(Hash{name, v.version});
}

void ReplicationCore::onHashed(const std::string& name, uint64_t version,
                               const StatusOr<uint32_t>& crc32) {
  if (!looking_.running || name != looking_.name) return;
  looking_.running = false;
  if (!crc32.isOk()) {
    snapLog()->warn("snapshot: cannot hash {} version {}: {}; the other nodes cannot fetch it",
                    name, versionText(version), crc32.status().message());
  } else {
    replica_.onCrcKnown(name, version, *crc32);
    auto held = replica_.held(name);
    auto id = files_.find(name);
    if (held && held->version == version && id != files_.end()) {
      hold(*held, id->second, HoldFile::kCrcKnown);
    }
  }
  lookNext();
}

void ReplicationCore::renamedLooked(const std::string& name, const Looked& looked) {
  looking_.running = false;
  if (holdsAlready(name, looked.id)) return;
  if (auto v = replica_.onLocalRename(name, looking_.from, looking_.from_version, round_.number)) {
    renames_.to[looking_.from] = name;  // its deletion, looked at next, says so
    publishWritten(*v, looked.id, HoldFile::kOpened, " (renamed from " + looking_.from + ")");
  } else {
    looking_.queue.push_front(name);  // what was held as `from` changed meanwhile: hashed
  }
}

void ReplicationCore::deletedHere(const std::string& name, const std::string& moved_to) {
  auto v = replica_.onLocalDelete(name, round_.number);
  if (!v) return;
  v->moved_to = moved_to;
  publishWritten(*v, FileId{}, HoldFile::kNone, "");
}

void ReplicationCore::publishWritten(const SnapshotVersion& v, const FileId& id, HoldFile file,
                                     const std::string& note) {
  hold(v, id, file);
  if (!v.deleted) ++metrics_.versions_written;
  const auto& nodes = round_.nodes;
  const auto targets = relayTargets(round_.self, round_.self, static_cast<int>(nodes.size()));
  snapLog()->info("snapshot: {} version {} {} here; announcing it to {} of {} other node(s){}",
                  v.name, versionText(v.version),
                  v.deleted ? std::string("(a deletion) made")
                            : "(" + std::to_string(v.size) + " bytes) written",
                  targets.size(), nodes.empty() ? 0 : nodes.size() - 1, note);
  announce(v, endpoint_, endpoint_, targets);
}

}  // namespace ddprun::snapshot
