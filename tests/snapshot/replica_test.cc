#include "ddprun/snapshot/replica.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <random>

#include "ddprun/common/deflate.h"
#include "ddprun/snapshot/relays.h"

using namespace ddprun;
using namespace ddprun::snapshot;

namespace {

SnapshotVersion file(uint64_t version, uint32_t crc = 7, const std::string& name = "snapshot.pt") {
  return SnapshotVersion{name, version, 100 + version, crc};
}

}  // namespace

TEST_CASE("files at any depth are replicated, except temp files, the agent's own and escapes",
          "[snapshot]") {
  CHECK(isReplicatedName("snapshot.pt"));
  CHECK(isReplicatedName("model-3.bin"));
  CHECK(isReplicatedName(".metadata"));  // torch.distributed.checkpoint's
  CHECK(isReplicatedName("checkpoint-500/optimizer.pt"));
  CHECK(isReplicatedName("step_100/.metadata"));
  CHECK(isReplicatedName("a/b/c/d/e/f"));
  CHECK(isReplicatedName("runs/lost+found"));  // only the file system's own, at the top
  CHECK(isReplicatedName(std::string(255, 'a') + "/" + std::string(255, 'b')));
  std::string deep;  // 5 directories of 200 bytes
  for (int i = 0; i < 5; ++i) deep += std::string(200, 'a') + "/";
  CHECK(isReplicatedName(deep + std::string(kMaxReplicatedName - deep.size(), 'b')));

  CHECK_FALSE(isReplicatedName(""));
  CHECK_FALSE(isReplicatedName("snapshot.pt.tmp"));
  CHECK_FALSE(isReplicatedName("snap.pt.tmp.123.456"));
  CHECK_FALSE(isReplicatedName("step_100/.metadata.tmp"));
  CHECK_FALSE(isReplicatedName("ckpt.tmp/model.pt"));  // a directory written before its rename
  CHECK_FALSE(isReplicatedName(".ddprun-versions"));
  CHECK_FALSE(isReplicatedName("ckpt/.ddprun-recv.model.pt.1.2"));
  CHECK_FALSE(isReplicatedName("lost+found"));
  CHECK_FALSE(isReplicatedName("lost+found/x"));
  CHECK_FALSE(isReplicatedName("bad\nname"));
  CHECK_FALSE(isReplicatedName("a/bad\x7fname"));
  CHECK_FALSE(isReplicatedName(std::string(256, 'a')));
  CHECK_FALSE(isReplicatedName("a/" + std::string(256, 'b')));
  CHECK_FALSE(isReplicatedName(deep + std::string(kMaxReplicatedName - deep.size() + 1, 'b')));
  // Nothing that leaves the directory, or names it twice.
  for (const char* escape :
       {"/etc/passwd", "../x", "a/../../x", "a/..", "./x", "a/./b", "a//b", "a/", "/", ".", ".."}) {
    INFO(escape);
    CHECK_FALSE(isReplicatedName(escape));
  }
}

TEST_CASE("a local write gets a version above every version seen, later rounds above earlier",
          "[snapshot]") {
  SnapshotReplica r;
  auto v1 = r.onLocalWrite("snapshot.pt", 10, 1, 3);
  CHECK(v1.version == makeSnapshotVersion(3, 1));
  auto v2 = r.onLocalWrite("snapshot.pt", 10, 2, 3);
  CHECK(v2.version == makeSnapshotVersion(3, 2));
  r.onHolder(file(makeSnapshotVersion(3, 9), 5, "other.pt"), "b:1");
  CHECK(r.onLocalWrite("snapshot.pt", 10, 3, 3).version == makeSnapshotVersion(3, 10));
  CHECK(r.onLocalWrite("snapshot.pt", 10, 4, 5).version == makeSnapshotVersion(5, 1));
  CHECK(r.held("snapshot.pt")->crc32 == 4);
}

TEST_CASE("a newer version held elsewhere is fetched but an older or equal one is not",
          "[snapshot]") {
  SnapshotReplica r;
  r.onLocalWrite("snapshot.pt", 10, 1, 2);
  const uint64_t mine = r.held("snapshot.pt")->version;
  r.onHolder(file(mine - 1), "b:1");
  r.onHolder(SnapshotVersion{"snapshot.pt", mine, 10, 1}, "b:1");  // what is held
  CHECK(r.takeTransfers().empty());
  CHECK_FALSE(r.busy());
  r.onHolder(file(mine + 1), "b:1");
  CHECK(r.busy());
  auto t = r.takeTransfers();
  REQUIRE(t.size() == 1);
  CHECK(t[0].file == file(mine + 1));
  CHECK(t[0].source == "b:1");
  CHECK(r.takeTransfers().empty());  // one transfer per name at a time
}

TEST_CASE("a file in a directory is fetched under its path but a peer's escaping name never is",
          "[snapshot]") {
  SnapshotReplica r;
  for (const char* hostile : {"../x", "/etc/passwd", "ckpt/../../x", ".ddprun-versions", "a//b"}) {
    r.onHolder(file(makeSnapshotVersion(1, 1), 7, hostile), "b:1");
  }
  CHECK(r.takeTransfers().empty());
  CHECK_FALSE(r.busy());
  r.onHolder(file(makeSnapshotVersion(1, 2), 7, "ckpt-5/.metadata"), "b:1");
  auto t = r.takeTransfers();
  REQUIRE(t.size() == 1);
  CHECK(t[0].file.name == "ckpt-5/.metadata");
}

