// The pure core of snapshot replication (snapshot/core.h), event by event: what it asks the shell
// to do for a file written here, a peer's announcement, a round's holdings, a transfer's end and
// time passing. No files, sockets or threads: the test plays the shell.
#include "ddprun/snapshot/core.h"

#include <catch2/catch.hpp>

#include "fake_clock.h"

using namespace ddprun;
using namespace ddprun::snapshot;
using ddprun::testing::FakeClock;

namespace {

constexpr const char* kSelf = "n0:1";
constexpr const char* kPeer1 = "n1:1";
constexpr const char* kPeer2 = "n2:1";

FileId fileId(uint64_t ino, uint64_t size = 10) { return FileId{1, ino, 100, size}; }

// The core with a clock, a shell's view of its actions, and the steps a round takes.
struct Shell {
  FakeClock clock;
  ReplicationCore core{CoreOptions{}, clock};

  Shell() {
    core.setEndpoint(kSelf);
    core.start({}, {});
    core.drain();
  }

  // Round `round` of `endpoints` (this node is group rank `rank`), each holding `held`'s
  // versions.
  void round(uint64_t round, const std::vector<std::string>& endpoints, int rank = 0,
             const std::vector<std::vector<SnapshotVersion>>& held = {}) {
    const uint64_t gen = core.beginRound(round, rank);
    std::vector<std::string> values;
    for (size_t i = 0; i < endpoints.size(); ++i) {
      values.push_back(
          encodeHoldings(endpoints[i], i < held.size() ? held[i] : std::vector<SnapshotVersion>{}));
    }
    core.onHoldings(gen, values);
  }

  std::vector<Action> actions() { return core.drain(); }

  template <typename T>
  static std::vector<T> all(const std::vector<Action>& actions) {
    std::vector<T> out;
    for (const auto& a : actions) {
      if (auto* t = std::get_if<T>(&a)) out.push_back(*t);
    }
    return out;
  }
  template <typename T>
  static T only(const std::vector<Action>& actions) {
    auto found = all<T>(actions);
    REQUIRE(found.size() == 1);
    return found.front();
  }

  // Writes `name` here: the look the core asks for, answered as hashed.
  std::vector<Action> write(const std::string& name, uint64_t ino, uint32_t crc = 7) {
    core.onChanged(name);
    auto look = only<Look>(actions());
    CHECK(look.name == name);
    Looked l;
    l.kind = Looked::Kind::kHashed;
    l.id = fileId(ino);
    l.size = 10;
    l.crc32 = crc;
    core.onLooked(name, l);
    return actions();
  }
};

SnapshotVersion version(const std::string& name, uint64_t v, uint32_t crc = 5) {
  return SnapshotVersion{name, v, 10, crc};
}

}  // namespace

TEST_CASE("a file written here is held, served and announced to the next node of the chain",
          "[snapshot_core]") {
  Shell s;
  s.round(1, {kSelf, kPeer1, kPeer2});
  s.actions();
  auto acts = s.write("snapshot.pt", 11);
  auto hold = Shell::only<Hold>(acts);
  CHECK(hold.version.name == "snapshot.pt");
  CHECK(hold.version.version == makeSnapshotVersion(1, 1));
  CHECK(hold.file == HoldFile::kOpened);
  auto announce = Shell::only<Announce>(acts);
  CHECK(announce.source == kSelf);
  CHECK(announce.origin == kSelf);
  // The chain starts here: n1 is told; n2 only if n1 does not take it.
  REQUIRE(announce.lines.size() == 1);
  CHECK(announce.lines[0] == std::vector<std::string>{kPeer1, kPeer2});
  CHECK(Shell::all<RecordTable>(acts).size() == 1);
  CHECK(s.core.metrics().versions_written == 1);
  CHECK_FALSE(s.core.replicated());  // the announcement is out
  s.core.onAnnounced(Announced{announce, {}});
  CHECK(s.core.replicated());
}

