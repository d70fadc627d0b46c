// Two jobs that share one --rdzv-id: the check that names the other job (agent/src/job_identity.h).
#include "job_identity.h"

#include <boost/asio/io_context.hpp>
#include <catch2/catch.hpp>
#include <optional>

#include "fake_rendezvous.h"
#include "fake_rendezvous_service.h"
#include "log_capture.h"

using namespace ddprun;
using namespace ddprun::agent;

TEST_CASE("nodes that run one program are one job, wherever they keep it", "[agent]") {
  CHECK(checkSameJob({encodeJobIdentity("10.0.0.1", "/home/a/train.py", InPlaceVote::kInPlace),
                      encodeJobIdentity("10.0.0.2", "/scratch/b/train.py", InPlaceVote::kProcess)},
                     1, "job")
            .isOk());
  CHECK(checkSameJob({encodeJobIdentity("10.0.0.1", "train.py", InPlaceVote::kInPlace)}, 0, "job")
            .isOk());
}

TEST_CASE("a node of the round that runs another program is named, with the job id", "[agent]") {
  const Status st =
      checkSameJob({encodeJobIdentity("10.0.0.1", "/srv/train.py", InPlaceVote::kInPlace),
                    encodeJobIdentity("10.0.0.2", "/srv/eval.py", InPlaceVote::kInPlace)},
                   0, "nightly");
  REQUIRE(st.code() == StatusCode::kFailedPrecondition);
  CHECK(st.message() ==
        "another job uses --rdzv-id 'nightly': node 1 of this round (10.0.0.2) runs "
        "'/srv/eval.py', this node runs '/srv/train.py'; give each job an id of its own");
  // What a node published is escaped in the message.
  const Status odd = checkSameJob({encodeJobIdentity("h", "a", InPlaceVote::kInPlace),
                                   encodeJobIdentity("h\x1b", "b\x1b[2J", InPlaceVote::kInPlace)},
                                  0, "j");
  CHECK(odd.message().find("\\x1b[2J") != std::string::npos);
  CHECK(odd.message().find('\x1b') == std::string::npos);
}

TEST_CASE("each node votes for in-place recovery, and the first other node against it is named",
          "[agent][inplace]") {
  const std::string a = encodeJobIdentity("10.0.0.1", "/srv/train", InPlaceVote::kInPlace);
  const std::string b = encodeJobIdentity("10.0.0.2", "/srv/train", InPlaceVote::kInPlace);
  const std::string c = encodeJobIdentity("10.0.0.3", "/srv/train", InPlaceVote::kProcess);
  CHECK(inPlaceVeto({a, b}, 0, 4).empty());
  CHECK(inPlaceVeto({a, b, c}, 0, 4) ==
        "node 2 of round 4 (10.0.0.3) restarts its workers as processes (its agent runs "
        "--restart-mode=process or a ddprun without in-place recovery)");
  CHECK(inPlaceVeto({a, b, c}, 1, 4).find("node 2 of round 4") == 0);
  // A node's own vote against holds it too (its workers then get no control channel, as the
  // others' do not): named after any other node against.
  CHECK(inPlaceVeto({a, b, c}, 2, 4) ==
        "this node (node 2 of round 4) restarts its workers as processes (its agent runs "
        "--restart-mode=process)");
  CHECK(inPlaceVeto({c, b, c}, 2, 4).find("node 0 of round 4 (10.0.0.3)") == 0);
  CHECK(inPlaceVeto({c}, 5, 4).find("node 0 of round 4") == 0);
  CHECK(inPlaceVeto({a}, -1, 4).empty());
  CHECK(othersVoteInPlace({a, b, c}, 2));
  CHECK_FALSE(othersVoteInPlace({a, c, c}, 2));
  CHECK_FALSE(othersVoteInPlace({a, b, c}, 0));
  CHECK(othersVoteInPlace({c}, 0));
  // Different votes do not make different jobs.
  CHECK(checkSameJob({a, c}, 0, "job").isOk());
}

