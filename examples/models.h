// The example models of `train`: the tutorial's linear model and two larger ones (10-25M
// parameters) worth benchmarking. Each comes with a matching synthetic dataset and loss.
#pragma once

#include <torch/torch.h>

#include <string>

namespace ddprun::examples {

struct Task {
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> loss;
  torch::Tensor inputs;
  torch::Tensor targets;
};

// `name` is linear, mlp or cnn. Data come from a generator seeded with `data_seed`, so every rank
// (and every restart) holds the same dataset. Throws std::invalid_argument for an unknown name.
Task makeTask(const std::string& name, int64_t dataset_size, uint64_t data_seed);

}  // namespace ddprun::examples
