// Helpers of the multi-node e2e suites: the test worker's ddprun arguments
// (tests/agent/ddprun_test_worker), what its state and env files say after a job that restarted
// its workers once, two agents that both succeed, and the stalled-agent scenarios each backend
// (gRPC, etcd-v3) must pass; the snapshot suites' end of a job (logsThenStop) and check that
// every node holds what every worker wrote (everyDirHolds), and the late-holdings scenario
// (lateHoldingsTakenIn).
#pragma once

#include <catch2/catch.hpp>
#include <chrono>
#include <csignal>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "process_helpers.h"

namespace ddprun::testing {

// `args` for the test worker, behind the ddprun flags that run it as a plain executable.
inline std::vector<std::string> testWorker(std::vector<std::string> args) {
  args.insert(args.begin(), {"--no-python", testWorkerBin()});
  return args;
}

// Every rank of `ranks` ran twice (attempts 0 and 1, never 2) and its second attempt saw
// TORCHELASTIC_RESTART_COUNT=1 (the worker's --state-dir and --env-out files).
inline void checkEveryRankRestartedOnce(const TempDir& state, const TempDir& envs, int ranks) {
  for (int r = 0; r < ranks; ++r) {
    INFO("rank " << r);
    CHECK(fileExists(state / ("pid." + std::to_string(r) + ".1")));
    CHECK_FALSE(fileExists(state / ("pid." + std::to_string(r) + ".2")));
    CHECK(parseEnvFile(
              readFile(envs / ("env." + std::to_string(r))))["TORCHELASTIC_RESTART_COUNT"] == "1");
  }
}

// The nodes' logs so far (the one round their workers ran in: nodes that leave at the end start
// another), then `stop_file` is created and every node must exit 0.
inline std::string logsThenStop(const std::vector<std::unique_ptr<Process>>& nodes,
                                const std::string& stop_file) {
  std::string logs;
  for (const auto& n : nodes) logs += n->err() + "\n";
  std::ofstream(stop_file) << "";
  for (const auto& n : nodes) {
    auto r = n->wait(std::chrono::seconds(120));
    REQUIRE(r);
    CHECK(r->exit_code == 0);
  }
  return logs;
}

// Whether each of `dirs` holds "<name>.bin" reading "<name>\n" for every one of `names` (what the
// nodes' workers wrote, replicated to every node).
inline bool everyDirHolds(const std::vector<std::string>& dirs,
                          const std::vector<std::string>& names) {
  for (const auto& dir : dirs) {
    for (const auto& n : names) {
      if (readFile(dir + "/" + n + ".bin") != n + "\n") return false;
    }
  }
  return true;
}

// Starts one node of a 3-node --snapshot-dir job: its agent advertising `addr`, replicating `dir`,
// running `program` (ddprun arguments included), with `env` added to the agent's environment.
using StartSnapshotNode = std::function<std::unique_ptr<Process>(
    const std::string& addr, const std::string& dir, const std::vector<std::string>& program,
    const std::map<std::string, std::string>& env)>;

// The late-holdings scenario each backend must pass: three nodes replicate directories of their
// own; the middle one publishes its holdings 17 s late (DDPRUN_SNAPSHOT_FAULT, as an agent stalled
// at the round's start), past the others' 15 s wait. They start the round with each other, take it
// in once its holdings come, and tell it what their workers wrote meanwhile; what its workers
// write is taken. Every node ends holding what every worker wrote.
inline void lateHoldingsTakenIn(const StartSnapshotNode& start) {
  using namespace std::chrono_literals;
  TempDir a_dir, b_dir, c_dir, flags;
  const std::string stop = flags / "stop";
  const std::string d = "\"$DDPRUN_SNAPSHOT_DIR\"";
  const auto program = [&](const std::string& name) {
    return std::vector<std::string>{"--no-python", "/bin/sh", "-c",
                                    "echo " + name + " > " + d + "/" + name + ".tmp && mv " + d +
                                        "/" + name + ".tmp " + d + "/" + name +
                                        ".bin; while [ ! -e '" + stop + "' ]; do sleep 0.05; done"};
  };
  std::vector<std::unique_ptr<Process>> nodes;
  nodes.push_back(start("127.0.0.2", a_dir.path(), program("a"), {}));
  nodes.push_back(start("127.0.0.3", b_dir.path(), program("b"),
                        {{"DDPRUN_SNAPSHOT_FAULT", "late-holdings:17000"}}));
  nodes.push_back(start("127.0.0.4", c_dir.path(), program("c"), {}));
  const bool everywhere = waitUntil(
      [&] {
        return everyDirHolds({a_dir.path(), b_dir.path(), c_dir.path()}, {"a", "b", "c"});
      },
      90s);
  INFO(nodes[0]->err() << "\n" << nodes[1]->err() << "\n" << nodes[2]->err());
  REQUIRE(everywhere);
  const std::string logs = logsThenStop(nodes, stop);
  INFO(logs);
  // The two others started without it, and took it in (its own wait saw every node's).
  CHECK(countOf(logs, "did not arrive in time") == 2);
  CHECK(countOf(logs, "came late; it is a node of round 1 from now on") == 2);
  CHECK(logs.find("snapshot: ignored") == std::string::npos);
}

// Waits (bounded) for two nodes' agents and checks that both succeeded.
inline std::pair<Finished, Finished> bothSucceed(
    Process& a, Process& b, std::chrono::seconds bound = std::chrono::seconds(120)) {
  auto ra = a.wait(bound), rb = b.wait(bound);
  INFO((ra ? "" : stuckReport(a, "the first agent", bound))
       << (rb ? "" : stuckReport(b, "the second agent", bound)) << "first agent:\n"
       << a.err() << "second agent:\n"
       << b.err());
  REQUIRE(ra);
  REQUIRE(rb);
  CHECK(ra->exit_code == 0);
  CHECK(rb->exit_code == 0);
  return {*ra, *rb};
}

// Starts one node of a 2-node job: its agent advertising `addr`, with ddprun `flags`, running
// `program`.
using StartNode = std::function<std::unique_ptr<Process>(const std::string& addr,
                                                         const std::vector<std::string>& flags,
                                                         const std::vector<std::string>& program)>;

// A worker that says "done <name>" once the file `dir`/`name` exists, and "stopped <name>" when
// it is sent SIGTERM first.
inline std::vector<std::string> untilFlagWorker(const TempDir& dir, const std::string& name) {
  return {"--no-python", "/bin/sh", "-c",
          "trap 'echo stopped " + name + "; exit 143' TERM; while [ ! -e '" + dir / name +
              "' ]; do sleep 0.05; done; echo done " + name};
}

// The two nodes of the stalled-agent scenarios, a and b, each running untilFlagWorker(dir, its
// name) with `flags`, both workers started. a joins first (group rank 0, the node that closes
// the run) or second.
struct NodePair {
  std::unique_ptr<Process> a, b;
};
inline NodePair startNodePair(const StartNode& start_node, const std::vector<std::string>& flags,
                              const TempDir& dir, bool a_first) {
  using namespace std::chrono_literals;
  auto start = [&](const std::string& addr, const std::string& name) {
    auto p = start_node(addr, flags, untilFlagWorker(dir, name));
    REQUIRE(waitUntil([&] { return p->err().find("waiting up to") != std::string::npos; }, 60s));
    return p;
  };
  NodePair n;
  auto first = start(a_first ? "127.0.0.2" : "127.0.0.3", a_first ? "a" : "b");
  auto second = start(a_first ? "127.0.0.3" : "127.0.0.2", a_first ? "b" : "a");
  n.a = std::move(a_first ? first : second);
  n.b = std::move(a_first ? second : first);
  REQUIRE(
      waitUntil([&] { return countOf(n.a->err() + n.b->err(), "started 1 worker(s)") == 2; }, 60s));
  return n;
}

// The flags of the stalled-agent scenarios: a node is declared dead 1.5 s after its agent stalls.
inline std::vector<std::string> stalledFlags(const std::string& failure_grace) {
  return {
      "--nproc-per-node=1", "--max-restarts=0",
      "--rdzv-conf=last_call_timeout=1,heartbeat_interval=0.5,heartbeat_misses=3,failure_grace=" +
          failure_grace};
}

// Stops node a's agent (SIGSTOP; its worker goes on) and lets a's worker finish.
inline void stallWhileItsWorkerFinishes(Process& a, const TempDir& flags_dir) {
  using namespace std::chrono_literals;
  a.signal(SIGSTOP);
  std::ofstream(flags_dir / "a") << "";
  REQUIRE(waitUntil([&] { return a.out().find("done a") != std::string::npos; }, 30s));
}

// Node a's agent stalls (SIGSTOP) while the job's last steps run; its worker goes on and
// finishes. b, a declared dead, has its worker finish within failure_grace: it ends the job, and
// a, running again, too; both exit 0. (Stopping its worker at once, b would wait for a round a
// never joins, and a out its whole exit barrier.)
inline void stalledNodeEndsWithTheOthers(const StartNode& start_node, bool a_first) {
  using namespace std::chrono_literals;
  TempDir flags_dir;
  NodePair nodes = startNodePair(start_node, stalledFlags("30"), flags_dir, a_first);
  auto& a = nodes.a;
  auto& b = nodes.b;
  stallWhileItsWorkerFinishes(*a, flags_dir);
  INFO(b->err());
  REQUIRE(waitUntil([&] { return b->err().find("NODE_DEAD") != std::string::npos; }, 30s));
  std::ofstream(flags_dir / "b") << "";  // b's worker finishes within b's failure_grace
  REQUIRE(waitUntil([&] { return b->err().find("exit barrier") != std::string::npos; }, 30s));
  a->signal(SIGCONT);
  auto rb = b->wait(60s), ra = a->wait(60s);
  INFO((ra ? "" : stuckReport(*a, "the stalled node", 60s)) << "stalled node:\n" << a->err());
  REQUIRE(rb);
  REQUIRE(ra);
  CHECK(rb->exit_code == 0);
  CHECK(ra->exit_code == 0);
  // b's worker was never stopped and started again.
  CHECK(countOf(rb->err, "started 1 worker(s)") == 1);
  CHECK(countOf(rb->out, "done b") == 1);
  // The stalled node says once that it is no longer counted, not at every heartbeat.
  CHECK(countOf(ra->err, "no longer counts this node") <= 1);
}

// Node a's agent stalls (SIGSTOP) while the job ends: b's worker finishes and b, a declared dead,
// ends the job. a, running again, learns that it was declared dead; its worker, still running,
// finishes within failure_grace and a exits 0 too, its worker neither stopped nor started again.
inline void stalledNodeFinishesItsTail(const StartNode& start_node, bool a_first) {
  using namespace std::chrono_literals;
  TempDir flags_dir;
  NodePair nodes = startNodePair(start_node, stalledFlags("30"), flags_dir, a_first);
  auto& a = nodes.a;
  auto& b = nodes.b;
  a->signal(SIGSTOP);  // the agent only: its worker goes on, a little behind b's
  std::ofstream(flags_dir / "b") << "";
  auto rb = b->wait(60s);
  INFO("other node:\n" << b->err());
  REQUIRE(rb);
  CHECK(rb->exit_code == 0);
  a->signal(SIGCONT);
  REQUIRE(waitUntil(
      [&] {
        return a->err().find("no longer counts this node") != std::string::npos ||
               a->err().find("NODE_DEAD by") != std::string::npos;
      },
      30s));
  std::ofstream(flags_dir / "a") << "";
  auto ra = a->wait(60s);
  INFO((ra ? "" : stuckReport(*a, "the stalled node", 60s)) << "stalled node:\n" << a->err());
  REQUIRE(ra);
  CHECK(ra->exit_code == 0);
  CHECK(countOf(ra->out, "done a") == 1);
  CHECK(countOf(ra->out, "stopped a") == 0);
}

// Node a's agent stalls (SIGSTOP) and its worker finishes; b, a declared dead, stops its own
// unfinished worker after failure_grace (1 s) and goes on to round 2. a, running again, learns it
// in its exit barrier and joins round 2: both workers start again, and both nodes exit 0.
inline void stalledNodeRerunsWithTheOthers(const StartNode& start_node) {
  using namespace std::chrono_literals;
  TempDir flags_dir;
  NodePair nodes = startNodePair(start_node, stalledFlags("1"), flags_dir, /*a_first=*/true);
  auto& a = nodes.a;
  auto& b = nodes.b;
  stallWhileItsWorkerFinishes(*a, flags_dir);
  INFO(b->err());
  REQUIRE(waitUntil([&] { return b->out().find("stopped b") != std::string::npos; }, 30s));
  a->signal(SIGCONT);
  REQUIRE(waitUntil([&] { return countOf(a->err() + b->err(), "started 1 worker(s)") == 4; }, 60s));
  std::ofstream(flags_dir / "b") << "";
  auto rb = b->wait(60s), ra = a->wait(60s);
  INFO((ra ? "" : stuckReport(*a, "the stalled node", 60s)) << "stalled node:\n" << a->err());
  REQUIRE(rb);
  REQUIRE(ra);
  CHECK(rb->exit_code == 0);
  CHECK(ra->exit_code == 0);
  CHECK(ra->err.find("went on to round 2; joining it") != std::string::npos);
  CHECK(countOf(ra->out, "done a") == 2);
  CHECK(countOf(rb->out, "done b") == 1);
}

}  // namespace ddprun::testing
