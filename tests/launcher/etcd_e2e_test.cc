// ddprun --rdzv-backend=etcd-v3 end to end: real agents on distinct loopback addresses, real
// worker processes (PyTorch gloo workers, the test worker), and a real etcd (etcd-server) started
// on loopback ports. Each case skips with a message when /usr/bin/etcd is absent.
#include <catch2/catch.hpp>
#include <csignal>
#include <fstream>
#include <map>
#include <memory>

#include "etcd_cluster.h"
#include "fake_etcd2.h"
#include "multinode_helpers.h"
#include "process_helpers.h"

using namespace ddprun::testing;
using namespace std::chrono_literals;

namespace {

#define REQUIRE_ETCD()                                                               \
  do {                                                                               \
    if (!etcdAvailable()) {                                                          \
      WARN("SKIPPED: " + etcdBinary() +                                              \
           " is absent (apt-get install etcd-server etcd-client; install-deps.sh)"); \
      return;                                                                        \
    }                                                                                \
  } while (0)

// One node: a ddprun agent advertising `addr`, in a process group of its own (so killing it
// with its workers is one signal).
std::unique_ptr<Process> etcdAgent(const std::string& addr, const std::string& endpoints,
                                   const std::string& nnodes, const std::string& run_id,
                                   std::vector<std::string> extra, std::vector<std::string> program,
                                   std::map<std::string, std::string> env = {}) {
  std::vector<std::string> argv = {ddprunBin(),
                                   "--nnodes=" + nnodes,
                                   "--rdzv-backend=etcd-v3",
                                   "--rdzv-endpoint=" + endpoints,
                                   "--rdzv-id=" + run_id,
                                   "--local-addr=" + addr};
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.insert(argv.end(), program.begin(), program.end());
  ProcessOptions options;
  options.own_process_group = true;
  env["PYTHON_EXEC"] = torchPython();
  return std::make_unique<Process>(argv, env, options);
}

}  // namespace

TEST_CASE("etcd-v3: two nodes of PyTorch gloo workers all_reduce across nodes", "[etcd][pytorch]") {
  REQUIRE_ETCD();
  if (!torchAvailable()) {
    WARN("SKIPPED: no torch at " + torchPython());
    return;
  }
  EtcdCluster etcd;
  const std::string prog = sourceDir() + "/examples/pytorch/allreduce_check.py";
  auto a =
      etcdAgent("127.0.0.2", etcd.endpoints(), "2", "e2e-gloo", {"--nproc-per-node=2"}, {prog});
  auto b =
      etcdAgent("127.0.0.3", etcd.endpoints(), "2", "e2e-gloo", {"--nproc-per-node=2"}, {prog});
  auto [ra, rb] = bothSucceed(*a, *b, 180s);
  INFO(ra.err << rb.err);
  const std::string all = ra.out + rb.out;
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r);
    CHECK(all.find("rank " + std::to_string(r) + "/4: all_reduce sum 10 (expected 10) OK") !=
          std::string::npos);
  }
}

TEST_CASE("etcd-v3: a worker failing on one node restarts every node once", "[etcd]") {
  REQUIRE_ETCD();
  EtcdCluster etcd;
  TempDir state, envs;
  auto worker = testWorker({"--exit-code", "4", "--only-rank", "3", "--fail-until-restart", "1",
                            "--fail-fast", "--sleep", "3", "--state-dir", state.path(), "--env-out",
                            envs.path()});
  auto a = etcdAgent("127.0.0.2", etcd.endpoints(), "2", "e2e-fail",
                     {"--nproc-per-node=2", "--max-restarts=1"}, worker);
  auto b = etcdAgent("127.0.0.3", etcd.endpoints(), "2", "e2e-fail",
                     {"--nproc-per-node=2", "--max-restarts=1"}, worker);
  auto [ra, rb] = bothSucceed(*a, *b, 180s);
  INFO(ra.err << rb.err);
  checkEveryRankRestartedOnce(state, envs, 4);
}

