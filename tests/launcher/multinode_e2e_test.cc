// Multi-node end to end on one machine: several agents on distinct loopback addresses
// (127.0.0.2, 127.0.0.3, ...) form one job over the gRPC rendezvous, with real worker processes
// and real PyTorch gloo workers whose collectives span the nodes.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <catch2/catch.hpp>
#include <csignal>
#include <fstream>
#include <memory>
#include <regex>

#include "ddprun/common/strings.h"
#include "multinode_helpers.h"
#include "process_helpers.h"
#include "rendezvous_daemon.h"
#include "test_pki.h"

using namespace ddprun;
using namespace ddprun::testing;
using namespace std::chrono_literals;

namespace {

// One node: a ddprun agent advertising `addr`.
std::unique_ptr<Process> agent(const std::string& addr, const std::string& endpoint,
                               const std::string& nnodes, const std::string& run_id,
                               std::vector<std::string> extra, std::vector<std::string> program) {
  std::vector<std::string> argv = {ddprunBin(),           "--nnodes=" + nnodes,
                                   "--rdzv-backend=c10d", "--rdzv-endpoint=" + endpoint,
                                   "--rdzv-id=" + run_id, "--local-addr=" + addr};
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.insert(argv.end(), program.begin(), program.end());
  return std::make_unique<Process>(
      argv, std::map<std::string, std::string>{{"PYTHON_EXEC", torchPython()}});
}

}  // namespace

TEST_CASE("agents on two loopback addresses form one job whose gloo all_reduce spans them",
          "[multinode][pytorch]") {
  if (!torchAvailable()) {
    WARN("skipped: no torch at " + torchPython());
    return;
  }
  const std::string ep = "127.0.0.1:" + std::to_string(freePort());
  const std::string prog = sourceDir() + "/examples/pytorch/allreduce_check.py";
  // Runs a job of two nodes with `na` and `nb` workers; checks every rank's sum, on the node
  // that must hold it: the group-rank-0 node has ranks 0..n0-1, the other the block after.
  auto check = [&](int na, int nb, const std::string& run_id) {
    auto a =
        agent("127.0.0.2", ep, "2", run_id, {"--nproc-per-node=" + std::to_string(na)}, {prog});
    auto b =
        agent("127.0.0.3", ep, "2", run_id, {"--nproc-per-node=" + std::to_string(nb)}, {prog});
    auto [ra, rb] = bothSucceed(*a, *b, 180s);
    INFO(ra.err << rb.err);
    const int world = na + nb;
    const std::string sum = std::to_string(world * (world + 1) / 2);
    const bool a_first = ra.out.find("rank 0/" + std::to_string(world)) != std::string::npos;
    const int first_block = a_first ? na : nb;
    for (int r = 0; r < world; ++r) {
      const bool on_a = (r < first_block) == a_first;
      INFO("rank " << r);
      CHECK((on_a ? ra.out : rb.out)
                .find("rank " + std::to_string(r) + "/" + std::to_string(world) +
                      ": all_reduce sum " + sum + " (expected " + sum + ") OK") !=
            std::string::npos);
    }
  };
  SECTION("2 + 2 workers give world size 4") { check(2, 2, "ws4"); }
  SECTION("4 + 2 workers give world size 6 with contiguous rank blocks") { check(4, 2, "ws6"); }
}

TEST_CASE("a worker failing on one node restarts every node's workers, charged once",
          "[multinode]") {
  RendezvousDaemon rdzv;
  TempDir state, envs;
  auto worker = testWorker({"--exit-code", "4", "--only-rank", "3", "--fail-until-restart", "1",
                            "--fail-fast", "--sleep", "3", "--state-dir", state.path(), "--env-out",
                            envs.path()});
  auto a = agent("127.0.0.2", rdzv.endpoint, "2", "fail1",
                 {"--nproc-per-node=2", "--max-restarts=1"}, worker);
  auto b = agent("127.0.0.3", rdzv.endpoint, "2", "fail1",
                 {"--nproc-per-node=2", "--max-restarts=1"}, worker);
  bothSucceed(*a, *b);
  checkEveryRankRestartedOnce(state, envs, 4);
}

TEST_CASE("the static backend forms the job from the node ranks given, as torchrun's tutorials do",
          "[multinode]") {
  TempDir state, envs;
  const int port = freePort();
  auto worker = testWorker({"--exit-code", "9", "--only-rank", "1", "--fail-until-restart", "1",
                            "--fail-fast", "--sleep", "3", "--state-dir", state.path(), "--env-out",
                            envs.path()});
  auto node = [&](int rank, const std::string& addr) {
    std::vector<std::string> argv = {ddprunBin(),
                                     "--nnodes=2",
                                     "--node_rank=" + std::to_string(rank),
                                     "--master_addr=127.0.0.1",
                                     "--master_port=" + std::to_string(port),
                                     "--nproc_per_node=2",
                                     "--max-restarts=1",
                                     "--local-addr=" + addr};
    argv.insert(argv.end(), worker.begin(), worker.end());
    return std::make_unique<Process>(argv);
  };
  auto n1 = node(1, "127.0.0.3");  // rank 1 first: it waits for rank 0's rendezvous
  auto n0 = node(0, "127.0.0.2");
  bothSucceed(*n0, *n1);
  for (int r = 0; r < 4; ++r) {
    auto env = parseEnvFile(readFile(envs / ("env." + std::to_string(r))));
    INFO("rank " << r);
    CHECK(env["MASTER_ADDR"] == "127.0.0.1");
    CHECK(env["MASTER_PORT"] == std::to_string(port));
    CHECK(env["GROUP_RANK"] == (r < 2 ? "0" : "1"));
    CHECK(env["WORLD_SIZE"] == "4");
    CHECK(env["TORCHELASTIC_RESTART_COUNT"] == "1");  // rank 1's failure restarted both nodes
  }
}

