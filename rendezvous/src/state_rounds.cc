// RendezvousState, rounds and membership: joins, round forming and completion, ranks, leaves,
// failure reports and close.
#include <algorithm>
#include <limits>

#include "ddprun/common/log.h"
#include "ddprun/common/strings.h"
#include "ddprun/rendezvous/state.h"
#include "state_internal.h"

namespace ddprun::rendezvous {

namespace {

Status validateConfig(const RunConfig& c) {
  if (c.min_nodes == 0 || c.max_nodes < c.min_nodes) {
    return invalidArgument("nnodes " + std::to_string(c.min_nodes) + ":" +
                           std::to_string(c.max_nodes) + " is invalid; need 0 < MIN <= MAX");
  }
  if (c.heartbeat_interval <= Duration::zero() || c.heartbeat_misses == 0) {
    return invalidArgument("heartbeat_interval must be > 0 and heartbeat_misses >= 1");
  }
  // A node is declared dead after their product: a time every deadline can still be added to.
  const double expiry =
      std::chrono::duration<double>(c.heartbeat_interval).count() * c.heartbeat_misses;
  if (expiry > kMaxDurationSeconds) {
    return invalidArgument("heartbeat_interval x heartbeat_misses must be at most 1e9 s, got " +
                           std::to_string(expiry) + " s");
  }
  if (c.last_call_timeout < Duration::zero()) {
    return invalidArgument("last_call_timeout must be >= 0");
  }
  return Status::ok();
}

}  // namespace

void RendezvousState::join(CallId id, const JoinRequest& req, TimePoint now) {
  auto fail = [&](Status s) { outbox_.joins.push_back({id, std::move(s)}); };
  if (Status s = validateIds(req.run_id, req.node_id); !s.isOk()) return fail(s);
  if (req.address.size() > limits_.max_id_bytes) {
    return fail(invalidArgument("node address is longer than " +
                                std::to_string(limits_.max_id_bytes) + " bytes"));
  }
  if (req.address.empty()) return fail(invalidArgument("node address is empty"));
  if (hasControlByte(req.address)) {
    return fail(invalidArgument("node address contains a control byte"));
  }
  if (req.local_world_size == 0) {
    return fail(invalidArgument("local_world_size must be >= 1, got 0"));
  }
  if (req.local_world_size > limits_.max_local_world_size) {
    return fail(invalidArgument("local_world_size must be at most " +
                                std::to_string(limits_.max_local_world_size) + ", got " +
                                std::to_string(req.local_world_size)));
  }
  if (req.config.max_nodes > limits_.max_nodes) {
    return fail(invalidArgument("nnodes MAX must be at most " + std::to_string(limits_.max_nodes) +
                                ", got " + std::to_string(req.config.max_nodes)));
  }
  if (req.join_timeout <= Duration::zero()) {
    return fail(invalidArgument("join_timeout must be > 0"));
  }
  if (Status s = validateConfig(req.config); !s.isOk()) return fail(s);

  Run* run = findRun(req.run_id);
  if (run == nullptr && findTombstone(req.run_id) != nullptr) {
    return fail(runClosed(req.run_id));
  }
  if (run == nullptr && runs_.size() >= limits_.max_runs) {
    return fail(Status(
        StatusCode::kResourceExhausted,
        "run " + req.run_id + " would be one run more than the " + std::to_string(runs_.size()) +
            " this rendezvous holds: max-runs = " + std::to_string(limits_.max_runs) +
            " (ddprun-rendezvous --max-runs; a run goes once closed, or unused "
            "for --idle-run-ttl)"));
  }
  if (run == nullptr) {
    auto fresh = std::make_unique<Run>();
    fresh->id = req.run_id;
    fresh->config = req.config;
    fresh->last_active = now;
    run = fresh.get();
    runs_.emplace(req.run_id, std::move(fresh));
    logger("rendezvous")
        ->info("run {} created: nnodes {}:{}, last_call {}s, heartbeat {}s x {}", req.run_id,
               req.config.min_nodes, req.config.max_nodes, secondsOf(req.config.last_call_timeout),
               secondsOf(req.config.heartbeat_interval), req.config.heartbeat_misses);
  } else if (run->config.min_nodes != req.config.min_nodes ||
             run->config.max_nodes != req.config.max_nodes) {
    return fail(failedPrecondition(
        "run " + req.run_id + " has nnodes " + std::to_string(run->config.min_nodes) + ":" +
        std::to_string(run->config.max_nodes) + " but this node asked for " +
        std::to_string(req.config.min_nodes) + ":" + std::to_string(req.config.max_nodes)));
  }
  if (run->closed) return fail(runClosed(req.run_id));

  std::string node_id = req.node_id;
  if (node_id.empty()) {
    do {
      node_id = "node-" + std::to_string(next_node_seq_++);
    } while (run->nodes.count(node_id) != 0);
  }
  // Spares wait only while the round is full, so a node new to the run would be one more.
  if (run->nodes.count(node_id) == 0 && run->spares.size() >= limits_.max_run_spares) {
    return fail(Status(StatusCode::kResourceExhausted,
                       "run " + req.run_id + " already has " + std::to_string(run->spares.size()) +
                           " nodes waiting beyond nnodes MAX " +
                           std::to_string(run->config.max_nodes) +
                           " (spares): max-run-spares = " + std::to_string(limits_.max_run_spares) +
                           " (ddprun-rendezvous --max-run-spares)"));
  }
  auto [it, inserted] = run->nodes.try_emplace(node_id);
  Node& node = it->second;
  if (inserted) {
    node.id = node_id;
    node.arrival = ++run->arrivals;
  }
  if (node.join) {
    finishJoin(node, Status(StatusCode::kAborted, "superseded by a newer join of node " + node_id));
  }
  node.address = req.address;
  node.local_world_size = req.local_world_size;
  node.last_seen = now;

  // A participant of the completed round asking again (a retry after a lost answer) gets it,
  // unless it comes back different (another local world size): that needs a new round.
  bool changed_participant = false;
  if (!run->forming) {
    auto r = run->completed_rank.find(node_id);
    if (r != run->completed_rank.end()) {
      const Participant& before = run->completed->at(r->second);
      changed_participant =
          before.local_world_size != req.local_world_size || before.address != req.address;
    }
    if (r != run->completed_rank.end() && !changed_participant) {
      outbox_.joins.push_back({id, participantInfo(*run, node_id, r->second)});
      return;
    }
  }

  node.join = id;
  node.join_deadline = now + req.join_timeout;
  joins_[id] = {run->id, node_id};
  deadlines_.insert(node.join_deadline);

  const uint32_t max = run->config.max_nodes;
  if (run->forming) {
    if (run->joined.count(node_id) != 0) return;  // re-attached to its place
    if (run->expected.count(node_id) != 0 || run->members.size() + run->expected.size() < max) {
      addToRound(*run, node, now);
    } else if (std::find(run->spares.begin(), run->spares.end(), node_id) == run->spares.end()) {
      run->spares.push_back(node_id);
    }
    return;
  }
  if (run->completed->size() < max || changed_participant) {
    openRound(*run, ChangeReason::kNodeJoined, node_id, now);
    if (run->forming && run->joined.count(node_id) == 0) addToRound(*run, node, now);
  } else if (std::find(run->spares.begin(), run->spares.end(), node_id) == run->spares.end()) {
    run->spares.push_back(node_id);
  }
}

void RendezvousState::addToRound(Run& run, Node& node, TimePoint now) {
  run.spares.erase(std::remove(run.spares.begin(), run.spares.end(), node.id), run.spares.end());
  run.expected.erase(node.id);
  run.joined.insert(node.id);
  run.members.push_back(node.id);
  const size_t n = run.members.size();
  if (n >= run.config.max_nodes ||
      (n >= run.config.min_nodes && run.reforming && run.expected.empty())) {
    completeRound(run, now);
  } else if (n >= run.config.min_nodes) {
    run.last_call = now + run.config.last_call_timeout;
    deadlines_.insert(*run.last_call);
  }
}

void RendezvousState::promoteSpares(Run& run, TimePoint now) {
  while (run.forming && !run.spares.empty() &&
         run.members.size() + run.expected.size() < run.config.max_nodes) {
    Node& spare = run.nodes.at(run.spares.front());
    addToRound(run, spare, now);
  }
}

void RendezvousState::openRound(Run& run, ChangeReason reason, const std::string& cause,
                                TimePoint now) {
  DDPRUN_CHECK(!run.forming, "openRound while a round is forming");
  run.round = run.completed_round + 1;
  run.forming = true;
  run.pending_reason = reason;
  run.pending_cause = cause;
  run.members.clear();
  run.joined.clear();
  run.expected.clear();
  run.last_call.reset();
  if (run.completed) {
    for (const Participant& p : *run.completed) {
      if (run.nodes.count(p.node_id) != 0) run.expected.insert(p.node_id);
    }
  }
  run.reforming = !run.expected.empty();
  logger("rendezvous")
      ->info("run {}: round {} opened ({} {}), {} survivors expected", run.id, run.round,
             changeReasonName(reason), cause, run.expected.size());
  push(run, ChangeKind::kRoundPending, reason, cause, run.round);
  promoteSpares(run, now);
}

void RendezvousState::completeRound(Run& run, TimePoint now) {
  const size_t n = run.members.size();
  std::vector<std::string> by_rank(n);
  std::vector<Node*> rest;
  // Claim previous ranks, most recent rounds first, so a survivor keeps its rank.
  std::vector<Node*> nodes;
  nodes.reserve(n);
  for (const std::string& id : run.members) nodes.push_back(&run.nodes.at(id));
  std::vector<Node*> claimers = nodes;
  std::stable_sort(claimers.begin(), claimers.end(),
                   [](const Node* a, const Node* b) { return a->prev_round > b->prev_round; });
  for (Node* node : claimers) {
    if (node->prev_rank >= 0 && static_cast<size_t>(node->prev_rank) < n &&
        by_rank[node->prev_rank].empty()) {
      by_rank[node->prev_rank] = node->id;
    } else {
      rest.push_back(node);
    }
  }
  // Others fill the free ranks: former holders by their old rank, then newcomers by arrival.
  std::stable_sort(rest.begin(), rest.end(), [](const Node* a, const Node* b) {
    const int64_t ka = a->prev_rank >= 0 ? a->prev_rank : std::numeric_limits<int64_t>::max();
    const int64_t kb = b->prev_rank >= 0 ? b->prev_rank : std::numeric_limits<int64_t>::max();
    if (ka != kb) return ka < kb;
    return a->arrival < b->arrival;
  });
  size_t next = 0;
  for (Node* node : rest) {
    while (!by_rank[next].empty()) ++next;
    by_rank[next] = node->id;
  }

  auto participants = std::make_shared<std::vector<Participant>>();
  participants->reserve(n);
  run.base_ranks.assign(n, 0);
  run.completed_rank.clear();
  uint32_t base = 0;
  for (size_t rank = 0; rank < n; ++rank) {
    const Node& node = run.nodes.at(by_rank[rank]);
    participants->push_back(
        {node.id, node.address, node.local_world_size, static_cast<uint32_t>(rank)});
    run.base_ranks[rank] = base;
    run.completed_rank[node.id] = static_cast<uint32_t>(rank);
    base += node.local_world_size;
  }
  run.world_size = base;
  run.completed = participants;
  run.completed_round = run.round;
  run.forming = false;
  run.reforming = false;
  run.members.clear();
  run.joined.clear();
  run.expected.clear();
  run.last_call.reset();
  logger("rendezvous")
      ->info("run {}: round {} complete with {} nodes, world size {}", run.id, run.round, n, base);

  for (size_t rank = 0; rank < n; ++rank) {
    Node& node = run.nodes.at(by_rank[rank]);
    node.prev_rank = static_cast<int64_t>(rank);
    node.prev_round = run.round;
    node.last_seen = now;
    RoundInfo info;
    info.round = run.round;
    info.node_id = node.id;
    info.group_rank = static_cast<uint32_t>(rank);
    info.group_world_size = static_cast<uint32_t>(n);
    info.base_rank = run.base_ranks[rank];
    info.world_size = base;
    info.participants = participants;
    finishJoin(node, std::move(info));
  }
  deadlines_.insert(now + run.expiry());
  push(run, ChangeKind::kRoundComplete, ChangeReason::kNone, "", run.round);
  abortMasterWaits(run);
}

void RendezvousState::detachFromRound(Run& run, Node& node) {
  run.spares.erase(std::remove(run.spares.begin(), run.spares.end(), node.id), run.spares.end());
  if (run.forming && run.joined.erase(node.id) != 0) {
    run.members.erase(std::remove(run.members.begin(), run.members.end(), node.id),
                      run.members.end());
    if (run.members.size() < run.config.min_nodes) run.last_call.reset();
  }
}

void RendezvousState::removeNode(Run& run, const std::string& node_id, ChangeReason reason,
                                 std::optional<Status> join_status, TimePoint now) {
  auto it = run.nodes.find(node_id);
  if (it == run.nodes.end()) return;
  Node& node = it->second;
  if (node.join) {
    if (join_status) {
      finishJoin(node, *join_status);
    } else {
      joins_.erase(*node.join);
      node.join.reset();
    }
  }
  const bool in_completed = !run.forming && run.completed_rank.count(node_id) != 0;
  detachFromRound(run, node);
  run.expected.erase(node_id);
  run.nodes.erase(it);
  logger("rendezvous")
      ->info("run {}: node {} removed ({})", run.id, node_id, changeReasonName(reason));
  noteMaybeIdle(run, now);
  if (run.closed) return;
  if (in_completed) {
    openRound(run, reason, node_id, now);
  } else if (run.forming) {
    if (run.reforming && run.expected.empty() && !run.members.empty() &&
        run.members.size() >= run.config.min_nodes) {
      completeRound(run, now);
    } else {
      promoteSpares(run, now);
    }
  }
}

void RendezvousState::cancelJoin(CallId id, TimePoint now) {
  auto j = joins_.find(id);
  if (j == joins_.end()) return;
  Run* run = findRun(j->second.first);
  const std::string node_id = j->second.second;
  joins_.erase(j);
  Node& node = run->nodes.at(node_id);
  node.join.reset();
  node.last_seen = now;
  detachFromRound(*run, node);
  logger("rendezvous")->info("run {}: node {} gave up its join (cancelled)", run->id, node_id);
  // A survivor of the last round stays expected (its retry may come); heartbeats decide if it
  // is gone. A node nobody waits for is forgotten.
  const bool survivor = run->completed && node.prev_round == run->completed_round;
  if (survivor && run->forming) {
    run->expected.insert(node_id);
    deadlines_.insert(now + run->expiry());
  } else if (!survivor) {
    run->nodes.erase(node_id);
    if (run->forming) promoteSpares(*run, now);
    noteMaybeIdle(*run, now);
  }
}

Status RendezvousState::leave(const std::string& run_id, const std::string& node_id,
                              TimePoint now) {
  DDPRUN_RETURN_IF_ERROR(validateIds(run_id, node_id));
  Run* run = findRun(run_id);
  if (run == nullptr && findTombstone(run_id) != nullptr) return Status::ok();
  if (run == nullptr) return runUnknown(run_id);
  removeNode(*run, node_id, ChangeReason::kNodeLeft,
             Status(StatusCode::kCancelled, "node " + node_id + " left the run"), now);
  return Status::ok();
}

StatusOr<uint64_t> RendezvousState::reportFailure(const std::string& run_id,
                                                  const std::string& node_id, uint64_t round,
                                                  TimePoint now, FailureKind kind) {
  DDPRUN_RETURN_IF_ERROR(validateIds(run_id, node_id));
  Run* run = findRun(run_id);
  if ((run == nullptr && findTombstone(run_id) != nullptr) || (run != nullptr && run->closed)) {
    return runClosed(run_id);
  }
  if (run == nullptr) return runUnknown(run_id);
  if (run->nodes.count(node_id) == 0) {
    return notFound("node " + node_id + " is not part of run " + run_id);
  }
  if (round == 0 || round > run->completed_round) {
    return failedPrecondition(
        "round " + std::to_string(round) + " of run " + run_id +
        " has not completed (last completed: " + std::to_string(run->completed_round) + ")");
  }
  if (!run->forming && round == run->completed_round) {
    if (run->completed_rank.count(node_id) == 0) {
      return failedPrecondition("node " + node_id + " is not a participant of round " +
                                std::to_string(round) + " of run " + run_id);
    }
    openRound(*run,
              kind == FailureKind::kRecovery ? ChangeReason::kRecoveryFailed
                                             : ChangeReason::kFailureReported,
              node_id, now);
  }
  return run->forming ? run->round : run->completed_round;
}

Status RendezvousState::close(const std::string& run_id, TimePoint now, std::string reason) {
  DDPRUN_RETURN_IF_ERROR(validateIds(run_id));
  Run* run = findRun(run_id);
  if (run == nullptr && findTombstone(run_id) != nullptr) return Status::ok();
  if (run == nullptr) return runUnknown(run_id);
  if (run->closed) return Status::ok();
  run->closed = true;
  ++closed_runs_;
  run->closed_at = now;
  run->close_reason = std::move(reason);
  // Shrunk to a tombstone by tick() once its watch streams ended, or after the drain timeout.
  if (watchers_.count(run_id) == 0) {
    deadlines_.insert(now);
  } else {
    scheduleCollect(now + retention_.closed_drain_timeout);
  }
  for (auto& [id, node] : run->nodes) {
    finishJoin(node, runClosed(run_id));
  }
  run->spares.clear();
  logger("rendezvous")->info("run {} closed {}", run_id, run->close_reason);
  push(*run, ChangeKind::kClosed, ChangeReason::kNone, "", run->round);
  return Status::ok();
}

// Join timeouts and the last call.
void RendezvousState::expireJoins(Run& run, TimePoint now) {
  // Join timeouts.
  std::vector<std::string> timed_out;
  for (auto& [id, node] : run.nodes) {
    if (node.join && node.join_deadline <= now) timed_out.push_back(id);
  }
  for (const std::string& id : timed_out) {
    Node& node = run.nodes.at(id);
    const std::string msg = std::string(kJoinTimeoutExpired) + "round " +
                            std::to_string(run.round) + " of run " + run.id + ": " +
                            std::to_string(run.members.size()) + " node(s) joined, min_nodes is " +
                            std::to_string(run.config.min_nodes);
    finishJoin(node, deadlineExceeded(msg));
    const bool survivor = run.completed && node.prev_round == run.completed_round;
    if (survivor) {
      node.last_seen = now;
      detachFromRound(run, node);
    } else {
      removeNode(run, id, ChangeReason::kNodeLeft, std::nullopt, now);
    }
  }
  // Last call.
  if (run.forming && run.last_call && *run.last_call <= now &&
      run.members.size() >= run.config.min_nodes) {
    completeRound(run, now);
  }
}

RoundInfo RendezvousState::participantInfo(const Run& run, const std::string& node_id,
                                           uint32_t group_rank) const {
  RoundInfo info;
  info.round = run.completed_round;
  info.node_id = node_id;
  info.group_rank = group_rank;
  info.group_world_size = static_cast<uint32_t>(run.completed->size());
  info.base_rank = run.base_ranks[group_rank];
  info.world_size = run.world_size;
  info.participants = run.completed;
  if (auto master = masterOf(run.id, info.round)) {
    info.master_addr = master->addr;
    info.master_port = master->port;
  }
  return info;
}

}  // namespace ddprun::rendezvous
