// PyTorch's own launcher tests (test/distributed/launcher/test_run.py and launch_test.py), their
// flags and expectations, run against ddprun with small equivalents of PyTorch's bin/ programs
// (tests/launcher/pytorch_launcher_bin/). The Python is /usr/bin/python3 (torch 1.13) through
// PYTHON_EXEC; the cases whose program imports torch skip without it.
#include <catch2/catch.hpp>
#include <csignal>
#include <fstream>
#include <set>

#include "ddprun/common/strings.h"
#include "process_helpers.h"

using namespace ddprun;
using namespace ddprun::testing;
using namespace std::chrono_literals;

namespace {

std::string bin(const std::string& name) {
  return sourceDir() + "/tests/launcher/pytorch_launcher_bin/" + name;
}

std::map<std::string, std::string> pythonEnv() { return {{"PYTHON_EXEC", torchPython()}}; }

Finished runDdprun(std::vector<std::string> args,
                   std::map<std::string, std::string> env = pythonEnv()) {
  args.insert(args.begin(), ddprunBin());
  return run(args, env, 180s);
}

// The names of the files in `dir`: test_script.py touches one per global rank.
std::set<std::string> filesIn(const std::string& dir) {
  std::set<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      if (e->d_name[0] != '.') out.insert(e->d_name);
    }
    ::closedir(d);
  }
  return out;
}

std::set<std::string> ranks(int n) {
  std::set<std::string> out;
  for (int i = 0; i < n; ++i) out.insert(std::to_string(i));
  return out;
}

std::string endpoint() { return "localhost:" + std::to_string(freePort()); }

#define REQUIRE_TORCH()                            \
  if (!torchAvailable()) {                         \
    WARN("skipped: no torch at " + torchPython()); \
    return;                                        \
  }

}  // namespace

TEST_CASE("test_run: a Python script runs on every rank over the c10d rendezvous",
          "[e2e][pytorch_launcher]") {
  TempDir touched;
  auto r = runDdprun({"--nnodes=1", "--nproc-per-node=4", "--rdzv-backend=c10d",
                      "--rdzv-endpoint=" + endpoint(), "--rdzv-id=test_run_python",
                      "--monitor-interval=1", "--start-method=spawn", bin("test_script.py"),
                      "--touch-file-dir=" + touched.path()});
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  CHECK(filesIn(touched.path()) == ranks(4));
}

TEST_CASE("test_run: every flag from PET_ variables", "[e2e][pytorch_launcher]") {
  TempDir touched;
  auto env = pythonEnv();
  env["PET_NNODES"] = "1";
  env["PET_NPROC_PER_NODE"] = "4";
  env["PET_RDZV_BACKEND"] = "c10d";
  env["PET_RDZV_ENDPOINT"] = endpoint();
  env["PET_RDZV_ID"] = "test_run_env";
  env["PET_MONITOR_INTERVAL"] = "1";
  env["PET_START_METHOD"] = "spawn";
  env["PET_NO_PYTHON"] = "0";
  auto r = runDdprun({bin("test_script.py"), "--touch-file-dir=" + touched.path()}, env);
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  CHECK(filesIn(touched.path()) == ranks(4));
}

TEST_CASE("test_run: --standalone", "[e2e][pytorch_launcher]") {
  TempDir touched;
  auto r = runDdprun({"--standalone", "--nproc-per-node=4", "--monitor-interval=1",
                      "--start-method=spawn", bin("test_script.py"),
                      "--touch-file-dir=" + touched.path()});
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  CHECK(filesIn(touched.path()) == ranks(4));
}

TEST_CASE("test_run: --run-path and --run_path run the script under the interpreter",
          "[e2e][pytorch_launcher]") {
  for (const char* flag : {"--run-path", "--run_path"}) {
    TempDir touched;
    // (--master-port: a free one, so that parallel tests do not meet on 29500.)
    auto r = runDdprun({flag, "--nnodes=1", "--nproc-per-node=4", "--monitor-interval=1",
                        "--start-method=spawn", "--master-port=" + std::to_string(freePort()),
                        bin("test_script.py"), "--touch-file-dir=" + touched.path()});
    INFO(flag << "\n" << r.out << r.err);
    CHECK(r.exit_code == 0);
    CHECK(filesIn(touched.path()) == ranks(4));
  }
}

