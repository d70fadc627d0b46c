#include "ddprun/agent/supervisor.h"

#include <algorithm>
#include <csignal>
#include <utility>

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
    case AgentState::kRecovering:
      return "RECOVERING";
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

double millis(Duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// "local rank 1 (pid 812)": how the logs name a worker.
std::string workerName(int local_rank, int pid) {
  return "local rank " + std::to_string(local_rank) + " (pid " + std::to_string(pid) + ")";
}
bool isTerminating(int sig) {
  return sig == SIGTERM || sig == SIGINT || sig == SIGHUP || sig == SIGQUIT;
}

// How long workers get to end after SIGTERM when an in-place recovery falls back.
constexpr Duration kFallbackGrace = std::chrono::seconds(2);
// Rounds an in-place recovery forms again because nodes kept changing, before it falls back.
constexpr int kMaxRegenerations = 3;

std::string describeExit(ExitStatus status) {
  return (status.signaled ? "was killed by signal " : "exited with code ") +
         std::to_string(status.code);
}
}  // namespace

Supervisor::Supervisor(SupervisorOptions options, ProcessLauncher& launcher,
                       RendezvousClient& rendezvous, Clock& clock, Planner planner,
                       HeartbeatProbe* heartbeats, ControlChannel* control)
    : options_(options),
      launcher_(launcher),
      rendezvous_(rendezvous),
      clock_(clock),
      planner_(std::move(planner)),
      heartbeats_(heartbeats),
      control_(control) {}

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
  if (!round.isOk() && rejoined_after_success_) {
    // Its workers had all succeeded: as the exit barrier, a round that does not form ends it with
    // success. (A closed run: it saw the mark before it heard that its writer was declared dead,
    // while the others, who had heard it, ended the job.)
    if (rendezvous::isRunClosed(round.status())) {
      logger("agent")->info(
          "the run was closed before the new round formed: the other nodes ended the job, and "
          "this node's workers had all succeeded");
    } else {
      logger("agent")->warn(
          "exit barrier: the round this node re-joined did not form ({}); exiting anyway, its "
          "workers had all succeeded",
          round.status().toString());
    }
    finish(AgentState::kSucceeded, 0);
    return;
  }
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
  rejoined_after_success_ = false;  // its workers start: what they do decides from now on
  deadlines_.barrier.reset();
  auto launches = planner_(*round, restart_count_);
  if (!launches.isOk()) {
    error_message_ = "cannot prepare workers: " + launches.status().message();
    finish(AgentState::kFailed, 1);
    return;
  }
  round_ = *round;
  // (This node's own veto, for a worker that failed unannounced, was said already. A soft veto
  // leaves this round's failures to the next round's votes, which a recovery's fallback names.)
  if (options_.restart_in_place && !round_.in_place_veto.empty() && !round_.in_place_veto_own &&
      !round_.in_place_veto_soft) {
    notInPlace(NotInPlace::kVeto, round_.in_place_veto);
  }
  group_generation_ = generationOf(round_);
  episode_.reset();
  hang_seen_.reset();
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
  deadlines_.membership.reset();
  hang_seen_.reset();
  setState(AgentState::kExitBarrier);
  deadlines_.barrier = clock_.now() + options_.exit_barrier_timeout;
  const unsigned generation = ++generation_;
  rendezvous_.exitBarrier(options_.exit_barrier_timeout, [this, generation](Status status) {
    if (generation != generation_ || state_ != AgentState::kExitBarrier) return;
    onExitBarrier(status);
  });
}

