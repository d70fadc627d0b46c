// End-to-end: the real ddprun binary, real worker processes (tests/agent/test_worker.cc), real
// signals, and real PyTorch workers and torchrun from python3-torch.
#include <algorithm>
#include <catch2/catch.hpp>
#include <csignal>
#include <fstream>
#include <random>
#include <regex>
#include <set>

#include "ddprun/common/strings.h"
#include "process_helpers.h"

using namespace ddprun;
using namespace ddprun::testing;
using namespace std::chrono_literals;

namespace {

std::vector<std::string> ddprunArgv(std::vector<std::string> flags) {
  flags.insert(flags.begin(), ddprunBin());
  return flags;
}

std::vector<std::string> withWorker(std::vector<std::string> flags,
                                    const std::vector<std::string>& worker_args) {
  auto argv = ddprunArgv(std::move(flags));
  argv.push_back("--no-python");
  argv.push_back(testWorkerBin());
  argv.insert(argv.end(), worker_args.begin(), worker_args.end());
  return argv;
}

std::string trainBin() { return buildDir() + "/examples/train"; }

// The run directory ddprun made under --log-dir (<run_id>_<random>); empty until it exists.
std::string runDir(const std::string& log_dir) {
  std::string found;
  if (DIR* dir = ::opendir(log_dir.c_str())) {
    while (dirent* e = ::readdir(dir)) {
      if (e->d_name[0] != '.') found = log_dir + "/" + e->d_name;
    }
    ::closedir(dir);
  }
  return found;
}

std::map<std::string, std::string> torchEnv() { return {{"PYTHON_EXEC", torchPython()}}; }

// A value no other test's processes carry: ddprun gets DDPRUN_TEST_MARKER=<it> in its
// environment, and so every process the workers start inherits it.
std::string newMarker() {
  std::random_device rd;
  return std::to_string(rd()) + std::to_string(rd());
}

// Live processes whose environment holds DDPRUN_TEST_MARKER=<marker>.
std::vector<int> markedPids(const std::string& marker) {
  const std::string entry = "DDPRUN_TEST_MARKER=" + marker;
  std::vector<int> out;
  DIR* dir = ::opendir("/proc");
  if (dir == nullptr) return out;
  while (dirent* e = ::readdir(dir)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    const int pid = std::atoi(e->d_name);
    const std::string env = readFile(std::string("/proc/") + e->d_name + "/environ");
    for (size_t start = 0; start < env.size();) {
      size_t end = env.find('\0', start);
      if (end == std::string::npos) end = env.size();
      if (env.compare(start, end - start, entry) == 0) {
        if (pidAlive(pid)) out.push_back(pid);
        break;
      }
      start = end + 1;
    }
  }
  ::closedir(dir);
  return out;
}

// Waits (bounded) until no process carries `marker`; otherwise lists those that still do.
std::string survivors(const std::string& marker) {
  std::vector<int> left;
  if (waitUntil([&] { return (left = markedPids(marker)).empty(); }, 10s)) return "";
  std::string out;
  for (int pid : left) {
    std::string cmd = readFile("/proc/" + std::to_string(pid) + "/cmdline");
    std::replace(cmd.begin(), cmd.end(), '\0', ' ');
    out += std::to_string(pid) + ": " + cmd + "\n";
  }
  return out;
}

// ddprun running one worker: `/bin/sh -c <script>`.
std::vector<std::string> shellWorker(const std::string& script) {
  return ddprunArgv({"--nproc-per-node=1", "--no-python", "/bin/sh", "-c", script});
}

// Compares the environments workers saw under ddprun and torchrun for the same flags.
void compareWithTorchrun(const std::vector<std::string>& flags,
                         const std::set<std::string>& differing_values) {
  TempDir ours, theirs;
  auto a = run(withWorker(flags, {"--env-out", ours.path()}));
  REQUIRE(a.exit_code == 0);
  std::vector<std::string> ref = {torchPython(), "-m",  "torch.distributed.run", "-r", "9:1",
                                  "-t",          "9:1", "--monitor_interval=0.1"};
  ref.insert(ref.end(), flags.begin(), flags.end());
  ref.insert(ref.end(), {"--no_python", testWorkerBin(), "--env-out", theirs.path()});
  auto b = run(ref);
  INFO(b.err);
  REQUIRE(b.exit_code == 0);
  // Ours only: extras SPEC §3 adds, and what one torchrun generation sets and the other does not:
  // for a program that is not Python (this one) ddprun cannot tell the workers' torch, and names
  // NCCL's switch both ways (torch 1.13 reads NCCL_, 2.x TORCH_NCCL_), and it names the handled
  // signals as torchrun 2.x does. Either side: what the shell or Python put there.
  const std::set<std::string> ours_only = {
      "DDPRUN_MEMBERSHIP_EPOCH",         "DDPRUN_ROUND",
      "DDPRUN_HEARTBEAT_FILE",           "DDPRUN_STOP_FILE",
      "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING",
      "TORCHELASTIC_SIGNALS_TO_HANDLE"};
  const std::set<std::string> ignored = {"_"};
  for (const char* rank : {"0", "1"}) {
    auto e1 = parseEnvFile(readFile(ours / (std::string("env.") + rank)));
    auto e2 = parseEnvFile(readFile(theirs / (std::string("env.") + rank)));
    REQUIRE(e1.count("RANK"));
    REQUIRE(e2.count("RANK"));
    for (const auto& [k, v] : e2) {
      if (ignored.count(k)) continue;
      INFO("rank " << rank << ": torchrun sets " << k << "=" << v);
      REQUIRE(e1.count(k));
      if (!differing_values.count(k)) CHECK(e1.at(k) == v);
    }
    for (const auto& [k, v] : e1) {
      if (ignored.count(k) || ours_only.count(k)) continue;
      INFO("rank " << rank << ": only ddprun sets " << k << "=" << v);
      CHECK(e2.count(k));
    }
  }
}

}  // namespace

