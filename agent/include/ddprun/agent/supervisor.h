// Supervisor: the agent's state machine (SPEC §4) for one node — rendezvous, run the worker
// group, stop it on a failure or a signal, restart while restarts remain, wait in the exit
// barrier once the workers succeeded, decide the exit code.
//
// Pure: it acts only through ProcessLauncher, RendezvousClient and Clock, and learns of the
// world through its on*() methods. The shell (agent_runner.h) calls them from one thread and
// arms a timer for nextDeadline(). Not thread-safe; lives as long as the job.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ddprun/agent/heartbeat.h"
#include "ddprun/agent/process.h"
#include "ddprun/agent/rendezvous_client.h"
#include "ddprun/common/clock.h"
#include "ddprun/common/control_protocol.h"
#include "ddprun/common/loop_affinity.h"

namespace ddprun::agent {

// kRecovering (--restart-mode=in-place): a failed worker was replaced alone and the others re-form
// in place; back to kRunning once every worker completed a step in the new generation.
// kExitBarrier: every local worker succeeded; waiting (bounded) for the other nodes to finish
// before SUCCEEDED, so this node does not tear down what they still need.
enum class AgentState {
  kInit,
  kRendezvous,
  kRunning,
  kRecovering,
  kStopping,
  kRestarting,
  kExitBarrier,
  kSucceeded,
  kFailed
};
const char* agentStateName(AgentState s);

// One worker that ended badly, as the failure report shows it.
struct WorkerFailure {
  int local_rank = 0;
  int global_rank = 0;
  int pid = 0;
  ExitStatus exit;       // for a hung worker: how it ended once the agent stopped it
  double wall_time = 0;  // when the exit (or the hang) was observed (unix seconds)
  std::string error_file;
  // Non-empty when the agent stopped the worker because its heartbeat went stale:
  // "worker hung: no heartbeat for 12.0 s (timeout 10 s)".
  std::string hang;
};

struct SupervisorOptions {
  int max_restarts = 0;
  Duration shutdown_timeout = std::chrono::seconds(30);
  // Multi-node: a local worker failure is reported (and charged) only if no membership change
  // arrives within this window — when a peer node dies or leaves, local workers often crash on
  // the broken connection a moment before the rendezvous says so, and that is no failure of
  // theirs. Zero (single node) reports at once.
  Duration failure_grace = Duration::zero();
  // A worker whose heartbeat file (WorkerLaunch::heartbeat_file) was touched once and then not
  // for longer than this is hung: it fails the attempt like a worker exiting non-zero. Zero, a
  // null HeartbeatProbe or an empty heartbeat_file turn the check off.
  Duration heartbeat_timeout = Duration::zero();
  // The job spans nodes: a worker that exits 0 after stopping on a checkpoint request this agent
  // did not forward (its WorkerLaunch::stop_file exists) stopped because a peer rank on another
  // node was asked to (that node is leaving or re-forming); it is re-formed with the others like
  // a membership change, never taken for the job's success.
  bool multi_node = false;
  // The longest the exit barrier holds this node after its workers succeeded.
  Duration exit_barrier_timeout = std::chrono::seconds(300);
  // A worker sent SIGKILL that has not been reaped after this long is given up: the launcher
  // ends what holds it (ProcessLauncher::forceEnd: its guardian, stopped or stuck) and the agent
  // waits for it no more. No child is waited for without a bound.
  Duration reap_timeout = std::chrono::seconds(10);
  // --restart-mode=in-place (single-node jobs for now): a failed worker is replaced alone while
  // the others, which said they can (`caps add=inplace` on the control channel), re-form in place
  // and go on from the last completed step. Whatever fails on the way falls back to restarting
  // every worker, and the failure is charged once either way.
  bool restart_in_place = false;
  Duration inplace_timeout = std::chrono::seconds(60);  // the bound on one recovery
};

// One completed in-place recovery, for logs and metrics: each phase's end, in ms after the failure
// was seen ("told", "replacement_start", "replacement_ready", "aborted", "formed", "synced",
// "first_step").
struct InPlaceRecovery {
  int generation = 0;
  std::vector<std::pair<std::string, double>> phases_ms;
  std::int64_t step = -1;  // the completed steps the group went on from
};

// The agent's end of the workers' control channel (docs/in-place-recovery.md §1).
class ControlChannel {
 public:
  virtual ~ControlChannel() = default;
  // False when `pid` has no open connection.
  virtual bool send(int pid, const ControlMessage& message) = 0;
  // Delivers now (to onControlMessage, then onControlClosed at its end) what `pid` sent that was
  // not read yet: a worker's last lines come before its exit, which is handled next.
  virtual void drain(int /*pid*/) {}
};

class Supervisor {
 public:
  // Builds the launches for a round's attempt; restart_count is TORCHELASTIC_RESTART_COUNT.
  using Planner =
      std::function<StatusOr<std::vector<WorkerLaunch>>(const RoundInfo& round, int restart_count)>;