TEST_CASE("two nodes that wrote a name under one number end with the same content", "[snapshot]") {
  // Nodes a and b both wrote snapshot.pt in round 4 before hearing of each other's write: the
  // same number, other bytes. Each hears of the other's; the greater content wins on both.
  SnapshotReplica a, b;
  const SnapshotVersion va = a.onLocalWrite("snapshot.pt", 100, 7, 4);
  const SnapshotVersion vb = b.onLocalWrite("snapshot.pt", 100, 9, 4);
  REQUIRE(va.version == vb.version);
  CHECK(vb.supersedes(va));
  CHECK_FALSE(va.supersedes(vb));
  CHECK_FALSE(va.supersedes(va));
  b.onHolder(va, "a:1");
  CHECK_FALSE(b.busy());  // b's is the greater: kept
  a.onHolder(vb, "b:1");
  auto t = a.takeTransfers();
  REQUIRE(t.size() == 1);
  CHECK(t[0].file == vb);
  CHECK(a.shouldInstall(vb));
  a.onTransferDone(t[0], TransferOutcome::kOk);
  CHECK(a.held("snapshot.pt") == vb);
  CHECK_FALSE(a.busy());
  a.onHolder(va, "c:1");  // a's own, heard of again from a node that still holds it
  CHECK_FALSE(a.busy());

  // The order: the larger size first, then the larger CRC-32, and a file over a tombstone.
  const uint64_t n = va.version;
  CHECK(SnapshotVersion({"s", n, 101, 1}).supersedes({"s", n, 100, 9}));
  SnapshotVersion gone{"s", n, 0, 0};
  gone.deleted = true;
  CHECK(SnapshotVersion({"s", n, 0, 0}).supersedes(gone));
  CHECK_FALSE(gone.supersedes({"s", n, 0, 0}));
  // Version 0 (files no agent recorded) is never decided by content: each node keeps its own.
  CHECK_FALSE(SnapshotVersion({"s", 0, 101, 1}).supersedes({"s", 0, 100, 9}));
  // A higher number wins whatever the content.
  CHECK(SnapshotVersion({"s", n + 1, 1, 1}).supersedes({"s", n, 100, 9}));

  // Content still being hashed decides nothing until its CRC-32 is known.
  SnapshotVersion pending{"s", n, 100, 0};
  pending.crc_pending = true;
  CHECK_FALSE(pending.supersedes({"s", n, 100, 9}));
  CHECK_FALSE(SnapshotVersion({"s", n, 100, 9}).supersedes(pending));
  SnapshotReplica hashing;
  hashing.onLocalWritePending("s", 100, 4);
  hashing.onHolder({"s", n, 100, 9}, "b:1");
  CHECK_FALSE(hashing.busy());
  hashing.onCrcKnown("s", n, 5);  // hashed: the next round's holdings are compared
  hashing.onHolder({"s", n, 100, 9}, "b:1");
  CHECK(hashing.busy());
}

TEST_CASE("the previous version stays held until the new copy is installed", "[snapshot]") {
  SnapshotReplica r;
  r.onHolder(file(5), "a:1");
  auto t = r.takeTransfers();
  REQUIRE(t.size() == 1);
  r.onTransferDone(t[0], TransferOutcome::kOk);
  CHECK(r.held("snapshot.pt") == file(5));
  r.onHolder(file(6), "a:1");
  t = r.takeTransfers();
  REQUIRE(t.size() == 1);
  CHECK(r.held("snapshot.pt") == file(5));  // still 5 while 6 is in flight
  r.onTransferDone(t[0], TransferOutcome::kFailed);
  CHECK(r.held("snapshot.pt") == file(5));  // a failed transfer changes nothing
}

TEST_CASE("a corrupt transfer is retried from the next holder, then given up", "[snapshot]") {
  SnapshotReplica r(SnapshotReplicaOptions{3, 0});
  r.onHolder(file(4), "a:1");
  r.onHolder(file(4), "b:1");
  r.onHolder(file(4), "a:1");  // a holder counts once
  std::vector<std::string> tried;
  for (int i = 0; i < 3; ++i) {
    auto t = r.takeTransfers();
    REQUIRE(t.size() == 1);
    CHECK(t[0].attempt == i + 1);
    tried.push_back(t[0].source);
    r.onTransferDone(t[0], TransferOutcome::kCorrupt);
  }
  CHECK(tried == std::vector<std::string>{"a:1", "b:1", "a:1"});
  CHECK(r.takeTransfers().empty());
  CHECK_FALSE(r.busy());
  CHECK_FALSE(r.held("snapshot.pt"));
  CHECK_FALSE(r.wanted("snapshot.pt"));
  r.retryGivenUp();  // next round: ask again
  CHECK(r.wanted("snapshot.pt") == 4u);
  CHECK(r.takeTransfers().size() == 1);
}

TEST_CASE("a version given up after failures gets one attempt from each holder announced later",
          "[snapshot]") {
  // A relay whose own fetch failed answers every fetch from it with that failure, until its retry
  // starts: the node below it may spend every attempt there before the relay names its source.
  SnapshotReplica r(SnapshotReplicaOptions{3, 0});
  r.onHolder(file(4), "relay:1");
  for (int i = 0; i < 3; ++i) {
    auto t = r.takeTransfers();
    REQUIRE(t.size() == 1);
    CHECK(t[0].source == "relay:1");
    r.onTransferDone(t[0], TransferOutcome::kFailed);
  }
  CHECK(r.takeTransfers().empty());
  r.onHolder(file(4), "relay:1");  // a holder already tried: still given up
  CHECK(r.takeTransfers().empty());
  CHECK_FALSE(r.busy());
  r.onHolder(file(4), "writer:1");  // the relay's source
  CHECK(r.busy());
  CHECK(r.wanted("snapshot.pt") == 4u);
  auto t = r.takeTransfers();
  REQUIRE(t.size() == 1);
  CHECK(t[0].source == "writer:1");
  CHECK(t[0].attempt == 3);
  r.onTransferDone(t[0], TransferOutcome::kCorrupt);  // one attempt only
  CHECK(r.takeTransfers().empty());
  r.onHolder(file(4), "third:1");
  t = r.takeTransfers();
  REQUIRE(t.size() == 1);
  CHECK(t[0].source == "third:1");
  r.onTransferDone(t[0], TransferOutcome::kOk);
  CHECK(r.held("snapshot.pt") == file(4));
  CHECK_FALSE(r.busy());
}

TEST_CASE("no space for a version is not retried, and a newer version is still fetched",
          "[snapshot]") {
  SnapshotReplica r;
  r.onHolder(file(4), "a:1");
  auto t = r.takeTransfers();
  r.onTransferDone(t.at(0), TransferOutcome::kNoSpace);
  CHECK(r.takeTransfers().empty());
  CHECK_FALSE(r.busy());
  r.onHolder(file(4), "b:1");  // the same version again: still given up
  CHECK(r.takeTransfers().empty());
  r.onHolder(file(9), "a:1");
  t = r.takeTransfers();
  REQUIRE(t.size() == 1);
  CHECK(t[0].file.version == 9);
}

