#include "ddprun/agent/agent_runner.h"

#include <arpa/inet.h>
#include <grpc/support/log.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <iostream>

#include "ddprun/agent/failure_report.h"
#include "ddprun/agent/supervisor.h"
#include "ddprun/agent/worker_env.h"
#include "ddprun/common/log.h"
#include "ddprun/common/strings.h"
#include "ddprun/rendezvous/conf.h"
#include "ddprun/rendezvous/server.h"
#include "grpc_rendezvous.h"
#include "local_rendezvous.h"
#include "metrics_server.h"
#include "posix_process_launcher.h"

namespace ddprun::agent {
namespace {

Status makeDirs(const std::string& path) {
  std::string partial;
  for (size_t i = 0; i <= path.size(); ++i) {
    if (i == path.size() || (path[i] == '/' && i > 0)) {
      partial = path.substr(0, i);
      if (::mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) {
        return failedPrecondition("cannot create directory " + partial + ": " +
                                  std::strerror(errno));
      }
    }
  }
  return Status::ok();
}

StatusOr<std::string> makeTempDir(const std::string& parent, const std::string& prefix) {
  DDPRUN_RETURN_IF_ERROR(makeDirs(parent));
  std::string templ = parent + "/" + prefix + "XXXXXX";
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr) {
    return failedPrecondition("cannot create a directory under " + parent + ": " +
                              std::strerror(errno));
  }
  return std::string(buf.data());
}

std::string replaceAll(std::string s, const std::string& from, const std::string& to) {
  for (size_t pos = 0; (pos = s.find(from, pos)) != std::string::npos; pos += to.size()) {
    s.replace(pos, from.size(), to);
  }
  return s;
}

// The Supervisor's planner: per-attempt log directories and each worker's launch.
class WorkerPlanner {
 public:
  WorkerPlanner(const AgentConfig& cfg, std::string run_log_dir, std::string hostname)
      : cfg_(cfg),
        run_log_dir_(std::move(run_log_dir)),
        hostname_(std::move(hostname)),
        parent_env_(environmentMap()) {}

  StatusOr<std::vector<WorkerLaunch>> plan(const RoundInfo& round, int restart_count) {
    const std::string attempt_dir = run_log_dir_ + "/attempt_" + std::to_string(restart_count);
    WorkerEnvInputs in;
    in.round = round;
    in.role = cfg_.role;
    in.restart_count = restart_count;
    in.max_restarts = cfg_.max_restarts;
    in.snapshot_dir = cfg_.snapshot_dir;
    in.set_omp_num_threads = cfg_.set_omp_num_threads;
    const int local_world_size = round.local_world_sizes.at(round.group_rank);
    const int base = baseRank(round.local_world_sizes, round.group_rank);
    std::vector<WorkerLaunch> launches;
    for (int lr = 0; lr < local_world_size; ++lr) {
      const std::string dir = attempt_dir + "/" + std::to_string(lr);
      DDPRUN_RETURN_IF_ERROR(makeDirs(dir));
      WorkerLaunch w;
      w.local_rank = lr;
      w.global_rank = base + lr;
      w.argv = cfg_.worker_argv;
      w.error_file = dir + "/error.json";
      in.error_file = w.error_file;
      if (cfg_.heartbeat_timeout > 0) {
        // A new round after a membership change reuses the attempt's directory: the previous
        // workers' file must not arm (or hang) the new worker before it touched it itself.
        w.heartbeat_file = dir + "/heartbeat";
        if (::unlink(w.heartbeat_file.c_str()) != 0 && errno != ENOENT) {
          return failedPrecondition("cannot remove the old heartbeat file " + w.heartbeat_file +
                                    ": " + std::strerror(errno));
        }
      }
      in.heartbeat_file = w.heartbeat_file;
      for (const auto& [k, v] : buildWorkerEnv(in, lr, parent_env_)) w.env.push_back(k + "=" + v);
      const StdStreams tee = cfg_.tee.forRank(lr);
      const int files = static_cast<int>(cfg_.redirects.forRank(lr)) | static_cast<int>(tee);
      if (files & 1) w.stdout_file = dir + "/stdout.log";
      if (files & 2) w.stderr_file = dir + "/stderr.log";
      w.tee_stdout = hasOut(tee);
      w.tee_stderr = hasErr(tee);
      w.to_console = !cfg_.local_ranks_filter || cfg_.local_ranks_filter->count(lr) > 0;
      std::string prefix = cfg_.log_line_prefix_template.empty() ? "[${role_name}${local_rank}]:"
                                                                 : cfg_.log_line_prefix_template;
      prefix = replaceAll(prefix, "${role_name}", cfg_.role);
      prefix = replaceAll(prefix, "${local_rank}", std::to_string(lr));
      prefix = replaceAll(prefix, "${rank}", std::to_string(w.global_rank));
      prefix = replaceAll(prefix, "${hostname}", hostname_);
      w.console_prefix = prefix;
      launches.push_back(std::move(w));
    }
    return launches;
  }

