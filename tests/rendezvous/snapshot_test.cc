// RendezvousState snapshots (exportRun / importRun) and the queries of a backend that keeps a run
// in a shared store (declareDead, joinOutcome, nodeIds): the etcd-v3 backend applies every request
// to a fresh state imported from etcd, so applying through snapshots must decide exactly as one
// long-lived state does. Pure: time is passed in, no sockets.
#include <catch2/catch.hpp>
#include <map>

#include "ddprun/rendezvous/state.h"

using namespace ddprun;
using namespace ddprun::rendezvous;

namespace {

const std::string kRun = "snap";

JoinRequest request(const std::string& node, uint32_t min, uint32_t max) {
  JoinRequest r;
  r.run_id = kRun;
  r.node_id = node;
  r.address = node + ".host";
  r.local_world_size = 2;
  r.config.min_nodes = min;
  r.config.max_nodes = max;
  r.config.last_call_timeout = seconds(5);
  r.config.heartbeat_interval = seconds(1000);
  r.config.heartbeat_misses = 1;
  r.join_timeout = seconds(60);
  return r;
}

// A run kept as a snapshot string, as in etcd: each request imports it into a fresh state,
// applies, and stores the export.
class Stored {
 public:
  RendezvousState::Outbox apply(const std::function<void(RendezvousState&)>& fn) {
    RendezvousState st;
    REQUIRE(st.importRun(kRun, blob).isOk());
    fn(st);
    auto out = st.drain();
    blob = st.exportRun(kRun);
    return out;
  }
  std::string blob;
};

// What each node got, by node id, from outboxes.
void collect(const RendezvousState::Outbox& out,
             std::map<RendezvousState::CallId, std::string>& who,
             std::map<std::string, RoundInfo>& got) {
  for (const auto& j : out.joins) {
    if (j.result.isOk()) got[who[j.id]] = j.result.value();
  }
}

}  // namespace

TEST_CASE("a run exported and imported again exports the same", "[rendezvous]") {
  RendezvousState st;
  const TimePoint t0{};
  st.join(1, request("a", 2, 3), t0);
  st.join(2, request("b", 2, 3), t0);
  st.join(3, request("c", 2, 3), t0);
  st.join(4, request("spare", 2, 3), t0);
  REQUIRE(st.publishMaster(kRun, "a", 1, {"a.host", 29500}, t0).isOk());
  const std::string blob = st.exportRun(kRun);
  REQUIRE_FALSE(blob.empty());
  RendezvousState copy;
  REQUIRE(copy.importRun(kRun, blob).isOk());
  CHECK(copy.exportRun(kRun) == blob);
  CHECK(copy.masterOf(kRun, 1)->port == 29500);
  CHECK(copy.status(kRun).value().spares == 1);
  // An unknown run exports as nothing, and nothing imports as no run.
  CHECK(st.exportRun("other").empty());
  REQUIRE(copy.importRun(kRun, "").isOk());
  CHECK(copy.status(kRun).status().code() == StatusCode::kNotFound);
}

TEST_CASE("requests applied through snapshots decide as one state does", "[rendezvous]") {
  RendezvousState one;
  Stored stored;
  std::map<RendezvousState::CallId, std::string> who;
  std::map<std::string, RoundInfo> got_one, got_stored;
  TimePoint now{};
  RendezvousState::CallId next = 1;
  auto join = [&](const std::string& node) {
    const auto id = next++;
    who[id] = node;
    one.join(id, request(node, 2, 3), now);
    collect(one.drain(), who, got_one);
    collect(stored.apply([&](RendezvousState& st) { st.join(id, request(node, 2, 3), now); }), who,
            got_stored);
  };
  auto tick = [&](Duration d) {
    now += d;
    one.tick(now);
    collect(one.drain(), who, got_one);
    collect(stored.apply([&](RendezvousState& st) { st.tick(now); }), who, got_stored);
  };
  join("a");
  join("b");
  tick(seconds(6));  // the last call completes round 1 with a, b
  REQUIRE(got_stored.count("a") == 1);
  join("c");  // scale-up: round 2 opens
  join("a");
  join("b");  // all expected re-joined: round 2 completes with stable ranks
  REQUIRE(got_stored.at("c").round == 2);
  // A participant dies: the next round is for the survivors.
  REQUIRE(one.declareDead(kRun, "a", now).isOk());
  collect(one.drain(), who, got_one);
  stored.apply([&](RendezvousState& st) { REQUIRE(st.declareDead(kRun, "a", now).isOk()); });
  join("b");
  join("c");
  REQUIRE(got_stored.at("b").round == 3);
  for (const auto& [node, info] : got_one) {
    INFO(node);
    REQUIRE(got_stored.count(node) == 1);
    CHECK(got_stored.at(node).round == info.round);
    CHECK(got_stored.at(node).group_rank == info.group_rank);
    CHECK(got_stored.at(node).base_rank == info.base_rank);
    CHECK(got_stored.at(node).world_size == info.world_size);
  }
  CHECK(one.exportRun(kRun) == stored.blob);
}