TEST_CASE(
    "a node that listens on its channel but whose workers did not announce support votes "
    "against, and the veto is soft only while every node listens",
    "[agent][inplace]") {
  const std::string a = encodeJobIdentity("10.0.0.1", "/srv/train", InPlaceVote::kInPlace);
  const std::string l = encodeJobIdentity("10.0.0.2", "/srv/train", InPlaceVote::kListen);
  const std::string p = encodeJobIdentity("10.0.0.3", "/srv/train", InPlaceVote::kProcess);
  CHECK(a == "10.0.0.1 listens inplace=1\n/srv/train");
  CHECK(l == "10.0.0.2 listens inplace=0\n/srv/train");
  CHECK(p == "10.0.0.3 inplace=0\n/srv/train");
  CHECK(inPlaceVeto({a, l}, 0, 7) ==
        "node 1 of round 7 (10.0.0.2) restarts its workers as processes (one of its workers failed "
        "without having announced in-place support, and none announced it since)");
  CHECK(inPlaceVeto({a, l}, 1, 7) ==
        "this node (node 1 of round 7) restarts its workers as processes (a worker failed without "
        "having announced in-place support, and none of its workers announced it since)");
  CHECK(everyNodeListens({a, l}));
  CHECK(everyNodeListens({a, a}));
  CHECK(everyNodeListens({l, l}));
  CHECK_FALSE(everyNodeListens({a, l, p}));
  CHECK_FALSE(everyNodeListens({a, "10.0.0.4\n/srv/train"}));  // an agent from before the vote
  CHECK_FALSE(everyNodeListens({a, "10.0.0.4 listens inplace=2\n/srv/train"}));
  CHECK_FALSE(everyNodeListens({a, "10.0.0.4 listens\n/srv/train"}));
  // An agent of the release before kListen votes "<address> inplace=1|0": its 1 is still a vote
  // for in-place recovery, but not one that listens, so beside a kListen node the veto is hard
  // (no node offers the channel; that agent, reading "inplace=0", offers none either).
  const std::string before = "10.0.0.4 inplace=1\n/srv/train";
  CHECK(inPlaceVeto({a, before}, 0, 7).empty());
  CHECK_FALSE(everyNodeListens({a, l, before}));
  CHECK(inPlaceVeto({before, l}, 0, 7).find("node 1 of round 7 (10.0.0.2)") == 0);
  CHECK_FALSE(othersVoteInPlace({a, l}, 0));
  CHECK(othersVoteInPlace({a, l}, 1));
  // A node under process mode is named before one that listens (it makes the veto hard).
  CHECK(inPlaceVeto({a, l, p}, 0, 7).find("node 2 of round 7") == 0);
  CHECK(inPlaceVeto({a, l, p}, 2, 7).find("node 1 of round 7") == 0);
  CHECK(olderAgent({a, l, p}, 0).empty());  // each knows the vote
  CHECK(checkSameJob({a, l, p}, 1, "job").isOk());
}

TEST_CASE("a vote that is missing or malformed is a vote against", "[agent][inplace]") {
  const std::string yes = encodeJobIdentity("10.0.0.1", "/srv/train", InPlaceVote::kInPlace);
  // An agent that predates the vote publishes "<address>\n<program>".
  CHECK(inPlaceVeto({yes, "10.0.0.2\n/srv/train"}, 0, 1).find("node 1 of round 1 (10.0.0.2)") == 0);
  for (const std::string odd : {"10.0.0.2 inplace=yes\n/srv/train", "10.0.0.2 inplace=\n/srv/train",
                                "10.0.0.2 inplace=listen\n/srv/train",
                                "10.0.0.2 inplace=11\n/srv/train", "10.0.0.2\n/srv/train inplace=1",
                                "", "\n\n\n", "inplace=1", " inplace=1", "10.0.0.2 inplace=1"}) {
    INFO(odd);
    CHECK_FALSE(inPlaceVeto({yes, odd}, 0, 1).empty());
  }
  // A program or an address that looks like a vote changes nothing.
  const std::string tricky =
      encodeJobIdentity("h inplace=1", "train inplace=1\nx", InPlaceVote::kProcess);
  CHECK(inPlaceVeto({yes, tricky}, 0, 1).find("(h inplace=1)") != std::string::npos);
  CHECK(checkSameJob(
            {encodeJobIdentity("10.0.0.1", "train inplace=1\nx", InPlaceVote::kInPlace), tricky}, 0,
            "job")
            .isOk());
  // What a node published is escaped in the line.
  const std::string veto =
      inPlaceVeto({yes, encodeJobIdentity("h\x1b[2J", "/srv/train", InPlaceVote::kProcess)}, 0, 1);
  CHECK(veto.find("\\x1b[2J") != std::string::npos);
  CHECK(veto.find('\x1b') == std::string::npos);
}

TEST_CASE("a node whose agent predates the vote is named, with what to do", "[agent][inplace]") {
  const std::string a = encodeJobIdentity("10.0.0.1", "/srv/train", InPlaceVote::kInPlace);
  const std::string b = encodeJobIdentity("10.0.0.2", "/srv/train", InPlaceVote::kProcess);
  CHECK(olderAgent({a, b}, 0).empty());                       // a vote against is no older agent
  CHECK(olderAgent({a, "10.0.0.3\n/srv/train"}, 1).empty());  // its own identity is not read
  const std::string older = olderAgent({a, b, "10.0.0.3\n/srv/train"}, 0);
  CHECK(older.find("node 2 (10.0.0.3) runs a ddprun from before the in-place vote") == 0);
  CHECK(older.find("run one ddprun release on every node of a job") != std::string::npos);
  // A malformed vote reads as no vote: that node is named too (escaped).
  CHECK(olderAgent({a, "h\x1b inplace=2\n/srv/train"}, 0).find("(h\\x1b inplace=2)") !=
        std::string::npos);
}