TEST_CASE("files are looked at one at a time in the order written, each name once while it waits",
          "[snapshot_core]") {
  Shell s;
  s.core.onChanged("a.bin");
  s.core.onChanged("b.bin");
  s.core.onChanged("a.bin");  // still being looked at: looked at again after b
  s.core.onChanged("b.bin");  // waits already
  auto first = Shell::only<Look>(s.actions());
  CHECK(first.name == "a.bin");
  CHECK_FALSE(s.core.versioned());
  Looked hashed{Looked::Kind::kHashed, fileId(1), 10, 1, ""};
  s.core.onLooked("a.bin", hashed);
  CHECK(Shell::only<Look>(s.actions()).name == "b.bin");
  s.core.onLooked("b.bin", Looked{Looked::Kind::kHashed, fileId(2), 10, 2, ""});
  auto again = Shell::only<Look>(s.actions());
  CHECK(again.name == "a.bin");
  REQUIRE(again.held);  // the file held: the shell finds it is the same one
  CHECK(again.held->ino == 1);
  s.core.onLooked("a.bin", Looked{Looked::Kind::kSame, fileId(1), 10, 1, ""});
  CHECK(Shell::all<Hold>(s.actions()).empty());
  CHECK(s.core.versioned());
  CHECK(s.core.replica().held("a.bin")->version < s.core.replica().held("b.bin")->version);
}

TEST_CASE("a large file is announced before its hash, and its CRC-32 is held once known",
          "[snapshot_core]") {
  Shell s;
  s.core.onChanged("big.bin");
  auto look = Shell::only<Look>(s.actions());
  CHECK(look.hash_below == CoreOptions{}.announce_before_hash);
  s.core.onLooked("big.bin", Looked{Looked::Kind::kLarge, fileId(3, 1 << 30), 1 << 30, 0, ""});
  auto acts = s.actions();
  auto hold = Shell::only<Hold>(acts);
  CHECK(hold.version.crc_pending);
  auto hash = Shell::only<Hash>(acts);
  CHECK(hash.version == hold.version.version);
  s.core.onChanged("next.bin");  // waits for the hash
  CHECK(Shell::all<Look>(s.actions()).empty());
  CHECK_FALSE(s.core.versioned());
  s.core.onHashed("big.bin", hash.version, uint32_t{42});
  acts = s.actions();
  auto known = Shell::only<Hold>(acts);
  CHECK(known.file == HoldFile::kCrcKnown);
  CHECK(known.version.crc32 == 42);
  CHECK_FALSE(known.version.crc_pending);
  CHECK(Shell::only<Look>(acts).name == "next.bin");
}

TEST_CASE(
    "a rename here is a version of the same file without a hash, and the old name's deletion "
    "names the new one",
    "[snapshot_core]") {
  Shell s;
  s.round(1, {kSelf, kPeer1});
  s.write("staging.pt", 5);
  s.core.onMovedFrom(77, "staging.pt", false);
  CHECK(s.core.nextDeadline());  // the pair's wait
  s.core.onMovedTo(77, "final.pt", false, {});
  auto look = Shell::only<Look>(s.actions());
  CHECK(look.name == "final.pt");
  REQUIRE(look.renamed);
  CHECK(look.renamed->ino == 5);
  s.core.onLooked("final.pt", Looked{Looked::Kind::kRenamed, fileId(5), 10, 0, ""});
  auto acts = s.actions();
  auto renamed = Shell::only<Announce>(acts);
  CHECK(renamed.version.name == "final.pt");
  CHECK(renamed.version.moved_from == "staging.pt");
  CHECK(renamed.version.crc32 == 7);  // the old name's
  CHECK(Shell::only<Look>(acts).name == "staging.pt");
  s.core.onLooked("staging.pt", Looked{Looked::Kind::kGone, {}, 0, 0, ""});
  auto deletion = Shell::only<Announce>(s.actions());
  CHECK(deletion.version.deleted);
  CHECK(deletion.version.moved_to == "final.pt");
}

TEST_CASE("a name renamed away is gone once its pair did not come within the wait",
          "[snapshot_core]") {
  Shell s;
  s.write("old.bin", 9);
  s.core.onMovedFrom(5, "old.bin", false);
  CHECK_FALSE(s.core.versioned());
  s.core.settled();  // too early
  CHECK(Shell::all<Look>(s.actions()).empty());
  const auto due = s.core.nextDeadline();
  REQUIRE(due);
  s.clock.advance(*due - s.clock.now());
  s.core.settled();
  CHECK(Shell::only<Look>(s.actions()).name == "old.bin");
  s.core.onLooked("old.bin", Looked{Looked::Kind::kGone, {}, 0, 0, ""});
  CHECK(Shell::only<Hold>(s.actions()).version.deleted);
  CHECK(s.core.versioned());
}

