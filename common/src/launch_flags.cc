#include "ddprun/common/launch_flags.h"

namespace ddprun {

const std::vector<LaunchFlag>& launchFlags() {
  static const std::vector<LaunchFlag> kFlags = {
      {"nnodes", true, "MIN:MAX",
       "Number of nodes, or the range of nodes in form <minimum_nodes>:<maximum_nodes>. Default "
       "1:1."},
      {"nproc_per_node", true, "NPROC",
       "Number of workers per node; supported values: [auto, cpu, gpu, int]. Default 1."},
      {"rdzv_backend", true, "BACKEND",
       "Rendezvous backend: static, c10d (ddprun's gRPC rendezvous; alias grpc). Default static."},
      {"rdzv_endpoint", true, "HOST[:PORT]",
       "Rendezvous backend endpoint; usually in form <host>:<port> (default port 29400)."},
      {"rdzv_id", true, "ID", "User-defined group id. Default none."},
      {"rdzv_conf", true, "K=V,...",
       "Additional rendezvous configuration (<key1>=<value1>,<key2>=<value2>,...): "
       "join_timeout, timeout, last_call_timeout, close_timeout, read_timeout, heartbeat_interval, "
       "heartbeat_misses, failure_grace, is_host, token_file, tls_ca, tls_cert, tls_key."},
      {"standalone", false, nullptr,
       "Start a local standalone rendezvous backend on a free port, with a fresh run id. Single "
       "node only."},
      {"max_restarts", true, "N",
       "Maximum number of worker group restarts before failing. Default 0."},
      {"monitor_interval", true, "SECONDS",
       "Accepted for compatibility; ddprun notices worker exits at once. Default 0.1."},
      {"start_method", true, "METHOD",
       "Accepted for compatibility (spawn, fork, forkserver); workers are always exec'd."},
      {"role", true, "ROLE", "User-defined role for the workers. Default default."},
      {"module", false, nullptr,
       "Change each process to interpret the launch script as a Python module (python3 -u -m)."},
      {"no_python", false, nullptr,
       "Skip prepending the training script with 'python3 -u' - just execute it directly."},
      {"log_dir", true, "DIR", "Base directory for log files (a temp dir by default)."},
      {"redirects", true, "STD",
       "Redirect std streams into a log file: 0 none, 1 stdout, 2 stderr, 3 both; or per local "
       "rank: 0:1,1:2."},
      {"tee", true, "STD",
       "Tee std streams into a log file and also to console (see --redirects for the format)."},
      {"local_ranks_filter", true, "RANKS",
       "Only show the tee'd output of these local ranks on the console, e.g. 0,1."},
      {"node_rank", true, "RANK",
       "Rank of the node for multi-node distributed training (static backend). Default 0."},
      {"master_addr", true, "ADDR",
       "Address of the master node (rank 0), static backend only. Default 127.0.0.1."},
      {"master_port", true, "PORT",
       "Port on the master node for communication during training, static backend only. Default "
       "29500."},
      {"local_addr", true, "ADDR",
       "Address this node advertises to the others. Default: the host's fully qualified name."},
      {"shutdown_timeout", true, "SECONDS",
       "Seconds between SIGTERM and SIGKILL when stopping workers. Default 30."},
      {"signals_to_handle", true, "SIGNALS",
       "Signals forwarded to workers. Default SIGTERM,SIGINT,SIGHUP,SIGQUIT."},
      {"log_line_prefix_template", true, "TEMPLATE",
       "Prefix of tee'd lines, from ${role_name} ${local_rank} ${rank} ${hostname}. Default "
       "[${role_name}${local_rank}]:"},
      {"exit_barrier_timeout", true, "SECONDS",
       "How long a node whose workers succeeded waits for the other nodes. Default 300."},
      {"heartbeat_timeout", true, "SECONDS",
       "Hang detection: a worker whose DDPRUN_HEARTBEAT_FILE, once touched, goes SECONDS "
       "without a touch fails (0 disables). Default 300."},
      {"snapshot_dir", true, "DIR",
       "Directory for worker snapshots, passed to workers as DDPRUN_SNAPSHOT_DIR."},
      {"metrics_port", true, "PORT",
       "Serve /healthz and Prometheus /metrics of this agent on PORT (0: a free port, printed)."},
  };
  return kFlags;
}

}  // namespace ddprun
