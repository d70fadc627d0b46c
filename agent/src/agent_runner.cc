#include "ddprun/agent/agent_runner.h"

#include <sys/stat.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/address.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>
#include <csignal>
#include <cstdlib>
#include <iostream>

#include "agent_metrics.h"
#include "ddprun/agent/choose_rendezvous.h"
#include "ddprun/agent/failure_report.h"
#include "ddprun/agent/supervisor.h"
#include "ddprun/agent/worker_planner.h"
#include "ddprun/common/control_protocol.h"
#include "ddprun/common/log.h"
#include "ddprun/common/log_throttle.h"
#include "ddprun/common/open_files.h"
#include "ddprun/common/strings.h"
#include "files.h"
#include "host_identity.h"
#include "job_identity.h"
#include "metrics_server.h"
#include "posix_process_launcher.h"
#include "rendezvous_factory.h"
#include "snapshot_sync_client.h"
#include "stat_heartbeat_probe.h"
#include "torch_probe.h"
#include "unix_control_server.h"

namespace ddprun::agent {
namespace {

// How long the endgame (departures, close) may hold an agent whose rendezvous is gone.
constexpr Duration kShutdownTimeout = std::chrono::seconds(30);
// How long the first launch waits for the Python workers' torch version (TorchProbe).
constexpr std::chrono::milliseconds kTorchProbeBound = std::chrono::seconds(3);

// The one place where an agent that could not start chooses its exit code: 2 for what the user
// must change (a flag, a file, a port: INVALID_ARGUMENT), 1 for everything else. Once the workers
// can start, the supervisor's exit code is the agent's (SPEC §4).
int exitCodeOf(const Status& setup_failure) {
  return setup_failure.code() == StatusCode::kInvalidArgument ? 2 : 1;
}

// A step whose every failure is the user's to fix.
Status usageError(const Status& st) {
  return st.isOk() ? st : Status(StatusCode::kInvalidArgument, st.message());
}

// What this node is, decided before anything starts: its names, its rendezvous, its log dir.
struct NodeSetup {
  std::string hostname;
  std::string local_addr;
  RendezvousChoice choice;
  std::string run_dir;
};

// <log_dir or a fresh temp dir>/<run_id>_XXXXXX: this run's log directory.
StatusOr<std::string> makeRunLogDir(const AgentConfig& cfg) {
  std::string base_dir = cfg.log_dir;
  if (base_dir.empty()) {
    // As Python's tempfile: TMPDIR when it is a directory this process may write in, else /tmp
    // (never a TMPDIR created because it was set).
    const char* set = std::getenv("TMPDIR");
    std::string tmp = set != nullptr ? set : "";
    struct stat st {};
    if (!tmp.empty() && (::stat(tmp.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) ||
                         ::access(tmp.c_str(), W_OK | X_OK) != 0)) {
      logger("agent")->warn(
          "TMPDIR={} is not a directory ddprun may write in; the run's logs go "
          "under /tmp",
          escapeControl(tmp));
      tmp.clear();
    }
    DDPRUN_ASSIGN_OR_RETURN(base_dir, makeTempDir(tmp.empty() ? "/tmp" : tmp, "torchelastic_"));
  }
  auto run_dir = makeTempDir(base_dir, cfg.rdzv_id + "_");
  if (!run_dir.isOk()) {
    // A --log-dir that cannot hold the run's logs is a usage error (exit 2), as --snapshot-dir's.
    Status st(run_dir.status().code(), "--log-dir: " + run_dir.status().message());
    return cfg.log_dir.empty() ? st : usageError(st);
  }
  return run_dir;
}

StatusOr<NodeSetup> prepareNode(const AgentConfig& cfg) {
  NodeSetup node;
  node.hostname = fullyQualifiedHostname();
  node.local_addr = cfg.local_addr.empty() ? node.hostname : cfg.local_addr;
  auto choice = chooseRendezvous(cfg, node.local_addr, [&](const std::string& host) {
    return isThisHost(host, node.local_addr, node.hostname);
  });
  if (!choice.isOk()) return usageError(choice.status());
  node.choice = std::move(choice).value();
  if (!cfg.snapshot_dir.empty())
    DDPRUN_RETURN_IF_ERROR(usageError(snapshot::checkSnapshotDir(cfg.snapshot_dir)));
  DDPRUN_ASSIGN_OR_RETURN(node.run_dir, makeRunLogDir(cfg));
  logger("agent")->info("log directory set to: {}", node.run_dir);
  // Before gRPC's threads exist (see the function).
  if (!cfg.snapshot_dir.empty()) {
    snapshot::tuneAllocatorForTransfers();
    // One open descriptor per replicated file name (its current version, served from that inode).
    logger("agent")->debug("snapshot dir: up to {} open files", raiseOpenFileLimit());
  }
  return node;
}

// The planner's launches, once the directories and files they name are ready.
StatusOr<std::vector<WorkerLaunch>> prepareAttempt(AttemptPlan plan) {
  for (const auto& dir : plan.dirs) DDPRUN_RETURN_IF_ERROR(makeDirs(dir));
  for (const auto& file : plan.stale_files) {  // error, heartbeat, stop and filtered files
    Status st = removeIfExists(file);
    if (!st.isOk()) return Status(st.code(), "a file of the previous round: " + st.message());
  }
  return std::move(plan.launches);
}

// The replication service speaks as the rendezvous does: the same token, TLS when configured.
StatusOr<snapshot::ReplicatorOptions> snapshotReplicatorOptions(const AgentConfig& cfg,
                                                                const std::string& local_addr) {
  snapshot::ReplicatorOptions o;
  o.dir = cfg.snapshot_dir;
  o.run_id = cfg.rdzv_id;
  o.local_addr = local_addr;
  o.limits = cfg.snapshot_limits;
  o.security.token = cfg.rdzv_conf.token;
  if (!cfg.rdzv_conf.tls_ca_pem.empty()) {
    if (cfg.rdzv_conf.tls_cert_pem.empty() || cfg.rdzv_conf.tls_key_pem.empty()) {
      return invalidArgument(
          "--snapshot-dir with TLS (tls_ca= in --rdzv-conf) needs tls_cert= and tls_key= on "
          "every node: each agent serves its snapshots to the others");
    }
    o.security.tls_ca_pem = cfg.rdzv_conf.tls_ca_pem;
    o.security.tls_cert_pem = cfg.rdzv_conf.tls_cert_pem;
    o.security.tls_key_pem = cfg.rdzv_conf.tls_key_pem;
  }
  const char* fault = std::getenv("DDPRUN_SNAPSHOT_FAULT");
  auto parsed = snapshot::parseSnapshotFault(fault != nullptr ? fault : "");
  if (!parsed.isOk()) return usageError(parsed.status());
  o.fault = *parsed;
  const char* streams = std::getenv("DDPRUN_SNAPSHOT_STREAMS");
  auto n = snapshot::parseSnapshotStreams(streams != nullptr ? streams : "");
  if (!n.isOk()) return usageError(n.status());
  o.fetch_streams = *n;
  return o;
}

// The rendezvous client the supervisor talks to, and what wraps it on a multi-node job: the check
// that every round is one job's (two jobs that share an id hang otherwise), then, with
// --snapshot-dir, the replication of the directory (a round reaches the supervisor only once this
// node holds the newest snapshot). Members are destroyed outermost wrapper first.
struct RendezvousStack {
  RendezvousSetup setup;
  std::unique_ptr<JobIdentityClient> identity;
  std::unique_ptr<snapshot::Replicator> replicator;
  std::unique_ptr<SnapshotSyncClient> synced;

