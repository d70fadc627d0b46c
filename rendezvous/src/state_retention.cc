// RendezvousState, retention: idle clocks, collection of closed and unused runs and stores,
// tombstones, the census.
#include <algorithm>

#include "ddprun/common/log.h"
#include "ddprun/common/strings.h"
#include "ddprun/rendezvous/state.h"
#include "state_internal.h"

namespace ddprun::rendezvous {

void RendezvousState::scheduleCollect(TimePoint at) {
  // Collection deadlines are rounded up to whole seconds, so the expiries of many runs, stores
  // and waits share a few ticks instead of one each; nothing is collected before its time.
  deadlines_.insert(std::chrono::ceil<std::chrono::seconds>(at));
}

void RendezvousState::touch(const std::string& run_id, TimePoint now) {
  if (Run* run = findRun(run_id)) run->last_active = now;
  auto kv = kv_.find(run_id);
  if (kv != kv_.end()) kv->second.last_active = now;
}

void RendezvousState::noteMaybeIdle(Run& run, TimePoint now) {
  if (run.closed || !run.nodes.empty()) return;
  run.last_active = now;
  if (watchers_.count(run.id) == 0) scheduleCollect(now + retention_.idle_run_ttl);
}

void RendezvousState::collect(TimePoint now) {
  auto log = logger("rendezvous");
  // Tombstones past their TTL: the id is free again.
  while (!tombstones_by_close_.empty() &&
         tombstones_by_close_.begin()->first + retention_.closed_run_ttl <= now) {
    auto oldest = tombstones_by_close_.begin();
    log->debug("run {}: tombstone expired ({}s after its close)", oldest->second,
               secondsOf(now - oldest->first));
    tombstones_.erase(oldest->second);
    tombstones_by_close_.erase(oldest);
  }
  if (!tombstones_by_close_.empty()) {
    scheduleCollect(tombstones_by_close_.begin()->first + retention_.closed_run_ttl);
  }

  std::set<std::string> waited;  // a pending wait keeps its run id in use
  for (const auto& [id, wait] : waits_) waited.insert(wait.run_id);
  auto idleSince = [&](const std::string& run_id, TimePoint last) {
    auto kv = kv_.find(run_id);
    return kv == kv_.end() ? last : std::max(last, kv->second.last_active);
  };

  std::vector<std::string> closed, unused;
  for (const auto& [run_id, run_ptr] : runs_) {
    const Run& run = *run_ptr;
    const bool watched = watchers_.count(run_id) != 0;
    if (run.closed) {
      // Once no stream is left, every watcher has taken kClosed (or gave up); a stuck one does
      // not keep the whole run alive past the drain timeout.
      if (!watched || run.closed_at + retention_.closed_drain_timeout <= now) {
        closed.push_back(run_id);
      }
      continue;
    }
    // A live node, a stream or a wait: in use. Each schedules a check when it ends.
    if (!run.nodes.empty() || watched || waited.count(run_id) != 0) continue;
    const TimePoint expires = idleSince(run_id, run.last_active) + retention_.idle_run_ttl;
    if (expires <= now) {
      unused.push_back(run_id);
    } else {
      scheduleCollect(expires);
    }
  }
  for (const std::string& run_id : closed) {
    const Run& run = *runs_.at(run_id);
    bury(run_id, run.closed_at, run.close_reason, now);
  }
  for (const std::string& run_id : unused) {
    log->info("run {} dropped: no live node, watch stream or key write for {}s", run_id,
              secondsOf(now - idleSince(run_id, runs_.at(run_id)->last_active)));
    runs_.erase(run_id);
    dropKvSpace(run_id);
  }

  // Key-value spaces of run ids without a run (the store needs no join, and outlives a
  // tombstone): the same idle rule.
  std::vector<std::string> stale;
  for (const auto& [run_id, space] : kv_) {
    if (runs_.count(run_id) != 0 || watchers_.count(run_id) != 0 || waited.count(run_id) != 0) {
      continue;
    }
    const TimePoint expires = space.last_active + retention_.idle_run_ttl;
    if (expires <= now) {
      stale.push_back(run_id);
    } else {
      scheduleCollect(expires);
    }
  }
  for (const std::string& run_id : stale) {
    log->info("key-value store of run {} dropped: unused for {}s", run_id,
              secondsOf(now - kv_.at(run_id).last_active));
    dropKvSpace(run_id);
  }
  if (!closed.empty() || !unused.empty() || !stale.empty()) {
    const StateCensus c = census();
    log->debug("rendezvous holds {} run(s) ({} closed), {} tombstone(s), {} key-value store(s)",
               c.runs, c.closed_runs, c.tombstones, c.kv_spaces);
  }
}

void RendezvousState::bury(const std::string& run_id, TimePoint closed_at, std::string reason,
                           TimePoint now) {
  // Waits on a closed run's keys would only run into their timeouts.
  std::vector<CallId> failed;
  for (const auto& [id, wait] : waits_) {
    if (wait.run_id == run_id) failed.push_back(id);
  }
  for (CallId id : failed) failWait(id, runClosed(run_id));
  const Run& run = *runs_.at(run_id);
  for (const auto& [id, node] : run.nodes) {
    if (node.join) joins_.erase(*node.join);  // answered at close; defensive
  }
  runs_.erase(run_id);
  --closed_runs_;
  dropKvSpace(run_id);
  if (closed_at + retention_.closed_run_ttl <= now || retention_.max_tombstones == 0) {
    logger("rendezvous")
        ->info("run {} dropped: closed {}s ago", run_id, secondsOf(now - closed_at));
    return;
  }
  logger("rendezvous")
      ->info("run {} shrunk to a tombstone (closed {}); joins refused for {}s more", run_id, reason,
             secondsOf(closed_at + retention_.closed_run_ttl - now));
  tombstones_[run_id] = Tombstone{closed_at, std::move(reason)};
  tombstones_by_close_.emplace(closed_at, run_id);
  while (tombstones_.size() > retention_.max_tombstones) {
    auto oldest = tombstones_by_close_.begin();
    logger("rendezvous")
        ->debug("run {}: tombstone evicted, {} tombstones is the limit", oldest->second,
                retention_.max_tombstones);
    tombstones_.erase(oldest->second);
    tombstones_by_close_.erase(oldest);
  }
  scheduleCollect(tombstones_by_close_.begin()->first + retention_.closed_run_ttl);
}

StateCensus RendezvousState::census() const {
  StateCensus c;
  c.runs = runs_.size();
  c.closed_runs = closed_runs_;
  c.tombstones = tombstones_.size();
  c.kv_spaces = kv_.size();
  c.watch_streams = watch_streams_;
  c.kv_bytes = kv_bytes_;
  return c;
}

}  // namespace ddprun::rendezvous
