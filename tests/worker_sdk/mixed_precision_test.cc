// The large-model loop of the Trainer with ranks as threads (real Gloo): gradient accumulation
// against one big batch and against its count of all-reduces, fp16 loss scaling whose skip
// decisions every rank takes alike, the scale in the snapshot, and autocast's state kept tidy.
#include "ddprun/worker/mixed_precision.h"

#include <ATen/autocast_mode.h>
#include <sys/wait.h>
#include <torch/version.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

#include "ddprun/worker/errors.h"
#include "ddprun/worker/trainer.h"
#include "test_util.h"
#include "thread_ranks.h"
#include "torch_catch.h"

using namespace ddprun::worker;
namespace t = ddprun::worker::testing;

namespace {

std::shared_ptr<ProcessGroup> unowned(ProcessGroup& pg) {
  return std::shared_ptr<ProcessGroup>(&pg, [](ProcessGroup*) {});
}

// A model without batch-dependent layers, its data, and the parameters after every step.
struct Run {
  std::vector<std::vector<torch::Tensor>> params_per_step;  // rank 0's
  std::vector<float> scales;                                // rank 0's loss scale per step
  int hook_calls = 0;                                       // rank 0's bucket reductions
  int steps = 0;
};

struct Setup {
  int world = 2;
  int64_t batch = 4;
  int64_t accumulate = 1;
  int64_t dataset = 64;
  int64_t epochs = 1;
  Amp amp = Amp::kNone;
  std::string snapshot;
  // Multiplies rank `inf_rank`'s loss by inf at global step `inf_step` (its last micro-batch).
  int inf_rank = -1;
  int64_t inf_step = -1;
};

Run train(const Setup& s) {
  torch::manual_seed(7);
  auto init =
      torch::nn::Sequential(torch::nn::Linear(6, 16), torch::nn::Tanh(), torch::nn::Linear(16, 3));
  const auto x = torch::randn({s.dataset, 6});
  const auto y = torch::randn({s.dataset, 3});
  Run out;
  std::mutex mu;
  t::runRanks(s.world, [&](ProcessGroup& pg) {
    auto model = torch::nn::Sequential(torch::nn::Linear(6, 16), torch::nn::Tanh(),
                                       torch::nn::Linear(16, 3));
    {
      torch::NoGradGuard g;
      for (size_t i = 0; i < model->parameters().size(); ++i)
        model->parameters()[i].copy_(init->parameters()[i]);
    }
    auto opt = std::make_shared<torch::optim::SGD>(model->parameters(),
                                                   torch::optim::SGDOptions(0.1).momentum(0.9));
    TrainerOptions o;
    o.total_epochs = s.epochs;
    o.save_every = s.snapshot.empty() ? 0 : 1;
    o.snapshot_path = s.snapshot;
    o.batch_size = s.batch;
    o.accumulate_steps = s.accumulate;
    o.amp = s.amp;
    o.loss_scaler.growth_interval = 3;
    std::ostringstream log;
    o.log = &log;
    int calls = 0;
    const CommHook reduce = allReduceHook();
    o.ddp.comm_hook = [&](Communicator& c, const GradBucket& b) {
      ++calls;
      return reduce(c, b);
    };
    int64_t global = 0;
    std::vector<std::vector<torch::Tensor>> seen;
    std::vector<float> scales;
    o.on_step = [&](const TrainingProgress& p) {
      global = p.global_step;
      std::vector<torch::Tensor> now;
      for (auto& q : model->parameters()) now.push_back(q.detach().clone());
      seen.push_back(now);
      scales.push_back(p.loss_scale);
    };
    const int rank = pg.rank();
    auto forward = [model](const torch::Tensor& in) mutable { return model->forward(in); };
    auto loss = [&, rank](const torch::Tensor& out, const torch::Tensor& target) {
      auto l = torch::mse_loss(out, target);
      // The step being computed is global + 1; poison only its last micro-batch's loss.
      if (rank == s.inf_rank && global + 1 == s.inf_step) l = l * INFINITY;
      return l;
    };
    Trainer trainer(unowned(pg), model.ptr(), forward, loss, opt, x, y, o);
    trainer.train();
    if (rank == 0) {
      std::lock_guard<std::mutex> lock(mu);
      out.params_per_step = seen;
      out.scales = scales;
      out.hook_calls = calls;
      out.steps = static_cast<int>(trainer.progress().global_step);
    }
  });
  return out;
}

double maxDiff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, (a[i] - b[i]).abs().max().item<double>());
  return m;
}

}  // namespace

