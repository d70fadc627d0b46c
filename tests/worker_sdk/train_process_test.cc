// Multi-process tests of `train`: real processes, real sockets, a real launcher (ddprun when it is
// built, otherwise the reference torchrun).
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "test_util.h"

namespace t = ddprun::worker::testing;
using namespace std::chrono_literals;

namespace {

std::string trainBin() { return t::buildDir() + "/examples/train"; }

std::map<std::string, std::string> rankEnv(int rank, int world, int port, const std::string& dir) {
  return {{"RANK", std::to_string(rank)},
          {"WORLD_SIZE", std::to_string(world)},
          {"LOCAL_RANK", std::to_string(rank)},
          {"LOCAL_WORLD_SIZE", std::to_string(world)},
          {"MASTER_ADDR", "127.0.0.1"},
          {"MASTER_PORT", std::to_string(port)},
          {"OMP_NUM_THREADS", "1"},
          {"DDPRUN_HEARTBEAT_FILE", dir + "/hb" + std::to_string(rank)},
          {"DDPRUN_STOP_FILE", dir + "/stop" + std::to_string(rank)},
          {"TORCHELASTIC_RESTART_COUNT", "0"}};
}

// One rank's log, in a process group of its own.
t::ProcessOptions ranked(const std::string& prefix, int rank) {
  return {prefix + std::to_string(rank), /*own_process_group=*/true};
}

// argv that runs `args` on 2 local workers with one restart allowed. ddprun: this build's, or
// DDPRUN_TEST_DDPRUN's (a build of the SDK alone, deploy/test.sh).
std::vector<std::string> launcherArgv(const std::vector<std::string>& args, std::string* which) {
  const std::string ddprun = t::envOr("DDPRUN_TEST_DDPRUN", t::buildDir() + "/launcher/ddprun");
  std::vector<std::string> argv;
  if (std::filesystem::exists(ddprun)) {
    *which = "ddprun";
    argv = {ddprun, "--standalone", "--nproc-per-node=2", "--max-restarts=1", trainBin()};
  } else {
    *which = "torchrun";
    argv = {t::python(),
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "--max_restarts=1",
            "--monitor_interval=0.2",
            "-r",
            "9:1",
            "-t",
            "9:1",
            "--no_python",
            trainBin()};
  }
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

}  // namespace

TEST_CASE("train rejects bad arguments with a clear message and exit code 2", "[worker][train]") {
  t::TempDir dir;
  // {train's arguments, what its message says}
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"3", "expected TOTAL_EPOCHS and SAVE_EVERY"},
      {"3 1 --model resnet", "--model must be linear, mlp or cnn"},
      {"3 1 --batch-size 0", "--batch-size must be an integer >= 1, got '0'"},
      {"3 1 --backend mpi", "expected gloo or nccl"},
      {"3 1 --fail-signal HUP", "--fail-signal must be KILL, TERM or HANG, got 'HUP'"},
      {"3 1 --fail-ranks 0", "--fail-ranks"},
      {"3 1 --step-delay 0", "--step-delay must be a positive number, got '0'"},
      {"3 1 --step-delay 61", "--step-delay must be at most 60 seconds"}};
  for (const auto& [args, says] : cases) {
    auto r = t::run(trainBin() + " " + args + " 2>&1");
    INFO("train " << args << ":\n" << r.output);
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.output, Catch::Contains(says));
  }
  auto r = t::run("env -u RANK -u WORLD_SIZE " + trainBin() + " 3 1 2>&1");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::Contains("WORLD_SIZE is not set"));
}

