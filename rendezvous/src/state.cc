// RendezvousState: construction, lookups, the outbox and the clock (tick dispatches to the
// rounds, liveness, key-value and retention parts in their own files).
#include "ddprun/rendezvous/state.h"

#include <algorithm>

#include "ddprun/common/log.h"
#include "ddprun/common/strings.h"
#include "state_internal.h"

namespace ddprun::rendezvous {

RendezvousState::RendezvousState(StateLimits limits, RunRetention retention)
    : limits_(limits), retention_(retention) {}
RendezvousState::~RendezvousState() = default;

RendezvousState::Run* RendezvousState::findRun(const std::string& run_id) {
  auto it = runs_.find(run_id);
  return it == runs_.end() ? nullptr : it->second.get();
}

const RendezvousState::Run* RendezvousState::findRun(const std::string& run_id) const {
  auto it = runs_.find(run_id);
  return it == runs_.end() ? nullptr : it->second.get();
}

const RendezvousState::Tombstone* RendezvousState::findTombstone(const std::string& run_id) const {
  auto it = tombstones_.find(run_id);
  return it == tombstones_.end() ? nullptr : &it->second;
}

RunStatus RendezvousState::statusOf(const Run& run) const {
  RunStatus s;
  s.completed_round = run.completed_round;
  s.pending_round = run.forming ? run.round : 0;
  s.closed = run.closed;
  s.participants = run.completed ? static_cast<uint32_t>(run.completed->size()) : 0;
  s.waiting = run.forming ? static_cast<uint32_t>(run.members.size()) : 0;
  s.spares = static_cast<uint32_t>(run.spares.size());
  return s;
}

void RendezvousState::push(Run& run, ChangeKind kind, ChangeReason reason,
                           const std::string& node_id, uint64_t round) {
  RoundChange c;
  c.kind = kind;
  c.reason = reason;
  c.node_id = node_id;
  c.round = round;
  c.status = statusOf(run);
  outbox_.changes.push_back({run.id, std::move(c)});
}

void RendezvousState::finishJoin(Node& node, StatusOr<RoundInfo> result) {
  if (!node.join) return;
  joins_.erase(*node.join);
  outbox_.joins.push_back({*node.join, std::move(result)});
  node.join.reset();
}

StatusOr<RunStatus> RendezvousState::status(const std::string& run_id) const {
  const Run* run = findRun(run_id);
  if (run == nullptr && findTombstone(run_id) != nullptr) {
    RunStatus s;
    s.closed = true;
    return s;
  }
  if (run == nullptr) return runUnknown(run_id);
  return statusOf(*run);
}

void RendezvousState::tick(TimePoint now) {
  if (deadlines_.empty() || *deadlines_.begin() > now) return;
  deadlines_.erase(deadlines_.begin(), deadlines_.upper_bound(now));
  expireWaits(now);
  for (auto& [run_id, run_ptr] : runs_) {
    Run& run = *run_ptr;
    if (run.closed) continue;
    expireJoins(run, now);
    expireHeartbeats(run, now);
  }
  collect(now);
}

std::optional<TimePoint> RendezvousState::nextDeadline() const {
  if (deadlines_.empty()) return std::nullopt;
  return *deadlines_.begin();
}

RendezvousState::Outbox RendezvousState::drain() {
  Outbox out = std::move(outbox_);
  outbox_ = Outbox{};
  return out;
}

void RendezvousState::abortAll(const Status& status) {
  for (auto& [run_id, run] : runs_) {
    for (auto& [id, node] : run->nodes) finishJoin(node, status);
  }
  std::vector<CallId> waits;
  for (const auto& [id, wait] : waits_) waits.push_back(id);
  for (CallId id : waits) failWait(id, status);
}

}  // namespace ddprun::rendezvous