TEST_CASE("workers see the same environment under ddprun --standalone as under torchrun",
          "[e2e][torchrun]") {
  if (!torchAvailable()) {
    WARN("skipped: no torch at " + torchPython());
    return;
  }
  // SPEC §3: worker rank 0 hosts the store; torchrun 2.x's c10d agent shares its own (True).
  compareWithTorchrun({"--standalone", "--nproc_per_node=2"},
                      {"TORCHELASTIC_RUN_ID", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE",
                       "TORCHELASTIC_USE_AGENT_STORE"});
}

TEST_CASE("workers see the same environment under the static backend as under torchrun",
          "[e2e][torchrun]") {
  if (!torchAvailable()) {
    WARN("skipped: no torch at " + torchPython());
    return;
  }
  // SPEC §3: worker rank 0 always hosts the store, so USE_AGENT_STORE is False where torchrun's
  // static agent says True.
  compareWithTorchrun({"--nnodes=1", "--nproc_per_node=2", "--max_restarts=2", "--role=trainer",
                       "--master_port=29517"},
                      {"TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE"});
}

TEST_CASE("a failed worker restarts the whole group with TORCHELASTIC_RESTART_COUNT+1", "[e2e]") {
  TempDir state, envs;
  auto r = run(withWorker(
      {"--standalone", "--nproc-per-node=2", "--max-restarts=2"},
      {"--exit-code", "3", "--only-rank", "1", "--fail-until-restart", "1", "--state-dir",
       state.path(), "--env-out", envs.path(), "--wait-for", state / "pid.0.0"}));
  INFO(r.err);
  CHECK(r.exit_code == 0);
  // Both ranks ran in attempt 0 and attempt 1, and only there.
  for (const char* f : {"pid.0.0", "pid.1.0", "pid.0.1", "pid.1.1"}) CHECK(fileExists(state / f));
  CHECK_FALSE(fileExists(state / "pid.0.2"));
  CHECK(parseEnvFile(readFile(envs / "env.0"))["TORCHELASTIC_RESTART_COUNT"] == "1");
  CHECK(parseEnvFile(readFile(envs / "env.0"))["TORCHELASTIC_MAX_RESTARTS"] == "2");
}

TEST_CASE(
    "in-place mode with a program that does not speak the control channel says so once and "
    "restarts the processes",
    "[e2e][inplace]") {
  // With one worker the failed one is all there is: its replacement would not speak it either.
  const int nproc = GENERATE(2, 1);
  INFO("--nproc-per-node=" << nproc);
  TempDir state, envs;
  auto r = run(withWorker(
      {"--standalone", "--nproc-per-node=" + std::to_string(nproc), "--max-restarts=2",
       "--restart-mode=in-place"},
      // The last rank fails at once in attempts 0 and 1 while rank 0 runs (a
      // second).
      {"--exit-code", "3", "--only-rank", std::to_string(nproc - 1), "--fail-until-restart", "2",
       "--fail-fast", "--sleep", "1", "--state-dir", state.path(), "--env-out", envs.path()}));
  INFO(r.err);
  CHECK(r.exit_code == 0);
  CHECK(r.err.find("in-place recovery failed") == std::string::npos);  // none was tried
  const std::string line =
      "did not announce in-place support on DDPRUN_CONTROL_SOCKET (not a worker SDK Trainer); "
      "this job recovers by restarting processes";
  const auto first = r.err.find(line);
  CHECK(first != std::string::npos);
  CHECK(r.err.find(line, first + 1) == std::string::npos);  // once, over two failures
  for (int rank = 0; rank < nproc; ++rank) {
    for (int attempt = 0; attempt < 3; ++attempt) {
      CHECK(fileExists(state / ("pid." + std::to_string(rank) + "." + std::to_string(attempt))));
    }
  }
  const auto env = parseEnvFile(readFile(envs / "env.0"));
  CHECK(env.count("DDPRUN_CONTROL_SOCKET") == 1);
  CHECK(env.at("TORCHELASTIC_RESTART_COUNT") == "2");
}

TEST_CASE("workers failing past the budget end with exit 1 and torchrun's failure report",
          "[e2e]") {
  TempDir logs;
  auto r = run(withWorker(
      {"--nproc-per-node=2", "--max-restarts=1", "--log-dir", logs.path()},
      {"--exit-code", "7", "--only-rank", "1", "--write-error-file", "ValueError: bad batch"}));
  INFO(r.err);
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("ddprun_test_worker FAILED") != std::string::npos);
  auto root = r.err.find("Root Cause (first observed failure):");
  REQUIRE(root != std::string::npos);
  CHECK(r.err.find("rank      : 1 (local_rank: 1)", root) != std::string::npos);
  CHECK(r.err.find("exitcode  : 7", root) != std::string::npos);
  CHECK(r.err.find("ValueError: bad batch", root) != std::string::npos);
  CHECK(r.err.find("/attempt_1/1/error.json", root) != std::string::npos);  // the last attempt
}

TEST_CASE("a worker killed by a signal is reported with the signal's name", "[e2e]") {
  TempDir state;
  Process p(withWorker({"--nproc-per-node=1"}, {"--sleep", "60", "--state-dir", state.path()}));
  REQUIRE(waitUntil([&] { return fileExists(state / "pid.0.0"); }));
  const int worker = std::stoi(readFile(state / "pid.0.0"));
  ::kill(worker, SIGKILL);
  auto r = p.wait();
  REQUIRE(r);
  CHECK(r->exit_code == 1);
  CHECK(r->err.find("exitcode  : -9 (pid: " + std::to_string(worker) + ")") != std::string::npos);
  CHECK(r->err.find("Signal 9 (SIGKILL) received by PID " + std::to_string(worker)) !=
        std::string::npos);
}

