#include "models.h"

#include <ATen/CPUGeneratorImpl.h>

#include <stdexcept>

namespace ddprun::examples {

namespace {

struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(1024, 4096))),
        fc2(register_module("fc2", torch::nn::Linear(4096, 2048))),
        fc3(register_module("fc3", torch::nn::Linear(2048, 10))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return fc3->forward(torch::relu(fc2->forward(torch::relu(fc1->forward(x)))));
  }
  torch::nn::Linear fc1, fc2, fc3;
};
TORCH_MODULE(Mlp);

struct CnnImpl : torch::nn::Module {
  CnnImpl()
      : conv1(register_module("conv1",
                              torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 64, 3).padding(1)))),
        conv2(register_module("conv2",
                              torch::nn::Conv2d(torch::nn::Conv2dOptions(64, 128, 3).padding(1)))),
        fc1(register_module("fc1", torch::nn::Linear(128 * 8 * 8, 1280))),
        fc2(register_module("fc2", torch::nn::Linear(1280, 10))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::max_pool2d(torch::relu(conv1->forward(x)), 2);
    h = torch::max_pool2d(torch::relu(conv2->forward(h)), 2);
    return fc2->forward(torch::relu(fc1->forward(h.flatten(1))));
  }
  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Cnn);

}  // namespace

Task makeTask(const std::string& name, int64_t n, uint64_t data_seed) {
  at::Generator gen = at::detail::createCPUGenerator(data_seed);
  Task t;
  if (name == "linear") {
    // The tutorial's job: Linear(20, 1) on (rand(20), rand(1)) pairs, regression loss.
    auto m = torch::nn::Linear(20, 1);
    t.module = m.ptr();
    t.forward = [m](const torch::Tensor& x) mutable { return m->forward(x); };
    t.loss = [](const torch::Tensor& out, const torch::Tensor& y) {
      return torch::mse_loss(out, y);
    };
    t.inputs = at::rand({n, 20}, gen);
    t.targets = at::rand({n, 1}, gen);
  } else if (name == "mlp") {
    Mlp m;
    t.module = m.ptr();
    t.forward = [m](const torch::Tensor& x) mutable { return m->forward(x); };
    t.loss = [](const torch::Tensor& out, const torch::Tensor& y) {
      return torch::cross_entropy_loss(out, y);
    };
    t.inputs = at::randn({n, 1024}, gen);
    t.targets = at::randint(0, 10, {n}, gen, torch::kLong);
  } else if (name == "cnn") {
    Cnn m;
    t.module = m.ptr();
    t.forward = [m](const torch::Tensor& x) mutable { return m->forward(x); };
    t.loss = [](const torch::Tensor& out, const torch::Tensor& y) {
      return torch::cross_entropy_loss(out, y);
    };
    t.inputs = at::randn({n, 3, 32, 32}, gen);
    t.targets = at::randint(0, 10, {n}, gen, torch::kLong);
  } else {
    throw std::invalid_argument("unknown model '" + name + "': expected linear, mlp or cnn");
  }
  return t;
}

}  // namespace ddprun::examples
