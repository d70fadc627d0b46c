#include "ddprun/launcher/cli.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <tuple>

#include "ddprun/agent/numa_binding.h"
#include "ddprun/common/launch_flags.h"
#include "ddprun/common/strings.h"
#include "ddprun/rendezvous/conf.h"

namespace ddprun::launcher {
namespace {

using Raw = FlagValue;  // a value and where it came from, for error messages

Status usage(const std::string& msg) { return invalidArgument(msg); }

Status badValue(const Raw& raw, const std::string& expected) {
  return usage("argument " + raw.source + ": expected " + expected + ", got '" +
               escapeControl(raw.value) + "'");
}

// An IPv6 address, with a zone (fe80::1%eth0) or without.
bool isIpv6(const std::string& s) {
  const std::string address = s.substr(0, s.find('%'));
  in6_addr a{};
  return ::inet_pton(AF_INET6, address.c_str(), &a) == 1;
}

// What DNS and /etc/hosts take as a name (letters, digits, '.', '-', '_'), or an IPv4 address: a
// space, a control byte or a '/' is a mistake (it broke the log lines and failed only at the
// first lookup).
bool isHostName(const std::string& s) {
  if (s.empty() || s.size() > 253) return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '.' || c == '-' || c == '_';
  });
}

// A host for the workers and this node's servers: a name, an IPv4 address or an IPv6 one (given
// bare, as torchrun takes it, or in brackets, which are dropped).
StatusOr<std::string> hostValue(const Raw& raw) {
  std::string h = trim(raw.value);
  if (h.size() > 2 && h.front() == '[' && h.back() == ']' && isIpv6(h.substr(1, h.size() - 2))) {
    return h.substr(1, h.size() - 2);
  }
  if (isIpv6(h) || isHostName(h)) return h;
  return badValue(raw, "a host name (letters, digits, '.', '-', '_') or an IP address");
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
  if (*v > kMaxDurationSeconds) {
    return badValue(
        raw, std::string(exclusive ? "a number of seconds > 0" : "a number of seconds >= 0") +
                 " and at most 1e9");
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
    if (!isIpv6(s.substr(1, close - 1))) return badValue(raw, "an IPv6 address in the brackets");
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
  if (host.empty()) return badValue(raw, expected + " (the host is missing)");
  if (host.front() != '[' && !isHostName(host)) {
    return badValue(raw, expected +
                             ", the host a name (letters, digits, '.', '-', '_') or an "
                             "IPv4 address");
  }
  int port = default_port;
  if (!port_text.empty()) {
    auto p = parseInt(port_text);
    if (!p || *p < 0 || *p > 65535) return badValue(raw, expected);
    port = static_cast<int>(*p);
  }
  return host + ":" + std::to_string(port);
}

// One pair of matching quotes around `s` removed: PyTorch's own tests (and shell scripts that
// quote twice) pass --rdzv_conf='join_timeout=5,...' with the quotes inside the argument.
std::string unquote(const std::string& s) {
  std::string t = trim(s);
  if (t.size() >= 2 && (t.front() == '\'' || t.front() == '"') && t.back() == t.front()) {
    return t.substr(1, t.size() - 2);
  }
  return t;
}

// --rdzv-conf k=v,... parsed once, by the rendezvous' own parser, for the --nnodes range: the
// agent takes the typed result (files named in it are read here).
StatusOr<rendezvous::RendezvousConf> rdzvConf(const Raw& raw, int min_nodes, int max_nodes) {
  std::map<std::string, std::string> pairs;
  const std::string text = unquote(raw.value);
  if (!trim(text).empty()) {
    for (const auto& item : split(text, ',')) {
      auto eq = item.find('=');
      if (eq == std::string::npos || eq == 0) {
        return badValue(raw, "<key>=<value> pairs separated by commas");
      }
      pairs[unquote(item.substr(0, eq))] = unquote(item.substr(eq + 1));
    }
  }
  auto parsed = rendezvous::parseRendezvousConf(pairs, static_cast<uint32_t>(min_nodes),
                                                static_cast<uint32_t>(max_nodes));
  if (!parsed.isOk()) return usage("argument " + raw.source + ": " + parsed.status().message());
  return parsed;
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

// A flag as a message names it: by its spelling, and by the variable when PET_<NAME> gave it.
std::string flagNamed(const std::string& spelling, const std::string& source) {
  return startsWith(source, "PET_") ? spelling + " (" + source + ")" : spelling;
}

// How the program is run: -m, --no-python, --run-path (each at most one), with where each came
// from (the flag as given, or its PET_ variable; empty: not given).
struct ProgramKind {
  std::string module_source;
  std::string no_python_source;
  std::string run_path_source;
  bool module() const { return !module_source.empty(); }
  bool noPython() const { return !no_python_source.empty(); }
  bool runPath() const { return !run_path_source.empty(); }
};

Status resolveProgram(agent::AgentConfig& cfg, const ProgramKind& kind, const std::string& program,
                      const std::vector<std::string>& program_args,
                      const std::map<std::string, std::string>& env) {
  const std::string module = flagNamed("-m/--module", kind.module_source);
  const std::string no_python = flagNamed("--no-python", kind.no_python_source);
  if (kind.module() && kind.noPython()) {
    return usage(no_python + " and " + module + " cannot be used together");
  }
  if (kind.runPath() && (kind.module() || kind.noPython())) {
    return usage(flagNamed("--run-path", kind.run_path_source) + " and " +
                 (kind.module() ? module : no_python) + " cannot be used together");
  }
  cfg.entrypoint = program;
  const bool python =
      kind.module() || kind.runPath() || (!kind.noPython() && endsWith(program, ".py"));
  std::vector<std::string> argv;
  if (python) {
    auto exec = env.find("PYTHON_EXEC");
    const bool from_env = exec != env.end() && !exec->second.empty();
    std::string interpreter = from_env ? exec->second : "python3";
    auto resolved = findExecutable(interpreter, env);
    if (!resolved) {
      return failedPrecondition("cannot find the Python interpreter '" + interpreter +
                                "' (on PATH, or set PYTHON_EXEC to its path)");
    }
    cfg.python_interpreter = *resolved;
    cfg.python_interpreter_source = from_env ? "PYTHON_EXEC" : "PATH";
    argv = {*resolved, "-u"};
    if (kind.module()) {
      argv.push_back("-m");
    } else {
      // --run-path runs what runpy.run_path runs: a file, or a directory or zip with __main__.py.
      struct stat st {};
      const bool exists = ::stat(program.c_str(), &st) == 0 &&
                          (S_ISREG(st.st_mode) || (kind.runPath() && S_ISDIR(st.st_mode)));
      if (!exists) return failedPrecondition("training script '" + program + "' does not exist");
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
  cfg.local_rank_arg_at = argv.size();
  argv.insert(argv.end(), program_args.begin(), program_args.end());
  cfg.worker_argv = std::move(argv);
  return Status::ok();
}

// --- Each flag's value into the AgentConfig. ---------------------------------------------------

StatusOr<std::pair<int, int>> nodeRange(const Raw& r) {
  const std::string expected = "N or MIN:MAX with 0 < MIN <= MAX <= 1000000";
  auto parts = split(r.value, ':');
  if (parts.size() > 2) return badValue(r, expected);
  auto lo = parseInt(parts[0]);
  auto hi = parts.size() == 2 ? parseInt(parts[1]) : lo;
  if (!lo || !hi || *lo <= 0 || *lo > *hi || *hi > 1000000) return badValue(r, expected);
  return std::make_pair(static_cast<int>(*lo), static_cast<int>(*hi));
}

StatusOr<int> nprocPerNode(const Raw& r, const HostFacts& host) {
  const std::string v = toLower(r.value);
  if (v == "cpu") return host.cpu_count;
  if (v == "gpu") {
    if (host.gpu_count == 0) {
      return usage("argument " + r.source +
                   ": 'gpu' asks for one worker per CUDA device, "
                   "but this host has none (use an integer, cpu or auto)");
    }
    return host.gpu_count;
  }
  if (v == "xpu") {
    if (host.xpu_count == 0) {
      return usage("argument " + r.source +
                   ": 'xpu' asks for one worker per Intel XPU device, "
                   "but this host has none (use an integer, cpu, gpu or auto)");
    }
    return host.xpu_count;
  }
  if (v == "auto") return host.gpu_count > 0 ? host.gpu_count : host.cpu_count;
  return intIn(r, 1, 4096, "an integer from 1 to 4096, or cpu, gpu, xpu, auto");
}

// The items of an etcd member list "h1:2379,h2:2379" (blanks around items allowed).
StatusOr<std::vector<std::string>> etcdMembers(const std::string& list) {
  std::vector<std::string> out;
  for (const std::string& item : split(list, ',')) {
    std::string t = trim(item);
    if (t.empty()) {
      return invalidArgument("the member list '" + list +
                             "' has an empty item; give HOST[:PORT][,HOST[:PORT]...]");
    }
    out.push_back(std::move(t));
  }
  return out;
}

StatusOr<agent::RendezvousBackend> rdzvBackend(const Raw& r) {
  if (r.value == "static") return agent::RendezvousBackend::kStatic;
  if (r.value == "c10d" || r.value == "grpc") return agent::RendezvousBackend::kC10d;
  if (r.value == "etcd-v3") return agent::RendezvousBackend::kEtcdV3;
  if (r.value == "etcd" || r.value == "etcd-v2") {
    return usage("argument " + r.source + ": '" + r.value +
                 "' is torchrun's etcd v2 backend (etcd 3.6 removed the v2 API); use "
                 "--rdzv-backend=etcd-v3, which speaks etcd's v3 API");
  }
  return badValue(r, "static, c10d, grpc or etcd-v3");
}

// --rdzv-id: every agent of the job gives the same, and it names the run's log directory
// (<log dir>/<id>_XXXXXX), so it must be one file name.
constexpr size_t kMaxRunIdBytes = 200;

StatusOr<std::string> rdzvId(const Raw& r) {
  const std::string& id = r.value;
  auto bad = [&](const std::string& why) {
    std::string shown = id.size() > 60 ? id.substr(0, 60) + "..." : id;
    for (char& ch : shown) {
      if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f) ch = '?';
    }
    return usage("argument " + r.source + ": the job id '" + shown + "' " + why +
                 " (it names the run's log directory; use letters, digits, '-', '_', '.')");
  };
  if (trim(id).empty()) return badValue(r, "a non-empty job id");
  if (id.size() > kMaxRunIdBytes) {
    return bad("is " + std::to_string(id.size()) + " bytes long, more than " +
               std::to_string(kMaxRunIdBytes));
  }
  if (id.find('/') != std::string::npos) return bad("contains '/'");
  if (id == "." || id == "..") return bad("is not a file name");
  if (hasControlByte(id)) return bad("contains a control byte");
  return id;
}

// --snapshot-limits K=V,...: the bounds of snapshot replication (agent::SnapshotLimits).
StatusOr<agent::SnapshotLimits> snapshotLimits(const Raw& r) {
  agent::SnapshotLimits out;
  const std::string keys =
      "streams_per_peer, streams, buffered_mb, names_per_peer, names, stall_timeout";
  for (const auto& item : split(r.value, ',')) {
    if (trim(item).empty()) continue;
    const auto eq = item.find('=');
    std::string key = trim(eq == std::string::npos ? item : item.substr(0, eq));
    for (char& ch : key) {
      if (ch == '-') ch = '_';
    }
    const std::string value = eq == std::string::npos ? "" : trim(item.substr(eq + 1));
    auto whole = [&](long long lo, long long hi, int& into) -> Status {
      auto v = parseInt(value);
      if (!v || *v < lo || *v > hi) {
        return usage("argument " + r.source + ": " + key + " must be a whole number from " +
                     std::to_string(lo) + " to " + std::to_string(hi) + ", got '" + value + "'");
      }
      into = static_cast<int>(*v);
      return Status::ok();
    };
    if (key == "streams_per_peer") {
      DDPRUN_RETURN_IF_ERROR(whole(1, 4096, out.streams_per_peer));
    } else if (key == "streams") {
      DDPRUN_RETURN_IF_ERROR(whole(1, 65536, out.streams));
    } else if (key == "buffered_mb") {
      int mb = 0;
      DDPRUN_RETURN_IF_ERROR(whole(1, 65536, mb));
      out.buffered_bytes = static_cast<uint64_t>(mb) << 20;
    } else if (key == "names_per_peer") {
      DDPRUN_RETURN_IF_ERROR(whole(1, 10000000, out.names_per_peer));
    } else if (key == "names") {
      DDPRUN_RETURN_IF_ERROR(whole(1, 10000000, out.names));
    } else if (key == "stall_timeout") {
      auto v = parseDouble(value);
      if (!v || *v <= 0 || *v > 86400) {
        return usage("argument " + r.source +
                     ": stall_timeout must be a number of seconds > 0 and at most 86400, got '" +
                     value + "'");
      }
      out.stall_seconds = *v;
    } else {
      return usage("argument " + r.source + ": unknown key '" + key + "' (known: " + keys + ")");
    }
  }
  if (out.streams_per_peer > out.streams) {
    return usage("argument " + r.source + ": streams_per_peer (" +
                 std::to_string(out.streams_per_peer) + ") is more than streams (" +
                 std::to_string(out.streams) + ")");
  }
  if (out.names_per_peer > out.names) {
    return usage("argument " + r.source + ": names_per_peer (" +
                 std::to_string(out.names_per_peer) + ") is more than names (" +
                 std::to_string(out.names) + ")");
  }
  return out;
}

StatusOr<std::string> nonEmpty(const Raw& r, const std::string& expected) {
  if (r.value.empty()) return badValue(r, expected);
  return r.value;
}

StatusOr<std::string> nonBlank(const Raw& r, const std::string& expected) {
  if (trim(r.value).empty()) return badValue(r, expected);
  return r.value;
}

StatusOr<std::set<int>> localRanks(const Raw& r) {
  std::set<int> ranks;
  for (const auto& item : split(r.value, ',')) {
    auto v = parseInt(trim(item));
    if (!v || *v < 0) return badValue(r, "local ranks separated by commas, like 0,1");
    ranks.insert(static_cast<int>(*v));
  }
  return ranks;
}

// Bounded so that the value fits the agent's clock arithmetic (nanoseconds in 64 bits).
StatusOr<double> heartbeatTimeout(const Raw& r) {
  auto v = parseDouble(r.value);
  if (!v || *v < 0 || *v > 1e9) {
    return badValue(r, "a number of seconds >= 0 (0 disables hang detection, at most 1e9)");
  }
  return *v;
}

StatusOr<std::vector<int>> signalList(const Raw& r) {
  std::vector<int> out;
  for (const auto& name : split(r.value, ',')) {
    auto sig = signalNumber(trim(name));
    if (!sig) {
      return badValue(r,
                      "signal names separated by commas, like SIGTERM,SIGINT,SIGUSR1 (of SIGHUP, "
                      "SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2, SIGALRM, SIGCONT, SIGWINCH, "
                      "SIGPWR, SIGXCPU, SIGTSTP)");
    }
    out.push_back(*sig);
  }
  return out;
}

using Apply = Status (*)(const Raw&, const HostFacts&, agent::AgentConfig&);

// --duplicate-*-filters: strings separated by commas, surrounding blanks trimmed. A line never
// holds a newline, and an empty string would match every line: both are refused.
StatusOr<std::vector<std::string>> lineFilters(const Raw& r) {
  constexpr size_t kMaxFilterBytes = 64 * 1024;
  const std::string expected = "strings separated by commas, like 'loss,NaN'";
  if (r.value.size() > kMaxFilterBytes) return badValue(r, expected + " (at most 64 KiB)");
  std::vector<std::string> out;
  for (const auto& item : split(r.value, ',')) {
    std::string needle = trim(item);
    if (needle.empty()) return badValue(r, expected + ", none of them empty");
    if (needle.find_first_of("\r\n") != std::string::npos) {
      return badValue(r, expected + " (a line never contains a newline)");
    }
    out.push_back(std::move(needle));
  }
  return out;
}

// The launcher's column of the flag table (common/launch_flags.h): what each flag does to the
// AgentConfig. Flags bound to nullptr act through the cross-flag rules and the program lookup.
// Applied in table order, so --nnodes is known when --rdzv-conf is parsed.
Apply applierOf(const std::string& name) {
  using agent::AgentConfig;
  static const std::map<std::string, Apply> kApply = {
      {"nnodes",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         DDPRUN_ASSIGN_OR_RETURN(auto range, nodeRange(r));
         std::tie(c.min_nodes, c.max_nodes) = range;
         return Status::ok();
       }},
      {"nproc_per_node",
       [](const Raw& r, const HostFacts& h, AgentConfig& c) -> Status {
         DDPRUN_ASSIGN_OR_RETURN(c.nproc_per_node, nprocPerNode(r, h));
         return Status::ok();
       }},
      {"numa_binding",
       [](const Raw& r, const HostFacts& h, AgentConfig& c) -> Status {
         auto policy = agent::parseNumaPolicy(r.value);
         if (!policy) return badValue(r, "node, socket, exclusive or core-complex");
         DDPRUN_ASSIGN_OR_RETURN(auto topology, agent::readCpuTopology(h.sysfs_root));
         DDPRUN_ASSIGN_OR_RETURN(c.cpu_affinity,
                                 agent::planNumaBinding(*policy, topology, c.nproc_per_node));
         return Status::ok();
       }},
      {"rdzv_backend",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         DDPRUN_ASSIGN_OR_RETURN(c.rdzv_backend, rdzvBackend(r));
         return Status::ok();
       }},
      {"rdzv_endpoint",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         if (trim(r.value).empty()) return Status::ok();
         if (r.value.find(',') != std::string::npos) {
           // A list of etcd members (etcd-v3); each item is checked here, and given etcd's
           // default port once the backend is known (applyCrossFlagRules).
           auto items = etcdMembers(r.value);
           if (!items.isOk())
             return usage("argument " + r.source + ": " + items.status().message());
           for (const std::string& item : items.value()) {
             Raw one = r;
             one.value = item;
             DDPRUN_RETURN_IF_ERROR(endpoint(one, 2379).status());
           }
           c.rdzv_endpoint = r.value;
           return Status::ok();
         }
         DDPRUN_ASSIGN_OR_RETURN(c.rdzv_endpoint, endpoint(r, 29400));
         return Status::ok();
       }},
      {"rdzv_id",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         DDPRUN_ASSIGN_OR_RETURN(c.rdzv_id, rdzvId(r));
         return Status::ok();
       }},
      {"rdzv_conf",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         DDPRUN_ASSIGN_OR_RETURN(c.rdzv_conf, rdzvConf(r, c.min_nodes, c.max_nodes));
         return Status::ok();
       }},
      {"standalone", nullptr},
      {"max_restarts",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         DDPRUN_ASSIGN_OR_RETURN(c.max_restarts,
                                 intIn(r, 0, 1000000, "an integer from 0 to 1000000"));
         return Status::ok();
       }},
      {"restart_mode",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         if (r.value != "process" && r.value != "in-place")
           return badValue(r, "process or in-place");
         c.restart_in_place = r.value == "in-place";
         return Status::ok();
       }},
      {"monitor_interval",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         DDPRUN_ASSIGN_OR_RETURN(c.monitor_interval, secondsAtLeast(r, 0, true));
         return Status::ok();
       }},
      {"start_method",
       [](const Raw& r, const HostFacts&, AgentConfig&) -> Status {
         if (r.value != "spawn" && r.value != "fork" && r.value != "forkserver") {
           return badValue(r, "spawn, fork or forkserver");
         }
         return Status::ok();
       }},
      {"role",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         DDPRUN_ASSIGN_OR_RETURN(c.role, nonEmpty(r, "a non-empty role name"));
         return Status::ok();
       }},
      {"module", nullptr},
      {"no_python", nullptr},
      {"run_path", nullptr},
      {"use_env", nullptr},
      {"local_rank_arg",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         if (r.value == "local-rank" || r.value == "local_rank") {
           c.local_rank_arg = r.value;
         } else if (r.value == "none") {
           c.local_rank_arg.clear();
         } else {
           return badValue(r, "local-rank (torch 2.x), local_rank (torch 1.x) or none");
         }
         return Status::ok();
       }},
      {"virtual_local_rank",
       [](const Raw&, const HostFacts&, AgentConfig& c) -> Status {
         c.virtual_local_rank = true;
         return Status::ok();
       }},
      {"duplicate_stdout_filters",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         DDPRUN_ASSIGN_OR_RETURN(c.duplicate_stdout_filters, lineFilters(r));
         return Status::ok();
       }},
      {"duplicate_stderr_filters",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         DDPRUN_ASSIGN_OR_RETURN(c.duplicate_stderr_filters, lineFilters(r));
         return Status::ok();
       }},
      {"logs_specs",
       [](const Raw& r, const HostFacts&, AgentConfig&) -> Status {
         return nonBlank(r, "the name of a LogsSpecs plug-in").status();
       }},
      {"event_log_handler",
       [](const Raw& r, const HostFacts&, AgentConfig&) -> Status {
         return nonBlank(r, "the name of an event-log handler (e.g. null)").status();
       }},
      {"log_dir",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         c.log_dir = r.value;
         return Status::ok();
       }},
      {"redirects",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         DDPRUN_ASSIGN_OR_RETURN(c.redirects, perRankStreams(r));
         return Status::ok();
       }},
      {"tee",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         DDPRUN_ASSIGN_OR_RETURN(c.tee, perRankStreams(r));
         return Status::ok();
       }},
      {"local_ranks_filter",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         DDPRUN_ASSIGN_OR_RETURN(c.local_ranks_filter, localRanks(r));
         return Status::ok();
       }},
      {"node_rank",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         DDPRUN_ASSIGN_OR_RETURN(c.node_rank, intIn(r, 0, 1000000, "an integer from 0 to 1000000"));
         return Status::ok();
       }},
      {"master_addr",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         DDPRUN_ASSIGN_OR_RETURN(c.master_addr, hostValue(r));
         return Status::ok();
       }},
      {"master_port",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         DDPRUN_ASSIGN_OR_RETURN(c.master_port, intIn(r, 1, 65535, "a port number in 1-65535"));
         c.master_port_given = true;
         return Status::ok();
       }},
      {"local_addr",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         DDPRUN_ASSIGN_OR_RETURN(c.local_addr, hostValue(r));
         return Status::ok();
       }},
      {"shutdown_timeout",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         DDPRUN_ASSIGN_OR_RETURN(c.shutdown_timeout, secondsAtLeast(r, 0, false));
         return Status::ok();
       }},
      {"signals_to_handle",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         DDPRUN_ASSIGN_OR_RETURN(c.signals_to_handle, signalList(r));
         return Status::ok();
       }},
      {"log_line_prefix_template",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         c.log_line_prefix_template = r.value;
         return Status::ok();
       }},
      {"exit_barrier_timeout",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         DDPRUN_ASSIGN_OR_RETURN(c.exit_barrier_timeout, secondsAtLeast(r, 0, false));
         return Status::ok();
       }},
      {"heartbeat_timeout",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         DDPRUN_ASSIGN_OR_RETURN(c.heartbeat_timeout, heartbeatTimeout(r));
         return Status::ok();
       }},
      {"snapshot_dir",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         c.snapshot_dir = r.value;
         return Status::ok();
       }},
      {"snapshot_allow_unauthenticated",
       [](const Raw&, const HostFacts&, AgentConfig& c) -> Status {
         c.snapshot_allow_unauthenticated = true;
         return Status::ok();
       }},
      {"snapshot_limits",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         DDPRUN_ASSIGN_OR_RETURN(c.snapshot_limits, snapshotLimits(r));
         return Status::ok();
       }},
      {"metrics_port",
       [](const Raw& r, const HostFacts&, AgentConfig& c) -> Status {
         DDPRUN_ASSIGN_OR_RETURN(c.metrics_port, intIn(r, 0, 65535, "a port number in 0-65535"));
         return Status::ok();
       }},
      {"print_completion", nullptr},  // answered before any flag is applied (parse)
  };
  auto it = kApply.find(name);
  if (it == kApply.end()) {
    // A row added to launchFlags() without saying what it does: a bug, not a usage error.
    std::fprintf(stderr, "ddprun: internal error: flag --%s has no meaning in the launcher\n",
                 name.c_str());
    std::abort();
  }
  return it->second;
}

