// planTopology (worker_sdk/src/topology.h): which ranks share memory and which all-reduce across
// hosts, from the hosts the ranks are on. Pure: no sockets, no threads.
#include "topology.h"

#include <catch2/catch.hpp>
#include <set>
#include <stdexcept>
#include <vector>

#include "allreduce_route.h"

using ddprun::worker::HostKey;
using ddprun::worker::planTopology;
using ddprun::worker::TopologyKind;
using ddprun::worker::TopologyPlan;

namespace {
constexpr HostKey kA = 0xa;
constexpr HostKey kB = 0xb;
constexpr HostKey kC = 0xc;
}  // namespace

TEST_CASE("a single rank all-reduces over the plain ring", "[worker][topology]") {
  const TopologyPlan plan = planTopology({kA}, 0);
  CHECK(plan.kind == TopologyKind::kFlat);
  CHECK(plan.num_hosts == 1);
  CHECK(plan.host_ranks == std::vector<int>{0});
  CHECK(plan.cross_host_ranks.empty());
  CHECK(plan.describe() == "gloo TCP ring");
}

TEST_CASE("ranks that all share one host all-reduce over shared memory", "[worker][topology]") {
  const std::vector<HostKey> hosts{kA, kA, kA, kA};
  for (int rank = 0; rank < 4; ++rank) {
    const TopologyPlan plan = planTopology(hosts, rank);
    CHECK(plan.kind == TopologyKind::kOneHost);
    CHECK(plan.num_hosts == 1);
    CHECK(plan.host_index == 0);
    CHECK(plan.local_rank == rank);
    CHECK(plan.host_ranks == std::vector<int>{0, 1, 2, 3});
    CHECK(plan.cross_host_ranks.empty());
    CHECK(plan.describe() == "shared memory (4 ranks on one host)");
  }
}

TEST_CASE("two hosts of two ranks each share memory within and ring across per local index",
          "[worker][topology]") {
  const std::vector<HostKey> hosts{kA, kA, kB, kB};
  const TopologyPlan plan = planTopology(hosts, 3);
  CHECK(plan.kind == TopologyKind::kHierarchical);
  CHECK(plan.num_hosts == 2);
  CHECK(plan.host_index == 1);
  CHECK(plan.local_rank == 1);
  CHECK(plan.host_ranks == std::vector<int>{2, 3});
  CHECK(plan.ranks_per_host == std::vector<int>{2, 2});
  CHECK(plan.cross_host_ranks == std::vector<int>{1, 3});
  CHECK(plan.describe() ==
        "shared memory within each of 2 hosts (2 ranks each) + gloo TCP rings across hosts");

  const TopologyPlan first = planTopology(hosts, 0);
  CHECK(first.host_index == 0);
  CHECK(first.local_rank == 0);
  CHECK(first.host_ranks == std::vector<int>{0, 1});
  CHECK(first.cross_host_ranks == std::vector<int>{0, 2});
}

TEST_CASE("hosts holding unequal numbers of ranks (4 + 2) go through one leader per host",
          "[worker][topology]") {
  const std::vector<HostKey> hosts{kA, kA, kA, kA, kB, kB};
  for (int rank = 0; rank < 6; ++rank) {
    const TopologyPlan plan = planTopology(hosts, rank);
    CHECK(plan.kind == TopologyKind::kLeaders);
    CHECK_FALSE(plan.equalHosts());
    CHECK(plan.cross_host_ranks.empty());
    CHECK(plan.leaders == std::vector<int>{0, 4});
    CHECK(plan.isLeader() == (rank == 0 || rank == 4));
    CHECK(plan.describe() ==
          "shared memory within each of 2 hosts (4+2 ranks) + a gloo TCP ring of one "
          "representative per host");
  }
  const TopologyPlan plan = planTopology(hosts, 5);
  CHECK(plan.num_hosts == 2);
  CHECK(plan.ranks_per_host == std::vector<int>{4, 2});
  CHECK(plan.host_ranks == std::vector<int>{4, 5});
  CHECK(plan.local_rank == 1);
}