TEST_CASE("accumulating N micro-batches of B equals one batch of N*B, step for step",
          "[worker][trainer][accumulate]") {
  for (int64_t n : {2, 4, 3}) {  // 3: the epoch's last step is a short one
    INFO("accumulate " << n);
    Setup big;
    big.batch = 4 * n;
    Setup small;
    small.batch = 4;
    small.accumulate = n;
    const Run a = train(big);
    const Run b = train(small);
    REQUIRE(a.params_per_step.size() == b.params_per_step.size());
    REQUIRE(a.steps == b.steps);
    for (size_t k = 0; k < a.params_per_step.size(); ++k) {
      INFO("step " << k);
      CHECK(maxDiff(a.params_per_step[k], b.params_per_step[k]) < 1e-6);
    }
  }
}

TEST_CASE("accumulation all-reduces once per optimizer step, not once per micro-batch",
          "[worker][trainer][accumulate]") {
  Setup s;
  s.batch = 4;
  s.accumulate = 4;  // 64 samples / 2 ranks / 4 = 8 micro-batches: 2 steps
  const Run acc = train(s);
  s.accumulate = 1;
  const Run every = train(s);
  CHECK(acc.steps == 2);
  CHECK(every.steps == 8);
  // One bucket (a small model): its reductions count the synchronised backward passes.
  CHECK(acc.hook_calls == 2);
  CHECK(every.hook_calls == 8);
}

TEST_CASE("fp16: an inf gradient on one rank skips the step on every rank and backs off the scale",
          "[worker][trainer][amp]") {
  try {
    checkAmpSupported(at::kCPU, Amp::kFp16);
  } catch (const ConfigError& e) {
    WARN("skipped: " << e.what());
    return;
  }
  Setup s;
  s.amp = Amp::kFp16;
  s.batch = 8;  // 4 steps an epoch
  s.epochs = 2;
  s.inf_rank = 1;
  s.inf_step = 3;
  const Run r = train(s);
  REQUIRE(r.scales.size() == 8);
  // growth_interval 3: steps 1, 2 clean; step 3 inf (halves, tracker 0); 4, 5, 6 clean (doubles).
  CHECK(r.scales[0] == 65536.0f);
  CHECK(r.scales[1] == 65536.0f);
  CHECK(r.scales[2] == 32768.0f);
  CHECK(r.scales[5] == 65536.0f);
  // The skipped step left rank 0's parameters (which saw only finite gradients) as they were.
  CHECK(maxDiff(r.params_per_step[1], r.params_per_step[2]) == 0);
  CHECK(maxDiff(r.params_per_step[2], r.params_per_step[3]) > 0);
  for (const auto& step : r.params_per_step)
    for (const auto& p : step) CHECK(torch::isfinite(p).all().item<bool>());
}