using Values = std::map<std::string, Raw>;

// Every flag given (or defaulted by PET_<NAME>) into the config, in table order.
Status applyFlags(const Values& given, const HostFacts& host, agent::AgentConfig& cfg) {
  for (const auto& f : launchFlags()) {
    Apply apply = applierOf(f.name);
    auto it = given.find(f.name);
    if (it == given.end() || apply == nullptr) continue;
    DDPRUN_RETURN_IF_ERROR(apply(it->second, host, cfg));
  }
  if (!given.count("signals_to_handle")) cfg.signals_to_handle = {SIGTERM, SIGINT, SIGHUP, SIGQUIT};
  // Without --rdzv-conf the agent still gets the rendezvous defaults for the --nnodes range.
  if (!given.count("rdzv_conf")) {
    DDPRUN_ASSIGN_OR_RETURN(cfg.rdzv_conf,
                            rdzvConf(Raw{"", "--rdzv-conf"}, cfg.min_nodes, cfg.max_nodes));
  }
  return Status::ok();
}

// Rules between flags: --standalone, and what the static backend needs.
Status applyCrossFlagRules(const Values& given, agent::AgentConfig& cfg) {
  if (given.count("standalone")) {
    if (given.count("nnodes") && cfg.max_nodes != 1) {
      return usage("argument " + flagNamed("--standalone", given.at("standalone").source) +
                   ": runs a single node, but " + given.at("nnodes").source + " asks for " +
                   given.at("nnodes").value + " (drop one of them)");
    }
    cfg.standalone = true;
    cfg.rdzv_backend = agent::RendezvousBackend::kC10d;
    cfg.rdzv_endpoint = "localhost:0";
    cfg.rdzv_id = randomUuid();
  }
  // Replicated between agents, the directory takes files from whoever reaches an agent: only
  // with the job's token, or when the user says, by name, that anyone may.
  if (!cfg.snapshot_dir.empty() && cfg.max_nodes > 1 && cfg.rdzv_conf.token.empty() &&
      !cfg.snapshot_allow_unauthenticated) {
    return usage(
        "argument --snapshot-dir: on a multi-node job the agents replicate " + cfg.snapshot_dir +
        " to each other, and without a token anyone who can reach an agent could plant or "
        "delete files there (a program that loads a planted snapshot.pt with torch.load runs its "
        "code); set token_file= in --rdzv-conf (the same secret on every node), or pass "
        "--snapshot-allow-unauthenticated to accept that risk");
  }
  if (cfg.rdzv_backend == agent::RendezvousBackend::kStatic) {
    if (cfg.min_nodes != cfg.max_nodes) {
      return usage("argument --nnodes: the static rendezvous needs a fixed number of nodes, got " +
                   given.at("nnodes").value + " (use --rdzv-backend=c10d for elastic MIN:MAX)");
    }
    if (cfg.node_rank >= cfg.max_nodes) {
      return usage("argument --node-rank: must be below --nnodes=" + std::to_string(cfg.max_nodes) +
                   ", got " + std::to_string(cfg.node_rank));
    }
  } else if (cfg.rdzv_backend == agent::RendezvousBackend::kEtcdV3) {
    if (cfg.rdzv_endpoint.empty()) {
      return usage(
          "argument --rdzv-endpoint: the etcd-v3 backend needs the etcd members, "
          "HOST[:PORT][,HOST[:PORT]...] (default port 2379)");
    }
    // etcd's port is 2379, not the c10d rendezvous' 29400.
    const Raw& raw = given.at("rdzv_endpoint");
    auto items = etcdMembers(raw.value);
    if (!items.isOk()) return usage("argument " + raw.source + ": " + items.status().message());
    std::vector<std::string> members;
    for (const std::string& item : items.value()) {
      Raw one = raw;
      one.value = item;
      DDPRUN_ASSIGN_OR_RETURN(std::string m, endpoint(one, 2379));
      if (endsWith(m, ":0")) {
        return usage("argument " + raw.source + ": port 0 cannot be dialled, got '" + item + "'");
      }
      members.push_back(m);
    }
    cfg.rdzv_endpoint = join(members, ",");
  } else if (!cfg.standalone && cfg.rdzv_endpoint.find(',') != std::string::npos) {
    return usage(
        "argument --rdzv-endpoint: a comma list of members is for --rdzv-backend=etcd-v3; "
        "the c10d backend takes one HOST[:PORT], got '" +
        given.at("rdzv_endpoint").value + "'");
  } else if (!cfg.standalone && cfg.rdzv_endpoint.empty()) {
    return usage("argument --rdzv-endpoint: the c10d backend needs HOST[:PORT] of the rendezvous");
  } else if (!cfg.standalone && endsWith(cfg.rdzv_endpoint, ":0")) {
    // An agent would host on a random port and then dial port 0: every node must know the port.
    return usage(
        "argument --rdzv-endpoint: port 0 cannot be dialled; give the rendezvous' real "
        "port (HOST:PORT, default 29400), got '" +
        given.at("rdzv_endpoint").value + "'");
  }
  return Status::ok();
}

