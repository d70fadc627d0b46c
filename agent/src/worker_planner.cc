#include "ddprun/agent/worker_planner.h"

#include <algorithm>

#include "ddprun/agent/failure_report.h"
#include "ddprun/common/strings.h"

namespace ddprun::agent {

std::string expandLogLinePrefix(const std::string& templ, const std::string& role, int local_rank,
                                int rank, const std::string& hostname) {
  std::string prefix = templ.empty() ? "[${role_name}${local_rank}]:" : templ;
  prefix = replaceAll(prefix, "${role_name}", role);
  prefix = replaceAll(prefix, "${local_rank}", std::to_string(local_rank));
  prefix = replaceAll(prefix, "${rank}", std::to_string(rank));
  return replaceAll(prefix, "${hostname}", hostname);
}

WorkerPlanner::WorkerPlanner(const AgentConfig& cfg, std::string run_log_dir, std::string hostname,
                             std::map<std::string, std::string> parent_env)
    : cfg_(cfg),
      run_log_dir_(std::move(run_log_dir)),
      hostname_(std::move(hostname)),
      parent_env_(std::move(parent_env)) {}

AttemptPlan WorkerPlanner::plan(const RoundInfo& round, int restart_count) const {
  const std::string attempt_dir = run_log_dir_ + "/attempt_" + std::to_string(restart_count);
  WorkerEnvInputs in;
  in.round = round;
  in.role = cfg_.role;
  in.restart_count = restart_count;
  in.max_restarts = cfg_.max_restarts;
  in.snapshot_dir = cfg_.snapshot_dir;
  in.set_omp_num_threads = cfg_.set_omp_num_threads;
  in.virtual_local_rank = cfg_.virtual_local_rank;
  in.torch_version = torch_version_;
  // A round in which a node under process mode restarts processes forms its groups as process
  // mode does (`/r<round>`, DDPRUN_ROUND): here too, so these workers are not offered the channel.
  // Where every node listens on its channel (a soft veto) they are, and may announce support.
  if (round.in_place_veto.empty() || round.in_place_veto_soft) in.control_socket = control_socket_;
  for (int sig : cfg_.signals_to_handle) {
    in.signals_to_handle += (in.signals_to_handle.empty() ? "" : ",") + signalName(sig);
  }
  const int local_world_size = round.local_world_sizes.at(round.group_rank);
  const int base = baseRank(round.local_world_sizes, round.group_rank);
  AttemptPlan out;
  for (int lr = 0; lr < local_world_size; ++lr) {
    const std::string dir = attempt_dir + "/" + std::to_string(lr);
    out.dirs.push_back(dir);
    WorkerLaunch w;
    w.local_rank = lr;
    w.global_rank = base + lr;
    w.argv = cfg_.worker_argv;
    if (static_cast<size_t>(lr) < cfg_.cpu_affinity.size()) {
      w.cpu_affinity = cfg_.cpu_affinity[static_cast<size_t>(lr)];
    }
    if (!cfg_.local_rank_arg.empty()) {
      // The value LOCAL_RANK has (0 under --virtual-local-rank), so both say the same.
      const int shown = cfg_.virtual_local_rank ? 0 : lr;
      const size_t at = std::min(cfg_.local_rank_arg_at, w.argv.size());
      w.argv.insert(w.argv.begin() + static_cast<long>(at),
                    "--" + cfg_.local_rank_arg + "=" + std::to_string(shown));
    }
    w.error_file = dir + "/error.json";
    in.error_file = w.error_file;
    out.stale_files.push_back(w.error_file);  // a previous round's, in the same attempt
    if (cfg_.heartbeat_timeout > 0) {
      w.heartbeat_file = dir + "/heartbeat";
      out.stale_files.push_back(w.heartbeat_file);
    }
    in.heartbeat_file = w.heartbeat_file;
    w.stop_file = dir + "/stopped";
    out.stale_files.push_back(w.stop_file);
    in.stop_file = w.stop_file;
    for (const auto& [k, v] : buildWorkerEnv(in, lr, parent_env_)) w.env.push_back(k + "=" + v);
    const StdStreams tee = cfg_.tee.forRank(lr);
    const int files = static_cast<int>(cfg_.redirects.forRank(lr)) | static_cast<int>(tee);
    if (files & 1) w.stdout_file = dir + "/stdout.log";
    if (files & 2) w.stderr_file = dir + "/stderr.log";
    w.tee_stdout = hasOut(tee);
    w.tee_stderr = hasErr(tee);
    w.to_console = !cfg_.local_ranks_filter || cfg_.local_ranks_filter->count(lr) > 0;
    w.console_prefix =
        expandLogLinePrefix(cfg_.log_line_prefix_template, cfg_.role, lr, w.global_rank, hostname_);
    if (w.tee_stdout && !cfg_.duplicate_stdout_filters.empty()) {
      w.stdout_filter = {attempt_dir + "/filtered_stdout.log", cfg_.duplicate_stdout_filters};
    }
    if (w.tee_stderr && !cfg_.duplicate_stderr_filters.empty()) {
      w.stderr_filter = {attempt_dir + "/filtered_stderr.log", cfg_.duplicate_stderr_filters};
    }
    out.launches.push_back(std::move(w));
  }
  // The filtered files gather every worker's lines of one round: a previous round's go first.
  for (const auto& w : out.launches) {
    for (const LineFilter* f : {&w.stdout_filter, &w.stderr_filter}) {
      if (!f->file.empty() && std::find(out.stale_files.begin(), out.stale_files.end(), f->file) ==
                                  out.stale_files.end()) {
        out.stale_files.push_back(f->file);
      }
    }
  }
  return out;
}

}  // namespace ddprun::agent
