// Host-topology planning for the Gloo communicator's all-reduce: given which host every rank is
// on, decide which ranks share memory and which talk across hosts. A pure function of its inputs
// (no sockets, threads or LibTorch), so every layout is unit-tested (tests/worker_sdk/
// topology_test.cc) apart from the collectives that gather the hosts and build the groups.
//
// The plans, for ranks whose host holds at least two ranks:
// - one host: every rank shares memory (ShmAllReduce does the whole all-reduce);
// - hierarchical: several hosts holding equal numbers of ranks: shared memory within each host,
//   and for each local index one Gloo ring ("column") across the hosts;
// - leaders: several hosts holding unequal numbers of ranks (4 + 2, 2 + 2 + 1): shared memory
//   sums within each host, one representative per host (its lowest rank) runs the Gloo ring
//   across the hosts, and shared memory brings the result back within each host;
// - flat: anything else (a single rank, one rank per host, a rank that opted out of shared
//   memory): Gloo's TCP ring over all ranks.
// Hosts are numbered in order of their lowest rank, and ranks within a host in rank order, so
// every rank computes the same plan from the same all-gathered keys.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ddprun::worker {

// Identifies a host: ranks with equal keys share one (a fingerprint of the host's identity).
using HostKey = uint64_t;
// The key of a rank that does not want shared memory: every rank then takes the flat ring.
constexpr HostKey kOptedOut = 0;

enum class TopologyKind { kFlat, kOneHost, kHierarchical, kLeaders };

struct TopologyPlan {
  TopologyKind kind = TopologyKind::kFlat;
  int num_hosts = 0;
  int host_index = 0;  // this rank's host
  int local_rank = 0;  // this rank's index among its host's ranks
  // Global ranks on this rank's host, ascending (local rank i is host_ranks[i]).
  std::vector<int> host_ranks;
  // Number of ranks on each host, by host index.
  std::vector<int> ranks_per_host;
  // Hierarchical only: the rank with this rank's local index on every host, by host index (this
  // rank's ring across hosts; its position there is host_index). Empty otherwise.
  std::vector<int> cross_host_ranks;
  // Leaders only: each host's representative (its lowest rank), by host index. Empty otherwise.
  std::vector<int> leaders;

  // Leaders only: whether this rank represents its host across hosts.
  bool isLeader() const { return local_rank == 0; }

  // Whether every host holds the same number of ranks.
  bool equalHosts() const;
  // How the all-reduce runs under this plan, for logs and Communicator::describe().
  std::string describe() const;
};

// `host_of_rank[r]` is rank r's host; `my_rank` must index into it (std::invalid_argument if not).
TopologyPlan planTopology(const std::vector<HostKey>& host_of_rank, int my_rank);

}  // namespace ddprun::worker