TEST_CASE(
    "SIGTERM to one node: it leaves at once, the others re-form without it, and a new "
    "node grows the world back",
    "[multinode]") {
  RendezvousDaemon rdzv;
  TempDir state;
  // Heartbeats so slow that only the graceful leave can explain a quick re-form.
  const std::vector<std::string> flags = {
      "--nproc-per-node=1", "--max-restarts=0",
      "--rdzv-conf=last_call_timeout=1,heartbeat_interval=30,heartbeat_misses=3"};
  auto worker =
      testWorker({"--sleep", "600", "--on-signal-exit", "0", "--state-dir", state.path()});
  auto a = agent("127.0.0.2", rdzv.endpoint, "1:2", "leave1", flags, worker);
  auto b = agent("127.0.0.3", rdzv.endpoint, "1:2", "leave1", flags, worker);
  REQUIRE(waitUntil([&] { return countOf(a->err() + b->err(), "world size 2") == 2; }, 60s));
  // b is the node whose log says so; either node may be rank 1.
  b->signal(SIGTERM);
  auto rb = b->wait(30s);
  REQUIRE(rb);
  CHECK(rb->exit_code == 128 + SIGTERM);
  const bool reformed = waitUntil(
      [&] { return a->err().find("group rank 0 of 1, world size 1") != std::string::npos; }, 20s);
  INFO(a->err() << "\n---\n" << rb->err);
  REQUIRE(reformed);
  // Told by the leave's change, or, where b left just as a's round completed (before a's watch
  // began), by the watch's first snapshot; either way long before a heartbeat could lapse.
  CHECK((a->err().find("NODE_LEFT") != std::string::npos ||
         a->err().find("is forming (found when the watch began)") != std::string::npos));
  // Scale back up.
  auto c = agent("127.0.0.4", rdzv.endpoint, "1:2", "leave1", flags, worker);
  REQUIRE(waitUntil([&] { return countOf(a->err(), "world size 2") == 2; }, 60s));
  CHECK(a->err().find("NODE_JOINED") != std::string::npos);
  CHECK(a->err().find("restarting workers") == std::string::npos);  // nothing was charged
  a->signal(SIGTERM);
  c->signal(SIGTERM);
  CHECK(a->wait(30s));
  CHECK(c->wait(30s));
}

TEST_CASE(
    "kill -9 of a node's agent: its workers die, the survivors re-form and finish from the "
    "last snapshot",
    "[multinode][pytorch]") {
  if (!torchAvailable()) {
    WARN("skipped: no torch at " + torchPython());
    return;
  }
  RendezvousDaemon rdzv;
  TempDir work;
  const std::vector<std::string> prog = {sourceDir() + "/examples/pytorch/ddp_tutorial.py",
                                         "30",
                                         "1",
                                         "--snapshot_path",
                                         work / "snapshot.pt",
                                         "--step_delay",
                                         "0.004"};
  const std::vector<std::string> flags = {"--nproc-per-node=1", "--max-restarts=3",
                                          "--rdzv-conf=last_call_timeout=1"};
  auto a = agent("127.0.0.2", rdzv.endpoint, "1:2", "kill9", flags, prog);
  auto b = agent("127.0.0.3", rdzv.endpoint, "1:2", "kill9", flags, prog);
  REQUIRE(waitUntil([&] { return (a->out() + b->out()).find("Epoch 3 |") != std::string::npos; },
                    180s));
  auto b_workers = workerPids(b->pid());
  REQUIRE(b_workers.size() == 1);
  b->signal(SIGKILL);
  REQUIRE(b->wait(10s));
  CHECK(waitUntil([&] { return !pidAlive(b_workers[0]); }, 10s));
  auto ra = a->wait(300s);
  REQUIRE(ra);
  INFO(ra->out << ra->err);
  CHECK(ra->exit_code == 0);
  CHECK(ra->err.find("group rank 0 of 1, world size 1") != std::string::npos);
  std::smatch m;
  REQUIRE(std::regex_search(
      ra->out, m, std::regex(R"(\[RANK 0\] Resuming training from snapshot at Epoch (\d+))")));
  CHECK(std::stoi(m[1]) >= 3);
  CHECK(ra->out.find("[RANK 0] Epoch 29 |") != std::string::npos);
}

TEST_CASE("with a standalone ddprun-rendezvous, losing the group-rank-0 node does not end the job",
          "[multinode]") {
  RendezvousDaemon rdzv;
  TempDir state;
  const std::vector<std::string> flags = {"--nproc-per-node=1", "--max-restarts=3",
                                          "--rdzv-conf=last_call_timeout=1"};
  auto worker = testWorker({"--sleep", "6", "--state-dir", state.path()});
  auto a = agent("127.0.0.2", rdzv.endpoint, "1:2", "rank0gone", flags, worker);
  auto b = agent("127.0.0.3", rdzv.endpoint, "1:2", "rank0gone", flags, worker);
  REQUIRE(waitUntil([&] { return countOf(a->err() + b->err(), "world size 2") == 2; }, 60s));
  const bool a_is_rank0 = a->err().find("group rank 0 of 2") != std::string::npos;
  auto& rank0 = a_is_rank0 ? a : b;
  auto& survivor = a_is_rank0 ? b : a;
  rank0->signal(SIGKILL);
  auto r = survivor->wait(120s);
  REQUIRE(r);
  INFO(r->err);
  CHECK(r->exit_code == 0);
  CHECK(r->err.find("group rank 0 of 1, world size 1") != std::string::npos);
}