  // `heartbeats` may be null (no hang detection), and `control` (no in-place recovery); both must
  // outlive the supervisor.
  Supervisor(SupervisorOptions options, ProcessLauncher& launcher, RendezvousClient& rendezvous,
             Clock& clock, Planner planner, HeartbeatProbe* heartbeats = nullptr,
             ControlChannel* control = nullptr);

  // INIT -> RENDEZVOUS.
  void start();
  // A child was reaped.
  void onWorkerExit(int pid, ExitStatus status);
  // A handled signal reached the agent. Terminating signals (TERM, INT, HUP, QUIT) stop the
  // workers and end the agent with 128+sig; others are only forwarded.
  void onSignal(int sig);
  // The membership changed (multi-node): restart in a new round without charging a restart.
  // With a failure_grace, when a node was declared dead, another or this one (or in place,
  // whatever changed), once the grace passed: workers that all succeed meanwhile end the job here.
  void onMembershipChange(bool declared_dead = false);
  // Workers on another node failed (kWorkers): every node restarts in one new round, charged once
  // here too. Another node's in-place recovery failed (kRecovery): the same, not charged again.
  void onPeerFailure(FailureKind kind);
  // The time is at or past nextDeadline(): SIGKILL after the shutdown timeout, a failure report
  // after its grace, a look at the workers' heartbeat files, or the end of the exit barrier.
  void onDeadline();
  // A line from worker `pid` on the control channel, parsed; and the end of its connection.
  void onControlMessage(int pid, const ControlMessage& message);
  void onControlClosed(int pid);
  // Whether `pid` is one of this attempt's running workers (who may use the control channel).
  bool isRunningWorker(int pid) const;
  // In-place recoveries that completed.
  int recoveredInPlace() const { return recovered_in_place_; }
  // This node's vote for in-place recovery in the round it joins next (multi-node; published by
  // JobIdentityClient): kInPlace under --restart-mode=in-place, kProcess under process mode, and
  // kListen after a worker here failed without having announced support while none announced it
  // since: its replacement may not either, so a recovery that forms that round falls back (no
  // node waits for ranks that never come), but its workers still get the control channel, and
  // the first that announces support brings the vote back. (Workers that have not announced
  // support yet, but did not fail, may still be starting: they do not change the vote.)
  InPlaceVote inPlaceVote() const {
    if (!options_.restart_in_place) return InPlaceVote::kProcess;
    return failed_unannounced_ ? InPlaceVote::kListen : InPlaceVote::kInPlace;
  }

  std::optional<TimePoint> nextDeadline() const;
  AgentState state() const { return state_; }
  bool finished() const {
    return state_ == AgentState::kSucceeded || state_ == AgentState::kFailed;
  }
  // 0 success, 1 workers failed past the budget, 128+n stopped by signal n.
  int exitCode() const { return exit_code_; }
  int restartCount() const { return restart_count_; }
  int runningWorkers() const;
  int groupRank() const { return round_.group_rank; }
  int worldSize() const;
  // Failures of the last attempt that failed (what the failure report shows).
  const std::vector<WorkerFailure>& failures() const { return failures_; }
  // True when the agent left the run: a handled terminating signal ended it, or the round it
  // re-joined from the exit barrier did not form in time.
  bool leftRun() const { return stop_reason_ == StopReason::kSignal || gave_up_rejoin_; }
  // Human-readable reason when the agent failed without local worker failures.
  const std::string& errorMessage() const { return error_message_; }
  // Called on every state change (logging, metrics).
  void setStateListener(std::function<void(AgentState)> listener) {
    listener_ = std::move(listener);
  }
  // Called when an in-place recovery completed (metrics).
  void setRecoveryListener(std::function<void(const InPlaceRecovery&)> listener) {
    recovery_listener_ = std::move(listener);
  }

