#include "ddprun/agent/multinode_rendezvous.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <optional>

#include "fake_rendezvous_service.h"

using namespace ddprun;
using namespace ddprun::agent;
using ddprun::testing::FakeRendezvousService;
using namespace std::chrono_literals;

namespace {

// The key of an exit barrier's mark: "exit_barrier/<round, 20 digits>/<what>".
std::string barrierKey(uint64_t round, const std::string& what) {
  return roundKeyPrefix(kBarrierKeys, round) + what;
}

// How many times `service` was asked to delete the keys of `kind` of the rounds below `round`.
long deletesBelow(const FakeRendezvousService& service, const std::string& kind, uint64_t round) {
  return std::count(service.calls.begin(), service.calls.end(),
                    "kvDeleteRange " + kind + "/ " + roundKeyPrefix(kind, round));
}

rendezvous::RoundInfo roundOf(uint64_t round, const std::string& me,
                              const std::vector<std::pair<std::string, uint32_t>>& members) {
  rendezvous::RoundInfo r;
  r.round = round;
  r.node_id = me;
  auto participants = std::make_shared<std::vector<rendezvous::Participant>>();
  uint32_t world = 0;
  for (size_t i = 0; i < members.size(); ++i) {
    participants->push_back({members[i].first, members[i].first + ".host", members[i].second,
                             static_cast<uint32_t>(i)});
    if (members[i].first == me) {
      r.group_rank = static_cast<uint32_t>(i);
      r.base_rank = world;
    }
    world += members[i].second;
  }
  r.world_size = world;
  r.group_world_size = static_cast<uint32_t>(members.size());
  r.participants = participants;
  return r;
}

rendezvous::RoundChange pending(uint64_t round, rendezvous::ChangeReason reason,
                                const std::string& node) {
  rendezvous::RoundChange c;
  c.kind = rendezvous::ChangeKind::kRoundPending;
  c.reason = reason;
  c.node_id = node;
  c.round = round;
  return c;
}

struct MultiNodeFixture {
  explicit MultiNodeFixture(MultiNodeOptions o = defaults()) : service(io) {
    rdzv = std::make_unique<MultiNodeRendezvous>(io, o, service,
                                                 [this](PeerEvent e) { events.push_back(e); });
  }
  static MultiNodeOptions defaults() {
    MultiNodeOptions o;
    o.run_id = "job";
    o.local_addr = "a.host";
    o.local_world_size = 2;
    o.master_port = 1234;  // no free-port lookup in unit tests
    o.run_config.heartbeat_interval = std::chrono::hours(1);
    return o;
  }
  void poll() {
    io.restart();
    io.poll();
  }
  // Starts nextRound; the result lands in `result`.
  void nextRound() {
    result.reset();
    rdzv->nextRound([this](StatusOr<RoundInfo> r) { result = std::move(r); });
    poll();
  }
  // A completed round where this node ("a") is rank 0 of a and b.
  void formRound(uint64_t round = 1) {
    nextRound();
    service.answer(service.joins, roundOf(round, "a", {{"a", 2}, {"b", 2}}));
    poll();
    service.answer(service.publishes, Status::ok());
    poll();
  }

  boost::asio::io_context io;
  FakeRendezvousService service;
  std::vector<PeerEvent> events;
  std::optional<StatusOr<RoundInfo>> result;
  std::unique_ptr<MultiNodeRendezvous> rdzv;
};

}  // namespace