 private:
  const AgentConfig& cfg_;
  std::string run_log_dir_;
  std::string hostname_;
  std::map<std::string, std::string> parent_env_;
};

// Hang detection's look at a worker's DDPRUN_HEARTBEAT_FILE.
class StatHeartbeatProbe final : public HeartbeatProbe {
 public:
  std::optional<int64_t> modificationTime(const std::string& path) override {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) return std::nullopt;
    return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  }
};

bool isLoopbackOrLocal(const std::string& host, const std::string& local_addr,
                       const std::string& hostname) {
  char name[256] = {0};
  ::gethostname(name, sizeof(name) - 1);
  if (host == "localhost" || host == local_addr || host == hostname || host == name) return true;
  std::string bare = host;
  if (bare.size() > 2 && bare.front() == '[' && bare.back() == ']') {
    bare = bare.substr(1, bare.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  addrinfo* res = nullptr;
  if (::getaddrinfo(bare.c_str(), nullptr, &hints, &res) != 0 || res == nullptr) return false;
  std::vector<std::string> wanted;
  bool loopback = false;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    char buf[INET6_ADDRSTRLEN] = {0};
    if (a->ai_family == AF_INET) {
      auto* in = reinterpret_cast<sockaddr_in*>(a->ai_addr);
      loopback = loopback || (ntohl(in->sin_addr.s_addr) >> 24) == 127;
      ::inet_ntop(AF_INET, &in->sin_addr, buf, sizeof(buf));
    } else if (a->ai_family == AF_INET6) {
      auto* in6 = reinterpret_cast<sockaddr_in6*>(a->ai_addr);
      loopback = loopback || IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr);
      ::inet_ntop(AF_INET6, &in6->sin6_addr, buf, sizeof(buf));
    }
    wanted.emplace_back(buf);
  }
  ::freeaddrinfo(res);
  if (loopback) return true;
  ifaddrs* ifs = nullptr;
  if (::getifaddrs(&ifs) != 0) return false;
  bool found = false;
  for (ifaddrs* i = ifs; i != nullptr && !found; i = i->ifa_next) {
    if (i->ifa_addr == nullptr) continue;
    char buf[INET6_ADDRSTRLEN] = {0};
    if (i->ifa_addr->sa_family == AF_INET) {
      ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf,
                  sizeof(buf));
    } else if (i->ifa_addr->sa_family == AF_INET6) {
      ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr, buf,
                  sizeof(buf));
    } else {
      continue;
    }
    for (const auto& w : wanted) found = found || w == buf;
  }
  ::freeifaddrs(ifs);
  return found;
}

struct RendezvousSetup {
  std::unique_ptr<rendezvous::RendezvousServer> server;  // when this agent hosts it
  std::unique_ptr<RendezvousClient> client;
};