 private:
  enum class StopReason { kNone, kFailure, kSignal, kMembership, kInPlaceFallback };
  struct Worker {
    WorkerLaunch launch;
    int pid = 0;
    bool running = false;
    Heartbeat heartbeat;
    std::optional<TimePoint> killed_at;  // when it was sent SIGKILL
    bool connected = false;              // said hello on the control channel
    bool capable = false;                // said `caps add=inplace`
    bool announced = false;              // said it once (a closed channel does not take that back)
    bool hung_up = false;                // its control channel closed (it is exiting, or lost it)
    bool left = false;    // said `goodbye reason=stop`: it leaves on a signal to it, the rest go on
    int aborted_gen = 0;  // the generation it said `aborted` for on its own (a peer gone), RUNNING
    TimePoint aborted_at;  // when it said so
    // In this episode: it said `aborted` (it then forms the groups it is sent), or had for the
    // failed generation before the episode began.
    bool heard_abort = false;
    bool newcomer = false;   // started by this recovery: it holds nothing of its own yet
    bool discarded = false;  // a newcomer killed when its round was voided: its exit is expected
  };
  // One in-place recovery: from the failure until every worker completed a step.
  struct Episode {
    int generation = 0;           // the group being formed (multi-node: known once the round is)
    int old_generation = 0;       // the group that failed
    bool awaiting_round = false;  // multi-node: the agents are forming the next round
    int regenerations = 0;        // rounds formed again because the nodes changed meanwhile
    bool charged = false;         // a failure began it (one restart counted)
    // When the failure was first seen: this agent's own detection, or a local worker's earlier
    // `fault` (its collective failed first, e.g. a peer node's sockets closed).
    TimePoint detected;
    double detected_unix = 0;  // wall-clock seconds, to line the phases up with others' logs
    double agent_saw_ms = -1;  // after a worker's `fault`: when this agent saw it (else -1)
    std::string first_seen;    // after a worker's `fault`: who and what
    TimePoint deadline;
    std::string cause;  // "local rank 1 (pid 812) killed by signal 9"
    int replacement_pid = 0;
    std::vector<int> stepped;  // pids that completed a step in `generation`
    std::vector<int> synced;   // pids that hold the state of `generation` (said `synced`)
    // When the last worker reported each phase (ms after `detected`).
    double told_ms = 0, hello_ms = 0, ready_ms = 0, aborted_ms = 0, formed_ms = 0, synced_ms = 0;
    std::int64_t step = -1;
    int source = -1;
  };