TEST_CASE("joinOutcome follows a join that another agent's request completed", "[rendezvous]") {
  Stored stored;
  const TimePoint t0{};
  stored.apply([&](RendezvousState& st) { st.join(11, request("a", 2, 2), t0); });
  {
    RendezvousState view;
    REQUIRE(view.importRun(kRun, stored.blob).isOk());
    auto pending = view.joinOutcome(kRun, "a");
    REQUIRE(pending.isOk());
    CHECK_FALSE(pending.value().has_value());
  }
  stored.apply([&](RendezvousState& st) { st.join(12, request("b", 2, 2), t0); });
  RendezvousState view;
  REQUIRE(view.importRun(kRun, stored.blob).isOk());
  auto done = view.joinOutcome(kRun, "a");
  REQUIRE(done.isOk());
  REQUIRE(done.value().has_value());
  CHECK(done.value()->round == 1);
  CHECK(done.value()->group_world_size == 2);
  CHECK(view.nodeIds(kRun) == std::vector<std::string>{"a", "b"});
  CHECK(view.joinOutcome(kRun, "gone").status().code() == StatusCode::kNotFound);
  stored.apply([&](RendezvousState& st) { REQUIRE(st.close(kRun, t0).isOk()); });
  RendezvousState closed;
  REQUIRE(closed.importRun(kRun, stored.blob).isOk());
  CHECK(closed.joinOutcome(kRun, "a").status().code() == StatusCode::kFailedPrecondition);
}

TEST_CASE("a closed run stays closed after it shrank to its tombstone", "[rendezvous]") {
  Stored stored;
  TimePoint now{};
  stored.apply([&](RendezvousState& st) { st.join(1, request("a", 1, 1), now); });
  stored.apply([&](RendezvousState& st) { REQUIRE(st.close(kRun, now).isOk()); });
  now += seconds(1);
  stored.apply([&](RendezvousState& st) { st.tick(now); });  // no watcher: shrinks at once
  auto out = stored.apply([&](RendezvousState& st) { st.join(2, request("b", 1, 1), now); });
  REQUIRE(out.joins.size() == 1);
  CHECK(out.joins[0].result.status().code() == StatusCode::kFailedPrecondition);
}

TEST_CASE("a damaged snapshot is refused with a message, never a crash", "[rendezvous]") {
  RendezvousState st;
  const TimePoint t0{};
  st.join(1, request("a", 2, 3), t0);
  st.join(2, request("b", 2, 3), t0);
  st.join(3, request("c", 2, 3), t0);
  const std::string blob = st.exportRun(kRun);
  for (size_t cut = 1; cut < blob.size(); ++cut) {
    RendezvousState fresh;
    Status s = fresh.importRun(kRun, blob.substr(0, cut));
    INFO("cut at " << cut);
    CHECK(s.code() == StatusCode::kInvalidArgument);
  }
  for (size_t i = 0; i < blob.size(); ++i) {
    std::string bad = blob;
    bad[i] = bad[i] == '9' ? 'x' : '9';
    RendezvousState fresh;
    Status s = fresh.importRun(kRun, bad);  // either refused or a readable other run
    if (s.isOk()) CHECK_FALSE(fresh.exportRun(kRun).empty());
  }
  RendezvousState fresh;
  CHECK_THAT(fresh.importRun(kRun, "garbage").message(), Catch::Contains("unreadable"));
}

TEST_CASE("why a forming round opened survives a snapshot and reaches a new watch",
          "[rendezvous]") {
  RendezvousState st;
  const TimePoint t0{};
  st.join(1, request("a", 2, 2), t0);
  st.join(2, request("b", 2, 2), t0);
  REQUIRE(st.status(kRun).value().completed_round == 1);
  // Round 1 formed: a snapshot says nothing forms, so no reason.
  CHECK(st.watchSnapshot(kRun).front().reason == ChangeReason::kNone);
  REQUIRE(st.declareDead(kRun, "b", t0).isOk());
  const std::string blob = st.exportRun(kRun);
  RendezvousState copy;
  REQUIRE(copy.importRun(kRun, blob).isOk());
  CHECK(copy.exportRun(kRun) == blob);
  for (RendezvousState* s : {&st, &copy}) {
    const RoundChange snap = s->watchSnapshot(kRun).front();
    CHECK(snap.kind == ChangeKind::kSnapshot);
    CHECK(snap.status.pending_round == 2);
    CHECK(snap.reason == ChangeReason::kNodeDead);
    CHECK(snap.node_id == "b");
  }
  // A value written by a release before the reason (v1) is read: the round forms, no reason.
  const std::string v2 = "13:ddprun-run-v2";
  const std::string tail = "3 1:b";
  REQUIRE(blob.compare(0, v2.size(), v2) == 0);
  REQUIRE(blob.size() > tail.size());
  REQUIRE(blob.compare(blob.size() - tail.size(), tail.size(), tail) == 0);
  const std::string v1 =
      "13:ddprun-run-v1" + blob.substr(v2.size(), blob.size() - v2.size() - tail.size());
  RendezvousState old;
  REQUIRE(old.importRun(kRun, v1).isOk());
  const RoundChange snap = old.watchSnapshot(kRun).front();
  CHECK(snap.status.pending_round == 2);
  CHECK(snap.reason == ChangeReason::kNone);
  CHECK(snap.node_id.empty());
  // A closed run forms nothing: its snapshot (followed by kClosed) names no cause.
  RendezvousState closed;
  REQUIRE(closed.importRun(kRun, blob).isOk());
  REQUIRE(closed.close(kRun, t0).isOk());
  const auto closing = closed.watchSnapshot(kRun);
  REQUIRE(closing.size() == 2);
  CHECK(closing.front().reason == ChangeReason::kNone);
  CHECK(closing.back().kind == ChangeKind::kClosed);
  // A reason no release writes is refused.
  RendezvousState bad;
  CHECK_THAT(bad.importRun(kRun, blob.substr(0, blob.size() - tail.size()) + "9 1:b").message(),
             Catch::Contains("round reason"));
}