TEST_CASE("a newer version announced mid-transfer replaces the wanted one after it ends",
          "[snapshot]") {
  SnapshotReplica r;
  r.onHolder(file(4), "a:1");
  auto t4 = r.takeTransfers().at(0);
  r.onHolder(file(5), "a:1");
  CHECK(r.takeTransfers().empty());  // 4 still runs
  CHECK(r.shouldInstall(t4.file));
  r.onTransferDone(t4, TransferOutcome::kOk);
  CHECK(r.held("snapshot.pt")->version == 4);
  auto t5 = r.takeTransfers();
  REQUIRE(t5.size() == 1);
  CHECK(t5[0].file.version == 5);
  CHECK(t5[0].attempt == 1);
  r.onTransferDone(t5[0], TransferOutcome::kOk);
  CHECK(r.held("snapshot.pt")->version == 5);
  CHECK_FALSE(r.busy());
}

TEST_CASE("a copy older than what was written locally meanwhile is not installed", "[snapshot]") {
  SnapshotReplica r;
  r.onHolder(file(makeSnapshotVersion(1, 1)), "a:1");
  auto t = r.takeTransfers().at(0);
  auto mine = r.onLocalWrite("snapshot.pt", 10, 99, 2);
  CHECK_FALSE(r.shouldInstall(t.file));
  r.onTransferDone(t, TransferOutcome::kOk);
  CHECK(r.held("snapshot.pt") == mine);
  CHECK_FALSE(r.busy());
}

TEST_CASE("first tries are spread over the holders by group rank", "[snapshot]") {
  SnapshotReplica r(SnapshotReplicaOptions{4, 1});
  r.onHolder(file(3), "a:1");
  r.onHolder(file(3), "b:1");
  CHECK(r.takeTransfers().at(0).source == "b:1");
}

TEST_CASE("files that were there before the job have version 0 and lose to any version",
          "[snapshot]") {
  SnapshotReplica r;
  r.adoptExisting("snapshot.pt", 10, 1);
  r.onHolder(SnapshotVersion{"snapshot.pt", 0, 10, 2}, "b:1");
  CHECK(r.takeTransfers().empty());
  r.onHolder(file(1), "b:1");
  CHECK(r.takeTransfers().size() == 1);
}

TEST_CASE("holdings survive the key-value text and malformed text is refused", "[snapshot]") {
  std::vector<SnapshotVersion> held = {file(makeSnapshotVersion(7, 3)), file(0, 9, "b.bin")};
  auto text = encodeHoldings("127.0.0.2:4567", held);
  auto back = decodeHoldings(text);
  REQUIRE(back.isOk());
  CHECK(back->first == "127.0.0.2:4567");
  CHECK(back->second == held);
  auto empty = decodeHoldings(encodeHoldings("h:1", {}));
  REQUIRE(empty.isOk());
  CHECK(empty->second.empty());
  CHECK_FALSE(decodeHoldings("").isOk());
  CHECK_FALSE(decodeHoldings("h:1\nsnapshot.pt\t1\t2\n").isOk());
  CHECK_FALSE(decodeHoldings("h:1\nsnapshot.pt\t1\tx\t3\n").isOk());
  CHECK_FALSE(decodeHoldings("h:1\n../escape\t1\t2\t3\n").isOk());
  CHECK_FALSE(decodeHoldings("h:1\n.ddprun-versions\t1\t2\t3\n").isOk());
  auto nested = decodeHoldings("h:1\nckpt-5/.metadata\t1\t2\t3\n");
  REQUIRE(nested.isOk());
  CHECK(nested->second.at(0).name == "ckpt-5/.metadata");
  CHECK_FALSE(decodeHoldings("h:1\nsnapshot.pt\t1\t2\t4294967296\n").isOk());
}

TEST_CASE("large holdings are published deflated, and a deflated value that lies is refused",
          "[snapshot]") {
  // A sharded checkpoint's names: 2000 files.
  std::vector<SnapshotVersion> held;
  for (int i = 0; i < 2000; ++i) {
    held.push_back(file(makeSnapshotVersion(3, static_cast<uint32_t>(i + 1)), 4096,
                        "ckpt-300/__" + std::to_string(i) + "_0.distcp"));
  }
  const auto text = encodeHoldings("127.0.0.2:4567", held);
  REQUIRE(text.rfind("ddprun-holdings-z1 ", 0) == 0);
  auto back = decodeHoldings(text);
  REQUIRE(back.isOk());
  CHECK(back->first == "127.0.0.2:4567");
  CHECK(back->second == held);
  const size_t inflated = std::stoul(text.substr(19, text.find('\n') - 19));
  INFO(text.size() << " bytes for " << inflated);
  CHECK(text.size() * 4 < inflated);
  // Small holdings stay plain text (what an agent of the release before reads).
  CHECK(encodeHoldings("h:1", {file(1)}).rfind("h:1\n", 0) == 0);
  const std::string body = text.substr(text.find('\n') + 1);
  const auto claims = [&](const std::string& size) {
    return decodeHoldings("ddprun-holdings-z1 " + size + "\n" + body);
  };
  CHECK_FALSE(claims(std::to_string(inflated + 1)).isOk());  // gives fewer
  CHECK_FALSE(claims(std::to_string(inflated - 1)).isOk());  // gives more
  auto huge = claims("68719476736");
  REQUIRE_FALSE(huge.isOk());
  CHECK(huge.status().message().find("more than the") != std::string::npos);
  CHECK_FALSE(claims("x").isOk());
  CHECK_FALSE(claims("18446744073709551615").isOk());
  // Inflated newlines (cheap to read: no string per line), tabs, and too many lines.
  const auto deflated = [](const std::string& plain) {
    return "ddprun-holdings-z1 " + std::to_string(plain.size()) + "\n" + *deflateFast(plain);
  };
  auto blank = decodeHoldings(deflated("h:1\n" + std::string(8 << 20, '\n')));
  REQUIRE(blank.isOk());
  CHECK(blank->second.empty());
  CHECK_FALSE(decodeHoldings(deflated("h:1\n" + std::string(1 << 20, '\t') + "\n")).isOk());
  std::string many = "h:1\n";
  for (size_t i = 0; i <= kMaxHeldVersions; ++i) many += "a\t1\t1\t1\n";
  auto refused = decodeHoldings(deflated(many));
  REQUIRE_FALSE(refused.isOk());
  CHECK(refused.status().message().find("more than") != std::string::npos);
  CHECK_FALSE(claims("0").isOk());
  CHECK_FALSE(decodeHoldings("ddprun-holdings-z1 12").isOk());  // no line end
  CHECK_FALSE(decodeHoldings("ddprun-holdings-z1 12\nnot deflated").isOk());
  std::string damaged = text;
  damaged[damaged.size() / 2] ^= 0x55;
  CHECK_FALSE(decodeHoldings(damaged).isOk());
}

