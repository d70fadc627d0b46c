#include "ddprun/common/launch_flags.h"

#include <cctype>

#include "ddprun/common/strings.h"

namespace ddprun {

const std::vector<LaunchFlag>& launchFlags() {
  static const std::vector<LaunchFlag> kFlags = {
      {"nnodes", 0, true, "MIN:MAX",
       "Number of nodes, or the range of nodes in form <minimum_nodes>:<maximum_nodes>. Default "
       "1:1."},
      {"nproc_per_node", 0, true, "NPROC",
       "Number of workers per node; supported values: [auto, cpu, gpu, xpu, int]. Default 1."},
      {"numa_binding", 0, true, "POLICY",
       "Bind each worker's CPU affinity from the NUMA topology in /sys: node, socket, exclusive "
       "or core-complex (local ranks go to NUMA nodes in contiguous blocks).",
       "node,socket,exclusive,core-complex"},
      {"rdzv_backend", 0, true, "BACKEND",
       "Rendezvous backend: static, c10d (ddprun's gRPC rendezvous; alias grpc), etcd-v3 (etcd's "
       "v3 API; --rdzv-endpoint lists the members). Default static.",
       "static,c10d,grpc,etcd-v3"},
      {"rdzv_endpoint", 0, true, "HOST[:PORT]",
       "Rendezvous backend endpoint; usually in form <host>:<port> (default port 29400)."},
      {"rdzv_id", 0, true, "ID", "User-defined group id. Default none."},
      {"rdzv_conf", 0, true, "K=V,...",
       "Additional rendezvous configuration (<key1>=<value1>,<key2>=<value2>,...): "
       "join_timeout, timeout, last_call_timeout, close_timeout, read_timeout, heartbeat_interval, "
       "heartbeat_misses, failure_grace, inplace_timeout, is_host, token_file, tls_ca, tls_cert, "
       "tls_key."},
      {"standalone", 0, false, nullptr,
       "Start a local standalone rendezvous backend on a free port, with a fresh run id. Single "
       "node only."},
      {"max_restarts", 0, true, "N",
       "Maximum number of worker group restarts before failing. Default 0."},
      {"restart_mode", 0, true, "MODE",
       "How workers recover from a failure: process (stop every worker, start them again from "
       "the latest snapshot) or in-place (programs on the worker SDK's Trainer: only the failed "
       "worker is replaced; the others keep their processes and state and go on from the last "
       "completed step). Default process.",
       "process,in-place"},
      {"monitor_interval", 0, true, "SECONDS",
       "Accepted for compatibility; ddprun notices worker exits at once. Default 0.1."},
      {"start_method", 0, true, "METHOD",
       "Accepted for compatibility (spawn, fork, forkserver); workers are always exec'd.",
       "spawn,fork,forkserver"},
      {"role", 0, true, "ROLE", "User-defined role for the workers. Default default."},
      {"module", 'm', false, nullptr,
       "Change each process to interpret the launch script as a Python module (python3 -u -m)."},
      {"no_python", 0, false, nullptr,
       "Skip prepending the training script with 'python3 -u' - just execute it directly."},
      {"run_path", 0, false, nullptr,
       "Run the training script (any file Python can run: a .py, a directory or zip with "
       "__main__.py) under the Python interpreter, as torchrun's runpy.run_path does."},
      {"use_env", 0, false, nullptr,
       "Pass the local rank only as LOCAL_RANK (torch.distributed.launch's flag; ddprun always "
       "sets LOCAL_RANK). Under 'ddprun launch' it stops the --local-rank=N script argument."},
      {"local_rank_arg", 0, true, "NAME",
       "Also pass the local rank to the script as --NAME=N: local-rank (torch 2.x), local_rank "
       "(torch 1.x) or none. 'ddprun launch' defaults to local-rank; plain ddprun to none."},
      {"virtual_local_rank", 0, false, nullptr,
       "Every worker sees LOCAL_RANK=0 and only its own GPU in CUDA_VISIBLE_DEVICES."},
      {"logs_specs", 0, true, "NAME",
       "torchrun's Python LogsSpecs plug-in: accepted and ignored with a notice (ddprun has no "
       "Python plug-ins; see --log-dir, -r, -t)."},
      {"event_log_handler", 0, true, "NAME",
       "torchrun's Python event-log handler plug-in: accepted and ignored with a notice unless "
       "'null' (ddprun has no Python plug-ins)."},
      {"duplicate_stdout_filters", 0, true, "FILTERS",
       "Also copy tee'd stdout lines that contain one of FILTERS (comma-separated) to "
       "<log dir>/<run>/attempt_<n>/filtered_stdout.log, all local ranks in one file (as "
       "torchrun 2.x; needs -t/--tee)."},
      {"duplicate_stderr_filters", 0, true, "FILTERS",
       "As --duplicate-stdout-filters, for stderr (filtered_stderr.log)."},
      {"log_dir", 0, true, "DIR", "Base directory for log files (a temp dir by default)."},
      {"redirects", 'r', true, "STD",
       "Redirect std streams into a log file: 0 none, 1 stdout, 2 stderr, 3 both; or per local "
       "rank: 0:1,1:2."},
      {"tee", 't', true, "STD",
       "Tee std streams into a log file and also to console (see --redirects for the format)."},
      {"local_ranks_filter", 0, true, "RANKS",
       "Only show the tee'd output of these local ranks on the console, e.g. 0,1."},
      {"node_rank", 0, true, "RANK",
       "Rank of the node for multi-node distributed training (static backend). Default 0."},
      {"master_addr", 0, true, "ADDR",
       "Address of the master node (rank 0), static backend only. Default 127.0.0.1."},
      {"master_port", 0, true, "PORT",
       "Port on the master node for communication during training, static backend only. Default "
       "29500."},
      {"local_addr", 0, true, "ADDR",
       "Address this node advertises to the others. Default: the host's fully qualified name."},
      {"shutdown_timeout", 0, true, "SECONDS",
       "Seconds between SIGTERM and SIGKILL when stopping workers. Default 30."},
      {"signals_to_handle", 0, true, "SIGNALS",
       "Signals forwarded to workers. Default SIGTERM,SIGINT,SIGHUP,SIGQUIT."},
      {"log_line_prefix_template", 0, true, "TEMPLATE",
       "Prefix of tee'd lines, from ${role_name} ${local_rank} ${rank} ${hostname}. Default "
       "$TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, else [${role_name}${local_rank}]:"},
      {"exit_barrier_timeout", 0, true, "SECONDS",
       "How long a node whose workers succeeded waits for the other nodes. Default 300."},
      {"heartbeat_timeout", 0, true, "SECONDS",
       "Hang detection: a worker whose DDPRUN_HEARTBEAT_FILE, once touched, goes SECONDS "
       "without a touch fails (0 disables). Default 300."},
      {"snapshot_dir", 0, true, "DIR",
       "Directory for worker snapshots, passed to workers as DDPRUN_SNAPSHOT_DIR; on a multi-node "
       "job replicated between the agents (needs token_file= in --rdzv-conf)."},
      {"snapshot_allow_unauthenticated", 0, false, nullptr,
       "Replicate --snapshot-dir between the agents without a token: anyone who can reach an "
       "agent may then plant or delete files in it (a planted snapshot that a program "
       "unpickles runs code)."},
      {"snapshot_limits", 0, true, "K=V,...",
       "Bounds of --snapshot-dir replication: streams_per_peer (16), streams (64), buffered_mb "
       "(64), names_per_peer (65536), names (131072), stall_timeout (60 s)."},
      {"metrics_port", 0, true, "PORT",
       "Serve /healthz and Prometheus /metrics of this agent on PORT (0: a free port, printed)."},
      {"print_completion", 0, true, "SHELL",
       "Print a shell completion script for ddprun to stdout and exit: bash, zsh or tcsh (e.g. "
       "--print-completion bash > ~/.local/share/bash-completion/completions/ddprun).",
       "bash,zsh,tcsh", false},
  };
  return kFlags;
}

std::string dashedFlagName(std::string_view canonical) {
  std::string out = "--" + std::string(canonical);
  for (size_t i = 2; i < out.size(); ++i) {
    if (out[i] == '_') out[i] = '-';
  }
  return out;
}

std::string petName(std::string_view canonical) {
  std::string out = "PET_";
  for (char c : canonical) out += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

namespace {

// The flag `name` (as typed, '-' or '_') names: its exact spelling, else the one flag it is a
// prefix of (argparse's abbreviations). On failure `error` says why.
const LaunchFlag* findLongFlag(const std::string& name, const std::vector<LaunchFlag>& table,
                               std::string& error) {
  std::string canon = name;
  for (char& c : canon) {
    if (c == '-') c = '_';
  }
  std::vector<const LaunchFlag*> prefixed;
  for (const auto& f : table) {
    if (canon == f.name) return &f;
    if (startsWith(f.name, canon)) prefixed.push_back(&f);
  }
  if (prefixed.size() == 1) return prefixed[0];
  if (prefixed.size() > 1) {
    std::vector<std::string> names;
    for (const auto* f : prefixed) names.push_back(dashedFlagName(f->name));
    error = "ambiguous option: --" + name + " could match " + join(names, ", ");
  } else {
    error = "unrecognized argument: --" + name + " (see ddprun --help)";
  }
  return nullptr;
}

const LaunchFlag* findShortFlag(char letter, const std::vector<LaunchFlag>& table) {
  for (const auto& f : table) {
    if (f.short_name != 0 && f.short_name == letter) return &f;
  }
  return nullptr;
}

ArgToken errorToken(size_t at, std::string error) {
  ArgToken t;
  t.kind = ArgToken::Kind::kError;
  t.begin = at;
  t.end = at + 1;
  t.error = std::move(error);
  return t;
}

// Whether argparse reads `arg` as an option rather than as a value: it starts with '-' and is not
// "-", a negative number or a string with a space in it (argparse's _parse_optional). So
// "--master-addr --nnodes=2" is an error there, as here, not a master address of "--nnodes=2".
bool looksLikeFlag(const std::string& arg) {
  if (arg.size() < 2 || arg[0] != '-' || arg.find(' ') != std::string::npos) return false;
  size_t digits = 0;
  size_t dots = 0;
  for (size_t k = 1; k < arg.size(); ++k) {
    if (arg[k] >= '0' && arg[k] <= '9') {
      ++digits;
    } else if (arg[k] == '.') {
      ++dots;
    } else {
      return true;
    }
  }
  // -5, -0, -.5, -1.5 are numbers; "-." and "-1.2.3" are not
  return digits == 0 || dots > 1 || (dots == 1 && arg.back() == '.');
}

// A value flag whose value is the next argument, if there is one that is not an option.
void takeNextValue(ArgToken& t, const std::vector<std::string>& args, size_t& i) {
  if (i + 1 >= args.size() || looksLikeFlag(args[i + 1])) {
    t.kind = ArgToken::Kind::kError;
    t.error = "argument " + t.source + ": expected one argument (" + t.flag->metavar + ")";
    return;
  }
  t.value = args[++i];
  t.end = i + 1;
}

ArgToken longToken(const std::vector<std::string>& args, size_t& i,
                   const std::vector<LaunchFlag>& table) {
  std::string body = args[i].substr(2);
  std::optional<std::string> inline_value;
  if (auto eq = body.find('='); eq != std::string::npos) {
    inline_value = body.substr(eq + 1);
    body = body.substr(0, eq);
  }
  std::string error;
  const LaunchFlag* flag = findLongFlag(body, table, error);
  if (flag == nullptr) return errorToken(i, error);
  ArgToken t;
  t.flag = flag;
  t.source = dashedFlagName(flag->name);
  t.begin = i;
  t.end = i + 1;
  t.value = inline_value;
  t.inline_value = inline_value.has_value();
  if (!flag->takes_value) {
    if (inline_value) {
      t.kind = ArgToken::Kind::kError;
      t.error = "argument " + t.source + ": takes no value";
    }
    return t;
  }
  if (!inline_value) takeNextValue(t, args, i);
  return t;
}

ArgToken shortToken(const std::vector<std::string>& args, size_t& i,
                    const std::vector<LaunchFlag>& table) {
  const std::string& arg = args[i];
  const LaunchFlag* flag = findShortFlag(arg[1], table);
  if (flag == nullptr || (!flag->takes_value && arg.size() != 2)) {
    return errorToken(i, "unrecognized argument: " + arg + " (see ddprun --help)");
  }
  ArgToken t;
  t.flag = flag;
  t.source = std::string("-") + arg[1];
  t.begin = i;
  t.end = i + 1;
  if (!flag->takes_value) return t;
  if (arg.size() > 2) {
    t.value = arg.substr(2);
    t.inline_value = true;
    return t;
  }
  takeNextValue(t, args, i);
  return t;
}

}  // namespace

TokenizedArgs tokenizeLaunchArgs(const std::vector<std::string>& args,
                                 const std::vector<LaunchFlag>& table) {
  TokenizedArgs out;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "-h" || arg == "--help") {
      ArgToken t;
      t.kind = ArgToken::Kind::kHelp;
      t.source = arg;
      t.begin = i;
      t.end = i + 1;
      out.tokens.push_back(std::move(t));
    } else if (startsWith(arg, "--help=")) {  // argparse's words for it
      out.tokens.push_back(
          errorToken(i, "argument -h/--help: ignored explicit argument '" + arg.substr(7) + "'"));
    } else if (arg == "--") {
      if (i + 1 < args.size()) out.program = i + 1;
      out.rest_begin = i;
      return out;
    } else if (startsWith(arg, "--")) {
      out.tokens.push_back(longToken(args, i, table));
    } else if (startsWith(arg, "-") && arg.size() > 1) {
      out.tokens.push_back(shortToken(args, i, table));
    } else {
      out.program = i;
      out.rest_begin = i;
      return out;
    }
  }
  out.rest_begin = args.size();
  return out;
}