// The worker SDK keys its group's store entries by the round, which every node shares; each
// node's restart count differs once a node joins after a restart (the groups hung 300 s, then
// failed, again at every restart).
TEST_CASE("a train job whose second node joins after the first restarted its workers trains on",
          "[multinode]") {
  RendezvousDaemon rdzv;
  TempDir dir;
  const std::vector<std::string> flags = {
      "--nproc-per-node=2", "--max-restarts=2",
      "--rdzv-conf=last_call_timeout=1,heartbeat_interval=0.5,heartbeat_misses=3", "--no-python"};
  auto train = [&](bool fault) {
    std::vector<std::string> p = {buildDir() + "/examples/train",
                                  "10",
                                  "1",
                                  "--step-delay",
                                  "0.2",
                                  "--dataset-size",
                                  "768",
                                  "--snapshot-path",
                                  dir / "snap.pt"};
    if (fault) p.insert(p.end(), {"--fail-at-step", "2"});
    return p;
  };
  // The first node alone fails once: its count is 1. The second joins with its own count at 0.
  auto a = agent("127.0.0.2", rdzv.endpoint, "1:2", "latejoin", flags, train(true));
  REQUIRE(waitUntil(
      [&] { return a->err().find("started 2 worker(s) (attempt 1") != std::string::npos; }, 120s));
  auto b = agent("127.0.0.3", rdzv.endpoint, "1:2", "latejoin", flags, train(false));
  auto ra = a->wait(240s);
  auto rb = b->wait(ra ? 240s : 1s);
  INFO("first node:\n" << a->out() << a->err() << "\nsecond node:\n" << b->out() << b->err());
  REQUIRE(ra);
  REQUIRE(rb);
  CHECK(ra->exit_code == 0);
  CHECK(rb->exit_code == 0);
  CHECK(ra->err.find("(1 of 2 restarts used)") != std::string::npos);
  CHECK(ra->err.find("(2 of 2 restarts used)") == std::string::npos);
  CHECK(rb->err.find("restarts used)") == std::string::npos);
  // The second node's ranks trained in the world of 4 to the end.
  CHECK(countOf(ra->err + rb->err, "world size 4") >= 2);
  CHECK(rb->out.find("Epoch 9 |") != std::string::npos);
}

TEST_CASE("joining a run that was closed is refused with a clear error", "[multinode]") {
  RendezvousDaemon rdzv;
  auto first = agent("127.0.0.2", rdzv.endpoint, "1", "closedrun", {}, testWorker({}));
  auto r1 = first->wait(60s);
  REQUIRE(r1);
  REQUIRE(r1->exit_code == 0);
  auto late = agent("127.0.0.3", rdzv.endpoint, "1", "closedrun", {}, testWorker({}));
  auto r2 = late->wait(60s);
  REQUIRE(r2);
  CHECK(r2->exit_code == 1);
  CHECK(r2->err.find("closedrun is closed") != std::string::npos);
}

TEST_CASE(
    "an agent whose c10d endpoint port another program holds fails within join_timeout and "
    "says it could not host the rendezvous",
    "[multinode]") {
  // Another program listens on the endpoint's port and never answers (accepts nothing).
  const int port = freePort();
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  REQUIRE(::listen(fd, 4) == 0);
  const std::string ep = "127.0.0.1:" + std::to_string(port);
  const auto started = std::chrono::steady_clock::now();
  auto a = agent("127.0.0.2", ep, "1", "taken", {"--rdzv-conf=join_timeout=3"}, testWorker({}));
  auto r = a->wait(60s);
  ::close(fd);
  REQUIRE(r);
  INFO(r->err);
  CHECK(r->exit_code == 1);
  CHECK(std::chrono::steady_clock::now() - started < 30s);
  CHECK(r->err.find("rendezvous at " + ep + " not hosted here (cannot listen on " + ep) !=
        std::string::npos);
  CHECK(r->err.find("rendezvous at " + ep + " unreachable") != std::string::npos);
  CHECK(r->err.find("this agent could not host it: cannot listen on " + ep) != std::string::npos);
  CHECK(r->err.find("some other program holds that port") != std::string::npos);
  CHECK(r->err.find("this agent speaks plaintext gRPC") != std::string::npos);  // still there
}

