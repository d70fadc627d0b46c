// Unit tests of the pure rendezvous state machine: time is a FakeClock, no sockets.
#include "ddprun/rendezvous/state.h"

#include <catch2/catch.hpp>
#include <map>

#include "fake_clock.h"

using namespace ddprun;
using namespace ddprun::rendezvous;

namespace {

class Harness {
 public:
  explicit Harness(uint32_t min, uint32_t max, RunRetention retention = {}, StateLimits limits = {})
      : state(limits, retention) {
    config.min_nodes = min;
    config.max_nodes = max;
    config.last_call_timeout = seconds(10);
    config.heartbeat_interval = seconds(5);
    config.heartbeat_misses = 3;
  }

  // Starts a join of `node` and returns its call id.
  RendezvousState::CallId join(const std::string& node, uint32_t lws = 1) {
    JoinRequest req;
    req.run_id = run_id;
    req.node_id = node;
    req.address = node + ".host";
    req.local_world_size = lws;
    req.config = config;
    req.join_timeout = join_timeout;
    RendezvousState::CallId id = next_id++;
    calls[id] = node;
    state.join(id, req, clock.now());
    collect();
    return id;
  }

  void advance(Duration d) {
    clock.advance(d);
    state.tick(clock.now());
    collect();
  }

  void collect() {
    auto out = state.drain();
    for (auto& j : out.joins) {
      if (j.result.isOk()) {
        done[calls[j.id]] = j.result.value();
      } else {
        errors[calls[j.id]] = j.result.status();
      }
    }
    for (auto& w : out.waits) waits.emplace(w.id, w.values);
    for (auto& m : out.masters) masters.emplace(m.id, m.master);
    for (auto& c : out.changes) changes.push_back(c.change);
  }

  bool completed(const std::string& node) const { return done.count(node) != 0; }
  uint32_t rank(const std::string& node) const { return done.at(node).group_rank; }
  const RoundChange* lastChange(ChangeKind kind) const {
    for (auto it = changes.rbegin(); it != changes.rend(); ++it) {
      if (it->kind == kind) return &*it;
    }
    return nullptr;
  }
  // Forgets answers so the next round's can be told apart.
  void clearAnswers() {
    done.clear();
    errors.clear();
    changes.clear();
  }
  void heartbeatAll(std::initializer_list<const char*> nodes) {
    for (const char* n : nodes) REQUIRE(state.heartbeat("job", n, clock.now()).isOk());
  }

  testing::FakeClock clock;
  RendezvousState state;
  std::string run_id = "job";
  RunConfig config;
  Duration join_timeout = seconds(600);
  RendezvousState::CallId next_id = 1;
  std::map<RendezvousState::CallId, std::string> calls;
  std::map<std::string, RoundInfo> done;
  std::map<std::string, Status> errors;
  std::map<RendezvousState::CallId, StatusOr<std::vector<std::string>>> waits;
  std::map<RendezvousState::CallId, StatusOr<MasterAddress>> masters;  // waitMaster answers
  std::vector<RoundChange> changes;
};

}  // namespace

TEST_CASE("a join below min_nodes waits", "[rendezvous][state]") {
  Harness h(2, 4);
  h.join("a");
  h.advance(seconds(100));
  CHECK_FALSE(h.completed("a"));
  CHECK(h.errors.empty());
  CHECK(h.state.status("job")->waiting == 1);
  CHECK(h.state.nextDeadline().has_value());  // the join timeout
}

TEST_CASE("reaching min_nodes starts the last call, which completes the round when it expires",
          "[rendezvous][state]") {
  Harness h(2, 4);
  h.join("a");
  h.join("b");
  CHECK_FALSE(h.completed("a"));
  REQUIRE(h.state.nextDeadline() == h.clock.now() + seconds(10));
  h.advance(seconds(9));
  CHECK_FALSE(h.completed("a"));
  h.advance(seconds(1));
  REQUIRE(h.completed("a"));
  REQUIRE(h.completed("b"));
  CHECK(h.done["a"].round == 1);
  CHECK(h.done["a"].group_world_size == 2);
  CHECK(h.rank("a") == 0);
  CHECK(h.rank("b") == 1);
  REQUIRE(h.lastChange(ChangeKind::kRoundComplete) != nullptr);
}

TEST_CASE("a joiner during the last call re-arms it, as torchrun", "[rendezvous][state]") {
  Harness h(2, 4);
  h.join("a");
  h.join("b");
  h.advance(seconds(6));
  h.join("c");
  h.advance(seconds(6));
  CHECK_FALSE(h.completed("a"));
  h.advance(seconds(4));
  CHECK(h.completed("c"));
  CHECK(h.done["c"].group_world_size == 3);
}

TEST_CASE("reaching max_nodes completes the round at once", "[rendezvous][state]") {
  Harness h(2, 3);
  h.join("a");
  h.join("b");
  h.join("c");
  REQUIRE(h.done.size() == 3);
  for (auto& [node, info] : h.done) {
    CHECK(info.group_world_size == 3);
    CHECK(info.participants->size() == 3);
    CHECK(info.participants->at(info.group_rank).node_id == node);
  }
}

TEST_CASE("a join after completion opens the next round and pushes the change",
          "[rendezvous][state]") {
  Harness h(1, 3);
  h.join("a");
  h.join("b");
  h.advance(seconds(10));
  REQUIRE(h.done.size() == 2);
  h.clearAnswers();
  h.join("c");
  CHECK_FALSE(h.completed("c"));
  const RoundChange* change = h.lastChange(ChangeKind::kRoundPending);
  REQUIRE(change != nullptr);
  CHECK(change->round == 2);
  CHECK(change->reason == ChangeReason::kNodeJoined);
  CHECK(change->node_id == "c");
  CHECK(change->status.completed_round == 1);
  CHECK(change->status.pending_round == 2);
  // The survivors re-join; once all of them are back the round completes without a last call.
  h.join("a");
  CHECK_FALSE(h.completed("a"));
  h.join("b");
  REQUIRE(h.done.size() == 3);
  CHECK(h.done["c"].round == 2);
  CHECK(h.rank("a") == 0);
  CHECK(h.rank("b") == 1);
  CHECK(h.rank("c") == 2);
}

TEST_CASE("a node beyond max_nodes becomes a spare and is promoted when a participant dies",
          "[rendezvous][state]") {
  Harness h(2, 2);
  h.join("a");
  h.join("b");
  REQUIRE(h.done.size() == 2);
  h.join("s");
  CHECK_FALSE(h.completed("s"));
  CHECK(h.state.status("job")->spares == 1);
  CHECK(h.lastChange(ChangeKind::kRoundPending) == nullptr);  // spares do not disturb the round
  h.clearAnswers();
  // a keeps beating, b falls silent.
  for (int i = 0; i < 4; ++i) {
    h.advance(seconds(5));
    h.heartbeatAll({"a"});
  }
  const RoundChange* change = h.lastChange(ChangeKind::kRoundPending);
  REQUIRE(change != nullptr);
  CHECK(change->reason == ChangeReason::kNodeDead);
  CHECK(change->node_id == "b");
  h.join("a");
  REQUIRE(h.completed("s"));
  REQUIRE(h.completed("a"));
  CHECK(h.rank("a") == 0);
  CHECK(h.rank("s") == 1);
  CHECK(h.state.status("job")->spares == 0);
}

