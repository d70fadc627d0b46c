#include "ddprun/agent/supervisor.h"

#include <csignal>

#include "ddprun/common/log.h"

namespace ddprun::agent {

const char* agentStateName(AgentState s) {
  switch (s) {
    case AgentState::kInit:
      return "INIT";
    case AgentState::kRendezvous:
      return "RENDEZVOUS";
    case AgentState::kRunning:
      return "RUNNING";
    case AgentState::kStopping:
      return "STOPPING";
    case AgentState::kRestarting:
      return "RESTARTING";
    case AgentState::kExitBarrier:
      return "EXIT_BARRIER";
    case AgentState::kSucceeded:
      return "SUCCEEDED";
    case AgentState::kFailed:
      return "FAILED";
  }
  return "?";
}

namespace {
bool isTerminating(int sig) {
  return sig == SIGTERM || sig == SIGINT || sig == SIGHUP || sig == SIGQUIT;
}
}  // namespace

Supervisor::Supervisor(SupervisorOptions options, ProcessLauncher& launcher,
                       RendezvousClient& rendezvous, Clock& clock, Planner planner,
                       HeartbeatProbe* heartbeats)
    : options_(options),
      launcher_(launcher),
      rendezvous_(rendezvous),
      clock_(clock),
      planner_(std::move(planner)),
      heartbeats_(heartbeats) {}

void Supervisor::setState(AgentState s) {
  if (s == state_) return;
  logger("agent")->debug("state {} -> {}", agentStateName(state_), agentStateName(s));
  state_ = s;
  if (listener_) listener_(s);
}

int Supervisor::runningWorkers() const {
  int n = 0;
  for (const auto& w : workers_) n += w.running ? 1 : 0;
  return n;
}

int Supervisor::worldSize() const {
  int n = 0;
  for (int s : round_.local_world_sizes) n += s;
  return n;
}

void Supervisor::start() {
  loop_.check();
  DDPRUN_CHECK(state_ == AgentState::kInit, "start() called twice");
  joinRound();
}

void Supervisor::joinRound() {
  setState(AgentState::kRendezvous);
  const unsigned generation = ++generation_;
  rendezvous_.nextRound([this, generation](StatusOr<RoundInfo> round) {
    if (generation != generation_ || state_ != AgentState::kRendezvous) return;
    onRound(std::move(round));
  });
}

void Supervisor::onRound(StatusOr<RoundInfo> round) {
  if (!round.isOk()) {
    error_message_ = "rendezvous failed: " + round.status().toString();
    finish(AgentState::kFailed, 1);
    return;
  }
  // A membership change that came while the round was on its way (the job-identity check and the
  // snapshot sync take round trips) reached no workers: the round is already superseded.
  if (isSuperseded(rendezvous_, *round)) {
    logger("agent")->info(
        "round {} was superseded before its workers started (round {} is forming); joining it",
        round->round, rendezvous_.formingRound());
    joinRound();
    return;
  }
  auto launches = planner_(*round, restart_count_);
  if (!launches.isOk()) {
    error_message_ = "cannot prepare workers: " + launches.status().message();
    finish(AgentState::kFailed, 1);
    return;
  }
  round_ = *round;
  signal_forwarded_ = false;
  workers_.clear();
  failures_.clear();
  stop_reason_ = StopReason::kNone;
  setState(AgentState::kRunning);
  for (auto& launch : *launches) {
    Worker w;
    w.launch = std::move(launch);
    auto pid = launcher_.spawn(w.launch);
    if (pid.isOk()) {
      w.pid = *pid;
      w.running = true;
      workers_.push_back(std::move(w));
      continue;
    }
    // A worker that cannot start fails the attempt like one that exits at once.
    logger("agent")->error("local rank {}: {}", w.launch.local_rank, pid.status().message());
    failures_.push_back(WorkerFailure{w.launch.local_rank, w.launch.global_rank, /*pid=*/0,
                                      ExitStatus{false, 127}, clock_.wallSeconds(),
                                      w.launch.error_file, /*hang=*/""});
    workers_.push_back(std::move(w));
  }
  if (!failures_.empty()) {
    beginStop(StopReason::kFailure, SIGTERM);
    reportLocalFailure();
    maybeFinishStop();
    return;
  }
  if (heartbeatsEnabled()) {
    deadlines_.heartbeat_check = clock_.now() + heartbeatCheckInterval(options_.heartbeat_timeout);
  }
}

void Supervisor::enterExitBarrier() {
  deadlines_.heartbeat_check.reset();
  setState(AgentState::kExitBarrier);
  deadlines_.barrier = clock_.now() + options_.exit_barrier_timeout;
  const unsigned generation = ++generation_;
  rendezvous_.exitBarrier(options_.exit_barrier_timeout, [this, generation](Status status) {
    if (generation != generation_ || state_ != AgentState::kExitBarrier) return;
    onExitBarrier(status);
  });
}

void Supervisor::onExitBarrier(const Status& status) {
  if (!status.isOk()) {
    logger("agent")->warn("exit barrier: not every node finished ({}); exiting anyway",
                          status.toString());
  }
  finish(AgentState::kSucceeded, 0);
}

bool Supervisor::failedOnItsOwn(const Worker& worker, ExitStatus status) const {
  if (status.success()) return false;
  // It wrote an error file: it failed (a worker that merely obeys the stop does not).
  if (heartbeats_ != nullptr && !worker.launch.error_file.empty() &&
      heartbeats_->modificationTime(worker.launch.error_file).has_value()) {
    return true;
  }
  // Ended by the stop itself (SIGTERM, or SIGKILL after the timeout; or exiting 128+that signal
  // from a handler) is no failure of its own.
  for (int sig : {stop_signal_, SIGKILL}) {
    if (status.signaled ? status.code == sig : status.code == 128 + sig) return false;
  }
  return true;
}

bool Supervisor::stoppedForPeer(const Worker& worker) const {
  return options_.multi_node && !signal_forwarded_ && heartbeats_ != nullptr &&
         !worker.launch.stop_file.empty() &&
         heartbeats_->modificationTime(worker.launch.stop_file).has_value();
}

bool Supervisor::heartbeatsEnabled() const {
  return heartbeats_ != nullptr && options_.heartbeat_timeout > Duration::zero();
}

void Supervisor::recordFailure(const WorkerFailure& failure) {
  failures_.push_back(failure);
  if (!failure.hang.empty()) {
    logger("agent")->warn("{} (rank {}, local_rank {}, pid {})", failure.hang, failure.global_rank,
                          failure.local_rank, failure.pid);
    return;
  }
  logger("agent")->warn("worker local_rank {} (pid {}) {} {}", failure.local_rank, failure.pid,
                        failure.exit.signaled ? "killed by signal" : "exited with code",
                        failure.exit.code);
}

void Supervisor::stopForLocalFailure() {
  beginStop(StopReason::kFailure, SIGTERM);
  if (options_.failure_grace > Duration::zero()) {
    deadlines_.report = clock_.now() + options_.failure_grace;
  } else {
    reportLocalFailure();
  }
  maybeFinishStop();
}

void Supervisor::checkHeartbeats() {
  const TimePoint now = clock_.now();
  deadlines_.heartbeat_check = now + heartbeatCheckInterval(options_.heartbeat_timeout);
  bool any_hung = false;
  for (auto& w : workers_) {
    if (!w.running || w.launch.heartbeat_file.empty()) continue;
    w.heartbeat.observe(heartbeats_->modificationTime(w.launch.heartbeat_file), now);
    if (!w.heartbeat.hung(now, options_.heartbeat_timeout)) continue;
    // Its exit status is filled in once it ended. A hung process may not act on SIGTERM at all
    // (one stopped with SIGSTOP cannot): it gets SIGKILL now, as torchrun's timer kills a hung
    // worker, instead of after the whole shutdown timeout. The others get SIGTERM as usual.
    recordFailure(WorkerFailure{
        w.launch.local_rank, w.launch.global_rank, w.pid, ExitStatus{}, clock_.wallSeconds(),
        w.launch.error_file, hangMessage(w.heartbeat.silentFor(now), options_.heartbeat_timeout)});
    logger("agent")->warn("local rank {} (pid {}) is hung: sending SIGKILL", w.launch.local_rank,
                          w.pid);
    kill(w);
    any_hung = true;
  }
  if (any_hung) stopForLocalFailure();
}

void Supervisor::onWorkerExit(int pid, ExitStatus status) {
  loop_.check();
  Worker* worker = nullptr;
  for (auto& w : workers_) {
    if (w.pid == pid && w.running) worker = &w;
  }
  if (worker == nullptr) return;  // not ours (or a previous attempt's straggler)
  worker->running = false;

  if (state_ == AgentState::kRunning) {
    if (!status.success()) {
      recordFailure(WorkerFailure{worker->launch.local_rank, worker->launch.global_rank, pid,
                                  status, clock_.wallSeconds(), worker->launch.error_file,
                                  /*hang=*/""});
      stopForLocalFailure();
      return;
    }
    if (stoppedForPeer(*worker)) {
      logger("agent")->warn(
          "local rank {} stopped because a rank on another node was asked to checkpoint, not "
          "because training finished; re-forming with the other nodes",
          worker->launch.local_rank);
      beginStop(StopReason::kMembership, SIGTERM);
      return;
    }
    if (runningWorkers() == 0) enterExitBarrier();
    return;
  }
  bool known = false;
  for (auto& f : failures_) {
    if (f.pid != pid) continue;
    known = true;
    if (!f.hang.empty()) f.exit = status;  // stopped for hanging: the report shows how it ended
  }
  // (Only when this node's failure caused the stop: after a peer's, local exits are its echo.)
  if (!known && state_ == AgentState::kStopping && stop_reason_ == StopReason::kFailure &&
      !failures_.empty() && failedOnItsOwn(*worker, status)) {
    // It had failed too by the time the group was stopped: the report lists it after the root
    // cause (SPEC §4), which stays the earliest failure.
    recordFailure(WorkerFailure{worker->launch.local_rank, worker->launch.global_rank, pid, status,
                                clock_.wallSeconds(), worker->launch.error_file, /*hang=*/""});
  }
  if (state_ == AgentState::kStopping) maybeFinishStop();
}

void Supervisor::beginStop(StopReason reason, int sig) {
  deadlines_.heartbeat_check.reset();
  stop_reason_ = reason;
  stop_signal_ = sig;
  setState(AgentState::kStopping);
  for (auto& w : workers_) {
    if (w.running) launcher_.signalGroup(w.pid, sig);
  }
  deadlines_.kill = clock_.now() + options_.shutdown_timeout;
  if (reason != StopReason::kFailure) maybeFinishStop();
}

void Supervisor::reportLocalFailure() {
  deadlines_.report.reset();
  rendezvous_.reportFailure();
}

void Supervisor::kill(Worker& w) {
  launcher_.signalGroup(w.pid, SIGKILL);
  if (!w.killed_at) w.killed_at = clock_.now();
}

void Supervisor::giveUpUnreaped() {
  const TimePoint now = clock_.now();
  for (auto& w : workers_) {
    if (!w.running || !w.killed_at || now < *w.killed_at + options_.reap_timeout) continue;
    logger("agent")->error(
        "local rank {} (pid {}) was not reaped {:.0f} s after SIGKILL (its guardian process does "
        "not answer: stopped?); killing the guardian and no longer waiting for the worker",
        w.launch.local_rank, w.pid, std::chrono::duration<double>(options_.reap_timeout).count());
    launcher_.forceEnd(w.pid);
    w.running = false;
    for (auto& f : failures_) {
      if (f.pid == w.pid && !f.hang.empty()) f.exit = ExitStatus{true, SIGKILL};
    }
  }
}

std::optional<TimePoint> Supervisor::nextDeadline() const {
  std::optional<TimePoint> next;
  for (const auto& d :
       {deadlines_.kill, deadlines_.report, deadlines_.heartbeat_check, deadlines_.barrier}) {
    if (d && (!next || *d < *next)) next = d;
  }
  for (const auto& w : workers_) {
    if (!w.running || !w.killed_at) continue;
    const TimePoint reap = *w.killed_at + options_.reap_timeout;
    if (!next || reap < *next) next = reap;
  }
  return next;
}

void Supervisor::maybeFinishStop() {
  if (runningWorkers() > 0 || deadlines_.report) return;
  deadlines_.kill.reset();
  switch (stop_reason_) {
    case StopReason::kSignal:
      finish(AgentState::kFailed, 128 + stop_signal_);
      return;
    case StopReason::kMembership:
      setState(AgentState::kRestarting);
      joinRound();
      return;
    case StopReason::kFailure:
      if (restart_count_ < options_.max_restarts) {
        ++restart_count_;
        logger("agent")->warn("restarting workers ({} of {} restarts used)", restart_count_,
                              options_.max_restarts);
        setState(AgentState::kRestarting);
        joinRound();
      } else {
        if (failures_.empty()) {
          error_message_ =
              "workers on another node failed and the restart budget (--max-restarts=" +
              std::to_string(options_.max_restarts) + ") is spent";
        }
        finish(AgentState::kFailed, 1);
      }
      return;
    case StopReason::kNone:
      break;
  }
  DDPRUN_CHECK(false, "stop finished without a reason");
}

void Supervisor::onSignal(int sig) {
  loop_.check();
  if (finished()) return;
  if (state_ == AgentState::kExitBarrier) {
    // No worker left to signal; a terminating signal ends the wait (and leaves the run).
    if (!isTerminating(sig)) return;
    ++generation_;
    rendezvous_.leave();
    stop_reason_ = StopReason::kSignal;
    stop_signal_ = sig;
    finish(AgentState::kFailed, 128 + sig);
    return;
  }
  if (!isTerminating(sig)) {
    signal_forwarded_ = true;
    for (auto& w : workers_) {
      if (w.running) launcher_.signalGroup(w.pid, sig);
    }
    return;
  }
  if (state_ == AgentState::kStopping && stop_reason_ == StopReason::kSignal) {
    // A second signal: pass it on too, the deadline stays.
    for (auto& w : workers_) {
      if (w.running) launcher_.signalGroup(w.pid, sig);
    }
    return;
  }
  deadlines_.report.reset();  // leaving: a failure seen just before is not the others' business
  rendezvous_.leave();
  ++generation_;  // a pending join's answer no longer matters
  beginStop(StopReason::kSignal, sig);
}

void Supervisor::onMembershipChange() {
  loop_.check();
  if (state_ == AgentState::kStopping && stop_reason_ == StopReason::kFailure &&
      deadlines_.report) {
    // The local failure was the peer going away: not charged, not reported.
    logger("agent")->info(
        "the worker failure followed a membership change; not charging a "
        "restart");
    deadlines_.report.reset();
    failures_.clear();
    stop_reason_ = StopReason::kMembership;
    maybeFinishStop();
    return;
  }
  if (state_ != AgentState::kRunning) return;
  beginStop(StopReason::kMembership, SIGTERM);
  maybeFinishStop();
}

void Supervisor::onPeerFailure() {
  loop_.check();
  if (state_ != AgentState::kRunning) return;  // already stopping: charged once
  logger("agent")->warn("workers on another node failed; restarting this node's workers too");
  failures_.clear();
  beginStop(StopReason::kFailure, SIGTERM);
  maybeFinishStop();
}

void Supervisor::onDeadline() {
  loop_.check();
  if (state_ == AgentState::kExitBarrier && deadlines_.barrier &&
      clock_.now() >= *deadlines_.barrier) {
    ++generation_;  // the rendezvous' late answer no longer matters
    onExitBarrier(
        deadlineExceeded("the other nodes did not finish within the exit barrier "
                         "timeout"));
    return;
  }
  if (state_ == AgentState::kRunning && deadlines_.heartbeat_check &&
      clock_.now() >= *deadlines_.heartbeat_check) {
    checkHeartbeats();
    if (finished()) return;
  }
  if (deadlines_.report && clock_.now() >= *deadlines_.report) {
    reportLocalFailure();
    maybeFinishStop();
    if (finished() || state_ != AgentState::kStopping) return;
  }
  if (deadlines_.kill && clock_.now() >= *deadlines_.kill) {
    deadlines_.kill.reset();
    for (auto& w : workers_) {
      if (w.running) {
        logger("agent")->warn(
            "local rank {} (pid {}) did not stop within the shutdown timeout; "
            "sending SIGKILL",
            w.launch.local_rank, w.pid);
        kill(w);
      }
    }
  }
  if (state_ == AgentState::kStopping) {
    giveUpUnreaped();
    maybeFinishStop();
  }
}

void Supervisor::finish(AgentState s, int exit_code) {
  exit_code_ = exit_code;
  deadlines_.kill.reset();
  deadlines_.report.reset();
  deadlines_.heartbeat_check.reset();
  deadlines_.barrier.reset();
  setState(s);
}

}  // namespace ddprun::agent
