#include "ddprun/launcher/cli.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <optional>
#include <random>
#include <thread>

#include "ddprun/common/launch_flags.h"
#include "ddprun/common/strings.h"
#include "ddprun/rendezvous/conf.h"

namespace ddprun::launcher {
namespace {

using FlagSpec = LaunchFlag;

Status usage(const std::string& msg) { return invalidArgument(msg); }

std::string dashed(const std::string& canonical) {
  std::string out = "--" + canonical;
  for (size_t i = 2; i < out.size(); ++i) {
    if (out[i] == '_') out[i] = '-';
  }
  return out;
}

std::string envName(const std::string& canonical) {
  std::string out = "PET_";
  for (char c : canonical) out += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

StatusOr<const FlagSpec*> findFlag(const std::string& name) {
  std::string canon = name;
  for (char& c : canon) {
    if (c == '-') c = '_';
  }
  std::vector<const FlagSpec*> prefixed;
  for (const auto& f : launchFlags()) {
    if (canon == f.name) return &f;
    if (startsWith(f.name, canon)) prefixed.push_back(&f);
  }
  if (prefixed.size() == 1) return prefixed[0];
  if (prefixed.size() > 1) {
    std::vector<std::string> names;
    for (auto* f : prefixed) names.push_back(dashed(f->name));
    return usage("ambiguous option: --" + name + " could match " + join(names, ", "));
  }
  return usage("unrecognized argument: --" + name + " (see ddprun --help)");
}

// A raw value and where it came from, for error messages.
struct Raw {
  std::string value;
  std::string source;  // "--nnodes" or "PET_NNODES"
};

Status badValue(const Raw& raw, const std::string& expected) {
  return usage("argument " + raw.source + ": expected " + expected + ", got '" + raw.value + "'");
}

StatusOr<int> intIn(const Raw& raw, long long lo, long long hi, const std::string& expected) {
  auto v = parseInt(raw.value);
  if (!v || *v < lo || *v > hi) return badValue(raw, expected);
  return static_cast<int>(*v);
}

StatusOr<double> secondsAtLeast(const Raw& raw, double lo, bool exclusive) {
  auto v = parseDouble(raw.value);
  if (!v || (exclusive ? *v <= lo : *v < lo)) {
    return badValue(raw, exclusive ? "a number of seconds > 0" : "a number of seconds >= 0");
  }
  return *v;
}

StatusOr<agent::StdStreams> stdValue(const Raw& raw, const std::string& text) {
  auto v = parseInt(text);
  if (!v || *v < 0 || *v > 3) {
    return badValue(raw,
                    "0 (none), 1 (stdout), 2 (stderr), 3 (both), or per local rank like 0:3,1:1");
  }
  return static_cast<agent::StdStreams>(*v);
}

StatusOr<agent::PerRankStreams> perRankStreams(const Raw& raw) {
  agent::PerRankStreams out;
  if (raw.value.find(':') == std::string::npos) {
    DDPRUN_ASSIGN_OR_RETURN(out.all, stdValue(raw, raw.value));
    return out;
  }
  for (const auto& item : split(raw.value, ',')) {
    auto kv = split(item, ':');
    auto rank = kv.size() == 2 ? parseInt(kv[0]) : std::nullopt;
    if (!rank || *rank < 0) {
      return badValue(raw, "0-3, or <local_rank>:<0-3> pairs separated by commas like 0:3,1:1");
    }
    DDPRUN_ASSIGN_OR_RETURN(out.per_rank[static_cast<int>(*rank)], stdValue(raw, kv[1]));
  }
  return out;
}

std::optional<int> signalNumber(std::string name) {
  static const std::pair<const char*, int> kSignals[] = {
      {"HUP", SIGHUP},     {"INT", SIGINT},   {"QUIT", SIGQUIT}, {"TERM", SIGTERM},
      {"USR1", SIGUSR1},   {"USR2", SIGUSR2}, {"ALRM", SIGALRM}, {"CONT", SIGCONT},
      {"WINCH", SIGWINCH}, {"PWR", SIGPWR},   {"XCPU", SIGXCPU}, {"TSTP", SIGTSTP}};
  for (char& c : name) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (startsWith(name, "SIG")) name = name.substr(3);
  for (const auto& [n, v] : kSignals) {
    if (name == n) return v;
  }
  return std::nullopt;
}

// host[:port] or [v6]:port, normalised to "host:port" (v6 keeps its brackets).
StatusOr<std::string> endpoint(const Raw& raw, int default_port) {
  const std::string& s = raw.value;
  const std::string expected = "HOST[:PORT] or [IPv6]:PORT with a port in 0-65535";
  std::string host;
  std::string port_text;
  if (startsWith(s, "[")) {
    auto close = s.find(']');
    if (close == std::string::npos || close == 1) return badValue(raw, expected);
    host = s.substr(0, close + 1);
    std::string rest = s.substr(close + 1);
    if (!rest.empty()) {
      if (rest[0] != ':') return badValue(raw, expected);
      port_text = rest.substr(1);
      if (port_text.empty()) return badValue(raw, expected);
    }
  } else {
    auto colon = s.rfind(':');
    if (colon != std::string::npos && s.find(':') != colon) {
      return badValue(raw, expected + " (bracket IPv6 addresses)");
    }
    host = s.substr(0, colon);
    if (colon != std::string::npos) {
      port_text = s.substr(colon + 1);
      if (port_text.empty()) return badValue(raw, expected);
    }
  }
  if (host.empty()) return badValue(raw, expected);
  int port = default_port;
  if (!port_text.empty()) {
    auto p = parseInt(port_text);
    if (!p || *p < 0 || *p > 65535) return badValue(raw, expected);
    port = static_cast<int>(*p);
  }
  return host + ":" + std::to_string(port);
}

// Splits k=v,... and validates the pairs with the rendezvous' own parser, which the agent uses
// too: the same keys, spellings and defaults everywhere. The agent gets the pairs and parses them
// again (files are read there).
StatusOr<std::map<std::string, std::string>> rdzvConf(const Raw& raw) {
  std::map<std::string, std::string> out;
  if (trim(raw.value).empty()) return out;
  for (const auto& item : split(raw.value, ',')) {
    auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0) {
      return badValue(raw, "<key>=<value> pairs separated by commas");
    }
    out[trim(item.substr(0, eq))] = trim(item.substr(eq + 1));
  }
  auto parsed = rendezvous::parseRendezvousConf(out, 1, 1);
  if (!parsed.isOk()) return usage("argument " + raw.source + ": " + parsed.status().message());
  return out;
}

bool isExecutableFile(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

// execvp's lookup: a name with a slash is a path, otherwise each PATH entry in turn.
std::optional<std::string> findExecutable(const std::string& name,
                                          const std::map<std::string, std::string>& env) {
  if (name.find('/') != std::string::npos) {
    return isExecutableFile(name) ? std::optional<std::string>(name) : std::nullopt;
  }
  auto path = env.find("PATH");
  std::string dirs = path == env.end() ? "/usr/local/bin:/usr/bin:/bin" : path->second;
  for (const auto& dir : split(dirs, ':')) {
    std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    if (isExecutableFile(candidate)) return candidate;
  }
  return std::nullopt;
}

std::string randomUuid() {
  std::random_device rd;
  std::uniform_int_distribution<int> hex(0, 15);
  const char* digits = "0123456789abcdef";
  std::string out;
  for (int i = 0; i < 32; ++i) {
    if (i == 8 || i == 12 || i == 16 || i == 20) out += '-';
    int d = hex(rd);
    if (i == 12) d = 4;            // version 4
    if (i == 16) d = 8 + (d & 3);  // variant 10xx
    out += digits[d];
  }
  return out;
}

Status resolveProgram(agent::AgentConfig& cfg, bool module, bool no_python,
                      const std::string& program, const std::vector<std::string>& program_args,
                      const std::map<std::string, std::string>& env) {
  if (module && no_python) {
    return usage("--no-python and -m/--module cannot be used together");
  }
  cfg.entrypoint = program;
  const bool python = module || (!no_python && endsWith(program, ".py"));
  std::vector<std::string> argv;
  if (python) {
    auto exec = env.find("PYTHON_EXEC");
    std::string interpreter = exec != env.end() && !exec->second.empty() ? exec->second : "python3";
    auto resolved = findExecutable(interpreter, env);
    if (!resolved) {
      return failedPrecondition("cannot find the Python interpreter '" + interpreter +
                                "' (on PATH, or set PYTHON_EXEC to its path)");
    }
    argv = {*resolved, "-u"};
    if (module) {
      argv.push_back("-m");
    } else {
      struct stat st {};
      if (::stat(program.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
        return failedPrecondition("training script '" + program + "' does not exist");
      }
    }
    argv.push_back(program);
  } else {
    auto resolved = findExecutable(program, env);
    if (!resolved) {
      struct stat st {};
      const bool exists =
          program.find('/') != std::string::npos && ::stat(program.c_str(), &st) == 0;
      return failedPrecondition(
          "program '" + program + "' " +
          (exists ? "is not an executable file" : "not found (looked on PATH and as a path)"));
    }
    argv = {*resolved};
  }
  argv.insert(argv.end(), program_args.begin(), program_args.end());
  cfg.worker_argv = std::move(argv);
  return Status::ok();
}

}  // namespace

StatusOr<CliResult> parseCommandLine(const std::vector<std::string>& args,
                                     const std::map<std::string, std::string>& env,
                                     const HostFacts& host) {
  CliResult result;
  std::map<std::string, Raw> given;  // canonical flag name -> raw value (last one wins)
  std::string program;
  std::vector<std::string> program_args;
  bool have_program = false;

  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "-h" || arg == "--help") {
      result.show_help = true;
      return result;
    }
    if (arg == "--") {
      if (i + 1 < args.size()) {
        have_program = true;
        program = args[i + 1];
        program_args.assign(args.begin() + static_cast<long>(i) + 2, args.end());
      }
      break;
    }
    if (startsWith(arg, "--")) {
      std::string body = arg.substr(2);
      std::optional<std::string> inline_value;
      if (auto eq = body.find('='); eq != std::string::npos) {
        inline_value = body.substr(eq + 1);
        body = body.substr(0, eq);
      }
      DDPRUN_ASSIGN_OR_RETURN(const FlagSpec* flag, findFlag(body));
      const std::string shown = dashed(flag->name);
      if (!flag->takes_value) {
        if (inline_value) return usage("argument " + shown + ": takes no value");
        given[flag->name] = Raw{"1", shown};
        continue;
      }
      if (!inline_value) {
        if (i + 1 >= args.size()) {
          return usage("argument " + shown + ": expected one argument (" + flag->metavar + ")");
        }
        inline_value = args[++i];
      }
      given[flag->name] = Raw{*inline_value, shown};
      continue;
    }
    if (startsWith(arg, "-") && arg.size() > 1) {
      const char letter = arg[1];
      if (letter == 'm' && arg.size() == 2) {
        given["module"] = Raw{"1", "-m"};
        continue;
      }
      if (letter == 'r' || letter == 't') {
        const char* name = letter == 'r' ? "redirects" : "tee";
        std::string value = arg.substr(2);
        if (value.empty()) {
          if (i + 1 >= args.size()) {
            return usage(std::string("argument -") + letter + ": expected one argument (STD)");
          }
          value = args[++i];
        }
        given[name] = Raw{value, std::string("-") + letter};
        continue;
      }
      return usage("unrecognized argument: " + arg + " (see ddprun --help)");
    }
    have_program = true;
    program = arg;
    program_args.assign(args.begin() + static_cast<long>(i) + 1, args.end());
    break;
  }