TEST_CASE("announcements form a chain from the writer: every node is told once, by one node",
          "[snapshot]") {
  CHECK(relayTargets(0, 0, 1).empty());
  CHECK(relayTargets(0, 0, 2) == std::vector<int>{1});
  CHECK(relayTargets(0, 0, 4) == std::vector<int>{1});
  CHECK(relayTargets(0, 1, 4) == std::vector<int>{2});
  CHECK(relayTargets(0, 3, 4).empty());                 // the last one
  CHECK(relayTargets(2, 2, 4) == std::vector<int>{3});  // the writer need not be rank 0
  CHECK(relayTargets(2, 3, 4) == std::vector<int>{0});
  CHECK(relayTargets(2, 1, 4).empty());
  CHECK(relayTargets(0, 5, 4).empty());  // out of range: nobody
  CHECK(relayTargets(-1, 0, 4).empty());
  for (int n = 1; n <= 37; ++n) {
    for (int origin = 0; origin < n; ++origin) {
      std::vector<int> told(n, 0);
      for (int self = 0; self < n; ++self) {
        auto targets = relayTargets(origin, self, n);
        CHECK(targets.size() <= 1);
        for (int t : targets) ++told[t];
      }
      for (int i = 0; i < n; ++i) CHECK(told[i] == (i == origin ? 0 : 1));
    }
  }
}

TEST_CASE("a large file is held and announced before its CRC-32 is known, which follows later",
          "[snapshot]") {
  SnapshotReplica r;
  auto v = r.onLocalWritePending("snapshot.pt", 1 << 30, 2);
  CHECK(v.version == makeSnapshotVersion(2, 1));
  CHECK(v.crc_pending);
  CHECK(r.held("snapshot.pt")->crc_pending);
  // Holdings carry "-" for it, and read back as pending; "-" is the only non-number allowed.
  auto back = decodeHoldings(encodeHoldings("h:1", r.heldList()));
  REQUIRE(back.isOk());
  REQUIRE(back->second.size() == 1);
  CHECK(back->second[0] == v);
  CHECK_FALSE(decodeHoldings("h:1\nsnapshot.pt\t1\t2\t--\n").isOk());
  CHECK_FALSE(decodeHoldings("h:1\nsnapshot.pt\t1\t2\t\n").isOk());
  r.onCrcKnown("snapshot.pt", v.version + 1, 99);  // not the held version: nothing
  CHECK(r.held("snapshot.pt")->crc_pending);
  r.onCrcKnown("snapshot.pt", v.version, 99);
  CHECK_FALSE(r.held("snapshot.pt")->crc_pending);
  CHECK(r.held("snapshot.pt")->crc32 == 99);
  CHECK(encodeHoldings("h:1", r.heldList()).find("\t99\n") != std::string::npos);
}

TEST_CASE("holders that are not nodes of the new round are not asked again", "[snapshot]") {
  SnapshotReplica r;
  r.onHolder(file(5), "gone:1");
  r.onHolder(file(5), "live:2");
  r.onHolder(file(3, 7, "only-gone.bin"), "gone:1");
  auto t = r.takeTransfers();
  REQUIRE(t.size() == 2);
  const SnapshotTransfer from_gone = t[0].file.name == "snapshot.pt" ? t[0] : t[1];
  REQUIRE(from_gone.source == "gone:1");
  const SnapshotTransfer only_gone = t[0].file.name == "snapshot.pt" ? t[1] : t[0];
  // gone:1 stopped answering and the next round is formed without it.
  r.keepSources({"live:2", "me:3"});
  CHECK(r.busy());  // the transfers still run: the shell ends them
  r.onTransferDone(only_gone, TransferOutcome::kFailed);
  CHECK_FALSE(r.wanted("only-gone.bin"));  // no live node holds it: wanted no more
  r.onTransferDone(from_gone, TransferOutcome::kFailed);
  t = r.takeTransfers();
  REQUIRE(t.size() == 1);
  CHECK(t[0].source == "live:2");
  r.onTransferDone(t[0],
                   TransferOutcome::kFailed);  // live:2 failed once: tried again, never gone:1
  for (int i = 0; i < 2; ++i) {
    t = r.takeTransfers();
    REQUIRE(t.size() == 1);
    CHECK(t[0].source == "live:2");
    r.onTransferDone(t[0], TransferOutcome::kFailed);
  }
  CHECK_FALSE(r.busy());  // given up after max_attempts
  // A version wanted only from a gone holder, with no transfer running: dropped at once.
  SnapshotReplica idle;
  idle.onHolder(file(5), "gone:1");
  idle.keepSources({"live:2"});
  CHECK_FALSE(idle.busy());
  CHECK(idle.takeTransfers().empty());
  idle.onHolder(file(5), "live:2");  // a live node that holds it is asked
  REQUIRE(idle.takeTransfers().size() == 1);
}

TEST_CASE("a newer version whose only holder is gone falls back to the newest a live node holds",
          "[snapshot]") {
  // Fetching 4 from the writer when it announces 5; the writer is then lost, and the next round's
  // holdings say that live:2 holds 4 (5 supersedes it, so it is not added as 5's source).
  SnapshotReplica r;
  r.onHolder(file(4), "writer:1");
  auto t4 = r.takeTransfers().at(0);
  r.onHolder(file(5), "writer:1");
  r.onHolder(file(4), "live:2");
  r.onHolder(file(3, 7, "other.bin"), "live:2");
  r.onHolder(file(3, 8, "other.bin"), "writer:1");  // the same number, greater content
  r.keepSources({"live:2", "me:3"});
  CHECK(r.busy());
  REQUIRE(r.wanted("snapshot.pt") == 4u);  // 5 is held by no live node: 4 is wanted from live:2
  REQUIRE(r.wanted("other.bin") == 3u);
  // The fetch from the gone writer ends (the shell ends it): 4 comes from live:2 next.
  r.onTransferDone(t4, TransferOutcome::kFailed);
  auto t = r.takeTransfers();
  REQUIRE(t.size() == 2);
  for (const auto& each : t) {
    INFO(each.file.name);
    CHECK(each.source == "live:2");
    CHECK(each.file.version == (each.file.name == "snapshot.pt" ? 4u : 3u));
    CHECK(each.file.crc32 == 7u);  // what live:2 holds
    r.onTransferDone(each, TransferOutcome::kOk);
  }
  CHECK(r.held("snapshot.pt")->version == 4);
  CHECK_FALSE(r.busy());

  // With no live holder of anything newer, the want ends when its transfer does: the round's
  // sync is not held up by it.
  SnapshotReplica alone;
  alone.onHolder(file(4), "writer:1");
  auto a4 = alone.takeTransfers().at(0);
  alone.onHolder(file(5), "writer:1");
  alone.keepSources({"me:3"});
  CHECK(alone.busy());  // the transfer still runs
  alone.onTransferDone(a4, TransferOutcome::kFailed);
  CHECK_FALSE(alone.busy());
  CHECK_FALSE(alone.wanted("snapshot.pt"));
  CHECK(alone.takeTransfers().empty());
  // A holder heard of before, newer than nothing held, and gone since is no fallback either.
  SnapshotReplica stale;
  stale.onHolder(file(4), "old:4");
  stale.onHolder(file(5), "writer:1");
  stale.keepSources({"me:3"});
  CHECK_FALSE(stale.busy());
  stale.onHolder(file(2), "live:2");  // older: still wanted, from the holder that has it
  REQUIRE(stale.wanted("snapshot.pt") == 2u);
}