TEST_CASE("a worker ignoring SIGTERM is killed after --shutdown-timeout", "[e2e]") {
  TempDir state;
  // Rank 0 fails at once; rank 1 ignores the SIGTERM that stops the group.
  Process p(
      withWorker({"--nproc-per-node=2", "--shutdown-timeout=1"},
                 {"--exit-code", "1", "--only-rank", "0", "--fail-fast", "--ignore-sigterm",
                  "--sleep", "600", "--state-dir", state.path(), "--wait-for", state / "pid.1.0"}));
  auto r = p.wait(60s);
  REQUIRE(r);
  CHECK(r->exit_code == 1);
  CHECK(r->err.find("did not stop within the shutdown timeout; sending SIGKILL") !=
        std::string::npos);
  const int survivor = std::stoi(readFile(state / "pid.1.0"));
  CHECK(waitUntil([&] { return !pidAlive(survivor); }, 10s));
}

TEST_CASE("SIGTERM to ddprun is forwarded to every worker and ends it with 143", "[e2e]") {
  TempDir state;
  Process p(withWorker({"--nproc-per-node=2", "--max-restarts=3"},
                       {"--sleep", "600", "--on-signal-exit", "5", "--state-dir", state.path()}));
  REQUIRE(
      waitUntil([&] { return fileExists(state / "pid.0.0") && fileExists(state / "pid.1.0"); }));
  p.signal(SIGTERM);
  auto r = p.wait(60s);
  REQUIRE(r);
  CHECK(r->exit_code == 128 + SIGTERM);
  CHECK(fileExists(state / ("sig.0." + std::to_string(SIGTERM))));
  CHECK(fileExists(state / ("sig.1." + std::to_string(SIGTERM))));
  CHECK_FALSE(fileExists(state / "pid.0.1"));  // a signal is not a failure: no restart
}

TEST_CASE("SIGINT ends ddprun with 130", "[e2e]") {
  TempDir state;
  Process p(withWorker({"--nproc-per-node=1"},
                       {"--sleep", "600", "--on-signal-exit", "0", "--state-dir", state.path()}));
  REQUIRE(waitUntil([&] { return fileExists(state / "pid.0.0"); }));
  p.signal(SIGINT);
  auto r = p.wait(60s);
  REQUIRE(r);
  CHECK(r->exit_code == 128 + SIGINT);
  CHECK(fileExists(state / ("sig.0." + std::to_string(SIGINT))));
}

TEST_CASE("a handled non-terminating signal is forwarded and a clean exit is success", "[e2e]") {
  TempDir state;
  Process p(withWorker({"--nproc-per-node=2", "--signals-to-handle=SIGTERM,SIGUSR1"},
                       {"--sleep", "600", "--on-signal-exit", "0", "--state-dir", state.path()}));
  REQUIRE(
      waitUntil([&] { return fileExists(state / "pid.0.0") && fileExists(state / "pid.1.0"); }));
  p.signal(SIGUSR1);
  auto r = p.wait(60s);
  REQUIRE(r);
  CHECK(r->exit_code == 0);
  CHECK(fileExists(state / ("sig.0." + std::to_string(SIGUSR1))));
  CHECK(fileExists(state / ("sig.1." + std::to_string(SIGUSR1))));
}

TEST_CASE("kill -9 of ddprun leaves no worker alive", "[e2e]") {
  TempDir state;
  Process p(withWorker({"--nproc-per-node=2"}, {"--sleep", "600", "--state-dir", state.path()}));
  REQUIRE(
      waitUntil([&] { return fileExists(state / "pid.0.0") && fileExists(state / "pid.1.0"); }));
  const int w0 = std::stoi(readFile(state / "pid.0.0"));
  const int w1 = std::stoi(readFile(state / "pid.1.0"));
  REQUIRE(pidAlive(w0));
  p.signal(SIGKILL);
  REQUIRE(p.wait(10s));
  CHECK(waitUntil([&] { return !pidAlive(w0) && !pidAlive(w1); }, 10s));
}

TEST_CASE("kill -9 of ddprun leaves no process a worker started alive", "[e2e]") {
  TempDir state;
  const std::string marker = newMarker();
  // A shell worker with a background child and a wrapped Python: neither is the agent's child.
  Process p(shellWorker("sleep 300 & " + torchPython() +
                        " -c 'import time; time.sleep(300)' & echo ready > " + state / "ready" +
                        "; wait"),
            {{"DDPRUN_TEST_MARKER", marker}});
  REQUIRE(waitUntil([&] { return fileExists(state / "ready"); }));
  // ddprun, sh, sleep, python at least (a background job may still be forking after "ready")
  REQUIRE(waitUntil([&] { return markedPids(marker).size() >= 4; }, 10s));
  p.signal(SIGKILL);
  REQUIRE(p.wait(10s));
  CHECK(survivors(marker) == "");
}

TEST_CASE("kill -9 of ddprun also ends a worker's descendant in a new session", "[e2e]") {
  TempDir state;
  const std::string marker = newMarker();
  // One setsid'd child of the worker, and one setsid'd and orphaned at once (a daemon).
  Process p(shellWorker("setsid sleep 300 & (setsid sleep 300 &); echo ready > " + state / "ready" +
                        "; wait"),
            {{"DDPRUN_TEST_MARKER", marker}});
  REQUIRE(waitUntil([&] { return fileExists(state / "ready"); }));
  // ddprun, sh, two sleeps at least (the orphaned one's subshell may still be forking)
  REQUIRE(waitUntil([&] { return markedPids(marker).size() >= 4; }, 10s));
  p.signal(SIGKILL);
  REQUIRE(p.wait(10s));
  CHECK(survivors(marker) == "");
}

