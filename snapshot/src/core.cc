// ReplicationCore: start, time, the outbox and what is held (core.h). Local changes are in
// core_local.cc, peers and rounds in core_peers.cc, transfers in core_transfers.cc.
#include "ddprun/snapshot/core.h"

#include <algorithm>

#include "log.h"

namespace ddprun::snapshot {

ReplicationCore::ReplicationCore(CoreOptions options, const Clock& clock)
    : options_(std::move(options)), clock_(clock), replica_(options_.replica) {}

void ReplicationCore::start(const std::map<std::string, SnapshotVersion>& table,
                            const std::vector<Existing>& existing) {
  for (const auto& e : existing) {
    const uint64_t version = recordedVersion(table, e.name, e.size, e.crc32);
    replica_.adoptExisting(e.name, e.size, e.crc32, version);
    hold(SnapshotVersion{e.name, version, e.size, e.crc32}, e.id, HoldFile::kOpened);
    if (version != 0) {
      snapLog()->info(
          "snapshot dir: {} ({} bytes) is version {}, as recorded before this agent "
          "started",
          e.name, e.size, versionText(version));
    } else {
      auto known = table.find(e.name);
      snapLog()->info(
          "snapshot dir: {} ({} bytes) was there before the job (version 0{})", e.name, e.size,
          known == table.end() ? std::string()
                               : "; it changed since version " +
                                     versionText(known->second.version) + " was recorded");
    }
  }
  // Deletions recorded of files still absent stay deletions: older copies elsewhere are deleted,
  // not fetched back.
  for (const auto& [name, v] : table) {
    if (!v.deleted || files_.count(name) != 0) continue;
    replica_.adoptDeleted(name, v.version);
    hold(v, FileId{}, HoldFile::kNone);
  }
  recording_ = true;
  recordTable();  // drops what is no longer there
}

void ReplicationCore::hold(const SnapshotVersion& v, const FileId& id, HoldFile file) {
  if (v.deleted) {
    files_.erase(v.name);
  } else {
    files_[v.name] = id;
  }
  metrics_.newest_version = std::max(metrics_.newest_version, v.version);
  emit(Hold{v, id, file});
  recordTable();
}

void ReplicationCore::recordTable() {
  if (!recording_) return;  // start() records the table once, at its end
  // One table per batch of actions is enough: the last one says what is held by then.
  if (!outbox_.empty() && std::holds_alternative<RecordTable>(outbox_.back())) {
    outbox_.pop_back();
  }
  emit(RecordTable{encodeVersionTable(replica_.heldList())});
}

void ReplicationCore::tick() {
  const TimePoint now = clock_.now();
  if (announcing_.retry_at && *announcing_.retry_at <= now) {
    announcing_.retry_at.reset();
    tellAgain();
  }
  std::vector<std::string> due;
  for (const auto& [name, kept] : kept_) {
    if (kept.until <= now) due.push_back(name);
  }
  for (const auto& name : due) dropKept(name);
}

std::optional<TimePoint> ReplicationCore::nextDeadline() const {
  std::optional<TimePoint> next = renames_.pairs.nextDue();
  auto earlier = [&next](TimePoint t) {
    if (!next || t < *next) next = t;
  };
  if (announcing_.retry_at) earlier(*announcing_.retry_at);
  for (const auto& [name, kept] : kept_) earlier(kept.until);
  return next;
}

std::vector<Action> ReplicationCore::drain() { return std::exchange(outbox_, {}); }

bool ReplicationCore::versioned() const {
  return !looking_.running && looking_.queue.empty() && !renames_.pairs.nextDue();
}

bool ReplicationCore::replicated() const {
  return versioned() && !replica_.busy() && announcing_.in_flight == 0;
}

}  // namespace ddprun::snapshot