  // PET_<NAME> supplies what the command line did not.
  for (const auto& f : launchFlags()) {
    if (given.count(f.name)) continue;
    auto it = env.find(envName(f.name));
    if (it == env.end()) continue;
    if (!f.takes_value) {
      auto b = parseBool(it->second);
      if (!b)
        return usage("environment " + envName(f.name) + ": expected 0 or 1, got '" + it->second +
                     "'");
      if (*b) given[f.name] = Raw{"1", envName(f.name)};
      continue;
    }
    given[f.name] = Raw{it->second, envName(f.name)};
  }
  auto has = [&](const char* name) { return given.count(name) > 0; };
  auto raw = [&](const char* name) -> const Raw& { return given.at(name); };

  agent::AgentConfig& cfg = result.config;

  if (has("nnodes")) {
    const Raw& r = raw("nnodes");
    const std::string expected = "N or MIN:MAX with 0 < MIN <= MAX";
    auto parts = split(r.value, ':');
    if (parts.size() > 2) return badValue(r, expected);
    auto lo = parseInt(parts[0]);
    auto hi = parts.size() == 2 ? parseInt(parts[1]) : lo;
    if (!lo || !hi || *lo <= 0 || *lo > *hi || *hi > 1000000) return badValue(r, expected);
    cfg.min_nodes = static_cast<int>(*lo);
    cfg.max_nodes = static_cast<int>(*hi);
  }