TEST_CASE(
    "a node new to a run is refused while max_run_spares spares wait, and taken once fewer do",
    "[rendezvous][state]") {
  StateLimits limits;
  limits.max_run_spares = 2;
  Harness h(2, 2, {}, limits);
  h.join("a");
  h.join("b");
  REQUIRE(h.done.size() == 2);
  h.join("s1");
  h.join("s2");
  REQUIRE(h.state.status("job")->spares == 2);
  h.join("s3");
  REQUIRE(h.errors.count("s3") == 1);
  CHECK(h.errors["s3"].code() == StatusCode::kResourceExhausted);
  CHECK(h.errors["s3"].message() ==
        "run job already has 2 nodes waiting beyond nnodes MAX 2 (spares): max-run-spares = 2 "
        "(ddprun-rendezvous --max-run-spares)");
  CHECK(h.state.status("job")->spares == 2);
  // A spare asking again is no new node: its earlier call is superseded, not refused.
  h.join("s1");
  REQUIRE(h.errors.count("s1") == 1);
  CHECK(h.errors["s1"].code() == StatusCode::kAborted);
  CHECK(h.state.status("job")->spares == 2);
  // b falls silent: s1 takes its place, one spare is left, and s3 is taken as a spare now.
  h.clearAnswers();
  for (int i = 0; i < 4; ++i) {
    h.advance(seconds(5));
    h.heartbeatAll({"a"});
  }
  h.join("a");
  REQUIRE(h.completed("s1"));
  REQUIRE(h.state.status("job")->spares == 1);
  h.join("s3");
  CHECK(h.errors.count("s3") == 0);
  CHECK(h.state.status("job")->spares == 2);
  // The bound is per run.
  h.run_id = "other";
  for (const char* n : {"x", "y", "z1", "z2"}) h.join(n);
  CHECK(h.errors.empty());
  CHECK(h.state.status("other")->spares == 2);
}

TEST_CASE("a join that would create a run past max_runs is refused, and taken once one went",
          "[rendezvous][state]") {
  StateLimits limits;
  limits.max_runs = 2;
  Harness h(1, 1, {}, limits);
  h.run_id = "r1";
  h.join("a");
  h.run_id = "r2";
  h.join("b");
  REQUIRE(h.completed("a"));
  REQUIRE(h.completed("b"));
  h.run_id = "r3";
  h.join("c");
  REQUIRE(h.errors.count("c") == 1);
  CHECK(h.errors["c"].code() == StatusCode::kResourceExhausted);
  CHECK(h.errors["c"].message() ==
        "run r3 would be one run more than the 2 this rendezvous holds: max-runs = 2 "
        "(ddprun-rendezvous --max-runs; a run goes once closed, or unused for --idle-run-ttl)");
  CHECK(h.state.status("r3").status().code() == StatusCode::kNotFound);
  // The runs it holds go on: a node of r1 asking again is answered.
  h.clearAnswers();
  h.run_id = "r1";
  h.join("a");
  CHECK(h.completed("a"));
  // r2 closes: once it shrank to its tombstone (no watcher), r3 is created.
  REQUIRE(h.state.close("r2", h.clock.now()).isOk());
  h.advance(seconds(1));
  h.clearAnswers();
  h.run_id = "r3";
  h.join("c");
  CHECK(h.completed("c"));
  CHECK(h.state.census().runs == 2);
}

TEST_CASE("missed heartbeats remove a node and start a new round for the survivors",
          "[rendezvous][state]") {
  Harness h(2, 3);
  h.join("a");
  h.join("b");
  h.join("c");
  REQUIRE(h.done.size() == 3);
  h.clearAnswers();
  for (int i = 0; i < 3; ++i) {
    h.advance(seconds(5));
    h.heartbeatAll({"a", "c"});
  }
  h.advance(seconds(5));
  const RoundChange* change = h.lastChange(ChangeKind::kRoundPending);
  REQUIRE(change != nullptr);
  CHECK(change->reason == ChangeReason::kNodeDead);
  CHECK(change->node_id == "b");
  CHECK(change->round == 2);
  CHECK_FALSE(h.state.heartbeat("job", "b", h.clock.now()).isOk());
  h.join("c");
  h.join("a");
  REQUIRE(h.done.size() == 2);
  CHECK(h.done["a"].round == 2);
  CHECK(h.rank("a") == 0);
  CHECK(h.rank("c") == 1);  // rank 2 is out of range now; c takes the free rank
}

TEST_CASE("survivors below min_nodes wait for the round to refill", "[rendezvous][state]") {
  Harness h(2, 2);
  h.join("a");
  h.join("b");
  h.clearAnswers();
  REQUIRE(h.state.leave("job", "b", h.clock.now()).isOk());
  h.collect();
  h.join("a");
  h.advance(seconds(60));
  CHECK_FALSE(h.completed("a"));
  h.join("c");
  REQUIRE(h.completed("a"));
  CHECK(h.rank("a") == 0);
  CHECK(h.rank("c") == 1);
}

TEST_CASE("falling below min_nodes clears the last call", "[rendezvous][state]") {
  Harness h(2, 4);
  auto b = h.join("b");
  h.join("a");
  REQUIRE(h.state.nextDeadline() == h.clock.now() + seconds(10));
  h.state.cancelJoin(b, h.clock.now());  // b's client went away mid-join
  h.collect();
  h.advance(seconds(30));
  CHECK_FALSE(h.completed("a"));
  CHECK(h.errors.empty());  // a cancelled join is not answered
  CHECK(h.state.status("job")->waiting == 1);
  h.join("c");
  h.advance(seconds(10));
  CHECK(h.completed("a"));
  CHECK(h.completed("c"));
  CHECK_FALSE(h.completed("b"));
}

TEST_CASE("close refuses later joins and fails pending ones", "[rendezvous][state]") {
  Harness h(2, 2);
  h.join("a");
  REQUIRE(h.state.close("job", h.clock.now()).isOk());
  h.collect();
  REQUIRE(h.errors.count("a"));
  CHECK(h.errors["a"].code() == StatusCode::kFailedPrecondition);
  CHECK(h.errors["a"].message() == "run job is closed");
  REQUIRE(h.lastChange(ChangeKind::kClosed) != nullptr);
  h.join("b");
  REQUIRE(h.errors.count("b"));
  CHECK(h.errors["b"].code() == StatusCode::kFailedPrecondition);
  CHECK(h.errors["b"].message() == "run job is closed");
}