  RendezvousClient& client() const {
    if (synced) return *synced;
    if (identity) return *identity;
    return *setup.client;
  }
};

Status addSnapshotReplication(const AgentConfig& cfg, const NodeSetup& node,
                              boost::asio::io_context& io, RendezvousStack& stack) {
  DDPRUN_ASSIGN_OR_RETURN(auto opts, snapshotReplicatorOptions(cfg, node.local_addr));
  DDPRUN_ASSIGN_OR_RETURN(stack.replicator, snapshot::Replicator::start(io, std::move(opts)));
  if (cfg.rdzv_conf.token.empty()) {
    logger("agent")->warn(
        "snapshot replication without a token (--snapshot-allow-unauthenticated): anyone who can "
        "reach {} may plant or delete files in {}",
        stack.replicator->endpoint(), cfg.snapshot_dir);
  }
  stack.synced =
      std::make_unique<SnapshotSyncClient>(stack.client(), *stack.setup.service, *stack.replicator);
  return Status::ok();
}

StatusOr<std::unique_ptr<RendezvousStack>> makeRendezvousStack(
    const AgentConfig& cfg, const NodeSetup& node, boost::asio::io_context& io,
    MultiNodeRendezvous::EventSink sink) {
  auto stack = std::make_unique<RendezvousStack>();
  DDPRUN_ASSIGN_OR_RETURN(stack->setup,
                          makeRendezvous(node.choice, cfg.rdzv_conf, io, std::move(sink)));
  if (!stack->setup.service) return stack;  // one node: nothing to check or replicate
  stack->identity =
      std::make_unique<JobIdentityClient>(*stack->setup.client, *stack->setup.service, cfg.rdzv_id,
                                          node.local_addr, cfg.entrypoint, cfg.restart_in_place,
                                          /*snapshot_dir=*/!cfg.snapshot_dir.empty());
  if (!cfg.snapshot_dir.empty()) {
    DDPRUN_RETURN_IF_ERROR(addSnapshotReplication(cfg, node, io, *stack));
  }
  return stack;
}

SupervisorOptions supervisorOptions(const AgentConfig& cfg, const RendezvousChoice& choice) {
  SupervisorOptions options;
  options.max_restarts = cfg.max_restarts;
  options.shutdown_timeout = seconds(cfg.shutdown_timeout);
  options.heartbeat_timeout = seconds(cfg.heartbeat_timeout);
  options.exit_barrier_timeout = seconds(cfg.exit_barrier_timeout);
  options.failure_grace = choice.failure_grace;
  options.multi_node = choice.kind != RendezvousKind::kLocal;
  options.restart_in_place = cfg.restart_in_place;
  options.inplace_timeout = cfg.rdzv_conf.inplace_timeout;
  return options;
}

// The supervisor's control channel over the agent's Unix socket server.
class SocketControlChannel : public ControlChannel {
 public:
  explicit SocketControlChannel(UnixControlServer& server) : server_(server) {}
  bool send(int pid, const ControlMessage& message) override {
    return server_.send(pid, formatControlLine(message));
  }
  void drain(int pid) override { server_.drain(pid); }