TEST_CASE("fp16: the loss scale is in the snapshot and a resumed run goes on with it",
          "[worker][trainer][amp]") {
  try {
    checkAmpSupported(at::kCPU, Amp::kFp16);
  } catch (const ConfigError& e) {
    WARN("skipped: " << e.what());
    return;
  }
  t::TempDir dir;
  Setup s;
  s.amp = Amp::kFp16;
  s.batch = 8;
  s.epochs = 1;
  s.snapshot = dir.str() + "/snap.pt";
  s.inf_rank = 0;
  s.inf_step = 2;  // the scale backs off to 32768 in epoch 0
  train(s);
  const auto saved = readSnapshotProgress(s.snapshot);
  REQUIRE(saved);
  CHECK(saved->loss_scale == 32768.0f);
  CHECK(saved->loss_scale_growth_tracker == 2);
  s.epochs = 2;
  s.inf_rank = -1;
  const Run resumed = train(s);  // epoch 1 only
  REQUIRE(resumed.scales.size() == 4);
  CHECK(resumed.scales[0] == 65536.0f);  // the third clean step in a row: grown from 32768
}

TEST_CASE("a snapshot taken mid-epoch resumes only with the same accumulation",
          "[worker][trainer][accumulate]") {
  t::TempDir dir;
  const std::string path = dir.str() + "/snap.pt";
  {
    torch::nn::Linear m(2, 1);
    torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.1));
    TrainingProgress p;
    p.epoch = 0;
    p.step_in_epoch = 3;
    p.global_step = 3;
    p.accumulate_steps = 4;
    saveSnapshot(path, *m, opt, p);
  }
  std::string error;
  t::runRanks(1, [&](ProcessGroup& pg) {
    auto m = torch::nn::Linear(2, 1);
    auto opt = std::make_shared<torch::optim::SGD>(m->parameters(), torch::optim::SGDOptions(0.1));
    TrainerOptions o;
    o.snapshot_path = path;
    o.accumulate_steps = 2;
    std::ostringstream log;
    o.log = &log;
    try {
      Trainer trainer(
          unowned(pg), m.ptr(), [m](const torch::Tensor& in) mutable { return m->forward(in); },
          [](const torch::Tensor& a, const torch::Tensor& b) { return torch::mse_loss(a, b); }, opt,
          torch::zeros({8, 2}), torch::zeros({8, 1}), o);
    } catch (const ConfigError& e) {
      error = e.what();
    }
  });
  CHECK_THAT(error, Catch::Contains("after 3 steps of 4 micro-batches; resume it with "
                                    "accumulate_steps 4, not 2"));
}

TEST_CASE("autocast guards nest and restore what was there", "[worker][amp]") {
  const auto enabled = [] {
    at::Tensor a = torch::ones({2, 2});
    return torch::mm(a, a).scalar_type();  // bf16 under CPU autocast, float otherwise
  };
  CHECK(enabled() == torch::kFloat);
  {
    AutocastGuard outer(at::kCPU, Amp::kBf16);
    CHECK(enabled() == torch::kBFloat16);
    {
      AutocastGuard none(at::kCPU, Amp::kNone);
      CHECK(enabled() == torch::kBFloat16);
    }
    CHECK(enabled() == torch::kBFloat16);
  }
  CHECK(enabled() == torch::kFloat);
  CHECK(parseAmp("fp16") == Amp::kFp16);
  CHECK(ampName(Amp::kBf16) == "bf16");
  CHECK_THROWS_WITH(parseAmp("fp8"), Catch::Contains("must be none, bf16 or fp16, got 'fp8'"));
}

namespace {

// The bits of `t` (NaN payloads and signed zeros included), as integers of its width.
torch::Tensor bitsOf(const torch::Tensor& t) {
  switch (t.element_size()) {
    case 2:
      return t.view(torch::kInt16);
    case 4:
      return t.view(torch::kInt32);
    default:
      return t.view(torch::kInt64);
  }
}

}  // namespace

