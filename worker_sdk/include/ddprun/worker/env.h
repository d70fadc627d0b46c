// The worker's view of the SPEC §3 environment (set by ddprun and by torchrun alike). Parsing is a
// pure function over a lookup callback so it is unit-testable; fromProcessEnv() reads getenv.
#pragma once

#include <functional>
#include <optional>
#include <string>

namespace ddprun::worker {

struct WorkerEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  int restart_count = 0;  // TORCHELASTIC_RESTART_COUNT (this node's own count)
  // DDPRUN_ROUND: ddprun's rendezvous round, the same on every node; -1 when not set (torchrun).
  int round = -1;
  // TORCHELASTIC_USE_AGENT_STORE: the launcher's agent already hosts the store at
  // MASTER_ADDR:MASTER_PORT (torchrun's static backend), so rank 0 connects instead of hosting.
  bool use_agent_store = false;
  std::string snapshot_dir;    // DDPRUN_SNAPSHOT_DIR, may be empty
  std::string heartbeat_file;  // DDPRUN_HEARTBEAT_FILE, may be empty
  std::string stop_file;       // DDPRUN_STOP_FILE, may be empty
  // DDPRUN_CONTROL_SOCKET: the agent's control channel (--restart-mode=in-place); empty = none.
  std::string control_socket;

  using Lookup = std::function<std::optional<std::string>(const std::string&)>;

  // Requires RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; LOCAL_RANK / LOCAL_WORLD_SIZE default to
  // RANK / WORLD_SIZE. Throws ConfigError naming the variable that is missing or malformed.
  static WorkerEnv parse(const Lookup& lookup);
  static WorkerEnv fromProcessEnv();
};

}  // namespace ddprun::worker