TEST_CASE("rank 0 of a completed round publishes its master address and gets its round",
          "[agent][multinode]") {
  MultiNodeFixture f;
  f.nextRound();
  REQUIRE(f.service.joins.size() == 1);
  CHECK(f.service.last_join.run_id == "job");
  CHECK(f.service.last_join.node_id.empty());  // first join: the service names the node
  CHECK(f.service.last_join.address == "a.host");
  CHECK(f.service.last_join.local_world_size == 2);
  f.service.answer(f.service.joins, roundOf(3, "a", {{"a", 2}, {"b", 4}}));
  f.poll();
  REQUIRE(f.service.publishes.size() == 1);
  CHECK(f.service.publishes.front().first == "a.host:1234");
  CHECK_FALSE(f.result.has_value());  // not before the master is published
  f.service.answer(f.service.publishes, Status::ok());
  f.poll();
  REQUIRE(f.result.has_value());
  REQUIRE(f.result->isOk());
  const RoundInfo& r = f.result->value();
  CHECK(r.round == 3);
  CHECK(r.group_rank == 0);
  CHECK(r.local_world_sizes == std::vector<int>{2, 4});
  CHECK(r.master_addr == "a.host");
  CHECK(r.master_port == 1234);
  CHECK(r.run_id == "job");
  CHECK(f.rdzv->currentRound() == 3);
  CHECK(f.rdzv->nodeId() == "a");
  CHECK(f.service.watches == 1);
}

TEST_CASE("a non-zero rank takes the master from the round, or waits for it",
          "[agent][multinode]") {
  MultiNodeFixture f;
  f.nextRound();
  auto joined = roundOf(1, "a", {{"b", 1}, {"a", 2}});
  joined.master_addr = "b.host";
  joined.master_port = 555;
  f.service.answer(f.service.joins, joined);
  f.poll();
  REQUIRE(f.result.has_value());
  CHECK(f.result->value().group_rank == 1);
  CHECK(f.result->value().master_addr == "b.host");
  CHECK(f.service.publishes.empty());

  f.nextRound();
  CHECK(f.service.last_join.node_id == "a");  // keeps its node id (and so its rank)
  f.service.answer(f.service.joins, roundOf(2, "a", {{"b", 1}, {"a", 2}}));
  f.poll();
  REQUIRE(f.service.master_waits.size() == 1);
  CHECK(f.service.master_waits.front().first == "2");
  f.service.answer(f.service.master_waits, rendezvous::MasterAddress{"b.host", 777});
  f.poll();
  REQUIRE(f.result.has_value());
  CHECK(f.result->value().master_port == 777);
}

TEST_CASE("the membership epoch bumps only when the members change", "[agent][multinode]") {
  MultiNodeFixture f;
  f.formRound(1);
  CHECK(f.result->value().membership_epoch == 0);
  f.formRound(2);  // a failure restart: same members
  CHECK(f.result->value().membership_epoch == 0);
  f.nextRound();
  f.service.answer(f.service.joins, roundOf(3, "a", {{"a", 2}, {"c", 2}}));
  f.poll();
  f.service.answer(f.service.publishes, Status::ok());
  f.poll();
  CHECK(f.result->value().membership_epoch == 1);
}

TEST_CASE("a join that fails says what to check when the service is unreachable",
          "[agent][multinode]") {
  MultiNodeFixture f;
  f.nextRound();
  f.service.answer(f.service.joins, StatusOr<rendezvous::RoundInfo>(unavailable("down")));
  f.poll();
  REQUIRE(f.result.has_value());
  CHECK(f.result->status().code() == StatusCode::kUnavailable);
  CHECK(f.result->status().message() == "down (check the fake)");
}

TEST_CASE("a join the rendezvous itself timed out is reported as it said, with no hint to reach it",
          "[agent][multinode]") {
  const std::string said = std::string(rendezvous::kJoinTimeoutExpired) +
                           "round 1 of run r: 1 node(s) joined, min_nodes is 2";
  {
    MultiNodeFixture f;
    f.nextRound();
    f.service.answer(f.service.joins, StatusOr<rendezvous::RoundInfo>(deadlineExceeded(said)));
    f.poll();
    REQUIRE(f.result.has_value());
    CHECK(f.result->status().code() == StatusCode::kDeadlineExceeded);
    CHECK(f.result->status().message() == said);
  }
  {  // a transport deadline (a port held by something that is not a rendezvous) is explained
    MultiNodeFixture f;
    f.nextRound();
    f.service.answer(f.service.joins,
                     StatusOr<rendezvous::RoundInfo>(deadlineExceeded("Deadline Exceeded")));
    f.poll();
    REQUIRE(f.result.has_value());
    CHECK(f.result->status().message() == "Deadline Exceeded (check the fake)");
  }
}