// Picks the rendezvous for the job: in-process for one node, else ddprun's gRPC rendezvous at
// --rdzv-endpoint (hosted by this agent when the endpoint is this host, as torchrun's is_host).
StatusOr<RendezvousSetup> makeRendezvous(const AgentConfig& cfg,
                                         const rendezvous::RendezvousConf& conf,
                                         const std::string& local_addr, const std::string& hostname,
                                         boost::asio::io_context& io,
                                         GrpcRendezvous::EventSink sink) {
  auto log = logger("agent");
  RendezvousSetup out;
  if (cfg.standalone || (cfg.rdzv_backend == RendezvousBackend::kStatic && cfg.max_nodes == 1)) {
    RoundInfo base;
    base.run_id = cfg.rdzv_id;
    base.local_world_sizes = {cfg.nproc_per_node};
    base.master_addr = cfg.standalone ? local_addr : cfg.master_addr;
    base.master_port = cfg.standalone ? 0 : cfg.master_port;
    out.client = std::make_unique<LocalRendezvous>(io, base, /*pick_free_port=*/cfg.standalone);
    return out;
  }

  GrpcRendezvousOptions o;
  std::string endpoint = cfg.rdzv_endpoint;
  bool must_host = false;
  bool may_host = false;
  if (cfg.rdzv_backend == RendezvousBackend::kStatic) {
    // The agents' own rendezvous sits next to the workers' store: MASTER_PORT+1 on the master.
    if (endpoint.empty()) {
      if (cfg.master_port >= 65535) {
        return invalidArgument(
            "--master-port: the static backend needs MASTER_PORT+1 free for "
            "the agents' rendezvous; pick a port below 65535 or give "
            "--rdzv-endpoint");
      }
      endpoint = cfg.master_addr + ":" + std::to_string(cfg.master_port + 1);
    }
    o.static_node_rank = cfg.node_rank;
    o.static_master_addr = cfg.master_addr;
    o.master_port = cfg.master_port;
    must_host = cfg.node_rank == 0;
    may_host = must_host;
  } else {
    o.master_port = cfg.master_port_given ? cfg.master_port : 0;
    const std::string host = endpoint.substr(0, endpoint.rfind(':'));
    if (conf.is_host == rendezvous::IsHost::kAuto) {
      may_host = isLoopbackOrLocal(host, local_addr, hostname);
    } else {
      must_host = conf.is_host == rendezvous::IsHost::kTrue;
      may_host = must_host;
    }
  }
  o.run_id = cfg.rdzv_id;
  o.local_addr = local_addr;
  o.local_world_size = cfg.nproc_per_node;
  o.run_config = conf.run;  // min/max nodes, last call, heartbeats
  o.join_timeout = conf.join_timeout;
  o.exit_barrier_timeout = seconds(cfg.exit_barrier_timeout);
  o.client.endpoint = endpoint;
  o.client.rpc_timeout = conf.read_timeout;
  o.client.retry_timeout = o.join_timeout;
  o.client.token = conf.token;
  o.client.tls_root_cert_pem = conf.tls_ca_pem;
  o.tls_ca_file = conf.tls_ca_file;

  if (may_host) {
    rendezvous::ServerOptions so;
    so.listen = endpoint;
    so.token = conf.token;
    so.tls_cert_pem = conf.tls_cert_pem;
    so.tls_key_pem = conf.tls_key_pem;
    auto server = rendezvous::RendezvousServer::start(so);
    if (server.isOk()) {
      out.server = std::move(server).value();
      log->info("hosting the rendezvous at {}{}", out.server->address(),
                conf.tls_cert_pem.empty() ? "" : " (TLS)");
    } else if (must_host) {
      return unavailable("cannot host the rendezvous at " + endpoint + ": " +
                         server.status().message());
    } else {
      log->info("rendezvous at {} is hosted by another agent", endpoint);
    }
  }
  out.client = std::make_unique<GrpcRendezvous>(io, std::move(o), std::move(sink));
  return out;
}

