// WorkerPlanner: what the agent starts for one attempt of a round — each worker's argv, its
// environment (SPEC §3), log files, heartbeat file and console prefix — as plain values. Pure:
// it creates no directory and touches no file; the agent's shell prepares what the plan names
// (AttemptPlan::dirs, stale_files) before spawning. Thread-compatible; holds a reference to the
// config, which must outlive it.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "ddprun/agent/config.h"
#include "ddprun/agent/process.h"
#include "ddprun/agent/worker_env.h"

namespace ddprun::agent {

struct AttemptPlan {
  std::vector<WorkerLaunch> launches;  // in local-rank order
  std::vector<std::string> dirs;       // to create (with parents) before spawning
  // Files of an earlier round in the same attempt directory that must be gone first: a new
  // round after a membership change reuses the directory, and the previous workers' heartbeat
  // file must not arm (or hang) the new worker before it touched it itself, nor their stop file
  // make its exit look like a stop.
  std::vector<std::string> stale_files;
};

// torchrun's --log-line-prefix-template with ${role_name}, ${local_rank}, ${rank} and
// ${hostname} substituted; an empty template is torchrun's default "[${role_name}${local_rank}]:".
std::string expandLogLinePrefix(const std::string& templ, const std::string& role, int local_rank,
                                int rank, const std::string& hostname);

class WorkerPlanner {
 public:
  WorkerPlanner(const AgentConfig& cfg, std::string run_log_dir, std::string hostname,
                std::map<std::string, std::string> parent_env);

  // The launches of `round` for attempt `restart_count` (TORCHELASTIC_RESTART_COUNT), with logs
  // under <run_log_dir>/attempt_<n>/<local_rank>/.
  AttemptPlan plan(const RoundInfo& round, int restart_count) const;

  // The workers' PyTorch, once known (WorkerEnvInputs::torch_version).
  void setTorchVersion(std::optional<TorchVersion> version) { torch_version_ = version; }
  // The agent's control channel (--restart-mode=in-place), once it listens; offered to the
  // workers of every round but one with a hard veto (in_place_veto, not in_place_veto_soft: a
  // node that does not listen on a channel).
  void setControlSocket(std::string path) { control_socket_ = std::move(path); }

 private:
  const AgentConfig& cfg_;
  std::string run_log_dir_;
  std::string hostname_;
  std::map<std::string, std::string> parent_env_;
  std::optional<TorchVersion> torch_version_;
  std::string control_socket_;
};

}  // namespace ddprun::agent
