#include "ddprun/agent/worker_planner.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <csignal>

using namespace ddprun;
using namespace ddprun::agent;

namespace {

std::string envOf(const WorkerLaunch& w, const std::string& name) {
  for (const auto& kv : w.env) {
    if (kv.rfind(name + "=", 0) == 0) return kv.substr(name.size() + 1);
  }
  return "<unset>";
}

RoundInfo round4And2(int group_rank) {
  RoundInfo r;
  r.round = 2;
  r.group_rank = group_rank;
  r.local_world_sizes = {4, 2};
  r.master_addr = "m";
  r.master_port = 9;
  r.run_id = "job";
  return r;
}

}  // namespace

TEST_CASE("the log line prefix template expands every variable", "[agent]") {
  CHECK(expandLogLinePrefix("", "trainer", 3, 7, "h") == "[trainer3]:");
  CHECK(expandLogLinePrefix("${hostname}/${rank}/${local_rank}/${role_name} ${rank}", "r", 1, 5,
                            "node") == "node/5/1/r 5");
  CHECK(expandLogLinePrefix("plain", "r", 1, 5, "node") == "plain");
}

TEST_CASE("the planner lays out one attempt's workers without touching the disk", "[agent]") {
  AgentConfig cfg;
  cfg.worker_argv = {"/bin/prog", "--x"};
  cfg.role = "trainer";
  cfg.max_restarts = 3;
  cfg.heartbeat_timeout = 10;
  cfg.redirects.all = StdStreams::kErr;
  cfg.tee.per_rank = {{1, StdStreams::kOut}};
  cfg.local_ranks_filter = std::set<int>{0};
  cfg.log_line_prefix_template = "${rank}>";
  WorkerPlanner planner(cfg, "/logs/run_x", "host1", {{"PATH", "/bin"}});
  const AttemptPlan plan = planner.plan(round4And2(1), /*restart_count=*/2);
  REQUIRE(plan.launches.size() == 2);  // group rank 1 runs 2 workers
  CHECK(plan.dirs ==
        std::vector<std::string>{"/logs/run_x/attempt_2/0", "/logs/run_x/attempt_2/1"});
  CHECK(plan.stale_files ==
        std::vector<std::string>{
            "/logs/run_x/attempt_2/0/error.json", "/logs/run_x/attempt_2/0/heartbeat",
            "/logs/run_x/attempt_2/0/stopped", "/logs/run_x/attempt_2/1/error.json",
            "/logs/run_x/attempt_2/1/heartbeat", "/logs/run_x/attempt_2/1/stopped"});
  const WorkerLaunch& w0 = plan.launches[0];
  const WorkerLaunch& w1 = plan.launches[1];
  CHECK(w0.local_rank == 0);
  CHECK(w0.global_rank == 4);
  CHECK(w1.global_rank == 5);
  CHECK(w0.argv == cfg.worker_argv);
  CHECK(w0.error_file == "/logs/run_x/attempt_2/0/error.json");
  CHECK(w0.heartbeat_file == "/logs/run_x/attempt_2/0/heartbeat");
  CHECK(envOf(w0, "RANK") == "4");
  CHECK(envOf(w1, "LOCAL_RANK") == "1");
  CHECK(envOf(w0, "WORLD_SIZE") == "6");
  CHECK(envOf(w0, "TORCHELASTIC_RESTART_COUNT") == "2");
  CHECK(envOf(w0, "TORCHELASTIC_ERROR_FILE") == w0.error_file);
  CHECK(envOf(w0, "DDPRUN_HEARTBEAT_FILE") == w0.heartbeat_file);
  CHECK(envOf(w0, "DDPRUN_STOP_FILE") == "/logs/run_x/attempt_2/0/stopped");
  CHECK(envOf(w0, "PATH") == "/bin");
  // Rank 0: stderr redirected to a file, nothing tee'd; rank 1: stdout tee'd (per-rank tee).
  CHECK(w0.stdout_file.empty());
  CHECK(w0.stderr_file == "/logs/run_x/attempt_2/0/stderr.log");
  CHECK_FALSE(w0.tee_stdout);
  CHECK(w1.stdout_file == "/logs/run_x/attempt_2/1/stdout.log");
  CHECK(w1.tee_stdout);
  CHECK(w0.to_console);
  CHECK_FALSE(w1.to_console);  // --local-ranks-filter=0
  CHECK(w1.console_prefix == "5>");
}

