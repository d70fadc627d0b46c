#include "allreduce_route.h"

namespace ddprun::worker {

AllReducePlanChoice chooseAllReduceRoute(const AllReduceCall& call) {
  AllReducePlanChoice choice;
  if (call.numel == 0 || call.size <= 1) return choice;
  // Types the shared-memory paths do not reduce (none today: every admitted dtype is) would take
  // the ring, where the average is a division afterwards.
  if (call.leaders_plan && call.shm_reducible) {
    choice.route = AllReduceRoute::kLeaders;
  } else if (call.shared_memory && call.shm_reducible) {
    choice.route =
        call.columns ? AllReduceRoute::kSharedMemoryAndColumns : AllReduceRoute::kSharedMemory;
  } else {
    choice.route = AllReduceRoute::kRing;
  }
  choice.scale_in_reduction = call.average && choice.route != AllReduceRoute::kRing;
  return choice;
}

const char* routeName(AllReduceRoute route) {
  switch (route) {
    case AllReduceRoute::kRing:
      return "ring";
    case AllReduceRoute::kSharedMemory:
      return "shared memory";
    case AllReduceRoute::kSharedMemoryAndColumns:
      return "shared memory and columns";
    case AllReduceRoute::kLeaders:
      return "leaders";
    case AllReduceRoute::kNone:
      break;
  }
  return "none";
}

}  // namespace ddprun::worker