TEST_CASE(
    "with tls_ca agents speak TLS to a TLS ddprun-rendezvous, without it or trusting another "
    "CA, an agent fails within its join timeout naming TLS and the endpoint",
    "[multinode][tls]") {
  TempDir dir, other_dir, envs;
  TestPki pki(dir), other(other_dir);
  if (!pki.ok || !other.ok) {
    WARN("skipped: " + (pki.ok ? other.why : pki.why));
    return;
  }
  const std::string token = dir / "token";
  std::ofstream(token) << "tls-and-token\n";
  RendezvousDaemon rdzv({"--tls-cert", pki.cert, "--tls-key", pki.key, "--token-file", token});
  CHECK(rdzv.process.err().find(", TLS") != std::string::npos);

  // A two-node job over TLS, with the shared token on every call too.
  const std::string conf =
      "--rdzv-conf=last_call_timeout=1,join_timeout=60,token_file=" + token + ",tls_ca=" + pki.ca;
  auto worker = testWorker({"--env-out", envs.path()});
  auto a = agent("127.0.0.2", rdzv.endpoint, "2", "tls2", {conf}, worker);
  auto b = agent("127.0.0.3", rdzv.endpoint, "2", "tls2", {conf}, worker);
  bothSucceed(*a, *b);
  for (int r = 0; r < 2; ++r) {
    auto env = parseEnvFile(readFile(envs / ("env." + std::to_string(r))));
    INFO("rank " << r);
    CHECK(env["WORLD_SIZE"] == "2");
    CHECK(env["GROUP_WORLD_SIZE"] == "2");
  }

  // Plaintext gRPC to the TLS daemon: refused by the handshake, reported after join_timeout.
  const auto started = std::chrono::steady_clock::now();
  auto plain = agent("127.0.0.4", rdzv.endpoint, "1", "tls-plain",
                     {"--rdzv-conf=join_timeout=3,token_file=" + token}, testWorker({}));
  auto rp = plain->wait(60s);
  REQUIRE(rp);
  INFO(rp->err);
  CHECK(rp->exit_code == 1);
  CHECK(std::chrono::steady_clock::now() - started < 30s);
  CHECK(rp->err.find("rendezvous at " + rdzv.endpoint + " unreachable") != std::string::npos);
  CHECK(rp->err.find("this agent speaks plaintext gRPC: if the rendezvous at " + rdzv.endpoint +
                     " serves TLS, give --rdzv-conf tls_ca=") != std::string::npos);

  // TLS trusting a CA that did not sign the daemon's certificate.
  auto wrong = agent("127.0.0.5", rdzv.endpoint, "1", "tls-wrong-ca",
                     {"--rdzv-conf=join_timeout=3,token_file=" + token + ",tls_ca=" + other.ca},
                     testWorker({}));
  auto rw = wrong->wait(60s);
  REQUIRE(rw);
  INFO(rw->err);
  CHECK(rw->exit_code == 1);
  CHECK(rw->err.find("this agent speaks TLS to " + rdzv.endpoint +
                     ", trusting tls_ca=" + other.ca) != std::string::npos);
}

TEST_CASE("an agent hosting the rendezvous in-process serves TLS with tls_cert and tls_key",
          "[multinode][tls]") {
  TempDir dir, envs;
  TestPki pki(dir);
  if (!pki.ok) {
    WARN("skipped: " + pki.why);
    return;
  }
  const std::string ep = "127.0.0.1:" + std::to_string(freePort());
  auto worker = testWorker({"--env-out", envs.path()});
  auto host = agent("127.0.0.2", ep, "2", "tlshost",
                    {"--rdzv-conf=is_host=true,last_call_timeout=1,tls_ca=" + pki.ca +
                     ",tls_cert=" + pki.cert + ",tls_key=" + pki.key},
                    worker);
  // The other node only trusts the CA: it can reach the host only over TLS.
  auto other = agent("127.0.0.3", ep, "2", "tlshost",
                     {"--rdzv-conf=is_host=false,last_call_timeout=1,tls_ca=" + pki.ca}, worker);
  const auto [rh, ro] = bothSucceed(*host, *other);
  CHECK(rh.err.find("hosting the rendezvous at " + ep + " (TLS)") != std::string::npos);
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    CHECK(parseEnvFile(readFile(envs / ("env." + std::to_string(r))))["WORLD_SIZE"] == "2");
  }
}

TEST_CASE("the agent serves /healthz and Prometheus /metrics", "[multinode]") {
  TempDir state;
  const std::string ep = "127.0.0.1:" + std::to_string(freePort());
  auto a = agent("127.0.0.2", ep, "1", "metrics", {"--nproc-per-node=2", "--metrics-port=0"},
                 testWorker({"--sleep", "600", "--state-dir", state.path()}));
  std::smatch m;
  std::string port;
  REQUIRE(waitUntil(
      [&] {
        std::string err = a->err();
        if (!std::regex_search(err, m,
                               std::regex(R"(metrics on http://127\.0\.0\.2:(\d+)/metrics)")))
          return false;
        port = m[1];
        return fileExists(state / "pid.0.0") && fileExists(state / "pid.1.0");
      },
      60s));
  auto get = [&](const std::string& path) {
    return run({torchPython(), "-c",
                "import urllib.request,sys\n"
                "try:\n"
                "  r=urllib.request.urlopen('http://127.0.0.2:" +
                    port + path +
                    "',timeout=10)\n"
                    "  print(r.status); print(r.read().decode())\n"
                    "except urllib.error.HTTPError as e:\n"
                    "  print(e.code)\n"})
        .out;
  };
  CHECK(startsWith(get("/healthz"), "200\nok"));
  const std::string metrics = get("/metrics");
  INFO(metrics);
  CHECK(metrics.find("ddprun_agent_world_size 2") != std::string::npos);
  CHECK(metrics.find("ddprun_agent_workers_running 2") != std::string::npos);
  CHECK(metrics.find("ddprun_agent_state{state=\"RUNNING\"} 1") != std::string::npos);
  CHECK(metrics.find("ddprun_agent_group_rank 0") != std::string::npos);
  CHECK(metrics.find("ddprun_agent_failures_total 0") != std::string::npos);
  CHECK(startsWith(get("/nope"), "404"));
  a->signal(SIGTERM);
  CHECK(a->wait(30s));
}