  void setState(AgentState s);
  void joinRound();
  void onRound(StatusOr<RoundInfo> round);
  void enterExitBarrier();
  // The worker exited 0 only because a peer's checkpoint stop was agreed across ranks.
  bool stoppedForPeer(const Worker& worker) const;
  // Every running worker said `aborted` for the current generation on its own: its collectives
  // failed (a node died, or ranks left on SIGTERM), so no agreed stop is under way among them.
  bool allAbortedOnTheirOwn() const;
  // While the group stops after a failure: this worker failed too, not merely stopped.
  bool failedOnItsOwn(const Worker& worker, ExitStatus status) const;
  void onExitBarrier(const Status& status);
  // A change of the job's nodes while RUNNING: in-place recovery, else stop and re-form.
  void onNodesChanged();
  void recordFailure(const WorkerFailure& failure);
  void stopForLocalFailure();
  void checkHeartbeats();
  // Records its hang as a failure ("worker hung: no heartbeat for ..." + `note`).
  void recordHang(const Worker& w, TimePoint now, const std::string& note = "");
  // In-place mode: the hung workers stopped by a signal, and those whose heartbeat file says they
  // do not wait for their peers, are killed and replaced in one episode, the others keeping their
  // processes (true); a multi-node hang with no such worker here waits a grace for the peer's
  // report (true, nothing done). False: the usual path (also on one node when every worker is
  // such a culprit).
  bool recoverHungInPlace(const std::vector<Worker*>& hung, TimePoint now);
  // The worker's heartbeat file says it does not wait for its peers, and has said so for longer
  // than `silent_for`: the mark is read, then the file's time again (every mark a worker writes
  // touches the file, so a wait that ended between the first look at the time and the look at the
  // mark is seen as the fresh heartbeat it is, not as a rank hung in its own code).
  bool saysNotWaiting(Worker& w, TimePoint now, Duration silent_for);
  // RECOVERING: a survivor that never said `aborted` and whose heartbeat went stale while it was
  // not waiting for its peers (or stopped by a signal) is killed and replaced in the episode.
  void checkHungInEpisode();
  // SIGKILL to a running worker's group, timed for reap_timeout.
  void kill(Worker& w);
  // Workers sent SIGKILL reap_timeout ago and still not reaped: given up (forceEnd).
  void giveUpUnreaped();
  bool heartbeatsEnabled() const;
  void beginStop(StopReason reason, int sig);
  void maybeFinishStop();
  void reportLocalFailure();
  // On SIGTERM: multi-node, in place, RUNNING, no hard veto on the round, every running worker
  // capable.
  bool leavesAfterWorkers() const;
  // A node of the current round restarts processes whatever happens (its workers have no control
  // channel): a veto that is not soft (RoundInfo::in_place_veto_soft).
  bool hardVeto() const { return !round_.in_place_veto.empty() && !round_.in_place_veto_soft; }
  void finish(AgentState s, int exit_code);
  // In-place recovery (restart_in_place): replaces `failed` alone and has the others re-form;
  // false when it does not apply (the caller takes the usual path).
  bool recoverInPlace(Worker& failed, const std::string& cause);
  // `failed`: the local worker that failed, or null for a peer's failure or a membership change;
  // `charged`: the episode takes a restart from the budget.
  bool inPlaceEligible(const Worker* failed, bool charged);
  // Why this job recovers by restarting processes after all: said once per reason, again when
  // the reason changes (a veto after workers that did not announce support, or back); false.
  enum class NotInPlace { kNone, kVeto, kUnannounced };
  bool notInPlace(NotInPlace kind, const std::string& why);
  // Multi-node: a peer's failure or a change of the job's nodes while RUNNING; false when it
  // does not apply.
  bool recoverInPlaceWithPeers(const std::string& cause, bool charged);
  // `charged`: a failure's episode (its restart was counted); a change of nodes' is free.
  void startEpisode(const std::string& cause, int generation, bool charged);
  // Multi-node: the episode's start, the survivors' abort, the report (a local failure) and the
  // join of the next round.
  void recoverAcrossNodes(const std::string& cause, bool report, bool charged);
  // During an episode, a local worker ended (`what`): replaced in this episode too, which it
  // charges when it was free, if it left on a signal sent to it (several ranks sent SIGTERM at
  // once leave at one agreed step), or if it failed before it heard of the episode (several ranks
  // died at once: it saw no group of this episode, so its rank there is free). False otherwise,
  // or with the budget spent: the caller falls back.
  bool replaceInEpisode(Worker& w, const std::string& what, ExitStatus status);
  // Starts w's replacement in the episode under way (across nodes: once its round forms).
  void startReplacementInEpisode(Worker& w);
  // During a failure's episode, another node reported failed workers (kWorkers): while the round
  // forms (no group out yet) they are part of it (ranks on several nodes died together, each node
  // reported its own), their node replacing them; charged once. False once a group is out, or in
  // a change of nodes' episode (the report may be a peer's fallback).
  bool joinPeerFailure();
  // The launch of `local_rank` in the current round at `restarts`, or why there is none.
  StatusOr<WorkerLaunch> replacementLaunch(int local_rank, int restarts);
  // Starts `launch` in `slot` (a failed worker's) as a newcomer; false after falling back.
  bool spawnReplacement(Worker& slot, WorkerLaunch launch);
  // `abort` of generation `gen` to every running worker.
  void tellAbort(int gen);
  // Multi-node: joins the next round without stopping the workers; onRecoveryRound gets it.
  void joinRecoveryRound();
  void onRecoveryRound(StatusOr<RoundInfo> round);
  // The group generation of a new round: the round itself across nodes (every agent agrees on
  // it), one more than the last on a single node.
  int generationOf(const RoundInfo& round) const;
  void sendGroup(const Worker& w);
  void onPhase(Worker& w, const ControlMessage& message);
  // A worker's `fault` while RUNNING: the first of the current generation is kept to date the
  // episode that follows (timings only: nothing is decided on a worker's word).
  void noteFault(const Worker& w, const ControlMessage& message);
  // The recovery is over: every running worker completed a step in the new generation, or (with
  // `training_done`) one that had taken the new generation's state exited 0, since no step was
  // left (a rank lost after the last step).
  void finishEpisode(bool training_done = false);
  // Every worker restarts; multi-node with `report`: the other nodes are told. No new charge,
  // except for a `failure` (a worker's, or a peer's) that ends a free episode (a change of nodes):
  // that failure is charged once, or fails the job with the budget spent, as in process mode.
  enum class FallbackCause { kRecovery, kFailure };
  void fallBack(const std::string& why, bool report = true,
                FallbackCause cause = FallbackCause::kRecovery);
  double msSinceDetection() const;
  std::int64_t inplaceTimeoutMs() const;
  Worker* findWorker(int pid);