StatusOr<FlagValues> resolveFlagValues(const TokenizedArgs& tokens,
                                       const std::map<std::string, std::string>& env,
                                       const std::vector<LaunchFlag>& table) {
  FlagValues out;
  for (const auto& t : tokens.tokens) {
    switch (t.kind) {
      case ArgToken::Kind::kHelp:
        out.help = true;
        return out;
      case ArgToken::Kind::kError:
        return invalidArgument(t.error);
      case ArgToken::Kind::kFlag:
        out.values[t.flag->name] = FlagValue{t.value.value_or("1"), t.source};
        break;
    }
  }
  // PET_<NAME> supplies what the command line did not. The Kubeflow training operator spells one
  // of them its own way (PET_N_PROC_PER_NODE); PET_NPROC_PER_NODE wins when both are set.
  static const std::map<std::string, std::string> kOtherSpellings = {
      {"nproc_per_node", "PET_N_PROC_PER_NODE"}};
  for (const auto& f : table) {
    if (out.values.count(f.name) || !f.from_env) continue;
    std::string var = petName(f.name);
    auto it = env.find(var);
    if (it == env.end()) {
      auto other = kOtherSpellings.find(f.name);
      if (other == kOtherSpellings.end()) continue;
      var = other->second;
      it = env.find(var);
      if (it == env.end()) continue;
    }
    if (!f.takes_value) {
      auto b = parseBool(it->second);
      if (!b)
        return invalidArgument("environment " + var +
                               ": expected 1 or 0 (or true/false, yes/no, on/off), got '" +
                               it->second + "'");
      if (*b) out.values[f.name] = FlagValue{"1", var};
      continue;
    }
    out.values[f.name] = FlagValue{it->second, var};
  }
  return out;
}

}  // namespace ddprun
