#include "ddprun/agent/worker_env.h"

#include <catch2/catch.hpp>

using namespace ddprun::agent;

namespace {
WorkerEnvInputs inputs(std::vector<int> sizes, int group_rank) {
  WorkerEnvInputs in;
  in.round.local_world_sizes = std::move(sizes);
  in.round.group_rank = group_rank;
  in.round.master_addr = "node0";
  in.round.master_port = 29500;
  in.round.run_id = "job";
  in.role = "trainer";
  in.restart_count = 2;
  in.max_restarts = 3;
  in.error_file = "/logs/error.json";
  return in;
}
}  // namespace

TEST_CASE("worker env carries torchrun's variables with torchrun's values", "[agent]") {
  auto env = buildWorkerEnv(inputs({2, 2}, 1), 1, {{"PATH", "/bin"}});
  CHECK(env["LOCAL_RANK"] == "1");
  CHECK(env["RANK"] == "3");
  CHECK(env["GROUP_RANK"] == "1");
  CHECK(env["ROLE_RANK"] == "3");
  CHECK(env["ROLE_NAME"] == "trainer");
  CHECK(env["LOCAL_WORLD_SIZE"] == "2");
  CHECK(env["WORLD_SIZE"] == "4");
  CHECK(env["GROUP_WORLD_SIZE"] == "2");
  CHECK(env["ROLE_WORLD_SIZE"] == "4");
  CHECK(env["MASTER_ADDR"] == "node0");
  CHECK(env["MASTER_PORT"] == "29500");
  CHECK(env["TORCHELASTIC_RESTART_COUNT"] == "2");
  CHECK(env["TORCHELASTIC_MAX_RESTARTS"] == "3");
  CHECK(env["TORCHELASTIC_RUN_ID"] == "job");
  CHECK(env["TORCHELASTIC_USE_AGENT_STORE"] == "False");
  CHECK(env["TORCHELASTIC_ERROR_FILE"] == "/logs/error.json");
  CHECK(env["NCCL_ASYNC_ERROR_HANDLING"] == "1");
  CHECK(env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1");
  CHECK(env["PATH"] == "/bin");  // the agent's own environment passes through
  CHECK(env.count("OMP_NUM_THREADS") == 0);
  CHECK(env.count("DDPRUN_SNAPSHOT_DIR") == 0);
  CHECK(env.count("DDPRUN_HEARTBEAT_FILE") == 0);
}

TEST_CASE("nodes of different sizes get contiguous rank blocks", "[agent]") {
  // A 4-worker node and a 2-worker node: ranks 0-3 and 4-5.
  auto in = inputs({4, 2}, 1);
  CHECK(buildWorkerEnv(in, 0, {})["RANK"] == "4");
  CHECK(buildWorkerEnv(in, 1, {})["RANK"] == "5");
  CHECK(buildWorkerEnv(in, 1, {})["WORLD_SIZE"] == "6");
  CHECK(buildWorkerEnv(in, 1, {})["LOCAL_WORLD_SIZE"] == "2");
  CHECK(buildWorkerEnv(inputs({4, 2}, 0), 3, {})["RANK"] == "3");
}

TEST_CASE("the parent's NCCL error handling and OMP settings win", "[agent]") {
  auto in = inputs({2}, 0);
  in.set_omp_num_threads = true;
  auto env = buildWorkerEnv(in, 0, {{"NCCL_ASYNC_ERROR_HANDLING", "0"}});
  CHECK(env["NCCL_ASYNC_ERROR_HANDLING"] == "0");
  CHECK(env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0");
  CHECK(env["OMP_NUM_THREADS"] == "1");
  auto kept = buildWorkerEnv(in, 0, {{"OMP_NUM_THREADS", "4"}});
  CHECK(kept["OMP_NUM_THREADS"] == "4");
}

TEST_CASE("ddprun's own variables tell membership epoch, round and snapshot dir", "[agent]") {
  auto in = inputs({1}, 0);
  in.round.membership_epoch = 7;
  in.round.round = 12;
  in.restart_count = 3;
  in.snapshot_dir = "/snap";
  auto env = buildWorkerEnv(in, 0, {{"DDPRUN_ROUND", "99"}});
  CHECK(env["DDPRUN_MEMBERSHIP_EPOCH"] == "7");
  CHECK(env["DDPRUN_ROUND"] == "12");
  CHECK(env["TORCHELASTIC_RESTART_COUNT"] == "3");
  CHECK(env["DDPRUN_SNAPSHOT_DIR"] == "/snap");
}

TEST_CASE("each worker gets its own heartbeat file, and none when hang detection is off",
          "[agent]") {
  auto in = inputs({2}, 0);
  in.heartbeat_file = "/logs/run/attempt_0/1/heartbeat";
  auto env = buildWorkerEnv(in, 1, {{"DDPRUN_HEARTBEAT_FILE", "/parent/heartbeat"}});
  CHECK(env["DDPRUN_HEARTBEAT_FILE"] == "/logs/run/attempt_0/1/heartbeat");
  // Off: an inherited file (the agent itself runs as someone's worker) is not passed on, or
  // every worker here would keep that other worker looking alive.
  in.heartbeat_file.clear();
  auto off = buildWorkerEnv(in, 1, {{"DDPRUN_HEARTBEAT_FILE", "/parent/heartbeat"}});
  CHECK(off.count("DDPRUN_HEARTBEAT_FILE") == 0);
}

TEST_CASE("torch versions are read from what pip and Debian report", "[agent]") {
  auto v = parseTorchVersion("2.15.0+cu132\n");
  REQUIRE(v);
  CHECK(v->major == 2);
  CHECK(v->minor == 15);
  v = parseTorchVersion("1.13.0a0+gitunknown");
  REQUIRE(v);
  CHECK(v->major == 1);
  CHECK(v->minor == 13);
  v = parseTorchVersion("2.2");
  REQUIRE(v);
  CHECK(v->minor == 2);
  for (const char* bad : {"", "2", "2.", ".2", "x2.1", "2.x", "torch 2.1", "99999999.1",
                          "Traceback (most recent call last):"}) {
    INFO(bad);
    CHECK_FALSE(parseTorchVersion(bad));
  }
}

TEST_CASE("NCCL's error handling switch has the name the workers' torch reads", "[agent]") {
  auto in = inputs({2}, 0);
  // torch >= 2.2 reads TORCH_NCCL_ASYNC_ERROR_HANDLING and warns about the old name on every rank.
  in.torch_version = TorchVersion{2, 15};
  auto env = buildWorkerEnv(in, 0, {});
  CHECK(env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1");
  CHECK(env.count("NCCL_ASYNC_ERROR_HANDLING") == 0);
  in.torch_version = TorchVersion{2, 2};
  CHECK(buildWorkerEnv(in, 0, {}).count("NCCL_ASYNC_ERROR_HANDLING") == 0);
  // torch 1.13 (and 2.0, 2.1) reads only the old name: error handling stays on.
  for (TorchVersion old : {TorchVersion{1, 13}, TorchVersion{2, 1}}) {
    in.torch_version = old;
    env = buildWorkerEnv(in, 0, {});
    CHECK(env["NCCL_ASYNC_ERROR_HANDLING"] == "1");
    CHECK(env.count("TORCH_NCCL_ASYNC_ERROR_HANDLING") == 0);
  }
  // The parent's value travels under the right name; a name the parent set itself passes as is.
  in.torch_version = TorchVersion{2, 15};
  env = buildWorkerEnv(in, 0, {{"NCCL_ASYNC_ERROR_HANDLING", "0"}});
  CHECK(env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0");
  CHECK(env["NCCL_ASYNC_ERROR_HANDLING"] == "0");  // the user's own, as torchrun passes it
  in.torch_version = TorchVersion{1, 13};
  env = buildWorkerEnv(in, 0, {{"TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"}});
  CHECK(env["NCCL_ASYNC_ERROR_HANDLING"] == "3");
}

TEST_CASE("the handled signals reach the workers as torchrun 2.x names them", "[agent]") {
  auto in = inputs({1}, 0);
  CHECK(buildWorkerEnv(in, 0, {}).count("TORCHELASTIC_SIGNALS_TO_HANDLE") == 0);
  in.signals_to_handle = "SIGTERM,SIGINT,SIGHUP,SIGQUIT";
  CHECK(buildWorkerEnv(
            in, 0,
            {{"TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGUSR2"}})["TORCHELASTIC_SIGNALS_TO_HANDLE"] ==
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT");
}