TEST_CASE("a join that waits past join_timeout fails with DEADLINE_EXCEEDED",
          "[rendezvous][state]") {
  Harness h(3, 3);
  h.join_timeout = seconds(20);
  h.join("a");
  h.join("b");
  h.advance(seconds(19));
  CHECK(h.errors.empty());
  h.advance(seconds(1));
  REQUIRE(h.errors.size() == 2);
  CHECK(h.errors["a"].code() == StatusCode::kDeadlineExceeded);
  CHECK(h.state.status("job")->waiting == 0);
}

TEST_CASE("group ranks stay stable across rounds and rank 0 moves only when its node is gone",
          "[rendezvous][state]") {
  Harness h(1, 4);
  h.join("a");
  h.join("b");
  h.join("c");
  h.join("d");
  REQUIRE(h.done.size() == 4);
  std::map<std::string, uint32_t> first;
  for (auto& [n, info] : h.done) first[n] = info.group_rank;
  h.clearAnswers();
  // A failure: everyone re-joins, in reverse order; ranks do not change.
  REQUIRE(h.state.reportFailure("job", "c", 1, h.clock.now()).isOk());
  h.collect();
  for (const char* n : {"d", "c", "b", "a"}) h.join(n);
  REQUIRE(h.done.size() == 4);
  for (auto& [n, r] : first) CHECK(h.rank(n) == r);
  // The node holding the middle rank leaves: survivors keep theirs, the top rank fills the hole.
  std::string rank0, rank1, rank3;
  for (auto& [n, r] : first) {
    if (r == 0) rank0 = n;
    if (r == 1) rank1 = n;
    if (r == 3) rank3 = n;
  }
  h.clearAnswers();
  REQUIRE(h.state.leave("job", rank1, h.clock.now()).isOk());
  h.collect();
  for (auto& [n, r] : first) {
    if (n != rank1) h.join(n);
  }
  REQUIRE(h.done.size() == 3);
  CHECK(h.rank(rank0) == 0);
  CHECK(h.rank(rank3) == 1);
  // Rank 0's node leaves: rank 0 moves.
  h.clearAnswers();
  REQUIRE(h.state.leave("job", rank0, h.clock.now()).isOk());
  h.collect();
  for (auto& [n, r] : first) {
    if (n != rank1 && n != rank0) h.join(n);
  }
  REQUIRE(h.done.size() == 2);
  CHECK(h.rank(rank3) == 1);
  for (auto& [n, info] : h.done) CHECK(info.group_rank < 2);
}

TEST_CASE("nodes with different local world sizes get contiguous worker ranks",
          "[rendezvous][state]") {
  Harness h(2, 2);
  h.join("a", 4);
  h.join("b", 2);
  REQUIRE(h.done.size() == 2);
  CHECK(h.done["a"].world_size == 6);
  CHECK(h.done["a"].base_rank == 0);
  CHECK(h.done["b"].base_rank == 4);
  CHECK(h.done["b"].participants->at(0).local_world_size == 4);
  CHECK(h.done["b"].participants->at(1).local_world_size == 2);
}

TEST_CASE("a failure report opens one new round that every node joins", "[rendezvous][state]") {
  Harness h(2, 2);
  h.join("a");
  h.join("b");
  h.clearAnswers();
  auto next = h.state.reportFailure("job", "b", 1, h.clock.now());
  REQUIRE(next.isOk());
  CHECK(next.value() == 2);
  // The other node reports the same failure: absorbed, no second round.
  auto again = h.state.reportFailure("job", "a", 1, h.clock.now());
  REQUIRE(again.isOk());
  CHECK(again.value() == 2);
  h.collect();
  REQUIRE(h.changes.size() == 1);
  CHECK(h.changes[0].reason == ChangeReason::kFailureReported);
  h.join("a");
  h.join("b");
  REQUIRE(h.done.size() == 2);
  CHECK(h.done["a"].round == 2);
  // A spare cannot report a failure of a round it is not part of.
  h.join("s");
  CHECK(h.state.reportFailure("job", "s", 2, h.clock.now()).status().code() ==
        StatusCode::kFailedPrecondition);
}

TEST_CASE("a failed in-place recovery's report opens a RECOVERY_FAILED round, absorbed like others",
          "[rendezvous][state]") {
  Harness h(2, 2);
  h.join("a");
  h.join("b");
  h.clearAnswers();
  auto next = h.state.reportFailure("job", "b", 1, h.clock.now(), FailureKind::kRecovery);
  REQUIRE(next.isOk());
  CHECK(next.value() == 2);
  // A new failure reported meanwhile is the same round (its charge is each node's own).
  auto again = h.state.reportFailure("job", "a", 1, h.clock.now(), FailureKind::kWorkers);
  REQUIRE(again.isOk());
  CHECK(again.value() == 2);
  h.collect();
  REQUIRE(h.changes.size() == 1);
  CHECK(h.changes[0].reason == ChangeReason::kRecoveryFailed);
  CHECK(h.changes[0].node_id == "b");
  CHECK(std::string(changeReasonName(h.changes[0].reason)) == "RECOVERY_FAILED");
}

TEST_CASE("a graceful leave starts a new round at once", "[rendezvous][state]") {
  Harness h(1, 3);
  h.join("a");
  h.join("b");
  h.join("c");
  h.clearAnswers();
  REQUIRE(h.state.leave("job", "c", h.clock.now()).isOk());
  h.collect();
  const RoundChange* change = h.lastChange(ChangeKind::kRoundPending);
  REQUIRE(change != nullptr);
  CHECK(change->reason == ChangeReason::kNodeLeft);
  CHECK(change->node_id == "c");
  h.join("a");
  h.join("b");
  REQUIRE(h.done.size() == 2);
  CHECK(h.done["a"].round == 2);
}

TEST_CASE("a completed participant joining again gets its round back", "[rendezvous][state]") {
  Harness h(1, 1);
  h.join("a");
  REQUIRE(h.completed("a"));
  REQUIRE(h.state.publishMaster("job", "a", 1, {"a.host", 29500}, h.clock.now()).isOk());
  h.clearAnswers();
  h.join("a");
  REQUIRE(h.completed("a"));
  CHECK(h.done["a"].round == 1);
  CHECK(h.done["a"].master_addr == "a.host");
  CHECK(h.done["a"].master_port == 29500);
  CHECK(h.changes.empty());
}

TEST_CASE("bad joins get precise errors and leave the run intact", "[rendezvous][state]") {
  Harness h(2, 4);
  h.join("a");
  h.config.max_nodes = 5;
  h.join("x");
  REQUIRE(h.errors.count("x"));
  CHECK(h.errors["x"].code() == StatusCode::kFailedPrecondition);
  CHECK(h.errors["x"].message() == "run job has nnodes 2:4 but this node asked for 2:5");
  h.config.max_nodes = 4;
  h.join("y", 0);
  CHECK(h.errors["y"].code() == StatusCode::kInvalidArgument);
  JoinRequest empty;
  empty.address = "h";
  h.calls[999] = "empty";
  h.state.join(999, empty, h.clock.now());
  h.collect();
  CHECK(h.errors["empty"].code() == StatusCode::kInvalidArgument);
  CHECK(h.errors["empty"].message() == "run id is empty");
  h.join("b");
  h.advance(seconds(10));
  CHECK(h.completed("a"));
  CHECK(h.completed("b"));
}