TEST_CASE("train runs the mlp and cnn models on two ranks and agrees on the loss",
          "[worker][train]") {
  for (std::string model : {"mlp", "cnn"}) {
    t::TempDir dir;
    const int port = t::freePort();
    std::vector<std::unique_ptr<t::Process>> ranks;
    for (int r = 0; r < 2; ++r) {
      ranks.push_back(std::make_unique<t::Process>(
          std::vector<std::string>{trainBin(), "1", "1", "--model", model, "--dataset-size", "128",
                                   "--snapshot-path", dir.str() + "/s.pt"},
          rankEnv(r, 2, port, dir.str()), ranked(dir.str() + "/out", r)));
    }
    std::string lines[2];
    for (int r = 0; r < 2; ++r) {
      auto code = ranks[static_cast<size_t>(r)]->waitExit(180s);
      const std::string out = ranks[static_cast<size_t>(r)]->output();
      INFO(model << " rank " << r << ":\n" << out);
      REQUIRE(code.has_value());
      CHECK(*code == 0);
      const auto at = out.find("| loss ");
      REQUIRE(at != std::string::npos);
      lines[r] = out.substr(at, out.find('\n', at) - at);
      CHECK_THAT(out, Catch::Contains("[RANK " + std::to_string(r) +
                                      "] Epoch 0 | Batchsize: 32 | Steps: 2"));
    }
    CHECK(lines[0] == lines[1]);  // the loss is averaged across ranks
    // Training finished: no rank claims it merely stopped.
    CHECK_FALSE(std::filesystem::exists(dir.path() / "stop0"));
    CHECK_FALSE(std::filesystem::exists(dir.path() / "stop1"));
  }
}

namespace {

// Two ranks of `train` run until `sig` reaches one of them (`signalled`) mid-epoch; every rank
// must stop at the same step boundary, rank 0 must write the snapshot, and all must exit 0.
// With `resume`, a new run then resumes from that snapshot.
void checkpointOnSignal(int sig, int signalled, bool resume) {
  t::TempDir dir;
  const int port = t::freePort();
  const std::string snap = dir.str() + "/snap.pt";
  std::vector<std::unique_ptr<t::Process>> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.push_back(std::make_unique<t::Process>(
        std::vector<std::string>{trainBin(), "100000", "0", "--snapshot-path", snap},
        rankEnv(r, 2, port, dir.str()), ranked(dir.str() + "/out", r)));
  }
  // Both ranks are past step 1 once their heartbeat files exist.
  REQUIRE(t::waitUntil(
      [&] {
        return std::filesystem::exists(dir.path() / "hb0") &&
               std::filesystem::exists(dir.path() / "hb1");
      },
      120s));
  CHECK_FALSE(std::filesystem::exists(snap));
  // Only one rank gets the signal: the ranks must still agree on the same stopping step.
  ranks[static_cast<size_t>(signalled)]->signal(sig);
  auto c0 = ranks[0]->waitExit(60s);
  auto c1 = ranks[1]->waitExit(60s);
  INFO("rank0: " << ranks[0]->output() << "\nrank1: " << ranks[1]->output());
  REQUIRE(c0.has_value());
  REQUIRE(c1.has_value());
  CHECK(*c0 == 0);
  CHECK(*c1 == 0);
  CHECK(std::filesystem::exists(snap));
  CHECK_THAT(ranks[0]->output(),
             Catch::Contains("Training snapshot saved at " + snap + " (checkpoint signal)"));
  CHECK_THAT(ranks[1]->output(), Catch::Contains("stopped by checkpoint signal"));
  // Each rank says it stopped rather than finished, and why: the agent of a rank that was not
  // signalled must not take its exit 0 for the job's success.
  for (int r = 0; r < 2; ++r) {
    const std::string why = t::readFile(dir.str() + "/stop" + std::to_string(r));
    CHECK_THAT(why,
               Catch::Contains(r == signalled ? "by a signal to this rank" : "by a peer rank"));
  }
  // No temp files are left next to the snapshot.
  int files = 0;
  for (auto& e : std::filesystem::directory_iterator(dir.path()))
    files += e.path().filename().string().rfind("snap", 0) == 0;
  CHECK(files == 1);
  if (!resume) return;

  // The snapshot is usable: a new run resumes from it mid-epoch.
  const int port2 = t::freePort();
  std::vector<std::unique_ptr<t::Process>> again;
  for (int r = 0; r < 2; ++r) {
    again.push_back(std::make_unique<t::Process>(
        std::vector<std::string>{trainBin(), "1", "0", "--snapshot-path", snap},
        rankEnv(r, 2, port2, dir.str()), ranked(dir.str() + "/again", r)));
  }
  for (auto& c : again) {
    auto code = c->waitExit(120s);
    INFO(c->output());
    REQUIRE(code.has_value());
    CHECK(*code == 0);
    CHECK_THAT(c->output(), Catch::Contains("Resuming training from snapshot at Epoch"));
  }
}

}  // namespace

