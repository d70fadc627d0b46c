// RendezvousState, liveness: heartbeats, watch streams (suspicion of a node whose stream broke,
// the snapshot a stream starts with) and declaring silent nodes dead.
#include <algorithm>

#include "ddprun/common/log.h"
#include "ddprun/common/strings.h"
#include "ddprun/rendezvous/state.h"
#include "state_internal.h"

namespace ddprun::rendezvous {

StatusOr<RunStatus> RendezvousState::heartbeat(const std::string& run_id,
                                               const std::string& node_id, TimePoint now) {
  DDPRUN_RETURN_IF_ERROR(validateIds(run_id, node_id));
  Run* run = findRun(run_id);
  if (run == nullptr && findTombstone(run_id) != nullptr) return status(run_id);
  if (run == nullptr) return runUnknown(run_id);
  auto it = run->nodes.find(node_id);
  if (it == run->nodes.end()) {
    return notFound("node " + node_id + " is not part of run " + run_id +
                    " (declared dead, left, or never joined); join again");
  }
  it->second.last_seen = now;
  it->second.suspect_until.reset();
  return statusOf(*run);
}

void RendezvousState::watchLost(const std::string& run_id, const std::string& node_id,
                                TimePoint now) {
  Run* run = findRun(run_id);
  if (run == nullptr || run->closed) return;
  auto it = run->nodes.find(node_id);
  if (it == run->nodes.end()) return;
  const TimePoint until = now + run->config.heartbeat_interval;
  it->second.suspect_until = until;
  deadlines_.insert(until);
}

void RendezvousState::watchStarted(const std::string& run_id, const std::string& node_id) {
  Run* run = findRun(run_id);
  if (run == nullptr) return;
  auto it = run->nodes.find(node_id);
  if (it != run->nodes.end()) it->second.suspect_until.reset();
}

std::vector<RoundChange> RendezvousState::watchSnapshot(const std::string& run_id) const {
  RoundChange snapshot;
  snapshot.kind = ChangeKind::kSnapshot;
  auto st = status(run_id);
  if (st.isOk()) snapshot.status = st.value();
  snapshot.round = snapshot.status.pending_round != 0 ? snapshot.status.pending_round
                                                      : snapshot.status.completed_round;
  // A round forming: why it opened, as its kRoundPending said (a watcher that missed that message,
  // its stream broken meanwhile, still tells a node's death from a failure or a join). Not for a
  // closed run: its kClosed follows, and nothing forms any more.
  if (const Run* run = findRun(run_id);
      run != nullptr && snapshot.status.pending_round != 0 && !snapshot.status.closed) {
    snapshot.reason = run->pending_reason;
    snapshot.node_id = run->pending_cause;
  }
  std::vector<RoundChange> out{snapshot};
  if (snapshot.status.closed) {
    RoundChange closed = snapshot;
    closed.kind = ChangeKind::kClosed;
    out.push_back(std::move(closed));
  }
  return out;
}

void RendezvousState::watchOpened(const std::string& run_id, TimePoint now) {
  ++watchers_[run_id];
  ++watch_streams_;
  touch(run_id, now);
}

void RendezvousState::watchClosed(const std::string& run_id, TimePoint now) {
  auto it = watchers_.find(run_id);
  DDPRUN_CHECK(it != watchers_.end() && it->second > 0, "watchClosed without watchOpened");
  --watch_streams_;
  if (--it->second != 0) return;
  watchers_.erase(it);
  touch(run_id, now);
  if (Run* run = findRun(run_id); run != nullptr && run->closed) {
    deadlines_.insert(now);  // its watchers were told: shrink it to a tombstone at once
  } else if (run != nullptr) {
    noteMaybeIdle(*run, now);
  } else if (kv_.count(run_id) != 0) {
    scheduleCollect(now + retention_.idle_run_ttl);
  }
}

void RendezvousState::expireHeartbeats(Run& run, TimePoint now) {
  // Heartbeats: nodes without a pending join must beat.
  std::vector<std::string> dead;
  std::optional<TimePoint> earliest;
  for (auto& [id, node] : run.nodes) {
    if (node.join) continue;
    TimePoint expires = node.last_seen + run.expiry();
    if (node.suspect_until) expires = std::min(expires, *node.suspect_until);
    if (expires <= now) {
      dead.push_back(id);
    } else if (!earliest || expires < *earliest) {
      earliest = expires;
    }
  }
  for (const std::string& id : dead) {
    if (run.nodes.at(id).suspect_until) {
      logger("rendezvous")
          ->warn("run {}: node {} lost its watch stream and went silent, declared dead", run.id,
                 id);
    } else {
      logger("rendezvous")
          ->warn("run {}: node {} missed {} heartbeats, declared dead", run.id, id,
                 run.config.heartbeat_misses);
    }
    removeNode(run, id, ChangeReason::kNodeDead, std::nullopt, now);
  }
  // Re-check no sooner than half an interval from now, so steady heartbeats cost few scans.
  if (earliest) deadlines_.insert(std::max(*earliest, now + run.config.heartbeat_interval / 2));
}

}  // namespace ddprun::rendezvous