// torch.distributed.launch's --local-rank=N argument: on by default under `ddprun launch`, off
// with --use-env; --local-rank-arg chooses the spelling (or asks for it under plain ddprun).
Status applyLocalRankArg(const Values& given, CliMode mode, agent::AgentConfig& cfg) {
  const bool use_env = given.count("use_env") > 0;
  const bool named = given.count("local_rank_arg") > 0;
  if (use_env && named && !cfg.local_rank_arg.empty()) {
    return usage("argument " + given.at("local_rank_arg").source + ": asks for --" +
                 cfg.local_rank_arg + "=N, but " + given.at("use_env").source +
                 " passes the local rank only as LOCAL_RANK (drop one of them)");
  }
  if (mode != CliMode::kLaunch || use_env || named) return Status::ok();
  if (given.count("no_python")) {
    // As torch.distributed.launch: a program run directly is not assumed to parse --local-rank.
    return usage(
        "ddprun launch: --no-python needs --use-env too (or --local-rank-arg to pass the local "
        "rank as an argument anyway)");
  }
  cfg.local_rank_arg = "local-rank";
  return Status::ok();
}

// One-line notices for flags that are accepted but change nothing, so that nobody believes a
// torchrun plug-in or rendezvous key took effect.
void addNotices(const Values& given, CliMode mode, const agent::AgentConfig& cfg,
                std::vector<std::string>& notices) {
  if (mode == CliMode::kLaunch) {
    notices.push_back(
        "'ddprun launch' does what the deprecated torch.distributed.launch did: " +
        (cfg.local_rank_arg.empty()
             ? std::string("the local rank is in LOCAL_RANK only (--use-env)")
             : "each script gets --" + cfg.local_rank_arg + "=<local rank>") +
        ". Read os.environ['LOCAL_RANK'] instead and run plain ddprun, which sets LOCAL_RANK "
        "(as torchrun)");
  }
  if (!cfg.rdzv_conf.unknown_keys.empty()) {
    const auto& raw = given.count("rdzv_conf") ? given.at("rdzv_conf").source : "--rdzv-conf";
    notices.push_back("warning: " + raw + ": ddprun's rendezvous does not use " +
                      join(cfg.rdzv_conf.unknown_keys, ", ") +
                      " (torchrun would pass them to its backend); ignoring them");
  }
  // As in torchrun, the filters see the streams the agent tees; say so when they see nothing.
  for (const auto& [flag, filters, mask] :
       {std::tuple{"duplicate_stdout_filters", &cfg.duplicate_stdout_filters, 1},
        std::tuple{"duplicate_stderr_filters", &cfg.duplicate_stderr_filters, 2}}) {
    bool teed = static_cast<int>(cfg.tee.all) & mask;
    for (const auto& [rank, streams] : cfg.tee.per_rank) teed |= (static_cast<int>(streams) & mask);
    if (!filters->empty() && !teed) {
      notices.push_back("warning: " + given.at(flag).source +
                        " has no effect: it filters the streams of tee'd workers, and no local "
                        "rank tees " +
                        (mask == 1 ? "stdout" : "stderr") + " (add -t " + std::to_string(mask) +
                        " or -t 3)");
    }
  }
  if (auto it = given.find("logs_specs"); it != given.end()) {
    notices.push_back(it->second.source + "=" + it->second.value +
                      " ignored: it names a Python plug-in of torchrun, and ddprun has none "
                      "(logs go to --log-dir as <run>/attempt_<n>/<local_rank>/*.log)");
  }
  if (auto it = given.find("event_log_handler"); it != given.end() && it->second.value != "null") {
    notices.push_back(it->second.source + "=" + it->second.value +
                      " ignored: it names a Python plug-in of torchrun, and ddprun has none");
  }
}