TEST_CASE("only rank 0 of a completed round may publish the master", "[rendezvous][state]") {
  Harness h(2, 2);
  h.join("a");
  h.join("b");
  auto st = h.state.publishMaster("job", "b", 1, {"b.host", 1234}, h.clock.now());
  CHECK(st.code() == StatusCode::kFailedPrecondition);
  h.state.waitMaster(7, "job", 1, seconds(5), h.clock.now());
  h.collect();
  CHECK(h.masters.empty());
  REQUIRE(h.state.publishMaster("job", "a", 1, {"a.host", 1234}, h.clock.now()).isOk());
  h.collect();
  REQUIRE(h.masters.count(7));
  CHECK(h.masters.at(7).value().addr == "a.host");
  CHECK(h.masters.at(7).value().port == 1234);
  // The server's reserved key still reads it, derived from the typed master.
  CHECK(h.state.kvGet("job", "__ddprun/master/1").value() == "a.host:1234");
}

TEST_CASE("waiting for the master of a superseded round fails with ABORTED",
          "[rendezvous][state]") {
  Harness h(2, 2);
  h.join("a");
  h.join("b");
  const std::string rank0 = h.done["a"].group_rank == 0 ? "a" : "b";
  h.state.waitMaster(7, "job", 1, seconds(60), h.clock.now());
  h.state.waitMaster(9, "job", 1, seconds(60), h.clock.now());
  REQUIRE(h.state.reportFailure("job", "b", 1, h.clock.now()).isOk());
  h.collect();
  // Round 2 is only forming: rank 0 of round 1 can still publish, and the waiters get it.
  CHECK(h.masters.empty());
  REQUIRE(h.state.publishMaster("job", rank0, 1, {"m", 1}, h.clock.now()).isOk());
  h.collect();
  REQUIRE(h.masters.count(7));
  CHECK(h.masters.at(7).isOk());
  // Waiting for round 2's master, which round 3 then supersedes before anyone published it.
  h.join("a");
  h.join("b");
  REQUIRE(h.done["a"].round == 2);
  h.state.waitMaster(11, "job", 2, seconds(60), h.clock.now());
  REQUIRE(h.state.reportFailure("job", "a", 2, h.clock.now()).isOk());
  h.join("a");
  h.join("b");
  REQUIRE(h.masters.count(11));
  CHECK(h.masters.at(11).status().code() == StatusCode::kAborted);
  // Asking for round 2's master now fails at once.
  h.state.waitMaster(12, "job", 2, seconds(60), h.clock.now());
  h.collect();
  REQUIRE(h.masters.count(12));
  CHECK(h.masters.at(12).status().code() == StatusCode::kAborted);
}

TEST_CASE("the key-value store supports set, get, add, compare-set, wait and delete",
          "[rendezvous][state]") {
  Harness h(1, 1);
  auto& s = h.state;
  auto now = h.clock.now();
  CHECK(s.kvGet("job", "k").status().code() == StatusCode::kNotFound);
  REQUIRE(s.kvSet("job", "k", "v1", now).isOk());
  CHECK(s.kvGet("job", "k").value() == "v1");
  CHECK(s.kvGet("other", "k").status().code() == StatusCode::kNotFound);  // per run
  CHECK(s.kvAdd("job", "n", 5, now).value() == 5);
  CHECK(s.kvAdd("job", "n", -2, now).value() == 3);
  CHECK(s.kvAdd("job", "k", 1, now).status().code() == StatusCode::kInvalidArgument);
  CHECK(s.kvCompareSet("job", "k", "wrong", "v2", now).value() == "v1");
  CHECK(s.kvCompareSet("job", "k", "v1", "v2", now).value() == "v2");
  CHECK(s.kvCompareSet("job", "new", "", "x", now).value() == "x");
  CHECK(s.kvGet("job", "new").value() == "x");
  CHECK(s.kvSet("job", "big", std::string((1 << 20) + 1, 'x'), now).code() ==
        StatusCode::kInvalidArgument);
  CHECK(s.kvDelete("job", "k", now).value());
  CHECK_FALSE(s.kvDelete("job", "k", now).value());

  s.kvWait(1, "job", {"w1", "w2"}, seconds(5), now);
  s.kvWait(2, "job", {"never"}, seconds(5), now);
  h.collect();
  CHECK(h.waits.empty());
  REQUIRE(s.kvSet("job", "w1", "1", now).isOk());
  h.collect();
  CHECK(h.waits.empty());
  REQUIRE(s.kvSet("job", "w2", "2", now).isOk());
  h.collect();
  REQUIRE(h.waits.count(1));
  CHECK(h.waits.at(1).value() == std::vector<std::string>{"1", "2"});
  h.advance(seconds(5));
  REQUIRE(h.waits.count(2));
  CHECK(h.waits.at(2).status().code() == StatusCode::kDeadlineExceeded);
}

TEST_CASE("the server's own keys cannot be written through the key-value verbs",
          "[rendezvous][state]") {
  Harness h(1, 1);
  auto now = h.clock.now();
  CHECK(h.state.kvSet("job", "__ddprun/master/1", "x", now).code() == StatusCode::kInvalidArgument);
  CHECK(h.state.kvAdd("job", "__ddprun/n", 1, now).status().code() == StatusCode::kInvalidArgument);
  CHECK(h.state.kvDelete("job", "__ddprun/master/1", h.clock.now()).status().code() ==
        StatusCode::kInvalidArgument);
  // Nor deleted by a range that covers them, wherever it starts.
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"A", "z"}, {"_", "__ddprun/z"}, {"__ddprun/", "z"}, {"__ddprun/a", "__ddprun/b"}}) {
    INFO(from << " .. " << to);
    CHECK(h.state.kvDeleteRange("job", from, to, now).status().code() ==
          StatusCode::kInvalidArgument);
  }
  CHECK(h.state.kvDeleteRange("job", "A", "__ddprun/", now).isOk());  // ends where they start
  CHECK(h.state.kvDeleteRange("job", "__ddprun0", "z", now).isOk());  // starts after them
}