TEST_CASE("SIGTERM mid-epoch writes a snapshot at the next step and every rank exits 0",
          "[worker][train]") {
  checkpointOnSignal(SIGTERM, /*signalled=*/1, /*resume=*/true);
}

TEST_CASE("SIGUSR1 mid-epoch writes a snapshot at the next step and every rank exits 0",
          "[worker][train]") {
  checkpointOnSignal(SIGUSR1, /*signalled=*/0, /*resume=*/false);
}

TEST_CASE(
    "a run killed mid-epoch and restarted by the launcher ends bit-identical to an uninterrupted "
    "run",
    "[worker][train]") {
  t::TempDir dir;
  const std::vector<std::string> common{"4", "1", "--dataset-size",
                                        "512"};  // 8 steps per epoch per rank
  std::string which;

  auto args = common;
  args.insert(args.end(),
              {"--snapshot-path", dir.str() + "/a/snap.pt", "--dump-params", dir.str() + "/a.bin"});
  t::Process clean(launcherArgv(args, &which), {{"OMP_NUM_THREADS", "1"}},
                   {dir.str() + "/clean.log", /*own_process_group=*/true});
  auto c = clean.waitExit(240s);
  INFO(which << " clean run:\n" << clean.output());
  REQUIRE(c.has_value());
  REQUIRE(*c == 0);

  // Global step 20 is in the middle of epoch 2 (steps 17-24): the restart resumes from the
  // snapshot taken after epoch 1 and redoes the first half of epoch 2.
  args = common;
  args.insert(args.end(), {"--snapshot-path", dir.str() + "/b/snap.pt", "--dump-params",
                           dir.str() + "/b.bin", "--fail-at-step", "20"});
  t::Process crashed(launcherArgv(args, &which), {{"OMP_NUM_THREADS", "1"}},
                     {dir.str() + "/crashed.log", /*own_process_group=*/true});
  c = crashed.waitExit(240s);
  const std::string out = crashed.output();
  INFO(which << " interrupted run:\n" << out);
  REQUIRE(c.has_value());
  CHECK(*c == 0);
  CHECK_THAT(out, Catch::Contains("fault injection: killing myself at step 20"));
  CHECK_THAT(out, Catch::Contains("Resuming training from snapshot at Epoch 2"));
  const std::string a = t::readFile(dir.str() + "/a.bin");
  const std::string b = t::readFile(dir.str() + "/b.bin");
  REQUIRE(a.size() == 21 * 4);  // Linear(20, 1): 20 weights + 1 bias
  CHECK(a == b);
}

namespace {

// Runs `train <epochs> 1` on two ranks, rank r with --snapshot-path paths[r] (and `env` added);
// returns each rank's output after both exited 0.
std::vector<std::string> trainTwoRanks(const t::TempDir& dir, const std::string& epochs,
                                       const std::vector<std::string>& paths,
                                       const std::string& tag,
                                       const std::map<std::string, std::string>& env = {}) {
  const int port = t::freePort();
  std::vector<std::unique_ptr<t::Process>> ranks;
  for (int r = 0; r < 2; ++r) {
    auto e = rankEnv(r, 2, port, dir.str());
    for (const auto& [k, v] : env) e[k] = v;
    ranks.push_back(std::make_unique<t::Process>(
        std::vector<std::string>{trainBin(), epochs, "1", "--dataset-size", "128",
                                 "--snapshot-path", paths[static_cast<size_t>(r)]},
        e, ranked(dir.str() + "/" + tag, r)));
  }
  std::vector<std::string> out;
  for (auto& c : ranks) {
    auto code = c->waitExit(180s);
    INFO(tag << ":\n" << c->output());
    REQUIRE(code.has_value());
    REQUIRE(*code == 0);
    out.push_back(c->output());
  }
  return out;
}

}  // namespace