// Counters behind /metrics, updated from the supervisor's state changes.
struct AgentMetrics {
  AgentState last = AgentState::kInit;
  int failures = 0;            // restarts charged (worker failures here or elsewhere)
  int membership_changes = 0;  // free restarts
  double last_change = 0;      // unix seconds of the last state change
  int last_restart_count = 0;
  void onState(AgentState s, int restart_count, double now) {
    if (s == AgentState::kRestarting || s == AgentState::kRendezvous) {
      if (last == AgentState::kStopping) {
        if (restart_count > last_restart_count) {
          ++failures;
        } else {
          ++membership_changes;
        }
      }
    }
    if (s == AgentState::kRunning) last_restart_count = restart_count;
    last = s;
    last_change = now;
  }
};

std::string renderMetrics(const AgentConfig& cfg, const Supervisor& sup, const AgentMetrics& m,
                          const RendezvousClient* rdzv) {
  std::string out;
  auto add = [&](const std::string& name, const std::string& help, const std::string& type,
                 double value, const std::string& labels = "") {
    out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.17g", value);
    out += name + labels + " " + buf + "\n";
  };
  const auto* grpc = dynamic_cast<const GrpcRendezvous*>(rdzv);
  add("ddprun_agent_round", "Rendezvous round this node's workers run in.", "gauge",
      grpc != nullptr ? static_cast<double>(grpc->currentRound()) : sup.restartCount());
  add("ddprun_agent_group_rank", "Group rank of this node in the round.", "gauge", sup.groupRank());
  add("ddprun_agent_world_size", "WORLD_SIZE of the round.", "gauge", sup.worldSize());
  add("ddprun_agent_local_world_size", "Workers on this node.", "gauge", cfg.nproc_per_node);
  add("ddprun_agent_workers_running", "Workers of this node running now.", "gauge",
      sup.runningWorkers());
  std::string states;
  for (auto s :
       {AgentState::kInit, AgentState::kRendezvous, AgentState::kRunning, AgentState::kStopping,
        AgentState::kRestarting, AgentState::kSucceeded, AgentState::kFailed}) {
    char line[128];
    std::snprintf(line, sizeof(line), "ddprun_agent_state{state=\"%s\"} %d\n", agentStateName(s),
                  sup.state() == s ? 1 : 0);
    states += line;
  }
  out +=
      "# HELP ddprun_agent_state Current state of the agent (1 for the current one).\n"
      "# TYPE ddprun_agent_state gauge\n" +
      states;
  add("ddprun_agent_restarts_total", "Restarts charged against --max-restarts.", "counter",
      sup.restartCount());
  add("ddprun_agent_failures_total", "Worker-group failures (here or on another node).", "counter",
      m.failures);
  add("ddprun_agent_membership_changes_total", "Restarts caused by nodes joining or leaving.",
      "counter", m.membership_changes);
  add("ddprun_agent_last_change_timestamp_seconds", "Unix time of the last state change.", "gauge",
      m.last_change);
  return out;
}

}  // namespace

std::string fullyQualifiedHostname() {
  // Python's socket.getfqdn(), which torchrun uses: resolve the host name, look the address up,
  // and take the first of (name, aliases...) that contains a dot, else the name.
  char name[256] = {0};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  addrinfo* res = nullptr;
  if (::getaddrinfo(name, nullptr, &hints, &res) != 0 || res == nullptr) return name;
  std::string fqdn = name;
  const void* addr = nullptr;
  socklen_t len = 0;
  if (res->ai_family == AF_INET) {
    addr = &reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
    len = sizeof(in_addr);
  } else if (res->ai_family == AF_INET6) {
    addr = &reinterpret_cast<sockaddr_in6*>(res->ai_addr)->sin6_addr;
    len = sizeof(in6_addr);
  }
  if (addr != nullptr) {
    hostent entry{};
    hostent* found = nullptr;
    char buf[8192];
    int err = 0;
    if (::gethostbyaddr_r(addr, len, res->ai_family, &entry, buf, sizeof(buf), &found, &err) == 0 &&
        found != nullptr && found->h_name != nullptr) {
      fqdn = found->h_name;
      std::vector<std::string> candidates{found->h_name};
      for (char** a = found->h_aliases; a != nullptr && *a != nullptr; ++a)
        candidates.push_back(*a);
      for (const auto& c : candidates) {
        if (c.find('.') != std::string::npos) {
          fqdn = c;
          break;
        }
      }
    }
  }
  ::freeaddrinfo(res);
  return fqdn;
}