TEST_CASE(
    "a range delete removes exactly the keys from its start up to its end and gives their bytes "
    "back",
    "[rendezvous][state]") {
  Harness h(1, 1);
  auto& s = h.state;
  const auto now = h.clock.now();
  for (const char* key : {"a", "job/1/0", "job/1/1", "job/2/0", "job/20", "jobs", "k"}) {
    REQUIRE(s.kvSet("r", key, "vv", now).isOk());
  }
  REQUIRE(s.kvSet("other", "job/1/0", "vv", now).isOk());
  const auto before = s.census().kv_bytes;
  CHECK(s.kvDeleteRange("r", "job/", "job/2", now).value() == 2);
  CHECK(s.census().kv_bytes == before - 2 * (7 + 2));
  for (const char* gone : {"job/1/0", "job/1/1"}) {
    CHECK(s.kvGet("r", gone).status().code() == StatusCode::kNotFound);
  }
  for (const char* kept : {"a", "job/2/0", "job/20", "jobs", "k"}) {
    CHECK(s.kvGet("r", kept).value() == "vv");
  }
  CHECK(s.kvGet("other", "job/1/0").value() == "vv");  // another run's keys are its own
  CHECK(s.kvDeleteRange("r", "job/", "job/2", now).value() == 0);
  CHECK(s.kvDeleteRange("absent", "a", "b", now).value() == 0);
  // An empty or reversed range, and a bad key, are refused.
  CHECK(s.kvDeleteRange("r", "b", "b", now).status().code() == StatusCode::kInvalidArgument);
  CHECK(s.kvDeleteRange("r", "b", "a", now).status().code() == StatusCode::kInvalidArgument);
  CHECK(s.kvDeleteRange("r", "", "z", now).status().code() == StatusCode::kInvalidArgument);
  CHECK(s.kvDeleteRange("r", "a", std::string(5000, 'z'), now).status().code() ==
        StatusCode::kInvalidArgument);
  CHECK(s.kvDeleteRange("r", "a", "zz", now).value() == 5);  // "a" and "k" included
  CHECK(s.kvGet("r", "k").status().code() == StatusCode::kNotFound);
}

TEST_CASE("a range delete gives its bytes back to the run's own quota", "[rendezvous][state]") {
  StateLimits limits;
  limits.max_run_kv_bytes = 100;
  RendezvousState state(limits);
  const TimePoint now{};
  REQUIRE(state.kvSet("r", "k/1", std::string(47, 'x'), now).isOk());  // 50 bytes
  REQUIRE(state.kvSet("r", "k/2", std::string(47, 'x'), now).isOk());  // 100: full
  CHECK(state.kvSet("r", "k/3", "x", now).code() == StatusCode::kResourceExhausted);
  REQUIRE(state.kvDeleteRange("r", "k/", "k/2", now).value() == 1);
  CHECK(state.kvSet("r", "k/3", std::string(47, 'x'), now).isOk());
  CHECK(state.kvSet("r", "k/4", "x", now).code() == StatusCode::kResourceExhausted);
}

TEST_CASE("a participant re-joining with another local world size opens a new round",
          "[rendezvous][state]") {
  Harness h(1, 2);
  h.join("a", 2);
  h.join("b", 2);
  REQUIRE(h.done.size() == 2);
  h.clearAnswers();
  h.join("a", 4);
  CHECK_FALSE(h.completed("a"));
  REQUIRE(h.lastChange(ChangeKind::kRoundPending) != nullptr);
  h.join("b", 2);
  REQUIRE(h.done.size() == 2);
  CHECK(h.done["b"].round == 2);
  CHECK(h.done["b"].world_size == 6);
}

TEST_CASE("a node whose watch stream broke is declared dead after one silent interval",
          "[rendezvous]") {
  using namespace std::chrono_literals;
  ddprun::rendezvous::RendezvousState state;
  ddprun::TimePoint t{std::chrono::seconds(100)};
  ddprun::rendezvous::JoinRequest req;
  req.run_id = "w";
  req.config.min_nodes = 2;
  req.config.max_nodes = 2;
  req.config.heartbeat_interval = 1s;
  req.config.heartbeat_misses = 5;
  req.address = "a";
  state.join(1, req, t);
  req.address = "b";
  state.join(2, req, t);
  auto out = state.drain();
  REQUIRE(out.joins.size() == 2);
  const std::string a = out.joins[0].result.value().node_id;
  const std::string b = out.joins[1].result.value().node_id;

  // a's watch breaks but it keeps beating: a live agent survives a broken stream.
  state.watchLost("w", a, t);
  state.heartbeat("w", a, t + 500ms).value();
  state.heartbeat("w", b, t + 500ms).value();
  state.tick(t + 1100ms);
  CHECK(state.status("w").value().participants == 2);
  CHECK(state.status("w").value().pending_round == 0);

  // b's watch breaks and b falls silent: dead after one interval, not five.
  state.watchLost("w", b, t + 1s);
  state.heartbeat("w", a, t + 1500ms).value();
  state.tick(t + 1900ms);
  CHECK(state.status("w").value().pending_round == 0);
  state.tick(t + 2s);
  CHECK(state.status("w").value().pending_round == 2);
  bool dead_pushed = false;
  for (const auto& c : state.drain().changes) {
    dead_pushed = dead_pushed || (c.change.reason == ddprun::rendezvous::ChangeReason::kNodeDead &&
                                  c.change.node_id == b);
  }
  CHECK(dead_pushed);

  // A new subscription clears the suspicion.
  state.watchLost("w", a, t + 2s);
  state.watchStarted("w", a);
  state.heartbeat("w", a, t + 2500ms).value();
  state.tick(t + 3100ms);
  CHECK_FALSE(state.heartbeat("w", a, t + 3100ms).status().code() == ddprun::StatusCode::kNotFound);
}

// --- Collection of closed and abandoned runs (RunRetention) ---

TEST_CASE(
    "a closed run shrinks to a tombstone that refuses joins until its TTL, then starts afresh",
    "[rendezvous][state][retention]") {
  RunRetention retention;
  retention.closed_run_ttl = std::chrono::hours(1);
  Harness h(1, 1, retention);
  h.join("a");
  REQUIRE(h.completed("a"));
  REQUIRE(h.state.kvSet("job", "k", "v", h.clock.now()).isOk());
  REQUIRE(h.state.close("job", h.clock.now()).isOk());
  h.collect();
  REQUIRE(h.lastChange(ChangeKind::kClosed) != nullptr);
  CHECK(h.state.census().runs == 1);  // not shrunk before a tick
  CHECK(h.state.census().closed_runs == 1);

  h.advance(Duration::zero());  // no watcher to tell: shrunk at once
  CHECK(h.state.census().runs == 0);
  CHECK(h.state.census().closed_runs == 0);
  CHECK(h.state.census().tombstones == 1);
  CHECK(h.state.census().kv_spaces == 0);  // the store went with the run
  // Its keys are refused, not answered from an empty store (a late node's exit barrier would wait
  // for keys written before the close until it timed out), and no store starts under its id.
  CHECK(h.state.kvGet("job", "k").status().code() == StatusCode::kFailedPrecondition);
  const Status late_write = h.state.kvSet("job", "exit_barrier/1/arrive/b", "1", h.clock.now());
  CHECK(late_write.code() == StatusCode::kFailedPrecondition);
  CHECK(late_write.message() == "run job is closed");
  CHECK(h.state.census().kv_spaces == 0);

  h.clearAnswers();
  h.join("b");
  REQUIRE(h.errors.count("b"));
  CHECK(h.errors["b"].code() == StatusCode::kFailedPrecondition);
  CHECK(h.errors["b"].message() == "run job is closed");
  CHECK(h.state.status("job")->closed);
  // A late agent's beat and leave still learn the run is over instead of "unknown".
  CHECK(h.state.heartbeat("job", "a", h.clock.now())->closed);
  CHECK(h.state.leave("job", "a", h.clock.now()).isOk());
  CHECK(h.state.close("job", h.clock.now()).isOk());
  CHECK(h.state.reportFailure("job", "a", 1, h.clock.now()).status().code() ==
        StatusCode::kFailedPrecondition);

  h.advance(std::chrono::minutes(59));
  h.join("c");
  REQUIRE(h.errors.count("c"));
  CHECK(h.errors["c"].message() == "run job is closed");
  CHECK(h.state.census().tombstones == 1);

  h.advance(std::chrono::minutes(1));  // an hour after the close
  CHECK(h.state.census().tombstones == 0);
  h.clearAnswers();
  h.join("d");
  REQUIRE(h.completed("d"));
  CHECK(h.done["d"].round == 1);  // a fresh run, no history
  CHECK_FALSE(h.state.status("job")->closed);
  CHECK(h.state.kvSet("job", "k", "v2", h.clock.now()).isOk());  // and a store of its own
  CHECK(*h.state.kvGet("job", "k") == "v2");
}