StatusOr<CliResult> parse(const std::vector<std::string>& args,
                          const std::map<std::string, std::string>& env, const HostFacts& host,
                          CliMode mode) {
  CliResult result;
  const TokenizedArgs tokens = tokenizeLaunchArgs(args, launchFlags());
  DDPRUN_ASSIGN_OR_RETURN(FlagValues flags, resolveFlagValues(tokens, env, launchFlags()));
  if (flags.help) {
    result.show_help = true;
    return result;
  }
  // As torchrun: printed at once, whatever else the command line holds or lacks.
  if (auto it = flags.values.find("print_completion"); it != flags.values.end()) {
    const auto row =
        std::find_if(launchFlags().begin(), launchFlags().end(),
                     [](const LaunchFlag& f) { return f.name == std::string("print_completion"); });
    const std::vector<std::string> shells = split(row->choices, ',');
    if (std::find(shells.begin(), shells.end(), it->second.value) == shells.end()) {
      return usage("argument " + it->second.source + ": invalid choice: '" + it->second.value +
                   "' (choose from " + join(shells, ", ") + ")");
    }
    result.completion_shell = it->second.value;
    return result;
  }
  agent::AgentConfig& cfg = result.config;
  // torch >= 2.2 reads the template's default from the environment.
  if (!flags.values.count("log_line_prefix_template")) {
    if (auto it = env.find("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"); it != env.end()) {
      flags.values["log_line_prefix_template"] =
          Raw{it->second, "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"};
    }
  }
  DDPRUN_RETURN_IF_ERROR(applyFlags(flags.values, host, cfg));
  DDPRUN_RETURN_IF_ERROR(applyCrossFlagRules(flags.values, cfg));
  DDPRUN_RETURN_IF_ERROR(applyLocalRankArg(flags.values, mode, cfg));

  if (!tokens.program) {
    return usage("the following arguments are required: training_script (the program to run)");
  }
  const std::string& program = args[*tokens.program];
  const std::vector<std::string> program_args(args.begin() + static_cast<long>(*tokens.program) + 1,
                                              args.end());
  const auto sourceOf = [&flags](const char* name) {
    auto it = flags.values.find(name);
    return it == flags.values.end() ? std::string() : it->second.source;
  };
  const ProgramKind kind{sourceOf("module"), sourceOf("no_python"), sourceOf("run_path")};
  DDPRUN_RETURN_IF_ERROR(resolveProgram(cfg, kind, program, program_args, env));
  addNotices(flags.values, mode, cfg, result.notices);

  if (cfg.nproc_per_node > 1 && !env.count("OMP_NUM_THREADS")) {
    cfg.set_omp_num_threads = true;
    result.notices.push_back(
        "setting OMP_NUM_THREADS=1 for each worker to avoid overloading the system; set it "
        "yourself to tune");
  }
  return result;
}

}  // namespace

