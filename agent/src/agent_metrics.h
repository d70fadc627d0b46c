// The agent's Prometheus metrics (--metrics-port): counters kept from the supervisor's state
// changes, and the text exposition of them. Loop thread only.
#pragma once

#include <string>

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
  void onState(AgentState s, int restart_count, double now);
};

// `snapshots`: the replication's counters when --snapshot-dir is replicated (nullptr: none).
std::string renderMetrics(const AgentConfig& cfg, const Supervisor& sup, const AgentMetrics& m,
                          const RendezvousClient& rdzv,
                          const snapshot::SnapshotMetrics* snapshots = nullptr);

}  // namespace ddprun::agent
