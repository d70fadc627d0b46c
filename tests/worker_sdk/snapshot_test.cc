#include "ddprun/worker/snapshot.h"

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>

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

TEST_CASE("a damaged snapshot is an error naming the file, however it is damaged",
          "[worker][snapshot]") {
  t::TempDir dir;
  torch::nn::Linear m(3, 1);
  torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.1));
  TrainingProgress p;
  const std::string good = dir.str() + "/good.pt";
  saveSnapshot(good, *m, opt, p);
  std::string bytes;
  {
    std::ifstream in(good, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  REQUIRE(bytes.size() > 100);
  auto check = [&](const std::string& name, const std::string& content) {
    const std::string path = dir.str() + "/" + name;
    std::ofstream(path, std::ios::binary) << content;
    INFO(name);
    CHECK_THROWS_WITH(
        loadSnapshot(path, *m, opt, p),
        Catch::Contains("cannot load snapshot '" + path + "'") && Catch::Contains("unreadable"));
  };
  check("truncated.pt", bytes.substr(0, bytes.size() / 2));
  std::string flipped = bytes;
  for (size_t i = bytes.size() / 3; i < bytes.size() / 3 + 64; ++i) flipped[i] ^= 0x5a;
  check("flipped.pt", flipped);
  check("empty.pt", "");
  // A valid archive of something else (no model, no progress).
  torch::serialize::OutputArchive other;
  other.write("x", torch::ones({2}));
  const std::string other_path = dir.str() + "/other.pt";
  other.save_to(other_path);
  CHECK_THROWS_WITH(loadSnapshot(other_path, *m, opt, p),
                    Catch::Contains("cannot load snapshot '" + other_path + "'"));
  // A snapshot of another model.
  torch::nn::Linear big(7, 4);
  torch::optim::SGD big_opt(big->parameters(), torch::optim::SGDOptions(0.1));
  const std::string big_path = dir.str() + "/big.pt";
  saveSnapshot(big_path, *big, big_opt, p);
  CHECK_THROWS_WITH(loadSnapshot(big_path, *m, opt, p),
                    Catch::Contains("cannot load snapshot '" + big_path + "'"));
}

TEST_CASE("temp files of an interrupted snapshot write are removed, a live writer's are kept",
          "[worker][snapshot]") {
  t::TempDir dir;
  const std::string snap = dir.str() + "/snap.pt";
  const std::string dead = snap + ".tmp.2147483646.12345";
  const std::string alive = snap + ".tmp." + std::to_string(::getpid()) + ".99";
  const std::string other = snap + ".bak";
  const std::string odd = snap + ".tmp.notapid.1";
  for (const auto& f : {dead, alive, other, odd}) std::ofstream(f) << "partial";
  CHECK(removeStaleTempFiles(snap) == 1);
  CHECK_FALSE(std::filesystem::exists(dead));
  CHECK(std::filesystem::exists(alive));
  CHECK(std::filesystem::exists(other));
  CHECK(std::filesystem::exists(odd));
  CHECK(removeStaleTempFiles(dir.str() + "/missing/snap.pt") == 0);
}

TEST_CASE("a directory where the snapshot file should be is named as such", "[worker][snapshot]") {
  t::TempDir dir;
  const std::string path = dir.str() + "/snapshot.pt";
  std::filesystem::create_directories(path);
  torch::nn::Linear m(3, 1);
  torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.1));
  TrainingProgress p;
  for (auto attempt : {std::function<void()>([&] { readSnapshotFile(path); }),
                       std::function<void()>([&] { loadSnapshot(path, *m, opt, p); }),
                       std::function<void()>([&] { saveSnapshot(path, *m, opt, p); })}) {
    CHECK_THROWS_WITH(attempt(), Catch::Contains("'" + path + "': it is a directory"));
  }
  CHECK(std::filesystem::is_directory(path));  // left alone
}

TEST_CASE("a snapshot write past the file size limit fails clearly and leaves no temp file",
          "[worker][snapshot]") {
  t::TempDir dir;
  const std::string path = dir.str() + "/snap.pt";
  const std::string message = dir.str() + "/message";
  // In a child: RLIMIT_FSIZE is the process's, and SIGXFSZ would end the whole test binary.
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    rlimit limit{4096, 4096};
    ::setrlimit(RLIMIT_FSIZE, &limit);
    try {
      writeFileAtomically(path, std::string(1 << 20, 'x'));
      ::_exit(3);
    } catch (const WorkerError& e) {
      std::ofstream(message) << e.what();
      ::_exit(0);
    }
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  REQUIRE(WIFEXITED(status));  // not killed by SIGXFSZ
  CHECK(WEXITSTATUS(status) == 0);
  CHECK_THAT(t::readFile(message), Catch::Contains("larger than the process's file size limit"));
  int left = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    left += entry.path().filename().string().rfind("snap.pt", 0) == 0;
  }
  CHECK(left == 0);
}