 private:
  UnixControlServer& server_;
};

// One node's agent: every object it needs, built in order by build() before the loop runs, and the
// loop's handlers. Everything runs on the calling thread; the rendezvous' peer events, the
// workers' exits, signals and timers all arrive through `io_`, so no handler runs before build()
// has returned.
class AgentRun {
 public:
  static StatusOr<std::unique_ptr<AgentRun>> build(const AgentConfig& cfg, NodeSetup node);

  // Runs the job on this node to its end; the agent's exit code.
  int run();

 private:
  AgentRun(const AgentConfig& cfg, NodeSetup node);
  Status startMetrics();
  // --restart-mode=in-place: the workers' control channel.
  Status openControlChannel();
  void onControlLine(int pid, const std::string& line);
  void onPeerEvent(PeerEvent e);
  void onStateChange(AgentState s);
  void afterEvent();  // shut down when done, else arm the timer for the next deadline
  void watchSignals();
  void beginShutdown();
  void reportEnd();

  const AgentConfig& cfg_;
  const NodeSetup node_;
  std::shared_ptr<spdlog::logger> log_ = logger("agent");
  TorchProbe torch_probe_;  // a Python program's torch version, asked while the round forms
  boost::asio::io_context io_;
  PosixProcessLauncher launcher_{io_};
  std::unique_ptr<RendezvousStack> rendezvous_;
  SteadyClock clock_;
  WorkerPlanner planner_;
  StatHeartbeatProbe heartbeat_probe_;
  std::unique_ptr<UnixControlServer> control_server_;
  std::unique_ptr<SocketControlChannel> control_channel_;
  std::unique_ptr<Supervisor> supervisor_;
  LogThrottle bad_control_lines_{std::chrono::seconds(10)};
  boost::asio::steady_timer timer_{io_};           // the supervisor's next deadline
  boost::asio::steady_timer shutdown_guard_{io_};  // bounds the endgame
  boost::asio::signal_set handled_{io_};
  bool shutting_down_ = false;
  AgentMetrics counters_;
  std::unique_ptr<MetricsServer> metrics_;
};

AgentRun::AgentRun(const AgentConfig& cfg, NodeSetup node)
    : cfg_(cfg),
      node_(std::move(node)),
      torch_probe_(cfg.python_interpreter),
      planner_(cfg, node_.run_dir, node_.hostname, environmentMap()) {
  for (int sig : cfg.signals_to_handle) handled_.add(sig);
}

StatusOr<std::unique_ptr<AgentRun>> AgentRun::build(const AgentConfig& cfg, NodeSetup node) {
  std::unique_ptr<AgentRun> run(new AgentRun(cfg, std::move(node)));
  AgentRun& r = *run;
  DDPRUN_ASSIGN_OR_RETURN(
      r.rendezvous_,
      makeRendezvousStack(cfg, r.node_, r.io_, [&r](PeerEvent e) { r.onPeerEvent(e); }));
  if (cfg.restart_in_place) DDPRUN_RETURN_IF_ERROR(r.openControlChannel());
  r.supervisor_ = std::make_unique<Supervisor>(
      supervisorOptions(cfg, r.node_.choice), r.launcher_, r.rendezvous_->client(), r.clock_,
      [&r](const RoundInfo& round, int restarts) {
        const auto torch = r.torch_probe_.result(kTorchProbeBound);
        if (torch) r.log_->debug("the workers' torch is {}.{}", torch->major, torch->minor);
        r.planner_.setTorchVersion(torch);
        return prepareAttempt(r.planner_.plan(round, restarts));
      },
      &r.heartbeat_probe_, r.control_channel_.get());
  if (cfg.metrics_port >= 0) DDPRUN_RETURN_IF_ERROR(usageError(r.startMetrics()));
  if (r.rendezvous_->identity) {
    r.rendezvous_->identity->setVote([&r] { return r.supervisor_->inPlaceVote(); });
  }
  r.supervisor_->setStateListener([&r](AgentState s) { r.onStateChange(s); });
  r.supervisor_->setRecoveryListener(
      [&r](const InPlaceRecovery& recovery) { r.counters_.onInPlaceRecovery(recovery); });
  r.launcher_.watchExits(
      [&r](int pid, ExitStatus status) { r.supervisor_->onWorkerExit(pid, status); },
      [&r] { r.afterEvent(); });
  return run;
}

Status AgentRun::startMetrics() {
  std::string host = node_.local_addr;
  boost::system::error_code ec;
  boost::asio::ip::make_address(host, ec);
  if (ec) host = "0.0.0.0";  // a host name: listen everywhere
  DDPRUN_ASSIGN_OR_RETURN(
      metrics_, MetricsServer::start(
                    io_, host, cfg_.metrics_port,
                    [this] {
                      const auto* replicator = rendezvous_->replicator.get();
                      return renderMetrics(cfg_, *supervisor_, counters_, rendezvous_->client(),
                                           replicator ? &replicator->metrics() : nullptr);
                    },
                    [this] { return !supervisor_->finished() || supervisor_->exitCode() == 0; }));
  log_->info("metrics on http://{}/metrics", hostPort(host, metrics_->port()));
  return Status::ok();
}

Status AgentRun::openControlChannel() {
  UnixControlServer::Callbacks callbacks;
  callbacks.on_line = [this](int pid, const std::string& line) { onControlLine(pid, line); };
  callbacks.on_closed = [this](int pid, const std::string& why) {
    log_->debug("control channel of pid {} closed: {}", pid, why);
    supervisor_->onControlClosed(pid);
    afterEvent();
  };
  // Only this attempt's workers themselves (a worker's child is not one).
  callbacks.is_worker = [this](int pid) { return supervisor_->isRunningWorker(pid); };
  auto server = UnixControlServer::open(io_, UnixControlServerOptions{}, std::move(callbacks));
  if (!server.isOk()) {
    return server.status().withContext("--restart-mode=in-place: cannot open the control channel");
  }
  control_server_ = std::move(*server);
  control_channel_ = std::make_unique<SocketControlChannel>(*control_server_);
  planner_.setControlSocket(control_server_->path());
  log_->debug("control channel for in-place recovery on {}", control_server_->path());
  return Status::ok();
}

void AgentRun::onControlLine(int pid, const std::string& line) {
  auto message = parseControlLine(line);
  if (!message.isOk()) {
    if (auto n = bad_control_lines_.note("bad line", clock_.now())) {
      log_->warn("control channel: pid {} sent a bad line ({}); closing it ({} such line(s))", pid,
                 message.status().message(), *n);
    }
    control_server_->close(pid);
    supervisor_->onControlClosed(pid);
  } else {
    supervisor_->onControlMessage(pid, *message);
  }
  afterEvent();
}

void AgentRun::onPeerEvent(PeerEvent e) {
  // Workers that finished before the news (this node's agent stalled while they ran to the end,
  // and was declared dead meanwhile) end the job as they would have, not stopped for the change.
  launcher_.reapExited();
  if (supervisor_->finished()) return;
  if (e == PeerEvent::kPeerFailure) {
    supervisor_->onPeerFailure(FailureKind::kWorkers);
  } else if (e == PeerEvent::kPeerRecoveryFailed) {
    supervisor_->onPeerFailure(FailureKind::kRecovery);
  } else {
    supervisor_->onMembershipChange(/*declared_dead=*/e == PeerEvent::kNodeDeclaredDead);
  }
  afterEvent();
}

void AgentRun::onStateChange(AgentState s) {
  const AgentState previous = counters_.last;
  counters_.onState(s, supervisor_->restartCount(), clock_.wallSeconds());
  // Changes that come from a posted callback (a round that completed or failed, the barrier's
  // answer) must shut down or arm the timer (the first look at the heartbeat files) too.
  boost::asio::post(io_, [this] { afterEvent(); });
  if (s == AgentState::kRunning && previous != AgentState::kRecovering) {
    log_->info("started {} worker(s) (attempt {}, run id {})", cfg_.nproc_per_node,
               supervisor_->restartCount(), cfg_.rdzv_id);
  }
}

// After every event: shut down when done, otherwise re-arm the timer for the supervisor's next
// deadline (SIGKILL, a delayed failure report, a look at the heartbeat files, the barrier).
void AgentRun::afterEvent() {
  if (supervisor_->finished()) {
    beginShutdown();
    return;
  }
  timer_.cancel();
  if (auto deadline = supervisor_->nextDeadline()) {
    timer_.expires_at(*deadline);
    timer_.async_wait([this](const boost::system::error_code& ec) {
      if (ec) return;
      supervisor_->onDeadline();
      afterEvent();
    });
  }
}

void AgentRun::watchSignals() {
  handled_.async_wait([this](const boost::system::error_code& ec, int sig) {
    if (ec) return;
    log_->warn("received {}, forwarding it to the workers", signalName(sig));
    supervisor_->onSignal(sig);
    afterEvent();
    watchSignals();
  });
}

// The supervisor is done: tell the rendezvous (bounded: it may be gone), then stop the loop.
void AgentRun::beginShutdown() {
  if (shutting_down_) return;
  shutting_down_ = true;
  timer_.cancel();
  // The workers are gone: from here a signal simply ends ddprun (default dispositions).
  boost::system::error_code ignored;
  handled_.clear(ignored);
  shutdown_guard_.expires_after(kShutdownTimeout);
  shutdown_guard_.async_wait([this](const boost::system::error_code& ec) {
    if (ec) return;
    log_->warn("the rendezvous did not confirm the end of the run; exiting anyway");
    io_.stop();
  });
  rendezvous_->client().shutdown(supervisor_->state() == AgentState::kSucceeded,
                                 supervisor_->leftRun(), [this] { io_.stop(); });
}

int AgentRun::run() {
  watchSignals();
  boost::asio::post(io_, [this] {
    supervisor_->start();
    afterEvent();
  });
  io_.run();
  launcher_.drainAll();
  std::cout.flush();
  reportEnd();
  return supervisor_->exitCode();
}

// After the loop: the snapshot dir's leftovers, and why the job failed on this node.
void AgentRun::reportEnd() {
  if (!cfg_.snapshot_dir.empty()) {
    // A snapshot write killed mid-way (SIGXFSZ, SIGKILL) leaves its temp file; its bytes are not
    // kept until the next start.
    const auto removed = snapshot::removeDeadWritersTempFiles(cfg_.snapshot_dir);
    if (!removed.empty()) {
      log_->info("snapshot dir: removed {} temp file(s) that killed writers left (e.g. {})",
                 removed.size(), removed.front());
    }
  }
  if (supervisor_->state() != AgentState::kFailed) return;
  if (!supervisor_->failures().empty() && supervisor_->exitCode() == 1) {
    std::cerr << formatFailureReport(cfg_.entrypoint, node_.hostname, supervisor_->failures())
              << pythonInterpreterHint(cfg_.python_interpreter, cfg_.python_interpreter_source,
                                       supervisor_->failures());
  }
  // What ended the agent after the failures (a round that could not form) is said too.
  if (!supervisor_->errorMessage().empty()) log_->error("{}", supervisor_->errorMessage());
}

}  // namespace

int runAgent(const AgentConfig& cfg) {
  ::signal(SIGPIPE, SIG_IGN);
  auto run = [&]() -> StatusOr<std::unique_ptr<AgentRun>> {
    DDPRUN_ASSIGN_OR_RETURN(auto node, prepareNode(cfg));
    return AgentRun::build(cfg, std::move(node));
  }();
  if (!run.isOk()) {
    logger("agent")->error("{}", run.status().message());
    return exitCodeOf(run.status());
  }
  return (*run)->run();
}

}  // namespace ddprun::agent
