// The worker SDK on CUDA: DDP over NCCL against a single-process reference, snapshots of a CUDA
// model, `train --backend nccl` to the end, buckets overlapping backward, and fp16 mixed precision
// with its loss scaler. Every case skips with
// a message where LibTorch sees no CUDA device (Debian's CPU LibTorch; machines without a GPU) or
// the build has no NCCL; deploy/gpu-check.sh runs them on a GPU machine. With one GPU NCCL runs
// world 1 (it puts no two ranks on one device); with more, one rank per GPU.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <memory>
#include <mutex>
#include <sstream>

#include "ddprun/worker/ddp.h"
#include "ddprun/worker/errors.h"
#include "ddprun/worker/mixed_precision.h"
#include "ddprun/worker/snapshot.h"
#include "ddprun/worker/trainer.h"
#include "test_util.h"
#include "thread_ranks.h"
#include "torch_catch.h"

using namespace ddprun::worker;
namespace t = ddprun::worker::testing;
using namespace std::chrono_literals;

namespace {

int cudaDevices() { return torch::cuda::is_available() ? torch::cuda::device_count() : 0; }

#define REQUIRE_CUDA_OR_SKIP()                                                                  \
  do {                                                                                          \
    if (cudaDevices() < 1 || !ncclAvailable()) {                                                \
      WARN("skipped: " << (ncclAvailable() ? "LibTorch sees no CUDA device"                     \
                                           : "this build has no NCCL")                          \
                       << " (run deploy/gpu-check.sh on a GPU machine, with a CUDA LibTorch)"); \
      return;                                                                                   \
    }                                                                                           \
  } while (0)

// Ranks the GPUs allow: one per device, at most `most`.
int gpuWorld(int most = 2) { return std::min(cudaDevices(), most); }

ProcessGroupOptions ncclOn(int device) {
  auto o = t::fastOptions();
  o.backend = Backend::kNccl;
  o.cuda_device = device;
  return o;
}

torch::nn::Sequential makeModel() {
  return torch::nn::Sequential(torch::nn::Linear(20, 64), torch::nn::ReLU(),
                               torch::nn::Linear(64, 32), torch::nn::Tanh(),
                               torch::nn::Linear(32, 4));
}

void copyParams(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard g;
  auto src = from.parameters();
  auto dst = to.parameters();
  for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
}

double maxAbsDiff(torch::nn::Module& a, torch::nn::Module& b) {
  double m = 0;
  auto pa = a.parameters();
  auto pb = b.parameters();
  for (size_t i = 0; i < pa.size(); ++i)
    m = std::max(m, (pa[i].cpu() - pb[i].cpu()).abs().max().item<double>());
  return m;
}

}  // namespace

TEST_CASE("DDP over NCCL on CUDA tensors equals one process on the whole batch",
          "[worker][gpu][nccl]") {
  REQUIRE_CUDA_OR_SKIP();
  const int world = gpuWorld();
  const int steps = 5;
  const int64_t per_rank = 8;
  torch::manual_seed(3);
  auto init = makeModel();
  std::vector<torch::Tensor> xs, ys;
  for (int i = 0; i < steps; ++i) {
    xs.push_back(torch::randn({per_rank * world, 20}));
    ys.push_back(torch::randn({per_rank * world, 4}));
  }
  const torch::Device ref_device(torch::kCUDA, 0);
  auto ref = makeModel();
  copyParams(*init, *ref);
  ref->to(ref_device);
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  for (int s = 0; s < steps; ++s) {
    ref_opt.zero_grad();
    torch::mse_loss(ref->forward(xs[s].to(ref_device)), ys[s].to(ref_device)).backward();
    ref_opt.step();
  }

  std::vector<torch::nn::Sequential> models(static_cast<size_t>(world));
  std::vector<std::string> devices(static_cast<size_t>(world));
  t::runRanks(
      world,
      [&](ProcessGroup& pg) {
        const torch::Device dev(torch::kCUDA, pg.rank());
        auto m = makeModel();
        copyParams(*init, *m);
        m->to(dev);
        DdpOptions o;
        o.bucket_cap_mb = 0.004;  // several buckets
        o.first_bucket_mb = 0.002;
        DistributedDataParallel ddp(m.ptr(), std::shared_ptr<ProcessGroup>(&pg, [](auto*) {}), o);
        torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.1));
        for (int s = 0; s < steps; ++s) {
          auto x = xs[s].narrow(0, per_rank * pg.rank(), per_rank).to(dev);
          auto y = ys[s].narrow(0, per_rank * pg.rank(), per_rank).to(dev);
          opt.zero_grad();
          torch::mse_loss(m->forward(x), y).backward();
          opt.step();
        }
        devices[static_cast<size_t>(pg.rank())] = m->parameters()[0].device().str();
        models[static_cast<size_t>(pg.rank())] = m;
      },
      [](int rank) { return ncclOn(rank); });
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r << " of " << world);
    CHECK(devices[static_cast<size_t>(r)] == "cuda:" + std::to_string(r));
    CHECK(maxAbsDiff(*models[static_cast<size_t>(r)], *ref) < 1e-5);
    CHECK(maxAbsDiff(*models[static_cast<size_t>(r)], *models[0]) == 0);
  }
}