int runAgent(const AgentConfig& cfg) {
  auto log = logger("agent");
  // gRPC's own log lines (e.g. a failed bind while probing is_host) go to our debug level.
  gpr_set_log_function([](gpr_log_func_args* args) {
    logger("grpc")->debug("{}:{} {}", args->file, args->line, args->message);
  });
  ::signal(SIGPIPE, SIG_IGN);
  // The launcher parsed --rdzv-conf (and read the files it names).
  const rendezvous::RendezvousConf* rdzv_conf = &cfg.rdzv_conf;
  const std::string hostname = fullyQualifiedHostname();
  const std::string local_addr = cfg.local_addr.empty() ? hostname : cfg.local_addr;

  std::string base_dir = cfg.log_dir;
  if (base_dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    auto dir = makeTempDir(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "torchelastic_");
    if (!dir.isOk()) {
      log->error("{}", dir.status().message());
      return 1;
    }
    base_dir = *dir;
  }
  auto run_dir = makeTempDir(base_dir, cfg.rdzv_id + "_");
  if (!run_dir.isOk()) {
    log->error("--log-dir: {}", run_dir.status().message());
    return 1;
  }
  log->info("log directory set to: {}", *run_dir);

  boost::asio::io_context io;
  PosixProcessLauncher launcher(io);

  Supervisor* supervisor_ptr = nullptr;
  std::function<void()> after_event;  // set below; pushed events reach it on this thread
  auto rendezvous_or = makeRendezvous(cfg, *rdzv_conf, local_addr, hostname, io, [&](PeerEvent e) {
    if (supervisor_ptr == nullptr) return;
    if (e == PeerEvent::kPeerFailure) {
      supervisor_ptr->onPeerFailure();
    } else {
      supervisor_ptr->onMembershipChange();
    }
    if (after_event) after_event();
  });
  if (!rendezvous_or.isOk()) {
    log->error("{}", rendezvous_or.status().message());
    return rendezvous_or.status().code() == StatusCode::kInvalidArgument ? 2 : 1;
  }
  RendezvousClient& rendezvous = *rendezvous_or->client;

  SteadyClock clock;
  WorkerPlanner planner(cfg, *run_dir, hostname);
  SupervisorOptions options;
  options.max_restarts = cfg.max_restarts;
  options.shutdown_timeout = seconds(cfg.shutdown_timeout);
  options.heartbeat_timeout = seconds(cfg.heartbeat_timeout);
  if (dynamic_cast<GrpcRendezvous*>(&rendezvous) != nullptr) {
    // Longer than the time the rendezvous takes to notice a dead peer (one heartbeat interval
    // after its watch stream broke), so a crash caused by that peer is not charged.
    options.failure_grace = rdzv_conf->failure_grace;
  }
  StatHeartbeatProbe heartbeat_probe;
  Supervisor supervisor(
      options, launcher, rendezvous, clock,
      [&planner](const RoundInfo& r, int restarts) { return planner.plan(r, restarts); },
      &heartbeat_probe);

  supervisor_ptr = &supervisor;

  boost::asio::steady_timer timer(io);
  boost::asio::signal_set children(io, SIGCHLD);
  boost::asio::signal_set handled(io);
  for (int sig : cfg.signals_to_handle) handled.add(sig);

  // After every event: stop when done, otherwise re-arm the timer for the supervisor's next
  // deadline (SIGKILL, a delayed failure report, or the next look at the heartbeat files).
  std::function<void()> afterEvent = [&] {
    if (supervisor.finished()) {
      io.stop();
      return;
    }
    timer.cancel();
    if (auto deadline = supervisor.nextDeadline()) {
      timer.expires_at(*deadline);
      timer.async_wait([&](const boost::system::error_code& ec) {
        if (ec) return;
        supervisor.onDeadline();
        afterEvent();
      });
    }
  };

  std::function<void()> reap;
  std::function<void()> watchChildren = [&] {
    children.async_wait([&](const boost::system::error_code& ec, int) {
      if (ec) return;
      reap();
      watchChildren();
    });
  };
  reap = [&] {
    while (true) {
      int status = 0;
      pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid <= 0) break;
      ExitStatus exit;
      if (WIFSIGNALED(status)) {
        exit = ExitStatus{true, WTERMSIG(status)};
      } else if (WIFEXITED(status)) {
        exit = ExitStatus{false, WEXITSTATUS(status)};
      } else {
        continue;
      }
      supervisor.onWorkerExit(pid, exit);
    }
    afterEvent();
  };
  std::function<void()> watchSignals = [&] {
    handled.async_wait([&](const boost::system::error_code& ec, int sig) {
      if (ec) return;
      log->warn("received {}, forwarding it to the workers", signalName(sig));
      supervisor.onSignal(sig);
      afterEvent();
      watchSignals();
    });
  };

  after_event = afterEvent;

  std::unique_ptr<MetricsServer> metrics;
  AgentMetrics counters;
  if (cfg.metrics_port >= 0) {
    std::string host = local_addr;
    boost::system::error_code ec;
    boost::asio::ip::make_address(host, ec);
    if (ec) host = "0.0.0.0";  // a host name: listen everywhere
    auto server = MetricsServer::start(
        io, host, cfg.metrics_port,
        [&] { return renderMetrics(cfg, supervisor, counters, rendezvous_or->client.get()); },
        [&] { return !supervisor.finished() || supervisor.exitCode() == 0; });
    if (!server.isOk()) {
      log->error("{}", server.status().message());
      return 2;
    }
    metrics = std::move(server).value();
    log->info("metrics on http://{}:{}/metrics", host, metrics->port());
  }

  supervisor.setStateListener([&](AgentState s) {
    counters.onState(s, supervisor.restartCount(), clock.wallSeconds());
    // Changes that come from a posted callback (a round that completed or failed) must stop the
    // loop or arm the timer (the first look at the heartbeat files) too.
    boost::asio::post(io, [&] { afterEvent(); });
    if (s == AgentState::kRunning) {
      log->info("started {} worker(s) (attempt {}, run id {})", cfg.nproc_per_node,
                supervisor.restartCount(), cfg.rdzv_id);
    }
  });

  watchChildren();
  watchSignals();
  boost::asio::post(io, [&] {
    supervisor.start();
    afterEvent();
  });
  io.run();

  launcher.drainAll();
  std::cout.flush();
  // The workers are gone: from here a signal simply ends ddprun (default dispositions).
  boost::system::error_code ignored;
  handled.clear(ignored);
  rendezvous.finish(supervisor.state() == AgentState::kSucceeded, supervisor.leftRun());
  if (supervisor.state() == AgentState::kFailed) {
    if (!supervisor.failures().empty() && supervisor.exitCode() == 1) {
      std::cerr << formatFailureReport(cfg.entrypoint, hostname, supervisor.failures());
    } else if (!supervisor.errorMessage().empty()) {
      log->error("{}", supervisor.errorMessage());
    }
  }
  return supervisor.exitCode();
}

}  // namespace ddprun::agent