TEST_CASE("ranks with their own snapshot files resume from the newest any of them holds",
          "[worker][train]") {
  t::TempDir dir;
  const std::string shared = dir.str() + "/shared.pt";
  const std::string older = dir.str() + "/older.pt";
  trainTwoRanks(dir, "1", {shared, shared}, "first");  // snapshot: epoch 1
  std::filesystem::copy_file(shared, older);
  trainTwoRanks(dir, "2", {shared, shared}, "second");  // snapshot: epoch 2

  // Rank 0 holds nothing (a fresh disk), rank 1 the newest: rank 0 gets it from rank 1.
  const std::string empty0 = dir.str() + "/r0/snap.pt";
  std::filesystem::create_directories(dir.path() / "r0");
  auto out = trainTwoRanks(dir, "3", {empty0, shared}, "fresh");
  CHECK_THAT(out[0], Catch::Contains("received the newest snapshot"));
  CHECK_THAT(out[0], Catch::Contains("from rank 1"));
  CHECK_THAT(out[1], !Catch::Contains("received the newest snapshot"));
  for (const auto& o : out)
    CHECK_THAT(o, Catch::Contains("Resuming training from snapshot at Epoch 2"));
  CHECK(std::filesystem::exists(empty0));

  // Rank 0 holds an older snapshot than rank 1: the newer one wins, and replaces the older.
  const std::string stale0 = dir.str() + "/stale0.pt";
  std::filesystem::copy_file(older, stale0);
  const std::string newest1 = dir.str() + "/newest1.pt";
  std::filesystem::copy_file(empty0, newest1);  // epoch 3 after the run above
  out = trainTwoRanks(dir, "4", {stale0, newest1}, "stale");
  CHECK_THAT(out[0], Catch::Contains("received the newest snapshot"));
  for (const auto& o : out)
    CHECK_THAT(o, Catch::Contains("Resuming training from snapshot at Epoch 3"));

  // Under ddprun's --snapshot-dir, a rank that lacks the newest loads what it was sent and does
  // not write it there: the agent brings the file, and a copy written by the worker would be a
  // new version of older content for every node. Rank 1 holds the snapshot after epoch 4, which
  // ends the 4-epoch job: nothing is trained or saved after the resume. DDPRUN_SNAPSHOT_DIR names
  // the directory through a symlink, with a trailing '/': the paths are compared resolved.
  const std::string agent_dir = dir.str() + "/replicated";
  std::filesystem::create_directories(agent_dir);
  std::filesystem::create_directory_symlink(agent_dir, dir.path() / "link");
  const std::string replicated0 = agent_dir + "/snap.pt";
  std::filesystem::copy_file(older, replicated0);
  const std::string newest = dir.str() + "/newest.pt";
  std::filesystem::copy_file(stale0, newest);  // rank 0 of the run above saved epoch 4 there
  const auto before = t::readFile(replicated0);
  out = trainTwoRanks(dir, "4", {replicated0, newest}, "replicated",
                      {{"DDPRUN_SNAPSHOT_DIR", dir.str() + "/link/"}});
  CHECK_THAT(out[0], Catch::Contains("received the newest snapshot"));
  CHECK_THAT(out[0], Catch::Contains("loaded from memory (ddprun replicates " + replicated0));
  CHECK_THAT(out[0], !Catch::Contains("written to"));
  for (const auto& o : out)
    CHECK_THAT(o, Catch::Contains("Resuming training from snapshot at Epoch 4"));
  CHECK(t::readFile(replicated0) == before);

  // A rank whose file is damaged resumes from the other's good one (and its file is replaced);
  // with no good one anywhere, every rank fails naming the damage instead of starting afresh.
  const std::string damaged0 = dir.str() + "/damaged0.pt";
  std::ofstream(damaged0) << "not a snapshot";
  out = trainTwoRanks(dir, "4", {damaged0, newest}, "damaged");
  CHECK_THAT(out[0], Catch::Contains("cannot load snapshot '" + damaged0));
  CHECK_THAT(out[0], Catch::Contains("resuming from rank 1's snapshot instead"));
  for (const auto& o : out)
    CHECK_THAT(o, Catch::Contains("Resuming training from snapshot at Epoch 4"));
  CHECK(t::readFile(damaged0) == t::readFile(newest));
  const std::string damaged1 = dir.str() + "/damaged1.pt";
  std::ofstream(damaged0) << "not a snapshot";
  std::ofstream(damaged1) << "nor this";
  const std::vector<std::string> bad = {damaged0, damaged1};
  const int port = t::freePort();
  std::vector<std::unique_ptr<t::Process>> ranks;
  for (size_t r = 0; r < 2; ++r) {
    ranks.push_back(std::make_unique<t::Process>(
        std::vector<std::string>{trainBin(), "4", "1", "--dataset-size", "128", "--snapshot-path",
                                 bad[r]},
        rankEnv(static_cast<int>(r), 2, port, dir.str()),
        ranked(dir.str() + "/both-damaged", static_cast<int>(r))));
  }
  for (size_t r = 0; r < 2; ++r) {
    auto code = ranks[r]->waitExit(120s);
    INFO(ranks[r]->output());
    REQUIRE(code.has_value());
    CHECK(*code != 0);
    CHECK_THAT(ranks[r]->output(), Catch::Contains("cannot load snapshot '" + bad[r]));
  }
}

