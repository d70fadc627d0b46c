// RendezvousState, snapshots of one run: export/import for backends that keep the run in a
// shared store (etcd-v3), and the two queries such a backend needs (declareDead, joinOutcome).
//
// The format is private to this file and versioned by its first token: a sequence of fields,
// numbers as decimal followed by a space, strings as "<length>:<bytes>". Every read is bounds
// checked, so a damaged value is an INVALID_ARGUMENT, never a crash.
#include <charconv>
#include <limits>

#include "ddprun/common/log.h"
#include "ddprun/common/strings.h"
#include "ddprun/rendezvous/state.h"
#include "state_internal.h"

namespace ddprun::rendezvous {

namespace {

// v2 adds why the forming round opened; v1 (no reason: as if for the run's first round) is read.
constexpr const char* kMagicRun = "ddprun-run-v2";
constexpr const char* kMagicRunV1 = "ddprun-run-v1";
constexpr const char* kMagicTomb = "ddprun-tomb-v1";

class Writer {
 public:
  void num(uint64_t v) { out_ += std::to_string(v) + ' '; }
  void snum(int64_t v) { out_ += std::to_string(v) + ' '; }
  void str(const std::string& s) {
    out_ += std::to_string(s.size()) + ':';
    out_ += s;
  }
  void time(TimePoint t) { snum(t.time_since_epoch().count()); }
  void dur(Duration d) { snum(d.count()); }
  void optTime(const std::optional<TimePoint>& t) {
    num(t ? 1 : 0);
    if (t) time(*t);
  }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(const std::string& s) : s_(s) {}
  bool ok() const { return ok_; }
  bool atEnd() const { return pos_ == s_.size(); }

  uint64_t num() {
    uint64_t v = 0;
    parse(v);
    return v;
  }
  int64_t snum() {
    int64_t v = 0;
    parse(v);
    return v;
  }
  // A count of items that follow; bounded by what is left, so a bad count cannot allocate much.
  size_t count() {
    const uint64_t n = num();
    if (n > s_.size() - pos_) ok_ = false;
    return ok_ ? static_cast<size_t>(n) : 0;
  }
  std::string str() {
    const size_t n = static_cast<size_t>(num_until(':'));
    if (!ok_ || n > s_.size() - pos_) {
      ok_ = false;
      return {};
    }
    std::string v = s_.substr(pos_, n);
    pos_ += n;
    return v;
  }
  TimePoint time() { return TimePoint(Duration(snum())); }
  Duration dur() { return Duration(snum()); }
  std::optional<TimePoint> optTime() {
    if (num() == 0) return std::nullopt;
    return time();
  }

 private:
  template <typename T>
  void parse(T& v) {
    v = static_cast<T>(num_until(' ', std::is_signed_v<T>));
  }
  int64_t num_until(char sep, bool is_signed = false) {
    if (!ok_) return 0;
    const size_t end = s_.find(sep, pos_);
    if (end == std::string::npos) {
      ok_ = false;
      return 0;
    }
    int64_t v = 0;
    uint64_t u = 0;
    const char* first = s_.data() + pos_;
    const char* last = s_.data() + end;
    std::from_chars_result r =
        is_signed ? std::from_chars(first, last, v) : std::from_chars(first, last, u);
    if (r.ec != std::errc() || r.ptr != last || first == last) {
      ok_ = false;
      return 0;
    }
    pos_ = end + 1;
    return is_signed ? v : static_cast<int64_t>(u);
  }