TEST_CASE("a worker's background process does not outlive the worker's success", "[e2e]") {
  TempDir state;
  const std::string marker = newMarker();
  auto r = run(shellWorker("setsid sleep 300 & echo $! > " + state / "bg" + "; exit 0"),
               {{"DDPRUN_TEST_MARKER", marker}});
  INFO(r.err);
  CHECK(r.exit_code == 0);
  REQUIRE(fileExists(state / "bg"));
  CHECK(survivors(marker) == "");
}

TEST_CASE("a shell worker's exit code and fatal signal reach the failure report", "[e2e]") {
  TempDir state;
  auto code = run(shellWorker("echo $$ > " + state / "pid" + "; sleep 300 & exit 3"));
  INFO(code.err);
  CHECK(code.exit_code == 1);
  CHECK(code.err.find("exitcode  : 3 (pid: " + trim(readFile(state / "pid")) + ")") !=
        std::string::npos);

  auto sig = run(shellWorker("ulimit -c 0; echo $$ > " + state / "pid" + "; kill -SEGV $$"));
  INFO(sig.err);
  CHECK(sig.exit_code == 1);
  const std::string pid = trim(readFile(state / "pid"));
  CHECK(sig.err.find("exitcode  : -11 (pid: " + pid + ")") != std::string::npos);
  CHECK(sig.err.find("Signal 11 (SIGSEGV) received by PID " + pid) != std::string::npos);
}

TEST_CASE("a worker whose exec fails is reported with the reason at once", "[e2e]") {
  TempDir dir;
  const std::string prog = dir / "bad_interpreter";
  run({"/bin/sh", "-c", "printf '#!/nonexistent/interpreter\\n' > " + prog + "; chmod +x " + prog});
  auto r = run(ddprunArgv({"--nproc-per-node=1", "--no-python", prog}));
  INFO(r.err);
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("cannot execute " + prog + ": No such file or directory") != std::string::npos);
  CHECK(r.err.find("exitcode  : 127") != std::string::npos);
}

TEST_CASE(
    "workers and their guardians hold none of the agent's descriptors, only what ddprun was "
    "started with",
    "[e2e]") {
  // Each worker prints its own descriptors and its guardian's (its parent's), as NUMBER=TARGET.
  // A line each, written at once (the agent tees them, whole, with the rank's prefix).
  const std::string worker =
      "for p in $$ $PPID; do l=\"$p:\"; for f in /proc/$p/fd/*; do "
      "l=\"$l ${f##*/}=$(readlink \"$f\")\"; done; echo \"$l\"; done";
  // fd 7 without FD_CLOEXEC, as a batch system or a wrapper may hand one to the job.
  auto r = run({"/bin/sh", "-c", "exec 7</dev/null; exec \"$0\" \"$@\"", ddprunBin(),
                "--nproc-per-node=6", "--tee=1", "--no-python", "/bin/sh", "-c", worker});
  INFO(r.out << r.err);
  REQUIRE(r.exit_code == 0);
  int lines = 0;
  for (const auto& line : split(r.out, '\n')) {
    if (line.find(':') == std::string::npos || line.find(" 0=") == std::string::npos) continue;
    ++lines;
    INFO(line);
    CHECK(line.find("socket:") == std::string::npos);  // the agent's servers and its clients
    CHECK(line.find(" 7=/dev/null") != std::string::npos);
    // Nothing of the agent's per-worker pipes and files: a handful, however many workers.
    CHECK(countOf(line, "=") <= 16);
  }
  CHECK(lines == 12);
}

TEST_CASE("redirects write each rank's streams into the torchrun log layout", "[e2e]") {
  TempDir logs;
  auto r = run(withWorker(
      {"--nproc-per-node=2", "--rdzv-id=job42", "--log-dir", logs.path(), "--redirects=3"},
      {"--print", "to-out", "--eprint", "to-err"}));
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("to-out") == std::string::npos);  // redirected, not tee'd
  auto runs = run({"/bin/sh", "-c", "ls -d " + logs.path() + "/job42_*"});
  const std::string run_dir = trim(runs.out);
  REQUIRE_FALSE(run_dir.empty());
  for (const char* rank : {"0", "1"}) {
    const std::string dir = run_dir + "/attempt_0/" + rank;
    CHECK(readFile(dir + "/stdout.log") == "to-out\n");
    CHECK(readFile(dir + "/stderr.log") == "to-err\n");
  }
}

TEST_CASE("tee prefixes console lines per rank and --local-ranks-filter selects ranks", "[e2e]") {
  TempDir logs;
  auto r = run(withWorker(
      {"--nproc-per-node=2", "--log-dir", logs.path(), "--tee=1", "--local-ranks-filter=1"},
      {"--print", "hello"}));
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("[default1]:hello\n") != std::string::npos);
  CHECK(r.out.find("[default0]:") == std::string::npos);
  // Both ranks' stdout still reach their files.
  auto files = run({"/bin/sh", "-c", "cat " + logs.path() + "/*/attempt_0/*/stdout.log"});
  CHECK(files.out == "hello\nhello\n");

  auto templ =
      run(withWorker({"--nproc-per-node=2", "--log-dir", logs.path(), "--tee=3", "--role=trainer",
                      "--log-line-prefix-template=<${role_name}|${rank}>"},
                     {"--eprint", "warn"}));
  REQUIRE(templ.exit_code == 0);
  CHECK(templ.err.find("<trainer|0>warn\n") != std::string::npos);
  CHECK(templ.err.find("<trainer|1>warn\n") != std::string::npos);
}