TEST_CASE("a directory moved in looks at its files, and those renamed from held names need no hash",
          "[snapshot_core]") {
  Shell s;
  s.write("stage/model.pt", 4);
  s.core.onMovedFrom(9, "stage", true);
  s.core.onMovedTo(9, "ckpt-1", true, {"ckpt-1/model.pt"});
  auto look = Shell::only<Look>(s.actions());
  CHECK(look.name == "ckpt-1/model.pt");
  REQUIRE(look.renamed);
  s.core.onLooked(look.name, Looked{Looked::Kind::kRenamed, fileId(4), 10, 0, ""});
  auto acts = s.actions();
  CHECK(Shell::only<Hold>(acts).version.moved_from == "stage/model.pt");
  CHECK(Shell::only<Look>(acts).name == "stage/model.pt");  // its deletion, after
}

TEST_CASE("announcements wait for the round's nodes and are taken only from them",
          "[snapshot_core]") {
  Shell s;
  s.core.beginRound(1, 0);
  s.core.onAnnounce(version("a.bin", makeSnapshotVersion(1, 1)), kPeer1, kPeer1);
  s.core.onAnnounce(version("b.bin", makeSnapshotVersion(1, 1)), "stranger:1", "stranger:1");
  CHECK(Shell::all<Fetch>(s.actions()).empty());  // who is a node is not known yet
  s.core.onHoldings(s.core.generation(), std::vector<std::string>{encodeHoldings(kSelf, {}),
                                                                  encodeHoldings(kPeer1, {})});
  auto fetch = Shell::only<Fetch>(s.actions());
  CHECK(fetch.transfer.file.name == "a.bin");
  CHECK(fetch.transfer.source == kPeer1);
}