TEST_CASE("test_run: the quoted --rdzv_conf of an elastic job is understood",
          "[e2e][pytorch_launcher]") {
  TempDir touched;
  // As test_run.py passes it: the quotes are inside the argument.
  auto ok = runDdprun({"--nnodes=1:2", "--nproc-per-node=2", "--rdzv-backend=c10d",
                       "--rdzv-endpoint=" + endpoint(), "--rdzv-id=elastic",
                       "--rdzv_conf='join_timeout=5,last_call_timeout=1,timeout=5'",
                       "--max-restarts=0", "--monitor-interval=1", bin("test_script.py"),
                       "--touch-file-dir=" + touched.path()});
  INFO(ok.out << ok.err);
  CHECK(ok.exit_code == 0);
  CHECK(filesIn(touched.path()) == ranks(2));
  CHECK(ok.err.find("warning") == std::string::npos);
  // test_launch_elastic_worker_raise_exception: the workers fail, the launcher exits 1.
  auto failed = runDdprun(
      {"--nnodes=1:2", "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=" + endpoint(),
       "--rdzv-id=elastic_fail", "--rdzv_conf='join_timeout=5,last_call_timeout=1,timeout=5'",
       "--max-restarts=0", "--monitor-interval=1", bin("test_script.py"), "--fail"});
  CHECK(failed.exit_code == 1);
  CHECK(failed.err.find("test_script.py FAILED") != std::string::npos);
}

TEST_CASE("unknown --rdzv-conf keys run with one warning naming them", "[e2e][pytorch_launcher]") {
  TempDir touched;
  auto r = runDdprun({"--standalone", "--nproc-per-node=1", "--rdzv-conf=store_type=tcp",
                      bin("test_script.py"), "--touch-file-dir=" + touched.path()});
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  CHECK(countOf(r.err, "store_type") == 1);
  CHECK(r.err.find("ddprun: warning: --rdzv-conf: ddprun's rendezvous does not use store_type") !=
        std::string::npos);
}

TEST_CASE("test_run: is_torchelastic_launched is True under ddprun, False without it",
          "[e2e][pytorch_launcher]") {
  REQUIRE_TORCH();
  TempDir out;
  auto r = runDdprun({"--run-path", "--nnodes=1", "--nproc-per-node=1", "--monitor-interval=1",
                      "--master-port=" + std::to_string(freePort()),
                      bin("test_script_is_torchelastic_launched.py"), "--out-file=" + out / "is"});
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  CHECK(readFile(out / "is") == "True");
  auto direct = run(
      {torchPython(), bin("test_script_is_torchelastic_launched.py"), "--out-file=" + out / "not"});
  CHECK(direct.exit_code == 0);
  CHECK(readFile(out / "not") == "False");
}

TEST_CASE("test_run: init_method env:// and tcp:// with ddprun's RANK and WORLD_SIZE",
          "[e2e][pytorch_launcher]") {
  REQUIRE_TORCH();
  const std::string tcp = "tcp://localhost:" + std::to_string(freePort());
  for (const std::string& init : {std::string("env://"), tcp}) {
    auto r = runDdprun({"--nnodes=1", "--nproc-per-node=4", "--master-addr=localhost",
                        "--master-port=" + std::to_string(freePort()), "--monitor-interval=1",
                        "--start-method=spawn", bin("test_script_init_method.py"),
                        "--init-method=" + init});
    INFO(init << "\n" << r.out << r.err);
    CHECK(r.exit_code == 0);
    for (int rank = 0; rank < 4; ++rank) {
      CHECK(r.out.find("rank " + std::to_string(rank) + ": all_reduce sum 4 OK") !=
            std::string::npos);
    }
  }
}

