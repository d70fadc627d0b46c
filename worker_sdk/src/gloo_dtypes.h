// The dtypes the Gloo communicator reduces, and their shared-memory names: one table for the
// communicator and its algorithms (ring, shared memory, leaders).
#pragma once

#include <c10/core/ScalarType.h>

#include "shm_allreduce.h"

namespace ddprun::worker {

// The dtypes every all-reduce path (shared memory, hierarchical, leaders, TCP ring) reduces.
inline bool glooReducible(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kLong || t == at::kInt ||
         t == at::kBFloat16 || t == at::kHalf;
}

// The shared-memory dtype of a reducible dtype.
inline ShmDType shmTypeOf(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return ShmDType::kFloat64;
    case at::kLong:
      return ShmDType::kInt64;
    case at::kInt:
      return ShmDType::kInt32;
    case at::kBFloat16:
      return ShmDType::kBFloat16;
    case at::kHalf:
      return ShmDType::kHalf;
    default:
      return ShmDType::kFloat32;
  }
}

}  // namespace ddprun::worker