TEST_CASE("duplicate filters copy matching tee'd lines of every rank to one file", "[e2e]") {
  TempDir logs;
  auto r =
      run(withWorker({"--nproc-per-node=2", "--rdzv-id=filt", "--log-dir", logs.path(), "--tee=3",
                      "--duplicate-stdout-filters=loss,NaN", "--duplicate_stderr_filters=Error"},
                     {"--print", "epoch 1 loss=0.5", "--print", "no match", "--print", "grad NaN",
                      "--eprint", "Error: x", "--eprint", "warn"}));
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("[default0]:no match\n") != std::string::npos);  // the console keeps all
  auto dirs = run({"/bin/sh", "-c", "ls -d " + logs.path() + "/filt_*"});
  const std::string attempt = trim(dirs.out) + "/attempt_0";
  auto lines = [](const std::string& text) {
    std::vector<std::string> out = split(text, '\n');
    if (!out.empty() && out.back().empty()) out.pop_back();
    std::sort(out.begin(), out.end());  // the ranks' lines interleave in any order
    return out;
  };
  CHECK(lines(readFile(attempt + "/filtered_stdout.log")) ==
        std::vector<std::string>{"[default0]:epoch 1 loss=0.5", "[default0]:grad NaN",
                                 "[default1]:epoch 1 loss=0.5", "[default1]:grad NaN"});
  CHECK(lines(readFile(attempt + "/filtered_stderr.log")) ==
        std::vector<std::string>{"[default0]:Error: x", "[default1]:Error: x"});
  CHECK(readFile(attempt + "/0/stdout.log") == "epoch 1 loss=0.5\nno match\ngrad NaN\n");
}

TEST_CASE("a tee'd worker that never writes a newline is cut into bounded lines", "[e2e]") {
  // 200000 bytes without a newline: the agent emits 64 KiB pieces, not one growing buffer.
  auto r =
      run(ddprunArgv({"--nproc-per-node=1", "--tee=1", "--duplicate-stdout-filters=a",
                      "--no-python", "/bin/sh", "-c", "head -c 200000 /dev/zero | tr '\\0' a"}));
  REQUIRE(r.exit_code == 0);
  const auto pieces = split(r.out, '\n');
  REQUIRE(pieces.size() == 5);  // 3 x 65536 + 3392, and the empty rest after the last newline
  CHECK(pieces[0] == "[default0]:" + std::string(65536, 'a'));
  CHECK(pieces[3] == "[default0]:" + std::string(200000 - 3 * 65536, 'a'));
}

TEST_CASE("usage errors are one line naming the flag, with exit code 2", "[e2e]") {
  for (const auto& args :
       std::vector<std::vector<std::string>>{{"--nnodes=0", "x"},
                                             {"--nproc-per-node=-1", "x"},
                                             {"--unknown-flag", "x"},
                                             {"--no-python", "/nonexistent/prog"},
                                             {"--master-addr", "--nnodes=2", "x"},
                                             {"--local-addr", "no such host", "x"},
                                             {"--standalone"}}) {
    auto r = run(ddprunArgv(args));
    INFO(join(args, " ") << " -> " << r.err);
    CHECK(r.exit_code == 2);
    CHECK(countOf(r.err, "\n") == 1);
    CHECK(startsWith(r.err, "ddprun: error: "));
  }
  // A --log-dir that cannot hold the logs is the user's to fix too.
  TempDir dir;
  const std::string file = dir.path() + "/a-file";
  std::ofstream(file) << "x";
  auto log_dir = run(ddprunArgv({"--log-dir", file, "/bin/true"}));
  INFO(log_dir.err);
  CHECK(log_dir.exit_code == 2);
  CHECK(log_dir.err.find("--log-dir: ") != std::string::npos);
  // TMPDIR that is no directory is not created (as root it was): /tmp, as Python's tempfile.
  const std::string missing = dir.path() + "/no/such/tmp";
  auto tmp = run(ddprunArgv({"/bin/true"}), {{"TMPDIR", missing}});
  INFO(tmp.err);
  CHECK(tmp.exit_code == 0);
  CHECK(tmp.err.find("warning: TMPDIR=" + missing +
                     " is not a directory ddprun may write in; the run's logs go under /tmp") !=
        std::string::npos);
  CHECK(::access((dir.path() + "/no").c_str(), F_OK) != 0);
  auto help = run(ddprunArgv({"--help"}));
  CHECK(help.exit_code == 0);
  CHECK(help.out.find("usage: ddprun") != std::string::npos);
}

TEST_CASE("PyTorch workers get NCCL's switch under their torch's name and no deprecation warning",
          "[e2e][pytorch]") {
  if (!torchAvailable()) {
    WARN("skipped: no torch at " + torchPython());
    return;
  }
  auto r =
      run(ddprunArgv({"--standalone", "--nproc_per_node=2",
                      sourceDir() + "/tests/launcher/pytorch_launcher_bin/torch_env_check.py"}),
          torchEnv());
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  CHECK(countOf(r.out, "env ok ") == 2);
  // torch >= 2.2 says "... is deprecated; use TORCH_... instead" on every rank when it reads an
  // old name; no word of it about what ddprun set.
  CHECK(r.err.find("deprecated") == std::string::npos);
}

TEST_CASE("a real PyTorch gloo all_reduce sums across ddprun's workers", "[e2e][pytorch]") {
  if (!torchAvailable()) {
    WARN("skipped: no torch at " + torchPython());
    return;
  }
  auto r = run(ddprunArgv({"--standalone", "--nproc_per_node=2",
                           sourceDir() + "/examples/pytorch/allreduce_check.py"}),
               torchEnv());
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("rank 0/2: all_reduce sum 3 (expected 3) OK") != std::string::npos);
  CHECK(r.out.find("rank 1/2: all_reduce sum 3 (expected 3) OK") != std::string::npos);
}

