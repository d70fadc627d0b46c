// AgentConfig: everything one node's agent needs to run a job, as decided by the launcher's
// command line (launcher/cli.h). A plain value type.
#pragma once

#include <cstddef>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "ddprun/rendezvous/conf.h"
#include "ddprun/snapshot/limits.h"

namespace ddprun::agent {

// --rdzv-backend: the launcher maps grpc to kC10d; etcd and etcd-v2 are refused there (etcd 3.6
// removed the v2 API), etcd-v3 is kEtcdV3.
enum class RendezvousBackend { kStatic, kC10d, kEtcdV3 };

// ddprun's --rdzv-conf defaults, as parseRendezvousConf gives them for an empty --rdzv-conf on
// one node; the launcher replaces them with the parsed --rdzv-conf for the --nnodes range.
inline rendezvous::RendezvousConf defaultRendezvousConf() {
  rendezvous::RendezvousConf conf;
  conf.run.heartbeat_interval = rendezvous::kDefaultHeartbeatInterval;
  conf.run.heartbeat_misses = rendezvous::kDefaultHeartbeatMisses;
  conf.failure_grace = 2 * rendezvous::kDefaultHeartbeatInterval;
  return conf;
}

// Which of a worker's streams go to a log file (torchrun's Std): 0 none, 1 stdout, 2 stderr, 3
// both.
enum class StdStreams : int { kNone = 0, kOut = 1, kErr = 2, kAll = 3 };

inline bool hasOut(StdStreams s) { return (static_cast<int>(s) & 1) != 0; }
inline bool hasErr(StdStreams s) { return (static_cast<int>(s) & 2) != 0; }

// A value given either for all local ranks ("3") or per local rank ("0:3,1:1").
struct PerRankStreams {
  StdStreams all = StdStreams::kNone;
  std::map<int, StdStreams> per_rank;  // when non-empty, ranks not listed get kNone
  StdStreams forRank(int local_rank) const {
    if (per_rank.empty()) return all;
    auto it = per_rank.find(local_rank);
    return it == per_rank.end() ? StdStreams::kNone : it->second;
  }
};

// The bounds of --snapshot-dir replication against peers that misbehave (--snapshot-limits).
using SnapshotLimits = snapshot::SnapshotLimits;

struct AgentConfig {
  // Job shape.
  int min_nodes = 1;
  int max_nodes = 1;
  int nproc_per_node = 1;

  // Rendezvous.
  RendezvousBackend rdzv_backend = RendezvousBackend::kStatic;
  std::string rdzv_endpoint;  // "host:port" after normalisation, may be empty
  std::string rdzv_id = "none";
  // --rdzv-conf, parsed once by the launcher (the token and TLS files already read); its
  // run.min_nodes/max_nodes are --nnodes.
  rendezvous::RendezvousConf rdzv_conf = defaultRendezvousConf();
  bool standalone = false;
  int node_rank = 0;                      // static backend only
  std::string master_addr = "127.0.0.1";  // static backend only
  int master_port = 29500;                // static backend only
  bool master_port_given = false;
  std::string local_addr;  // address this node advertises; empty: the host's FQDN

  // Supervision.
  int max_restarts = 0;
  // --restart-mode=in-place: replace only a failed worker; the others recover in place.
  bool restart_in_place = false;
  double monitor_interval = 0.1;  // accepted for compatibility; supervision is event-driven
  double shutdown_timeout = 30.0;
  double exit_barrier_timeout = 300.0;
  // Hang detection: a worker that touched its DDPRUN_HEARTBEAT_FILE and then stopped touching it
  // for this long fails like one that exited non-zero. 0 disables (and sets no variable).
  double heartbeat_timeout = 300.0;
  std::vector<int> signals_to_handle;  // signal numbers forwarded to workers
  std::string role = "default";

  // Program: argv[0] is the executable (already resolved to a path), the rest its arguments.
  std::vector<std::string> worker_argv;
  std::string entrypoint;  // what the user named (script, module or binary), for the report
  // torch.distributed.launch's script argument: each worker's argv gets "--<local_rank_arg>=N"
  // inserted at worker_argv[local_rank_arg_at] (after the script, before its arguments). Empty:
  // none (torchrun and --use-env: the local rank is in LOCAL_RANK only).
  std::string local_rank_arg;
  size_t local_rank_arg_at = 0;
  // The interpreter worker_argv[0] is, when the program runs under Python (empty otherwise), and
  // where it came from ("PYTHON_EXEC" or "PATH"), for the failure report's hint.
  std::string python_interpreter;
  std::string python_interpreter_source;
  // --virtual-local-rank: LOCAL_RANK=0 for every worker, CUDA_VISIBLE_DEVICES its own device.
  bool virtual_local_rank = false;
  // --numa-binding: the CPUs of each local rank (index = local rank); empty: no binding.
  std::vector<std::vector<int>> cpu_affinity;

  // Logs.
  std::string log_dir;  // empty: a fresh temp dir
  PerRankStreams redirects;
  PerRankStreams tee;
  std::optional<std::set<int>> local_ranks_filter;  // nullopt: every rank reaches the console
  std::string log_line_prefix_template;             // empty: "[${role_name}${local_rank}]:"
  // --duplicate-stdout-filters / --duplicate-stderr-filters (torchrun 2.x): tee'd lines that
  // contain one of these strings are also copied, prefixed, to <attempt dir>/filtered_std*.log.
  std::vector<std::string> duplicate_stdout_filters;
  std::vector<std::string> duplicate_stderr_filters;

  // Extras of ours.
  int metrics_port = -1;     // >= 0: serve /healthz and /metrics on local_addr (0: any free port)
  std::string snapshot_dir;  // DDPRUN_SNAPSHOT_DIR when non-empty
  // --snapshot-allow-unauthenticated: replicate between agents without a token (anyone who
  // reaches an agent may then plant or delete files in the directory).
  bool snapshot_allow_unauthenticated = false;
  SnapshotLimits snapshot_limits;    // --snapshot-limits
  bool set_omp_num_threads = false;  // OMP_NUM_THREADS=1 for workers (decided by the launcher)
};

}  // namespace ddprun::agent