TEST_CASE("a peer's version from a round no job reaches is refused, and never wraps numbering",
          "[snapshot]") {
  SnapshotReplica r;
  auto mine = r.onLocalWrite("snapshot.pt", 10, 1, 5);
  for (uint64_t bogus : {UINT64_MAX, makeSnapshotVersion(uint64_t{1} << 31, 0)}) {
    CAPTURE(bogus);
    SnapshotVersion v{"snapshot.pt", bogus, 10, 2};
    r.onHolder(v, "peer:1");
    CHECK_FALSE(r.wanted("snapshot.pt"));
    CHECK(r.maxVersionSeen() == mine.version);
    auto holdings = decodeHoldings(encodeHoldings("peer:1", {v}));
    REQUIRE_FALSE(holdings.isOk());
    CHECK(holdings.status().message().find("which no job reaches") != std::string::npos);
  }
  // The last possible round is still a version.
  r.onHolder(SnapshotVersion{"snapshot.pt", makeSnapshotVersion((uint64_t{1} << 31) - 1, 1), 10, 2},
             "peer:1");
  CHECK(r.wanted("snapshot.pt"));
  // What this node writes next numbers above what it holds.
  auto next = r.onLocalWrite("snapshot.pt", 10, 3, 5);
  CHECK(next.version > mine.version);
}

TEST_CASE("a holder still hashing and one that knows the CRC-32 serve the same version",
          "[snapshot]") {
  SnapshotReplica r;
  SnapshotVersion pending = file(makeSnapshotVersion(1, 4), 0);
  pending.crc_pending = true;
  r.onHolder(pending, "writer:1");
  r.onHolder(file(makeSnapshotVersion(1, 4), 1234), "relay:2");  // same version, CRC known
  r.onHolder(file(makeSnapshotVersion(1, 4), 555), "odd:3");     // known, but another CRC...
  auto t = r.takeTransfers();
  REQUIRE(t.size() == 1);
  CHECK(t[0].file == pending);
  // ...is still the same content as far as a pending target can tell; the fetch checks it.
  r.onTransferDone(t[0], TransferOutcome::kCorrupt);
  t = r.takeTransfers();
  REQUIRE(t.size() == 1);
  CHECK(t[0].source != "writer:1");
  // The fetch learned the CRC-32: the held version has it, and nothing more is wanted.
  SnapshotTransfer done = t[0];
  done.file.crc32 = 1234;
  done.file.crc_pending = false;
  r.onTransferDone(done, TransferOutcome::kOk);
  CHECK_FALSE(r.busy());
  CHECK(r.held("snapshot.pt") == file(makeSnapshotVersion(1, 4), 1234));
}

TEST_CASE("the version table keeps what a node held, and is refused when it is not one",
          "[snapshot]") {
  SnapshotReplica r;
  r.onLocalWrite("snapshot.pt", 10, 5, 3);
  r.onLocalWritePending("big.bin", 1 << 30, 3);  // no CRC-32 yet: not recorded
  r.adoptExisting("old.bin", 4, 6);              // version 0: nothing to record
  const std::string text = encodeVersionTable(r.heldList());
  auto table = decodeVersionTable(text);
  REQUIRE(table.isOk());
  REQUIRE(table->size() == 1);
  CHECK(table->at("snapshot.pt") == *r.held("snapshot.pt"));
  // Only the very content recorded keeps its version.
  const uint64_t v = r.held("snapshot.pt")->version;
  CHECK(recordedVersion(*table, "snapshot.pt", 10, 5) == v);
  CHECK(recordedVersion(*table, "snapshot.pt", 10, 6) == 0);  // changed in place
  CHECK(recordedVersion(*table, "snapshot.pt", 11, 5) == 0);
  CHECK(recordedVersion(*table, "other.pt", 10, 5) == 0);
  CHECK(decodeVersionTable(encodeVersionTable({}))->empty());
  // Not a table: named, with the line.
  auto bad = [](const std::string& t) {
    auto d = decodeVersionTable(t);
    return d.isOk() ? std::string() : d.status().message();
  };
  CHECK(bad("").find("not a version table") != std::string::npos);
  CHECK(bad("snapshot.pt\t1\t2\t3\n").find("not a version table") != std::string::npos);
  const std::string head = "ddprun snapshot versions 1\n";
  CHECK(bad(head + "snapshot.pt\t1\t2\n").find("line 2") != std::string::npos);
  CHECK(bad(head + "a\t1\t2\t3\n\nb\t1\tx\t3\n").find("line 4 ('b") != std::string::npos);
  CHECK(bad(head + "snapshot.pt\t1\t2\t-\n").find("is not NAME") != std::string::npos);
  CHECK(bad(head + "../etc/passwd\t1\t2\t3\n").find("is not NAME") != std::string::npos);
  CHECK(bad(head + "snapshot.pt\t18446744073709551616\t2\t3\n") != "");  // past 64 bits
  CHECK(bad(head + "snapshot.pt\t18446744073709551615\t2\t3\n").find("no job reaches") !=
        std::string::npos);
  CHECK(bad(head + "a\t1\t2\t3\na\t2\t2\t3\n").find("a second time") != std::string::npos);
  CHECK(bad(head + "x\t1\t2\t3\n" + std::string(100000, 'y')).size() < 500);  // quoted in part
  CHECK(bad(head + "a\t" + std::to_string(makeSnapshotVersion((1u << 31) - 1, 7)) + "\t2\t3\n")
            .empty());
}