TEST_CASE(
    "holdings that did not all come start the round with the nodes that published theirs, and a "
    "late node is taken in, and told what it lacks, when its holdings come",
    "[snapshot_core]") {
  Shell s;
  const uint64_t gen = s.core.beginRound(1, 0);
  const auto held_there = version("old.bin", makeSnapshotVersion(0, 2));
  // n2's holdings did not come in time (its agent stalled at the round's start).
  s.core.onSomeHoldings(
      gen, {encodeHoldings(kSelf, {}), encodeHoldings(kPeer1, {held_there}), std::nullopt});
  auto fetch = Shell::only<Fetch>(s.actions());
  CHECK(fetch.transfer.source == kPeer1);
  s.core.onFetched(Fetched{fetch.transfer, Status::ok(), 5, "/t", false});
  auto install = Shell::only<Install>(s.actions());
  s.core.onInstalled(Installed{install.transfer, "", Status::ok(), fileId(8)});
  CHECK(Shell::only<SyncDone>(s.actions()).generation == gen);  // the round started
  // What is written here goes to the nodes known; n2 is not announced to (nor retried).
  auto announce = Shell::only<Announce>(s.write("ckpt.pt", 11));
  REQUIRE(announce.lines.size() == 1);
  CHECK(announce.lines[0] == std::vector<std::string>{kPeer1});
  s.core.onAnnounced(Announced{announce, {}});
  // n2, which knows the round (it read everyone's holdings), announces what its workers wrote:
  // that waits for its holdings, as does a stranger's.
  const auto from_late = version("late.bin", makeSnapshotVersion(1, 1));
  s.core.onAnnounce(from_late, kPeer2, kPeer2);
  s.core.onAnnounce(version("x.bin", makeSnapshotVersion(1, 1)), "stranger:1", "stranger:1");
  CHECK(Shell::all<Fetch>(s.actions()).empty());
  // Late holdings of another generation, or of a node that was not missing, are ignored.
  s.core.onLateHoldings(gen + 1, 2, encodeHoldings(kPeer2, {}));
  s.core.onLateHoldings(gen, 1, encodeHoldings(kPeer2, {}));
  CHECK(s.actions().empty());
  // n2's come: it is told what it lacks of this round (not old.bin, from the round before, which
  // it read in n1's holdings), and its announcement is taken (the stranger's still is not).
  s.core.onLateHoldings(gen, 2, encodeHoldings(kPeer2, {}));
  auto acts = s.actions();
  auto again = Shell::only<AnnounceAgain>(acts);
  CHECK(again.peer == kPeer2);
  REQUIRE(again.items.size() == 1);
  CHECK(again.items[0].version.name == "ckpt.pt");
  CHECK(again.items[0].source == kSelf);
  auto late_fetch = Shell::only<Fetch>(acts);
  CHECK(late_fetch.transfer.file.name == "late.bin");
  CHECK(late_fetch.transfer.source == kPeer2);
  CHECK_FALSE(s.core.replicated());
  s.core.onAnnouncedAgain(again, again.items.size());
  // From now on n2 is a node of the chain.
  auto next = Shell::only<Announce>(s.write("ckpt2.pt", 12));
  REQUIRE(next.lines.size() == 1);
  CHECK(next.lines[0] == std::vector<std::string>{kPeer1, kPeer2});
  // A node whose late holdings list what it holds already is told nothing; unreadable ones leave
  // it out of the round.
  Shell t;
  const uint64_t g = t.core.beginRound(1, 0);
  t.core.onSomeHoldings(g, {encodeHoldings(kSelf, {}), std::nullopt, std::nullopt});
  t.actions();
  const auto written = Shell::only<Hold>(t.write("a.pt", 3)).version;  // announced to no one
  t.core.onLateHoldings(g, 1, encodeHoldings(kPeer1, {written}));
  t.core.onLateHoldings(g, 2, "");  // no endpoint
  CHECK(Shell::all<AnnounceAgain>(t.actions()).empty());
  t.core.onAnnounce(version("b.bin", makeSnapshotVersion(1, 1)), kPeer2, kPeer2);
  CHECK(Shell::all<Fetch>(t.actions()).empty());
  t.core.onAnnounce(version("b.bin", makeSnapshotVersion(1, 1)), kPeer1, kPeer1);
  CHECK(Shell::only<Fetch>(t.actions()).transfer.source == kPeer1);
  // Late holdings naming another node's endpoint (before or after it) or this node's do not make
  // it a node twice, nor is what they list fetched.
  Shell u;
  const uint64_t h = u.core.beginRound(1, 0);
  u.core.onSomeHoldings(h, {encodeHoldings(kSelf, {}), std::nullopt, encodeHoldings(kPeer2, {}),
                            std::nullopt, std::nullopt});
  u.actions();
  u.write("c.pt", 4);
  const auto listed = version("f.bin", makeSnapshotVersion(1, 1));
  u.core.onLateHoldings(h, 1, encodeHoldings(kPeer2, {listed}));
  u.core.onLateHoldings(h, 3, encodeHoldings(kSelf, {listed}));
  u.core.onLateHoldings(h, 4, encodeHoldings(kPeer1, {}));
  auto after = u.actions();
  CHECK(Shell::all<Fetch>(after).empty());
  CHECK(Shell::only<AnnounceAgain>(after).peer == kPeer1);
  CHECK(Shell::only<Announce>(u.write("d.pt", 5)).lines[0] ==
        std::vector<std::string>{kPeer2, kPeer1});
  // This node's own holdings not read back (the store did not answer it): it is still itself, and
  // the chain after it steps over the node not known.
  Shell w;
  const uint64_t k = w.core.beginRound(1, 1);
  w.core.onSomeHoldings(k, {encodeHoldings(kPeer1, {}), std::nullopt, std::nullopt});
  CHECK(Shell::only<SyncDone>(w.actions()).generation == k);
  auto own = Shell::only<Announce>(w.write("e.pt", 6));
  CHECK(own.source == kSelf);
  REQUIRE(own.lines.size() == 1);
  CHECK(own.lines[0] == std::vector<std::string>{kPeer1});
}

TEST_CASE("a fetched copy is installed only if still newer, and then passed on down the chain",
          "[snapshot_core]") {
  Shell s;
  s.round(1, {kPeer1, kSelf, kPeer2}, 1);
  s.actions();
  const auto v = version("a.bin", makeSnapshotVersion(1, 1));
  s.core.onAnnounce(v, kPeer1, kPeer1);
  auto fetch = Shell::only<Fetch>(s.actions());
  s.core.onFetched(Fetched{fetch.transfer, Status::ok(), 5, "/d/.ddprun-recv.a", false});
  auto install = Shell::only<Install>(s.actions());
  CHECK(install.temp == "/d/.ddprun-recv.a");
  s.core.onInstalled(Installed{install.transfer, install.taken, Status::ok(), fileId(20)});
  auto acts = s.actions();
  CHECK(s.core.replica().held("a.bin")->version == v.version);
  CHECK(s.core.metrics().versions_fetched == 1);
  CHECK(Shell::all<RecordTable>(acts).size() == 1);
  // Written meanwhile here, a copy of an older version is not installed.
  s.write("b.bin", 30);
  s.core.onAnnounce(version("b.bin", makeSnapshotVersion(1, 1)), kPeer1, kPeer1);
  CHECK(Shell::all<Fetch>(s.actions()).empty());  // not newer than what was written here
}