namespace {

// Two network namespaces of this test's own joined by a veth pair: "a" at 10.231.7.1 and "b" at
// 10.231.7.2. Torn down with the object. ok() is false where namespaces cannot be made.
class TwoHostNetwork {
 public:
  TwoHostNetwork() {
    const std::string id = std::to_string(::getpid());
    a_ = "ddprun_a" + id;
    b_ = "ddprun_b" + id;
    const std::string va = "dva" + id, vb = "dvb" + id;
    const std::vector<std::vector<std::string>> steps = {
        {"ip", "netns", "add", a_},
        {"ip", "netns", "add", b_},
        {"ip", "link", "add", va, "type", "veth", "peer", "name", vb},
        {"ip", "link", "set", va, "netns", a_},
        {"ip", "link", "set", vb, "netns", b_},
        {"ip", "-n", a_, "addr", "add", "10.231.7.1/24", "dev", va},
        {"ip", "-n", b_, "addr", "add", "10.231.7.2/24", "dev", vb},
        {"ip", "-n", a_, "link", "set", va, "up"},
        {"ip", "-n", b_, "link", "set", vb, "up"},
        {"ip", "-n", a_, "link", "set", "lo", "up"},
        {"ip", "-n", b_, "link", "set", "lo", "up"}};
    vb_ = vb;
    for (const auto& step : steps) {
      auto r = run(step, {}, 30s);
      if (r.exit_code != 0) {
        why_ = join(step, " ") + ": " + r.err;
        return;
      }
    }
    ok_ = true;
  }
  ~TwoHostNetwork() {
    run({"ip", "netns", "del", a_}, {}, 30s);
    run({"ip", "netns", "del", b_}, {}, 30s);
  }
  bool ok() const { return ok_; }
  const std::string& why() const { return why_; }
  std::vector<std::string> inA(std::vector<std::string> argv) const { return in(a_, argv); }
  std::vector<std::string> inB(std::vector<std::string> argv) const { return in(b_, argv); }
  void cutB() const { run({"ip", "-n", b_, "link", "set", vb_, "down"}, {}, 30s); }

 private:
  static std::vector<std::string> in(const std::string& ns, std::vector<std::string> argv) {
    argv.insert(argv.begin(), {"ip", "netns", "exec", ns});
    return argv;
  }
  std::string a_, b_, vb_, why_;
  bool ok_ = false;
};

}  // namespace

TEST_CASE("a network cut makes the far node dead to the rendezvous and the survivors go on",
          "[multinode][netns]") {
  TwoHostNetwork net;
  if (!net.ok()) {
    WARN("skipped: cannot create network namespaces here (" + net.why() + ")");
    return;
  }
  TempDir state;
  Process rdzv(net.inA({buildDir() + "/rendezvous/ddprun-rendezvous", "--listen", "10.231.7.1:0"}));
  std::string endpoint;
  std::smatch m;
  REQUIRE(waitUntil([&] {
    std::string out = rdzv.out();
    if (!std::regex_search(out, m, std::regex(R"(listening on (\S+))"))) return false;
    endpoint = m[1];
    return true;
  }));
  auto node = [&](const std::string& addr, bool in_a) {
    std::vector<std::string> argv = {
        ddprunBin(),
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=" + endpoint,
        "--rdzv-id=netcut",
        "--local-addr=" + addr,
        "--rdzv-conf=last_call_timeout=1,heartbeat_interval=0.5,heartbeat_misses=3",
        "--no-python",
        testWorkerBin(),
        "--sleep",
        "600",
        "--on-signal-exit",
        "0",
        "--state-dir",
        state.path()};
    return std::make_unique<Process>(in_a ? net.inA(argv) : net.inB(argv));
  };
  auto a = node("10.231.7.1", true);
  auto b = node("10.231.7.2", false);
  REQUIRE(waitUntil([&] { return countOf(a->err() + b->err(), "world size 2") == 2; }, 60s));
  net.cutB();
  REQUIRE(waitUntil(
      [&] { return a->err().find("group rank 0 of 1, world size 1") != std::string::npos; }, 30s));
  CHECK(a->err().find("NODE_DEAD") != std::string::npos);
  CHECK(a->err().find("restarting workers") == std::string::npos);  // not charged
  a->signal(SIGTERM);
  CHECK(a->wait(30s));
  b->signal(SIGKILL);
}

TEST_CASE("a node that dies while the others wait in the exit barrier does not hold them",
          "[multinode]") {
  RendezvousDaemon rdzv;
  const std::vector<std::string> flags = {"--nproc-per-node=1", "--rdzv-conf=last_call_timeout=1"};
  auto a =
      agent("127.0.0.2", rdzv.endpoint, "2:2", "barrierdead", flags, testWorker({"--sleep", "1"}));
  auto b = agent("127.0.0.3", rdzv.endpoint, "2:2", "barrierdead", flags,
                 testWorker({"--sleep", "600"}));
  // One round of both nodes; a's worker is done and a waits for b; then b's node disappears.
  REQUIRE(waitUntil([&] { return a->err().find("exit barrier") != std::string::npos; }, 60s));
  // b logs its round once its own master lookup returns: a busy host may delay that past a's line.
  CHECK(waitUntil([&] { return countOf(a->err() + b->err(), "world size 2") == 2; }, 30s));
  b->signal(SIGKILL);
  // Without noticing the death, a would sit out the whole 300 s barrier.
  auto r = a->wait(120s);
  REQUIRE(r);
  INFO(r->err);
  CHECK(r->exit_code == 0);
}