TEST_CASE("etcd-v3: an agent killed with SIGKILL is found dead by its lease", "[etcd]") {
  REQUIRE_ETCD();
  EtcdCluster etcd;
  TempDir state;
  const std::vector<std::string> flags = {
      "--nproc-per-node=1", "--max-restarts=0",
      "--rdzv-conf=last_call_timeout=1,heartbeat_interval=0.5,heartbeat_misses=3"};
  auto worker =
      testWorker({"--sleep", "600", "--on-signal-exit", "0", "--state-dir", state.path()});
  auto a = etcdAgent("127.0.0.2", etcd.endpoints(), "1:2", "e2e-dead", flags, worker);
  auto b = etcdAgent("127.0.0.3", etcd.endpoints(), "1:2", "e2e-dead", flags, worker);
  const bool formed =
      waitUntil([&] { return countOf(a->err() + b->err(), " of 2, world size 2") == 2; }, 90s);
  INFO(a->err() << b->err());
  REQUIRE(formed);
  // No leave, no lease revoke: only the lease's expiry tells etcd.
  ::kill(-b->pid(), SIGKILL);
  REQUIRE(b->wait(10s));
  REQUIRE(waitUntil(
      [&] { return a->err().find("group rank 0 of 1, world size 1") != std::string::npos; }, 60s));
  CHECK(a->err().find("NODE_DEAD") != std::string::npos);
  CHECK(a->err().find("restarting workers") == std::string::npos);  // not charged
  a->signal(SIGTERM);
  CHECK(a->wait(30s));
}

TEST_CASE("etcd-v3: a node declared dead while the last steps ran ends the job with the others",
          "[etcd]") {
  REQUIRE_ETCD();
  EtcdCluster etcd;
  stalledNodeEndsWithTheOthers(
      [&](const std::string& addr, const std::vector<std::string>& flags,
          const std::vector<std::string>& prog) {
        return etcdAgent(addr, etcd.endpoints(), "2", "e2e-stalledend", flags, prog);
      },
      GENERATE(true, false));
}

TEST_CASE("etcd-v3: a node declared dead while its agent stalled lets its workers finish",
          "[etcd]") {
  REQUIRE_ETCD();
  EtcdCluster etcd;
  stalledNodeFinishesItsTail(
      [&](const std::string& addr, const std::vector<std::string>& flags,
          const std::vector<std::string>& prog) {
        return etcdAgent(addr, etcd.endpoints(), "2", "e2e-stalledtail", flags, prog);
      },
      GENERATE(true, false));
}

TEST_CASE(
    "etcd-v3: a node whose workers finished while it was declared dead joins the others' new "
    "round",
    "[etcd]") {
  REQUIRE_ETCD();
  EtcdCluster etcd;
  stalledNodeRerunsWithTheOthers([&](const std::string& addr, const std::vector<std::string>& flags,
                                     const std::vector<std::string>& prog) {
    return etcdAgent(addr, etcd.endpoints(), "2", "e2e-stalledrerun", flags, prog);
  });
}

TEST_CASE(
    "etcd-v3: a node declared dead while its agent stalled, its watch broken and the store "
    "compacted meanwhile, still lets its workers finish",
    "[etcd]") {
  // etcd drops the connections of a client that answers no keepalive ping (the stalled agent's),
  // and the revisions the agent missed are compacted: when it runs again it reads the whole run
  // anew, and only that read's snapshot says that round 2 forms. It must say why (this node was
  // declared dead), so that the node's workers, still running, get failure_grace as they do when
  // the round's message itself arrives; told only "a round forms", it stopped them at once.
  REQUIRE_ETCD();
  EtcdCluster::Options options;
  // The stalled agent's connection is dropped (~2 s) before its lease expires (5 s): the change
  // that declares it dead goes to no open stream of it.
  options.extra_args = {"--grpc-keepalive-interval", "1s", "--grpc-keepalive-timeout", "1s"};
  EtcdCluster etcd(options);
  const int etcd_port = std::stoi(etcd.endpoint(0).substr(etcd.endpoint(0).rfind(':') + 1));
  TempDir flags_dir;
  NodePair nodes = startNodePair(
      [&](const std::string& addr, const std::vector<std::string>& flags,
          const std::vector<std::string>& prog) {
        return etcdAgent(addr, etcd.endpoints(), "2", "e2e-stalledsync", flags, prog);
      },
      {"--nproc-per-node=1", "--max-restarts=0",
       "--rdzv-conf=last_call_timeout=1,heartbeat_interval=0.5,heartbeat_misses=10,"
       "failure_grace=60"},
      flags_dir, /*a_first=*/true);
  auto& a = nodes.a;
  auto& b = nodes.b;
  // Seen now, so that its end below means something.
  REQUIRE(hasConnectionTo(a->pid(), etcd_port));
  a->signal(SIGSTOP);  // the agent only: its worker goes on
  REQUIRE(waitUntil([&] { return !hasConnectionTo(a->pid(), etcd_port); }, 30s));
  INFO("other node:\n" << b->err());
  REQUIRE(waitUntil([&] { return b->err().find("NODE_DEAD") != std::string::npos; }, 30s));
  const int64_t revision = etcd.revision();
  REQUIRE(revision > 0);
  REQUIRE(etcd.etcdctl({"compact", std::to_string(revision)}).exit_code == 0);
  a->signal(SIGCONT);
  const bool synced = waitUntil(
      [&] { return a->err().find("found when the watch began") != std::string::npos; }, 30s);
  INFO("stalled node:\n" << a->err());
  REQUIRE(synced);
  CHECK(a->err().find("was compacted") != std::string::npos);
  std::ofstream(flags_dir / "a") << "";
  std::ofstream(flags_dir / "b") << "";
  auto rb = b->wait(60s), ra = a->wait(60s);
  INFO((ra ? "" : stuckReport(*a, "the stalled node", 60s)));
  REQUIRE(rb);
  REQUIRE(ra);
  CHECK(rb->exit_code == 0);
  CHECK(ra->exit_code == 0);
  // Neither worker was stopped and started again.
  CHECK(countOf(ra->out, "stopped a") == 0);
  CHECK(countOf(ra->out, "done a") == 1);
  CHECK(countOf(rb->out, "done b") == 1);
  CHECK(countOf(ra->err, "started 1 worker(s)") == 1);
}