TEST_CASE("unscaleGradients gives mul_'s bits in every dtype and finds inf and NaN in any of them",
          "[worker][amp]") {
  INFO("the fused kernel on the CPU: " << fusedUnscaleAvailable(at::kCPU));
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  CHECK(fusedUnscaleAvailable(at::kCPU));  // what torch.amp.GradScaler uses there too
#endif
  const float inv_scale = static_cast<float>(1.0 / 65536.0 * 3.0);  // not a power of 2: rounds
  for (const auto dtype : {torch::kFloat, torch::kDouble, torch::kHalf, torch::kBFloat16}) {
    for (const float bad : {0.0f, INFINITY, -INFINITY, NAN}) {
      INFO("dtype " << dtype << ", a gradient holding " << bad);
      torch::manual_seed(7);
      std::vector<torch::Tensor> params;
      // Sizes around the kernels' vector widths, a non-contiguous gradient, and one without any.
      for (const int64_t n : {1, 7, 64, 1000}) {
        auto p = torch::zeros({n}, torch::TensorOptions().dtype(dtype));
        p.mutable_grad() = (torch::randn({n}) * 1000).to(dtype);
        params.push_back(p);
      }
      auto strided = torch::zeros({6, 4}, torch::TensorOptions().dtype(dtype));
      strided.mutable_grad() = (torch::randn({4, 6}) * 1000).to(dtype).t();
      params.push_back(strided);
      params.push_back(torch::zeros({3}, torch::TensorOptions().dtype(dtype)));
      if (bad != 0.0f) params[2].mutable_grad()[5] = bad;
      std::vector<torch::Tensor> expected;
      for (const auto& p : params)
        expected.push_back(p.grad().defined() ? p.grad().clone().mul_(inv_scale) : torch::Tensor());
      CHECK(unscaleGradients(params, inv_scale) == (bad != 0.0f));
      for (size_t i = 0; i < params.size(); ++i) {
        if (!expected[i].defined()) {
          CHECK_FALSE(params[i].grad().defined());
          continue;
        }
        CHECK(
            torch::equal(bitsOf(params[i].grad().contiguous()), bitsOf(expected[i].contiguous())));
      }
    }
  }
  CHECK_FALSE(unscaleGradients({}, inv_scale));
  // Gradients of two dtypes at once: an inf in either is found.
  auto a = torch::zeros({4});
  a.mutable_grad() = torch::ones({4});
  auto b = torch::zeros({4}, torch::TensorOptions().dtype(torch::kHalf));
  b.mutable_grad() = torch::ones({4}, torch::TensorOptions().dtype(torch::kHalf));
  b.mutable_grad()[1] = INFINITY;
  CHECK(unscaleGradients({a, b}, 0.5f));
  CHECK(a.grad()[0].item<float>() == 0.5f);
  CHECK_FALSE(unscaleGradients({a}, 0.5f));
}

TEST_CASE("a temp file of a snapshot write killed in an earlier attempt is gone when training ends",
          "[worker][trainer][snapshot]") {
  t::TempDir dir;
  const std::string path = dir.str() + "/snap.pt";
  // A writer that is gone: its pid names the temp file (<path>.tmp.<pid>.<random>).
  const pid_t gone = ::fork();
  if (gone == 0) ::_exit(0);
  ::waitpid(gone, nullptr, 0);
  const std::string stale = path + ".tmp." + std::to_string(gone) + ".42";
  t::runRanks(1, [&](ProcessGroup& pg) {
    auto m = torch::nn::Linear(2, 1);
    auto opt = std::make_shared<torch::optim::SGD>(m->parameters(), torch::optim::SGDOptions(0.1));
    TrainerOptions o;
    o.snapshot_path = path;
    o.save_every = 0;
    o.batch_size = 4;
    std::ostringstream log;
    o.log = &log;
    // Left after the start's cleanup, as by a write that another process's attempt was killed in.
    o.on_step = [&](const TrainingProgress& p) {
      if (p.global_step == 1) std::ofstream(stale) << "half a snapshot";
    };
    Trainer trainer(
        unowned(pg), m.ptr(), [m](const torch::Tensor& in) mutable { return m->forward(in); },
        [](const torch::Tensor& a, const torch::Tensor& b) { return torch::mse_loss(a, b); }, opt,
        torch::zeros({8, 2}), torch::zeros({8, 1}), o);
    trainer.train();
  });
  CHECK_FALSE(std::filesystem::exists(stale));
}