TEST_CASE(
    "a worker failing after the other node's workers finished restarts them too, from the exit "
    "barrier",
    "[multinode]") {
  RendezvousDaemon rdzv;
  TempDir flags_dir;
  const std::vector<std::string> flags = {"--nproc-per-node=1", "--max-restarts=1",
                                          "--rdzv-conf=last_call_timeout=1"};
  // b's worker fails in its first attempt, once its flag exists; it succeeds in the second.
  const std::vector<std::string> b_prog = {
      "--no-python", "/bin/sh", "-c",
      "while [ ! -e '" + flags_dir / "b" +
          "' ]; do sleep 0.05; done; echo attempt $TORCHELASTIC_RESTART_COUNT; "
          "[ \"$TORCHELASTIC_RESTART_COUNT\" != 0 ]"};
  auto a =
      agent("127.0.0.2", rdzv.endpoint, "2", "failatend", flags, untilFlagWorker(flags_dir, "a"));
  REQUIRE(waitUntil([&] { return a->err().find("waiting up to") != std::string::npos; }, 60s));
  auto b = agent("127.0.0.3", rdzv.endpoint, "2", "failatend", flags, b_prog);
  REQUIRE(waitUntil([&] { return countOf(a->err() + b->err(), "started 1 worker(s)") == 2; }, 60s));
  std::ofstream(flags_dir / "a") << "";
  REQUIRE(waitUntil([&] { return a->err().find("exit barrier") != std::string::npos; }, 30s));
  std::ofstream(flags_dir / "b") << "";
  auto [ra, rb] = bothSucceed(*a, *b, 60s);
  CHECK(ra.err.find("went on to round 2; joining it") != std::string::npos);
  CHECK(countOf(ra.out, "done a") == 2);
  CHECK(countOf(rb.out, "attempt 0") == 1);
  CHECK(countOf(rb.out, "attempt 1") == 1);
}

TEST_CASE("a node joining after one node's workers finished has them start again with it",
          "[multinode]") {
  RendezvousDaemon rdzv;
  TempDir flags_dir;
  const std::vector<std::string> flags = {"--nproc-per-node=1", "--max-restarts=0",
                                          "--rdzv-conf=last_call_timeout=1"};
  auto start = [&](const std::string& addr, const std::string& name) {
    return agent(addr, rdzv.endpoint, "2:3", "joinatend", flags, untilFlagWorker(flags_dir, name));
  };
  auto a = start("127.0.0.2", "a");
  REQUIRE(waitUntil([&] { return a->err().find("waiting up to") != std::string::npos; }, 60s));
  auto b = start("127.0.0.3", "b");
  REQUIRE(waitUntil([&] { return countOf(a->err() + b->err(), "started 1 worker(s)") == 2; }, 60s));
  std::ofstream(flags_dir / "a") << "";
  REQUIRE(waitUntil([&] { return a->err().find("exit barrier") != std::string::npos; }, 30s));
  auto c = start("127.0.0.4", "c");  // b stops its unfinished worker for the round c joins
  INFO(a->err() << b->err() << c->err());
  REQUIRE(waitUntil([&] { return a->err().find("joining it") != std::string::npos; }, 60s));
  std::ofstream(flags_dir / "b") << "";
  std::ofstream(flags_dir / "c") << "";
  for (auto* p : {&a, &b, &c}) {
    auto r = (*p)->wait(60s);
    REQUIRE(r);
    CHECK(r->exit_code == 0);
  }
  CHECK(countOf(a->out(), "done a") >= 2);
  CHECK(countOf(b->out(), "stopped b") >= 1);
  CHECK(countOf(c->out(), "done c") == 1);
}

TEST_CASE("a node declared dead while the last steps ran does not turn the job's end into a wait",
          "[multinode]") {
  RendezvousDaemon rdzv;
  stalledNodeEndsWithTheOthers(
      [&](const std::string& addr, const std::vector<std::string>& flags,
          const std::vector<std::string>& prog) {
        return agent(addr, rdzv.endpoint, "2", "stalledend", flags, prog);
      },
      GENERATE(true, false));
}

TEST_CASE(
    "a node that finds itself declared dead while its workers still run lets them finish within "
    "failure_grace",
    "[multinode]") {
  RendezvousDaemon rdzv;
  stalledNodeFinishesItsTail(
      [&](const std::string& addr, const std::vector<std::string>& flags,
          const std::vector<std::string>& prog) {
        return agent(addr, rdzv.endpoint, "2", "stalledtail", flags, prog);
      },
      GENERATE(true, false));
}

TEST_CASE(
    "a node whose workers finished while it was declared dead starts them again with the others "
    "in their new round",
    "[multinode]") {
  RendezvousDaemon rdzv;
  stalledNodeRerunsWithTheOthers([&](const std::string& addr, const std::vector<std::string>& flags,
                                     const std::vector<std::string>& prog) {
    return agent(addr, rdzv.endpoint, "2", "stalledrerun", flags, prog);
  });
}