  const std::string& s_;
  size_t pos_ = 0;
  bool ok_ = true;
};

}  // namespace

std::string RendezvousState::exportRun(const std::string& run_id) const {
  Writer w;
  const Run* run = findRun(run_id);
  if (run == nullptr) {
    const Tombstone* tomb = findTombstone(run_id);
    if (tomb == nullptr) return {};
    w.str(kMagicTomb);
    w.time(tomb->closed_at);
    w.str(tomb->reason);
    return w.take();
  }
  w.str(kMagicRun);
  const RunConfig& c = run->config;
  w.num(c.min_nodes);
  w.num(c.max_nodes);
  w.dur(c.last_call_timeout);
  w.dur(c.heartbeat_interval);
  w.num(c.heartbeat_misses);
  w.num(run->closed ? 1 : 0);
  w.time(run->closed_at);
  w.str(run->close_reason);
  w.time(run->last_active);
  w.num(run->arrivals);
  w.num(run->nodes.size());
  for (const auto& [id, n] : run->nodes) {
    w.str(n.id);
    w.str(n.address);
    w.num(n.local_world_size);
    w.num(n.arrival);
    w.time(n.last_seen);
    w.num(n.join ? 1 : 0);
    if (n.join) w.num(*n.join);
    w.time(n.join_deadline);
    w.snum(n.prev_rank);
    w.num(n.prev_round);
    w.optTime(n.suspect_until);
  }
  w.num(run->round);
  w.num(run->forming ? 1 : 0);
  w.num(run->members.size());
  for (const std::string& m : run->members) w.str(m);
  w.num(run->expected.size());
  for (const std::string& e : run->expected) w.str(e);
  w.num(run->reforming ? 1 : 0);
  w.num(run->spares.size());
  for (const std::string& s : run->spares) w.str(s);
  w.optTime(run->last_call);
  w.num(run->completed_round);
  const size_t completed = run->completed ? run->completed->size() : 0;
  w.num(completed);
  for (size_t i = 0; i < completed; ++i) {
    const Participant& p = run->completed->at(i);
    w.str(p.node_id);
    w.str(p.address);
    w.num(p.local_world_size);
    w.num(run->base_ranks.at(i));
  }
  w.num(run->world_size);
  w.num(run->masters.size());
  for (const auto& [round, m] : run->masters) {
    w.num(round);
    w.str(m.addr);
    w.num(m.port);
  }
  w.num(static_cast<uint64_t>(run->pending_reason));
  w.str(run->pending_cause);
  return w.take();
}

Status RendezvousState::importRun(const std::string& run_id, const std::string& snapshot) {
  auto bad = [&](const std::string& what) {
    return invalidArgument("stored rendezvous state of run " + run_id + " is unreadable (" + what +
                           ")");
  };
  // Forget what this state holds of the run.
  if (Run* old = findRun(run_id)) {
    for (const auto& [id, node] : old->nodes) {
      if (node.join) joins_.erase(*node.join);
    }
    if (old->closed) --closed_runs_;
    runs_.erase(run_id);
  }
  if (auto t = tombstones_.find(run_id); t != tombstones_.end()) {
    tombstones_by_close_.erase({t->second.closed_at, run_id});
    tombstones_.erase(t);
  }
  if (snapshot.empty()) return Status::ok();

  Reader r(snapshot);
  const std::string magic = r.str();
  if (magic == kMagicTomb) {
    const TimePoint closed_at = r.time();
    std::string reason = r.str();
    if (!r.ok() || !r.atEnd()) return bad("tombstone");
    tombstones_[run_id] = Tombstone{closed_at, std::move(reason)};
    tombstones_by_close_.insert({closed_at, run_id});
    return Status::ok();
  }
  if (magic != kMagicRun && magic != kMagicRunV1) return bad("unknown format");

  auto run = std::make_unique<Run>();
  run->id = run_id;
  RunConfig& c = run->config;
  c.min_nodes = static_cast<uint32_t>(r.num());
  c.max_nodes = static_cast<uint32_t>(r.num());
  c.last_call_timeout = r.dur();
  c.heartbeat_interval = r.dur();
  c.heartbeat_misses = static_cast<uint32_t>(r.num());
  run->closed = r.num() != 0;
  run->closed_at = r.time();
  run->close_reason = r.str();
  run->last_active = r.time();
  run->arrivals = r.num();
  const size_t nodes = r.count();
  for (size_t i = 0; i < nodes && r.ok(); ++i) {
    Node n;
    n.id = r.str();
    n.address = r.str();
    n.local_world_size = static_cast<uint32_t>(r.num());
    n.arrival = r.num();
    n.last_seen = r.time();
    if (r.num() != 0) n.join = r.num();
    n.join_deadline = r.time();
    n.prev_rank = r.snum();
    n.prev_round = r.num();
    n.suspect_until = r.optTime();
    run->nodes[n.id] = std::move(n);
  }
  run->round = r.num();
  run->forming = r.num() != 0;
  const size_t members = r.count();
  for (size_t i = 0; i < members && r.ok(); ++i) run->members.push_back(r.str());
  run->joined.insert(run->members.begin(), run->members.end());
  const size_t expected = r.count();
  for (size_t i = 0; i < expected && r.ok(); ++i) run->expected.insert(r.str());
  run->reforming = r.num() != 0;
  const size_t spares = r.count();
  for (size_t i = 0; i < spares && r.ok(); ++i) run->spares.push_back(r.str());
  run->last_call = r.optTime();
  run->completed_round = r.num();
  const size_t completed = r.count();
  if (completed > 0) {
    auto participants = std::make_shared<std::vector<Participant>>();
    for (size_t i = 0; i < completed && r.ok(); ++i) {
      Participant p;
      p.node_id = r.str();
      p.address = r.str();
      p.local_world_size = static_cast<uint32_t>(r.num());
      p.group_rank = static_cast<uint32_t>(i);
      run->base_ranks.push_back(static_cast<uint32_t>(r.num()));
      run->completed_rank[p.node_id] = p.group_rank;
      participants->push_back(std::move(p));
    }
    run->completed = std::move(participants);
  }
  run->world_size = static_cast<uint32_t>(r.num());
  const size_t masters = r.count();
  for (size_t i = 0; i < masters && r.ok(); ++i) {
    const uint64_t round = r.num();
    MasterAddress m;
    m.addr = r.str();
    m.port = static_cast<uint32_t>(r.num());
    run->masters[round] = std::move(m);
  }
  if (magic == kMagicRun) {
    const uint64_t reason = r.num();
    if (reason > static_cast<uint64_t>(ChangeReason::kRecoveryFailed)) return bad("round reason");
    run->pending_reason = static_cast<ChangeReason>(reason);
    run->pending_cause = r.str();
  }
  if (!r.ok() || !r.atEnd()) return bad("truncated or damaged");
  // Every name a round refers to must be a node of the run.
  for (const std::string& id : run->members) {
    if (run->nodes.count(id) == 0) return bad("member " + id + " is not a node");
  }
  for (const std::string& id : run->spares) {
    if (run->nodes.count(id) == 0) return bad("spare " + id + " is not a node");
  }
  if (c.min_nodes == 0 || c.max_nodes < c.min_nodes || c.heartbeat_misses == 0) {
    return bad("run config");
  }

  // Rebuild the indexes and the deadlines tick() looks at.
  for (const auto& [id, node] : run->nodes) {
    if (node.join) {
      joins_[*node.join] = {run_id, id};
      deadlines_.insert(node.join_deadline);
    } else {
      deadlines_.insert(node.last_seen + run->expiry());
    }
    if (node.suspect_until) deadlines_.insert(*node.suspect_until);
  }
  if (run->last_call) deadlines_.insert(*run->last_call);
  if (run->closed) {
    ++closed_runs_;
    deadlines_.insert(run->closed_at);
  }
  runs_.emplace(run_id, std::move(run));
  return Status::ok();
}

Status RendezvousState::declareDead(const std::string& run_id, const std::string& node_id,
                                    TimePoint now) {
  Run* run = findRun(run_id);
  if (run == nullptr || run->nodes.count(node_id) == 0) {
    return notFound("node " + node_id + " is not part of run " + run_id);
  }
  if (run->closed) return Status::ok();
  logger("rendezvous")->warn("run {}: node {} lost its lease, declared dead", run_id, node_id);
  removeNode(*run, node_id, ChangeReason::kNodeDead,
             Status(StatusCode::kNotFound, "node " + node_id + " was declared dead"), now);
  return Status::ok();
}

StatusOr<std::optional<RoundInfo>> RendezvousState::joinOutcome(const std::string& run_id,
                                                                const std::string& node_id) const {
  const Run* run = findRun(run_id);
  if ((run == nullptr && findTombstone(run_id) != nullptr) || (run != nullptr && run->closed)) {
    return runClosed(run_id);
  }
  if (run == nullptr) return notFound("run " + run_id + " is unknown");
  auto it = run->nodes.find(node_id);
  if (it == run->nodes.end()) {
    return notFound("node " + node_id + " is no longer part of run " + run_id +
                    " (its join timed out, it left, or it was declared dead)");
  }
  if (it->second.join) return std::optional<RoundInfo>{};
  auto r = run->completed_rank.find(node_id);
  if (r == run->completed_rank.end()) {
    // Not pending and not a participant: a survivor whose join timed out, or a spare.
    return std::optional<RoundInfo>{};
  }
  return std::optional<RoundInfo>{participantInfo(*run, node_id, r->second)};
}

std::vector<std::string> RendezvousState::nodeIds(const std::string& run_id) const {
  std::vector<std::string> out;
  if (const Run* run = findRun(run_id)) {
    for (const auto& [id, node] : run->nodes) out.push_back(id);
  }
  return out;
}

}  // namespace ddprun::rendezvous
