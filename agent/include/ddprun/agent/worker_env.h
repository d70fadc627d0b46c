// The worker environment contract (SPEC §3): which variables each worker of this node gets,
// value for value as torchrun sets them. Pure functions over the round's shape; no I/O.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace ddprun::agent {

// What a completed rendezvous round tells one node.
struct RoundInfo {
  int round = 0;             // bumps on every new round (restart or membership change)
  int membership_epoch = 0;  // bumps only on membership changes
  int group_rank = 0;
  std::vector<int> local_world_sizes;  // indexed by group rank
  std::string master_addr;
  int master_port = 0;
  std::string run_id;
  bool use_agent_store = false;
  // Empty when every node of the round recovers in place (multi-node: their agents' votes,
  // JobIdentityClient); else a line naming a node that restarts processes instead (this one too).
  std::string in_place_veto;
  bool in_place_veto_own = false;  // it names this node: every other one votes for in-place
  // The veto comes only from nodes that listen on their control channel but whose workers have not
  // shown they can recover in place since one failed unannounced (InPlaceVote::kListen): every
  // node's workers get the channel (and can announce support), a failure within the round may
  // start an in-place recovery, and that recovery's own round decides. A recovery whose round
  // has any veto falls back.
  bool in_place_veto_soft = false;
  // Multi-node: the nodes (group rank -> address) whose agents said they run without
  // --snapshot-dir (JobIdentityClient): the round's snapshot sync does not wait for them.
  std::map<int, std::string> without_snapshot_dir;
};

// A node's vote for in-place recovery in a round (docs/in-place-recovery.md §2.1).
enum class InPlaceVote {
  kProcess,  // its agent runs --restart-mode=process (or predates the vote): no control channel
  // --restart-mode=in-place, but a worker failed without having announced support and none
  // announced it since: not this round; its workers get the channel to announce it again.
  kListen,
  kInPlace,
};

// A PyTorch version as far as the worker contract depends on it.
struct TorchVersion {
  int major = 0;
  int minor = 0;
};

// "2.15.0+cu132", "1.13.0a0+gitunknown", "2.2" -> {major, minor}; nullopt for anything else.
std::optional<TorchVersion> parseTorchVersion(const std::string& text);

struct WorkerEnvInputs {
  RoundInfo round;
  std::string role;
  int restart_count = 0;
  int max_restarts = 0;
  std::string error_file;  // per worker; filled by the caller for each local rank
  // DDPRUN_HEARTBEAT_FILE, per worker like error_file; empty when hang detection is off (an
  // inherited DDPRUN_HEARTBEAT_FILE is then dropped: it belongs to some other worker).
  std::string heartbeat_file;
  // DDPRUN_STOP_FILE: where the worker SDK says it stopped on a checkpoint request (its exit 0
  // is then no success); empty: not set.
  std::string stop_file;
  std::string snapshot_dir;  // may be empty
  // DDPRUN_CONTROL_SOCKET: the agent's control channel (--restart-mode=in-place); empty: not set.
  std::string control_socket;
  bool set_omp_num_threads = false;
  // --virtual-local-rank: LOCAL_RANK=0, and CUDA_VISIBLE_DEVICES names only this worker's device
  // (the local rank-th entry of the agent's CUDA_VISIBLE_DEVICES, or the local rank itself).
  bool virtual_local_rank = false;
  // TORCHELASTIC_SIGNALS_TO_HANDLE, as torchrun 2.x sets it: the handled signals' names,
  // comma-separated ("SIGTERM,SIGINT,SIGHUP,SIGQUIT"). Empty: not set.
  std::string signals_to_handle;
  // The workers' PyTorch, when known (a Python program: agent/src/torch_probe.h). It names NCCL's
  // asynchronous error handling switch as that version's torchrun does: torch >= 2.2 reads
  // TORCH_NCCL_ASYNC_ERROR_HANDLING and warns, on every rank, about the older
  // NCCL_ASYNC_ERROR_HANDLING, which is all torch < 2.2 reads. Unknown: both are set.
  std::optional<TorchVersion> torch_version;
};

// Base global rank of `group_rank`: the sum of the local world sizes of lower group ranks.
int baseRank(const std::vector<int>& local_world_sizes, int group_rank);

// The variables ddprun sets for local rank `local_rank`, on top of `parent_env` (the agent's own
// environment, passed through as torchrun does). Returns the full environment, sorted by name.
std::map<std::string, std::string> buildWorkerEnv(
    const WorkerEnvInputs& in, int local_rank,
    const std::map<std::string, std::string>& parent_env);

}  // namespace ddprun::agent