  SupervisorOptions options_;
  ProcessLauncher& launcher_;
  RendezvousClient& rendezvous_;
  Clock& clock_;
  Planner planner_;
  HeartbeatProbe* heartbeats_;
  ControlChannel* control_;
  std::function<void(AgentState)> listener_;
  std::function<void(const InPlaceRecovery&)> recovery_listener_;

  AgentState state_ = AgentState::kInit;
  RoundInfo round_;
  std::vector<Worker> workers_;
  std::vector<WorkerFailure> failures_;
  StopReason stop_reason_ = StopReason::kNone;
  int stop_signal_ = 0;
  bool signal_forwarded_ = false;  // a non-terminating signal reached this round's workers
  // What nextDeadline() chooses from.
  struct Deadlines {
    std::optional<TimePoint> kill;             // SIGKILL to the workers that did not stop
    std::optional<TimePoint> report;           // a local failure not yet reported (grace)
    std::optional<TimePoint> heartbeat_check;  // next look at the heartbeat files (RUNNING only)
    std::optional<TimePoint> barrier;          // EXIT_BARRIER only
    // Multi-node: a change of nodes (in process mode, a peer declared dead) waits failure_grace
    // before the workers are stopped or recovered in place (RUNNING), unless every local worker
    // aborted the current generation already (allAbortedOnTheirOwn); workers that all succeed
    // meanwhile end the job here.
    std::optional<TimePoint> membership;
  } deadlines_;
  int restart_count_ = 0;
  // Joining a round from the exit barrier (another node went on): this node's workers had all
  // succeeded, so a run closed meanwhile (the others ended the job without it) is a success.
  bool rejoined_after_success_ = false;
  bool gave_up_rejoin_ = false;  // ... and left the run when that round did not form in time
  int exit_code_ = 0;
  std::string error_message_;
  // Guards against callbacks of a join or barrier that was superseded (e.g. a signal arrived
  // mid-join, or the barrier timed out before the rendezvous answered).
  unsigned generation_ = 0;
  // The workers' group generation (control channel `gen`): one per round, one per in-place
  // recovery; never reused, so each has its own store keys.
  int group_generation_ = 0;
  std::optional<Episode> episode_;
  // The first `fault` of the running generation. An episode that starts within inplace_timeout of
  // it (a worker that saw a failure waits no longer for a group) is timed from it.
  struct Fault {
    int generation = 0;
    TimePoint at;
    double at_unix = 0;
    int local_rank = 0;
    std::string what;
  };
  std::optional<Fault> first_fault_;
  // When heartbeats were first seen stale with no stopped worker here (in-place, multi-node).
  std::optional<TimePoint> hang_seen_;
  int recovered_in_place_ = 0;
  // SIGTERM to an in-place node whose workers are all Trainers: the rendezvous is left once every
  // worker said `goodbye reason=stop` or ended (finish), not at the signal (leavesAfterWorkers).
  bool leave_after_workers_ = false;
  NotInPlace said_why_not_in_place_ = NotInPlace::kNone;  // the last "restarting processes" line
  // A worker failed without having announced support, and none announced it since (inPlaceVote).
  bool failed_unannounced_ = false;
  LoopAffinity loop_{"Supervisor"};
};

}  // namespace ddprun::agent
