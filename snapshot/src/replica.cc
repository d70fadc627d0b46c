#include "ddprun/snapshot/replica.h"

#include <algorithm>

namespace ddprun::snapshot {

SnapshotReplica::SnapshotReplica(SnapshotReplicaOptions options) : options_(options) {}

void SnapshotReplica::adoptExisting(const std::string& name, uint64_t size, uint32_t crc32,
                                    uint64_t version) {
  held_[name] = SnapshotVersion{name, version, size, crc32};
  max_seen_ = std::max(max_seen_, version);
}

void SnapshotReplica::adoptDeleted(const std::string& name, uint64_t version) {
  SnapshotVersion v{name, version, 0, 0};
  v.deleted = true;
  held_[name] = v;
  max_seen_ = std::max(max_seen_, version);
  trimTombstones();
}

std::optional<SnapshotVersion> SnapshotReplica::onLocalDelete(const std::string& name,
                                                              uint64_t round) {
  auto it = held_.find(name);
  if (it == held_.end() || it->second.deleted) return std::nullopt;
  SnapshotVersion v = onLocalWrite(name, 0, 0, round);
  v.deleted = true;
  held_[name] = v;
  trimTombstones();
  return v;
}

void SnapshotReplica::trimTombstones() {
  std::vector<std::pair<uint64_t, std::string>> deletions;
  for (const auto& [name, v] : held_) {
    if (v.deleted) deletions.emplace_back(v.version, name);
  }
  if (deletions.size() <= options_.max_tombstones) return;
  const size_t excess = deletions.size() - options_.max_tombstones;
  std::nth_element(deletions.begin(), deletions.begin() + static_cast<std::ptrdiff_t>(excess - 1),
                   deletions.end());
  for (size_t i = 0; i < excess; ++i) {
    forgotten_ = std::max(forgotten_, deletions[i].first);
    held_.erase(deletions[i].second);
  }
}

SnapshotVersion SnapshotReplica::onLocalWrite(const std::string& name, uint64_t size,
                                              uint32_t crc32, uint64_t round) {
  const uint64_t version = std::max(makeSnapshotVersion(round, 1), max_seen_ + 1);
  max_seen_ = version;
  SnapshotVersion v{name, version, size, crc32};
  held_[name] = v;
  auto it = wants_.find(name);
  // A running transfer of an older version ends on its own; shouldInstall() refuses its copy.
  if (it != wants_.end() && !it->second.running) wants_.erase(it);
  return v;
}

std::optional<SnapshotVersion> SnapshotReplica::onLocalRename(const std::string& name,
                                                              const std::string& from,
                                                              uint64_t from_version,
                                                              uint64_t round) {
  auto it = held_.find(from);
  if (from == name || it == held_.end() || it->second.version != from_version ||
      it->second.deleted || it->second.crc_pending || it->second.version == 0) {
    return std::nullopt;  // version 0: no other node can tell its copy is the same
  }
  const SnapshotVersion was = it->second;
  SnapshotVersion v = onLocalWrite(name, was.size, was.crc32, round);
  v.moved_from = from;
  v.moved_from_version = was.version;
  return v;
}

SnapshotVersion SnapshotReplica::onLocalWritePending(const std::string& name, uint64_t size,
                                                     uint64_t round) {
  SnapshotVersion v = onLocalWrite(name, size, 0, round);
  v.crc_pending = true;
  held_[name] = v;
  return v;
}

void SnapshotReplica::onCrcKnown(const std::string& name, uint64_t version, uint32_t crc32) {
  auto it = held_.find(name);
  if (it == held_.end() || it->second.version != version) return;
  it->second.crc32 = crc32;
  it->second.crc_pending = false;
}

bool SnapshotReplica::newerThanHeld(const SnapshotVersion& v) const {
  auto it = held_.find(v.name);
  return it == held_.end() || v.supersedes(it->second);
}

bool SnapshotReplica::worthFetching(const SnapshotVersion& v) const {
  // A deletion this node forgot, announced by a peer that has not yet: nothing to do here unless
  // a copy it deletes is held.
  return newerThanHeld(v) && !(v.deleted && v.version <= forgotten_ && held_.count(v.name) == 0);
}

void SnapshotReplica::pruneHeard(const std::string& name, const std::vector<std::string>* live) {
  auto heard = heard_.find(name);
  if (heard == heard_.end()) return;
  auto& holders = heard->second;
  for (auto h = holders.begin(); h != holders.end();) {
    const bool gone = live && std::find(live->begin(), live->end(), h->first) == live->end();
    if (!gone && worthFetching(h->second)) {
      ++h;
      continue;
    }
    auto count = heard_by_holder_.find(h->first);
    if (count != heard_by_holder_.end() && --count->second == 0) heard_by_holder_.erase(count);
    h = holders.erase(h);
  }
  if (holders.empty()) heard_.erase(heard);
}

size_t SnapshotReplica::namesFrom(const std::string& holder) const {
  auto it = heard_by_holder_.find(holder);
  return it == heard_by_holder_.end() ? 0 : it->second;
}

HolderNews SnapshotReplica::onHolder(const SnapshotVersion& v, const std::string& source) {
  if (!isReplicatedName(v.name) || source.empty() || !isPossibleVersion(v.version)) {
    return HolderNews::kIgnored;
  }
  if (!worthFetching(v)) {
    max_seen_ = std::max(max_seen_, v.version);
    return HolderNews::kIgnored;
  }
  // What a name heard of costs stays bounded, per holder and in all.
  auto names = heard_.find(v.name);
  if (names == heard_.end() || names->second.count(source) == 0) {
    if (namesFrom(source) >= options_.max_names_per_holder) return HolderNews::kTooManyFromHolder;
    if (names == heard_.end() && heard_.size() >= options_.max_pending_names) {
      return HolderNews::kTooManyNames;
    }
    ++heard_by_holder_[source];
  }
  max_seen_ = std::max(max_seen_, v.version);
  auto& heard = heard_[v.name][source];
  if (heard.name.empty() || v.supersedes(heard)) heard = v;
  auto it = wants_.find(v.name);
  if (it == wants_.end() || v.supersedes(it->second.target)) {
    Want w;
    w.target = v;
    w.sources = {source};
    if (it != wants_.end()) w.running = it->second.running;  // the old transfer still runs
    wants_[v.name] = std::move(w);
    return HolderNews::kTaken;
  }
  Want& w = it->second;
  // Older, or the same number with lesser content. A holder that knows the CRC-32 serves the same
  // version as one that is still hashing it.
  if (!v.sameContent(w.target)) return HolderNews::kTaken;
  if (w.target.moved_from.empty() && w.target.moved_to.empty()) {  // told of a rename later
    w.target.moved_from = v.moved_from;
    w.target.moved_from_version = v.moved_from_version;
    w.target.moved_to = v.moved_to;
  }
  if (std::find(w.sources.begin(), w.sources.end(), source) == w.sources.end()) {
    w.sources.push_back(source);
    if (w.given_up && w.failed_out) {
      // Given up after its holders failed it (a relay whose own fetch failed answers so until it
      // tries again): a holder not tried yet gets one attempt.
      w.given_up = false;
      w.failed_out = false;
      w.attempts = options_.max_attempts - 1;
      w.next_source = w.sources.size() - 1;
    }
  }
  return HolderNews::kTaken;
}

std::vector<SnapshotTransfer> SnapshotReplica::takeTransfers() {
  std::vector<SnapshotTransfer> out;
  for (auto& [name, w] : wants_) {
    if (w.running || w.given_up || w.sources.empty()) continue;
    if (w.attempts == 0) {
      w.next_source = static_cast<size_t>(std::max(options_.self_index, 0)) % w.sources.size();
    }
    w.running = true;
    ++w.attempts;
    out.push_back(
        SnapshotTransfer{w.target, w.sources[w.next_source % w.sources.size()], w.attempts});
  }
  return out;
}

bool SnapshotReplica::shouldInstall(const SnapshotVersion& v) const { return newerThanHeld(v); }

void SnapshotReplica::onTransferDone(const SnapshotTransfer& t, TransferOutcome outcome) {
  const std::string& name = t.file.name;
  if (outcome == TransferOutcome::kOk && newerThanHeld(t.file)) {
    SnapshotVersion& held = held_[name] = t.file;
    held.moved_from.clear();  // the hint travels with announcements only
    held.moved_from_version = 0;
    held.moved_to.clear();
    if (t.file.deleted) trimTombstones();
    pruneHeard(name);
  }
  auto it = wants_.find(name);
  if (it == wants_.end()) return;
  Want& w = it->second;
  w.running = false;
  if (!newerThanHeld(w.target)) {  // what is held now is at least as new as the wanted one
    wants_.erase(it);
    return;
  }
  // No live holder of what is wanted is left (keepSources), nor of anything newer than what is
  // held: wanted no more, so that the round's sync does not wait for it.
  if (w.sources.empty() && !fallBack(name, w)) {
    wants_.erase(it);
    return;
  }
  if (!w.target.sameContent(t.file)) return;  // superseded while it ran: the newer one is next
  switch (outcome) {
    case TransferOutcome::kOk:  // installed elsewhere meanwhile? (not newer: erased above)
      wants_.erase(it);
      return;
    case TransferOutcome::kCancelled:
      wants_.erase(it);
      return;
    case TransferOutcome::kNoSpace:
    case TransferOutcome::kRefused:
      w.given_up = true;
      return;
    case TransferOutcome::kCorrupt:
    case TransferOutcome::kFailed:
      if (w.attempts >= options_.max_attempts) {
        w.given_up = true;
        w.failed_out = true;
      } else if (w.sources[w.next_source % w.sources.size()] == t.source) {
        w.next_source = (w.next_source + 1) % w.sources.size();
      }  // else its source was dropped: next_source names one not tried yet
      return;
  }
}

bool SnapshotReplica::fallBack(const std::string& name, Want& w) {
  auto heard = heard_.find(name);
  if (heard == heard_.end()) return false;
  std::optional<SnapshotVersion> best;
  for (const auto& [source, v] : heard->second) {
    if (worthFetching(v) && (!best || v.supersedes(*best))) best = v;
  }
  if (!best) return false;
  Want next;
  next.target = *best;
  for (const auto& [source, v] : heard->second) {
    if (v.sameContent(*best)) next.sources.push_back(source);
  }
  next.running = w.running;  // a transfer that still runs ends first
  w = std::move(next);
  return true;
}

void SnapshotReplica::keepSources(const std::vector<std::string>& live) {
  const auto isLive = [&](const std::string& s) {
    return std::find(live.begin(), live.end(), s) != live.end();
  };
  std::vector<std::string> names;
  for (const auto& [name, holders] : heard_) names.push_back(name);
  for (const auto& name : names) pruneHeard(name, &live);
  for (auto it = wants_.begin(); it != wants_.end();) {
    Want& w = it->second;
    const std::string current =
        w.sources.empty() ? "" : w.sources[w.next_source % w.sources.size()];
    w.sources.erase(std::remove_if(w.sources.begin(), w.sources.end(),
                                   [&](const auto& s) { return !isLive(s); }),
                    w.sources.end());
    auto at = std::find(w.sources.begin(), w.sources.end(), current);
    w.next_source = at == w.sources.end() ? 0 : static_cast<size_t>(at - w.sources.begin());
    if (w.sources.empty() && !fallBack(it->first, w) && !w.running) {
      it = wants_.erase(it);
    } else {
      ++it;
    }
  }
}

void SnapshotReplica::retryGivenUp() {
  for (auto& [name, w] : wants_) {
    if (!w.given_up) continue;
    w.given_up = false;
    w.failed_out = false;
    w.attempts = 0;
  }
}

bool SnapshotReplica::busy() const {
  return std::any_of(wants_.begin(), wants_.end(),
                     [](const auto& kv) { return kv.second.running || !kv.second.given_up; });
}

std::vector<SnapshotVersion> SnapshotReplica::heldList() const {
  std::vector<SnapshotVersion> out;
  for (const auto& [name, v] : held_) out.push_back(v);
  return out;
}

std::optional<SnapshotVersion> SnapshotReplica::held(const std::string& name) const {
  auto it = held_.find(name);
  if (it == held_.end()) return std::nullopt;
  return it->second;
}

std::optional<uint64_t> SnapshotReplica::wanted(const std::string& name) const {
  auto it = wants_.find(name);
  if (it == wants_.end() || it->second.given_up) return std::nullopt;
  return it->second.target.version;
}
}  // namespace ddprun::snapshot
