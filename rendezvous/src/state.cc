#include "ddprun/rendezvous/state.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <limits>

#include "ddprun/common/log.h"
#include "ddprun/common/strings.h"

namespace ddprun::rendezvous {

const char* changeKindName(ChangeKind kind) {
  switch (kind) {
    case ChangeKind::kSnapshot:
      return "SNAPSHOT";
    case ChangeKind::kRoundPending:
      return "ROUND_PENDING";
    case ChangeKind::kRoundComplete:
      return "ROUND_COMPLETE";
    case ChangeKind::kClosed:
      return "CLOSED";
  }
  return "UNKNOWN";
}

const char* changeReasonName(ChangeReason reason) {
  switch (reason) {
    case ChangeReason::kNone:
      return "NONE";
    case ChangeReason::kNodeJoined:
      return "NODE_JOINED";
    case ChangeReason::kNodeLeft:
      return "NODE_LEFT";
    case ChangeReason::kNodeDead:
      return "NODE_DEAD";
    case ChangeReason::kFailureReported:
      return "FAILURE_REPORTED";
  }
  return "UNKNOWN";
}

namespace {

// Keys under this prefix are written only by the server itself (master addresses).
constexpr const char* kReservedPrefix = "__ddprun/";

std::string masterKey(uint64_t round) {
  return kReservedPrefix + std::string("master/") + std::to_string(round);
}

// "addr:port" as stored by publishMaster.
std::optional<MasterAddress> parseMaster(const std::string& value) {
  auto colon = value.rfind(':');
  if (colon == std::string::npos) return std::nullopt;
  auto port = parseInt(value.substr(colon + 1));
  if (!port || *port <= 0 || *port > 65535) return std::nullopt;
  return MasterAddress{value.substr(0, colon), static_cast<uint32_t>(*port)};
}

double secondsOf(Duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

struct RendezvousState::Node {
  std::string id;
  std::string address;
  uint32_t local_world_size = 0;
  uint64_t arrival = 0;  // order of first arrival: tie-break for ranks and spares
  TimePoint last_seen;
  std::optional<CallId> join;  // pending join; a node with one is alive by definition
  TimePoint join_deadline;
  int64_t prev_rank = -1;  // rank in the last round this node completed
  uint64_t prev_round = 0;
  std::optional<TimePoint> suspect_until;  // its watch broke: dead unless it shows life by then
};

struct RendezvousState::Run {
  std::string id;
  RunConfig config;
  bool closed = false;
  TimePoint closed_at{};
  std::string close_reason;
  // When the run was last used: its idle clock, read once it has no node and no watch stream.
  TimePoint last_active{};
  std::map<std::string, Node> nodes;  // every live node: participants, joiners, spares
  uint64_t arrivals = 0;

  uint64_t round = 1;  // the forming round, or the last completed one when !forming
  bool forming = true;
  std::vector<std::string> members;  // forming: joiners in join order
  std::set<std::string> joined;      // same, as a set
  std::set<std::string> expected;    // survivors of the last round not yet re-joined
  bool reforming = false;            // opened from a completed round with survivors
  std::vector<std::string> spares;   // beyond max_nodes, in arrival order
  std::optional<TimePoint> last_call;

  uint64_t completed_round = 0;
  std::shared_ptr<const std::vector<Participant>> completed;  // rank order
  std::vector<uint32_t> base_ranks;
  uint32_t world_size = 0;
  std::unordered_map<std::string, uint32_t> completed_rank;  // node id -> group rank

  Duration expiry() const { return config.heartbeat_interval * config.heartbeat_misses; }
};

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

RendezvousState::KvSpace& RendezvousState::kvSpace(const std::string& run_id, TimePoint now) {
  auto [it, inserted] = kv_.try_emplace(run_id);
  // A new space may belong to no run: make sure a collection check comes for it.
  if (inserted) scheduleCollect(now + retention_.idle_run_ttl);
  it->second.last_active = now;
  return it->second;
}

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

namespace {

Status validateConfig(const RunConfig& c) {
  if (c.min_nodes == 0 || c.max_nodes < c.min_nodes) {
    return invalidArgument("nnodes " + std::to_string(c.min_nodes) + ":" +
                           std::to_string(c.max_nodes) + " is invalid; need 0 < MIN <= MAX");
  }
  if (c.heartbeat_interval <= Duration::zero() || c.heartbeat_misses == 0) {
    return invalidArgument("heartbeat_interval must be > 0 and heartbeat_misses >= 1");
  }
  if (c.last_call_timeout < Duration::zero()) {
    return invalidArgument("last_call_timeout must be >= 0");
  }
  return Status::ok();
}

}  // namespace

void RendezvousState::join(CallId id, const JoinRequest& req, TimePoint now) {
  auto fail = [&](Status s) { outbox_.joins.push_back({id, std::move(s)}); };
  if (req.run_id.empty()) return fail(invalidArgument("run id is empty"));
  if (req.run_id.size() > limits_.max_id_bytes || req.node_id.size() > limits_.max_id_bytes ||
      req.address.size() > limits_.max_id_bytes) {
    return fail(invalidArgument("run id, node id or address longer than " +
                                std::to_string(limits_.max_id_bytes) + " bytes"));
  }
  if (req.address.empty()) return fail(invalidArgument("node address is empty"));
  if (req.local_world_size == 0) {
    return fail(invalidArgument("local_world_size must be >= 1, got 0"));
  }
  if (req.join_timeout <= Duration::zero()) {
    return fail(invalidArgument("join_timeout must be > 0"));
  }
  if (Status s = validateConfig(req.config); !s.isOk()) return fail(s);

  Run* run = findRun(req.run_id);
  if (run == nullptr && findTombstone(req.run_id) != nullptr) {
    return fail(failedPrecondition("run " + req.run_id + " is closed"));
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
  if (run->closed) return fail(failedPrecondition("run " + req.run_id + " is closed"));

  std::string node_id = req.node_id;
  if (node_id.empty()) {
    do {
      node_id = "node-" + std::to_string(next_node_seq_++);
    } while (run->nodes.count(node_id) != 0);
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
      RoundInfo info;
      info.round = run->completed_round;
      info.node_id = node_id;
      info.group_rank = r->second;
      info.group_world_size = static_cast<uint32_t>(run->completed->size());
      info.base_rank = run->base_ranks[r->second];
      info.world_size = run->world_size;
      info.participants = run->completed;
      if (auto kv = kv_.find(run->id); kv != kv_.end()) {
        auto m = kv->second.data.find(masterKey(info.round));
        if (m != kv->second.data.end()) {
          if (auto master = parseMaster(m->second)) {
            info.master_addr = master->addr;
            info.master_port = master->port;
          }
        }
      }
      outbox_.joins.push_back({id, std::move(info)});
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

StatusOr<RunStatus> RendezvousState::heartbeat(const std::string& run_id,
                                               const std::string& node_id, TimePoint now) {
  Run* run = findRun(run_id);
  if (run == nullptr && findTombstone(run_id) != nullptr) return status(run_id);
  if (run == nullptr) return notFound("run " + run_id + " is unknown to this server");
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

Status RendezvousState::leave(const std::string& run_id, const std::string& node_id,
                              TimePoint now) {
  Run* run = findRun(run_id);
  if (run == nullptr && findTombstone(run_id) != nullptr) return Status::ok();
  if (run == nullptr) return notFound("run " + run_id + " is unknown to this server");
  removeNode(*run, node_id, ChangeReason::kNodeLeft,
             Status(StatusCode::kCancelled, "node " + node_id + " left the run"), now);
  return Status::ok();
}

StatusOr<uint64_t> RendezvousState::reportFailure(const std::string& run_id,
                                                  const std::string& node_id, uint64_t round,
                                                  TimePoint now) {
  Run* run = findRun(run_id);
  if ((run == nullptr && findTombstone(run_id) != nullptr) || (run != nullptr && run->closed)) {
    return failedPrecondition("run " + run_id + " is closed");
  }
  if (run == nullptr) return notFound("run " + run_id + " is unknown to this server");
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
    openRound(*run, ChangeReason::kFailureReported, node_id, now);
  }
  return run->forming ? run->round : run->completed_round;
}

Status RendezvousState::close(const std::string& run_id, TimePoint now, std::string reason) {
  Run* run = findRun(run_id);
  if (run == nullptr && findTombstone(run_id) != nullptr) return Status::ok();
  if (run == nullptr) return notFound("run " + run_id + " is unknown to this server");
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
    finishJoin(node, failedPrecondition("run " + run_id + " is closed"));
  }
  run->spares.clear();
  logger("rendezvous")->info("run {} closed {}", run_id, run->close_reason);
  push(*run, ChangeKind::kClosed, ChangeReason::kNone, "", run->round);
  return Status::ok();
}

StatusOr<RunStatus> RendezvousState::status(const std::string& run_id) const {
  const Run* run = findRun(run_id);
  if (run == nullptr && findTombstone(run_id) != nullptr) {
    RunStatus s;
    s.closed = true;
    return s;
  }
  if (run == nullptr) return notFound("run " + run_id + " is unknown to this server");
  return statusOf(*run);
}

Status RendezvousState::publishMaster(const std::string& run_id, const std::string& node_id,
                                      uint64_t round, const MasterAddress& master, TimePoint now) {
  Run* run = findRun(run_id);
  if (run == nullptr && findTombstone(run_id) != nullptr) {
    return failedPrecondition("run " + run_id + " is closed");
  }
  if (run == nullptr) return notFound("run " + run_id + " is unknown to this server");
  if (master.addr.empty() || master.port == 0 || master.port > 65535) {
    return invalidArgument("master address must be a non-empty host and a port in 1..65535");
  }
  if (round == 0 || round != run->completed_round || !run->completed ||
      run->completed->front().node_id != node_id) {
    return failedPrecondition("node " + node_id + " is not rank 0 of round " +
                              std::to_string(round) + " of run " + run_id);
  }
  kvSpace(run_id, now).data[masterKey(round)] = master.addr + ":" + std::to_string(master.port);
  notifyKeys(run_id, masterKey(round), now);
  return Status::ok();
}

void RendezvousState::waitMaster(CallId id, const std::string& run_id, uint64_t round,
                                 Duration timeout, TimePoint now) {
  if (findRun(run_id) == nullptr && findTombstone(run_id) != nullptr) {
    outbox_.waits.push_back({id, failedPrecondition("run " + run_id + " is closed")});
    return;
  }
  kvWait(id, run_id, {masterKey(round)}, timeout, now);
  auto it = waits_.find(id);
  if (it == waits_.end()) return;  // answered at once
  it->second.master_round = round;
  if (const Run* run = findRun(run_id)) abortMasterWaits(*run);
}

void RendezvousState::abortMasterWaits(const Run& run) {
  // Only the rank 0 of the last completed round can publish (a forming round does not stop it),
  // so a wait for an older round can no longer be answered.
  std::vector<CallId> aborted;
  for (const auto& [id, wait] : waits_) {
    if (wait.run_id == run.id && wait.master_round != 0 &&
        wait.master_round < run.completed_round) {
      aborted.push_back(id);
    }
  }
  for (CallId id : aborted) {
    outbox_.waits.push_back(
        {id, Status(StatusCode::kAborted, "round " + std::to_string(waits_.at(id).master_round) +
                                              " of run " + run.id + " was superseded by round " +
                                              std::to_string(run.completed_round) +
                                              " before its master was published")});
    waits_.erase(id);
  }
}

Status RendezvousState::validateWrite(const std::string& run_id, const std::string& key) const {
  DDPRUN_RETURN_IF_ERROR(validateKey(run_id, key));
  if (startsWith(key, kReservedPrefix)) {
    return invalidArgument("keys under " + std::string(kReservedPrefix) +
                           " are reserved for the rendezvous server");
  }
  return Status::ok();
}

Status RendezvousState::validateKey(const std::string& run_id, const std::string& key) const {
  if (run_id.empty()) return invalidArgument("run id is empty");
  if (run_id.size() > limits_.max_id_bytes) return invalidArgument("run id is too long");
  if (key.empty()) return invalidArgument("key is empty");
  if (key.size() > limits_.max_key_bytes) {
    return invalidArgument("key is " + std::to_string(key.size()) + " bytes, above the limit of " +
                           std::to_string(limits_.max_key_bytes));
  }
  return Status::ok();
}

void RendezvousState::notifyKeys(const std::string& run_id, const std::string& key, TimePoint now) {
  auto space = kv_.find(run_id);
  if (space == kv_.end()) return;
  const auto& kv = space->second.data;
  std::vector<CallId> done;
  for (const auto& [id, wait] : waits_) {
    if (wait.run_id != run_id ||
        std::find(wait.keys.begin(), wait.keys.end(), key) == wait.keys.end()) {
      continue;
    }
    bool all = std::all_of(wait.keys.begin(), wait.keys.end(),
                           [&](const std::string& k) { return kv.count(k) != 0; });
    if (all) done.push_back(id);
  }
  for (CallId id : done) {
    std::vector<std::string> values;
    for (const std::string& k : waits_.at(id).keys) values.push_back(kv.at(k));
    waits_.erase(id);
    outbox_.waits.push_back({id, std::move(values)});
  }
  // A wait kept the space in use; now only its idle clock does.
  if (!done.empty()) scheduleCollect(now + retention_.idle_run_ttl);
}

Status RendezvousState::kvSet(const std::string& run_id, const std::string& key, std::string value,
                              TimePoint now) {
  DDPRUN_RETURN_IF_ERROR(validateWrite(run_id, key));
  if (value.size() > limits_.max_value_bytes) {
    return invalidArgument("value of key " + key + " is " + std::to_string(value.size()) +
                           " bytes, above the limit of " + std::to_string(limits_.max_value_bytes));
  }
  kvSpace(run_id, now).data[key] = std::move(value);
  touch(run_id, now);
  notifyKeys(run_id, key, now);
  return Status::ok();
}

StatusOr<std::string> RendezvousState::kvGet(const std::string& run_id,
                                             const std::string& key) const {
  DDPRUN_RETURN_IF_ERROR(validateKey(run_id, key));
  auto r = kv_.find(run_id);
  if (r == kv_.end()) return notFound("key " + key + " not found in run " + run_id);
  auto it = r->second.data.find(key);
  if (it == r->second.data.end()) return notFound("key " + key + " not found in run " + run_id);
  return it->second;
}

StatusOr<int64_t> RendezvousState::kvAdd(const std::string& run_id, const std::string& key,
                                         int64_t delta, TimePoint now) {
  DDPRUN_RETURN_IF_ERROR(validateWrite(run_id, key));
  auto& kv = kvSpace(run_id, now).data;
  touch(run_id, now);
  int64_t value = 0;
  auto it = kv.find(key);
  if (it != kv.end()) {
    errno = 0;
    char* end = nullptr;
    long long v = std::strtoll(it->second.c_str(), &end, 10);
    if (it->second.empty() || *end != '\0' || errno != 0) {
      return invalidArgument("key " + key + " holds a value that is not an integer");
    }
    value = v;
  }
  if ((delta > 0 && value > std::numeric_limits<int64_t>::max() - delta) ||
      (delta < 0 && value < std::numeric_limits<int64_t>::min() - delta)) {
    return Status(StatusCode::kOutOfRange, "add on key " + key + " overflows int64");
  }
  value += delta;
  kv[key] = std::to_string(value);
  notifyKeys(run_id, key, now);
  return value;
}

StatusOr<std::string> RendezvousState::kvCompareSet(const std::string& run_id,
                                                    const std::string& key,
                                                    const std::string& expected,
                                                    std::string desired, TimePoint now) {
  DDPRUN_RETURN_IF_ERROR(validateWrite(run_id, key));
  if (desired.size() > limits_.max_value_bytes) {
    return invalidArgument("value of key " + key + " is " + std::to_string(desired.size()) +
                           " bytes, above the limit of " + std::to_string(limits_.max_value_bytes));
  }
  auto& kv = kvSpace(run_id, now).data;
  touch(run_id, now);
  auto it = kv.find(key);
  if (it == kv.end()) {
    if (!expected.empty()) return expected;  // c10d: absent key and non-empty expected
    kv[key] = desired;
    notifyKeys(run_id, key, now);
    return desired;
  }
  if (it->second != expected) return it->second;
  it->second = desired;
  notifyKeys(run_id, key, now);
  return desired;
}

StatusOr<bool> RendezvousState::kvDelete(const std::string& run_id, const std::string& key,
                                         TimePoint now) {
  DDPRUN_RETURN_IF_ERROR(validateWrite(run_id, key));
  auto r = kv_.find(run_id);
  if (r == kv_.end()) return false;
  touch(run_id, now);
  return r->second.data.erase(key) != 0;
}

void RendezvousState::kvWait(CallId id, const std::string& run_id, std::vector<std::string> keys,
                             Duration timeout, TimePoint now) {
  if (keys.empty()) {
    outbox_.waits.push_back({id, invalidArgument("wait needs at least one key")});
    return;
  }
  for (const std::string& k : keys) {
    if (Status s = validateKey(run_id, k); !s.isOk()) {
      outbox_.waits.push_back({id, s});
      return;
    }
  }
  touch(run_id, now);
  const auto& kv = kvSpace(run_id, now).data;
  bool all =
      std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return kv.count(k) != 0; });
  if (all) {
    std::vector<std::string> values;
    for (const std::string& k : keys) values.push_back(kv.at(k));
    outbox_.waits.push_back({id, std::move(values)});
    return;
  }
  TimePoint deadline = now + timeout;
  waits_[id] = Wait{run_id, std::move(keys), deadline};
  deadlines_.insert(deadline);
}

void RendezvousState::cancelWait(CallId id, TimePoint now) {
  auto it = waits_.find(id);
  if (it == waits_.end()) return;
  touch(it->second.run_id, now);
  waits_.erase(it);
  scheduleCollect(now + retention_.idle_run_ttl);
}

void RendezvousState::tick(TimePoint now) {
  if (deadlines_.empty() || *deadlines_.begin() > now) return;
  deadlines_.erase(deadlines_.begin(), deadlines_.upper_bound(now));

  std::vector<CallId> expired_waits;
  for (const auto& [id, wait] : waits_) {
    if (wait.deadline <= now) expired_waits.push_back(id);
  }
  for (CallId id : expired_waits) {
    const Wait& w = waits_.at(id);
    outbox_.waits.push_back(
        {id, deadlineExceeded("timed out waiting for key(s) " + ddprun::join(w.keys, ", ") +
                              " of run " + w.run_id)});
    touch(w.run_id, now);
    waits_.erase(id);
  }
  if (!expired_waits.empty()) scheduleCollect(now + retention_.idle_run_ttl);

  for (auto& [run_id, run_ptr] : runs_) {
    Run& run = *run_ptr;
    if (run.closed) continue;
    // Join timeouts.
    std::vector<std::string> timed_out;
    for (auto& [id, node] : run.nodes) {
      if (node.join && node.join_deadline <= now) timed_out.push_back(id);
    }
    for (const std::string& id : timed_out) {
      Node& node = run.nodes.at(id);
      const std::string msg =
          "join_timeout expired waiting for round " + std::to_string(run.round) + " of run " +
          run.id + ": " + std::to_string(run.members.size()) + " node(s) joined, min_nodes is " +
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
  collect(now);
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
    kv_.erase(run_id);
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
    kv_.erase(run_id);
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
  for (CallId id : failed) {
    outbox_.waits.push_back({id, failedPrecondition("run " + run_id + " is closed")});
    waits_.erase(id);
  }
  const Run& run = *runs_.at(run_id);
  for (const auto& [id, node] : run.nodes) {
    if (node.join) joins_.erase(*node.join);  // answered at close; defensive
  }
  runs_.erase(run_id);
  --closed_runs_;
  kv_.erase(run_id);
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
  return c;
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
  for (auto& [id, wait] : waits_) outbox_.waits.push_back({id, status});
  waits_.clear();
}

}  // namespace ddprun::rendezvous
