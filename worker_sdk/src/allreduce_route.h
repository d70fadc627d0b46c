// Which way one all_reduce call of the Gloo communicator goes: a pure function of the plan the
// group made when it formed (topology.h, gloo_plan.h) and of the call (size, dtype, average), so
// every combination is unit-tested (tests/worker_sdk/topology_test.cc) apart from the collectives.
#pragma once

#include <cstddef>

namespace ddprun::worker {

enum class AllReduceRoute {
  kNone,                    // nothing to reduce: no elements, or a group of one rank
  kRing,                    // Gloo's TCP ring over all ranks (gloo_ring.h)
  kSharedMemory,            // every rank on this host: shared memory alone (shm_allreduce.h)
  kSharedMemoryAndColumns,  // hierarchical: shared memory, each piece summed across the hosts
  kLeaders,                 // hosts of unequal sizes: shared memory, leaders' ring, shared memory
};

struct AllReduceCall {
  // The group's plan.
  bool leaders_plan = false;   // the group runs the leaders plan
  bool shared_memory = false;  // this host has a shared-memory group
  bool columns = false;        // hierarchical: this rank's ring across the hosts
  int size = 1;                // ranks in the group
  // The call.
  std::size_t numel = 0;
  bool shm_reducible = false;  // a dtype every path reduces (float, double, half, bf16, int32/64)
  bool average = false;        // ReduceOp::kAvg
};

struct AllReducePlanChoice {
  AllReduceRoute route = AllReduceRoute::kNone;
  // The average's 1/size rides on the reduction's last pass; otherwise the result is divided after.
  bool scale_in_reduction = false;
};

AllReducePlanChoice chooseAllReduceRoute(const AllReduceCall& call);

const char* routeName(AllReduceRoute route);

}  // namespace ddprun::worker