TEST_CASE(
    "etcd-v3: --snapshot-dir replicates through the etcd store, and a node whose holdings come "
    "late "
    "is taken in",
    "[etcd][snapshot]") {
  // The round's holdings travel through etcd's key-value store.
  REQUIRE_ETCD();
  EtcdCluster etcd;
  lateHoldingsTakenIn([&](const std::string& addr, const std::string& dir,
                          const std::vector<std::string>& program,
                          const std::map<std::string, std::string>& env) {
    return etcdAgent(addr, etcd.endpoints(), "3", "e2e-snap",
                     {"--nproc-per-node=1", "--max-restarts=0", "--snapshot-dir=" + dir,
                      "--snapshot-allow-unauthenticated",
                      "--rdzv-conf=last_call_timeout=1,heartbeat_interval=1,heartbeat_misses=3"},
                     program, env);
  });
}

TEST_CASE("etcd-v3: an unreachable etcd is one error line naming the member", "[etcd]") {
  const std::string endpoint = "127.0.0.1:" + std::to_string(freePort());
  auto a = etcdAgent("127.0.0.2", endpoint, "2", "e2e-down", {"--rdzv-conf=join_timeout=2"},
                     testWorker({"--sleep", "1"}));
  auto r = a->wait(60s);
  REQUIRE(r);
  INFO(r->err);
  CHECK(r->exit_code != 0);
  CHECK(r->err.find("no etcd member answered") != std::string::npos);
  CHECK(r->err.find(endpoint) != std::string::npos);
  CHECK(r->err.find("terminate called") == std::string::npos);
}

TEST_CASE("etcd-v3: an etcd that serves only the v2 API is one error line, before join_timeout",
          "[etcd]") {
  FakeEtcd2 old("2.3.8");
  // join_timeout=600: the agent must give up because etcd is too old, not because time ran out.
  auto a = etcdAgent("127.0.0.2", old.endpoint(), "1", "e2e-v2", {"--rdzv-conf=join_timeout=600"},
                     testWorker({"--sleep", "1"}));
  auto r = a->wait(120s);
  REQUIRE(r);
  INFO(r->err);
  CHECK(r->exit_code != 0);
  CHECK(r->err.find("etcd at " + old.endpoint() +
                    " is version 2.3.8, which serves only the v2 API") != std::string::npos);
  CHECK(r->err.find("terminate called") == std::string::npos);
}