TEST_CASE("the DDP tutorial job survives a killed worker and resumes from its snapshot",
          "[e2e][pytorch]") {
  if (!torchAvailable()) {
    WARN("skipped: no torch at " + torchPython());
    return;
  }
  TempDir work;
  const std::string snapshot = work / "snapshot.pt";
  Process p(ddprunArgv({"--standalone", "--nproc_per_node=2", "--max-restarts=1",
                        sourceDir() + "/examples/pytorch/ddp_tutorial.py", "40", "1",
                        "--snapshot_path", snapshot, "--step_delay", "0.004"}),
            torchEnv());
  // Mid-run: a few epochs done and snapshotted.
  REQUIRE(waitUntil([&] { return p.out().find("[RANK 0] Epoch 3 |") != std::string::npos; }, 120s));
  auto workers = workerPids(p.pid());
  REQUIRE(workers.size() == 2);
  ::kill(workers[1], SIGKILL);
  auto r = p.wait(300s);
  REQUIRE(r);
  INFO(r->out << r->err);
  CHECK(r->exit_code == 0);
  std::smatch m;
  REQUIRE(std::regex_search(
      r->out, m, std::regex(R"(\[RANK 0\] Resuming training from snapshot at Epoch (\d+))")));
  CHECK(std::stoi(m[1]) >= 3);  // not from epoch 0
  CHECK(countOf(r->out, "[RANK 0] Epoch 0 |") == 1);
  CHECK(r->out.find("[RANK 0] Epoch 39 |") != std::string::npos);
  CHECK(r->out.find("[RANK 1] Epoch 39 |") != std::string::npos);
}

TEST_CASE("a worker whose heartbeat goes stale is stopped and restarted with RESTART_COUNT=1",
          "[e2e][heartbeat]") {
  TempDir logs, state, envs;
  // Rank 1 touches its heartbeat file a few times, then hangs (attempt 0 only); rank 0 and the
  // restarted rank 1 exit 0 without touching theirs.
  Process p(withWorker({"--standalone", "--nproc-per-node=2", "--max-restarts=1",
                        "--heartbeat-timeout=2", "--log-dir", logs.path()},
                       {"--hang-after-heartbeats", "3", "--only-rank", "1", "--fail-until-restart",
                        "1", "--state-dir", state.path(), "--env-out", envs.path()}));
  auto r = p.wait(120s);  // a hang that is never detected would run into this bound
  REQUIRE(r);
  INFO(r->err);
  CHECK(r->exit_code == 0);
  CHECK(r->err.find("worker hung: no heartbeat for ") != std::string::npos);
  CHECK(r->err.find("(timeout 2 s) (rank 1, local_rank 1, pid " + readFile(state / "pid.1.0") +
                    ")") != std::string::npos);
  CHECK(fileExists(state / "pid.1.1"));  // restarted, once
  CHECK_FALSE(fileExists(state / "pid.1.2"));
  const auto env1 = parseEnvFile(readFile(envs / "env.1"));
  CHECK(env1.at("TORCHELASTIC_RESTART_COUNT") == "1");
  // Each worker's heartbeat file sits next to its error file, in that attempt's directory.
  const std::string dir = runDir(logs.path()) + "/attempt_1/1";
  CHECK(env1.at("DDPRUN_HEARTBEAT_FILE") == dir + "/heartbeat");
  CHECK(env1.at("TORCHELASTIC_ERROR_FILE") == dir + "/error.json");
  CHECK(fileExists(runDir(logs.path()) + "/attempt_0/1/heartbeat"));
}

TEST_CASE("a hung worker past the budget ends ddprun with exit 1 and the hang in the report",
          "[e2e][heartbeat]") {
  TempDir state;
  Process p(withWorker({"--nproc-per-node=2", "--max-restarts=0", "--heartbeat_timeout=2"},
                       {"--hang-after-heartbeats", "3", "--only-rank", "1", "--sleep", "600",
                        "--state-dir", state.path()}));
  auto r = p.wait(120s);
  REQUIRE(r);
  INFO(r->err);
  CHECK(r->exit_code == 1);
  CHECK(r->err.find("ddprun_test_worker FAILED") != std::string::npos);
  const auto root = r->err.find("Root Cause (first observed failure):");
  REQUIRE(root != std::string::npos);
  const std::string pid = readFile(state / "pid.1.0");
  CHECK(r->err.find("rank      : 1 (local_rank: 1)", root) != std::string::npos);
  // Hung: SIGKILL at once (issue 34), not SIGTERM and the shutdown timeout.
  CHECK(r->err.find("exitcode  : -9 (pid: " + pid + ")", root) != std::string::npos);
  std::smatch m;
  REQUIRE(std::regex_search(
      r->err, m,
      std::regex(R"(traceback : worker hung: no heartbeat for (\d+\.\d) s \(timeout 2 s\); the )"
                 R"(agent stopped it)")));
  CHECK(std::stod(m[1]) > 2.0);
  // Rank 0, stopped with the group while it slept, is no failure of its own.
  CHECK(r->err.find("<NO_OTHER_FAILURES>") != std::string::npos);
}