TEST_CASE(
    "a failed fetch is retried from the next holder, and given up is passed on from where it "
    "was tried",
    "[snapshot_core]") {
  Shell s;
  s.round(1, {kSelf, kPeer1, kPeer2});
  s.actions();
  const auto v = version("a.bin", makeSnapshotVersion(1, 1));
  s.core.onAnnounce(v, kPeer1, kPeer1);
  s.core.onAnnounce(v, kPeer2, kPeer1);
  auto fetch = Shell::only<Fetch>(s.actions());
  for (int attempt = 1; attempt <= 4; ++attempt) {
    CHECK(fetch.transfer.attempt == attempt);
    s.core.onFetched(
        Fetched{fetch.transfer, Status(StatusCode::kUnavailable, "gone"), 0, "", false});
    auto acts = s.actions();
    if (attempt == 4) {
      CHECK(Shell::all<Fetch>(acts).empty());
      CHECK(s.core.metrics().transfer_failures == 4);
      CHECK_FALSE(s.core.replica().wanted("a.bin"));
      break;
    }
    const std::string before = fetch.transfer.source;
    fetch = Shell::only<Fetch>(acts);
    CHECK(fetch.transfer.source != before);
  }
}

TEST_CASE(
    "a version this node relays is served as it arrives, and a failure tells the rest of the "
    "chain where to fetch it",
    "[snapshot_core]") {
  Shell s;
  // Rank 0 here; n2 wrote it: its chain is n2, n0, n1.
  s.round(1, {kSelf, kPeer1, kPeer2});
  s.actions();
  const auto v = version("a.bin", makeSnapshotVersion(1, 1));
  s.core.onAnnounce(v, kPeer2, kPeer2);
  auto acts = s.actions();
  auto fetch = Shell::only<Fetch>(acts);
  CHECK(fetch.serve_arriving);
  auto passed = Shell::only<Announce>(acts);
  CHECK(passed.source == kSelf);
  CHECK(passed.origin == kPeer2);
  REQUIRE(passed.lines.size() == 1);
  CHECK(passed.lines[0] == std::vector<std::string>{kPeer1});
  s.core.onAnnounced(Announced{passed, {}});
  s.core.onFetched(Fetched{fetch.transfer, Status(StatusCode::kDataLoss, "bad"), 0, "", false});
  acts = s.actions();
  auto told = Shell::only<Announce>(acts);  // n1's stream from here failed with this fetch
  CHECK(told.source == kPeer2);
  CHECK(Shell::only<Fetch>(acts).transfer.attempt == 2);
}

TEST_CASE(
    "a node that does not take an announcement is stepped over and told again while the "
    "round lasts",
    "[snapshot_core]") {
  Shell s;
  s.round(1, {kSelf, kPeer1, kPeer2});
  s.actions();
  auto announce = Shell::only<Announce>(s.write("a.bin", 1));
  s.core.onAnnounced(Announced{announce, {{kPeer1, "deadline exceeded", true}}});
  const auto due = s.core.nextDeadline();
  REQUIRE(due);
  // Meanwhile the next version steps over n1 without trying it.
  auto next = Shell::only<Announce>(s.write("b.bin", 2));
  CHECK(next.lines[0] == std::vector<std::string>{kPeer2});
  s.core.onAnnounced(Announced{next, {}});
  s.core.tick();
  CHECK(Shell::all<AnnounceAgain>(s.actions()).empty());  // not yet
  s.clock.advance(*due - s.clock.now());
  s.core.tick();
  auto again = Shell::only<AnnounceAgain>(s.actions());
  CHECK(again.peer == kPeer1);
  REQUIRE(again.items.size() == 2);
  CHECK(again.items[0].version.name == "a.bin");
  CHECK_FALSE(s.core.replicated());
  s.core.onAnnouncedAgain(again, 2);
  CHECK(s.core.replicated());
  CHECK_FALSE(s.core.nextDeadline());
  // Answered: tried first again.
  auto third = Shell::only<Announce>(s.write("c.bin", 3));
  CHECK(third.lines[0] == std::vector<std::string>{kPeer1, kPeer2});
}