namespace {

std::string trainBin() { return buildDir() + "/examples/train"; }

// A ddprun-rendezvous on a fixed port, so it can be killed and started again at the same place.
std::unique_ptr<Process> daemonAt(int port) {
  auto p = std::make_unique<Process>(
      std::vector<std::string>{buildDir() + "/rendezvous/ddprun-rendezvous", "--listen",
                               "127.0.0.1:" + std::to_string(port)});
  REQUIRE(waitUntil([&] { return p->out().find("listening on") != std::string::npos; }));
  return p;
}

// Kills the rendezvous daemon mid-job and starts a fresh one (no state) on the same port 2 s
// later; every node must re-form with all the others and finish the whole job.
void surviveServerRestart(const std::vector<std::string>& addrs,
                          const std::vector<std::string>& prog, const std::string& run_id,
                          const std::string& progress, const std::string& last_epoch) {
  const int port = freePort();
  auto daemon = daemonAt(port);
  const std::string ep = "127.0.0.1:" + std::to_string(port);
  // No restart budget: the restart must be charged to nobody.
  const std::vector<std::string> flags = {"--nproc-per-node=1", "--max-restarts=0",
                                          "--rdzv-conf=last_call_timeout=1"};
  const std::string nnodes = std::to_string(addrs.size());
  std::vector<std::unique_ptr<Process>> nodes;
  for (const auto& addr : addrs) nodes.push_back(agent(addr, ep, nnodes, run_id, flags, prog));
  auto allOut = [&] {
    std::string all;
    for (auto& n : nodes) all += n->out();
    return all;
  };
  REQUIRE(waitUntil([&] { return allOut().find(progress) != std::string::npos; }, 180s));
  daemon->signal(SIGKILL);
  REQUIRE(daemon->wait(10s));
  std::this_thread::sleep_for(2s);  // the outage itself, not a wait for an event
  daemon = daemonAt(port);
  for (auto& n : nodes) {
    auto r = n->wait(300s);
    REQUIRE(r);
    INFO(r->out << r->err);
    CHECK(r->exit_code == 0);
    // Every node's worker ran to the end: none left early taking a stop for success.
    CHECK(r->out.find(last_epoch) != std::string::npos);
  }
}

}  // namespace

TEST_CASE("after the rendezvous server restarts, every node of a train job re-forms and finishes",
          "[multinode][restart]") {
  TempDir work;
  // 0.15 s a step (--step-delay), so the restart lands mid-training.
  const std::vector<std::string> prog = {"--no-python",
                                         trainBin(),
                                         "40",
                                         "1",
                                         "--step-delay",
                                         "0.15",
                                         "--dataset-size",
                                         "192",
                                         "--snapshot-path",
                                         work / "snap.pt"};
  surviveServerRestart({"127.0.0.2", "127.0.0.3", "127.0.0.4"}, prog, "srvrestart", "] Epoch 5 |",
                       "] Epoch 39 |");
}

TEST_CASE("a rendezvous server that restarts after the job re-formed once has every node re-form",
          "[multinode][restart]") {
  // The new server numbers rounds from 1 again, below the rounds the nodes heard of.
  const int port = freePort();
  auto daemon = daemonAt(port);
  const std::string ep = "127.0.0.1:" + std::to_string(port);
  TempDir flags_dir;
  const std::vector<std::string> flags = {"--nproc-per-node=1", "--max-restarts=1",
                                          "--rdzv-conf=last_call_timeout=1"};
  // Each worker fails in its first attempt (round 2 forms), then runs until the flag exists.
  const std::vector<std::string> prog = {
      "--no-python", "/bin/sh", "-c",
      "[ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ] && exit 1; while [ ! -e '" + flags_dir / "go" +
          "' ]; do sleep 0.05; done; echo done"};
  auto a = agent("127.0.0.2", ep, "2", "srvrestart2", flags, prog);
  auto b = agent("127.0.0.3", ep, "2", "srvrestart2", flags, prog);
  auto started = [&] { return countOf(a->err() + b->err(), "started 1 worker(s)"); };
  REQUIRE(waitUntil([&] { return started() == 4; }, 60s));
  daemon->signal(SIGKILL);
  REQUIRE(daemon->wait(10s));
  std::this_thread::sleep_for(2s);  // the outage itself, not a wait for an event
  daemon = daemonAt(port);
  const bool reformed = waitUntil([&] { return started() == 6; }, 60s);
  INFO(a->err() << b->err());
  REQUIRE(reformed);
  std::ofstream(flags_dir / "go") << "";
  auto [ra, rb] = bothSucceed(*a, *b, 60s);
  CHECK(countOf(ra.out + rb.out, "done") == 2);
  CHECK((ra.err + rb.err).find("it lost its rounds") != std::string::npos);
}

TEST_CASE("after the rendezvous server restarts, a PyTorch job re-forms and finishes",
          "[multinode][restart][pytorch]") {
  if (!torchAvailable()) {
    WARN("skipped: no torch at " + torchPython());
    return;
  }
  TempDir work;
  const std::vector<std::string> prog = {sourceDir() + "/examples/pytorch/ddp_tutorial.py",
                                         "12",
                                         "1",
                                         "--snapshot_path",
                                         work / "snapshot.pt",
                                         "--step_delay",
                                         "0.01"};
  surviveServerRestart({"127.0.0.2", "127.0.0.3"}, prog, "srvrestart-py", "] Epoch 2 |",
                       "] Epoch 11 |");
}