TEST_CASE("a closed run keeps its state until its last watch stream ended, or the drain timeout",
          "[rendezvous][state][retention]") {
  RunRetention retention;
  retention.closed_drain_timeout = seconds(60);
  Harness h(1, 1, retention);
  h.join("a");
  h.state.watchOpened("job", h.clock.now());
  h.state.watchOpened("job", h.clock.now());
  REQUIRE(h.state.close("job", h.clock.now()).isOk());
  h.advance(seconds(30));
  CHECK(h.state.census().runs == 1);
  CHECK(h.state.census().watch_streams == 2);
  h.state.watchClosed("job", h.clock.now());
  h.advance(Duration::zero());
  CHECK(h.state.census().runs == 1);  // one watcher has not taken kClosed yet
  h.state.watchClosed("job", h.clock.now());
  CHECK(h.state.nextDeadline() == h.clock.now());
  h.advance(Duration::zero());
  CHECK(h.state.census().runs == 0);
  CHECK(h.state.census().tombstones == 1);
  CHECK(h.state.census().watch_streams == 0);

  // A stream that never ends (a stuck client) does not hold the run past the drain timeout.
  h.run_id = "stuck";
  h.join("b");
  h.state.watchOpened("stuck", h.clock.now());
  REQUIRE(h.state.close("stuck", h.clock.now()).isOk());
  h.advance(seconds(59));
  CHECK(h.state.census().runs == 1);
  h.advance(seconds(1));
  CHECK(h.state.census().runs == 0);
  CHECK(h.state.census().tombstones == 2);
  h.state.watchClosed("stuck", h.clock.now());  // ends later: nothing left to hold
  h.advance(Duration::zero());
  CHECK(h.state.census().tombstones == 2);
  CHECK(h.state.status("stuck")->closed);
}

TEST_CASE("an abandoned run is dropped after the idle TTL, not before, and its id is free again",
          "[rendezvous][state][retention]") {
  RunRetention retention;
  retention.idle_run_ttl = std::chrono::minutes(10);
  Harness h(2, 2, retention);
  h.join("a");
  h.join("b");
  REQUIRE(h.completed("b"));
  REQUIRE(h.state.kvSet("job", "ckpt", "step-100", h.clock.now()).isOk());

  // Every agent crashes: declared dead after heartbeat_interval x misses (15 s).
  h.advance(seconds(15));
  REQUIRE(h.state.status("job")->pending_round == 2);  // the dead were noticed
  REQUIRE(h.state.census().runs == 1);
  // The whole job restarting within the window finds its store (and its run) again.
  h.advance(std::chrono::minutes(9) + seconds(59));
  CHECK(h.state.census().runs == 1);
  CHECK(h.state.kvGet("job", "ckpt").value() == "step-100");
  h.advance(seconds(1));
  CHECK(h.state.census().runs == 0);
  CHECK(h.state.census().kv_spaces == 0);
  CHECK(h.state.census().tombstones == 0);  // no tombstone: the id may be reused
  CHECK(h.state.status("job").status().code() == StatusCode::kNotFound);

  h.clearAnswers();
  h.config.min_nodes = h.config.max_nodes = 1;  // a new job, other settings
  h.join("c");
  REQUIRE(h.completed("c"));
  CHECK(h.done["c"].round == 1);
}

TEST_CASE("a run with a live node or an open watch stream is never dropped",
          "[rendezvous][state][retention]") {
  RunRetention retention;
  retention.idle_run_ttl = std::chrono::minutes(1);
  Harness h(1, 1, retention);
  h.join("a");
  REQUIRE(h.completed("a"));
  for (int i = 0; i < 60; ++i) {  // ten minutes of beats
    h.heartbeatAll({"a"});
    h.advance(seconds(10));
  }
  CHECK(h.state.census().runs == 1);

  // A joiner waiting below min_nodes is live too.
  h.run_id = "waiting";
  h.config.min_nodes = h.config.max_nodes = 2;
  h.join_timeout = std::chrono::hours(1);
  h.join("w");
  h.advance(std::chrono::minutes(30));
  CHECK(h.state.status("waiting")->waiting == 1);

  // The node leaves, an observer still watches: kept.
  h.state.watchOpened("job", h.clock.now());
  REQUIRE(h.state.leave("job", "a", h.clock.now()).isOk());
  h.advance(std::chrono::minutes(10));
  CHECK(h.state.status("job").isOk());
  // The idle clock starts when the stream ends.
  h.state.watchClosed("job", h.clock.now());
  h.advance(seconds(59));
  CHECK(h.state.status("job").isOk());
  h.advance(seconds(1));
  CHECK(h.state.status("job").status().code() == StatusCode::kNotFound);
  CHECK(h.state.status("waiting")->waiting == 1);
}

TEST_CASE("key writes and waits keep a store alive, and a store without a run is collected too",
          "[rendezvous][state][retention]") {
  RunRetention retention;
  retention.idle_run_ttl = std::chrono::minutes(10);
  Harness h(1, 1, retention);
  REQUIRE(h.state.kvSet("store", "k", "1", h.clock.now()).isOk());
  h.advance(std::chrono::minutes(9));
  REQUIRE(h.state.kvAdd("store", "n", 1, h.clock.now()).isOk());  // restarts the idle clock
  h.advance(std::chrono::minutes(9));
  CHECK(h.state.kvGet("store", "k").isOk());
  h.advance(std::chrono::minutes(1));
  CHECK(h.state.census().kv_spaces == 0);
  CHECK(h.state.kvGet("store", "k").status().code() == StatusCode::kNotFound);

  // A pending wait holds the store; its timeout restarts the idle clock.
  REQUIRE(h.state.kvSet("store", "k", "1", h.clock.now()).isOk());
  h.state.kvWait(7, "store", {"never"}, std::chrono::minutes(30), h.clock.now());
  h.advance(std::chrono::minutes(29));
  CHECK(h.state.kvGet("store", "k").isOk());
  h.advance(std::chrono::minutes(1));
  REQUIRE(h.waits.count(7));
  CHECK(h.waits.at(7).status().code() == StatusCode::kDeadlineExceeded);
  h.advance(std::chrono::minutes(9));
  CHECK(h.state.kvGet("store", "k").isOk());
  h.advance(std::chrono::minutes(1));
  CHECK(h.state.census().kv_spaces == 0);

  // Off whole seconds: never collected early, at most a second late (ticks are shared).
  h.advance(std::chrono::milliseconds(300));
  REQUIRE(h.state.kvSet("store", "k", "1", h.clock.now()).isOk());
  h.advance(std::chrono::minutes(10) - std::chrono::milliseconds(1));
  CHECK(h.state.census().kv_spaces == 1);
  h.advance(std::chrono::seconds(1));
  CHECK(h.state.census().kv_spaces == 0);
}

