#include "agent_metrics.h"

#include <cstdio>

namespace ddprun::agent {

void AgentMetrics::onState(AgentState s, int restart_count, double now) {
  if (s == AgentState::kRestarting || s == AgentState::kRendezvous) {
    if (last == AgentState::kStopping) {
      if (restart_count > last_restart_count) {
        ++failures;
      } else if (recovering) {
        ++inplace_fallbacks;  // the failure was counted when the recovery began
      } else {
        ++membership_changes;
      }
    }
  }
  if (s == AgentState::kRecovering) {
    ++failures;
    recovering = true;
    last_restart_count = restart_count;
  }
  if (s == AgentState::kRunning) {
    if (recovering && last == AgentState::kRecovering) ++inplace_recovered;
    recovering = false;
    last_restart_count = restart_count;
  }
  last = s;
  last_change = now;
}

void AgentMetrics::onInPlaceRecovery(const InPlaceRecovery& recovery) {
  for (const auto& [phase, ms] : recovery.phases_ms) {
    Histogram& h = inplace_phases[phase];
    const double seconds = ms / 1000.0;
    for (size_t i = 0; i < std::size(kPhaseBuckets); ++i) {
      if (seconds <= kPhaseBuckets[i]) ++h.counts[i];
    }
    ++h.total;
    h.sum += seconds;
  }
}

namespace {

std::string renderPhaseHistograms(const AgentMetrics& m) {
  std::string out =
      "# HELP ddprun_agent_inplace_phase_seconds Phases of in-place recoveries, from the failure "
      "first seen here (a local worker's collective, or this agent).\n"
      "# TYPE ddprun_agent_inplace_phase_seconds histogram\n";
  char line[256];
  for (const auto& [phase, h] : m.inplace_phases) {
    for (size_t i = 0; i < std::size(AgentMetrics::kPhaseBuckets); ++i) {
      std::snprintf(line, sizeof(line),
                    "ddprun_agent_inplace_phase_seconds_bucket{phase=\"%s\",le=\"%g\"} %llu\n",
                    phase.c_str(), AgentMetrics::kPhaseBuckets[i],
                    static_cast<unsigned long long>(h.counts[i]));
      out += line;
    }
    std::snprintf(line, sizeof(line),
                  "ddprun_agent_inplace_phase_seconds_bucket{phase=\"%s\",le=\"+Inf\"} %llu\n"
                  "ddprun_agent_inplace_phase_seconds_sum{phase=\"%s\"} %.17g\n"
                  "ddprun_agent_inplace_phase_seconds_count{phase=\"%s\"} %llu\n",
                  phase.c_str(), static_cast<unsigned long long>(h.total), phase.c_str(), h.sum,
                  phase.c_str(), static_cast<unsigned long long>(h.total));
    out += line;
  }
  return out;
}

}  // namespace

std::string renderMetrics(const AgentConfig& cfg, const Supervisor& sup, const AgentMetrics& m,
                          const RendezvousClient& rdzv,
                          const snapshot::SnapshotMetrics* snapshots) {
  std::string out;
  auto add = [&](const std::string& name, const std::string& help, const std::string& type,
                 double value, const std::string& labels = "") {
    out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.17g", value);
    out += name + labels + " " + buf + "\n";
  };
  add("ddprun_agent_round", "Rendezvous round this node's workers run in.", "gauge",
      static_cast<double>(rdzv.currentRound()));
  add("ddprun_agent_group_rank", "Group rank of this node in the round.", "gauge", sup.groupRank());
  add("ddprun_agent_world_size", "WORLD_SIZE of the round.", "gauge", sup.worldSize());
  add("ddprun_agent_local_world_size", "Workers on this node.", "gauge", cfg.nproc_per_node);
  add("ddprun_agent_workers_running", "Workers of this node running now.", "gauge",
      sup.runningWorkers());
  std::string states;
  for (auto s : {AgentState::kInit, AgentState::kRendezvous, AgentState::kRunning,
                 AgentState::kRecovering, AgentState::kStopping, AgentState::kRestarting,
                 AgentState::kExitBarrier, AgentState::kSucceeded, AgentState::kFailed}) {
    char line[128];
    std::snprintf(line, sizeof(line), "ddprun_agent_state{state=\"%s\"} %d\n", agentStateName(s),
                  sup.state() == s ? 1 : 0);
    states += line;
  }
  out +=
      "# HELP ddprun_agent_state Current state of the agent (1 for the current one).\n"
      "# TYPE ddprun_agent_state gauge\n" +
      states;
  add("ddprun_agent_restarts_total", "Restarts charged against --max-restarts.", "counter",
      sup.restartCount());
  add("ddprun_agent_failures_total", "Worker-group failures (here or on another node).", "counter",
      m.failures);
  add("ddprun_agent_membership_changes_total", "Restarts caused by nodes joining or leaving.",
      "counter", m.membership_changes);
  out +=
      "# HELP ddprun_agent_inplace_recoveries_total In-place recoveries (--restart-mode=in-place) "
      "by outcome.\n# TYPE ddprun_agent_inplace_recoveries_total counter\n"
      "ddprun_agent_inplace_recoveries_total{outcome=\"in_place\"} " +
      std::to_string(m.inplace_recovered) +
      "\nddprun_agent_inplace_recoveries_total{outcome=\"fallback\"} " +
      std::to_string(m.inplace_fallbacks) + "\n";
  out += renderPhaseHistograms(m);
  add("ddprun_agent_last_change_timestamp_seconds", "Unix time of the last state change.", "gauge",
      m.last_change);
  if (snapshots != nullptr) {
    const snapshot::SnapshotMetrics& s = *snapshots;
    add("ddprun_snapshot_versions_replicated_total",
        "Snapshot versions fetched from other nodes and renamed into place.", "counter",
        static_cast<double>(s.versions_fetched));
    add("ddprun_snapshot_bytes_replicated_total", "Bytes of snapshot versions fetched.", "counter",
        static_cast<double>(s.bytes_fetched));
    add("ddprun_snapshot_versions_written_total",
        "Snapshot versions this node's workers completed (announced to the others).", "counter",
        static_cast<double>(s.versions_written));
    add("ddprun_snapshot_versions_copied_locally_total",
        "Snapshot versions another node renamed, copied here from this node's own file of the "
        "old name instead of fetched.",
        "counter", static_cast<double>(s.versions_copied));
    add("ddprun_snapshot_transfer_failures_total",
        "Snapshot fetches that failed (corrupt, no space, source gone).", "counter",
        static_cast<double>(s.transfer_failures));
    add("ddprun_snapshot_replication_lag_seconds",
        "From learning of a version to holding it, for the last fetch.", "gauge",
        s.last_lag_seconds);
    add("ddprun_snapshot_newest_version", "Highest snapshot version held here.", "gauge",
        static_cast<double>(s.newest_version));
  }
  return out;
}

}  // namespace ddprun::agent