TEST_CASE("an agent that predates the vote still reads a new identity as the same job",
          "[agent][inplace]") {
  // Its decoding: the first line is the address, the rest the program.
  const std::string mine = encodeJobIdentity("10.0.0.1", "train.py", InPlaceVote::kInPlace);
  const auto nl = mine.find('\n');
  REQUIRE(nl != std::string::npos);
  CHECK(mine.substr(nl + 1) == "train.py");
  CHECK(checkSameJob({mine, "10.0.0.2\ntrain.py"}, 1, "job").isOk());
}

TEST_CASE("an agent without --snapshot-dir says so in its identity, readable by older agents",
          "[agent][identity]") {
  const std::string with = encodeJobIdentity("10.0.0.1", "/srv/train", InPlaceVote::kInPlace);
  const std::string without =
      encodeJobIdentity("10.0.0.2", "/srv/train", InPlaceVote::kListen, /*snapshot_dir=*/false);
  const std::string without_process =
      encodeJobIdentity("10.0.0.3", "/srv/train", InPlaceVote::kProcess, /*snapshot_dir=*/false);
  CHECK(without == "10.0.0.2 nosnapdir listens inplace=0\n/srv/train");
  // The marker changes neither the program nor the vote.
  CHECK(checkSameJob({with, without, without_process}, 0, "job").isOk());
  CHECK(everyNodeListens({with, without}));
  CHECK_THAT(inPlaceVeto({with, without_process}, 0, 4), Catch::Contains("(10.0.0.3)"));
  const auto missing = nodesWithoutSnapshotDir({with, without, without_process});
  CHECK(missing == std::map<int, std::string>{{1, "10.0.0.2"}, {2, "10.0.0.3"}});
  // An agent that predates the marker says nothing: it is waited for, as before.
  CHECK(
      nodesWithoutSnapshotDir({"10.0.0.4 inplace=0\n/srv/train", "10.0.0.5\n/srv/train"}).empty());
  // Said once by each side, naming the first node that differs.
  CHECK_THAT(snapshotDirMismatch({with, without, without_process}, 0),
             Catch::Contains("node 1 (10.0.0.2) runs without --snapshot-dir"));
  CHECK_THAT(snapshotDirMismatch({with, without, without_process}, 2),
             Catch::Contains("node 0 (10.0.0.1) runs with --snapshot-dir and this node without"));
  CHECK(snapshotDirMismatch({without, without_process}, 0).empty());
  CHECK(snapshotDirMismatch({with, with}, 1).empty());
  CHECK(snapshotDirMismatch({with}, 3).empty());
  // A hostile address is quoted, not echoed raw.
  const std::string odd = encodeJobIdentity("h\x1b[2J", "/srv/train", InPlaceVote::kProcess, false);
  CHECK(snapshotDirMismatch({with, odd}, 0).find('\x1b') == std::string::npos);
}

TEST_CASE("a round whose identities do not all come in time goes on, and says why once",
          "[agent]") {
  boost::asio::io_context io;
  ddprun::testing::FakeRendezvous inner;
  inner.round.local_world_sizes = {1, 1};
  inner.round.group_rank = 0;
  ddprun::testing::FakeRendezvousService service(io);
  ddprun::testing::LogCapture log("agent");
  // The other node never says what it runs (stalled, or an agent of another release, whose keys
  // this one does not read): the wait (one slice here) times out.
  JobIdentityClient client(inner, service, "job", "127.0.0.1", "/bin/train", false, true,
                           std::chrono::milliseconds(500));
  for (int round = 0; round < 2; ++round) {
    std::optional<StatusOr<RoundInfo>> got;
    client.nextRound([&](StatusOr<RoundInfo> r) { got = std::move(r); });
    REQUIRE(service.kv_sets.size() == 1);
    service.answer(service.kv_sets, Status::ok());
    io.restart();
    io.poll();
    REQUIRE(service.kv_waits.size() == 1);
    service.answer(service.kv_waits, StatusOr<std::vector<std::string>>(
                                         deadlineExceeded("waiting for keys: timed out")));
    io.restart();
    io.poll();
    REQUIRE(got.has_value());
    CHECK(got->isOk());  // the round goes on, unchecked
  }
  CHECK(log.count("warning: round 0: not every node said what it runs within") == 1);
  CHECK_THAT(log.text(), Catch::Contains("another ddprun release"));
  CHECK(log.count("not every node said what it runs") == 1);  // the second round's is debug
}