TEST_CASE("pushed round changes become membership changes and peer failures",
          "[agent][multinode]") {
  MultiNodeFixture f;
  f.formRound(4);
  f.service.push(pending(4, rendezvous::ChangeReason::kNodeJoined, "c"));       // a round it holds
  f.service.push(pending(5, rendezvous::ChangeReason::kFailureReported, "a"));  // its own report
  f.poll();
  CHECK(f.events.empty());
  f.service.push(pending(5, rendezvous::ChangeReason::kFailureReported, "b"));
  f.service.push(pending(5, rendezvous::ChangeReason::kNodeLeft, "b"));
  f.service.push(pending(5, rendezvous::ChangeReason::kNodeDead, "b"));
  f.poll();
  CHECK(f.events == std::vector<PeerEvent>{PeerEvent::kPeerFailure, PeerEvent::kMembershipChange,
                                           PeerEvent::kNodeDeclaredDead});
  // A failed in-place recovery elsewhere (not charged again); this node's own is not an event.
  f.events.clear();
  f.service.push(pending(6, rendezvous::ChangeReason::kRecoveryFailed, "a"));
  f.service.push(pending(6, rendezvous::ChangeReason::kRecoveryFailed, "b"));
  f.poll();
  CHECK(f.events == std::vector<PeerEvent>{PeerEvent::kPeerRecoveryFailed});
  // This node declared dead (its agent stalled): its workers may be finishing, as a peer's.
  f.events.clear();
  f.service.push(pending(7, rendezvous::ChangeReason::kNodeDead, "a"));
  f.poll();
  CHECK(f.events == std::vector<PeerEvent>{PeerEvent::kNodeDeclaredDead});
}

TEST_CASE("the service's lowest node deletes the --node-rank keys of past rounds",
          "[agent][multinode]") {
  auto o = MultiNodeFixture::defaults();
  o.static_node_rank = 1;
  MultiNodeFixture f(o);
  f.nextRound();
  const bool lowest = GENERATE(true, false);
  const bool written = GENERATE(true, false);
  INFO("lowest " << lowest << ", its key written " << written);
  f.service.answer(f.service.joins, lowest ? roundOf(3, "a", {{"a", 2}, {"b", 4}})
                                           : roundOf(3, "a", {{"b", 4}, {"a", 2}}));
  f.poll();
  REQUIRE(f.service.kv_sets.size() == 1);
  CHECK(deletesBelow(f.service, kStaticRankKeys, 3) == 0);
  f.service.answer(f.service.kv_sets,
                   written ? Status::ok() : Status(StatusCode::kUnavailable, "gone"));
  f.poll();
  // Once its own key is written (a round that fails here is joined again).
  CHECK(deletesBelow(f.service, kStaticRankKeys, 3) == (lowest && written ? 1 : 0));
}

TEST_CASE("the lowest node deletes the exit barrier's keys of the rounds below the one before",
          "[agent][multinode]") {
  MultiNodeFixture f;
  f.formRound(1);
  CHECK(deletesBelow(f.service, kBarrierKeys, 0) == 0);  // nothing before round 1
  f.service.push(pending(2, rendezvous::ChangeReason::kNodeJoined, "c"));
  f.poll();
  f.nextRound();
  CHECK(f.service.kv_sets.front().first == barrierKey(1, "arrive/a") + "=next:2");
  f.service.answer(f.service.joins, roundOf(2, "a", {{"a", 2}, {"b", 2}, {"c", 2}}));
  f.poll();
  // Round 1's marks stay: a node still waiting in its barrier reads them.
  CHECK(deletesBelow(f.service, kBarrierKeys, 1) == 1);
  CHECK(deletesBelow(f.service, kBarrierKeys, 2) == 0);
}