TEST_CASE("tombstones are bounded in number, the oldest close evicted first",
          "[rendezvous][state][retention]") {
  RunRetention retention;
  retention.max_tombstones = 3;
  Harness h(1, 1, retention);
  for (int i = 0; i < 5; ++i) {
    h.run_id = "r" + std::to_string(i);
    h.join("n" + std::to_string(i));
    REQUIRE(h.state.close(h.run_id, h.clock.now()).isOk());
    h.advance(seconds(1));
  }
  CHECK(h.state.census().tombstones == 3);
  CHECK(h.state.census().runs == 0);
  h.clearAnswers();
  for (int i = 0; i < 5; ++i) {
    h.run_id = "r" + std::to_string(i);
    h.join("m" + std::to_string(i));
  }
  CHECK(h.completed("m0"));  // evicted: the id is free
  CHECK(h.completed("m1"));
  for (const char* node : {"m2", "m3", "m4"}) {
    REQUIRE(h.errors.count(node));
    CHECK(h.errors[node].message().find("is closed") != std::string::npos);
  }
}

TEST_CASE("a join whose local world size or node count could wrap WORLD_SIZE is refused",
          "[rendezvous][state]") {
  Harness h(1, 2);
  h.join("huge", 0xFFFFFFFFu);
  REQUIRE(h.errors.count("huge"));
  CHECK(h.errors["huge"].code() == StatusCode::kInvalidArgument);
  CHECK(h.errors["huge"].message() == "local_world_size must be at most 32768, got 4294967295");
  h.join("fine", 32768);
  CHECK(h.errors.count("fine") == 0);
  Harness many(1, 0xFFFFFFFFu);
  many.join("a");
  REQUIRE(many.errors.count("a"));
  CHECK(many.errors["a"].message() == "nnodes MAX must be at most 65536, got 4294967295");
}

TEST_CASE("key-value quotas refuse a write past each limit and name it", "[rendezvous][state]") {
  StateLimits limits;
  limits.max_run_keys = 3;
  limits.max_run_kv_bytes = 100;
  limits.max_kv_bytes = 150;
  RendezvousState state(limits);
  const TimePoint now{};
  // Keys per run: a fourth key is refused, overwriting one of the three is not.
  for (const char* k : {"a", "b", "c"}) REQUIRE(state.kvSet("r1", k, "1", now).isOk());
  Status fourth = state.kvSet("r1", "d", "1", now);
  CHECK(fourth.code() == StatusCode::kResourceExhausted);
  CHECK_THAT(fourth.message(), Catch::Contains("max-run-keys = 3"));
  CHECK(state.kvAdd("r1", "e", 1, now).status().code() == StatusCode::kResourceExhausted);
  CHECK(state.kvCompareSet("r1", "f", "", "x", now).status().code() ==
        StatusCode::kResourceExhausted);
  CHECK(state.kvSet("r1", "a", "22", now).isOk());
  CHECK(state.kvAdd("r1", "b", 5, now).value() == 6);
  // Bytes per run (keys plus values): r1 holds 3+2+2 = 7 bytes; "a" with 96 bytes makes 101.
  CHECK(state.census().kv_bytes == 7);
  Status big = state.kvSet("r1", "a", std::string(96, 'x'), now);
  CHECK(big.code() == StatusCode::kResourceExhausted);
  CHECK_THAT(big.message(), Catch::Contains("max-run-kv-bytes = 100"));
  CHECK(state.kvGet("r1", "a").value() == "22");  // a refused write changes nothing
  REQUIRE(state.kvSet("r1", "a", std::string(95, 'x'), now).isOk());
  CHECK(state.census().kv_bytes == 100);
  // Bytes of all runs: r2 may hold 50 more, not 51.
  REQUIRE(state.kvSet("r2", "k", std::string(49, 'y'), now).isOk());
  Status total = state.kvSet("r3", "k", "z", now);
  CHECK(total.code() == StatusCode::kResourceExhausted);
  CHECK_THAT(total.message(), Catch::Contains("max-kv-bytes = 150"));
  CHECK(state.census().kv_spaces == 2);  // the refused write created no store for r3
  // Deleting and shrinking give room back.
  REQUIRE(state.kvDelete("r2", "k", now).value());
  CHECK(state.census().kv_bytes == 100);
  CHECK(state.kvSet("r3", "k", "z", now).isOk());
  REQUIRE(state.kvSet("r1", "a", "", now).isOk());
  CHECK(state.census().kv_bytes == 7);
}

TEST_CASE("a dropped run gives its key-value bytes back to the server", "[rendezvous][state]") {
  StateLimits limits;
  limits.max_kv_bytes = 64;
  RunRetention retention;
  retention.idle_run_ttl = seconds(10);
  RendezvousState state(limits, retention);
  testing::FakeClock clock;
  REQUIRE(state.kvSet("old", "k", std::string(60, 'x'), clock.now()).isOk());
  CHECK(state.kvSet("new", "k", std::string(10, 'x'), clock.now()).code() ==
        StatusCode::kResourceExhausted);
  clock.advance(seconds(11));
  state.tick(clock.now());
  CHECK(state.census().kv_bytes == 0);
  CHECK(state.kvSet("new", "k", std::string(10, 'x'), clock.now()).isOk());
}