TEST_CASE("a version kept from before the agent started is held, and what is written numbers above",
          "[snapshot]") {
  SnapshotReplica r;
  const uint64_t kept = makeSnapshotVersion(12, 4);
  r.adoptExisting("snapshot.pt", 100, 7, kept);
  CHECK(r.held("snapshot.pt")->version == kept);
  CHECK(r.maxVersionSeen() == kept);
  // A restarted job's rounds start again at 1: what is written there still counts as newer.
  CHECK(r.onLocalWrite("snapshot.pt", 100, 8, 1).version == kept + 1);
  // Another node's kept version wins over a version 0 and loses to a newer one.
  SnapshotReplica other;
  other.adoptExisting("snapshot.pt", 100, 9);
  other.onHolder(file(kept), "a:1");
  CHECK(other.wanted("snapshot.pt") == kept);
  SnapshotReplica newer;
  newer.adoptExisting("snapshot.pt", 100, 9, kept + 5);
  newer.onHolder(file(kept), "a:1");
  CHECK_FALSE(newer.wanted("snapshot.pt"));
}

TEST_CASE("a deletion is a version: older copies are deleted, not fetched back", "[snapshot]") {
  SnapshotReplica writer;
  CHECK_FALSE(writer.onLocalDelete("snapshot.pt", 1));  // nothing held: nothing to tell
  const SnapshotVersion written = writer.onLocalWrite("snapshot.pt", 10, 5, 1);
  auto gone = writer.onLocalDelete("snapshot.pt", 1);
  REQUIRE(gone);
  CHECK(gone->deleted);
  CHECK(gone->version > written.version);
  CHECK(gone->size == 0);
  CHECK(writer.held("snapshot.pt")->deleted);
  CHECK_FALSE(writer.onLocalDelete("snapshot.pt", 1));  // deleted already
  // A node holding the written version is told: one "transfer" of the deletion, no fetch.
  SnapshotReplica other;
  other.onHolder(written, "w:1");
  other.onTransferDone(other.takeTransfers().at(0), TransferOutcome::kOk);
  other.onHolder(*gone, "w:1");
  auto ts = other.takeTransfers();
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].file.deleted);
  other.onTransferDone(ts[0], TransferOutcome::kOk);
  CHECK(other.held("snapshot.pt")->deleted);
  CHECK_FALSE(other.busy());
  // The older version, held elsewhere, is not fetched back; a later write is.
  other.onHolder(written, "x:1");
  CHECK(other.takeTransfers().empty());
  const SnapshotVersion again = writer.onLocalWrite("snapshot.pt", 12, 6, 2);
  CHECK(again.version > gone->version);
  other.onHolder(again, "w:1");
  CHECK(other.takeTransfers().size() == 1);
  // The same number deleted on one node and written on another is not the same version.
  SnapshotVersion as_file = *gone;
  as_file.deleted = false;
  CHECK_FALSE(as_file.sameContent(*gone));
}

TEST_CASE("a rename is a new version of the new name that names the old one as a hint",
          "[snapshot]") {
  SnapshotReplica writer;
  const SnapshotVersion old = writer.onLocalWrite("ckpt.new", 10, 5, 1);
  auto renamed = writer.onLocalRename("ckpt.pt", "ckpt.new", old.version, 1);
  REQUIRE(renamed);
  CHECK(renamed->version > old.version);
  CHECK(renamed->size == 10);
  CHECK(renamed->crc32 == 5);
  CHECK(renamed->moved_from == "ckpt.new");
  CHECK(renamed->moved_from_version == old.version);
  // Held without the hint (it is not recorded), and the old name's deletion follows as usual.
  CHECK(writer.held("ckpt.pt")->moved_from.empty());
  CHECK(*writer.held("ckpt.pt") == SnapshotVersion{"ckpt.pt", renamed->version, 10, 5});
  auto gone = writer.onLocalDelete("ckpt.new", 1);
  REQUIRE(gone);
  CHECK(gone->version > renamed->version);
  // Nothing to copy from: not held, deleted, never recorded (version 0), still hashed, itself.
  CHECK_FALSE(writer.onLocalRename("b", "ckpt.new", gone->version, 1));
  CHECK_FALSE(writer.onLocalRename("b", "nothing", 0, 1));
  writer.adoptExisting("before.pt", 3, 3);
  CHECK_FALSE(writer.onLocalRename("b", "before.pt", 0, 1));
  auto big = writer.onLocalWritePending("big.bin", 1 << 30, 1);
  CHECK_FALSE(writer.onLocalRename("b", "big.bin", big.version, 1));
  CHECK_FALSE(writer.onLocalRename("ckpt.pt", "ckpt.pt", renamed->version, 1));
  // The file renamed was the old name's version the shell matched; a newer copy of the old name
  // installed since is other bytes: no rename, the file is hashed.
  const SnapshotVersion a1 = writer.onLocalWrite("a.pt", 10, 1, 1);
  const SnapshotVersion a2{"a.pt", makeSnapshotVersion(2, 1), 12, 9};
  writer.onHolder(a2, "p:1");
  writer.onTransferDone(writer.takeTransfers().at(0), TransferOutcome::kOk);
  CHECK_FALSE(writer.onLocalRename("c.pt", "a.pt", a1.version, 2));
  auto c = writer.onLocalRename("c.pt", "a.pt", a2.version, 2);
  REQUIRE(c);
  CHECK(c->size == 12);
  CHECK(c->crc32 == 9);

  // A receiver keeps the hint with what it wants, also when the holdings told it first.
  SnapshotReplica other;
  other.onHolder(old, "w:1");
  other.onTransferDone(other.takeTransfers().at(0), TransferOutcome::kOk);
  SnapshotVersion plain = *renamed;
  plain.moved_from.clear();
  plain.moved_from_version = 0;
  other.onHolder(plain, "x:1");  // the round's holdings: no hint
  other.onHolder(*renamed, "w:1");
  auto ts = other.takeTransfers();
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].file == *renamed);
  CHECK(ts[0].file.moved_from == "ckpt.new");
  CHECK(ts[0].file.moved_from_version == old.version);
  other.onTransferDone(ts[0], TransferOutcome::kOk);
  CHECK(other.held("ckpt.pt")->moved_from.empty());
  CHECK_FALSE(other.busy());
}