TEST_CASE("static node ranks order the nodes by --node-rank", "[agent][multinode]") {
  auto o = MultiNodeFixture::defaults();
  o.static_node_rank = 0;
  o.static_master_addr = "master";
  o.master_port = 29500;
  MultiNodeFixture f(o);
  f.nextRound();
  // The service ranked b first; --node-rank says a is 0.
  f.service.answer(f.service.joins, roundOf(1, "a", {{"b", 4}, {"a", 2}}));
  f.poll();
  REQUIRE(f.service.kv_sets.size() == 1);
  CHECK(f.service.kv_sets.front().first == roundKeyPrefix("static_rank", 1) + "a=0");
  f.service.answer(f.service.kv_sets, Status::ok());
  f.poll();
  REQUIRE(f.service.kv_waits.size() == 1);
  CHECK(f.service.kv_waits.front().first ==
        roundKeyPrefix("static_rank", 1) + "b," + roundKeyPrefix("static_rank", 1) + "a");
  f.service.answer(f.service.kv_waits, std::vector<std::string>{"1", "0"});
  f.poll();
  REQUIRE(f.result.has_value());
  REQUIRE(f.result->isOk());
  CHECK(f.result->value().group_rank == 0);
  CHECK(f.result->value().local_world_sizes == std::vector<int>{2, 4});
  CHECK(f.result->value().master_addr == "master");
  CHECK(f.result->value().master_port == 29500);
  CHECK(f.service.publishes.empty());
}

TEST_CASE("a --node-rank used twice fails the round naming the flag", "[agent][multinode]") {
  auto o = MultiNodeFixture::defaults();
  o.static_node_rank = 1;
  MultiNodeFixture f(o);
  f.nextRound();
  f.service.answer(f.service.joins, roundOf(1, "a", {{"a", 2}, {"b", 2}}));
  f.poll();
  f.service.answer(f.service.kv_sets, Status::ok());
  f.poll();
  f.service.answer(f.service.kv_waits, std::vector<std::string>{"1", "1"});
  f.poll();
  REQUIRE(f.result.has_value());
  CHECK(f.result->status().code() == StatusCode::kFailedPrecondition);
  CHECK(f.result->status().message().find("--node-rank") != std::string::npos);
}

TEST_CASE("calls run one at a time in the order made, and leave cancels a join in flight",
          "[agent][multinode]") {
  MultiNodeFixture f;
  f.formRound(1);
  f.nextRound();
  f.rdzv->reportFailure(FailureKind::kWorkers);  // queued behind the join
  f.poll();
  CHECK(f.service.failure_reports.empty());
  f.rdzv->leave();
  f.poll();
  CHECK(f.service.cancels == 1);
  REQUIRE(f.result.has_value());  // the join ended (cancelled)
  CHECK(f.result->status().code() == StatusCode::kCancelled);
  REQUIRE(f.service.failure_reports.size() == 1);
  CHECK(f.service.failure_reports.front().first == "a@1");
  CHECK(f.service.leaves.empty());  // still behind the report
  f.service.answer(f.service.failure_reports, uint64_t{2});
  f.poll();
  REQUIRE(f.service.leaves.size() == 1);
  CHECK(f.service.leaves.front().first == "a");
}

