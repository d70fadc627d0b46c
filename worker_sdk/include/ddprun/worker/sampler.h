// DistributedSampler: splits a dataset of `size` samples across `num_replicas` ranks with exactly
// the index sequence of PyTorch's torch.utils.data.DistributedSampler (shuffle via randperm on a
// CPU generator seeded with seed + epoch, padding by repetition, drop_last, stride by rank).
// Header is LibTorch-free. Not thread-safe: one sampler per rank, set_epoch between epochs.
#pragma once

#include <cstdint>
#include <vector>

namespace ddprun::worker {

struct SamplerOptions {
  std::int64_t size = 0;  // dataset length
  int num_replicas = 1;
  int rank = 0;
  bool shuffle = true;
  std::uint64_t seed = 0;
  bool drop_last = false;
};

class DistributedSampler {
 public:
  // Throws ConfigError for rank outside [0, num_replicas), num_replicas < 1 or size < 0.
  explicit DistributedSampler(const SamplerOptions& options);

  void setEpoch(std::int64_t epoch) { epoch_ = epoch; }
  std::int64_t epoch() const { return epoch_; }

  // Samples this rank sees per epoch (PyTorch's num_samples).
  std::int64_t numSamples() const { return num_samples_; }
  std::int64_t totalSize() const { return num_samples_ * options_.num_replicas; }

  // This rank's dataset indices for the current epoch.
  std::vector<std::int64_t> indices() const;

 private:
  SamplerOptions options_;
  std::int64_t num_samples_ = 0;
  std::int64_t epoch_ = 0;
};

}  // namespace ddprun::worker
