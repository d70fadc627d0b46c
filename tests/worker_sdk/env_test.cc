#include "ddprun/worker/env.h"

#include <catch2/catch.hpp>
#include <map>

#include "ddprun/worker/errors.h"

using ddprun::worker::ConfigError;
using ddprun::worker::WorkerEnv;

namespace {
WorkerEnv::Lookup from(std::map<std::string, std::string> m) {
  return [m](const std::string& k) -> std::optional<std::string> {
    auto it = m.find(k);
    if (it == m.end()) return std::nullopt;
    return it->second;
  };
}
std::map<std::string, std::string> good() {
  return {{"RANK", "3"},
          {"WORLD_SIZE", "6"},
          {"LOCAL_RANK", "1"},
          {"LOCAL_WORLD_SIZE", "2"},
          {"MASTER_ADDR", "node0"},
          {"MASTER_PORT", "29500"},
          {"TORCHELASTIC_RESTART_COUNT", "2"}};
}
std::string errorOf(const std::map<std::string, std::string>& m) {
  try {
    WorkerEnv::parse(from(m));
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("the worker environment is read from the torchrun variables", "[worker][env]") {
  WorkerEnv env = WorkerEnv::parse(from(good()));
  CHECK(env.rank == 3);
  CHECK(env.world_size == 6);
  CHECK(env.local_rank == 1);
  CHECK(env.local_world_size == 2);
  CHECK(env.master_addr == "node0");
  CHECK(env.master_port == 29500);
  CHECK(env.restart_count == 2);
  CHECK(env.round == -1);  // not under ddprun
  CHECK(env.snapshot_dir.empty());
  CHECK_FALSE(env.use_agent_store);
}

TEST_CASE("an agent-hosted store (torchrun's static backend) is recognised", "[worker][env]") {
  auto m = good();
  m["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  CHECK(WorkerEnv::parse(from(m)).use_agent_store);
  m["TORCHELASTIC_USE_AGENT_STORE"] = "False";
  CHECK_FALSE(WorkerEnv::parse(from(m)).use_agent_store);
  m["TORCHELASTIC_USE_AGENT_STORE"] = "maybe";
  CHECK_THAT(errorOf(m), Catch::Contains("TORCHELASTIC_USE_AGENT_STORE='maybe'"));
}

TEST_CASE("a missing or malformed variable is named in the error", "[worker][env]") {
  auto m = good();
  m.erase("MASTER_PORT");
  CHECK_THAT(errorOf(m), Catch::Contains("MASTER_PORT is not set"));
  m = good();
  m["RANK"] = "6";
  CHECK_THAT(errorOf(m), Catch::Contains("RANK='6' is malformed"));
  m = good();
  m["WORLD_SIZE"] = "two";
  CHECK_THAT(errorOf(m), Catch::Contains("WORLD_SIZE='two'"));
  m = good();
  m["MASTER_PORT"] = "70000";
  CHECK_THAT(errorOf(m), Catch::Contains("MASTER_PORT='70000'"));
  m = good();
  m.erase("MASTER_ADDR");
  CHECK_THAT(errorOf(m), Catch::Contains("MASTER_ADDR"));
}

TEST_CASE("ddprun's round is read, and a malformed one named", "[worker][env]") {
  auto m = good();
  m["DDPRUN_ROUND"] = "17";
  CHECK(WorkerEnv::parse(from(m)).round == 17);
  for (const char* bad : {"-1", "x", "", "99999999999"}) {
    m["DDPRUN_ROUND"] = bad;
    CHECK_THAT(errorOf(m), Catch::Contains(std::string("DDPRUN_ROUND='") + bad + "' is malformed"));
  }
}
