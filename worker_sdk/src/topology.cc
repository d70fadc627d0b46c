#include "topology.h"

#include <algorithm>
#include <stdexcept>

namespace ddprun::worker {

bool TopologyPlan::equalHosts() const {
  return std::all_of(ranks_per_host.begin(), ranks_per_host.end(),
                     [&](int n) { return n == ranks_per_host.front(); });
}

std::string TopologyPlan::describe() const {
  switch (kind) {
    case TopologyKind::kOneHost:
      return "shared memory (" + std::to_string(host_ranks.size()) + " ranks on one host)";
    case TopologyKind::kHierarchical:
      return "shared memory within each of " + std::to_string(num_hosts) + " hosts (" +
             std::to_string(host_ranks.size()) + " ranks each) + gloo TCP rings across hosts";
    case TopologyKind::kLeaders: {
      std::string layout;
      for (int n : ranks_per_host) layout += (layout.empty() ? "" : "+") + std::to_string(n);
      return "shared memory within each of " + std::to_string(num_hosts) + " hosts (" + layout +
             " ranks) + a gloo TCP ring of one representative per host";
    }
    case TopologyKind::kFlat:
      break;
  }
  return "gloo TCP ring";
}

TopologyPlan planTopology(const std::vector<HostKey>& host_of_rank, int my_rank) {
  const int size = static_cast<int>(host_of_rank.size());
  if (my_rank < 0 || my_rank >= size) {
    throw std::invalid_argument("planTopology: rank " + std::to_string(my_rank) +
                                " is outside a group of " + std::to_string(size));
  }
  TopologyPlan plan;
  // Hosts in order of their lowest rank; each rank's host index and local index.
  std::vector<HostKey> hosts;
  std::vector<int> host_index(static_cast<size_t>(size));
  std::vector<int> local_rank(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) {
    const HostKey key = host_of_rank[static_cast<size_t>(r)];
    auto it = std::find(hosts.begin(), hosts.end(), key);
    const auto h = static_cast<size_t>(it - hosts.begin());
    if (it == hosts.end()) {
      hosts.push_back(key);
      plan.ranks_per_host.push_back(0);
    }
    host_index[static_cast<size_t>(r)] = static_cast<int>(h);
    local_rank[static_cast<size_t>(r)] = plan.ranks_per_host[h]++;
  }
  plan.num_hosts = static_cast<int>(hosts.size());
  plan.host_index = host_index[static_cast<size_t>(my_rank)];
  plan.local_rank = local_rank[static_cast<size_t>(my_rank)];
  for (int r = 0; r < size; ++r) {
    if (host_index[static_cast<size_t>(r)] == plan.host_index) plan.host_ranks.push_back(r);
  }
  const bool opted_out =
      std::find(host_of_rank.begin(), host_of_rank.end(), kOptedOut) != host_of_rank.end();
  const bool shared = std::any_of(plan.ranks_per_host.begin(), plan.ranks_per_host.end(),
                                  [](int n) { return n > 1; });
  if (opted_out || !shared) return plan;  // flat
  if (!plan.equalHosts()) {
    plan.kind = TopologyKind::kLeaders;
    plan.leaders.assign(hosts.size(), -1);
    for (int r = size - 1; r >= 0; --r) {
      plan.leaders[static_cast<size_t>(host_index[static_cast<size_t>(r)])] = r;
    }
    return plan;
  }
  if (plan.num_hosts == 1) {
    plan.kind = TopologyKind::kOneHost;
    return plan;
  }
  plan.kind = TopologyKind::kHierarchical;
  plan.cross_host_ranks.assign(hosts.size(), -1);
  for (int r = 0; r < size; ++r) {
    if (local_rank[static_cast<size_t>(r)] == plan.local_rank) {
      plan.cross_host_ranks[static_cast<size_t>(host_index[static_cast<size_t>(r)])] = r;
    }
  }
  return plan;
}

}  // namespace ddprun::worker