TEST_CASE("launch_test: without --use-env the script gets --local-rank (ddprun launch)",
          "[e2e][pytorch_launcher]") {
  const std::string port = std::to_string(freePort());
  auto r = runDdprun({"launch", "--nnodes=1", "--nproc-per-node=4", "--monitor-interval=1",
                      "--start-method=spawn", "--master-addr=localhost", "--master-port=" + port,
                      "--node-rank=0", bin("test_script_local_rank.py")});
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  for (int lr = 0; lr < 4; ++lr) {
    CHECK(r.out.find("Finished execution with local_rank: " + std::to_string(lr)) !=
          std::string::npos);
  }
  // The deprecation notice, once, pointing at LOCAL_RANK.
  CHECK(countOf(r.err, "torch.distributed.launch") == 1);
  CHECK(r.err.find("os.environ['LOCAL_RANK']") != std::string::npos);
  // A torch 1.x script declares only --local_rank.
  auto v1 = runDdprun({"launch", "--local-rank-arg=local_rank", "--nproc-per-node=2",
                       "--master-port=" + std::to_string(freePort()),
                       bin("test_script_local_rank.py"), "--spelling=local_rank"});
  INFO(v1.out << v1.err);
  CHECK(v1.exit_code == 0);
  CHECK(v1.out.find("Finished execution with local_rank: 1") != std::string::npos);
  // Plain ddprun passes no argument, so the same script fails as under torchrun.
  auto plain = runDdprun({"--nproc-per-node=1", "--master-port=" + std::to_string(freePort()),
                          bin("test_script_local_rank.py")});
  CHECK(plain.exit_code == 1);
}

TEST_CASE("launch_test: with --use-env the local rank is in LOCAL_RANK only",
          "[e2e][pytorch_launcher]") {
  for (const std::vector<std::string>& head :
       {std::vector<std::string>{"launch", "--use-env"}, std::vector<std::string>{"--use_env"}}) {
    TempDir touched;
    std::vector<std::string> args = head;
    for (const std::string& a :
         {std::string("--nnodes=1"), std::string("--nproc-per-node=4"),
          std::string("--monitor-interval=1"), std::string("--start-method=spawn"),
          std::string("--master-addr=localhost"), "--master-port=" + std::to_string(freePort()),
          std::string("--node-rank=0"), bin("test_script.py"),
          "--touch-file-dir=" + touched.path()}) {
      args.push_back(a);
    }
    auto r = runDdprun(args);
    INFO(join(head, " ") << "\n" << r.out << r.err);
    CHECK(r.exit_code == 0);
    CHECK(filesIn(touched.path()) == ranks(4));
  }
}

TEST_CASE("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE prefixes the tee'd lines",
          "[e2e][pytorch_launcher]") {
  TempDir touched;
  auto env = pythonEnv();
  env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = "[rank${rank}]:";
  auto r = runDdprun({"--standalone", "--nproc-per-node=2", "--tee=3", bin("test_script.py"),
                      "--touch-file-dir=" + touched.path()},
                     env);
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("[rank0]:Distributed env vars set by agent:") != std::string::npos);
  CHECK(r.out.find("[rank1]:Distributed env vars set by agent:") != std::string::npos);
  CHECK(r.out.find("[default0]:") == std::string::npos);
}

TEST_CASE("with --virtual-local-rank every worker sees LOCAL_RANK=0", "[e2e][pytorch_launcher]") {
  TempDir touched;
  auto r = runDdprun({"--standalone", "--nproc-per-node=2", "--virtual-local-rank", "--tee=1",
                      bin("test_script.py"), "--touch-file-dir=" + touched.path()});
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  CHECK(filesIn(touched.path()) == ranks(2));
  CHECK(countOf(r.out, "LOCAL_RANK = 0") == 2);
  CHECK(r.out.find("[default1]:CUDA") == std::string::npos);  // (not printed by the script)
}

TEST_CASE("zombie_test: a failed worker's children do not outlive the job",
          "[e2e][pytorch_launcher]") {
  TempDir pids;
  auto r = runDdprun({"--standalone", "--nproc-per-node=2", "--shutdown-timeout=2",
                      bin("zombie_test.py"), "--pid-dir", pids.path()});
  INFO(r.out << r.err);
  CHECK(r.exit_code == 1);
  REQUIRE(filesIn(pids.path()) == ranks(2));
  for (const char* rank : {"0", "1"}) {
    const int child = std::stoi(readFile(pids / rank));
    INFO("rank " << rank << "'s child " << child);
    CHECK(waitUntil([&] { return !pidAlive(child); }, 10s));
  }
}