TEST_CASE("uneven layouts with a host of one rank, interleaved ranks", "[worker][topology]") {
  // 2 + 2 + 1, and 3 + 1 with the lone host's rank in the middle.
  const std::vector<HostKey> five{kA, kA, kB, kB, kC};
  const TopologyPlan lone = planTopology(five, 4);
  CHECK(lone.kind == TopologyKind::kLeaders);
  CHECK(lone.leaders == std::vector<int>{0, 2, 4});
  CHECK(lone.isLeader());
  CHECK(lone.host_ranks == std::vector<int>{4});
  const std::vector<HostKey> four{kA, kB, kA, kA};
  for (int rank = 0; rank < 4; ++rank) {
    const TopologyPlan plan = planTopology(four, rank);
    CHECK(plan.kind == TopologyKind::kLeaders);
    CHECK(plan.leaders == std::vector<int>{0, 1});
    CHECK(plan.ranks_per_host == std::vector<int>{3, 1});
  }
  CHECK(planTopology(four, 3).host_ranks == std::vector<int>{0, 2, 3});
  CHECK_FALSE(planTopology(four, 3).isLeader());
}

TEST_CASE("one rank per host has nothing to share and uses the plain ring", "[worker][topology]") {
  const std::vector<HostKey> hosts{kA, kB, kC};
  for (int rank = 0; rank < 3; ++rank) {
    const TopologyPlan plan = planTopology(hosts, rank);
    CHECK(plan.kind == TopologyKind::kFlat);
    CHECK(plan.equalHosts());
    CHECK(plan.num_hosts == 3);
    CHECK(plan.host_index == rank);
    CHECK(plan.local_rank == 0);
    CHECK(plan.host_ranks == std::vector<int>{rank});
  }
}

TEST_CASE("ranks interleaved across hosts are grouped by host, in rank order",
          "[worker][topology]") {
  // Ranks 0, 2, 4 on A; 1, 3, 5 on B.
  const std::vector<HostKey> hosts{kA, kB, kA, kB, kA, kB};
  const TopologyPlan plan = planTopology(hosts, 4);
  CHECK(plan.kind == TopologyKind::kHierarchical);
  CHECK(plan.host_index == 0);
  CHECK(plan.local_rank == 2);
  CHECK(plan.host_ranks == std::vector<int>{0, 2, 4});
  CHECK(plan.cross_host_ranks == std::vector<int>{4, 5});

  const TopologyPlan other = planTopology(hosts, 1);
  CHECK(other.host_index == 1);
  CHECK(other.local_rank == 0);
  CHECK(other.host_ranks == std::vector<int>{1, 3, 5});
  CHECK(other.cross_host_ranks == std::vector<int>{0, 1});
}

TEST_CASE("hosts are numbered by their lowest rank, not by their keys", "[worker][topology]") {
  const std::vector<HostKey> hosts{kC, kC, kA, kA};
  const TopologyPlan plan = planTopology(hosts, 1);
  CHECK(plan.host_index == 0);
  CHECK(plan.cross_host_ranks == std::vector<int>{1, 3});
  CHECK(planTopology(hosts, 2).host_index == 1);
}

TEST_CASE("a rank that opts out poses as a host of its own and every rank falls back",
          "[worker][topology]") {
  // Rank 2 of four on one host does not want shared memory.
  const std::vector<HostKey> hosts{kA, kA, ddprun::worker::kOptedOut, kA};
  for (int rank = 0; rank < 4; ++rank) {
    CHECK(planTopology(hosts, rank).kind == TopologyKind::kFlat);
  }
}