TEST_CASE("the exit barrier waits only for the members that are still in the job",
          "[agent][multinode][barrier]") {
  MultiNodeFixture f;
  f.nextRound();
  f.service.answer(f.service.joins, roundOf(1, "a", {{"a", 1}, {"b", 1}, {"c", 1}}));
  f.poll();
  f.service.answer(f.service.publishes, Status::ok());
  f.poll();
  f.service.push(pending(2, rendezvous::ChangeReason::kNodeDead, "c"));
  f.poll();
  std::optional<Status> barrier;
  f.rdzv->exitBarrier(60s, [&](Status st) { barrier = st; });
  f.poll();
  REQUIRE(f.service.kv_sets.size() == 1);
  CHECK(f.service.kv_sets.front().first == barrierKey(1, "arrive/a") + "=1");
  f.service.answer(f.service.kv_sets, Status::ok());
  f.poll();
  REQUIRE(f.service.kv_waits.size() == 1);
  CHECK(f.service.kv_waits.front().first ==
        barrierKey(1, "arrive/a") + "," + barrierKey(1, "arrive/b"));
  // A slice ran out: it asks again, now without b, which left meanwhile.
  f.service.push(pending(2, rendezvous::ChangeReason::kNodeLeft, "b"));
  f.service.answer(f.service.kv_waits,
                   StatusOr<std::vector<std::string>>(deadlineExceeded("slice")));
  f.poll();
  CHECK_FALSE(barrier.has_value());
  REQUIRE(f.service.kv_waits.size() == 1);
  CHECK(f.service.kv_waits.front().first == barrierKey(1, "arrive/a"));
  f.service.answer(f.service.kv_waits, std::vector<std::string>{"1"});
  f.poll();
  REQUIRE(barrier.has_value());
  CHECK(barrier->isOk());
}

TEST_CASE("a node that leaves its round for a newer one says so in that round's exit barrier",
          "[agent][multinode][barrier]") {
  MultiNodeFixture f;
  f.formRound(1);
  SECTION("a round forming (a node joined, left or was declared dead)") {
    f.service.push(pending(2, rendezvous::ChangeReason::kNodeJoined, "c"));
    f.poll();
  }
  SECTION("its own failure report, answered before the watch tells it") {
    f.rdzv->reportFailure(FailureKind::kWorkers);
    f.poll();
    f.service.answer(f.service.failure_reports, uint64_t{2});
    f.poll();
  }
  f.nextRound();
  REQUIRE(f.service.kv_sets.size() == 1);
  CHECK(f.service.kv_sets.front().first == barrierKey(1, "arrive/a") + "=next:2");
  // Not awaited: the join is on its way at once.
  CHECK(f.service.joins.size() == 1);
}

TEST_CASE("a service that lost its rounds is followed from its own numbers, not re-joined forever",
          "[agent][multinode]") {
  MultiNodeFixture f;
  auto answer = [&](uint64_t round) {
    f.service.answer(f.service.joins, roundOf(round, "a", {{"a", 2}, {"b", 2}}));
    f.poll();
    f.service.answer(f.service.publishes, Status::ok());
    f.poll();
    REQUIRE(f.result.has_value());
    REQUIRE(f.result->isOk());
  };
  SECTION("a round below the one it held") {
    f.formRound(3);
    f.service.push(pending(4, rendezvous::ChangeReason::kNodeDead, "a"));
    f.poll();
    f.nextRound();
    answer(1);  // a fresh server's first round
    CHECK(f.rdzv->formingRound() == 1);
    CHECK_FALSE(isSuperseded(*f.rdzv, f.result->value()));
  }
  SECTION("the same round again below the one forming") {
    f.formRound(1);
    f.service.push(pending(2, rendezvous::ChangeReason::kNodeDead, "a"));
    f.poll();
    f.nextRound();
    answer(1);
    // Maybe superseded on its way: joined again, as before.
    CHECK(isSuperseded(*f.rdzv, f.result->value()));
    f.service.kv_sets.clear();
    f.nextRound();
    CHECK(f.service.kv_sets.empty());  // no worker finished round 1 meanwhile: nothing to mark
    answer(1);
    CHECK(f.rdzv->formingRound() == 1);
    CHECK_FALSE(isSuperseded(*f.rdzv, f.result->value()));
  }
  SECTION("a newer round, superseded on its way, is followed by the newest") {
    f.formRound(1);
    f.service.push(pending(2, rendezvous::ChangeReason::kNodeJoined, "c"));
    f.poll();
    f.nextRound();
    answer(2);
    f.service.push(pending(3, rendezvous::ChangeReason::kNodeLeft, "c"));
    f.poll();
    CHECK(isSuperseded(*f.rdzv, f.result->value()));
    f.nextRound();
    answer(3);
    CHECK(f.rdzv->formingRound() == 3);
    CHECK_FALSE(isSuperseded(*f.rdzv, f.result->value()));
  }
}