TEST_CASE("deletions travel in the holdings and the version table", "[snapshot]") {
  SnapshotReplica r;
  r.onLocalWrite("a.bin", 10, 5, 1);
  r.onLocalWrite("b.bin", 3, 4, 1);
  r.onLocalDelete("a.bin", 1);
  auto back = decodeHoldings(encodeHoldings("h:1", r.heldList()));
  REQUIRE(back.isOk());
  CHECK(back->second == r.heldList());
  auto table = decodeVersionTable(encodeVersionTable(r.heldList()));
  REQUIRE(table.isOk());
  CHECK(table->at("a.bin") == *r.held("a.bin"));
  CHECK(table->at("a.bin").deleted);
  // A deletion recorded is no version of a file that is there again (even an empty one, whose
  // size and CRC-32 are 0 too).
  CHECK(recordedVersion(*table, "a.bin", 0, 0) == 0);
  CHECK(recordedVersion(*table, "b.bin", 3, 4) == r.held("b.bin")->version);
  // Kept across a restart: an older copy elsewhere is not fetched back.
  SnapshotReplica restarted;
  restarted.adoptDeleted("a.bin", table->at("a.bin").version);
  CHECK(restarted.maxVersionSeen() == table->at("a.bin").version);
  restarted.onHolder(SnapshotVersion{"a.bin", makeSnapshotVersion(1, 1), 10, 5}, "x:1");
  CHECK(restarted.takeTransfers().empty());
  // A deletion line carries no size or CRC-32.
  CHECK_FALSE(decodeHoldings("h:1\na.bin\t5\t7\tdeleted\n").isOk());
  CHECK(decodeHoldings("h:1\na.bin\t5\t0\tdeleted\n")->second.at(0).deleted);
  CHECK_FALSE(decodeHoldings("h:1\na.bin\t5\t0\tDeleted\n").isOk());
}

TEST_CASE("only the newest deletions are kept, and a forgotten one is not learned back",
          "[snapshot]") {
  SnapshotReplicaOptions o;
  o.max_tombstones = 3;
  SnapshotReplica r(o);
  std::vector<SnapshotVersion> gone;
  // A job that writes a new name every epoch and deletes the one before.
  for (int epoch = 0; epoch < 6; ++epoch) {
    r.onLocalWrite("ckpt" + std::to_string(epoch) + ".pt", 10, 5, 1);
    if (epoch > 0) gone.push_back(*r.onLocalDelete("ckpt" + std::to_string(epoch - 1) + ".pt", 1));
  }
  int deletions = 0;
  for (const auto& v : r.heldList()) deletions += v.deleted ? 1 : 0;
  CHECK(deletions == 3);
  CHECK(r.heldList().size() == 4);  // ckpt5.pt and the deletions of ckpt2..4
  CHECK_FALSE(r.held("ckpt0.pt"));
  CHECK_FALSE(r.held("ckpt1.pt"));
  CHECK(r.held("ckpt2.pt")->deleted);
  CHECK(r.forgottenDeletions() == gone[1].version);
  auto table = decodeVersionTable(encodeVersionTable(r.heldList()));
  REQUIRE(table.isOk());
  CHECK(table->size() == 4);
  // A peer that still announces a forgotten deletion: nothing to do here...
  r.onHolder(gone[0], "p:1");
  CHECK(r.takeTransfers().empty());
  CHECK_FALSE(r.held("ckpt0.pt"));
  // ...but a node that still holds a copy the forgotten deletion removes deletes it, and keeps
  // no more than the newest deletions after.
  SnapshotReplica away(o);
  away.onHolder(SnapshotVersion{"ckpt0.pt", makeSnapshotVersion(1, 1), 10, 5}, "w:1");
  away.onTransferDone(away.takeTransfers().at(0), TransferOutcome::kOk);
  for (int i = 1; i < 5; ++i) away.onHolder(gone[i], "w:1");
  for (auto& t : away.takeTransfers()) away.onTransferDone(t, TransferOutcome::kOk);
  REQUIRE(away.forgottenDeletions() == gone[1].version);  // above ckpt0.pt's deletion
  away.onHolder(gone[0], "w:1");
  auto ts = away.takeTransfers();
  REQUIRE(ts.size() == 1);
  CHECK(ts[0].file.deleted);
  away.onTransferDone(ts[0], TransferOutcome::kOk);
  CHECK_FALSE(away.held("ckpt0.pt"));  // deleted, and the oldest deletion: forgotten at once
  CHECK(away.forgottenDeletions() == gone[1].version);
  CHECK_FALSE(away.busy());
}

TEST_CASE("announcements are passed on by content, each along the chain it came by", "[snapshot]") {
  SnapshotRelays relays;
  const auto a = file(5, 1), b = file(5, 2);  // one number, other bytes: written on two nodes
  relays.told(a, "node-a");
  relays.told(b, "node-b");
  CHECK(relays.origin(a) == "node-a");
  CHECK(relays.origin(b) == "node-b");  // not the chain of the first one told
  // Passed on once each: as it arrives, then no more when its copy completes.
  CHECK(relays.pass(b, /*early=*/true) == "node-b");
  CHECK(relays.passedEarly(b));
  CHECK_FALSE(relays.pass(b, /*early=*/true));
  CHECK_FALSE(relays.pass(b, /*early=*/false));
  CHECK(relays.origin(b) == "node-b");  // a retry of its fetch serves it on again
  CHECK_FALSE(relays.passedEarly(a));
  CHECK(relays.pass(a, /*early=*/false) == "node-a");
  CHECK_FALSE(relays.origin(a));
  // Told again after it was passed on as it arrived: to be passed on again, by its first chain.
  relays.told(b, "node-c");
  CHECK_FALSE(relays.passedEarly(b));
  CHECK(relays.pass(b, /*early=*/false) == "node-b");
  // The same content while its CRC-32 is pending, then known, is one announcement.
  auto pending = file(6, 0);
  pending.crc_pending = true;
  relays.told(pending, "node-a");
  CHECK(relays.origin(file(6, 9)) == "node-a");
  CHECK(relays.pass(file(6, 9), /*early=*/false) == "node-a");
  CHECK_FALSE(relays.origin(pending));
  // A newer number forgets the older ones; an older one told later is ignored.
  relays.told(file(7, 1), "node-a");
  relays.told(file(8, 1), "node-b");
  CHECK_FALSE(relays.origin(file(7, 1)));
  relays.told(file(7, 1), "node-a");
  CHECK_FALSE(relays.origin(file(7, 1)));
  CHECK(relays.origin(file(8, 1)) == "node-b");
  CHECK_FALSE(relays.origin(file(8, 1, "other.pt")));  // names are apart
}