TEST_CASE("every call validates its run and node ids the same way", "[rendezvous][state]") {
  RendezvousState state;
  const TimePoint now{};
  const std::string huge(1025, 'r');
  const std::string control = std::string("job") + '\n';
  for (const std::string& bad : {std::string(), huge, control}) {
    CAPTURE(bad.size());
    CHECK(state.validateIds(bad).code() == StatusCode::kInvalidArgument);
    CHECK(state.heartbeat(bad, "n", now).status().code() == StatusCode::kInvalidArgument);
    CHECK(state.leave(bad, "n", now).code() == StatusCode::kInvalidArgument);
    CHECK(state.reportFailure(bad, "n", 1, now).status().code() == StatusCode::kInvalidArgument);
    CHECK(state.close(bad, now).code() == StatusCode::kInvalidArgument);
    CHECK(state.publishMaster(bad, "n", 1, {"h", 1}, now).code() == StatusCode::kInvalidArgument);
    CHECK(state.kvSet(bad, "k", "v", now).code() == StatusCode::kInvalidArgument);
    CHECK(state.kvGet(bad, "k").status().code() == StatusCode::kInvalidArgument);
    CHECK(state.kvAdd(bad, "k", 1, now).status().code() == StatusCode::kInvalidArgument);
    CHECK(state.kvDelete(bad, "k", now).status().code() == StatusCode::kInvalidArgument);
    state.kvWait(1, bad, {"k"}, seconds(1), now);
    state.waitMaster(2, bad, 1, seconds(1), now);
    JoinRequest join;
    join.run_id = bad;
    join.address = "h";
    join.local_world_size = 1;
    join.config.min_nodes = join.config.max_nodes = 1;
    state.join(3, join, now);
    auto out = state.drain();
    REQUIRE(out.waits.size() == 1);
    CHECK(out.waits[0].values.status().code() == StatusCode::kInvalidArgument);
    REQUIRE(out.masters.size() == 1);
    CHECK(out.masters[0].master.status().code() == StatusCode::kInvalidArgument);
    REQUIRE(out.joins.size() == 1);
    CHECK(out.joins[0].result.status().code() == StatusCode::kInvalidArgument);
    // Node ids get the same bounds (an empty one is an observer's, or a join asking for one).
    if (!bad.empty()) {
      CHECK(state.validateIds("job", bad).code() == StatusCode::kInvalidArgument);
      CHECK(state.heartbeat("job", bad, now).status().code() == StatusCode::kInvalidArgument);
    }
  }
  CHECK(state.validateIds("job", "node-1").isOk());
  CHECK(state.validateIds(std::string(1024, 'r')).message().empty());
  CHECK(state.census().kv_spaces == 0);
  CHECK(state.census().runs == 0);
}

TEST_CASE("the closed-run and unknown-run answers are told from others by code and wording",
          "[rendezvous]") {
  CHECK(isRunClosed(runClosed("job")));
  CHECK(isRunUnknown(runUnknown("job")));
  CHECK_FALSE(isRunClosed(runUnknown("job")));
  CHECK_FALSE(isRunUnknown(runClosed("job")));
  // The code and both ends of the message count.
  CHECK_FALSE(isRunClosed(Status(StatusCode::kUnavailable, "run job is closed")));
  CHECK_FALSE(isRunClosed(failedPrecondition("run job has other settings")));
  CHECK_FALSE(isRunClosed(failedPrecondition("the run job is closed")));
  CHECK_FALSE(isRunUnknown(notFound("node n is not part of run job")));
  CHECK_FALSE(isRunUnknown(notFound("run ")));
  CHECK_FALSE(isRunClosed(Status::ok()));
}

// Found by a hostile client (a black-box gRPC fuzz of the daemon): each was one request.
TEST_CASE("heartbeats that would add up past 1e9 s are refused, not wrapped into a dead node",
          "[rendezvous][state]") {
  Harness h(1, 1);
  h.config.heartbeat_interval = seconds(3);
  h.config.heartbeat_misses = 4294967295u;
  h.join("a");
  REQUIRE(h.errors.count("a") == 1);
  CHECK(h.errors["a"].code() == StatusCode::kInvalidArgument);
  CHECK(h.errors["a"].message().rfind(
            "heartbeat_interval x heartbeat_misses must be at most 1e9 s, got 12884901885", 0) ==
        0);
  h.errors.clear();
  h.config.heartbeat_interval = seconds(922337203.0);
  h.config.heartbeat_misses = 10;
  h.join("a");
  CHECK(h.errors.count("a") == 1);
  // At the bound it is taken, and the node lives.
  h.errors.clear();
  h.config.heartbeat_interval = seconds(1e8);
  h.join("a");
  REQUIRE(h.completed("a"));
  h.advance(seconds(3600));
  CHECK(h.state.status("job")->participants == 1);
}

TEST_CASE("a node's or a master's address with a control byte is refused", "[rendezvous][state]") {
  Harness h(1, 1);
  JoinRequest req;
  req.run_id = "job";
  req.node_id = "a";
  req.address = "\x1b[31mX\n";
  req.local_world_size = 1;
  req.config = h.config;
  req.join_timeout = seconds(5);
  h.calls[1] = "a";
  h.state.join(1, req, h.clock.now());
  h.collect();
  REQUIRE(h.errors.count("a") == 1);
  CHECK(h.errors["a"].message() == "node address contains a control byte");
  h.errors.clear();
  h.join("a");
  REQUIRE(h.completed("a"));
  auto st = h.state.publishMaster("job", "a", 1, {"\x1b]0;x\x07", 29500}, h.clock.now());
  CHECK(st.code() == StatusCode::kInvalidArgument);
  CHECK(st.message() == "master address contains a control byte");
}

TEST_CASE("a wait whose values would not fit one answer fails with the bound named",
          "[rendezvous][state]") {
  StateLimits limits;
  limits.max_wait_answer_bytes = 100;
  Harness h(1, 1, {}, limits);
  auto& s = h.state;
  const auto now = h.clock.now();
  REQUIRE(s.kvSet("job", "big", std::string(60, 'x'), now).isOk());
  s.kvWait(1, "job", {"big"}, seconds(5), now);  // one copy fits
  s.kvWait(2, "job", {"big", "big"}, seconds(5), now);
  s.kvWait(3, "job", {"late", "late"}, seconds(5), now);
  h.collect();
  REQUIRE(h.waits.count(1) == 1);
  CHECK(h.waits.at(1).isOk());
  REQUIRE(h.waits.count(2) == 1);
  CHECK(h.waits.at(2).status().code() == StatusCode::kResourceExhausted);
  CHECK(h.waits.at(2).status().message() ==
        "the values of the 2 key(s) waited for in run job take more than 100 bytes together, "
        "more than one answer carries (wait for fewer keys)");
  // Answered when its key comes: the same.
  REQUIRE(s.kvSet("job", "late", std::string(60, 'y'), now).isOk());
  h.collect();
  REQUIRE(h.waits.count(3) == 1);
  CHECK(h.waits.at(3).status().code() == StatusCode::kResourceExhausted);
}

TEST_CASE("a wait for many keys that times out names five of them, escaped, and counts the rest",
          "[rendezvous][state]") {
  Harness h(1, 1);
  std::vector<std::string> keys = {"k\x1b[2J"};
  for (int i = 0; i < 1999; ++i) keys.push_back("key-" + std::to_string(i));
  h.state.kvWait(1, "job", keys, seconds(1), h.clock.now());
  h.advance(seconds(1));
  REQUIRE(h.waits.count(1) == 1);
  const Status st = h.waits.at(1).status();
  CHECK(st.code() == StatusCode::kDeadlineExceeded);
  CHECK(st.message() ==
        "timed out waiting for key(s) k\\x1b[2J, key-0, key-1, key-2, key-3 and 1995 more of run "
        "job");
  CHECK(h.state.kvGet("job", std::string(4096, 'q')).status().message().size() < 300);
}
