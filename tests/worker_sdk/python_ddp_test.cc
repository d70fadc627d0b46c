// The SDK against PyTorch itself: the same model, data and seed trained with Python's
// DistributedDataParallel (gloo, 2 processes, python3-torch) and with the SDK (2 thread-ranks).
#include <fstream>

#include "ddprun/worker/ddp.h"
#include "test_util.h"
#include "thread_ranks.h"
#include "torch_catch.h"

using namespace ddprun::worker;
namespace t = ddprun::worker::testing;

namespace {
torch::Tensor readFloats(const std::string& path, std::vector<int64_t> shape) {
  const std::string bytes = t::readFile(path);
  auto out = torch::empty(shape, torch::kFloat);
  REQUIRE(bytes.size() == static_cast<size_t>(out.numel()) * sizeof(float));
  std::memcpy(out.data_ptr<float>(), bytes.data(), bytes.size());
  return out;
}
}  // namespace

TEST_CASE("the SDK's DDP and PyTorch's DDP reach the same parameters after k steps",
          "[worker][ddp][python]") {
  const int steps = 6;
  t::TempDir dir;
  const std::string reference = t::python() + " " + t::sourceDir() +
                                "/tests/worker_sdk/python_ddp_reference.py " + dir.str() + " " +
                                std::to_string(steps) + " 2>&1";
  auto r = t::run(reference);
  if (r.exit_code != 0) {
    // The reference is PyTorch's, not the SDK's: one crash of it (a torch 2.x gloo teardown abort
    // was seen once in CI) is said and the reference run again; the comparison below is unchanged.
    WARN("the PyTorch reference run failed once; running it again. Its output:\n" << r.output);
    r = t::run(reference);
  }
  INFO(r.output);
  REQUIRE(r.exit_code == 0);

  auto make = [] {
    return torch::nn::Sequential(torch::nn::Linear(20, 32), torch::nn::ReLU(),
                                 torch::nn::Linear(32, 16), torch::nn::Tanh(),
                                 torch::nn::Linear(16, 4));
  };
  int64_t n_params = 0;
  for (auto& p : make()->parameters()) n_params += p.numel();
  auto init = readFloats(dir.str() + "/init.bin", {n_params});
  auto x = readFloats(dir.str() + "/x.bin", {steps, 16, 20});
  auto y = readFloats(dir.str() + "/y.bin", {steps, 16, 4});
  auto expected = readFloats(dir.str() + "/final.bin", {n_params});

  std::vector<torch::Tensor> finals(2);
  t::runRanks(2, [&](ProcessGroup& pg) {
    auto model = make();
    if (pg.rank() == 0) {
      torch::NoGradGuard g;
      int64_t off = 0;
      for (auto& p : model->parameters()) {
        p.copy_(init.narrow(0, off, p.numel()).view(p.sizes()));
        off += p.numel();
      }
    }
    DistributedDataParallel ddp(model.ptr(), pg.shared_from_this());
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    const int64_t shard = 8;
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      auto out = model->forward(x[s].narrow(0, pg.rank() * shard, shard));
      torch::mse_loss(out, y[s].narrow(0, pg.rank() * shard, shard)).backward();
      opt.step();
    }
    std::vector<torch::Tensor> flat;
    for (auto& p : model->parameters()) flat.push_back(p.detach().reshape({-1}));
    finals[static_cast<size_t>(pg.rank())] = torch::cat(flat);
  });
  for (auto& f : finals) {
    const double diff = (f - expected).abs().max().item<double>();
    INFO("max |sdk - pytorch| = " << diff);
    CHECK(diff < 1e-6);
    // The run must have moved the weights, or the comparison would prove nothing.
    CHECK((f - init).abs().max().item<double>() > 1e-3);
  }
}