StatusOr<CliResult> parseCommandLine(const std::vector<std::string>& args,
                                     const std::map<std::string, std::string>& env,
                                     const HostFacts& host, CliMode mode) {
  auto parsed = parse(args, env, host, mode);
  // Messages quote flag values and environment variables: one line, whatever they hold.
  if (!parsed.isOk())
    return Status(parsed.status().code(), escapeControl(parsed.status().message()));
  return parsed;
}

std::string helpText(CliMode mode) {
  std::string out =
      mode == CliMode::kLaunch
          ? "usage: ddprun launch [options] training_script [training_script_args ...]\n\n"
            "torch.distributed.launch's behaviour: as ddprun, and each script also gets\n"
            "--local-rank=<local rank> (--local-rank-arg=local_rank: the torch 1.x spelling)\n"
            "unless --use-env is given. Deprecated as in torch: read LOCAL_RANK instead.\n\n"
          : "usage: ddprun [options] training_script [training_script_args ...]\n"
            "       ddprun launch [options] ...   torch.distributed.launch's --local-rank "
            "argument\n"
            "       ddprun slurm [options] ...    one agent per node of a Slurm allocation\n\n";
  out +=
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
    if (f.short_name != 0) left += std::string("-") + f.short_name + ", ";
    left += dashedFlagName(f.name);
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
  // Intel GPUs: DRM render nodes whose PCI vendor is Intel's (what torch.xpu would drive).
  if (DIR* dir = ::opendir("/sys/class/drm")) {
    while (dirent* e = ::readdir(dir)) {
      std::string name = e->d_name;
      if (!startsWith(name, "renderD")) continue;
      std::string vendor;
      std::ifstream("/sys/class/drm/" + name + "/device/vendor") >> vendor;
      if (vendor == "0x8086") ++facts.xpu_count;
    }
    ::closedir(dir);
  }
  return facts;
}

}  // namespace ddprun::launcher