TEST_CASE("duplicate filters: tee'd streams share one filtered file per attempt", "[agent]") {
  AgentConfig cfg;
  cfg.worker_argv = {"/bin/prog"};
  cfg.tee.per_rank = {{0, StdStreams::kAll}, {1, StdStreams::kErr}};
  cfg.duplicate_stdout_filters = {"loss"};
  cfg.duplicate_stderr_filters = {"Error", "NaN"};
  WorkerPlanner planner(cfg, "/logs/r", "host1", {});
  const AttemptPlan plan = planner.plan(round4And2(1), /*restart_count=*/0);
  REQUIRE(plan.launches.size() == 2);
  const WorkerLaunch& w0 = plan.launches[0];
  const WorkerLaunch& w1 = plan.launches[1];
  CHECK(w0.stdout_filter.file == "/logs/r/attempt_0/filtered_stdout.log");
  CHECK(w0.stdout_filter.needles == std::vector<std::string>{"loss"});
  CHECK(w0.stderr_filter.file == "/logs/r/attempt_0/filtered_stderr.log");
  CHECK(w1.stdout_filter.file.empty());  // rank 1 does not tee stdout
  CHECK(w1.stderr_filter.file == w0.stderr_filter.file);
  CHECK(w1.stderr_filter.needles == std::vector<std::string>{"Error", "NaN"});
  // A previous round's filtered lines go, once each.
  CHECK(std::count(plan.stale_files.begin(), plan.stale_files.end(),
                   "/logs/r/attempt_0/filtered_stdout.log") == 1);
  CHECK(std::count(plan.stale_files.begin(), plan.stale_files.end(),
                   "/logs/r/attempt_0/filtered_stderr.log") == 1);
}

TEST_CASE("without hang detection no heartbeat file is planned", "[agent]") {
  AgentConfig cfg;
  cfg.worker_argv = {"/bin/prog"};
  cfg.heartbeat_timeout = 0;
  WorkerPlanner planner(cfg, "/l", "h", {});
  const AttemptPlan plan = planner.plan(round4And2(0), 0);
  REQUIRE(plan.launches.size() == 4);
  CHECK(plan.stale_files.size() == 8);  // error and stop files, no heartbeat file
  CHECK(plan.stale_files[0] == "/l/attempt_0/0/error.json");
  CHECK(plan.stale_files[1] == "/l/attempt_0/0/stopped");
  CHECK(plan.launches[3].heartbeat_file.empty());
  CHECK(envOf(plan.launches[3], "DDPRUN_HEARTBEAT_FILE") == "<unset>");
  CHECK(plan.launches[3].console_prefix == "[default3]:");
}

TEST_CASE("legacy launch mode gives each worker --local-rank=N after the script", "[agent]") {
  AgentConfig cfg;
  cfg.worker_argv = {"/usr/bin/python3", "-u", "train.py", "--lr=1"};
  cfg.local_rank_arg = "local_rank";
  cfg.local_rank_arg_at = 3;
  WorkerPlanner planner(cfg, "/logs/r", "h", {});
  const AttemptPlan plan = planner.plan(round4And2(0), 0);
  REQUIRE(plan.launches.size() == 4);
  CHECK(plan.launches[2].argv ==
        std::vector<std::string>{"/usr/bin/python3", "-u", "train.py", "--local_rank=2", "--lr=1"});
  cfg.local_rank_arg.clear();
  CHECK(planner.plan(round4And2(0), 0).launches[2].argv == cfg.worker_argv);
}