  if (has("nproc_per_node")) {
    const Raw& r = raw("nproc_per_node");
    const std::string v = toLower(r.value);
    if (v == "cpu") {
      cfg.nproc_per_node = host.cpu_count;
    } else if (v == "gpu") {
      if (host.gpu_count == 0) {
        return usage("argument " + r.source +
                     ": 'gpu' asks for one worker per CUDA device, "
                     "but this host has none (use an integer, cpu or auto)");
      }
      cfg.nproc_per_node = host.gpu_count;
    } else if (v == "auto") {
      cfg.nproc_per_node = host.gpu_count > 0 ? host.gpu_count : host.cpu_count;
    } else {
      DDPRUN_ASSIGN_OR_RETURN(cfg.nproc_per_node,
                              intIn(r, 1, 4096, "an integer >= 1, or cpu, gpu, auto"));
    }
  }

  if (has("rdzv_backend")) {
    const Raw& r = raw("rdzv_backend");
    if (r.value == "static" || r.value == "c10d") {
      cfg.rdzv_backend = r.value;
    } else if (r.value == "grpc") {
      cfg.rdzv_backend = "c10d";
    } else if (r.value == "etcd" || r.value == "etcd-v2" || r.value == "etcd-v3") {
      return usage("argument " + r.source +
                   ": the etcd backends are not supported yet; use "
                   "static or c10d");
    } else {
      return badValue(r, "static, c10d or grpc");
    }
  }
  if (has("rdzv_endpoint") && !trim(raw("rdzv_endpoint").value).empty()) {
    DDPRUN_ASSIGN_OR_RETURN(cfg.rdzv_endpoint, endpoint(raw("rdzv_endpoint"), 29400));
  }
  if (has("rdzv_id")) {
    if (raw("rdzv_id").value.empty()) return badValue(raw("rdzv_id"), "a non-empty job id");
    cfg.rdzv_id = raw("rdzv_id").value;
  }
  if (has("rdzv_conf")) {
    DDPRUN_ASSIGN_OR_RETURN(cfg.rdzv_conf, rdzvConf(raw("rdzv_conf")));
  }
  if (has("max_restarts")) {
    DDPRUN_ASSIGN_OR_RETURN(cfg.max_restarts,
                            intIn(raw("max_restarts"), 0, 1000000, "an integer >= 0"));
  }
  if (has("monitor_interval")) {
    DDPRUN_ASSIGN_OR_RETURN(cfg.monitor_interval, secondsAtLeast(raw("monitor_interval"), 0, true));
  }
  if (has("start_method")) {
    const std::string& v = raw("start_method").value;
    if (v != "spawn" && v != "fork" && v != "forkserver") {
      return badValue(raw("start_method"), "spawn, fork or forkserver");
    }
  }
  if (has("role")) {
    if (raw("role").value.empty()) return badValue(raw("role"), "a non-empty role name");
    cfg.role = raw("role").value;
  }
  if (has("log_dir")) cfg.log_dir = raw("log_dir").value;
  if (has("redirects")) {
    DDPRUN_ASSIGN_OR_RETURN(cfg.redirects, perRankStreams(raw("redirects")));
  }
  if (has("tee")) {
    DDPRUN_ASSIGN_OR_RETURN(cfg.tee, perRankStreams(raw("tee")));
  }
  if (has("local_ranks_filter")) {
    const Raw& r = raw("local_ranks_filter");
    std::set<int> ranks;
    for (const auto& item : split(r.value, ',')) {
      auto v = parseInt(trim(item));
      if (!v || *v < 0) return badValue(r, "local ranks separated by commas, like 0,1");
      ranks.insert(static_cast<int>(*v));
    }
    cfg.local_ranks_filter = ranks;
  }
  if (has("node_rank")) {
    DDPRUN_ASSIGN_OR_RETURN(cfg.node_rank, intIn(raw("node_rank"), 0, 1000000, "an integer >= 0"));
  }
  if (has("master_addr")) {
    if (trim(raw("master_addr").value).empty()) {
      return badValue(raw("master_addr"), "a host name or address");
    }
    cfg.master_addr = raw("master_addr").value;
  }
  if (has("master_port")) {
    DDPRUN_ASSIGN_OR_RETURN(cfg.master_port,
                            intIn(raw("master_port"), 1, 65535, "a port number in 1-65535"));
    cfg.master_port_given = true;
  }
  if (has("local_addr")) {
    if (trim(raw("local_addr").value).empty()) return badValue(raw("local_addr"), "an address");
    cfg.local_addr = raw("local_addr").value;
  }
  if (has("shutdown_timeout")) {
    DDPRUN_ASSIGN_OR_RETURN(cfg.shutdown_timeout,
                            secondsAtLeast(raw("shutdown_timeout"), 0, false));
  }
  if (has("exit_barrier_timeout")) {
    DDPRUN_ASSIGN_OR_RETURN(cfg.exit_barrier_timeout,
                            secondsAtLeast(raw("exit_barrier_timeout"), 0, false));
  }
  if (has("heartbeat_timeout")) {
    // Bounded so that the value fits the agent's clock arithmetic (nanoseconds in 64 bits).
    const Raw& r = raw("heartbeat_timeout");
    auto v = parseDouble(r.value);
    if (!v || *v < 0 || *v > 1e9) {
      return badValue(r, "a number of seconds >= 0 (0 disables hang detection, at most 1e9)");
    }
    cfg.heartbeat_timeout = *v;
  }
  {
    Raw r = has("signals_to_handle") ? raw("signals_to_handle")
                                     : Raw{"SIGTERM,SIGINT,SIGHUP,SIGQUIT", "--signals-to-handle"};
    for (const auto& name : split(r.value, ',')) {
      auto sig = signalNumber(trim(name));
      if (!sig) {
        return badValue(r, "signal names separated by commas, like SIGTERM,SIGINT,SIGUSR1");
      }
      cfg.signals_to_handle.push_back(*sig);
    }
  }
  if (has("log_line_prefix_template")) {
    cfg.log_line_prefix_template = raw("log_line_prefix_template").value;
  }
  if (has("snapshot_dir")) cfg.snapshot_dir = raw("snapshot_dir").value;
  if (has("metrics_port")) {
    DDPRUN_ASSIGN_OR_RETURN(cfg.metrics_port,
                            intIn(raw("metrics_port"), 0, 65535, "a port number in 0-65535"));
  }

