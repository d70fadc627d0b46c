#include "ddprun/worker/snapshot.h"

#include <filesystem>
#include <fstream>

#include "ddprun/worker/errors.h"
#include "test_util.h"
#include "torch_catch.h"

using namespace ddprun::worker;
namespace t = ddprun::worker::testing;

namespace {
void trainSteps(torch::nn::Linear& m, torch::optim::Optimizer& opt, int steps, uint64_t seed) {
  torch::manual_seed(seed);
  for (int i = 0; i < steps; ++i) {
    opt.zero_grad();
    torch::mse_loss(m->forward(torch::randn({8, 5})), torch::randn({8, 2})).backward();
    opt.step();
  }
}
}  // namespace

TEST_CASE("a snapshot restores model, Adam state, progress and RNG exactly", "[worker][snapshot]") {
  t::TempDir dir;
  const std::string path = dir.str() + "/sub/snap.pt";
  torch::nn::Linear a(5, 2);
  torch::optim::Adam opt_a(a->parameters(), torch::optim::AdamOptions(0.01));
  trainSteps(a, opt_a, 3, 1);
  TrainingProgress saved{4, 7, 131, 2.5};
  torch::manual_seed(99);
  saveSnapshot(path, *a, opt_a, saved);
  const auto rng_after_save = torch::rand({4});

  torch::nn::Linear b(5, 2);  // different initial weights, fresh optimizer
  torch::optim::Adam opt_b(b->parameters(), torch::optim::AdamOptions(0.01));
  TrainingProgress loaded;
  REQUIRE(loadSnapshot(path, *b, opt_b, loaded));
  CHECK(torch::rand({4}).equal(rng_after_save));
  CHECK(loaded.epoch == 4);
  CHECK(loaded.step_in_epoch == 7);
  CHECK(loaded.global_step == 131);
  CHECK(loaded.epoch_loss_sum == 2.5);
  CHECK(a->weight.equal(b->weight));
  CHECK(a->bias.equal(b->bias));
  // Continuing both runs gives bit-identical weights only if Adam's moments came back too.
  trainSteps(a, opt_a, 2, 5);
  trainSteps(b, opt_b, 2, 5);
  CHECK(a->weight.equal(b->weight));
  CHECK(a->bias.equal(b->bias));
}

TEST_CASE("a missing snapshot is reported as absent and a corrupt one as an error naming it",
          "[worker][snapshot]") {
  t::TempDir dir;
  torch::nn::Linear m(3, 1);
  torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.1));
  TrainingProgress p;
  CHECK_FALSE(loadSnapshot(dir.str() + "/none.pt", *m, opt, p));
  const std::string bad = dir.str() + "/bad.pt";
  std::ofstream(bad) << "not a snapshot";
  CHECK_THROWS_WITH(loadSnapshot(bad, *m, opt, p),
                    Catch::Contains("cannot load snapshot '" + bad + "'"));
}

TEST_CASE("atomic writes replace the file whole and leave no temp files", "[worker][snapshot]") {
  t::TempDir dir;
  const std::string path = dir.str() + "/f.bin";
  writeFileAtomically(path, "first");
  writeFileAtomically(path, std::string(100000, 'x'));
  std::ifstream f(path, std::ios::binary);
  std::string content((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  CHECK(content == std::string(100000, 'x'));
  int entries = 0;
  for (auto& e : std::filesystem::directory_iterator(dir.path())) {
    (void)e;
    ++entries;
  }
  CHECK(entries == 1);
  CHECK_THROWS_AS(writeFileAtomically("/proc/no/such/dir/f.bin", "x"), WorkerError);
}

TEST_CASE("the heartbeat touch creates the file and advances its mtime", "[worker][snapshot]") {
  t::TempDir dir;
  const std::string hb = dir.str() + "/hb";
  touchFile(hb);
  REQUIRE(std::filesystem::exists(hb));
  const auto old_time = std::filesystem::last_write_time(hb) - std::chrono::hours(1);
  std::filesystem::last_write_time(hb, old_time);
  touchFile(hb);
  CHECK(std::filesystem::last_write_time(hb) > old_time);
}
