// The agent's Prometheus metrics (--metrics-port): counters kept from the supervisor's state
// changes, and the text exposition of them. Loop thread only.
#pragma once

#include <cstdint>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "ddprun/agent/config.h"
#include "ddprun/agent/rendezvous_client.h"
#include "ddprun/agent/supervisor.h"
#include "ddprun/snapshot/core.h"

namespace ddprun::agent {

// Counters behind /metrics, updated from the supervisor's state changes.
struct AgentMetrics {
  AgentState last = AgentState::kInit;
  int failures = 0;            // restarts charged (worker failures here or elsewhere)
  int membership_changes = 0;  // free restarts
  double last_change = 0;      // unix seconds of the last state change
  int last_restart_count = 0;
  bool recovering = false;  // an in-place recovery began since the last RUNNING
  void onState(AgentState s, int restart_count, double now);

  // In-place recoveries: how each ended, and each phase's duration (a histogram per phase).
  static constexpr double kPhaseBuckets[] = {0.001, 0.005, 0.01, 0.05, 0.1, 0.25,
                                             0.5,   1,     2.5,  5,    10,  60};
  struct Histogram {
    std::vector<std::uint64_t> counts = std::vector<std::uint64_t>(std::size(kPhaseBuckets), 0);
    std::uint64_t total = 0;
    double sum = 0;
  };
  int inplace_recovered = 0;
  int inplace_fallbacks = 0;
  std::map<std::string, Histogram> inplace_phases;  // by phase name
  void onInPlaceRecovery(const InPlaceRecovery& recovery);
};

// `snapshots`: the replication's counters when --snapshot-dir is replicated (nullptr: none).
std::string renderMetrics(const AgentConfig& cfg, const Supervisor& sup, const AgentMetrics& m,
                          const RendezvousClient& rdzv,
                          const snapshot::SnapshotMetrics* snapshots = nullptr);

}  // namespace ddprun::agent