TEST_CASE("DDP refuses a model that is not on the NCCL communicator's device, naming it",
          "[worker][gpu][nccl]") {
  REQUIRE_CUDA_OR_SKIP();
  std::string error;
  t::runRanks(
      1,
      [&](ProcessGroup& pg) {
        auto m = makeModel();  // left on the CPU
        try {
          DistributedDataParallel ddp(m.ptr(), std::shared_ptr<ProcessGroup>(&pg, [](auto*) {}));
        } catch (const ConfigError& e) {
          error = e.what();
        }
      },
      [](int) { return ncclOn(0); });
  CHECK_THAT(error,
             Catch::Contains("parameter '0.weight' is on cpu but the nccl communicator works "
                             "on cuda:0: move the model there"));
}

TEST_CASE("a snapshot of a CUDA model and its optimizer resumes on the GPU exactly",
          "[worker][gpu][snapshot]") {
  REQUIRE_CUDA_OR_SKIP();
  t::TempDir dir;
  const std::string path = dir.str() + "/snap.pt";
  const torch::Device dev(torch::kCUDA, 0);
  auto train = [&](torch::nn::Sequential& m, torch::optim::Optimizer& opt, int steps) {
    for (int i = 0; i < steps; ++i) {
      opt.zero_grad();
      // Dropout on the GPU: the CUDA generator's state must come back too.
      auto h = torch::dropout(m->forward(torch::randn({16, 20}, dev)), 0.3, true);
      torch::mse_loss(h, torch::randn({16, 4}, dev)).backward();
      opt.step();
    }
  };
  torch::manual_seed(11);
  auto a = makeModel();
  a->to(dev);
  torch::optim::Adam opt_a(a->parameters(), torch::optim::AdamOptions(0.01));
  train(a, opt_a, 3);
  saveSnapshot(path, *a, opt_a, TrainingProgress{2, 1, 3, 0.5});
  auto saved = makeModel();
  copyParams(*a, *saved);
  // `a` goes on from the RNG states the snapshot holds.
  train(a, opt_a, 2);

  torch::manual_seed(12);  // other weights and RNG states until the load
  auto b = makeModel();
  b->to(dev);
  torch::optim::Adam opt_b(b->parameters(), torch::optim::AdamOptions(0.01));
  TrainingProgress p;
  REQUIRE(loadSnapshot(path, *b, opt_b, p));
  CHECK(p.global_step == 3);
  CHECK(b->parameters()[0].device() == dev);
  CHECK(maxAbsDiff(*saved, *b) == 0);
  // `b` goes on as `a` did only if Adam's moments and the RNG states (CPU and CUDA: dropout) came
  // back.
  train(b, opt_b, 2);
  CHECK(maxAbsDiff(*a, *b) == 0);
}