TEST_CASE("re-joining the round it ran in (no newer round forming) marks nothing",
          "[agent][multinode][barrier]") {
  MultiNodeFixture f;
  f.formRound(1);
  f.nextRound();
  CHECK(f.service.kv_sets.empty());
  CHECK(f.service.joins.size() == 1);
}

TEST_CASE("the exit barrier ends when another node went on to a newer round",
          "[agent][multinode][barrier]") {
  MultiNodeFixture f;
  f.formRound(1);
  std::optional<Status> barrier;
  f.rdzv->exitBarrier(60s, [&](Status st) { barrier = st; });
  f.poll();
  f.service.answer(f.service.kv_sets, Status::ok());
  f.poll();
  REQUIRE(f.service.kv_waits.size() == 1);
  SECTION("b's key names a newer round: this node must join it") {
    f.service.answer(f.service.kv_waits, std::vector<std::string>{"1", "next:2"});
    f.poll();
    REQUIRE(barrier.has_value());
    CHECK(isRoundAbandoned(*barrier));
    CHECK(barrier->message() ==
          "node b stopped its workers before they finished and went on to round 2");
  }
  SECTION("a mark of this round or an older one is no such news") {
    f.service.answer(f.service.kv_waits, std::vector<std::string>{"1", "next:1"});
    f.poll();
    REQUIRE(barrier.has_value());
    CHECK(barrier->isOk());
  }
  SECTION("a malformed mark is no such news either") {
    f.service.answer(f.service.kv_waits, std::vector<std::string>{"1", "next:x"});
    f.poll();
    REQUIRE(barrier.has_value());
    CHECK(barrier->isOk());
  }
  SECTION("the service's own ABORTED is an error, not a reason to start again") {
    f.service.answer(f.service.kv_waits,
                     StatusOr<std::vector<std::string>>(Status(StatusCode::kAborted, "conflict")));
    f.poll();
    REQUIRE(barrier.has_value());
    CHECK_FALSE(barrier->isOk());
    CHECK_FALSE(isRoundAbandoned(*barrier));
    CHECK(barrier->message() == "conflict");
  }
}

TEST_CASE("after a success the closer waits for departures, then closes the run",
          "[agent][multinode][barrier]") {
  MultiNodeFixture f;
  f.formRound(1);  // a is group rank 0: the closer
  bool done = false;
  f.rdzv->shutdown(/*succeeded=*/true, /*left=*/false, [&] { done = true; });
  f.poll();
  REQUIRE(f.service.kv_sets.size() == 1);
  CHECK(f.service.kv_sets.front().first == barrierKey(1, "depart/a") + "=1");
  f.service.answer(f.service.kv_sets, Status::ok());
  f.poll();
  REQUIRE(f.service.kv_waits.size() == 1);
  CHECK(f.service.kv_waits.front().first ==
        barrierKey(1, "depart/a") + "," + barrierKey(1, "depart/b"));
  f.service.answer(f.service.kv_waits, std::vector<std::string>{"1", "1"});
  f.poll();
  REQUIRE(f.service.closes.size() == 1);
  CHECK_FALSE(done);
  f.service.answer(f.service.closes, Status::ok());
  f.poll();
  CHECK(done);
  CHECK(f.service.stopped_watches == 1);
}