TEST_CASE("a worker's checkpoint stop is no job success, every node re-forms",
          "[multinode][restart]") {
  RendezvousDaemon rdzv;
  TempDir work;
  const std::vector<std::string> prog = {
      "--no-python",     trainBin(),      "30", "1", "--step-delay", "0.1", "--dataset-size", "192",
      "--snapshot-path", work / "snap.pt"};
  const std::vector<std::string> flags = {"--nproc-per-node=1", "--max-restarts=0",
                                          "--rdzv-conf=last_call_timeout=1"};
  auto a = agent("127.0.0.2", rdzv.endpoint, "2", "peerstop", flags, prog);
  auto b = agent("127.0.0.3", rdzv.endpoint, "2", "peerstop", flags, prog);
  REQUIRE(waitUntil([&] { return (a->out() + b->out()).find("] Epoch 3 |") != std::string::npos; },
                    180s));
  // SIGTERM straight to b's worker, not through its agent: the SDK stops every rank at the same
  // step, and every worker exits 0 although training is not over.
  auto workers = workerPids(b->pid());
  REQUIRE(workers.size() == 1);
  ::kill(workers[0], SIGTERM);
  auto [ra, rb] = bothSucceed(*a, *b);
  for (const auto* r : {&ra, &rb}) {
    INFO(r->out << r->err);
    CHECK(r->out.find("] Epoch 29 |") != std::string::npos);  // ran to the end
    CHECK(r->err.find("stopped because a rank on another node was asked to checkpoint") !=
          std::string::npos);
    CHECK(r->out.find("Resuming training from snapshot at Epoch") != std::string::npos);
  }
}

TEST_CASE("ddprun-rendezvous refuses bad listen addresses, tokens and TLS files with exit 2",
          "[multinode][hardening]") {
  TempDir dir;
  const std::string bin = buildDir() + "/rendezvous/ddprun-rendezvous";
  auto refused = [&](std::vector<std::string> args, const std::string& says) {
    args.insert(args.begin(), bin);
    auto r = run(args, {}, 20s);  // never hangs: a FIFO or a device is refused, not read
    INFO(args.back() << ": " << r.err);
    CHECK(r.exit_code == 2);
    CHECK(r.err.find(says) != std::string::npos);
    CHECK(countOf(r.err, "\n") == 1);  // one line
  };
  refused({"--listen", "[::1"}, "is not HOST:PORT (an IPv6 address goes in brackets");
  refused({"--listen", "::1:5"}, "is not HOST:PORT");
  refused({"--listen", "127.0.0.1:99999"}, "has no valid port");

  const std::string control = dir / "control";
  std::ofstream(control) << "abc\x01"
                            "def\n";
  refused({"--listen", "127.0.0.1:0", "--token-file", control},
          "the token must be printable ASCII without spaces; byte 3 is 0x01");
  const std::string utf8 = dir / "utf8";
  std::ofstream(utf8) << "t\xc3\xa9st\n";
  refused({"--listen", "127.0.0.1:0", "--token-file", utf8}, "byte 1 is 0xc3");
  refused({"--listen", "127.0.0.1:0", "--token-file", "/dev/zero"}, "is not a regular file");
  const std::string fifo = dir / "fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  refused({"--listen", "127.0.0.1:0", "--token-file", fifo}, "is not a regular file");
  const std::string huge = dir / "huge";
  std::ofstream(huge) << std::string(100000, 'x');
  refused({"--listen", "127.0.0.1:0", "--token-file", huge}, "is larger than 65536 bytes");

  const std::string junk = dir / "junk.pem";
  std::ofstream(junk) << "not a certificate\n";
  refused({"--listen", "127.0.0.1:0", "--tls-cert", junk, "--tls-key", junk},
          "--tls-cert: '" + junk + "' is not a PEM certificate");

  TempDir a_dir, b_dir;
  TestPki a(a_dir), b(b_dir);
  if (!a.ok || !b.ok) {
    WARN("TLS pair case skipped: " + (a.ok ? b.why : a.why));
    return;
  }
  // Two valid PEM files that do not belong together: a TLS problem, not an address problem.
  refused({"--listen", "127.0.0.1:0", "--tls-cert", a.cert, "--tls-key", b.key},
          "the TLS certificate and key cannot be used");
}

TEST_CASE("two jobs that share one --rdzv-id are told so, not left to hang", "[multinode]") {
  // Their nodes formed one round and started each other's programs, which waited in their
  // collectives until gloo's 300 s store timeout.
  RendezvousDaemon rdzv;
  auto a = agent("127.0.0.2", rdzv.endpoint, "2", "shared-id", {"--rdzv-conf=last_call_timeout=1"},
                 {"--no-python", "/bin/sleep", "60"});
  auto b = agent("127.0.0.3", rdzv.endpoint, "2", "shared-id", {"--rdzv-conf=last_call_timeout=1"},
                 {"--no-python", "/bin/true"});
  auto ra = a->wait(60s);
  auto rb = b->wait(60s);
  REQUIRE(ra);
  REQUIRE(rb);
  INFO(ra->err << "\n" << rb->err);
  CHECK(ra->exit_code == 1);
  CHECK(rb->exit_code == 1);
  CHECK(ra->err.find("another job uses --rdzv-id 'shared-id': node ") != std::string::npos);
  CHECK(ra->err.find("(127.0.0.3) runs '/bin/true', this node runs '/bin/sleep'; give each job an "
                     "id of its own") != std::string::npos);
  CHECK(rb->err.find("(127.0.0.2) runs '/bin/sleep', this node runs '/bin/true'") !=
        std::string::npos);
  CHECK(ra->err.find("started 1 worker(s)") == std::string::npos);  // nothing of the other ran
}