TEST_CASE("a round is handed on once what is newer elsewhere is fetched", "[snapshot_core]") {
  Shell s;
  const uint64_t gen = s.core.beginRound(2, 0);
  const auto v = version("a.bin", makeSnapshotVersion(1, 3));
  s.core.onHoldings(
      gen, std::vector<std::string>{encodeHoldings(kSelf, {}), encodeHoldings(kPeer1, {v})});
  auto acts = s.actions();
  CHECK(Shell::all<SyncDone>(acts).empty());
  auto fetch = Shell::only<Fetch>(acts);
  CHECK(fetch.prompt);  // the round's sync waits for it: no workers run
  s.core.onFetched(Fetched{fetch.transfer, Status::ok(), 5, "/t", false});
  auto install = Shell::only<Install>(s.actions());
  s.core.onInstalled(Installed{install.transfer, "", Status::ok(), fileId(8)});
  CHECK(Shell::only<SyncDone>(s.actions()).generation == gen);
  // Holdings that do not arrive hand the round on with what is held here.
  const uint64_t next = s.core.beginRound(3, 0);
  s.core.onHoldings(next, Status(StatusCode::kDeadlineExceeded, "late"));
  CHECK(Shell::only<SyncDone>(s.actions()).generation == next);
}

TEST_CASE("a round's sync still fetching is handed on when the next round begins",
          "[snapshot_core]") {
  Shell s;
  const uint64_t gen = s.core.beginRound(2, 0);
  const auto v = version("a.bin", makeSnapshotVersion(1, 3));
  s.core.onHoldings(
      gen, std::vector<std::string>{encodeHoldings(kSelf, {}), encodeHoldings(kPeer1, {v})});
  auto fetch = Shell::only<Fetch>(s.actions());
  s.core.beginRound(3, 0);
  CHECK(Shell::only<SyncDone>(s.actions()).generation == gen);
  // The fetch from a node that is not in the new round ends.
  s.core.onHoldings(s.core.generation(), std::vector<std::string>{encodeHoldings(kSelf, {}),
                                                                  encodeHoldings(kPeer2, {})});
  auto cancel = Shell::only<CancelFetch>(s.actions());
  CHECK(cancel.name == "a.bin");
  CHECK(cancel.why.code() == StatusCode::kUnavailable);
  s.core.onFetched(Fetched{fetch.transfer, cancel.why, 0, "", false});
  CHECK(Shell::only<SyncDone>(s.actions()).generation == s.core.generation());
}

TEST_CASE(
    "another node's deletion deletes the copy here, kept a while for the name it was renamed "
    "to",
    "[snapshot_core]") {
  Shell s;
  s.round(1, {kSelf, kPeer1});
  s.actions();
  auto written = Shell::only<Hold>(s.write("staging.pt", 6)).version;
  SnapshotVersion deletion{"staging.pt", makeSnapshotVersion(1, 2), 0, 0};
  deletion.deleted = true;
  deletion.moved_to = "final.pt";
  s.core.onAnnounce(deletion, kPeer1, kPeer1);
  auto del = Shell::only<Delete>(s.actions());
  CHECK(del.set_aside);
  s.core.onDeleted(Deleted{del.transfer, Status::ok(), true, ".ddprun-recv.kept.1"});
  CHECK(s.core.replica().held("staging.pt")->deleted);
  // The renamed version comes after: linked from the file set aside.
  SnapshotVersion renamed{"final.pt", makeSnapshotVersion(1, 3), written.size, written.crc32};
  renamed.moved_from = "staging.pt";
  renamed.moved_from_version = written.version;
  s.core.onAnnounce(renamed, kPeer1, kPeer1);
  auto link = Shell::only<Link>(s.actions());
  CHECK(link.from == ".ddprun-recv.kept.1");
  CHECK(link.expect.ino == 6);
  s.core.onLinked(Linked{link.transfer, "/d/.ddprun-recv.final"});
  auto acts = s.actions();
  CHECK(Shell::only<DropKept>(acts).name == "staging.pt");
  auto install = Shell::only<Install>(acts);
  CHECK(install.taken == "linked from staging.pt");
  s.core.onInstalled(Installed{install.transfer, install.taken, Status::ok(), fileId(6)});
  CHECK(s.core.metrics().versions_copied == 1);
}