TEST_CASE("after a success a node that does not close the run departs and leaves",
          "[agent][multinode][barrier]") {
  MultiNodeFixture f;
  f.nextRound();
  auto joined = roundOf(1, "a", {{"b", 1}, {"a", 1}});
  joined.master_addr = "b.host";
  joined.master_port = 1;
  f.service.answer(f.service.joins, joined);
  f.poll();
  bool done = false;
  f.rdzv->shutdown(true, false, [&] { done = true; });
  f.poll();
  f.service.answer(f.service.kv_sets, Status::ok());
  f.poll();
  CHECK(f.service.kv_waits.empty());
  REQUIRE(f.service.leaves.size() == 1);
  f.service.answer(f.service.leaves, Status::ok());
  f.poll();
  CHECK(done);
  CHECK(f.service.closes.empty());
}

TEST_CASE("after a failure past the budget the run is closed, after a leave nothing is said",
          "[agent][multinode]") {
  MultiNodeFixture f;
  f.formRound(1);
  bool done = false;
  f.rdzv->shutdown(false, false, [&] { done = true; });
  f.poll();
  REQUIRE(f.service.closes.size() == 1);
  f.service.answer(f.service.closes, unavailable("gone"));  // the server may be gone: still done
  f.poll();
  CHECK(done);

  MultiNodeFixture g;
  g.formRound(1);
  g.rdzv->leave();
  g.poll();
  g.service.answer(g.service.leaves, Status::ok());
  g.poll();
  const auto before = g.service.calls.size();
  bool left = false;
  g.rdzv->shutdown(false, true, [&] { left = true; });
  g.poll();
  CHECK(left);
  CHECK(g.service.calls.size() == before);
}

TEST_CASE("a heartbeat the service no longer knows makes the node join again",
          "[agent][multinode]") {
  auto o = MultiNodeFixture::defaults();
  o.run_config.heartbeat_interval = 1ms;
  MultiNodeFixture f(o);
  f.formRound(1);
  // Wait (bounded) for the heartbeat timer to fire once.
  const auto give_up = std::chrono::steady_clock::now() + 10s;
  while (f.service.heartbeats.empty() && std::chrono::steady_clock::now() < give_up) {
    f.io.restart();
    f.io.run_one_for(100ms);
  }
  REQUIRE_FALSE(f.service.heartbeats.empty());
  CHECK(f.service.heartbeats.front().first == "a");
  REQUIRE(f.service.heartbeat_policy.retry_for.has_value());
  CHECK(*f.service.heartbeat_policy.retry_for == Duration::zero());  // one attempt per beat
  SECTION("declared dead: its workers may be finishing a job the others ended (failure_grace)") {
    f.service.answer(
        f.service.heartbeats,
        StatusOr<rendezvous::RunStatus>(notFound("node a is not part of run job (declared dead)")));
    f.poll();
    REQUIRE_FALSE(f.events.empty());
    CHECK(f.events.front() == PeerEvent::kNodeDeclaredDead);
  }
  SECTION("a server that lost the run (started again without its state) declared no one dead") {
    f.service.answer(f.service.heartbeats,
                     StatusOr<rendezvous::RunStatus>(rendezvous::runUnknown("job")));
    f.poll();
    REQUIRE_FALSE(f.events.empty());
    CHECK(f.events.front() == PeerEvent::kMembershipChange);
  }
}

TEST_CASE("rank 0 re-joining a round whose master is published keeps that master",
          "[agent][multinode]") {
  MultiNodeFixture f;
  f.formRound(1);
  CHECK(f.result->value().master_port == 1234);
  // Every node re-forms without a membership change: the service answers the same round, with
  // the master rank 0 published the first time. A fresh port would split the workers' stores.
  auto o = MultiNodeFixture::defaults();
  o.master_port = 0;  // would pick a free port
  MultiNodeFixture g(o);
  g.nextRound();
  auto joined = roundOf(1, "a", {{"a", 2}, {"b", 2}});
  joined.master_addr = "a.host";
  joined.master_port = 4321;
  g.service.answer(g.service.joins, joined);
  g.poll();
  CHECK(g.service.publishes.empty());
  REQUIRE(g.result.has_value());
  REQUIRE(g.result->isOk());
  CHECK(g.result->value().group_rank == 0);
  CHECK(g.result->value().master_port == 4321);
}

