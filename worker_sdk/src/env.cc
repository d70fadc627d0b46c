#include "ddprun/worker/env.h"

#include <cstdlib>

#include "ddprun/common/strings.h"
#include "ddprun/worker/errors.h"

namespace ddprun::worker {

namespace {

int parseIntVar(const WorkerEnv::Lookup& lookup, const std::string& name,
                std::optional<int> fallback, long long min, long long max) {
  std::optional<std::string> raw = lookup(name);
  if (!raw) {
    if (fallback) return *fallback;
    throw ConfigError("environment variable " + name +
                      " is not set; run this program under ddprun or torchrun, or set it");
  }
  std::optional<long long> v = ddprun::parseInt(ddprun::trim(*raw));
  if (!v || *v < min || *v > max) {
    throw ConfigError("environment variable " + name + "='" + *raw +
                      "' is malformed: expected an integer in [" + std::to_string(min) + ", " +
                      std::to_string(max) + "]");
  }
  return static_cast<int>(*v);
}

}  // namespace

WorkerEnv WorkerEnv::parse(const Lookup& lookup) {
  constexpr long long kMaxInt = 1 << 30;
  WorkerEnv env;
  env.world_size = parseIntVar(lookup, "WORLD_SIZE", std::nullopt, 1, kMaxInt);
  env.rank = parseIntVar(lookup, "RANK", std::nullopt, 0, env.world_size - 1);
  env.local_world_size = parseIntVar(lookup, "LOCAL_WORLD_SIZE", env.world_size, 1, kMaxInt);
  env.local_rank = parseIntVar(lookup, "LOCAL_RANK", env.rank, 0, env.local_world_size - 1);
  std::optional<std::string> addr = lookup("MASTER_ADDR");
  if (!addr || ddprun::trim(*addr).empty()) {
    throw ConfigError(
        "environment variable MASTER_ADDR is not set; run this program under ddprun or torchrun, "
        "or set it");
  }
  env.master_addr = ddprun::trim(*addr);
  env.master_port = parseIntVar(lookup, "MASTER_PORT", std::nullopt, 1, 65535);
  env.restart_count = parseIntVar(lookup, "TORCHELASTIC_RESTART_COUNT", 0, 0, kMaxInt);
  if (lookup("DDPRUN_ROUND")) env.round = parseIntVar(lookup, "DDPRUN_ROUND", 0, 0, kMaxInt);
  if (auto v = lookup("TORCHELASTIC_USE_AGENT_STORE")) {
    std::optional<bool> b = ddprun::parseBool(ddprun::trim(*v));
    if (!b) {
      throw ConfigError("environment variable TORCHELASTIC_USE_AGENT_STORE='" + *v +
                        "' is malformed: expected True or False");
    }
    env.use_agent_store = *b;
  }
  env.snapshot_dir = lookup("DDPRUN_SNAPSHOT_DIR").value_or("");
  env.heartbeat_file = lookup("DDPRUN_HEARTBEAT_FILE").value_or("");
  env.control_socket = lookup("DDPRUN_CONTROL_SOCKET").value_or("");
  env.stop_file = lookup("DDPRUN_STOP_FILE").value_or("");
  return env;
}

WorkerEnv WorkerEnv::fromProcessEnv() {
  return parse([](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  });
}

}  // namespace ddprun::worker