TEST_CASE("a worker's ModuleNotFoundError points at PYTHON_EXEC", "[e2e][pytorch_launcher]") {
  TempDir work;
  const std::string script = work / "needs_module.py";
  std::ofstream(script) << "import ddprun_surely_missing_module\n";
  auto r = runDdprun(
      {"--standalone", "--nproc-per-node=1", "--redirects=2", "--log-dir", work / "logs", script});
  INFO(r.err);
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("hint: a worker failed with 'ModuleNotFoundError: No module named "
                   "'ddprun_surely_missing_module'': the workers ran under " +
                   torchPython() + " (PYTHON_EXEC)") != std::string::npos);
  // Without a redirected stderr there is nothing to read: the report still names the interpreter.
  auto plain = runDdprun({"--standalone", "--nproc-per-node=1", script});
  CHECK(plain.exit_code == 1);
  CHECK(plain.err.find("note: the workers ran under " + torchPython() +
                       " (PYTHON_EXEC); set PYTHON_EXEC to run another interpreter") !=
        std::string::npos);
}

TEST_CASE("the static form names MASTER_PORT+1 when it is taken, on both nodes",
          "[e2e][pytorch_launcher]") {
  // Something else listens on MASTER_PORT+1 (the agents' coordination port of the static form).
  int port = 0;
  int holder = -1;
  for (int attempt = 0; attempt < 20 && holder < 0; ++attempt) {
    port = freePort();
    if (port >= 65535) continue;
    holder = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port + 1));
    if (::bind(holder, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::listen(holder, 4) != 0) {
      ::close(holder);
      holder = -1;
    }
  }
  REQUIRE(holder >= 0);
  const std::string taken = "127.0.0.1:" + std::to_string(port + 1);
  const std::string note = "the static backend's agents meet on MASTER_PORT+1 = " + taken +
                           ", which must be free on node 0 and reachable from every node; pick "
                           "another --master-port, or place it with --rdzv-endpoint=HOST:PORT";
  auto node = [&](const char* rank) {
    return runDdprun({"--nnodes=2", std::string("--node-rank=") + rank, "--master-addr=127.0.0.1",
                      "--master-port=" + std::to_string(port), "--rdzv-conf=join_timeout=3",
                      "--no-python", "/bin/true"});
  };
  auto node0 = node("0");
  INFO(node0.err);
  CHECK(node0.exit_code == 1);
  CHECK(node0.err.find("cannot host the rendezvous at " + taken) != std::string::npos);
  CHECK(node0.err.find(note) != std::string::npos);
  // Node 1 says what it waits for, and gives up after the join timeout with the same fix.
  auto node1 = node("1");
  INFO(node1.err);
  CHECK(node1.exit_code == 1);
  CHECK(node1.err.find("waiting up to 3 s (join_timeout) for 2 node(s) to join the rendezvous at " +
                       taken + " (" + note + ")") != std::string::npos);
  CHECK(node1.err.find("rendezvous failed: ") != std::string::npos);
  CHECK(countOf(node1.err, note) == 2);
  ::close(holder);
}

TEST_CASE("the flag --numa-binding=exclusive gives the workers disjoint CPU affinities",
          "[e2e][pytorch_launcher]") {
  TempDir touched;
  auto r = runDdprun({"--standalone", "--nproc-per-node=2", "--numa-binding=exclusive", "--tee=1",
                      bin("test_script.py"), "--touch-file-dir=" + touched.path()});
  INFO(r.out << r.err);
  if (r.exit_code == 2 && r.err.find("cores for 2 local ranks") != std::string::npos) {
    WARN("skipped: this machine has fewer than 2 cores on its first NUMA node");
    return;
  }
  REQUIRE(r.exit_code == 0);
  auto affinity = [&](const std::string& prefix) {
    auto at = r.out.find(prefix + "CPU affinity = [");
    REQUIRE(at != std::string::npos);
    at += prefix.size() + 16;
    return r.out.substr(at, r.out.find(']', at) - at);
  };
  const std::string a = affinity("[default0]:"), b = affinity("[default1]:");
  CHECK_FALSE(a.empty());
  CHECK_FALSE(b.empty());
  std::set<std::string> seen;
  for (const auto& cpu : split(a, ',')) seen.insert(trim(cpu));
  for (const auto& cpu : split(b, ',')) CHECK(seen.count(trim(cpu)) == 0);
  // An unknown policy is a usage error before anything starts.
  auto bad = runDdprun({"--numa-binding=cores", bin("test_script.py")});
  CHECK(bad.exit_code == 2);
  CHECK(bad.err ==
        "ddprun: error: argument --numa-binding: expected node, socket, exclusive or "
        "core-complex, got 'cores'\n");
}