TEST_CASE("etcd-v3: a train job finishes while the etcd leader is killed mid-run",
          "[etcd][cluster]") {
  REQUIRE_ETCD();
  EtcdCluster::Options eo;
  eo.members = 3;
  EtcdCluster etcd(eo);
  TempDir work;
  // 0.2 s a step (--step-delay), so the kill lands mid-training.
  auto prog = [&](const std::string& name) {
    return std::vector<std::string>{"--no-python",
                                    buildDir() + "/examples/train",
                                    "60",
                                    "1",
                                    "--step-delay",
                                    "0.2",
                                    "--dataset-size",
                                    "192",
                                    "--snapshot-path",
                                    work / (name + ".pt")};
  };
  const std::vector<std::string> flags = {"--nproc-per-node=1", "--max-restarts=0",
                                          "--rdzv-conf=last_call_timeout=1"};
  auto a = etcdAgent("127.0.0.2", etcd.endpoints(), "2:3", "e2e-leader", flags, prog("a"));
  auto b = etcdAgent("127.0.0.3", etcd.endpoints(), "2:3", "e2e-leader", flags, prog("b"));
  auto c = etcdAgent("127.0.0.4", etcd.endpoints(), "2:3", "e2e-leader", flags, prog("c"));
  auto all = [&] { return a->out() + b->out() + c->out(); };
  auto errs = [&] { return a->err() + b->err() + c->err(); };
  const bool formed = waitUntil([&] { return countOf(errs(), " of 3, world size 3") == 3; }, 120s);
  INFO(errs());
  REQUIRE(formed);
  REQUIRE(waitUntil([&] { return all().find("] Epoch 3 |") != std::string::npos; }, 180s));
  const int leader = etcd.leader();
  REQUIRE(leader >= 0);
  etcd.kill(leader);
  REQUIRE(waitUntil([&] { return all().find("] Epoch 8 |") != std::string::npos; }, 180s));
  // Nobody was declared dead and nothing was re-formed by the leader's loss.
  CHECK(errs().find("NODE_DEAD") == std::string::npos);
  CHECK(countOf(errs(), "round 2:") == 0);
  // A later membership change (a node leaving) still reaches every agent through the cluster.
  c->signal(SIGTERM);
  REQUIRE(c->wait(60s));
  REQUIRE(waitUntil([&] { return countOf(a->err() + b->err(), " of 2, world size 2") == 2; }, 60s));
  for (Process* p : {a.get(), b.get()}) {
    auto r = p->wait(300s);
    REQUIRE(r);
    INFO(r->err);
    CHECK(r->exit_code == 0);
    CHECK(r->out.find("] Epoch 59 |") != std::string::npos);
    CHECK(r->err.find("restarting workers") == std::string::npos);  // no restart charged
  }
}

TEST_CASE("etcd-v3: workers run on through an etcd outage and a failure in it is handled after",
          "[etcd]") {
  REQUIRE_ETCD();
  EtcdCluster etcd;
  TempDir state, envs;
  const std::string trigger = state / "trigger";
  // Every rank waits for the trigger; then rank 1 fails at once (first attempt only) while the
  // others keep running for 30 s.
  auto worker = testWorker({"--wait-for", trigger, "--exit-code", "4", "--only-rank", "1",
                            "--fail-until-restart", "1", "--fail-fast", "--sleep", "30",
                            "--state-dir", state.path(), "--env-out", envs.path()});
  const std::vector<std::string> flags = {"--nproc-per-node=1", "--max-restarts=1",
                                          "--rdzv-conf=join_timeout=120"};
  auto a = etcdAgent("127.0.0.2", etcd.endpoints(), "2", "e2e-outage", flags, worker);
  auto b = etcdAgent("127.0.0.3", etcd.endpoints(), "2", "e2e-outage", flags, worker);
  REQUIRE(waitUntil([&] { return fileExists(state / "pid.0.0") && fileExists(state / "pid.1.0"); },
                    120s));
  etcd.kill(0);
  std::ofstream(trigger) << "go\n";  // the failure happens while etcd is down
  REQUIRE(waitUntil(
      [&] {
        return a->err().find("exit") != std::string::npos ||
               b->err().find("exit") != std::string::npos;
      },
      30s));
  std::this_thread::sleep_for(2s);  // the outage itself, not a wait for an event
  // The workers of the healthy node were not stopped by the outage.
  CHECK_FALSE(fileExists(state / "pid.0.1"));
  etcd.start(0);
  {
    const bool healthy = etcd.waitHealthy();
    INFO(etcd.logs());
    REQUIRE(healthy);
  }
  for (Process* p : {a.get(), b.get()}) {
    auto r = p->wait(120s);
    INFO("first agent:\n" << a->err() << "second agent:\n" << b->err());
    REQUIRE(r);
    INFO(r->err);
    CHECK(r->exit_code == 0);
    // The outage is said once or twice (the watch's end, the first refused retry), not once per
    // retry (10 a second before).
    CHECK(countOf(r->err, "etcd rendezvous: watch ended") <= 6);
  }
  checkEveryRankRestartedOnce(state, envs, 2);
}