  // Cross-flag rules.
  if (has("standalone")) {
    if (has("nnodes") && cfg.max_nodes != 1) {
      return usage("argument --standalone: runs a single node, but --nnodes asks for " +
                   raw("nnodes").value + " (drop one of them)");
    }
    cfg.standalone = true;
    cfg.rdzv_backend = "c10d";
    cfg.rdzv_endpoint = "localhost:0";
    cfg.rdzv_id = randomUuid();
  }
  if (cfg.rdzv_backend == "static") {
    if (cfg.min_nodes != cfg.max_nodes) {
      return usage("argument --nnodes: the static rendezvous needs a fixed number of nodes, got " +
                   raw("nnodes").value + " (use --rdzv-backend=c10d for elastic MIN:MAX)");
    }
    if (cfg.node_rank >= cfg.max_nodes) {
      return usage("argument --node-rank: must be below --nnodes=" + std::to_string(cfg.max_nodes) +
                   ", got " + std::to_string(cfg.node_rank));
    }
  } else if (!cfg.standalone && cfg.rdzv_endpoint.empty()) {
    return usage("argument --rdzv-endpoint: the c10d backend needs HOST[:PORT] of the rendezvous");
  }

  if (!have_program) {
    return usage("the following arguments are required: training_script (the program to run)");
  }
  DDPRUN_RETURN_IF_ERROR(
      resolveProgram(cfg, has("module"), has("no_python"), program, program_args, env));