namespace {
// The two-host rig (deploy/netrig.sh) for as long as it lives; down again on every path out.
struct NetRig {
  bool up = false;
  std::string why;
  NetRig() {
    auto r = t::run(t::sourceDir() + "/deploy/netrig.sh up --rate 10gbit --delay 0 2>&1");
    up = r.exit_code == 0;
    why = r.output;
  }
  ~NetRig() {
    if (up) t::run(t::sourceDir() + "/deploy/netrig.sh down >/dev/null 2>&1");
  }
};

// The loss each rank printed last ("[RANK r] Epoch e | ... | loss X").
std::map<int, std::string> lastLosses(const std::string& out) {
  std::map<int, std::string> losses;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    const auto at = line.find("[RANK ");
    const auto loss = line.find("| loss ");
    if (at == std::string::npos || loss == std::string::npos) continue;
    losses[std::stoi(line.substr(at + 6))] = line.substr(loss);
  }
  return losses;
}
}  // namespace

TEST_CASE("train between two network namespaces: 2+1 ranks through leaders, bf16",
          "[worker][train][netns]") {
  const std::string ddprun = t::buildDir() + "/launcher/ddprun";
  if (!std::filesystem::exists(ddprun)) {
    WARN("skipped: ddprun is not built");
    return;
  }
  NetRig rig;
  if (!rig.up) {
    WARN("skipped: no network namespaces here (deploy/netrig.sh up: " << rig.why << ")");
    return;
  }
  t::TempDir dir;
  const std::string port = std::to_string(t::freePort());
  std::vector<std::unique_ptr<t::Process>> nodes;
  for (int node = 0; node < 2; ++node) {
    nodes.push_back(std::make_unique<t::Process>(
        std::vector<std::string>{
            t::sourceDir() + "/deploy/netrig.sh", "exec", node == 0 ? "a" : "b", ddprun,
            "--nnodes=2", node == 0 ? "--nproc-per-node=2" : "--nproc-per-node=1",
            "--rdzv-backend=c10d", "--rdzv-endpoint=10.203.0.1:" + port, "--rdzv-id=netns",
            // the two "hosts" share a hostname: name each by its address
            node == 0 ? "--local-addr=10.203.0.1" : "--local-addr=10.203.0.2", trainBin(), "2", "1",
            "--model", "mlp", "--dataset-size", "192", "--compression", "bf16", "--snapshot-path",
            dir.str() + "/s" + std::to_string(node) + ".pt"},
        std::map<std::string, std::string>{{"OMP_NUM_THREADS", "1"}},
        ranked(dir.str() + "/node", node)));
  }
  std::map<int, std::string> losses;
  std::string both;
  for (int node = 0; node < 2; ++node) {
    auto code = nodes[static_cast<size_t>(node)]->waitExit(180s);
    const std::string out = nodes[static_cast<size_t>(node)]->output();
    INFO("node " << node << ":\n" << out);
    REQUIRE(code.has_value());
    CHECK(*code == 0);
    both += out;
    for (auto& [rank, loss] : lastLosses(out)) losses[rank] = loss;
  }
  INFO(both);
  // Global rank 0 logs the plan, and it is on whichever node joined the rendezvous first: the
  // layout reads 2+1 or 1+2.
  CHECK(
      std::regex_search(both, std::regex(R"(all_reduce over shared memory within each of 2 hosts )"
                                         R"(\((2\+1|1\+2) ranks\) \+ a gloo TCP ring of one )"
                                         R"(representative per host)")));
  REQUIRE(losses.size() == 3);
  CHECK(losses[0] == losses[1]);  // the loss is averaged: the same on every rank
  CHECK(losses[0] == losses[2]);
}