TEST_CASE("virtual local rank: LOCAL_RANK=0 and one CUDA device per worker", "[agent]") {
  AgentConfig cfg;
  cfg.worker_argv = {"/bin/prog"};
  cfg.virtual_local_rank = true;
  cfg.local_rank_arg = "local-rank";
  cfg.local_rank_arg_at = 1;
  WorkerPlanner mapped(cfg, "/logs/r", "h", {{"CUDA_VISIBLE_DEVICES", "4,5,6,7"}});
  const AttemptPlan plan = mapped.plan(round4And2(0), 0);
  CHECK(envOf(plan.launches[1], "LOCAL_RANK") == "0");
  CHECK(envOf(plan.launches[1], "RANK") == "1");
  CHECK(envOf(plan.launches[1], "CUDA_VISIBLE_DEVICES") == "5");
  CHECK(plan.launches[1].argv == std::vector<std::string>{"/bin/prog", "--local-rank=0"});
  WorkerPlanner plain(cfg, "/logs/r", "h", {});
  CHECK(envOf(plain.plan(round4And2(0), 0).launches[3], "CUDA_VISIBLE_DEVICES") == "3");
  cfg.virtual_local_rank = false;
  CHECK(envOf(plain.plan(round4And2(0), 0).launches[3], "LOCAL_RANK") == "3");
  CHECK(envOf(plain.plan(round4And2(0), 0).launches[3], "CUDA_VISIBLE_DEVICES") == "<unset>");
}

TEST_CASE("numa binding: each worker gets its local rank's CPUs", "[agent]") {
  AgentConfig cfg;
  cfg.worker_argv = {"/bin/prog"};
  cfg.cpu_affinity = {{0, 1}, {2, 3}, {4}, {5}};
  WorkerPlanner planner(cfg, "/logs/r", "h", {});
  const AttemptPlan plan = planner.plan(round4And2(0), 0);
  CHECK(plan.launches[1].cpu_affinity == std::vector<int>{2, 3});
  CHECK(plan.launches[3].cpu_affinity == std::vector<int>{5});
  cfg.cpu_affinity.clear();
  CHECK(planner.plan(round4And2(0), 0).launches[1].cpu_affinity.empty());
}

TEST_CASE("the planner names the handled signals and NCCL's switch for the workers' torch",
          "[agent]") {
  AgentConfig cfg;
  cfg.worker_argv = {"/usr/bin/python3", "-u", "train.py"};
  cfg.signals_to_handle = {SIGTERM, SIGINT, SIGHUP, SIGQUIT};
  WorkerPlanner planner(cfg, "/logs/run_x", "host1", {});
  // Before the probe answered (or for a program that is not Python): both names.
  AttemptPlan plan = planner.plan(round4And2(0), 0);
  CHECK(envOf(plan.launches[0], "TORCHELASTIC_SIGNALS_TO_HANDLE") ==
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT");
  CHECK(envOf(plan.launches[0], "NCCL_ASYNC_ERROR_HANDLING") == "1");
  CHECK(envOf(plan.launches[0], "TORCH_NCCL_ASYNC_ERROR_HANDLING") == "1");
  planner.setTorchVersion(TorchVersion{2, 15});
  plan = planner.plan(round4And2(0), 0);
  CHECK(envOf(plan.launches[0], "NCCL_ASYNC_ERROR_HANDLING") == "<unset>");
  CHECK(envOf(plan.launches[0], "TORCH_NCCL_ASYNC_ERROR_HANDLING") == "1");
}

TEST_CASE(
    "the workers get the control channel, except in a round where another node restarts "
    "processes",
    "[agent][inplace]") {
  AgentConfig cfg;
  cfg.worker_argv = {"/bin/train"};
  WorkerPlanner planner(cfg, "/logs/run_x", "host1", {{"DDPRUN_CONTROL_SOCKET", "/inherited"}});
  CHECK(envOf(planner.plan(round4And2(1), 0).launches[0], "DDPRUN_CONTROL_SOCKET") == "<unset>");
  planner.setControlSocket("/run/ddprun/control.sock");
  RoundInfo round = round4And2(1);
  CHECK(envOf(planner.plan(round, 0).launches[1], "DDPRUN_CONTROL_SOCKET") ==
        "/run/ddprun/control.sock");
  round.in_place_veto = "node 0 of round 2 (m) restarts its workers as processes";
  for (const auto& w : planner.plan(round, 0).launches) {
    CHECK(envOf(w, "DDPRUN_CONTROL_SOCKET") == "<unset>");
  }
  // Every node listens on its channel (a soft veto): the workers get it, to announce support.
  round.in_place_veto_soft = true;
  for (const auto& w : planner.plan(round, 0).launches) {
    CHECK(envOf(w, "DDPRUN_CONTROL_SOCKET") == "/run/ddprun/control.sock");
  }
}
