// train: the PyTorch DDP tutorial's job on the worker SDK. Run it under ddprun or torchrun:
//   ddprun --standalone --nproc_per_node=2 train 50 10
// Usage errors exit 2, failures exit 1, a checkpoint signal (SIGTERM/SIGUSR1) saves and exits 0.
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ddprun/common/strings.h"
#include "ddprun/worker/errors.h"
#include "ddprun/worker/process_group.h"
#include "ddprun/worker/trainer.h"
#include "models.h"

namespace {

constexpr const char* kUsage =
    "usage: train TOTAL_EPOCHS SAVE_EVERY [--snapshot-path P] [--batch-size N] [--model "
    "linear|mlp|cnn]\n"
    "             [--backend gloo|nccl] [--lr F] [--dataset-size N] [--bucket-cap-mb F] "
    "[--no-overlap]\n"
    "             [--compression none|fp16|bf16] [--accumulate N] [--amp none|bf16|fp16]\n"
    "             [--seed N] [--dump-params FILE] [--timing] [--fail-at-step N] [--fail-ranks K]\n"
    "             [--fail-signal KILL|TERM|HANG] [--step-log FILE] [--step-delay S]\n"
    "  --accumulate N:   N micro-batches of --batch-size per optimizer step, reduced once "
    "(no_sync)\n"
    "  --amp bf16|fp16:  mixed precision: autocast forward and loss; fp16 also scales the loss\n"
    "  --fail-at-step N: fault injection for tests: the last rank kills itself (SIGKILL) after "
    "global\n"
    "                    step N on the first attempt (TORCHELASTIC_RESTART_COUNT=0)\n"
    "  --fail-signal TERM: ... sends itself SIGTERM instead (it is asked to stop; under\n"
    "                    --restart-mode=in-place it leaves and the others go on)\n"
    "  --fail-signal HANG: ... sleeps for good instead (a hang in the program's own code)\n"
    "  --fail-ranks K:   ... the last K ranks do it, at the same step (default 1)\n"
    "  --step-log FILE:  rank 0 appends '<global step> <unix time>' after every optimizer step\n"
    "  --step-delay S:   every rank sleeps S seconds (at most 60) after each optimizer step, in\n"
    "                    place of a larger model's compute (as ddp_tutorial.py's --step_delay)";

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Args {
  int64_t total_epochs = 0;
  int64_t save_every = 0;
  std::string snapshot_path;
  int64_t batch_size = 32;
  std::string model = "linear";
  std::string backend = "gloo";
  double lr = 1e-3;
  int64_t dataset_size = 2048;
  double bucket_cap_mb = 25;
  bool overlap = true;
  ddprun::worker::Compression compression = ddprun::worker::Compression::kNone;
  int64_t accumulate = 1;
  ddprun::worker::Amp amp = ddprun::worker::Amp::kNone;
  int64_t seed = 0;
  std::string dump_params;
  bool timing = false;
  int64_t fail_at_step = -1;
  int fail_signal = SIGKILL;  // 0: hang
  int64_t fail_ranks = 1;
  std::string step_log;
  double step_delay = 0;
};

int64_t intArg(const std::string& flag, const std::string& v, int64_t min) {
  auto n = ddprun::parseInt(v);
  if (!n || *n < min)
    throw UsageError(flag + " must be an integer >= " + std::to_string(min) + ", got '" + v + "'");
  return *n;
}

double positiveArg(const std::string& flag, const std::string& v) {
  auto d = ddprun::parseDouble(v);
  if (!d || !(*d > 0)) throw UsageError(flag + " must be a positive number, got '" + v + "'");
  return *d;
}

Args parseArgs(int argc, char** argv) {
  Args a;
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::optional<std::string> inline_value;
    if (ddprun::startsWith(arg, "--") && arg.find('=') != std::string::npos) {
      inline_value = arg.substr(arg.find('=') + 1);
      arg = arg.substr(0, arg.find('='));
    }
    std::replace(arg.begin(), arg.end(), '_', '-');
    auto value = [&]() -> std::string {
      if (inline_value) return *inline_value;
      if (i + 1 >= argc) throw UsageError(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--snapshot-path")
      a.snapshot_path = value();
    else if (arg == "--batch-size")
      a.batch_size = intArg(arg, value(), 1);
    else if (arg == "--model") {
      a.model = value();
      if (a.model != "linear" && a.model != "mlp" && a.model != "cnn") {
        throw UsageError("--model must be linear, mlp or cnn, got '" + a.model + "'");
      }
    } else if (arg == "--backend") {
      a.backend = value();
      try {
        ddprun::worker::parseBackend(a.backend);
      } catch (const ddprun::worker::ConfigError& e) {
        throw UsageError(std::string("--backend: ") + e.what());
      }
    } else if (arg == "--lr")
      a.lr = positiveArg(arg, value());
    else if (arg == "--dataset-size")
      a.dataset_size = intArg(arg, value(), 1);
    else if (arg == "--bucket-cap-mb")
      a.bucket_cap_mb = positiveArg(arg, value());
    else if (arg == "--no-overlap")
      a.overlap = false;
    else if (arg == "--compression") {
      try {
        a.compression = ddprun::worker::parseCompression(value());
      } catch (const ddprun::worker::ConfigError& e) {
        throw UsageError(std::string("--compression: ") + e.what());
      }
    } else if (arg == "--accumulate")
      a.accumulate = intArg(arg, value(), 1);
    else if (arg == "--amp") {
      try {
        a.amp = ddprun::worker::parseAmp(value());
      } catch (const ddprun::worker::ConfigError& e) {
        throw UsageError(std::string("--amp: ") + e.what());
      }
    } else if (arg == "--seed")
      a.seed = intArg(arg, value(), 0);
    else if (arg == "--dump-params")
      a.dump_params = value();
    else if (arg == "--timing")
      a.timing = true;
    else if (arg == "--fail-at-step")
      a.fail_at_step = intArg(arg, value(), 1);
    else if (arg == "--fail-ranks")
      a.fail_ranks = intArg(arg, value(), 1);
    else if (arg == "--fail-signal") {
      const std::string v = value();
      if (v != "KILL" && v != "TERM" && v != "HANG")
        throw UsageError("--fail-signal must be KILL, TERM or HANG, got '" + v + "'");
      a.fail_signal = v == "KILL" ? SIGKILL : v == "TERM" ? SIGTERM : 0;
    } else if (arg == "--step-log")
      a.step_log = value();
    else if (arg == "--step-delay") {
      a.step_delay = positiveArg(arg, value());
      if (a.step_delay > 60) throw UsageError("--step-delay must be at most 60 seconds");
    } else if (arg == "-h" || arg == "--help") {
      std::cout << kUsage << std::endl;
      std::exit(0);
    } else if (ddprun::startsWith(arg, "-"))
      throw UsageError("unknown option " + arg);
    else
      positional.push_back(arg);
  }
  if (positional.size() != 2) throw UsageError("expected TOTAL_EPOCHS and SAVE_EVERY");
  a.total_epochs = intArg("TOTAL_EPOCHS", positional[0], 0);
  a.save_every = intArg("SAVE_EVERY", positional[1], 0);
  return a;
}

void dumpParams(const std::string& path, torch::nn::Module& m) {
  std::ofstream f(path, std::ios::binary);
  for (auto& p : m.parameters()) {
    auto c = p.detach().contiguous().to(torch::kCPU);
    f.write(static_cast<const char*>(c.data_ptr()),
            static_cast<std::streamsize>(c.numel() * c.element_size()));
  }
  if (!f) throw ddprun::worker::WorkerError("cannot write " + path);
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  try {
    args = parseArgs(argc, argv);
  } catch (const UsageError& e) {
    std::cerr << "train: " << e.what() << "\n" << kUsage << std::endl;
    return 2;
  }
  try {
    namespace w = ddprun::worker;
    const w::WorkerEnv env = w::WorkerEnv::fromProcessEnv();
    w::ProcessGroupOptions pg_opts;
    pg_opts.backend = w::parseBackend(args.backend);
    auto group = w::ProcessGroup::initFromEnv(env, pg_opts);
    if (group->inPlace()) {
      std::cout << "[RANK " << group->rank() << "] pid " << ::getpid() << " joined generation "
                << group->generation() << " (in-place recovery on)" << std::endl;
    }

    torch::manual_seed(static_cast<uint64_t>(args.seed));
    auto task = ddprun::examples::makeTask(args.model, args.dataset_size,
                                           1234 + static_cast<uint64_t>(args.seed));
    if (pg_opts.backend == w::Backend::kNccl) {
      const auto dev = torch::Device(torch::kCUDA, env.local_rank);
      task.module->to(dev);
      task.inputs = task.inputs.to(dev);
      task.targets = task.targets.to(dev);
    }
    auto opt = std::make_shared<torch::optim::SGD>(task.module->parameters(),
                                                   torch::optim::SGDOptions(args.lr));

    w::TrainerOptions o;
    o.total_epochs = args.total_epochs;
    o.save_every = args.save_every;
    o.snapshot_path = args.snapshot_path;
    if (o.snapshot_path.empty())
      o.snapshot_path =
          env.snapshot_dir.empty() ? "snapshot.pt" : env.snapshot_dir + "/snapshot.pt";
    o.batch_size = args.batch_size;
    o.heartbeat_file = env.heartbeat_file;
    o.stop_file = env.stop_file;
    o.ddp.bucket_cap_mb = args.bucket_cap_mb;
    o.ddp.compression = args.compression;
    o.ddp.overlap = args.overlap;
    o.accumulate_steps = args.accumulate;
    o.amp = args.amp;
    // Step timing (--timing): steady-state mean, skipping the first kWarmup steps of this run.
    constexpr int64_t kWarmup = 5;
    std::vector<std::chrono::steady_clock::time_point> stamps;
    const bool inject = args.fail_at_step > 0 && env.restart_count == 0 &&
                        env.rank >= env.world_size - args.fail_ranks;
    auto unixNow = [] {
      return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
          .count();
    };
    std::unique_ptr<std::FILE, int (*)(std::FILE*)> step_log(nullptr, &std::fclose);
    if (!args.step_log.empty()) {  // every rank: rank 0 may move in an in-place recovery
      step_log.reset(std::fopen(args.step_log.c_str(), "a"));
      if (!step_log) throw w::WorkerError("cannot open --step-log " + args.step_log);
    }
    o.on_step = [&, inject, n = args.fail_at_step](const w::TrainingProgress& p) {
      if (args.timing) stamps.push_back(std::chrono::steady_clock::now());
      if (step_log && group->rank() == 0) {
        std::fprintf(step_log.get(), "%lld %.6f\n", static_cast<long long>(p.global_step),
                     unixNow());
        std::fflush(step_log.get());
      }
      if (inject && p.global_step == n) {
        std::fprintf(stderr, "train: fault injection: %s at step %lld at %.6f\n",
                     args.fail_signal == SIGKILL   ? "killing myself"
                     : args.fail_signal == SIGTERM ? "sending myself SIGTERM"
                                                   : "hanging",
                     static_cast<long long>(n), unixNow());
        if (args.fail_signal == 0) {
          for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
        }
        std::raise(args.fail_signal);
      }
      if (args.step_delay > 0) {
        std::this_thread::sleep_for(std::chrono::duration<double>(args.step_delay));
      }
    };
    w::Trainer trainer(group, task.module, task.forward, task.loss, opt, task.inputs, task.targets,
                       o);
    const auto outcome = trainer.train();
    if (args.timing) {
      const int64_t steps = static_cast<int64_t>(stamps.size()) - 1 - kWarmup;
      const double secs =
          steps > 0 ? std::chrono::duration<double>(stamps.back() - stamps[kWarmup]).count() : 0.0;
      std::printf("[RANK %d] timing: %.3f ms/step over %lld steps (after %lld warm-up steps)\n",
                  group->rank(), steps > 0 ? 1e3 * secs / static_cast<double>(steps) : 0.0,
                  static_cast<long long>(std::max<int64_t>(steps, 0)),
                  static_cast<long long>(kWarmup));
      std::fflush(stdout);
    }
    // It left the job (SIGTERM to part of the world under in-place recovery): the others go on
    // without it, and its group is closed.
    if (outcome == w::Trainer::Outcome::kLeft) return 0;
    if (!args.dump_params.empty() && group->rank() == 0) dumpParams(args.dump_params, *task.module);
    if (outcome == w::Trainer::Outcome::kStoppedBySignal) {
      std::cout << "[RANK " << group->rank() << "] stopped by checkpoint signal" << std::endl;
    }
    group->comm().barrier();
    return 0;
  } catch (const ddprun::worker::ConfigError& e) {
    std::cerr << "train: " << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "train: error: " << e.what() << std::endl;
    return 1;
  }
}