TEST_CASE("a round that began forming before the watch did is a membership change",
          "[agent][multinode]") {
  // A node left just as this one's round completed: its kRoundPending went out before this
  // node's watch began, and only the watch's first snapshot tells of round 2.
  MultiNodeFixture f;
  f.formRound(1);
  REQUIRE(f.service.watches == 1);
  rendezvous::RoundChange snapshot;
  snapshot.kind = rendezvous::ChangeKind::kSnapshot;
  snapshot.status.completed_round = 1;
  snapshot.status.pending_round = 2;
  snapshot.round = 2;
  f.service.push(snapshot);
  f.poll();
  CHECK(f.events == std::vector<PeerEvent>{PeerEvent::kMembershipChange});
  CHECK(f.rdzv->formingRound() == 2);
  // A later snapshot of that same round (the watch resumed): nothing more.
  f.service.push(snapshot);
  f.poll();
  CHECK(f.events.size() == 1);
  // A snapshot with nothing forming beyond this node's round is no change.
  MultiNodeFixture g;
  g.formRound(1);
  snapshot.status.pending_round = 0;
  snapshot.round = 1;
  g.service.push(snapshot);
  g.poll();
  CHECK(g.events.empty());
  CHECK(g.rdzv->formingRound() == 0);
}

TEST_CASE("a watch's snapshot of a forming round tells why it opened, as its message would have",
          "[agent][multinode]") {
  // The watch broke while this node's agent stalled (SIGSTOP, a paused VM), and the round's
  // kRoundPending went by: the snapshot of the resumed watch names the reason and the node.
  auto snapshotOf = [](rendezvous::ChangeReason reason, const std::string& node) {
    rendezvous::RoundChange snapshot;
    snapshot.kind = rendezvous::ChangeKind::kSnapshot;
    snapshot.reason = reason;
    snapshot.node_id = node;
    snapshot.status.completed_round = 1;
    snapshot.status.pending_round = 2;
    snapshot.round = 2;
    return snapshot;
  };
  struct Case {
    rendezvous::ChangeReason reason;
    bool self;
    std::vector<PeerEvent> events;
  };
  const std::vector<Case> cases = {
      // This node declared dead while it stalled: its running workers get failure_grace.
      {rendezvous::ChangeReason::kNodeDead, true, {PeerEvent::kNodeDeclaredDead}},
      {rendezvous::ChangeReason::kNodeDead, false, {PeerEvent::kNodeDeclaredDead}},
      {rendezvous::ChangeReason::kFailureReported, false, {PeerEvent::kPeerFailure}},
      {rendezvous::ChangeReason::kRecoveryFailed, false, {PeerEvent::kPeerRecoveryFailed}},
      {rendezvous::ChangeReason::kNodeLeft, false, {PeerEvent::kMembershipChange}},
      {rendezvous::ChangeReason::kNodeJoined, false, {PeerEvent::kMembershipChange}},
      // Its own failure report (its answer raised the forming round first, else this): no event.
      {rendezvous::ChangeReason::kFailureReported, true, {}},
  };
  for (const Case& c : cases) {
    INFO(rendezvous::changeReasonName(c.reason) << (c.self ? " by this node" : " by a peer"));
    MultiNodeFixture f;
    f.formRound(1);
    f.service.push(snapshotOf(c.reason, c.self ? f.rdzv->nodeId() : std::string("peer")));
    f.poll();
    CHECK(f.events == c.events);
    CHECK(f.rdzv->formingRound() == 2);
  }
}