  if (cfg.nproc_per_node > 1 && !env.count("OMP_NUM_THREADS")) {
    cfg.set_omp_num_threads = true;
    result.notices.push_back(
        "setting OMP_NUM_THREADS=1 for each worker to avoid overloading the system; set it "
        "yourself to tune");
  }
  return result;
}

std::string helpText() {
  std::string out =
      "usage: ddprun [options] training_script [training_script_args ...]\n\n"
      "Torchrun-compatible elastic launcher. Starts --nproc-per-node workers on this node, sets\n"
      "RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ... for them, and restarts them\n"
      "on failure. Every option may be spelled with '_' or '-', and defaults to the environment\n"
      "variable PET_<OPTION> (e.g. PET_NPROC_PER_NODE).\n\n"
      "positional arguments:\n"
      "  training_script       a .py script (run as 'python3 -u', PYTHON_EXEC overrides) or a "
      "program\n"
      "  training_script_args  arguments passed to the program\n\n"
      "options:\n"
      "  -h, --help            show this help message and exit\n";
  for (const auto& f : launchFlags()) {
    std::string left = "  ";
    if (std::string(f.name) == "module") left += "-m, ";
    if (std::string(f.name) == "redirects") left += "-r, ";
    if (std::string(f.name) == "tee") left += "-t, ";
    left += dashed(f.name);
    if (f.takes_value) left += std::string(" ") + f.metavar;
    if (left.size() < 40)
      left.resize(40, ' ');
    else
      left += "\n" + std::string(40, ' ');
    out += left + f.help + "\n";
  }
  return out;
}

HostFacts probeHost() {
  HostFacts facts;
  facts.cpu_count = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  // CUDA devices appear as /dev/nvidia0, /dev/nvidia1, ...; CUDA_VISIBLE_DEVICES narrows them.
  int count = 0;
  if (DIR* dir = ::opendir("/dev")) {
    while (dirent* e = ::readdir(dir)) {
      std::string name = e->d_name;
      if (startsWith(name, "nvidia") && name.size() > 6 && parseInt(name.substr(6))) ++count;
    }
    ::closedir(dir);
  }
  if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES"); visible != nullptr && count > 0) {
    std::string v = trim(visible);
    count = v.empty() ? 0 : std::min(count, static_cast<int>(split(v, ',').size()));
  }
  facts.gpu_count = count;
  return facts;
}

}  // namespace ddprun::launcher
