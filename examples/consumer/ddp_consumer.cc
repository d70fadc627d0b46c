// A few steps of DDP on a linear model with the worker SDK, as a user's own project would write
// it (examples/consumer/CMakeLists.txt finds the installed package). Every rank fits y = 3x + 2
// on its DistributedSampler share of 64 samples; rank 0 prints the final loss and parameters and
// whether every rank ended with the same parameters.
//   ddprun --standalone --nproc_per_node=2 ./ddp_consumer
#include <torch/torch.h>

#include <cstdio>
#include <exception>
#include <memory>
#include <vector>

#include "ddprun/worker/ddp.h"
#include "ddprun/worker/process_group.h"
#include "ddprun/worker/sampler.h"

namespace w = ddprun::worker;

int main() {
  try {
    auto group = w::ProcessGroup::initFromEnv();
    torch::manual_seed(0);  // same data and initial model everywhere (DDP broadcasts it anyway)
    const int64_t n = 64;
    auto x = torch::linspace(-1, 1, n).unsqueeze(1);
    auto y = 3 * x + 2;

    auto model = std::make_shared<torch::nn::LinearImpl>(1, 1);
    w::DistributedDataParallel ddp(model, group);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.2));

    w::SamplerOptions so;
    so.size = n;
    so.num_replicas = group->size();
    so.rank = group->rank();
    w::DistributedSampler sampler(so);
    const int64_t batch = 8;
    float loss_value = 0;
    int64_t steps = 0;
    for (int64_t epoch = 0; epoch < 10; ++epoch) {
      sampler.setEpoch(epoch);
      const auto idx = sampler.indices();
      for (size_t b = 0; b + batch <= idx.size(); b += batch) {
        auto take = torch::tensor(std::vector<int64_t>(idx.begin() + b, idx.begin() + b + batch));
        opt.zero_grad();
        auto loss =
            torch::mse_loss(model->forward(x.index_select(0, take)), y.index_select(0, take));
        loss.backward();  // gradients averaged over the ranks
        opt.step();
        loss_value = loss.item<float>();
        ++steps;
      }
    }

    // Parameters must be identical everywhere: compare the sum over ranks with world_size x ours.
    auto flat = torch::cat({model->weight.detach().flatten(), model->bias.detach().flatten()});
    auto sum = flat.clone();
    group->comm().allReduceAsync(sum, w::ReduceOp::kSum)->wait();
    const bool same = torch::allclose(sum, flat * group->size());
    if (group->rank() == 0) {
      std::printf(
          "ddp_consumer: world_size=%d steps=%lld final_loss=%.6f weight=%.4f bias=%.4f %s\n",
          group->size(), static_cast<long long>(steps), loss_value, model->weight.item<float>(),
          model->bias.item<float>(), same ? "params_identical_on_all_ranks" : "PARAMS_DIFFER");
      std::fflush(stdout);
    }
    group->comm().barrier();
    return same ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_consumer: error: %s\n", e.what());
    return 1;
  }
}
