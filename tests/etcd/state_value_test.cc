// The etcd-v3 backend's stored value: header, join answers and snapshot, read without etcd.
#include "state_value.h"

#include <catch2/catch.hpp>

using namespace ddprun;
using namespace ddprun::etcd;
using rendezvous::RendezvousState;

namespace {

TimePoint at(int64_t s) { return TimePoint(std::chrono::seconds(1'700'000'000 + s)); }

std::shared_ptr<const std::string> stored(std::string s) {
  return std::make_shared<const std::string>(std::move(s));
}

rendezvous::JoinRequest joinRequest(const std::string& node, uint32_t nodes) {
  rendezvous::JoinRequest req;
  req.run_id = "run";
  req.node_id = node;
  req.address = node + ".example";
  req.local_world_size = 2;
  req.config.min_nodes = nodes;
  req.config.max_nodes = nodes;
  return req;
}

}  // namespace

TEST_CASE(
    "a waiting joiner finds its rank in the value of the transaction that completed its round",
    "[etcd]") {
  RendezvousState st;
  st.join(11, joinRequest("a", 3), at(0));
  st.join(12, joinRequest("b", 3), at(1));
  REQUIRE(st.drain().joins.empty());
  st.join(13, joinRequest("c", 3), at(2));  // the last joiner completes the round
  RendezvousState::Outbox out = st.drain();
  REQUIRE(out.joins.size() == 3);

  const std::string snapshot = st.exportRun("run");
  auto value = StateValue::parse(
      stored(encodeStateValue(out.changes, out.joins, snapshot, st.nextDeadline())));
  REQUIRE(value.isOk());
  CHECK(value->snapshot().value() == snapshot);
  CHECK(value->nextDeadline() == st.nextDeadline());
  REQUIRE(value->changes().size() == out.changes.size());
  CHECK(value->changes().back().kind == out.changes.back().change.kind);
  CHECK(value->changes().back().round == out.changes.back().change.round);

  for (const auto& done : out.joins) {
    auto answer = value->joinAnswer(done.id);
    REQUIRE(answer);
    REQUIRE(answer->isOk());
    const rendezvous::RoundInfo& want = done.result.value();
    const rendezvous::RoundInfo& got = answer->value();
    CHECK(got.round == want.round);
    CHECK(got.node_id == want.node_id);
    CHECK(got.group_rank == want.group_rank);
    CHECK(got.group_world_size == want.group_world_size);
    CHECK(got.base_rank == want.base_rank);
    CHECK(got.world_size == want.world_size);
    REQUIRE(got.participants);
    REQUIRE(got.participants->size() == 3);
    for (size_t i = 0; i < 3; ++i) {
      CHECK(got.participants->at(i).node_id == want.participants->at(i).node_id);
      CHECK(got.participants->at(i).address == want.participants->at(i).address);
      CHECK(got.participants->at(i).local_world_size == 2);
      CHECK(got.participants->at(i).group_rank == i);
    }
  }
  CHECK_FALSE(value->joinAnswer(99));  // a call this transaction did not answer
}

TEST_CASE("a join the transaction failed reads as that error", "[etcd]") {
  std::vector<RendezvousState::JoinDone> answers;
  answers.push_back({7, Status(StatusCode::kFailedPrecondition, "run r is closed")});
  rendezvous::RoundInfo info;
  info.round = 4;
  info.node_id = "n";
  info.master_addr = "10.0.0.1";
  info.master_port = 29500;
  answers.push_back({8, info});  // no participant list
  auto value = StateValue::parse(stored(encodeStateValue({}, answers, "snap", std::nullopt)));
  REQUIRE(value.isOk());
  CHECK_FALSE(value->nextDeadline());
  CHECK(value->snapshot().value() == "snap");
  auto failed = value->joinAnswer(7);
  REQUIRE(failed);
  REQUIRE_FALSE(failed->isOk());
  CHECK(failed->status().code() == StatusCode::kFailedPrecondition);
  CHECK(failed->status().message() == "run r is closed");
  auto ok = value->joinAnswer(8);
  REQUIRE(ok);
  REQUIRE(ok->isOk());
  CHECK(ok->value().round == 4);
  CHECK(ok->value().master_addr == "10.0.0.1");
  CHECK(ok->value().master_port == 29500);
  CHECK_FALSE(ok->value().participants);
}

TEST_CASE("a value written before join answers existed reads with none", "[etcd]") {
  // "<next deadline>;<n>:<changes><snapshot>"
  const std::string changes = "2 1 3 2 3 0 2 1 0 1:x";
  auto value = StateValue::parse(
      stored("1700000000000000000;" + std::to_string(changes.size()) + ":" + changes + "SNAP"));
  REQUIRE(value.isOk());
  CHECK(value->snapshot().value() == "SNAP");
  REQUIRE(value->changes().size() == 1);
  CHECK(value->changes()[0].kind == rendezvous::ChangeKind::kRoundPending);
  CHECK(value->changes()[0].node_id == "x");
  CHECK(value->nextDeadline() == TimePoint(std::chrono::seconds(1'700'000'000)));
  CHECK_FALSE(value->joinAnswer(1));
}

TEST_CASE("an empty value reads as nothing, a damaged one is refused or answers nothing",
          "[etcd]") {
  auto empty = StateValue::parse(stored(""));
  REQUIRE(empty.isOk());
  CHECK(empty->snapshot().value().empty());
  CHECK(empty->changes().empty());

  for (const std::string bad :
       {"v2;", "v2;x;0:0:", "v2;-;9:", "v2;-;0:9:ab", "12;3:ab", "-;1:zz"}) {
    CAPTURE(bad);
    CHECK_FALSE(StateValue::parse(stored(bad)).isOk());
  }

  // Answers whose record is cut short answer nothing: the joiner falls back to the snapshot.
  std::vector<RendezvousState::JoinDone> answers;
  rendezvous::RoundInfo info;
  info.participants = std::make_shared<std::vector<rendezvous::Participant>>(
      std::vector<rendezvous::Participant>{{"a", "h", 1, 0}, {"b", "h", 1, 1}});
  answers.push_back({5, info});
  std::string good = encodeStateValue({}, answers, "", std::nullopt);
  // Every truncation of the answers section (its length kept) reads nothing or the whole answer.
  const size_t colon = good.find(':', 5);
  const std::string head = good.substr(0, good.find(';', 3) + 1);
  REQUIRE(good.back() == 'p');  // an empty snapshot, stored as it is
  const std::string record = good.substr(colon + 1, good.size() - colon - 2);
  int readable = 0;
  for (size_t cut = 0; cut < record.size(); ++cut) {
    const std::string part = record.substr(0, cut);
    auto v =
        StateValue::parse(stored(head + "0:" + std::to_string(part.size()) + ":" + part + "p"));
    if (!v.isOk()) continue;
    ++readable;
    auto a = v->joinAnswer(5);
    if (a && a->isOk() && a->value().participants) {
      CHECK(a->value().participants->size() == 2);
    }
  }
  CHECK(readable > 0);
}

TEST_CASE(
    "a large snapshot is stored deflated and reads back the same, and a plain one still reads",
    "[etcd]") {
  // A 512-node run: the snapshot every watcher is pushed.
  RendezvousState st;
  for (int i = 0; i < 512; ++i)
    st.join(static_cast<uint64_t>(i + 1), joinRequest("node-" + std::to_string(i), 512), at(i));
  RendezvousState::Outbox out = st.drain();
  const std::string snapshot = st.exportRun("run");
  REQUIRE(snapshot.size() > 20000);
  const std::string value = encodeStateValue(out.changes, out.joins, snapshot, st.nextDeadline());
  CAPTURE(snapshot.size(), value.size());
  CHECK(value.rfind("v3;", 0) == 0);
  auto parsed = StateValue::parse(stored(value));
  REQUIRE(parsed.isOk());
  REQUIRE(parsed->snapshot().isOk());
  CHECK(parsed->snapshot().value() == snapshot);
  // The snapshot section is what shrinks: the value is smaller than the snapshot alone, and
  // without answers (any change but a round's completion) a fraction of it.
  CHECK(value.size() < snapshot.size());
  const size_t bare = encodeStateValue({}, {}, snapshot, std::nullopt).size();
  CAPTURE(bare);
  CHECK(bare * 4 < snapshot.size());
  RendezvousState back;
  REQUIRE(back.importRun("run", parsed->snapshot().value()).isOk());
  CHECK(back.exportRun("run") == snapshot);
  // Join answers and changes read as before.
  REQUIRE_FALSE(out.joins.empty());
  auto answer = parsed->joinAnswer(out.joins.front().id);
  REQUIRE(answer);
  REQUIRE(answer->isOk());
  CHECK(answer->value().world_size == 1024);

  // A value written by the previous format ("v2;", the snapshot as it is) still reads.
  auto old = StateValue::parse(stored("v2;-;0:0:" + snapshot));
  REQUIRE(old.isOk());
  CHECK(old->snapshot().value() == snapshot);
}

TEST_CASE("a damaged deflated snapshot is refused, never a crash or a huge allocation", "[etcd]") {
  std::string snapshot(5000, 'a');
  for (size_t i = 0; i < snapshot.size(); i += 7) snapshot[i] = static_cast<char>('a' + i % 26);
  const std::string good = encodeStateValue({}, {}, snapshot, std::nullopt);
  const size_t z = good.find('z');
  REQUIRE(z != std::string::npos);
  REQUIRE(StateValue::parse(stored(good))->snapshot().value() == snapshot);
  // Unknown section kind, missing size, zero, huge (no allocation of it), not a number.
  for (const std::string bad : {"v3;-;0:0:", "v3;-;0:0:x", "v3;-;0:0:z", "v3;-;0:0:z:abc",
                                "v3;-;0:0:z0:abc", "v3;-;0:0:z99999999999999:abc",
                                "v3;-;0:0:z18446744073709551616:abc", "v3;-;0:0:z12x:abc"}) {
    CAPTURE(bad);
    CHECK_FALSE(StateValue::parse(stored(bad)).isOk());
  }
  // Parsable headers over bytes that do not inflate, or inflate to another size: the snapshot
  // read fails with a clear error.
  const std::string body = good.substr(good.find(':', z) + 1);
  for (const std::string& bad :
       {good.substr(0, good.size() - 10), good.substr(0, z + 1) + "4999:" + body,
        good.substr(0, z + 1) + "5001:" + body,
        good.substr(0, good.size() - 20) + std::string(20, 'x'),
        good.substr(0, z + 1) + "5000:" + std::string(body.size(), '\x01')}) {
    auto v = StateValue::parse(stored(bad));
    if (!v.isOk()) continue;
    auto snap = v->snapshot();
    REQUIRE_FALSE(snap.isOk());
    CHECK(snap.status().code() == StatusCode::kInvalidArgument);
    CHECK_THAT(snap.status().message(), Catch::Contains("does not inflate"));
  }
}

TEST_CASE("a value that claims a huge snapshot is refused before anything is allocated", "[etcd]") {
  // The 46-byte value of issue 34: every agent it was pushed to allocated 1 GiB.
  auto huge = StateValue::parse(stored("v3;-;0:0:z1073741824:garbage"));
  REQUIRE_FALSE(huge.isOk());
  CHECK(huge.status().message() ==
        "the stored rendezvous state says its snapshot inflates to 1073741824 bytes, more than "
        "the 16777216 any run writes (a damaged or foreign value)");
  // At the bound the header is read, and the garbage fails as it inflates, at its first bytes.
  auto at_bound =
      StateValue::parse(stored("v3;-;0:0:z" + std::to_string(kMaxStateSnapshotBytes) + ":garbage"));
  REQUIRE(at_bound.isOk());
  auto snap = at_bound->snapshot();
  REQUIRE_FALSE(snap.isOk());
  CHECK(snap.status().message() ==
        "the stored rendezvous state is unreadable (its snapshot does not inflate)");
}

TEST_CASE("a deflated snapshot must inflate to exactly the size it states", "[etcd]") {
  const std::string snapshot(300000, 's');
  const std::string value = encodeStateValue({}, {}, snapshot, std::nullopt);
  auto ok = StateValue::parse(stored(value));
  REQUIRE(ok.isOk());
  CHECK(ok->snapshot().value() == snapshot);
  // The same deflated bytes stating another size: named either way.
  const std::string deflated = value.substr(value.find(':', value.find('z')) + 1);
  auto more = inflateBounded(deflated, snapshot.size() - 1);
  REQUIRE_FALSE(more.isOk());
  CHECK(more.status().message().find(
            "does not inflate to the 299999 bytes stated: it gives more") != std::string::npos);
  auto fewer = inflateBounded(deflated, snapshot.size() + 10);
  REQUIRE_FALSE(fewer.isOk());
  CHECK(fewer.status().message().find(
            "does not inflate to the 300010 bytes stated: it gives 300000") != std::string::npos);
  auto cut = inflateBounded(deflated.substr(0, deflated.size() / 2), snapshot.size());
  REQUIRE_FALSE(cut.isOk());
  CHECK_FALSE(inflateBounded(deflated, kMaxStateSnapshotBytes + 1).isOk());
}