void Supervisor::onExitBarrier(const Status& status) {
  if (isRoundAbandoned(status)) {
    // The job ends only when one round's workers all finish: this node's start again with the
    // others' in that round (not charged: no worker of this node failed).
    logger("agent")->warn("exit barrier: {}; joining it, this node's workers start again",
                          status.message());
    // (The barrier's deadline stays: the round must form before it.)
    setState(AgentState::kRestarting);
    rejoined_after_success_ = true;
    joinRound();
    return;
  }
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

bool Supervisor::allAbortedOnTheirOwn() const {
  bool any = false;
  for (const auto& w : workers_) {
    if (!w.running) continue;
    if (w.aborted_gen != group_generation_) return false;
    any = true;
  }
  return any;
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
  std::vector<Worker*> hung;
  for (auto& w : workers_) {
    if (!w.running || w.launch.heartbeat_file.empty()) continue;
    w.heartbeat.observe(heartbeats_->modificationTime(w.launch.heartbeat_file), now);
    if (w.heartbeat.hung(now, options_.heartbeat_timeout)) hung.push_back(&w);
  }
  if (hung.empty()) {
    hang_seen_.reset();
    return;
  }
  if (recoverHungInPlace(hung, now)) return;
  for (Worker* w : hung) {
    // Its exit status is filled in once it ended. A hung process may not act on SIGTERM at all
    // (one stopped with SIGSTOP cannot): it gets SIGKILL now, as torchrun's timer kills a hung
    // worker, instead of after the whole shutdown timeout. The others get SIGTERM as usual.
    recordHang(*w, now);
    logger("agent")->warn("local rank {} (pid {}) is hung: sending SIGKILL", w->launch.local_rank,
                          w->pid);
    kill(*w);
  }
  stopForLocalFailure();
}

void Supervisor::checkHungInEpisode() {
  const TimePoint now = clock_.now();
  deadlines_.heartbeat_check = now + heartbeatCheckInterval(options_.heartbeat_timeout);
  for (size_t i = 0; i < workers_.size(); ++i) {
    // The others' files stall while the group re-forms: only a survivor that never said `aborted`
    // is looked at. It was not waiting for its peers when the episode began (or it was stopped by
    // a signal): it hangs too, a step later than the failure, and the group would wait for it
    // until inplace_timeout. It is replaced in this episode.
    auto unaware = [this, i] {
      const Worker& w = workers_[i];
      return w.running && !w.newcomer && !w.heard_abort && !w.launch.heartbeat_file.empty();
    };
    if (!unaware()) continue;
    Worker* w = &workers_[i];
    w->heartbeat.observe(heartbeats_->modificationTime(w->launch.heartbeat_file), now);
    if (!w->heartbeat.hung(now, options_.heartbeat_timeout)) continue;
    const bool stopped = heartbeats_->stopped(w->pid);
    if (!stopped && !saysNotWaiting(*w, now, options_.heartbeat_timeout)) continue;
    // What it said and was not read yet comes first: an `aborted` there means it heard.
    const int pid = w->pid;
    control_->drain(pid);
    if (state_ != AgentState::kRecovering || !episode_) return;
    if (workers_[i].pid != pid || !unaware()) continue;
    w = &workers_[i];
    recordHang(*w, now);
    const std::string what = workerName(w->launch.local_rank, pid) + ", " +
                             (stopped ? "stopped by a signal" : "hung in its own code") + ": " +
                             failures_.back().hang;
    logger("agent")->warn(
        "local rank {} (pid {}) is hung during the recovery and never heard of it: sending SIGKILL",
        w->launch.local_rank, pid);
    kill(*w);
    // A crash: replaced in this episode (charged if the episode was free), else the fallback of
    // a failure, which counts the killed one among the workers to stop.
    if (!replaceInEpisode(*w, what, ExitStatus{true, SIGKILL})) {
      fallBack(what + " during the recovery", /*report=*/true, FallbackCause::kFailure);
    }
    if (state_ != AgentState::kRecovering) return;
    // Its exit, whenever it is reaped, ends nothing more; across nodes its replacement starts
    // with the round.
    if (workers_[i].pid == pid) workers_[i].running = false;
  }
}

void Supervisor::recordHang(const Worker& w, TimePoint now, const std::string& note) {
  recordFailure(
      WorkerFailure{w.launch.local_rank, w.launch.global_rank, w.pid, ExitStatus{},
                    clock_.wallSeconds(), w.launch.error_file,
                    hangMessage(w.heartbeat.silentFor(now), options_.heartbeat_timeout) + note});
}

bool Supervisor::saysNotWaiting(Worker& w, TimePoint now, Duration silent_for) {
  if (heartbeats_->mark(w.launch.heartbeat_file) != HeartbeatMark::kNotWaiting) return false;
  w.heartbeat.observe(heartbeats_->modificationTime(w.launch.heartbeat_file), now);
  return w.heartbeat.silentFor(now) > silent_for;
}

bool Supervisor::recoverHungInPlace(const std::vector<Worker*>& hung, TimePoint now) {
  if (!options_.restart_in_place || control_ == nullptr) return false;
  // A rank that hangs stalls every rank's collective, so the others' heartbeats go stale with its
  // own: it alone is the failure. The culprits are the hung workers stopped by a signal, and
  // those whose heartbeat file says they do not wait for their peers (a Trainer says so at each
  // touch, and marks its long waits). Each is killed and replaced in one episode; the others keep
  // their processes. None: no culprit here.
  struct Culprit {
    Worker* w;
    int pid;
    bool stopped;  // by a signal; else its file says it does not wait
    bool hung;     // else it would be at the next look
    std::string cause;
  };
  std::vector<Culprit> culprits;
  // Ranks that hang at one step touched their files moments apart, which the agent may see one
  // look apart: one not waiting that would be hung at the next look is a culprit too.
  const Duration next_look =
      options_.heartbeat_timeout - heartbeatCheckInterval(options_.heartbeat_timeout);
  bool any_hung = false;
  for (auto& w : workers_) {
    if (!w.running || w.launch.heartbeat_file.empty()) continue;
    const bool is_hung = std::find(hung.begin(), hung.end(), &w) != hung.end();
    const bool stopped = is_hung && heartbeats_->stopped(w.pid);
    const bool not_waiting =
        !stopped && (is_hung || w.heartbeat.silentFor(now) > next_look) &&
        saysNotWaiting(w, now, is_hung ? options_.heartbeat_timeout : next_look);
    if (!stopped && !not_waiting) continue;
    culprits.push_back({&w, w.pid, stopped, is_hung, ""});
    any_hung = any_hung || is_hung;
  }
  if (!any_hung) culprits.clear();
  // On one node with every worker a culprit, no survivor would keep anything: the usual path.
  if (!options_.multi_node && !culprits.empty() &&
      static_cast<int>(culprits.size()) == runningWorkers()) {
    return false;
  }
  if (culprits.empty()) {
    // Across nodes the hung rank may be another node's: its agent's report starts an in-place
    // recovery here too. Give it failure_grace and one more look before stopping everything.
    if (!options_.multi_node || !inPlaceEligible(nullptr, /*charged=*/true)) return false;
    if (!hang_seen_) hang_seen_ = now;
    return now < *hang_seen_ + options_.failure_grace +
                     heartbeatCheckInterval(options_.heartbeat_timeout);
  }
  if (!inPlaceEligible(culprits.front().w, /*charged=*/true)) return false;
  hang_seen_.reset();
  for (Culprit& c : culprits) {
    const std::string how = c.stopped ? "stopped by a signal" : "hung while its peers wait for it";
    recordHang(*c.w, now, c.hung ? "" : ", hung at the next look (with a peer, at one step)");
    logger("agent")->warn("{} is {}: sending SIGKILL", workerName(c.w->launch.local_rank, c.pid),
                          c.stopped ? "hung and " + how : how);
    kill(*c.w);
    c.cause = workerName(c.w->launch.local_rank, c.pid) + ", " + how + ": " + failures_.back().hang;
  }
  // A killed one's exit, whenever it is reaped, ends nothing more once its replacement is under
  // way; until then (and after a fallback) it counts among the workers a stop waits for. The
  // first is out before the recovery begins: across nodes the round's replacements are those
  // not running.
  const Culprit& first = culprits.front();
  first.w->running = false;
  const bool recovering = recoverInPlace(*first.w, first.cause);
  if (state_ != AgentState::kRecovering && first.w->pid == first.pid) first.w->running = true;
  if (!recovering) {
    stopForLocalFailure();
    return true;
  }
  for (size_t i = 1; i < culprits.size() && state_ == AgentState::kRecovering; ++i) {
    const Culprit& c = culprits[i];
    logger("agent")->warn("in-place recovery: {}; it is replaced in this recovery too", c.cause);
    episode_->cause += "; " + c.cause;
    startReplacementInEpisode(*c.w);
    if (state_ == AgentState::kRecovering && c.w->pid == c.pid) c.w->running = false;
  }
  return true;
}

void Supervisor::onWorkerExit(int pid, ExitStatus status) {
  loop_.check();
  Worker* worker = findWorker(pid);
  if (worker == nullptr) return;  // not ours (or a previous attempt's straggler)
  if (worker->discarded) return;  // killed on purpose; its slot starts again with the next round
  if (control_ != nullptr) {
    // What it said before it died comes first (an `aborted` decides how its end is recovered).
    control_->drain(pid);
    worker = findWorker(pid);
    if (worker == nullptr || worker->discarded) return;
  }
  worker->running = false;

  if (state_ == AgentState::kRecovering || state_ == AgentState::kRunning) {
    const std::string what =
        workerName(worker->launch.local_rank, pid) + " " + describeExit(status);
    if (!status.success()) {
      recordFailure(WorkerFailure{worker->launch.local_rank, worker->launch.global_rank, pid,
                                  status, clock_.wallSeconds(), worker->launch.error_file,
                                  /*hang=*/""});
    }
    if (state_ == AgentState::kRecovering && status.success() && episode_ &&
        std::find(episode_->synced.begin(), episode_->synced.end(), pid) !=
            episode_->synced.end()) {
      // It re-formed, took the state, and found no step left: the job's last step was done
      // before the failure. The recovery is over; its exit is the end of its training.
      logger("agent")->info(
          "in-place recovery: {} after it took the new generation's state (no step was left)",
          what);
      finishEpisode(/*training_done=*/true);
    }
    if (state_ == AgentState::kRecovering) {
      if (replaceInEpisode(*worker, what, status)) return;
      fallBack(what + " during the recovery", /*report=*/true,
               status.success() ? FallbackCause::kRecovery : FallbackCause::kFailure);
      return;
    }
    if (!status.success()) {
      if (deadlines_.membership) {
        // A crash on the connection to a node that just went away: that change, free of charge.
        logger("agent")->info("{} after a change of the job's nodes; re-forming, not charged",
                              what);
        failures_.clear();
        onNodesChanged();
        return;
      }
      if (!recoverInPlace(*worker, what)) stopForLocalFailure();
      return;
    }
    if (worker->left) {
      // It was sent SIGTERM by someone else than this agent (which would be stopping now), and
      // left while the other ranks re-form: replace it like a failed worker.
      if (recoverInPlace(*worker, what + " after it left the job on a signal sent to it")) return;
      beginStop(StopReason::kMembership, SIGTERM);
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
  deadlines_.membership.reset();
  episode_.reset();
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
  rendezvous_.reportFailure(FailureKind::kWorkers);
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
  const std::optional<TimePoint> episode =
      episode_ ? std::optional<TimePoint>(episode_->deadline) : std::nullopt;
  for (const auto& d : {deadlines_.kill, deadlines_.report, deadlines_.heartbeat_check,
                        deadlines_.barrier, deadlines_.membership, episode}) {
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
    case StopReason::kInPlaceFallback:  // charged when the recovery began
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
        if (failures_.empty() && error_message_.empty()) {
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
  if (leavesAfterWorkers()) {
    // Its ranks leave after the step they agree on, and the other nodes' ranks recover in place
    // from it. Told now, the other agents would recover once failure_grace passed, maybe before
    // that step ended: the rendezvous hears of the leave once every worker left its group
    // (`goodbye reason=stop`) or ended (finish).
    leave_after_workers_ = true;
  } else {
    rendezvous_.leave();
  }
  ++generation_;  // a pending join's answer no longer matters
  beginStop(StopReason::kSignal, sig);
}

bool Supervisor::leavesAfterWorkers() const {
  if (!options_.multi_node || !options_.restart_in_place || control_ == nullptr ||
      state_ != AgentState::kRunning || hardVeto()) {
    return false;
  }
  return std::all_of(workers_.begin(), workers_.end(),
                     [](const Worker& w) { return !w.running || w.capable; });
}

void Supervisor::onMembershipChange(bool declared_dead) {
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
  if (state_ == AgentState::kRecovering && episode_) {
    // A pending join answers with the newer round (superseded rounds are joined again); a group
    // already sent may be waiting for a node that is gone: abort it and form the next round.
    if (episode_->awaiting_round) return;
    if (++episode_->regenerations > kMaxRegenerations) {
      fallBack("the job's nodes kept changing during the recovery", /*report=*/true);
      return;
    }
    tellAbort(group_generation_);
    // A replacement started for that round forms it from its environment, which no longer
    // holds: it starts again, from the next round's.
    for (auto& w : workers_) {
      if (!w.running || !w.newcomer) continue;
      logger("agent")->info(
          "in-place recovery: local rank {} (pid {}) was started for round {}, which the nodes' "
          "change voided; a new one starts with the next round",
          w.launch.local_rank, w.pid, round_.round);
      kill(w);
      w.running = false;
      w.discarded = true;
    }
    // The group sent is void: its phase messages (a step it completed meanwhile) end nothing.
    episode_->generation = 0;
    episode_->old_generation = group_generation_;
    episode_->stepped.clear();
    episode_->formed_ms = episode_->synced_ms = 0;
    joinRecoveryRound();
    return;
  }
  if (state_ != AgentState::kRunning) return;
  if (options_.multi_node && options_.failure_grace > Duration::zero()) {
    // The workers are stopped once failure_grace passed (onDeadline). Meanwhile they end as they
    // would have: all of them succeeding ends the job here, and a crash is the change's echo, not
    // charged. In process mode only for a node declared dead: a peer may be alive, its agent
    // stalled while its workers finished, and would not join the round this node's stop waits for;
    // this node, its own agent stalled, may find its workers finishing a job the others ended
    // meanwhile (a node that left or joined is no such case, and is answered at once). In place,
    // a stop may be under way too: this node's own SIGTERM (the whole job stopped), or the
    // workers' agreed checkpoint stop, which keeps its snapshot; the recovery starts at once when
    // every worker aborted on its own.
    const bool in_place = inPlaceEligible(nullptr, /*charged=*/false);
    if (in_place ? !allAbortedOnTheirOwn() : declared_dead) {
      if (!deadlines_.membership) deadlines_.membership = clock_.now() + options_.failure_grace;
      return;
    }
  }
  onNodesChanged();
}

void Supervisor::onNodesChanged() {
  deadlines_.membership.reset();
  if (recoverInPlaceWithPeers("the job's nodes changed", /*charged=*/false)) return;
  beginStop(StopReason::kMembership, SIGTERM);
  maybeFinishStop();
}

void Supervisor::onPeerFailure(FailureKind kind) {
  loop_.check();
  const bool recovery = kind == FailureKind::kRecovery;
  if (state_ == AgentState::kRecovering) {
    if (!recovery && joinPeerFailure()) return;
    // A failure the episode cannot absorb (its own is reported by the node it happened on).
    fallBack(recovery ? "the in-place recovery failed on another node"
                      : "workers on another node failed during the recovery",
             /*report=*/false, recovery ? FallbackCause::kRecovery : FallbackCause::kFailure);
    return;
  }
  if (state_ != AgentState::kRunning) return;  // charged once
  // After a failed recovery elsewhere, the failure it recovered from was charged here too when
  // that recovery began (this node finished it first): its restarted workers cost nothing more.
  if (recoverInPlaceWithPeers(recovery ? "another node's in-place recovery failed and it restarts "
                                         "its workers"
                                       : "workers on another node failed",
                              /*charged=*/!recovery)) {
    return;
  }
  logger("agent")->warn(recovery ? "another node's in-place recovery failed; restarting this "
                                   "node's workers too (the failure was charged when the "
                                   "recovery began)"
                                 : "workers on another node failed; restarting this node's "
                                   "workers too");
  failures_.clear();
  beginStop(recovery ? StopReason::kInPlaceFallback : StopReason::kFailure, SIGTERM);
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
  if (state_ == AgentState::kRendezvous && rejoined_after_success_ && deadlines_.barrier &&
      clock_.now() >= *deadlines_.barrier) {
    // Its workers had all succeeded, and the round it re-joined from the exit barrier did not
    // form in the barrier's time: it leaves, so the others may form theirs without it.
    ++generation_;
    gave_up_rejoin_ = true;
    rendezvous_.leave();
    logger("agent")->warn(
        "exit barrier: the round this node re-joined did not form within the exit barrier "
        "timeout; leaving the run, its workers had all succeeded");
    finish(AgentState::kSucceeded, 0);
    return;
  }
  if (state_ == AgentState::kRunning && deadlines_.membership &&
      clock_.now() >= *deadlines_.membership) {
    onNodesChanged();
    return;
  }
  if (state_ == AgentState::kRecovering && episode_ && clock_.now() >= episode_->deadline) {
    // (A round that did not form in time is the rendezvous's; a group that did not is a failure.)
    fallBack("the recovery did not finish within inplace_timeout (" +
                 std::to_string(inplaceTimeoutMs()) + " ms)",
             /*report=*/true,
             episode_->awaiting_round ? FallbackCause::kRecovery : FallbackCause::kFailure);
    return;
  }
  if (deadlines_.heartbeat_check && clock_.now() >= *deadlines_.heartbeat_check) {
    if (state_ == AgentState::kRunning) {
      checkHeartbeats();
      if (finished()) return;
    } else if (state_ == AgentState::kRecovering && episode_) {
      checkHungInEpisode();
      if (state_ != AgentState::kRecovering) return;
    }
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
  if (std::exchange(leave_after_workers_, false)) rendezvous_.leave();
  exit_code_ = exit_code;
  deadlines_.kill.reset();
  deadlines_.report.reset();
  deadlines_.heartbeat_check.reset();
  deadlines_.barrier.reset();
  deadlines_.membership.reset();
  setState(s);
}

// ---- In-place recovery (docs/in-place-recovery.md §2) ----

Supervisor::Worker* Supervisor::findWorker(int pid) {
  for (auto& w : workers_) {
    if (w.pid == pid && w.running) return &w;
  }
  return nullptr;
}

bool Supervisor::isRunningWorker(int pid) const {
  return std::any_of(workers_.begin(), workers_.end(),
                     [pid](const Worker& w) { return w.pid == pid && w.running; });
}

std::int64_t Supervisor::inplaceTimeoutMs() const {
  return std::max<std::int64_t>(
      1, std::chrono::duration_cast<std::chrono::milliseconds>(options_.inplace_timeout).count());
}

double Supervisor::msSinceDetection() const {
  return episode_ ? millis(clock_.now() - episode_->detected) : 0.0;
}

bool Supervisor::notInPlace(NotInPlace kind, const std::string& why) {
  if (said_why_not_in_place_ != kind) {
    said_why_not_in_place_ = kind;
    logger("agent")->warn("--restart-mode=in-place: {}; this job recovers by restarting processes",
                          why);
  }
  return false;
}

bool Supervisor::inPlaceEligible(const Worker* failed, bool charged) {
  if (!options_.restart_in_place || control_ == nullptr) return false;
  // With the budget spent the usual path fails the job.
  if (charged && restart_count_ >= options_.max_restarts) return false;
  // Another node restarts its workers whatever happens: those here could only wait for its ranks.
  // (This node's own veto, for a worker that failed unannounced, was said as it voted.) Under a
  // soft veto every node's workers have the channel, and the recovery's round decides.
  if (hardVeto()) {
    return round_.in_place_veto_own ? false : notInPlace(NotInPlace::kVeto, round_.in_place_veto);
  }
  auto unannounced = [this](const Worker& w) {
    return notInPlace(NotInPlace::kUnannounced,
                      workerName(w.launch.local_rank, w.pid) +
                          " did not announce in-place support on DDPRUN_CONTROL_SOCKET (not a "
                          "worker SDK Trainer)");
  };
  // The failed one's replacement runs its program: it can join only if the failed one said it
  // could (a program that never speaks the channel would leave the others waiting for it). One
  // that left on a signal spoke it too.
  if (failed != nullptr && !failed->announced && !failed->left) {
    failed_unannounced_ = true;
    return unannounced(*failed);
  }
  for (const auto& w : workers_) {
    // One that left on a signal too (its channel may be closed already) is replaced once reaped.
    if (&w == failed || (w.running && (w.capable || w.left))) continue;
    if (!w.running) return false;  // it ended already (finished or failing too)
    if (w.hung_up) {
      // Dead, its exit not reaped yet (killed with the failed one): replaced in this recovery
      // once reaped, before it could hear of it (replaceInEpisode).
      if (w.announced && heartbeats_ != nullptr && heartbeats_->ended(w.pid)) continue;
      // Alive: this time only, its replacement may well recover in place later.
      logger("agent")->warn(
          "no in-place recovery this time: local rank {} (pid {}) closed its "
          "DDPRUN_CONTROL_SOCKET connection; restarting every worker",
          w.launch.local_rank, w.pid);
      return false;
    }
    return unannounced(w);  // it may still be starting
  }
  return true;
}

bool Supervisor::recoverInPlace(Worker& failed, const std::string& cause) {
  if (!inPlaceEligible(&failed, /*charged=*/true)) return false;
  if (options_.multi_node) {
    // The replacement starts in the next round (onRecoveryRound), with its ranks and master.
    ++restart_count_;
    recoverAcrossNodes(cause, /*report=*/true, /*charged=*/true);
    return true;
  }
  auto launch = replacementLaunch(failed.launch.local_rank, restart_count_ + 1);
  if (!launch.isOk()) {
    logger("agent")->warn("in-place recovery: {}", launch.status().message());
    return false;
  }
  ++restart_count_;  // the failure is charged once, however it is recovered
  startEpisode(cause, group_generation_ + 1, /*charged=*/true);
  group_generation_ = episode_->generation;
  tellAbort(episode_->old_generation);
  for (auto& w : workers_) {
    if (w.running) sendGroup(w);
  }
  episode_->told_ms = msSinceDetection();
  spawnReplacement(failed, std::move(*launch));
  return true;
}

StatusOr<WorkerLaunch> Supervisor::replacementLaunch(int local_rank, int restarts) {
  auto launches = planner_(round_, restarts);
  if (!launches.isOk() || static_cast<size_t>(local_rank) >= launches->size()) {
    return Status(StatusCode::kInternal,
                  "cannot prepare a replacement for local rank " + std::to_string(local_rank) +
                      ": " + (launches.isOk() ? "no such rank" : launches.status().message()));
  }
  return std::move((*launches)[static_cast<size_t>(local_rank)]);
}

bool Supervisor::replaceInEpisode(Worker& w, const std::string& what, ExitStatus status) {
  Episode& e = *episode_;
  const bool left = status.success() && w.left;
  // One that heard may be forming this episode's group, or sending its state: a failure of the
  // recovery. A group not sent yet (multi-node) no one can have joined.
  const bool unaware =
      !status.success() && !w.newcomer && w.announced && (e.awaiting_round || !w.heard_abort);
  if (!left && !unaware) return false;
  if (!e.charged) {  // a change of nodes' episode: this is the first failure in it
    if (restart_count_ >= options_.max_restarts) return false;
    ++restart_count_;
    e.charged = true;
  }
  if (left) {
    logger("agent")->info(
        "in-place recovery: {} after it left the job on a signal sent to it; it is replaced in "
        "this recovery too",
        what);
  } else {
    logger("agent")->warn(
        "in-place recovery: {} too, before it heard of the recovery; it is replaced in this "
        "recovery too",
        what);
    e.cause += "; " + what;
  }
  startReplacementInEpisode(w);
  return true;
}

void Supervisor::startReplacementInEpisode(Worker& w) {
  Episode& e = *episode_;
  if (e.awaiting_round) return;  // started with the others once the round forms
  auto launch = replacementLaunch(w.launch.local_rank, restart_count_);
  if (!launch.isOk()) {
    fallBack(launch.status().message(), /*report=*/true);
    return;
  }
  // The phases of start-up are the last replacement's, which the group waits for.
  e.hello_ms = e.ready_ms = 0;
  spawnReplacement(w, std::move(*launch));
}

bool Supervisor::joinPeerFailure() {
  Episode& e = *episode_;
  // (In a change of nodes' episode such a report may be a peer's fallback: the usual path.)
  if (!e.awaiting_round || !e.charged) return false;
  logger("agent")->warn(
      "workers on another node failed too while the round forms; that node replaces them in this "
      "recovery");
  e.cause += "; workers on another node failed";
  return true;
}

bool Supervisor::spawnReplacement(Worker& slot, WorkerLaunch launch) {
  auto pid = launcher_.spawn(launch);
  if (!pid.isOk()) {
    fallBack("cannot start a replacement for local rank " + std::to_string(launch.local_rank) +
             ": " + pid.status().message());
    return false;
  }
  Worker replacement;
  replacement.launch = std::move(launch);
  replacement.pid = *pid;
  replacement.running = true;
  replacement.capable = true;  // it joins through the channel, as a newcomer
  replacement.announced = true;
  replacement.newcomer = true;
  episode_->replacement_pid = *pid;
  slot = std::move(replacement);
  return true;
}

bool Supervisor::recoverInPlaceWithPeers(const std::string& cause, bool charged) {
  if (!options_.multi_node || !inPlaceEligible(nullptr, charged)) return false;
  if (charged) ++restart_count_;
  recoverAcrossNodes(cause, /*report=*/false, charged);
  return true;
}

void Supervisor::recoverAcrossNodes(const std::string& cause, bool report, bool charged) {
  startEpisode(cause, /*generation=*/0, charged);
  tellAbort(episode_->old_generation);
  episode_->told_ms = msSinceDetection();
  if (report) rendezvous_.reportFailure(FailureKind::kWorkers);
  joinRecoveryRound();
}

void Supervisor::startEpisode(const std::string& cause, int generation, bool charged) {
  hang_seen_.reset();
  deadlines_.membership.reset();  // (a peer's failure during the grace: this episode covers it)
  Episode episode;
  episode.generation = generation;
  episode.old_generation = group_generation_;
  const TimePoint now = clock_.now();
  episode.detected = now;
  episode.detected_unix = clock_.wallSeconds();
  if (first_fault_ && first_fault_->generation == group_generation_ &&
      now - first_fault_->at <= options_.inplace_timeout) {
    episode.agent_saw_ms = millis(now - first_fault_->at);
    episode.detected = first_fault_->at;
    episode.detected_unix = first_fault_->at_unix;
    episode.first_seen =
        fmt::format("local rank {}'s collective failed first ({}), {:.0f} ms earlier",
                    first_fault_->local_rank, first_fault_->what, episode.agent_saw_ms);
  }
  first_fault_.reset();
  for (auto& w : workers_) w.heard_abort = w.aborted_gen == group_generation_;
  if (allAbortedOnTheirOwn()) {  // before they were told: that phase ended already
    for (const auto& w : workers_) {
      if (!w.running) continue;
      episode.aborted_ms = std::max(episode.aborted_ms, millis(w.aborted_at - episode.detected));
    }
  }
  // Multi-node: also the bound on forming the round (a `--nnodes 2:2` job waits for a new node).
  episode.deadline = now + options_.inplace_timeout;
  episode.cause = cause;
  episode.charged = charged;
  episode_ = std::move(episode);
  // (The heartbeats go on being checked: only for workers that never heard of the episode.)
  setState(AgentState::kRecovering);
  const std::string budget = " (" + std::to_string(restart_count_) + " of " +
                             std::to_string(options_.max_restarts) + " restarts used)";
  if (generation > 0) {
    logger("agent")->warn(
        "{}; recovering in place as generation {}{}: replacing it alone, the others keep their "
        "processes",
        cause, generation, budget);
  } else {
    logger("agent")->warn(
        "{}; recovering in place{}: this node's workers keep their processes while the nodes form "
        "the next round",
        cause, budget);
  }
}

void Supervisor::tellAbort(int gen) {
  for (auto& w : workers_) {
    if (!w.running) continue;
    control_->send(w.pid, makeControl(ControlType::kAbort,
                                      {{"gen", std::to_string(gen)}, {"reason", "failure"}}));
  }
}

int Supervisor::generationOf(const RoundInfo& round) const {
  return options_.multi_node ? round.round + 1 : group_generation_ + 1;
}

void Supervisor::joinRecoveryRound() {
  episode_->awaiting_round = true;
  const unsigned token = ++generation_;
  rendezvous_.nextRound([this, token](StatusOr<RoundInfo> round) {
    if (token != generation_ || state_ != AgentState::kRecovering || !episode_) return;
    onRecoveryRound(std::move(round));
  });
}

void Supervisor::onRecoveryRound(StatusOr<RoundInfo> round) {
  if (!round.isOk()) {
    fallBack("the next round did not form: " + round.status().toString(), /*report=*/false);
    return;
  }
  if (isSuperseded(rendezvous_, *round)) {
    logger("agent")->info("round {} was superseded before it re-formed (round {} is forming)",
                          round->round, rendezvous_.formingRound());
    joinRecoveryRound();
    return;
  }
  if (!round->in_place_veto.empty()) {
    // A node that restarts processes joined: its fresh ranks form no group with the survivors.
    // Every node restarts into the next round, which syncs the snapshot the old rank 0 saves now.
    fallBack(round->in_place_veto, /*report=*/true, FallbackCause::kRecovery);
    return;
  }
  const auto rank = static_cast<size_t>(round->group_rank);
  if (rank >= round->local_world_sizes.size() ||
      round->local_world_sizes[rank] != static_cast<int>(workers_.size())) {
    fallBack("round " + std::to_string(round->round) +
                 " gives this node a different number of "
                 "workers",
             /*report=*/true);
    return;
  }
  std::vector<WorkerLaunch> launches;
  if (runningWorkers() < static_cast<int>(workers_.size())) {
    auto planned = planner_(*round, restart_count_);
    if (!planned.isOk() || planned->size() != workers_.size()) {
      fallBack("cannot prepare a replacement: " + (planned.isOk()
                                                       ? std::string("wrong number of launches")
                                                       : planned.status().message()),
               /*report=*/true);
      return;
    }
    launches = std::move(*planned);
  }
  round_ = *round;
  group_generation_ = generationOf(round_);
  Episode& e = *episode_;
  e.generation = group_generation_;
  e.awaiting_round = false;
  e.deadline = clock_.now() + options_.inplace_timeout;
  const int base = baseRank(round_.local_world_sizes, round_.group_rank);
  for (auto& w : workers_) {
    if (w.running) {
      w.launch.global_rank = base + w.launch.local_rank;
      sendGroup(w);
      continue;
    }
    if (!spawnReplacement(w, std::move(launches[static_cast<size_t>(w.launch.local_rank)]))) {
      return;
    }
  }
  logger("agent")->info("in-place recovery: round {} formed; generation {}, world {}", round_.round,
                        e.generation, worldSize());
}

void Supervisor::sendGroup(const Worker& w) {
  control_->send(
      w.pid, makeControl(ControlType::kGroup, {{"gen", std::to_string(group_generation_)},
                                               {"rank", std::to_string(w.launch.global_rank)},
                                               {"world", std::to_string(worldSize())},
                                               {"local_rank", std::to_string(w.launch.local_rank)},
                                               {"local_world", std::to_string(workers_.size())},
                                               {"addr", round_.master_addr},
                                               {"port", std::to_string(round_.master_port)},
                                               {"prefix", "g" + std::to_string(group_generation_)},
                                               {"restart_count", std::to_string(restart_count_)}}));
}

void Supervisor::onControlMessage(int pid, const ControlMessage& message) {
  loop_.check();
  Worker* w = findWorker(pid);
  if (w == nullptr) return;
  switch (message.type) {
    case ControlType::kHello:
      w->connected = true;
      control_->send(pid, makeControl(ControlType::kWelcome,
                                      {{"v", std::to_string(std::min<std::int64_t>(
                                                 message.num("v"), kControlProtocolVersion))},
                                       {"gen", std::to_string(group_generation_)},
                                       {"timeout_ms", std::to_string(inplaceTimeoutMs())}}));
      if (episode_ && pid == episode_->replacement_pid) episode_->hello_ms = msSinceDetection();
      return;
    case ControlType::kCaps:
      w->capable = w->connected;
      if (w->capable) {
        w->announced = true;
        failed_unannounced_ = false;  // this program can, after all
      }
      // The SDK's Trainer announces itself once the program has built its model and data: the
      // replacement's own start-up ends here (what follows is the recovery's).
      if (episode_ && pid == episode_->replacement_pid && episode_->ready_ms == 0) {
        episode_->ready_ms = msSinceDetection();
      }
      return;
    case ControlType::kGoodbye: {
      const std::string reason = message.str("reason");
      w->left = reason == "stop";
      if (leave_after_workers_ &&
          std::all_of(workers_.begin(), workers_.end(),
                      [](const Worker& x) { return !x.running || x.left; })) {
        // Every rank here left its group (their processes may take a while to end): told now,
        // the others re-form without waiting for that.
        leave_after_workers_ = false;
        rendezvous_.leave();
      }
      if (reason == "giveup" && state_ == AgentState::kRecovering) {
        fallBack("local rank " + std::to_string(w->launch.local_rank) + " gave up recovering",
                 /*report=*/true, FallbackCause::kFailure);
      }
      return;
    }
    case ControlType::kFault:
      noteFault(*w, message);
      return;
    default:
      if (state_ == AgentState::kRecovering) {
        onPhase(*w, message);
      } else if (state_ == AgentState::kRunning && message.type == ControlType::kAborted) {
        w->aborted_gen = static_cast<int>(message.num("gen"));
        w->aborted_at = clock_.now();
        if (deadlines_.membership && allAbortedOnTheirOwn()) onNodesChanged();
      }
      return;
  }
}

void Supervisor::noteFault(const Worker& w, const ControlMessage& message) {
  if (state_ != AgentState::kRunning || message.num("gen") != group_generation_) return;
  if (first_fault_ && first_fault_->generation == group_generation_) return;
  first_fault_ = Fault{group_generation_, clock_.now(), clock_.wallSeconds(), w.launch.local_rank,
                       message.str("what")};
  logger("agent")->debug("local rank {} (pid {}): a collective of generation {} failed ({})",
                         w.launch.local_rank, w.pid, group_generation_, message.str("what"));
}

void Supervisor::onPhase(Worker& w, const ControlMessage& message) {
  Episode& e = *episode_;
  if (e.awaiting_round && message.type != ControlType::kAborted) return;  // no group out yet
  const auto gen = message.num("gen");  // every phase message has one
  const double at = msSinceDetection();
  switch (message.type) {
    case ControlType::kAborted:
      w.heard_abort = true;
      if (gen <= e.old_generation) e.aborted_ms = std::max(e.aborted_ms, at);
      return;
    case ControlType::kFormed:
      if (gen == e.generation) e.formed_ms = std::max(e.formed_ms, at);
      return;
    case ControlType::kSynced:
      if (gen != e.generation) return;
      if (std::find(e.synced.begin(), e.synced.end(), w.pid) == e.synced.end()) {
        e.synced.push_back(w.pid);
      }
      e.synced_ms = std::max(e.synced_ms, at);
      e.step = message.num("step");
      e.source = static_cast<int>(message.num("source"));
      return;
    case ControlType::kStep:
      if (gen != e.generation) return;
      if (std::find(e.stepped.begin(), e.stepped.end(), w.pid) == e.stepped.end()) {
        e.stepped.push_back(w.pid);
      }
      if (e.stepped.size() >= static_cast<size_t>(runningWorkers())) finishEpisode();
      return;
    default:
      return;
  }
}

void Supervisor::finishEpisode(bool training_done) {
  const Episode e = *episode_;
  const double first_step = msSinceDetection();
  episode_.reset();
  failures_.clear();  // recovered: a later report names a later failure
  ++recovered_in_place_;
  for (auto& w : workers_) w.newcomer = false;         // it trained: it holds what the others hold
  for (auto& w : workers_) w.heartbeat = Heartbeat{};  // the pause is no hang
  setState(AgentState::kRunning);
  if (heartbeatsEnabled()) {
    deadlines_.heartbeat_check = clock_.now() + heartbeatCheckInterval(options_.heartbeat_timeout);
  }
  // (A node whose workers all survived, after a peer's failure or a change of nodes, started no
  // replacement: that phase is not its own.)
  const bool replaced = e.replacement_pid != 0;
  if (recovery_listener_) {
    InPlaceRecovery r{e.generation, {{"told", e.told_ms}}, e.step};
    if (e.agent_saw_ms >= 0) r.phases_ms.emplace_back("detected", e.agent_saw_ms);
    if (replaced) r.phases_ms.emplace_back("replacement_start", e.hello_ms);
    if (replaced && e.ready_ms > 0) r.phases_ms.emplace_back("replacement_ready", e.ready_ms);
    for (const auto& phase :
         std::initializer_list<std::pair<const char*, double>>{{"aborted", e.aborted_ms},
                                                               {"formed", e.formed_ms},
                                                               {"synced", e.synced_ms},
                                                               {"first_step", first_step}}) {
      // (No step came when the training was done: that phase did not happen.)
      if (!(training_done && std::string(phase.first) == "first_step")) {
        r.phases_ms.emplace_back(phase.first, phase.second);
      }
    }
    recovery_listener_(r);
  }
  std::string hello = replaced ? fmt::format(", replacement said hello {:.0f} ms", e.hello_ms) : "";
  if (replaced && e.ready_ms > 0) hello += fmt::format(", ready {:.0f} ms", e.ready_ms);
  logger("agent")->info(
      "in-place recovery, generation {} ({}, seen at unix time {:.3f}{}): told {:.1f} ms{}, "
      "aborted {:.0f} ms, formed {:.0f} ms, synced {:.0f} ms, {} {:.0f} ms; resumed after "
      "step {} from rank {}, world {}",
      e.generation, e.cause, e.detected_unix, e.first_seen.empty() ? "" : ": " + e.first_seen,
      e.told_ms, hello, e.aborted_ms, e.formed_ms, e.synced_ms,
      training_done ? "no step left, done" : "first step", first_step, e.step, e.source,
      worldSize());
}

void Supervisor::fallBack(const std::string& why, bool report, FallbackCause cause) {
  // A failure during a free episode (a change of nodes) is the first to be charged: the stop
  // counts it when it ends (or fails the job with the budget spent).
  const bool charge = cause == FallbackCause::kFailure && episode_ && !episode_->charged;
  logger("agent")->warn("in-place recovery failed ({}); restarting every worker ({})", why,
                        charge ? "the failure is charged, the recovery was for a change of nodes"
                               : "the failure is charged once");
  ++generation_;  // a pending join's answer no longer matters
  if (charge && failures_.empty() && restart_count_ >= options_.max_restarts) {
    error_message_ =
        "in-place recovery failed (" + why +
        ") and the restart budget (--max-restarts=" + std::to_string(options_.max_restarts) +
        ") is spent";
  }
  beginStop(charge ? StopReason::kFailure : StopReason::kInPlaceFallback, SIGTERM);
  // The other nodes restart theirs too (a failure the rendezvous already knows is not reported).
  // A failure charged when the recovery began is not charged again by a node that is back in
  // RUNNING by now (its workers completed a step in the new group before this one gave up).
  if (options_.multi_node && report) {
    rendezvous_.reportFailure(charge ? FailureKind::kWorkers : FailureKind::kRecovery);
  }
  // A worker mid-recovery has nothing to save, and may be blocked forming a group with the dead
  // (bounded only by its connect timeout): SIGKILL comes soon after the SIGTERM.
  if (deadlines_.kill) {
    deadlines_.kill = std::min(*deadlines_.kill, clock_.now() + kFallbackGrace);
  }
  maybeFinishStop();
}

void Supervisor::onControlClosed(int pid) {
  loop_.check();
  Worker* w = findWorker(pid);
  if (w == nullptr) return;
  // A worker that cannot hear the agent cannot recover with the others. (One that died closes
  // its channel first: its exit decides; one that lives on is bounded by the episode's deadline.)
  w->connected = false;
  w->capable = false;
  w->hung_up = true;
}

}  // namespace ddprun::agent
