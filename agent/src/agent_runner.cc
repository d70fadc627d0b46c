#include "ddprun/agent/agent_runner.h"

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
#include "ddprun/common/log.h"
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

namespace ddprun::agent {
namespace {

// How long the endgame (departures, close) may hold an agent whose rendezvous is gone.
constexpr Duration kShutdownTimeout = std::chrono::seconds(30);
// How long the first launch waits for the Python workers' torch version (TorchProbe).
constexpr std::chrono::milliseconds kTorchProbeBound = std::chrono::seconds(3);

// <log_dir or a fresh temp dir>/<run_id>_XXXXXX: this run's log directory.
StatusOr<std::string> makeRunLogDir(const AgentConfig& cfg) {
  std::string base_dir = cfg.log_dir;
  if (base_dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    DDPRUN_ASSIGN_OR_RETURN(
        base_dir, makeTempDir(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "torchelastic_"));
  }
  auto run_dir = makeTempDir(base_dir, cfg.rdzv_id + "_");
  if (!run_dir.isOk())
    return Status(run_dir.status().code(), "--log-dir: " + run_dir.status().message());
  return run_dir;
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
  if (!parsed.isOk()) return parsed.status();
  o.fault = *parsed;
  const char* streams = std::getenv("DDPRUN_SNAPSHOT_STREAMS");
  auto n = snapshot::parseSnapshotStreams(streams != nullptr ? streams : "");
  if (!n.isOk()) return n.status();
  o.fetch_streams = *n;
  return o;
}

}  // namespace

int runAgent(const AgentConfig& cfg) {
  auto log = logger("agent");
  ::signal(SIGPIPE, SIG_IGN);
  const std::string hostname = fullyQualifiedHostname();
  const std::string local_addr = cfg.local_addr.empty() ? hostname : cfg.local_addr;

  auto choice = chooseRendezvous(cfg, local_addr, [&](const std::string& host) {
    return isThisHost(host, local_addr, hostname);
  });
  if (!choice.isOk()) {
    log->error("{}", choice.status().message());
    return 2;
  }
  if (!cfg.snapshot_dir.empty()) {
    Status st = snapshot::checkSnapshotDir(cfg.snapshot_dir);
    if (!st.isOk()) {
      log->error("{}", st.message());
      return 2;
    }
  }
  auto run_dir = makeRunLogDir(cfg);
  if (!run_dir.isOk()) {
    log->error("{}", run_dir.status().message());
    return 1;
  }
  log->info("log directory set to: {}", *run_dir);

  // Before gRPC's threads exist (see the function).
  if (!cfg.snapshot_dir.empty()) {
    snapshot::tuneAllocatorForTransfers();
    log->debug("snapshot dir: up to {} open files", snapshot::raiseOpenFileLimit());
  }
  // A Python program's torch version, asked while the rendezvous forms.
  TorchProbe torch_probe(cfg.python_interpreter);
  boost::asio::io_context io;
  PosixProcessLauncher launcher(io);
  Supervisor* supervisor_ptr = nullptr;
  std::function<void()> after_event;  // set below; pushed events reach it on this thread
  auto rendezvous_or = makeRendezvous(*choice, cfg.rdzv_conf, io, [&](PeerEvent e) {
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
  // A multi-node job's rounds are checked to be one job's (two jobs that share an id hang
  // otherwise), before anything is replicated between their nodes.
  std::unique_ptr<JobIdentityClient> identity_client;
  RendezvousClient* joined = rendezvous_or->client.get();
  if (rendezvous_or->service) {
    identity_client = std::make_unique<JobIdentityClient>(
        *rendezvous_or->client, *rendezvous_or->service, cfg.rdzv_id,
        encodeJobIdentity(local_addr, cfg.entrypoint));
    joined = identity_client.get();
  }
  // --snapshot-dir on a multi-node job: the directory is replicated between the agents, and
  // every round reaches the supervisor only once this node holds the newest snapshot.
  std::unique_ptr<snapshot::Replicator> replicator;
  std::unique_ptr<SnapshotSyncClient> synced_client;
  if (!cfg.snapshot_dir.empty() && rendezvous_or->service) {
    auto opts = snapshotReplicatorOptions(cfg, local_addr);
    if (!opts.isOk()) {
      log->error("{}", opts.status().message());
      return 2;
    }
    auto started = snapshot::Replicator::start(io, std::move(opts).value());
    if (!started.isOk()) {
      log->error("{}", started.status().message());
      return started.status().code() == StatusCode::kInvalidArgument ? 2 : 1;
    }
    replicator = std::move(started).value();
    if (cfg.rdzv_conf.token.empty()) {
      log->warn(
          "snapshot replication without a token (--snapshot-allow-unauthenticated): anyone who "
          "can reach {} may plant or delete files in {}",
          replicator->endpoint(), cfg.snapshot_dir);
    }
    synced_client =
        std::make_unique<SnapshotSyncClient>(*joined, *rendezvous_or->service, *replicator);
  }
  RendezvousClient& rendezvous = synced_client ? *synced_client : *joined;

  SteadyClock clock;
  WorkerPlanner planner(cfg, *run_dir, hostname, environmentMap());
  SupervisorOptions options;
  options.max_restarts = cfg.max_restarts;
  options.shutdown_timeout = seconds(cfg.shutdown_timeout);
  options.heartbeat_timeout = seconds(cfg.heartbeat_timeout);
  options.exit_barrier_timeout = seconds(cfg.exit_barrier_timeout);
  options.failure_grace = choice->failure_grace;
  options.multi_node = choice->kind != RendezvousKind::kLocal;
  StatHeartbeatProbe heartbeat_probe;
  Supervisor supervisor(
      options, launcher, rendezvous, clock,
      [&planner, &torch_probe, &log](const RoundInfo& r, int restarts) {
        const auto torch = torch_probe.result(kTorchProbeBound);
        if (torch) log->debug("the workers' torch is {}.{}", torch->major, torch->minor);
        planner.setTorchVersion(torch);
        return prepareAttempt(planner.plan(r, restarts));
      },
      &heartbeat_probe);
  supervisor_ptr = &supervisor;

  boost::asio::steady_timer timer(io);
  boost::asio::steady_timer shutdown_guard(io);
  boost::asio::signal_set handled(io);
  for (int sig : cfg.signals_to_handle) handled.add(sig);
  bool shutting_down = false;

  // The supervisor is done: tell the rendezvous (bounded: it may be gone), then stop the loop.
  auto beginShutdown = [&] {
    if (shutting_down) return;
    shutting_down = true;
    timer.cancel();
    // The workers are gone: from here a signal simply ends ddprun (default dispositions).
    boost::system::error_code ignored;
    handled.clear(ignored);
    shutdown_guard.expires_after(kShutdownTimeout);
    shutdown_guard.async_wait([&](const boost::system::error_code& ec) {
      if (ec) return;
      log->warn("the rendezvous did not confirm the end of the run; exiting anyway");
      io.stop();
    });
    rendezvous.shutdown(supervisor.state() == AgentState::kSucceeded, supervisor.leftRun(),
                        [&] { io.stop(); });
  };

  // After every event: shut down when done, otherwise re-arm the timer for the supervisor's next
  // deadline (SIGKILL, a delayed failure report, a look at the heartbeat files, the barrier).
  std::function<void()> afterEvent = [&] {
    if (supervisor.finished()) {
      beginShutdown();
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
  after_event = afterEvent;

  std::function<void()> watchSignals = [&] {
    handled.async_wait([&](const boost::system::error_code& ec, int sig) {
      if (ec) return;
      log->warn("received {}, forwarding it to the workers", signalName(sig));
      supervisor.onSignal(sig);
      afterEvent();
      watchSignals();
    });
  };

  std::unique_ptr<MetricsServer> metrics;
  AgentMetrics counters;
  if (cfg.metrics_port >= 0) {
    std::string host = local_addr;
    boost::system::error_code ec;
    boost::asio::ip::make_address(host, ec);
    if (ec) host = "0.0.0.0";  // a host name: listen everywhere
    auto server = MetricsServer::start(
        io, host, cfg.metrics_port,
        [&] {
          return renderMetrics(cfg, supervisor, counters, rendezvous,
                               replicator ? &replicator->metrics() : nullptr);
        },
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
    // Changes that come from a posted callback (a round that completed or failed, the barrier's
    // answer) must shut down or arm the timer (the first look at the heartbeat files) too.
    boost::asio::post(io, [&] { afterEvent(); });
    if (s == AgentState::kRunning) {
      log->info("started {} worker(s) (attempt {}, run id {})", cfg.nproc_per_node,
                supervisor.restartCount(), cfg.rdzv_id);
    }
  });

  launcher.watchExits([&](int pid, ExitStatus status) { supervisor.onWorkerExit(pid, status); },
                      afterEvent);
  watchSignals();
  boost::asio::post(io, [&] {
    supervisor.start();
    afterEvent();
  });
  io.run();

  launcher.drainAll();
  std::cout.flush();
  if (!cfg.snapshot_dir.empty()) {
    // A snapshot write killed mid-way (SIGXFSZ, SIGKILL) leaves its temp file; its bytes are not
    // kept until the next start.
    const auto removed = snapshot::removeDeadWritersTempFiles(cfg.snapshot_dir);
    if (!removed.empty()) {
      log->info("snapshot dir: removed {} temp file(s) that killed writers left (e.g. {})",
                removed.size(), removed.front());
    }
  }
  if (supervisor.state() == AgentState::kFailed) {
    if (!supervisor.failures().empty() && supervisor.exitCode() == 1) {
      std::cerr << formatFailureReport(cfg.entrypoint, hostname, supervisor.failures())
                << pythonInterpreterHint(cfg.python_interpreter, cfg.python_interpreter_source,
                                         supervisor.failures());
    }
    // What ended the agent after the failures (a round that could not form) is said too.
    if (!supervisor.errorMessage().empty()) log->error("{}", supervisor.errorMessage());
  }
  return supervisor.exitCode();
}

}  // namespace ddprun::agent