TEST_CASE("nodes that wrote one name under one number all end with the greatest content",
          "[snapshot]") {
  // A model of the agents' replication with the pure pieces: each node a SnapshotReplica and a
  // SnapshotRelays; an announcement passed on to the next node of its chain when the fetch of it
  // starts (the pipelined relay), fetches that take a while and succeed. Messages and fetches
  // complete in a random order. Every node must end with the greatest content, in any order.
  constexpr int kNodes = 5;
  struct Event {
    int node;
    SnapshotVersion v;
    int source;  // announce: who holds it; -1: `v`'s fetch at `node` completes
    int origin;
  };
  for (unsigned seed = 0; seed < 300; ++seed) {
    std::mt19937 rng(seed);
    std::vector<SnapshotReplica> replicas;
    std::vector<SnapshotRelays> relays(kNodes);
    for (int i = 0; i < kNodes; ++i) replicas.emplace_back(SnapshotReplicaOptions{4, i});
    std::vector<Event> queue;
    auto tell = [&](const SnapshotVersion& v, int from, int origin) {
      for (int next : relayTargets(origin, from, kNodes)) queue.push_back({next, v, from, origin});
    };
    // Some nodes write the name in round 3, none having heard of another's write: one number.
    std::vector<int> writers;
    for (int i = 0; i < kNodes; ++i) {
      if (writers.empty() || rng() % 2 == 0) writers.push_back(i);
    }
    uint32_t greatest = 0;
    for (int w : writers) {
      const uint32_t crc = 1000 + static_cast<uint32_t>(rng() % 1000);
      greatest = std::max(greatest, crc);
      auto v = replicas[w].onLocalWrite("snapshot.pt", 64, crc, 3);
      REQUIRE(v.version == makeSnapshotVersion(3, 1));
      tell(v, w, w);
    }
    while (!queue.empty()) {
      const size_t pick = rng() % queue.size();
      Event e = queue[pick];
      queue.erase(queue.begin() + static_cast<std::ptrdiff_t>(pick));
      auto& replica = replicas[e.node];
      if (e.source < 0) {
        replica.onTransferDone(SnapshotTransfer{e.v, "holder"}, TransferOutcome::kOk);
        if (auto origin = relays[e.node].pass(e.v, false)) tell(e.v, e.node, std::stoi(*origin));
      } else {
        relays[e.node].told(e.v, std::to_string(e.origin));
        replica.onHolder(e.v, std::to_string(e.source));
      }
      for (const auto& t : replica.takeTransfers()) {
        if (auto origin = relays[e.node].pass(t.file, true))
          tell(t.file, e.node, std::stoi(*origin));
        queue.push_back({e.node, t.file, -1, -1});
      }
    }
    for (int i = 0; i < kNodes; ++i) {
      INFO("seed " << seed << ", node " << i << " of " << writers.size() << " writer(s)");
      REQUIRE(replicas[i].held("snapshot.pt"));
      CHECK(replicas[i].held("snapshot.pt")->crc32 == greatest);
    }
  }
}

TEST_CASE("the names a holder may keep waiting here are bounded, per holder and in all",
          "[snapshot]") {
  SnapshotReplicaOptions o;
  o.max_names_per_holder = 3;
  o.max_pending_names = 5;
  SnapshotReplica r(o);
  for (int i = 0; i < 3; ++i) {
    CHECK(r.onHolder(file(5, 7, "a" + std::to_string(i)), "hostile:1") == HolderNews::kTaken);
  }
  // A fourth new name from that holder is refused; what it announced before still counts.
  CHECK(r.onHolder(file(5, 7, "a3"), "hostile:1") == HolderNews::kTooManyFromHolder);
  CHECK_FALSE(r.wanted("a3"));
  CHECK(r.onHolder(file(6, 7, "a0"), "hostile:1") == HolderNews::kTaken);  // a newer version
  CHECK(r.namesFrom("hostile:1") == 3);
  // Other holders have their own bound, and all share the total.
  CHECK(r.onHolder(file(5, 7, "b0"), "other:2") == HolderNews::kTaken);
  CHECK(r.onHolder(file(5, 7, "b1"), "other:2") == HolderNews::kTaken);
  CHECK(r.onHolder(file(5, 7, "b2"), "third:3") == HolderNews::kTooManyNames);
  CHECK(r.onHolder(file(5, 7, "a1"), "third:3") == HolderNews::kTaken);  // a name already here
  CHECK(r.pendingNames() == 5);
  // A version not newer than held is ignored, whatever the bounds.
  r.adoptExisting("held", 1, 1, makeSnapshotVersion(9, 1));
  CHECK(r.onHolder(file(5, 7, "held"), "third:3") == HolderNews::kIgnored);

  // A name fetched no longer waits: room for another.
  auto t = r.takeTransfers();
  const auto b0 =
      std::find_if(t.begin(), t.end(), [](const auto& x) { return x.file.name == "b0"; });
  REQUIRE(b0 != t.end());
  r.onTransferDone(*b0, TransferOutcome::kOk);
  CHECK(r.pendingNames() == 4);
  CHECK(r.onHolder(file(5, 7, "b2"), "third:3") == HolderNews::kTaken);
  for (const auto& x : t) {
    if (x.file.name != "b0") r.onTransferDone(x, TransferOutcome::kFailed);
  }
}

TEST_CASE("the names only a holder that left held are forgotten", "[snapshot]") {
  SnapshotReplica r;
  for (int i = 0; i < 100; ++i) r.onHolder(file(5, 7, "n" + std::to_string(i)), "hostile:1");
  r.onHolder(file(5, 7, "n0"), "live:2");
  CHECK(r.pendingNames() == 100);
  CHECK(r.namesFrom("hostile:1") == 100);
  r.keepSources({"live:2"});  // the next round has no hostile:1
  CHECK(r.pendingNames() == 1);
  CHECK(r.namesFrom("hostile:1") == 0);
  CHECK(r.wanted("n0"));
  CHECK_FALSE(r.wanted("n1"));

  SnapshotRelays relays;
  relays.told(file(5, 7, "n0"), "live:2");
  relays.told(file(5, 7, "n1"), "hostile:1");
  relays.forgetUnless([&](const std::string& name) { return r.wanted(name).has_value(); });
  CHECK(relays.size() == 1);
  CHECK(relays.origin(file(5, 7, "n0")) == std::optional<std::string>("live:2"));
}