TEST_CASE("every rank of a layout derives the same host groups and cross-host rings",
          "[worker][topology]") {
  // Three hosts of three ranks, shuffled: A B C C A B B C A.
  const std::vector<HostKey> hosts{kA, kB, kC, kC, kA, kB, kB, kC, kA};
  const int size = static_cast<int>(hosts.size());
  std::set<std::vector<int>> groups;
  std::set<std::vector<int>> rings;
  for (int rank = 0; rank < size; ++rank) {
    const TopologyPlan plan = planTopology(hosts, rank);
    REQUIRE(plan.kind == TopologyKind::kHierarchical);
    CHECK(plan.host_ranks.at(static_cast<size_t>(plan.local_rank)) == rank);
    CHECK(plan.cross_host_ranks.at(static_cast<size_t>(plan.host_index)) == rank);
    for (int peer : plan.host_ranks) CHECK(hosts[static_cast<size_t>(peer)] == hosts[rank]);
    // My ring partners agree on the ring and hold my local index on their hosts.
    for (int peer : plan.cross_host_ranks) {
      const TopologyPlan theirs = planTopology(hosts, peer);
      CHECK(theirs.cross_host_ranks == plan.cross_host_ranks);
      CHECK(theirs.local_rank == plan.local_rank);
    }
    groups.insert(plan.host_ranks);
    rings.insert(plan.cross_host_ranks);
  }
  // Three host groups and three rings, each partitioning the nine ranks.
  CHECK(groups == std::set<std::vector<int>>{{0, 4, 8}, {1, 5, 6}, {2, 3, 7}});
  CHECK(rings == std::set<std::vector<int>>{{0, 1, 2}, {4, 5, 3}, {8, 6, 7}});
}

TEST_CASE("a rank outside the group is a programming error", "[worker][topology]") {
  CHECK_THROWS_AS(planTopology({kA, kA}, 2), std::invalid_argument);
  CHECK_THROWS_AS(planTopology({kA, kA}, -1), std::invalid_argument);
  CHECK_THROWS_AS(planTopology({}, 0), std::invalid_argument);
}

TEST_CASE("each all_reduce call takes the route its group's plan and its dtype allow",
          "[worker][topology]") {
  using ddprun::worker::AllReduceCall;
  using ddprun::worker::AllReduceRoute;
  using ddprun::worker::chooseAllReduceRoute;
  AllReduceCall call;
  call.size = 4;
  call.numel = 1000;
  call.shm_reducible = true;
  // No plan beyond the ring.
  CHECK(chooseAllReduceRoute(call).route == AllReduceRoute::kRing);
  call.average = true;
  CHECK_FALSE(chooseAllReduceRoute(call).scale_in_reduction);  // the ring divides afterwards
  // One host: shared memory alone, the average folded into its last pass.
  call.shared_memory = true;
  CHECK(chooseAllReduceRoute(call).route == AllReduceRoute::kSharedMemory);
  CHECK(chooseAllReduceRoute(call).scale_in_reduction);
  // Hierarchical: shared memory and a ring per local index.
  call.columns = true;
  CHECK(chooseAllReduceRoute(call).route == AllReduceRoute::kSharedMemoryAndColumns);
  // Hosts of unequal sizes: the leaders' pipeline, also where this host has no shared memory.
  call.columns = false;
  call.leaders_plan = true;
  call.shared_memory = false;
  CHECK(chooseAllReduceRoute(call).route == AllReduceRoute::kLeaders);
  CHECK(chooseAllReduceRoute(call).scale_in_reduction);
  // A dtype the shared-memory paths do not take goes over the ring, whatever the plan.
  call.shm_reducible = false;
  CHECK(chooseAllReduceRoute(call).route == AllReduceRoute::kRing);
  CHECK_FALSE(chooseAllReduceRoute(call).scale_in_reduction);
  // Nothing to reduce: no elements, or a group of one.
  call.shm_reducible = true;
  call.numel = 0;
  CHECK(chooseAllReduceRoute(call).route == AllReduceRoute::kNone);
  call.numel = 10;
  call.size = 1;
  CHECK(chooseAllReduceRoute(call).route == AllReduceRoute::kNone);
  CHECK_FALSE(chooseAllReduceRoute(call).scale_in_reduction);
}