TEST_CASE("train --backend nccl runs to the end, saves on the GPU and resumes from it",
          "[worker][gpu][train]") {
  REQUIRE_CUDA_OR_SKIP();
  const int world = gpuWorld();
  t::TempDir dir;
  const std::string snapshot = dir.str() + "/snapshot.pt";
  auto runTrain = [&](int epochs) {
    const int port = t::freePort();
    std::vector<std::unique_ptr<t::Process>> ranks;
    for (int r = 0; r < world; ++r) {
      ranks.push_back(std::make_unique<t::Process>(
          std::vector<std::string>{t::buildDir() + "/examples/train", std::to_string(epochs), "1",
                                   "--backend", "nccl", "--model", "mlp", "--dataset-size", "512",
                                   "--snapshot-path", snapshot},
          std::map<std::string, std::string>{{"RANK", std::to_string(r)},
                                             {"WORLD_SIZE", std::to_string(world)},
                                             {"LOCAL_RANK", std::to_string(r)},
                                             {"LOCAL_WORLD_SIZE", std::to_string(world)},
                                             {"MASTER_ADDR", "127.0.0.1"},
                                             {"MASTER_PORT", std::to_string(port)}},
          t::ProcessOptions{dir.str() + "/out" + std::to_string(epochs) + "." + std::to_string(r),
                            true}));
    }
    std::string out0;
    for (int r = 0; r < world; ++r) {
      auto code = ranks[static_cast<size_t>(r)]->waitExit(300s);
      const std::string out = ranks[static_cast<size_t>(r)]->output();
      INFO("rank " << r << ":\n" << out);
      REQUIRE(code.has_value());
      CHECK(*code == 0);
      if (r == 0) out0 = out;
    }
    return out0;
  };
  const std::string first = runTrain(2);
  CHECK_THAT(first, Catch::Contains("[RANK 0] Epoch 1 | Batchsize: 32"));
  CHECK_THAT(first, Catch::Contains("Training snapshot saved at " + snapshot));
  CHECK(std::filesystem::exists(snapshot));
  const std::string second = runTrain(3);
  CHECK_THAT(second, Catch::Contains("Resuming training from snapshot at Epoch 2"));
  CHECK_THAT(second, Catch::Contains("[RANK 0] Epoch 2 | Batchsize: 32"));
  CHECK(second.find("[RANK 0] Epoch 1 |") == std::string::npos);
}

TEST_CASE("DDP's first bucket is handed to NCCL while backward still has kernels to run",
          "[worker][gpu][nccl][overlap]") {
  REQUIRE_CUDA_OR_SKIP();
  // Wide layers, so backward runs long on the GPU; small buckets, so there are several. On the
  // compute stream, an event recorded when bucket 0's all-reduce is enqueued (its ready point: the
  // NCCL stream starts it from there) must come before one recorded when the first layer's
  // gradient, backward's last, is accumulated.
  const torch::Device dev(torch::kCUDA, 0);
  struct Marks {
    std::mutex mu;
    std::vector<std::size_t> launched;  // bucket indices, in launch order
    cudaEvent_t first_launch = nullptr;
    cudaEvent_t last_grad = nullptr;
    std::atomic<bool> last_grad_seen{false};
  } marks;
  cudaEventCreate(&marks.first_launch);
  cudaEventCreate(&marks.last_grad);
  float gap_ms = 0;
  std::vector<std::size_t> launched;
  bool launched_before_last_grad = false;
  t::runRanks(
      1,
      [&](ProcessGroup& pg) {
        auto m = torch::nn::Sequential(torch::nn::Linear(1024, 2048), torch::nn::ReLU(),
                                       torch::nn::Linear(2048, 2048), torch::nn::ReLU(),
                                       torch::nn::Linear(2048, 2048), torch::nn::ReLU(),
                                       torch::nn::Linear(2048, 1024));
        m->to(dev);
        DdpOptions o;
        o.bucket_cap_mb = 8;
        o.first_bucket_mb = 4;
        const CommHook reduce = allReduceHook();
        o.comm_hook = [&](Communicator& comm, const GradBucket& bucket) {
          std::lock_guard<std::mutex> lock(marks.mu);
          if (marks.launched.empty()) {
            cudaEventRecord(marks.first_launch, cudaStreamLegacy);
            launched_before_last_grad = !marks.last_grad_seen.load();
          }
          marks.launched.push_back(bucket.index);
          return reduce(comm, bucket);
        };
        DistributedDataParallel ddp(m.ptr(), std::shared_ptr<ProcessGroup>(&pg, [](auto*) {}), o);
        // The first layer's weight gets its gradient last in backward.
        auto first_weight = m->parameters()[0];
        first_weight.register_hook([&](torch::Tensor g) {
          marks.last_grad_seen = true;
          cudaEventRecord(marks.last_grad, cudaStreamLegacy);
          return g;
        });
        auto x = torch::randn({4096, 1024}, dev);
        for (int step = 0; step < 3; ++step) {  // the last step is measured
          {
            std::lock_guard<std::mutex> lock(marks.mu);
            marks.launched.clear();
          }
          marks.last_grad_seen = false;
          m->zero_grad();
          m->forward(x).pow(2).mean().backward();
        }
        cudaDeviceSynchronize();
        cudaEventElapsedTime(&gap_ms, marks.first_launch, marks.last_grad);
        launched = marks.launched;
      },
      [](int) { return ncclOn(0); });
  INFO("buckets launched in order: " << launched.size() << "; first launch " << gap_ms
                                     << " ms before the last gradient");
  REQUIRE(launched.size() >= 3);
  for (std::size_t i = 0; i < launched.size(); ++i) CHECK(launched[i] == i);
  CHECK(launched_before_last_grad);  // on the host: launched during backward
  CHECK(gap_ms > 0);                 // on the device: ahead of backward's last kernels
  cudaEventDestroy(marks.first_launch);
  cudaEventDestroy(marks.last_grad);
}

