#include "ddprun/agent/worker_env.h"

#include <numeric>

#include "ddprun/common/status.h"

namespace ddprun::agent {

int baseRank(const std::vector<int>& local_world_sizes, int group_rank) {
  DDPRUN_CHECK(group_rank >= 0 && group_rank < static_cast<int>(local_world_sizes.size()),
               "group rank outside the round");
  return std::accumulate(local_world_sizes.begin(), local_world_sizes.begin() + group_rank, 0);
}

std::map<std::string, std::string> buildWorkerEnv(
    const WorkerEnvInputs& in, int local_rank,
    const std::map<std::string, std::string>& parent_env) {
  const RoundInfo& r = in.round;
  const int local_world_size = r.local_world_sizes.at(r.group_rank);
  const int world_size = std::accumulate(r.local_world_sizes.begin(), r.local_world_sizes.end(), 0);
  const int rank = baseRank(r.local_world_sizes, r.group_rank) + local_rank;

  std::map<std::string, std::string> env = parent_env;
  auto set = [&](const char* k, const std::string& v) { env[k] = v; };
  set("LOCAL_RANK", std::to_string(local_rank));
  set("RANK", std::to_string(rank));
  set("GROUP_RANK", std::to_string(r.group_rank));
  // One role per job: role ranks are the global ranks.
  set("ROLE_RANK", std::to_string(rank));
  set("ROLE_NAME", in.role);
  set("LOCAL_WORLD_SIZE", std::to_string(local_world_size));
  set("WORLD_SIZE", std::to_string(world_size));
  set("GROUP_WORLD_SIZE", std::to_string(r.local_world_sizes.size()));
  set("ROLE_WORLD_SIZE", std::to_string(world_size));
  set("MASTER_ADDR", r.master_addr);
  set("MASTER_PORT", std::to_string(r.master_port));
  set("TORCHELASTIC_RESTART_COUNT", std::to_string(in.restart_count));
  set("TORCHELASTIC_MAX_RESTARTS", std::to_string(in.max_restarts));
  set("TORCHELASTIC_RUN_ID", r.run_id);
  set("TORCHELASTIC_USE_AGENT_STORE", r.use_agent_store ? "True" : "False");
  set("TORCHELASTIC_ERROR_FILE", in.error_file);
  // The parent's value wins, as torchrun does; both spellings carry the same value.
  auto nccl = parent_env.find("TORCH_NCCL_ASYNC_ERROR_HANDLING");
  if (nccl == parent_env.end()) nccl = parent_env.find("NCCL_ASYNC_ERROR_HANDLING");
  const std::string nccl_value = nccl == parent_env.end() ? "1" : nccl->second;
  if (!parent_env.count("NCCL_ASYNC_ERROR_HANDLING")) set("NCCL_ASYNC_ERROR_HANDLING", nccl_value);
  if (!parent_env.count("TORCH_NCCL_ASYNC_ERROR_HANDLING")) {
    set("TORCH_NCCL_ASYNC_ERROR_HANDLING", nccl_value);
  }
  if (in.set_omp_num_threads && !parent_env.count("OMP_NUM_THREADS")) set("OMP_NUM_THREADS", "1");
  set("DDPRUN_MEMBERSHIP_EPOCH", std::to_string(r.membership_epoch));
  if (!in.snapshot_dir.empty()) set("DDPRUN_SNAPSHOT_DIR", in.snapshot_dir);
  if (in.stop_file.empty()) {
    env.erase("DDPRUN_STOP_FILE");
  } else {
    set("DDPRUN_STOP_FILE", in.stop_file);
  }
  if (in.heartbeat_file.empty()) {
    env.erase("DDPRUN_HEARTBEAT_FILE");
  } else {
    set("DDPRUN_HEARTBEAT_FILE", in.heartbeat_file);
  }
  return env;
}

}  // namespace ddprun::agent