TEST_CASE("a kept copy is let go when its time is up, and a link that fails becomes a copy",
          "[snapshot_core]") {
  Shell s;
  s.round(1, {kSelf, kPeer1});
  s.actions();
  auto written = Shell::only<Hold>(s.write("a.pt", 6)).version;
  SnapshotVersion deletion{"a.pt", makeSnapshotVersion(1, 2), 0, 0};
  deletion.deleted = true;
  deletion.moved_to = "b.pt";
  s.core.onAnnounce(deletion, kPeer1, kPeer1);
  s.core.onDeleted(Deleted{Shell::only<Delete>(s.actions()).transfer, Status::ok(), true, ""});
  SnapshotVersion renamed{"b.pt", makeSnapshotVersion(1, 3), written.size, written.crc32};
  renamed.moved_from = "a.pt";
  renamed.moved_from_version = written.version;

  SECTION("kept open only: copied") {
    s.core.onAnnounce(renamed, kPeer1, kPeer1);
    auto acts = s.actions();
    auto fetch = Shell::only<Fetch>(acts);
    CHECK(fetch.copy_from == "a.pt");
    CHECK(fetch.from_kept);
    CHECK(Shell::only<DropKept>(acts).name == "a.pt");
  }
  SECTION("past its time: let go, and fetched") {
    const auto due = s.core.nextDeadline();
    REQUIRE(due);
    s.clock.advance(*due - s.clock.now());
    s.core.tick();
    CHECK(Shell::only<DropKept>(s.actions()).name == "a.pt");
    s.core.onAnnounce(renamed, kPeer1, kPeer1);
    auto fetch = Shell::only<Fetch>(s.actions());
    CHECK(fetch.copy_from.empty());
    CHECK(fetch.transfer.source == kPeer1);
  }
}

TEST_CASE("a held file renamed elsewhere is linked here, and copied when the link fails",
          "[snapshot_core]") {
  Shell s;
  s.round(1, {kSelf, kPeer1});
  s.actions();
  auto written = Shell::only<Hold>(s.write("a.pt", 6)).version;
  SnapshotVersion renamed{"b.pt", makeSnapshotVersion(1, 3), written.size, written.crc32};
  renamed.moved_from = "a.pt";
  renamed.moved_from_version = written.version;
  s.core.onAnnounce(renamed, kPeer1, kPeer1);
  auto link = Shell::only<Link>(s.actions());
  CHECK(link.from == "a.pt");
  s.core.onLinked(Linked{link.transfer, ""});  // a worker changed it meanwhile
  auto fetch = Shell::only<Fetch>(s.actions());
  CHECK(fetch.copy_from == "a.pt");
  CHECK_FALSE(fetch.from_kept);
  s.core.onFetched(Fetched{fetch.transfer, Status::ok(), written.crc32, "/t", true});
  auto install = Shell::only<Install>(s.actions());
  CHECK(install.taken == "copied from a.pt");
}

TEST_CASE(
    "the start holds what the version table recorded for the same content, and deletions it "
    "recorded",
    "[snapshot_core]") {
  FakeClock clock;
  ReplicationCore core(CoreOptions{}, clock);
  std::map<std::string, SnapshotVersion> table;
  table["kept.bin"] = SnapshotVersion{"kept.bin", makeSnapshotVersion(3, 2), 10, 77};
  table["changed.bin"] = SnapshotVersion{"changed.bin", makeSnapshotVersion(3, 1), 10, 1};
  SnapshotVersion gone{"gone.bin", makeSnapshotVersion(3, 3), 0, 0};
  gone.deleted = true;
  table["gone.bin"] = gone;
  core.start(table,
             {Existing{"kept.bin", 10, 77, fileId(1)}, Existing{"changed.bin", 10, 2, fileId(2)}});
  auto acts = core.drain();
  CHECK(Shell::all<Hold>(acts).size() == 3);
  CHECK(core.replica().held("kept.bin")->version == makeSnapshotVersion(3, 2));
  CHECK(core.replica().held("changed.bin")->version == 0);
  CHECK(core.replica().held("gone.bin")->deleted);
  auto record = Shell::only<RecordTable>(acts);
  auto decoded = decodeVersionTable(record.text);
  REQUIRE(decoded.isOk());
  CHECK(decoded->count("kept.bin") == 1);
  CHECK(decoded->count("changed.bin") == 0);  // version 0: nothing to keep
  CHECK(decoded->count("gone.bin") == 1);
  CHECK(core.metrics().newest_version == makeSnapshotVersion(3, 3));
}
