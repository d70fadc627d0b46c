#include "ddprun/agent/agent_runner.h"

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
#include "local_rendezvous.h"
#include "posix_process_launcher.h"

extern char** environ;

namespace ddprun::agent {
namespace {

std::map<std::string, std::string> currentEnvironment() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string kv = *e;
    auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return env;
}

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
        parent_env_(currentEnvironment()) {}

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
      for (const auto& [k, v] : buildWorkerEnv(in, lr, parent_env_)) w.env.push_back(k + "=" + v);
      const StdStreams tee = cfg_.tee.forRank(lr);
      const int files = static_cast<int>(cfg_.redirects.forRank(lr)) | static_cast<int>(tee);
      if (files & 1) w.stdout_file = dir + "/stdout.log";
      if (files & 2) w.stderr_file = dir + "/stderr.log";
      w.tee_stdout = hasOut(tee);
      w.tee_stderr = hasErr(tee);
      w.to_console = !cfg_.local_ranks_filter || cfg_.local_ranks_filter->count(lr) > 0;
      std::string prefix = cfg_.log_line_prefix_template.empty()
                               ? "[${role_name}${local_rank}]:"
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
      for (char** a = found->h_aliases; a != nullptr && *a != nullptr; ++a) candidates.push_back(*a);
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
  ::signal(SIGPIPE, SIG_IGN);
  const std::string hostname = fullyQualifiedHostname();
  const std::string local_addr = cfg.local_addr.empty() ? hostname : cfg.local_addr;

  if (cfg.max_nodes > 1) {
    log->error("multi-node jobs (--nnodes={}:{}) need the multi-node rendezvous, which is not "
               "part of this build yet; run one node (--standalone or --nnodes=1)",
               cfg.min_nodes, cfg.max_nodes);
    return 2;
  }

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

  RoundInfo base;
  base.run_id = cfg.rdzv_id;
  base.group_rank = 0;
  base.local_world_sizes = {cfg.nproc_per_node};
  if (cfg.standalone) {
    base.master_addr = local_addr;
  } else {
    base.master_addr = cfg.master_addr;
    base.master_port = cfg.master_port;
  }
  LocalRendezvous rendezvous(io, base, /*pick_free_port=*/cfg.standalone);

  SteadyClock clock;
  WorkerPlanner planner(cfg, *run_dir, hostname);
  SupervisorOptions options;
  options.max_restarts = cfg.max_restarts;
  options.shutdown_timeout = seconds(cfg.shutdown_timeout);
  Supervisor supervisor(options, launcher, rendezvous, clock,
                        [&planner](const RoundInfo& r, int restarts) {
                          return planner.plan(r, restarts);
                        });

  boost::asio::steady_timer timer(io);
  boost::asio::signal_set children(io, SIGCHLD);
  boost::asio::signal_set handled(io);
  for (int sig : cfg.signals_to_handle) handled.add(sig);

  // After every event: stop when done, otherwise re-arm the kill-deadline timer.
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

  supervisor.setStateListener([&](AgentState s) {
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
