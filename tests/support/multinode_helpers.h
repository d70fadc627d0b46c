// Helpers of the multi-node e2e suites: the test worker's ddprun arguments
// (tests/agent/ddprun_test_worker), what its state and env files say after a job that restarted
// its workers once, and two agents that both succeed.
#pragma once

#include <catch2/catch.hpp>
#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "process_helpers.h"

namespace ddprun::testing {

// `args` for the test worker, behind the ddprun flags that run it as a plain executable.
inline std::vector<std::string> testWorker(std::vector<std::string> args) {
  args.insert(args.begin(), {"--no-python", testWorkerBin()});
  return args;
}

// Every rank of `ranks` ran twice (attempts 0 and 1, never 2) and its second attempt saw
// TORCHELASTIC_RESTART_COUNT=1 (the worker's --state-dir and --env-out files).
inline void checkEveryRankRestartedOnce(const TempDir& state, const TempDir& envs, int ranks) {
  for (int r = 0; r < ranks; ++r) {
    INFO("rank " << r);
    CHECK(fileExists(state / ("pid." + std::to_string(r) + ".1")));
    CHECK_FALSE(fileExists(state / ("pid." + std::to_string(r) + ".2")));
    CHECK(parseEnvFile(
              readFile(envs / ("env." + std::to_string(r))))["TORCHELASTIC_RESTART_COUNT"] == "1");
  }
}

// Waits (bounded) for two nodes' agents and checks that both succeeded.
inline std::pair<Finished, Finished> bothSucceed(
    Process& a, Process& b, std::chrono::seconds bound = std::chrono::seconds(120)) {
  auto ra = a.wait(bound), rb = b.wait(bound);
  INFO((ra ? "" : stuckReport(a, "the first agent", bound))
       << (rb ? "" : stuckReport(b, "the second agent", bound)) << "first agent:\n"
       << a.err() << "second agent:\n"
       << b.err());
  REQUIRE(ra);
  REQUIRE(rb);
  CHECK(ra->exit_code == 0);
  CHECK(rb->exit_code == 0);
  return {*ra, *rb};
}

}  // namespace ddprun::testing
