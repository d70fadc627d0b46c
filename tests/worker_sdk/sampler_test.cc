#include "ddprun/worker/sampler.h"

#include <catch2/catch.hpp>
#include <fstream>
#include <sstream>
#include <vector>

#include "ddprun/worker/errors.h"
#include "test_util.h"

using ddprun::worker::DistributedSampler;
using ddprun::worker::SamplerOptions;
namespace t = ddprun::worker::testing;

TEST_CASE("the sampler matches PyTorch's DistributedSampler index lists", "[worker][sampler]") {
  struct Config {
    SamplerOptions o;
    int64_t epoch;
  };
  std::vector<Config> configs;
  for (int64_t size : {0, 1, 7, 10, 100, 2048, 2051}) {
    for (int replicas : {1, 2, 3, 4}) {
      for (bool shuffle : {true, false}) {
        for (bool drop_last : {false, true}) {
          for (int64_t epoch : {0, 3}) {
            const int rank = static_cast<int>((size + epoch) % replicas);
            configs.push_back({SamplerOptions{size, replicas, rank, shuffle,
                                              42u + static_cast<uint64_t>(size % 5), drop_last},
                               epoch});
          }
        }
      }
    }
  }
  t::TempDir dir;
  const std::string cfg = (dir.path() / "configs.txt").string();
  {
    std::ofstream f(cfg);
    for (const auto& c : configs) {
      f << c.o.size << ' ' << c.o.num_replicas << ' ' << c.o.rank << ' ' << c.o.shuffle << ' '
        << c.o.seed << ' ' << c.o.drop_last << ' ' << c.epoch << '\n';
    }
  }
  auto res =
      t::run(t::python() + " " + t::sourceDir() + "/tests/worker_sdk/sampler_reference.py " + cfg);
  REQUIRE(res.exit_code == 0);
  std::istringstream lines(res.output);
  std::string line;
  size_t compared = 0;
  for (const auto& c : configs) {
    REQUIRE(std::getline(lines, line));
    std::vector<int64_t> expected;
    std::istringstream ls(line);
    int64_t v;
    while (ls >> v) expected.push_back(v);
    DistributedSampler s(c.o);
    s.setEpoch(c.epoch);
    INFO("size=" << c.o.size << " replicas=" << c.o.num_replicas << " rank=" << c.o.rank
                 << " shuffle=" << c.o.shuffle << " drop_last=" << c.o.drop_last
                 << " epoch=" << c.epoch);
    CHECK(s.indices() == expected);
    CHECK(s.numSamples() == static_cast<int64_t>(expected.size()));
    ++compared;
  }
  CHECK(compared == configs.size());
}

TEST_CASE("different epochs shuffle differently and ranks partition the padded set",
          "[worker][sampler]") {
  SamplerOptions o{10, 3, 0, true, 7, false};
  DistributedSampler s0(o);
  auto e0 = s0.indices();
  s0.setEpoch(1);
  CHECK(s0.indices() != e0);
  std::vector<int> count(10, 0);
  for (int r = 0; r < 3; ++r) {
    o.rank = r;
    DistributedSampler s(o);
    for (auto i : s.indices()) ++count[static_cast<size_t>(i)];
  }
  int total = 0;
  for (int c : count) {
    CHECK(c >= 1);
    total += c;
  }
  CHECK(total == 12);  // 10 samples padded to 4 per rank
}

TEST_CASE("bad sampler options are rejected with a clear error", "[worker][sampler]") {
  CHECK_THROWS_WITH(DistributedSampler(SamplerOptions{10, 2, 2}),
                    Catch::Contains("rank 2 is outside [0, 1]"));
  CHECK_THROWS_AS(DistributedSampler(SamplerOptions{10, 0, 0}), ddprun::worker::ConfigError);
  CHECK_THROWS_AS(DistributedSampler(SamplerOptions{-1, 1, 0}), ddprun::worker::ConfigError);
}