TEST_CASE("a hung worker that ignores SIGTERM is killed at once, not after the shutdown timeout",
          "[e2e][heartbeat]") {
  // A stopped or hung process cannot act on SIGTERM: with a 60 s shutdown timeout the agent used
  // to wait it out before SIGKILL.
  TempDir state;
  Process p(withWorker(
      {"--nproc-per-node=1", "--max-restarts=0", "--heartbeat-timeout=2", "--shutdown-timeout=60"},
      {"--hang-after-heartbeats", "3", "--only-rank", "0", "--ignore-sigterm", "--sleep", "600",
       "--state-dir", state.path()}));
  auto r = p.wait(40s);
  REQUIRE(r);
  INFO(r->err);
  CHECK(r->exit_code == 1);
  CHECK(r->err.find("local rank 0 (pid " + readFile(state / "pid.0.0") +
                    ") is hung: sending SIGKILL") != std::string::npos);
  CHECK(r->err.find("did not stop within the shutdown timeout") == std::string::npos);
}

TEST_CASE("a worker whose guardian is stopped still ends the agent, the guardian killed", "[e2e]") {
  // SIGSTOP of a worker's guardian: the worker's exit never reached the agent, which then never
  // exited (still alive after 700 s).
  TempDir state;
  const std::string go = state / "go";
  Process p(
      withWorker({"--standalone", "--nproc-per-node=1", "--max-restarts=0", "--metrics-port=0"},
                 {"--wait-for", go, "--exit-code", "3", "--state-dir", state.path()}));
  REQUIRE(waitUntil([&] { return fileExists(state / "pid.0.0"); }));
  // The agent has the guardian's report that it started the worker (stopped before it sent it,
  // the guardian would be killed as one that never started its worker): the agent waits for it on
  // its loop, so an answer of its metrics endpoint, served there too, comes after it.
  std::string metrics_port;
  REQUIRE(waitUntil([&] {
    const std::string err = p.err();
    std::smatch m;
    if (!std::regex_search(err, m, std::regex(R"(metrics on http://[^:]+:(\d+)/metrics)"))) {
      return false;
    }
    metrics_port = m[1];
    return true;
  }));
  REQUIRE(startsWith(run({"bash", "-c",
                          "exec 3<>/dev/tcp/127.0.0.1/" + metrics_port +
                              " 2>/dev/null || exit 1; printf 'GET /healthz HTTP/1.0\\r\\n\\r\\n' "
                              ">&3; head -c 15 <&3"})
                         .out,
                     "HTTP/1.0 200 OK"));
  std::vector<int> guardians;
  REQUIRE(waitUntil([&] {
    guardians.clear();
    for (int g : childPids(p.pid())) {
      if (!childPids(g).empty()) guardians.push_back(g);
    }
    return guardians.size() == 1;
  }));
  const int guardian = guardians[0];
  REQUIRE(::kill(guardian, SIGSTOP) == 0);
  std::ofstream(go) << "";  // the worker exits 3; its stopped guardian hands nothing over
  auto r = p.wait(40s);
  if (pidAlive(guardian)) ::kill(guardian, SIGKILL);
  REQUIRE(r);
  INFO(r->err);
  CHECK(r->exit_code == 1);
  CHECK(r->err.find("worker pid " + readFile(state / "pid.0.0") +
                    " exited, but its guardian process (pid " + std::to_string(guardian) +
                    ") did not hand it over within 5 s (stopped?); killing the guardian") !=
        std::string::npos);
  CHECK(r->err.find("exited with code 3") != std::string::npos);
}

TEST_CASE("a snapshot write killed mid-way leaves no temp file once the job ended", "[e2e]") {
  // The worker SDK writes <name>.tmp.<pid>.<random>, then renames it; killed in between
  // (SIGXFSZ past a file size limit, SIGKILL), its bytes stayed until the next start.
  TempDir dir;
  auto r = run(
      ddprunArgv({"--standalone", "--snapshot-dir=" + dir.path(), "--no-python", "/bin/sh", "-c",
                  "echo partial > \"$DDPRUN_SNAPSHOT_DIR/snapshot.pt.tmp.$$.7\"; "
                  "kill -XFSZ $$"}));
  INFO(r.err);
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("snapshot dir: removed 1 temp file(s) that killed writers left (e.g. "
                   "snapshot.pt.tmp.") != std::string::npos);
  DIR* d = ::opendir(dir.path().c_str());
  REQUIRE(d != nullptr);
  int left = 0;
  while (dirent* e = ::readdir(d)) left += e->d_name[0] != '.' ? 1 : 0;
  ::closedir(d);
  CHECK(left == 0);
}

TEST_CASE("a worker that never touches its heartbeat file is not stopped however long it runs",
          "[e2e][heartbeat]") {
  TempDir logs, envs;
  // Sleeps three timeouts: no SDK, no heartbeat, no hang.
  auto r = run(withWorker({"--nproc-per-node=1", "--heartbeat-timeout=1", "--log-dir", logs.path()},
                          {"--sleep", "3", "--env-out", envs.path()}));
  INFO(r.err);
  CHECK(r.exit_code == 0);
  CHECK(r.err.find("hung") == std::string::npos);
  const std::string file = parseEnvFile(readFile(envs / "env.0")).at("DDPRUN_HEARTBEAT_FILE");
  CHECK(file == runDir(logs.path()) + "/attempt_0/0/heartbeat");
  CHECK_FALSE(fileExists(file));

  // With --heartbeat-timeout=0 there is no heartbeat file at all.
  TempDir off;
  auto o =
      run(withWorker({"--nproc-per-node=1", "--heartbeat-timeout=0"}, {"--env-out", off.path()}));
  CHECK(o.exit_code == 0);
  CHECK(parseEnvFile(readFile(off / "env.0")).count("DDPRUN_HEARTBEAT_FILE") == 0);
}

