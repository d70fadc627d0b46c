#include "ddprun/worker/sampler.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>

#include <string>

#include "ddprun/worker/errors.h"

namespace ddprun::worker {

DistributedSampler::DistributedSampler(const SamplerOptions& options) : options_(options) {
  if (options.num_replicas < 1) {
    throw ConfigError("DistributedSampler: num_replicas must be >= 1, got " +
                      std::to_string(options.num_replicas));
  }
  if (options.rank < 0 || options.rank >= options.num_replicas) {
    throw ConfigError("DistributedSampler: rank " + std::to_string(options.rank) +
                      " is outside [0, " + std::to_string(options.num_replicas - 1) + "]");
  }
  if (options.size < 0) {
    throw ConfigError("DistributedSampler: dataset size must be >= 0, got " +
                      std::to_string(options.size));
  }
  const std::int64_t n = options.size;
  const std::int64_t r = options.num_replicas;
  if (options.drop_last && n % r != 0) {
    num_samples_ = n >= r ? (n - 1) / r : 0;  // PyTorch: ceil((n - r) / r), floored at 0
  } else {
    num_samples_ = (n + r - 1) / r;
  }
}

std::vector<std::int64_t> DistributedSampler::indices() const {
  const std::int64_t n = options_.size;
  std::vector<std::int64_t> all;
  all.reserve(static_cast<std::size_t>(n));
  if (options_.shuffle) {
    // Same generator and kernel as Python's torch.randperm(n, generator=g) after
    // g.manual_seed(seed + epoch), so the permutation matches bit for bit.
    at::Generator gen =
        at::detail::createCPUGenerator(options_.seed + static_cast<std::uint64_t>(epoch_));
    at::Tensor perm = at::randperm(n, gen, at::TensorOptions().dtype(at::kLong));
    const std::int64_t* p = perm.data_ptr<std::int64_t>();
    all.assign(p, p + n);
  } else {
    for (std::int64_t i = 0; i < n; ++i) all.push_back(i);
  }
  const std::int64_t total = totalSize();
  if (!options_.drop_last) {
    const std::int64_t base = static_cast<std::int64_t>(all.size());
    for (std::int64_t i = 0; base > 0 && static_cast<std::int64_t>(all.size()) < total; ++i) {
      all.push_back(all[static_cast<std::size_t>(i % base)]);
    }
  } else {
    all.resize(static_cast<std::size_t>(total));
  }
  std::vector<std::int64_t> mine;
  mine.reserve(static_cast<std::size_t>(num_samples_));
  for (std::int64_t i = options_.rank; i < total; i += options_.num_replicas) {
    mine.push_back(all[static_cast<std::size_t>(i)]);
  }
  return mine;
}

}  // namespace ddprun::worker
