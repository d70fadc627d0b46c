#include "ddprun/agent/worker_env.h"

#include <numeric>

#include "ddprun/common/status.h"
#include "ddprun/common/strings.h"

namespace ddprun::agent {

std::optional<TorchVersion> parseTorchVersion(const std::string& text) {
  // Digits, '.', digits; what follows the minor version (".0a0+gitunknown") does not matter.
  const std::string t = trim(text);
  size_t i = 0;
  auto number = [&]() -> std::optional<int> {
    const size_t start = i;
    while (i < t.size() && i - start < 6 && t[i] >= '0' && t[i] <= '9') ++i;
    if (i == start || (i < t.size() && t[i] >= '0' && t[i] <= '9')) return std::nullopt;
    return std::stoi(t.substr(start, i - start));
  };
  const auto major = number();
  if (!major || i >= t.size() || t[i] != '.') return std::nullopt;
  ++i;
  const auto minor = number();
  if (!minor) return std::nullopt;
  return TorchVersion{*major, *minor};
}

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
  // The parent's value wins, as torchrun does; the name is the one the workers' torch reads
  // (both when the version is unknown), with the value of either name the parent set.
  auto nccl = parent_env.find("TORCH_NCCL_ASYNC_ERROR_HANDLING");
  if (nccl == parent_env.end()) nccl = parent_env.find("NCCL_ASYNC_ERROR_HANDLING");
  const std::string nccl_value = nccl == parent_env.end() ? "1" : nccl->second;
  const auto& torch = in.torch_version;
  const bool current = !torch || torch->major > 2 || (torch->major == 2 && torch->minor >= 2);
  const bool legacy = !torch || !current;
  if (legacy && !parent_env.count("NCCL_ASYNC_ERROR_HANDLING")) {
    set("NCCL_ASYNC_ERROR_HANDLING", nccl_value);
  }
  if (current && !parent_env.count("TORCH_NCCL_ASYNC_ERROR_HANDLING")) {
    set("TORCH_NCCL_ASYNC_ERROR_HANDLING", nccl_value);
  }
  if (!in.signals_to_handle.empty()) set("TORCHELASTIC_SIGNALS_TO_HANDLE", in.signals_to_handle);
  if (in.set_omp_num_threads && !parent_env.count("OMP_NUM_THREADS")) set("OMP_NUM_THREADS", "1");
  if (in.virtual_local_rank) {
    std::string device = std::to_string(local_rank);
    if (auto visible = parent_env.find("CUDA_VISIBLE_DEVICES"); visible != parent_env.end()) {
      auto devices = split(visible->second, ',');
      if (local_rank < static_cast<int>(devices.size())) device = trim(devices[local_rank]);
    }
    set("LOCAL_RANK", "0");
    set("CUDA_VISIBLE_DEVICES", device);
  }
  set("DDPRUN_MEMBERSHIP_EPOCH", std::to_string(r.membership_epoch));
  // The same on every node of the round, unlike TORCHELASTIC_RESTART_COUNT (a node that joined
  // after a restart counts from 0): the worker SDK keys its group's store entries by it.
  set("DDPRUN_ROUND", std::to_string(r.round));
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
  // An inherited channel is some other agent's (ddprun under ddprun): never the workers'.
  if (in.control_socket.empty()) {
    env.erase("DDPRUN_CONTROL_SOCKET");
  } else {
    set("DDPRUN_CONTROL_SOCKET", in.control_socket);
  }
  return env;
}

}  // namespace ddprun::agent