TEST_CASE("SIGUSR1 to ddprun makes train snapshot at the next step and every rank exit 0",
          "[e2e][signals]") {
  TempDir logs, work;
  const std::string snapshot = work / "snap.pt";
  Process p({ddprunBin(), "--standalone", "--nproc-per-node=2",
             "--signals-to-handle=SIGTERM,SIGUSR1", "--log-dir", logs.path(), trainBin(), "100000",
             "0", "--snapshot-path", snapshot});
  // Both ranks are past their first step once their heartbeat files exist.
  REQUIRE(waitUntil(
      [&] {
        const std::string dir = runDir(logs.path());
        return !dir.empty() && fileExists(dir + "/attempt_0/0/heartbeat") &&
               fileExists(dir + "/attempt_0/1/heartbeat");
      },
      120s));
  CHECK_FALSE(fileExists(snapshot));
  p.signal(SIGUSR1);
  auto r = p.wait(120s);
  REQUIRE(r);
  INFO(r->out << r->err);
  CHECK(r->exit_code == 0);
  CHECK(r->err.find("received SIGUSR1, forwarding it to the workers") != std::string::npos);
  CHECK(fileExists(snapshot));
  CHECK(r->out.find("Training snapshot saved at " + snapshot + " (checkpoint signal)") !=
        std::string::npos);
  CHECK(r->out.find("[RANK 0] stopped by checkpoint signal") != std::string::npos);
  CHECK(r->out.find("[RANK 1] stopped by checkpoint signal") != std::string::npos);
  CHECK(r->err.find("FAILED") == std::string::npos);
}

// --print-completion (torch 2.x's torchrun has it): the scripts complete in the shells
// themselves. bash's function is called as bash calls it at a TAB; zsh's runs in an interactive
// zsh on a pseudo-terminal (zsh and tcsh come with deploy/install-deps.sh).
TEST_CASE("the completion scripts complete ddprun's flags, their values and the program", "[e2e]") {
  TempDir dir;
  std::ofstream(dir / "train.py") << "print('hi')\n";
  std::ofstream(dir / "data.txt") << "x";
  ::mkdir((dir / "logs").c_str(), 0755);
  const std::vector<std::string> lines = {"ddprun --nn",
                                          "ddprun --rdzv-backend=",
                                          "ddprun --rdzv_backend e",
                                          "ddprun --restart-mode ",
                                          "ddprun --nnodes 2 --print-completion z",
                                          "ddprun --log-dir=l",
                                          "ddprun -r 3 --log-dir l",
                                          "ddprun --nnodes=1:2 --standalone tr",
                                          "ddprun --nnodes=2 train.py --nn",
                                          "ddprun launch --st",
                                          "ddprun --nnodes 2"};
  const std::vector<std::string> expected = {
      "ddprun --nn => --nnodes", "ddprun --rdzv-backend= => c10d etcd-v3 grpc static",
      "ddprun --rdzv_backend e => etcd-v3", "ddprun --restart-mode  => in-place process",
      "ddprun --nnodes 2 --print-completion z => zsh", "ddprun --log-dir=l => logs",
      "ddprun -r 3 --log-dir l => logs", "ddprun --nnodes=1:2 --standalone tr => train.py",
      // the program's own arguments: files, not flags
      "ddprun --nnodes=2 train.py --nn =>", "ddprun launch --st => --standalone --start-method",
      "ddprun --nnodes 2 =>"};
  const std::string drivers = sourceDir() + "/tests/launcher/completion/";
  auto linesOf = [](const std::string& text) {
    std::vector<std::string> out = split(text, '\n');
    if (!out.empty() && out.back().empty()) out.pop_back();
    return out;
  };
  std::vector<std::string> bash = {"bash", drivers + "drive_bash.sh", ddprunBin(), dir.path()};
  bash.insert(bash.end(), lines.begin(), lines.end());
  Finished b = run(bash);
  INFO(b.err);
  CHECK(b.exit_code == 0);
  CHECK(linesOf(b.out) == expected);

  // `ddprun slurm` prints the same, outside an allocation too (as its --help).
  Finished plain = run({ddprunBin(), "--print-completion", "bash"});
  Finished slurm =
      run({ddprunBin(), "slurm", "--print-completion", "bash"}, {{"SLURM_JOB_ID", ""}});
  CHECK(slurm.exit_code == 0);
  CHECK(slurm.out == plain.out);

  if (::access("/usr/bin/zsh", X_OK) != 0) {
    WARN("skipped zsh: /usr/bin/zsh is missing (deploy/install-deps.sh installs it)");
  } else {
    // zsh's program arguments complete as files too, and "launch" is a program there.
    const std::vector<std::string> zsh_lines(lines.begin(), lines.begin() + 9);
    std::vector<std::string> zsh = {"zsh", "-f", drivers + "drive_zsh.zsh", ddprunBin(),
                                    dir.path()};
    zsh.insert(zsh.end(), zsh_lines.begin(), zsh_lines.end());
    Finished z = run(zsh);
    INFO(z.err);
    CHECK(z.exit_code == 0);
    CHECK(linesOf(z.out) == std::vector<std::string>(expected.begin(), expected.begin() + 9));
  }

  if (::access("/usr/bin/tcsh", X_OK) != 0) {
    WARN("skipped tcsh: /usr/bin/tcsh is missing (deploy/install-deps.sh installs it)");
  } else {
    // tcsh completes only at a terminal: the script is sourced and its rules registered.
    const std::string script = dir / "ddprun.tcsh";
    std::ofstream(script) << run({ddprunBin(), "--print-completion", "tcsh"}).out;
    Finished r = run({"tcsh", "-f", "-c", "source " + script + " && complete ddprun"});
    INFO(r.err);
    CHECK(r.exit_code == 0);
    CHECK(r.out.find("'n/--rdzv-backend/(static c10d grpc etcd-v3)/'") != std::string::npos);
    CHECK(r.out.find("'p/*/f/'") != std::string::npos);
  }
}