namespace {

// `program` (train, or a .py under PYTHON_EXEC = the reference PyTorch) on 2 ranks under the
// launcher; returns rank 0's "timing" line's run output, or fails the test.
std::string runOnTwoRanks(const std::vector<std::string>& program, const t::TempDir& dir,
                          const std::string& name) {
  const std::string ddprun = t::envOr("DDPRUN_TEST_DDPRUN", t::buildDir() + "/launcher/ddprun");
  std::vector<std::string> argv;
  if (std::filesystem::exists(ddprun)) {
    argv = {ddprun, "--standalone", "--nproc-per-node=2"};
  } else {
    argv = {t::python(),
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-r",
            "9:1",
            "-t",
            "9:1"};
  }
  argv.insert(argv.end(), program.begin(), program.end());
  t::Process p(argv, {{"PYTHON_EXEC", t::python()}, {"OMP_NUM_THREADS", "1"}},
               {dir.str() + "/" + name + ".log", true});
  auto code = p.waitExit(std::chrono::seconds(300));
  const std::string out = p.output();
  INFO(name << ":\n" << out);
  REQUIRE(code.has_value());
  REQUIRE(*code == 0);
  return out;
}

double maxParamDiff(const std::string& a, const std::string& b) {
  const std::string x = t::readFile(a);
  const std::string y = t::readFile(b);
  REQUIRE(x.size() == y.size());
  REQUIRE(x.size() % 4 == 0);
  double m = 0;
  for (size_t i = 0; i < x.size(); i += 4) {
    float u, v;
    std::memcpy(&u, x.data() + i, 4);
    std::memcpy(&v, y.data() + i, 4);
    m = std::max(m, static_cast<double>(std::fabs(u - v)));
  }
  return m;
}

}  // namespace

TEST_CASE(
    "train's accumulation and mixed precision reach PyTorch DDP's parameters (no_sync, "
    "autocast, GradScaler)",
    "[worker][train][python][amp]") {
  struct Case {
    std::string accumulate, amp;
  };
  for (const Case& c : {Case{"4", "none"}, Case{"1", "bf16"}, Case{"2", "fp16"}}) {
    INFO("--accumulate " << c.accumulate << " --amp " << c.amp);
    t::TempDir dir;
    const std::vector<std::string> common = {"--model",        "mlp", "--batch-size", "8",
                                             "--dataset-size", "128", "--accumulate", c.accumulate,
                                             "--amp",          c.amp};
    std::vector<std::string> ours = {trainBin(),
                                     "1",
                                     "0",
                                     "--snapshot-path",
                                     dir.str() + "/s.pt",
                                     "--dump-params",
                                     dir.str() + "/ours.bin"};
    ours.insert(ours.end(), common.begin(), common.end());
    if (c.amp == "fp16") {
      // fp16 on the CPU needs LibTorch 2.x (Debian's 1.13 has no fp16 matrix products there).
      auto probe =
          t::run("env RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                 std::to_string(t::freePort()) + " " + trainBin() +
                 " 0 0 --amp fp16 --model linear --snapshot-path " + dir.str() + "/p.pt 2>&1");
      if (probe.output.find("needs a LibTorch with fp16") != std::string::npos) {
        WARN("fp16 on the CPU skipped: " << probe.output);
        continue;
      }
    }
    runOnTwoRanks(ours, dir, "train");
    std::vector<std::string> ref = {t::sourceDir() + "/bench/worker_sdk/ddp_torch.py", "--epochs",
                                    "1", "--dump-params", dir.str() + "/torch.bin"};
    ref.insert(ref.end(), common.begin(), common.end());
    runOnTwoRanks(ref, dir, "torch");
    CHECK(maxParamDiff(dir.str() + "/ours.bin", dir.str() + "/torch.bin") < 1e-6);
  }
}
