// Gradient bucket assignment for DistributedDataParallel, as a pure function over tensor sizes
// and dtypes (c10d keeps compute_bucket_assignment_by_size apart from its Reducer; so do we).
// No LibTorch dependency, no state: safe to call from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ddprun::worker {

// What bucketing needs to know about one parameter.
struct TensorSpec {
  std::size_t numel = 0;
  std::size_t element_size = 4;
  int dtype = 0;    // any stable id; buckets never mix two ids
  int device = -1;  // -1 = CPU; buckets never mix devices either
};

struct BucketOptions {
  static constexpr std::size_t kMiB = 1024 * 1024;
  std::size_t first_bucket_bytes = 1 * kMiB;
  std::size_t bucket_cap_bytes = 25 * kMiB;
  // Walk parameters last to first: gradients of the last layers are produced first in backward.
  bool reverse = true;
};

// Returns buckets of parameter indices (indices into `tensors`). Buckets are listed in the order
// they are expected to become ready (bucket 0 first). Within a (dtype, device) group the first
// bucket closes once it holds at least `first_bucket_bytes`, later ones at `bucket_cap_bytes`.
// A tensor larger than the current limit gets a bucket of its own. Every index appears in exactly
// one bucket. Throws ConfigError when a limit is zero.
std::vector<std::vector<std::size_t>> computeBucketAssignment(
    const std::vector<TensorSpec>& tensors, const BucketOptions& options = {});

}  // namespace ddprun::worker