TEST_CASE("fp16 mixed precision on CUDA trains, and an inf gradient skips the step and backs off",
          "[worker][gpu][amp]") {
  REQUIRE_CUDA_OR_SKIP();
  const torch::Device dev(torch::kCUDA, 0);
  std::vector<float> scales;
  std::vector<torch::Tensor> first_param;
  at::ScalarType forward_dtype = at::kFloat;
  double first_loss = 0, last_loss = 0;
  t::runRanks(
      1,
      [&](ProcessGroup& pg) {
        torch::manual_seed(5);
        auto m = torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(),
                                       torch::nn::Linear(64, 8));
        m->to(dev);
        const auto x = torch::randn({256, 32}, dev);
        const auto y = torch::randn({256, 8}, dev);
        auto opt =
            std::make_shared<torch::optim::SGD>(m->parameters(), torch::optim::SGDOptions(0.05));
        TrainerOptions o;
        o.total_epochs = 3;
        o.batch_size = 16;
        o.accumulate_steps = 2;  // 256 / 16 / 2 = 8 steps an epoch
        o.amp = Amp::kFp16;
        o.loss_scaler.growth_interval = 4;
        std::ostringstream log;
        o.log = &log;
        int64_t global = 0;
        o.on_step = [&](const TrainingProgress& p) {
          global = p.global_step;
          scales.push_back(p.loss_scale);
          first_param.push_back(m->parameters()[0].detach().cpu().clone());
        };
        auto forward = [&, m](const torch::Tensor& in) mutable {
          auto out = m->forward(in);
          forward_dtype = out.scalar_type();
          return out;
        };
        auto loss = [&](const torch::Tensor& out, const torch::Tensor& target) {
          auto l = torch::mse_loss(out, target);
          return global + 1 == 3 ? l * INFINITY : l;  // step 3's gradients are inf
        };
        Trainer trainer(std::shared_ptr<ProcessGroup>(&pg, [](auto*) {}), m.ptr(), forward, loss,
                        opt, x, y, o);
        trainer.train();
        const std::string lines = log.str();
        const auto at = [&](size_t pos) { return std::stod(lines.substr(pos + 6, 10)); };
        first_loss = at(lines.find("| loss ", lines.find("Epoch 1 |")));  // epoch 0 had the inf
        last_loss = at(lines.rfind("| loss "));
      },
      [](int) { return ncclOn(0); });
  CHECK(forward_dtype == at::kHalf);  // autocast ran the linear layers in fp16
  REQUIRE(scales.size() == 24);
  CHECK(scales[1] == 65536.0f);
  CHECK(scales[2] == 32768.0f);                         // step 3: backed off
  CHECK(torch::equal(first_param[1], first_param[2]));  // and skipped
  CHECK(scales[6] == 65536.0f);                         // steps 4-7 clean: grown again
  for (const auto& p : first_param) CHECK(torch::isfinite(p).all().item<bool>());
  CHECK(last_loss < first_loss);
}
