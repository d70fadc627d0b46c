// ReplicationCore: transfers (core.h). What is fetched, linked, copied or deleted, what is
// installed, and what a failure means for the nodes down the chain.
#include <algorithm>

#include "ddprun/snapshot/core.h"
#include "log.h"

namespace ddprun::snapshot {

namespace {

// How a transfer's status counts for the replica.
TransferOutcome outcomeOf(const Status& st) {
  switch (st.code()) {
    case StatusCode::kOk:
      return TransferOutcome::kOk;
    case StatusCode::kDataLoss:
      return TransferOutcome::kCorrupt;
    case StatusCode::kResourceExhausted:
      return TransferOutcome::kNoSpace;
    case StatusCode::kCancelled:
      return TransferOutcome::kCancelled;
    default:
      return TransferOutcome::kFailed;
  }
}

}  // namespace

void ReplicationCore::pump() {
  // While a round's sync waits for them, this node's workers are not running and their start
  // waits for these transfers: they run at the agent's priority then, in the background else.
  const bool prompt = round_.syncing;
  for (auto& t : replica_.takeTransfers()) {
    if (t.file.deleted) {
      applyDeletion(t);
    } else {
      startTransfer(t, prompt);
    }
  }
  maybeFinishSync();
}

void ReplicationCore::startTransfer(const SnapshotTransfer& t, bool prompt) {
  running_[t.file.name] = Running{t.source, clock_.now(), false};
  // Renamed on the node that wrote it, from a file held here: linked, else copied from that (it
  // is passed on once complete, a local copy being quick). Else a node this one relays the
  // version to fetches it from here while it arrives.
  const auto local = localCopyOf(t.file);
  if (local) {
    if (auto from = linkSource(t.file)) {
      emit(Link{t, from->first, from->second});  // onLinked
      return;
    }
    emit(Fetch{t, local->first, local->second, /*serve_arriving=*/false, prompt});
    dropKept(t.file.moved_from);  // the copy holds its file
    return;
  }
  std::string origin;
  const auto targets = subtree(t.file, &origin);
  emit(Fetch{t, "", false, /*serve_arriving=*/!targets.empty(), prompt});
  if (!targets.empty() && relays_.pass(t.file, /*early=*/true)) {
    // Told once: a retry of the fetch serves it quietly.
    snapLog()->info("snapshot: passing {} version {} on to {} node(s) as it arrives", t.file.name,
                    versionText(t.file.version), targets.size());
    announce(t.file, endpoint_, origin, targets);
  }
}

std::optional<std::pair<std::string, bool>> ReplicationCore::localCopyOf(
    const SnapshotVersion& v) const {
  if (v.moved_from.empty() || v.crc_pending || v.deleted) return std::nullopt;
  auto isIt = [&](const SnapshotVersion& f) {
    return !f.deleted && !f.crc_pending && f.version == v.moved_from_version && f.size == v.size &&
           f.crc32 == v.crc32;
  };
  auto held = replica_.held(v.moved_from);
  if (held && files_.count(v.moved_from) != 0 && isIt(*held)) {
    return std::make_pair(v.moved_from, false);
  }
  auto kept = kept_.find(v.moved_from);
  if (kept != kept_.end() && isIt(kept->second.version)) return std::make_pair(v.moved_from, true);
  return std::nullopt;
}

std::optional<std::pair<std::string, FileId>> ReplicationCore::linkSource(
    const SnapshotVersion& v) const {
  auto held = replica_.held(v.moved_from);
  auto id = files_.find(v.moved_from);
  if (held && id != files_.end() && held->version == v.moved_from_version) {
    return std::make_pair(v.moved_from, id->second);
  }
  auto kept = kept_.find(v.moved_from);
  if (kept != kept_.end() && !kept->second.aside.empty()) {
    return std::make_pair(kept->second.aside, kept->second.id);
  }
  return std::nullopt;  // kept open for the copy only
}

void ReplicationCore::onLinked(const Linked& done) {
  const SnapshotTransfer& t = done.transfer;
  if (!done.temp.empty()) {
    dropKept(t.file.moved_from);
    arrived(t, done.temp, "linked from " + t.file.moved_from);
    return;
  }
  // Not the file held any more (changed by a worker meanwhile), or no link to be had: copied.
  const auto local = localCopyOf(t.file);
  emit(Fetch{t, local ? local->first : "", local && local->second, false, round_.syncing});
  dropKept(t.file.moved_from);
}

void ReplicationCore::onFetched(const Fetched& done) {
  SnapshotTransfer t = done.transfer;
  if (!done.status.isOk()) {
    transferDone(t, done.status, "");
    return;
  }
  t.file.crc32 = done.crc32;  // the verified CRC-32 (the target's may have been pending)
  t.file.crc_pending = false;
  arrived(t, done.temp, done.copied ? "copied from " + t.file.moved_from : std::string());
}

void ReplicationCore::arrived(const SnapshotTransfer& t, const std::string& temp,
                              const std::string& taken) {
  if (!replica_.shouldInstall(t.file)) {  // something newer arrived meanwhile
    emit(Discard{temp});
    transferDone(t, Status::ok(), taken);
    return;
  }
  emit(Install{t, temp, taken});  // onInstalled
}

void ReplicationCore::onInstalled(const Installed& done) {
  const SnapshotTransfer& t = done.transfer;
  if (!done.status.isOk()) {
    transferDone(t, done.status, done.taken);
    return;
  }
  files_[t.file.name] = done.id;
  metrics_.newest_version = std::max(metrics_.newest_version, t.file.version);
  const TimePoint now = clock_.now();
  auto running = running_.find(t.file.name);
  const TimePoint started = running != running_.end() ? running->second.started : now;
  const double secs = std::chrono::duration<double>(now - started).count();
  if (done.taken.empty()) {
    ++metrics_.versions_fetched;
    metrics_.bytes_fetched += t.file.size;
  } else {
    ++metrics_.versions_copied;
  }
  auto heard = first_heard_.find(t.file.name);
  const TimePoint since = heard != first_heard_.end() && heard->second.first == t.file.version
                              ? std::min(heard->second.second, started)
                              : started;
  metrics_.last_lag_seconds = std::chrono::duration<double>(now - since).count();
  if (done.taken.empty()) {
    snapLog()->info("snapshot: fetched {} version {}: {} bytes from {} in {:.3f} s", t.file.name,
                    versionText(t.file.version), t.file.size, t.source, secs);
  } else {
    snapLog()->info(
        "snapshot: {} version {}: {} bytes {} here (renamed on another node) in {:.3f} s",
        t.file.name, versionText(t.file.version), t.file.size, done.taken, secs);
  }
  relay(t.file, endpoint_);  // this node serves its subtree of the announcement chain
  transferDone(t, Status::ok(), done.taken);
}

void ReplicationCore::transferDone(const SnapshotTransfer& t, const Status& st,
                                   const std::string& taken) {
  running_.erase(t.file.name);
  if (!st.isOk()) {
    ++metrics_.transfer_failures;
    logFailure(t, st);
  }
  replica_.onTransferDone(t, outcomeOf(st));
  recordTable();
  const std::string& name = t.file.name;
  if (!st.isOk()) {
    std::string origin;
    const auto targets = subtree(t.file, &origin);
    if (relays_.passedEarly(t.file)) {
      // The subtree was told to fetch from here as it arrived: their streams failed with this
      // one. They fetch from where this node tried too.
      announce(t.file, t.source, origin, targets);
    } else if (!replica_.wanted(name)) {
      relay(t.file, t.source);  // given up here: the subtree fetches from where this node tried
    }
  }
  if (!st.isOk() && st.code() != StatusCode::kResourceExhausted && !replica_.wanted(name) &&
      replica_.shouldInstall(t.file)) {
    auto kept = replica_.held(name);
    if (auto n = warnings_.gave_up.note(t.source, clock_.now())) {
      snapLog()->error(
          "snapshot: gave up on {} version {} (last tried from {}); keeping {}{}", name,
          versionText(t.file.version), t.source,
          kept ? "version " + versionText(kept->version) : std::string("none"),
          *n > 1 ? " (" + std::to_string(*n - 1) + " more given up, not logged)" : std::string());
    }
  }
  pump();
}

void ReplicationCore::logFailure(const SnapshotTransfer& t, const Status& st) {
  if (st.code() == StatusCode::kResourceExhausted) {  // this node's disk (or memory)
    snapLog()->error("snapshot: {} (fetching it from {}); keeping the previous version",
                     st.message(), t.source);
  } else if (st.code() != StatusCode::kCancelled) {
    // A peer can fail many fetches (one per name it announced): a few lines a minute each.
    if (auto n = warnings_.fetch.note(t.source, clock_.now())) {
      snapLog()->warn(
          "snapshot: fetching {} version {} from {} failed (attempt {}): {}{}", t.file.name,
          versionText(t.file.version), t.source, t.attempt, st.message(),
          *n > 1 ? " (" + std::to_string(*n - 1) + " more failures from it were not logged)"
                 : std::string());
    }
  }
}

void ReplicationCore::applyDeletion(const SnapshotTransfer& t) {
  if (replica_.shouldInstall(t.file)) {
    // Renamed on the node that deleted it: its new name may not have arrived yet.
    const bool keep = !t.file.moved_to.empty() && worthKeeping(t.file.moved_to, t.file.name);
    emit(Delete{t, keep});  // onDeleted
    return;
  }
  replica_.onTransferDone(t, TransferOutcome::kOk);
  recordTable();
  relay(t.file, endpoint_);
}

bool ReplicationCore::worthKeeping(const std::string& moved_to, const std::string& name) const {
  auto held = replica_.held(name);
  auto before = files_.find(name);
  if (!held || before == files_.end() || held->deleted || held->crc_pending) return false;
  auto now_there = files_.find(moved_to);
  // Else linked there already (a Link).
  return now_there == files_.end() || !now_there->second.sameInode(before->second);
}

void ReplicationCore::onDeleted(const Deleted& done) {
  const SnapshotTransfer& t = done.transfer;
  const std::string& name = t.file.name;
  metrics_.newest_version = std::max(metrics_.newest_version, t.file.version);
  if (!done.status.isOk()) {
    ++metrics_.transfer_failures;
    snapLog()->warn("snapshot: not deleting {} (deleted at version {} on another node): {}", name,
                    versionText(t.file.version), done.status.message());
  } else {
    if (done.kept) keepForCopy(name, done.aside);
    files_.erase(name);
    snapLog()->info("snapshot: deleted {} (version {}, deleted on another node)", name,
                    versionText(t.file.version));
  }
  // A deletion refused (through a symlink) is not tried again: nothing here would change that.
  replica_.onTransferDone(t, done.status.isOk() ? TransferOutcome::kOk : TransferOutcome::kRefused);
  recordTable();
  if (done.status.isOk()) relay(t.file, endpoint_);
  pump();
}

void ReplicationCore::keepForCopy(const std::string& name, std::string aside) {
  auto held = replica_.held(name);
  auto id = files_.find(name);
  if (!held || id == files_.end()) return;
  // One kept before under that name: the newer deletion's file replaced it (the shell let go of
  // the older one when it kept this).
  kept_[name] = Kept{*held, id->second, clock_.now() + options_.keep_renamed_for, std::move(aside)};
}

void ReplicationCore::dropKept(const std::string& name) {
  if (kept_.erase(name) != 0) emit(DropKept{name});
}

}  // namespace ddprun::snapshot
