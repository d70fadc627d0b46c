#include "ddprun/agent/supervisor.h"

#include <catch2/catch.hpp>
#include <csignal>

#include "fake_clock.h"
#include "fake_heartbeat_probe.h"
#include "fake_process_launcher.h"
#include "fake_rendezvous.h"

using namespace ddprun;
using namespace ddprun::agent;
using ddprun::testing::FakeClock;
using ddprun::testing::FakeHeartbeatProbe;
using ddprun::testing::FakeProcessLauncher;
using ddprun::testing::FakeRendezvous;

namespace {

struct Fixture {
  explicit Fixture(int nproc = 2, int max_restarts = 0, Duration grace = Duration::zero(),
                   Duration heartbeat_timeout = Duration::zero(),
                   Duration exit_barrier_timeout = std::chrono::seconds(300),
                   bool multi_node = false) {
    rdzv.round.local_world_sizes = {nproc};
    rdzv.round.master_addr = "host";
    rdzv.round.master_port = 1234;
    SupervisorOptions opts;
    opts.max_restarts = max_restarts;
    opts.shutdown_timeout = std::chrono::seconds(5);
    opts.failure_grace = grace;
    opts.heartbeat_timeout = heartbeat_timeout;
    opts.exit_barrier_timeout = exit_barrier_timeout;
    opts.multi_node = multi_node;
    sup = std::make_unique<Supervisor>(
        opts, launcher, rdzv, clock,
        [this](const RoundInfo& r, int restarts) {
          rounds_planned.push_back({r.round, restarts});
          std::vector<WorkerLaunch> out;
          for (int i = 0; i < r.local_world_sizes[0]; ++i) {
            WorkerLaunch w;
            w.local_rank = i;
            w.global_rank = i;
            w.argv = {"/bin/worker"};
            w.heartbeat_file = heartbeatFile(restarts, i);
            w.stop_file = stopFile(restarts, i);
            out.push_back(w);
          }
          return StatusOr<std::vector<WorkerLaunch>>(out);
        },
        &heartbeats);
  }
  static std::string stopFile(int attempt, int local_rank) {
    return "/logs/attempt_" + std::to_string(attempt) + "/" + std::to_string(local_rank) +
           "/stopped";
  }
  static std::string heartbeatFile(int attempt, int local_rank) {
    return "/logs/attempt_" + std::to_string(attempt) + "/" + std::to_string(local_rank) +
           "/heartbeat";
  }
  // Moves the fake time on by `d` in steps of `step`, firing every deadline that falls due (as
  // the agent's timer does), and calls `each` before every step.
  void runFor(
      Duration d, Duration step, const std::function<void()>& each = [] {}) {
    for (Duration done = Duration::zero(); done < d; done += step) {
      each();
      clock.advance(step);
      while (sup->nextDeadline() && *sup->nextDeadline() <= clock.now()) {
        const auto before = sup->nextDeadline();
        sup->onDeadline();
        if (sup->nextDeadline() == before) break;  // nothing more due now
      }
    }
  }
  // The pids of the latest attempt.
  std::vector<int> current() const {
    auto all = launcher.pids();
    int n = rdzv.round.local_world_sizes[0];
    return std::vector<int>(all.end() - n, all.end());
  }
  void exitAll(int code) {
    for (int pid : current()) sup->onWorkerExit(pid, ExitStatus{false, code});
  }

  FakeClock clock;
  FakeHeartbeatProbe heartbeats;
  FakeProcessLauncher launcher;
  FakeRendezvous rdzv;
  std::vector<std::pair<int, int>> rounds_planned;
  std::unique_ptr<Supervisor> sup;
};

}  // namespace

TEST_CASE("agent starts every local worker once the round completes", "[agent]") {
  Fixture f(3);
  f.rdzv.hold = true;
  f.sup->start();
  CHECK(f.sup->state() == AgentState::kRendezvous);
  CHECK(f.launcher.spawned.empty());
  RoundInfo r = f.rdzv.round;
  f.rdzv.pending(r);
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.launcher.spawned.size() == 3);
  CHECK(f.sup->runningWorkers() == 3);
}

TEST_CASE("agent succeeds when every worker exits zero", "[agent]") {
  Fixture f;
  f.sup->start();
  auto pids = f.current();
  f.sup->onWorkerExit(pids[0], ExitStatus{false, 0});
  CHECK(f.sup->state() == AgentState::kRunning);  // one still running
  f.sup->onWorkerExit(pids[1], ExitStatus{false, 0});
  CHECK(f.sup->state() == AgentState::kSucceeded);
  CHECK(f.sup->exitCode() == 0);
}

TEST_CASE("agent restarts the whole group when one worker exits non-zero", "[agent]") {
  Fixture f(2, /*max_restarts=*/1);
  f.sup->start();
  auto first = f.current();
  f.sup->onWorkerExit(first[1], ExitStatus{false, 3});
  CHECK(f.sup->state() == AgentState::kStopping);
  CHECK(f.rdzv.failures == 1);
  // The survivor got SIGTERM to its group.
  REQUIRE(f.launcher.signals.size() == 1);
  CHECK(f.launcher.signals[0] == std::make_pair(first[0], SIGTERM));
  f.sup->onWorkerExit(first[0], ExitStatus{true, SIGTERM});
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.sup->restartCount() == 1);
  CHECK(f.launcher.spawned.size() == 4);
  CHECK(f.rounds_planned.back().second == 1);  // TORCHELASTIC_RESTART_COUNT of the new attempt
  CHECK(f.rdzv.joins == 2);
}

TEST_CASE("agent fails with exit code 1 once the restart budget is spent", "[agent]") {
  Fixture f(2, /*max_restarts=*/1);
  f.sup->start();
  f.sup->onWorkerExit(f.current()[0], ExitStatus{false, 1});
  f.sup->onWorkerExit(f.current()[1], ExitStatus{true, SIGTERM});
  REQUIRE(f.sup->state() == AgentState::kRunning);
  f.sup->onWorkerExit(f.current()[0], ExitStatus{true, SIGSEGV});
  f.sup->onWorkerExit(f.current()[1], ExitStatus{true, SIGTERM});
  CHECK(f.sup->state() == AgentState::kFailed);
  CHECK(f.sup->exitCode() == 1);
  // Only the worker that failed on its own is a failure, not the one we stopped.
  REQUIRE(f.sup->failures().size() == 1);
  CHECK(f.sup->failures()[0].exit.signaled);
  CHECK(f.sup->failures()[0].exit.code == SIGSEGV);
  CHECK(f.sup->failures()[0].local_rank == 0);
}

TEST_CASE("agent sends SIGKILL to workers that outlive the shutdown timeout", "[agent]") {
  Fixture f;
  f.sup->start();
  auto pids = f.current();
  f.sup->onWorkerExit(pids[0], ExitStatus{false, 2});
  REQUIRE(f.sup->nextDeadline().has_value());
  f.clock.advance(std::chrono::seconds(4));
  f.sup->onDeadline();  // early: nothing happens
  CHECK(f.launcher.signalsSent(SIGKILL) == 0);
  f.clock.advance(std::chrono::seconds(1));
  f.sup->onDeadline();
  CHECK(f.launcher.signalsSent(SIGKILL) == 1);
  // Waited for no longer than the reap bound (then given up: see below).
  CHECK(f.sup->nextDeadline() == f.clock.now() + std::chrono::seconds(10));
  f.sup->onWorkerExit(pids[1], ExitStatus{true, SIGKILL});
  CHECK_FALSE(f.sup->nextDeadline().has_value());
  CHECK(f.sup->state() == AgentState::kFailed);
}

TEST_CASE("a terminating signal is forwarded, stops the workers and ends with 128+sig", "[agent]") {
  Fixture f(2, /*max_restarts=*/3);
  f.sup->start();
  f.sup->onSignal(SIGTERM);
  CHECK(f.rdzv.leaves == 1);
  CHECK(f.launcher.signalsSent(SIGTERM) == 2);
  CHECK(f.sup->state() == AgentState::kStopping);
  // Workers exiting non-zero while we stop them for a signal are not failures: no restart.
  f.exitAll(1);
  CHECK(f.sup->state() == AgentState::kFailed);
  CHECK(f.sup->exitCode() == 128 + SIGTERM);
  CHECK(f.sup->failures().empty());
  CHECK(f.launcher.spawned.size() == 2);
}

TEST_CASE("a non-terminating handled signal is only forwarded", "[agent]") {
  Fixture f;
  f.sup->start();
  f.sup->onSignal(SIGUSR1);
  CHECK(f.launcher.signalsSent(SIGUSR1) == 2);
  CHECK(f.sup->state() == AgentState::kRunning);
  f.exitAll(0);  // workers that checkpoint and exit 0 end the job successfully
  CHECK(f.sup->exitCode() == 0);
}

TEST_CASE("a signal during rendezvous ends the agent without starting workers", "[agent]") {
  Fixture f;
  f.rdzv.hold = true;
  f.sup->start();
  f.sup->onSignal(SIGINT);
  CHECK(f.sup->state() == AgentState::kFailed);
  CHECK(f.sup->exitCode() == 128 + SIGINT);
  f.rdzv.pending(f.rdzv.round);  // a late answer is ignored
  CHECK(f.launcher.spawned.empty());
}

TEST_CASE("a membership change restarts the workers without charging a restart", "[agent]") {
  Fixture f(2, /*max_restarts=*/0);
  f.sup->start();
  f.sup->onMembershipChange();
  CHECK(f.launcher.signalsSent(SIGTERM) == 2);
  f.exitAll(143);
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.sup->restartCount() == 0);
  CHECK(f.rdzv.joins == 2);
}

// Two workers of a multi-node job with a failure_grace of 1 s, no restart budget.
struct GraceFixture : Fixture {
  GraceFixture()
      : Fixture(2, /*max_restarts=*/0, std::chrono::seconds(1), Duration::zero(),
                std::chrono::seconds(300), /*multi_node=*/true) {}
};

// A node declared dead while the last steps ran (its agent stalled; its workers went on): the
// others' workers finish too. Stopped at once, they would wait for a round that node never joins.
TEST_CASE("with a failure grace, workers that all succeed after a peer's death end the job",
          "[agent][barrier]") {
  GraceFixture f;
  f.rdzv.hold_barrier = true;
  f.sup->start();
  f.sup->onMembershipChange(/*declared_dead=*/true);
  CHECK(f.launcher.signalsSent(SIGTERM) == 0);  // not stopped within the grace
  REQUIRE(f.sup->nextDeadline().has_value());
  f.clock.advance(std::chrono::milliseconds(900));
  f.exitAll(0);
  CHECK(f.sup->state() == AgentState::kExitBarrier);
  CHECK(f.rdzv.joins == 1);
  f.clock.advance(std::chrono::milliseconds(200));  // the grace's end changes nothing now
  f.sup->onDeadline();
  f.rdzv.pending_barrier(Status::ok());
  CHECK(f.sup->state() == AgentState::kSucceeded);
  CHECK(f.sup->exitCode() == 0);
  CHECK(f.launcher.signalsSent(SIGTERM) == 0);
}

TEST_CASE("with a failure grace, a peer's death stops the workers once the grace passed",
          "[agent]") {
  GraceFixture f;
  f.sup->start();
  f.sup->onMembershipChange(/*declared_dead=*/true);
  f.sup->onWorkerExit(f.current()[0], ExitStatus{false, 0});  // one rank finished
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.launcher.signalsSent(SIGTERM) == 0);
  f.clock.advance(std::chrono::seconds(1));
  f.sup->onDeadline();
  CHECK(f.sup->state() == AgentState::kStopping);
  CHECK(f.launcher.signalsSent(SIGTERM) == 1);  // the one still running
  f.sup->onWorkerExit(f.current()[1], ExitStatus{true, SIGTERM});
  CHECK(f.sup->state() == AgentState::kRunning);  // the next round's workers, both of them
  CHECK(f.current().size() == 2);
  CHECK(f.sup->restartCount() == 0);
  CHECK(f.rdzv.joins == 2);
}

TEST_CASE("with a failure grace, a node that left or joined has the workers stopped at once",
          "[agent]") {
  GraceFixture f;
  f.sup->start();
  f.sup->onMembershipChange();
  CHECK(f.sup->state() == AgentState::kStopping);
  CHECK(f.launcher.signalsSent(SIGTERM) == 2);
  f.exitAll(143);
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.sup->restartCount() == 0);
  CHECK(f.rdzv.joins == 2);
}

TEST_CASE("with a failure grace, a crash after a peer's death re-forms, not charged", "[agent]") {
  GraceFixture f;
  f.sup->start();
  f.sup->onMembershipChange(/*declared_dead=*/true);
  f.clock.advance(std::chrono::milliseconds(300));
  f.sup->onWorkerExit(f.current()[1], ExitStatus{false, 1});  // its peer's connection reset
  CHECK(f.sup->state() == AgentState::kStopping);
  CHECK(f.launcher.signalsSent(SIGTERM) == 1);
  f.sup->onWorkerExit(f.current()[0], ExitStatus{true, SIGTERM});
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.sup->restartCount() == 0);
  CHECK(f.rdzv.failures == 0);
  CHECK(f.rdzv.joins == 2);
}

TEST_CASE("a round superseded while it was on its way starts no workers, the newer one does",
          "[agent]") {
  // The membership change (a node left during the job-identity check) came while the supervisor
  // waited for the round, so no worker could be stopped for it.
  Fixture f(2, /*max_restarts=*/0);
  f.rdzv.hold = true;
  f.sup->start();
  f.sup->onMembershipChange();  // in RENDEZVOUS: nothing to stop
  f.rdzv.forming = 1;           // round 1 is forming, and round 0 arrives
  auto first = std::move(f.rdzv.pending);
  agent::RoundInfo r0 = f.rdzv.round;
  r0.round = 0;
  first(r0);
  CHECK(f.launcher.pids().empty());
  CHECK(f.sup->state() == AgentState::kRendezvous);
  REQUIRE(f.rdzv.joins == 2);
  agent::RoundInfo r1 = f.rdzv.round;
  r1.round = 1;
  f.rdzv.pending(r1);
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.launcher.pids().size() == 2);
  CHECK(f.sup->restartCount() == 0);
}

TEST_CASE("a worker that cannot be started fails the attempt", "[agent]") {
  Fixture f(2, /*max_restarts=*/0);
  f.launcher.fail_local_ranks = {1};
  f.sup->start();
  CHECK(f.sup->state() == AgentState::kStopping);
  f.sup->onWorkerExit(f.launcher.pids()[0], ExitStatus{true, SIGTERM});
  CHECK(f.sup->state() == AgentState::kFailed);
  REQUIRE(f.sup->failures().size() == 1);
  CHECK(f.sup->failures()[0].exit.code == 127);
}

TEST_CASE("a rendezvous error fails the agent with its reason", "[agent]") {
  Fixture f;
  f.rdzv.hold = true;
  f.sup->start();
  f.rdzv.pending(failedPrecondition("run x is closed"));
  CHECK(f.sup->state() == AgentState::kFailed);
  CHECK(f.sup->exitCode() == 1);
  CHECK(f.sup->errorMessage().find("run x is closed") != std::string::npos);
}

TEST_CASE("exits of unknown pids are ignored", "[agent]") {
  Fixture f;
  f.sup->start();
  f.sup->onWorkerExit(424242, ExitStatus{false, 1});
  CHECK(f.sup->state() == AgentState::kRunning);
}

TEST_CASE("a failure on another node restarts this node's workers, charged once", "[agent]") {
  Fixture f(2, /*max_restarts=*/1);
  f.sup->start();
  f.sup->onPeerFailure(agent::FailureKind::kWorkers);
  CHECK(f.sup->state() == AgentState::kStopping);
  CHECK(f.rdzv.failures == 0);  // not ours to report
  f.sup->onPeerFailure(
      agent::FailureKind::kWorkers);  // the same failure seen twice is still one restart
  f.exitAll(143);
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.sup->restartCount() == 1);
  // Budget spent: the next failure elsewhere ends this node too, with a reason to show.
  f.sup->onPeerFailure(agent::FailureKind::kWorkers);
  f.exitAll(143);
  CHECK(f.sup->state() == AgentState::kFailed);
  CHECK(f.sup->exitCode() == 1);
  CHECK(f.sup->failures().empty());
  CHECK(f.sup->errorMessage().find("another node failed") != std::string::npos);
}

TEST_CASE("a peer failure while this node is already stopping is ignored", "[agent]") {
  Fixture f(2, /*max_restarts=*/2);
  f.sup->start();
  f.sup->onWorkerExit(f.current()[0], ExitStatus{false, 1});
  f.sup->onPeerFailure(agent::FailureKind::kWorkers);
  f.sup->onWorkerExit(f.current()[1], ExitStatus{true, SIGTERM});
  CHECK(f.sup->restartCount() == 1);
  CHECK(f.sup->state() == AgentState::kRunning);
}

TEST_CASE("with a failure grace, a membership change right after a crash makes it free",
          "[agent]") {
  Fixture f(2, /*max_restarts=*/0, std::chrono::milliseconds(500));
  f.sup->start();
  f.sup->onWorkerExit(f.current()[0], ExitStatus{false, 1});  // peer's socket went away
  CHECK(f.sup->state() == AgentState::kStopping);
  CHECK(f.rdzv.failures == 0);  // not reported yet
  f.sup->onWorkerExit(f.current()[1], ExitStatus{true, SIGTERM});
  CHECK(f.sup->state() == AgentState::kStopping);  // waits out the grace
  f.clock.advance(std::chrono::milliseconds(100));
  f.sup->onMembershipChange();  // the rendezvous says the peer left
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.sup->restartCount() == 0);
  CHECK(f.rdzv.failures == 0);
  CHECK(f.rdzv.joins == 2);
}

TEST_CASE("with a failure grace, a crash with no membership change is reported and charged",
          "[agent]") {
  Fixture f(2, /*max_restarts=*/1, std::chrono::milliseconds(500));
  f.sup->start();
  f.sup->onWorkerExit(f.current()[0], ExitStatus{false, 1});
  f.sup->onWorkerExit(f.current()[1], ExitStatus{true, SIGTERM});
  REQUIRE(f.sup->nextDeadline().has_value());
  f.clock.advance(std::chrono::milliseconds(500));
  f.sup->onDeadline();
  CHECK(f.rdzv.failures == 1);
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.sup->restartCount() == 1);
}

// Hang detection (SPEC §6): a stale DDPRUN_HEARTBEAT_FILE is a failure like a non-zero exit.

TEST_CASE("heartbeat checks run every quarter timeout, at most 1 s and at least 10 ms", "[agent]") {
  using std::chrono::milliseconds;
  CHECK(heartbeatCheckInterval(std::chrono::seconds(300)) == std::chrono::seconds(1));
  CHECK(heartbeatCheckInterval(std::chrono::seconds(2)) == milliseconds(500));
  CHECK(heartbeatCheckInterval(milliseconds(20)) == milliseconds(10));
}

TEST_CASE("a heartbeat arms on the first touch and measures silence from the last change",
          "[agent]") {
  FakeClock clock;
  Heartbeat hb;
  const auto timeout = std::chrono::seconds(10);
  hb.observe(std::nullopt, clock.now());
  CHECK_FALSE(hb.armed());
  clock.advance(std::chrono::hours(1));
  CHECK_FALSE(hb.hung(clock.now(), timeout));  // never touched: never hung
  hb.observe(5, clock.now());
  CHECK(hb.armed());
  clock.advance(std::chrono::seconds(8));
  hb.observe(5, clock.now());  // unchanged
  CHECK(hb.silentFor(clock.now()) == std::chrono::seconds(8));
  hb.observe(6, clock.now());  // touched again
  CHECK(hb.silentFor(clock.now()) == Duration::zero());
  clock.advance(std::chrono::seconds(10));
  CHECK_FALSE(hb.hung(clock.now(), timeout));  // exactly the timeout is not past it
  hb.observe(std::nullopt, clock.now());       // the file vanished: still armed, still silent
  clock.advance(std::chrono::milliseconds(1));
  CHECK(hb.hung(clock.now(), timeout));
  CHECK_FALSE(hb.hung(clock.now(), Duration::zero()));  // 0 disables
  CHECK(hangMessage(std::chrono::milliseconds(12000), timeout) ==
        "worker hung: no heartbeat for 12.0 s (timeout 10 s)");
  // Rounded up: just past the timeout never reads as the timeout itself.
  CHECK(hangMessage(timeout + std::chrono::nanoseconds(1), timeout) ==
        "worker hung: no heartbeat for 10.1 s (timeout 10 s)");
  CHECK(hangMessage(std::chrono::milliseconds(2500), std::chrono::milliseconds(1500)) ==
        "worker hung: no heartbeat for 2.5 s (timeout 1.5 s)");
}

TEST_CASE("a worker whose heartbeat goes stale is stopped and the group restarts, charged",
          "[agent]") {
  Fixture f(2, /*max_restarts=*/1, Duration::zero(), std::chrono::seconds(10));
  f.sup->start();
  const auto first = f.current();
  // Checked every min(1 s, timeout/4).
  REQUIRE(f.sup->nextDeadline() == f.clock.now() + std::chrono::seconds(1));
  const std::string hb0 = Fixture::heartbeatFile(0, 0), hb1 = Fixture::heartbeatFile(0, 1);
  f.heartbeats.touch(hb1);  // rank 1 takes one step, then hangs; rank 0 keeps stepping
  // Rank 1's touch is seen at the first check (t=1 s); at t=11 s it has been silent for exactly
  // the timeout, which is not yet past it.
  f.runFor(std::chrono::seconds(11), std::chrono::seconds(1), [&] { f.heartbeats.touch(hb0); });
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.launcher.signals.empty());
  f.runFor(std::chrono::seconds(1), std::chrono::seconds(1), [&] { f.heartbeats.touch(hb0); });
  // The same path as a worker exiting non-zero: SIGTERM to the group, reported to the rendezvous;
  // and the hung worker SIGKILL at once (it may not be able to act on SIGTERM).
  CHECK(f.sup->state() == AgentState::kStopping);
  CHECK(f.launcher.signalsSent(SIGTERM) == 2);
  CHECK(f.launcher.signalsSent(SIGKILL) == 1);
  CHECK(f.launcher.signals.front() == std::make_pair(first[1], SIGKILL));
  CHECK(f.rdzv.failures == 1);
  REQUIRE(f.sup->failures().size() == 1);
  const WorkerFailure hung = f.sup->failures()[0];
  CHECK(hung.local_rank == 1);
  CHECK(hung.pid == first[1]);
  CHECK(hung.hang == "worker hung: no heartbeat for 11.0 s (timeout 10 s)");
  // While stopping, nobody looks at heartbeats any more; the next deadline is the SIGKILL.
  const int looks = f.heartbeats.looks;
  CHECK(f.sup->nextDeadline() == f.clock.now() + std::chrono::seconds(5));
  f.sup->onWorkerExit(first[0], ExitStatus{true, SIGTERM});
  f.sup->onWorkerExit(first[1], ExitStatus{true, SIGTERM});
  CHECK(f.heartbeats.looks == looks);
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.sup->restartCount() == 1);
  CHECK(f.rounds_planned.back().second == 1);
  // The new attempt's workers start unarmed: silence alone does not flag them.
  f.runFor(std::chrono::seconds(60), std::chrono::seconds(1));
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.sup->restartCount() == 1);
}

TEST_CASE("a hung worker past the budget fails the agent with the hang in its failure", "[agent]") {
  Fixture f(1, /*max_restarts=*/0, Duration::zero(), std::chrono::seconds(2));
  f.sup->start();
  const int pid = f.current()[0];
  f.heartbeats.touch(Fixture::heartbeatFile(0, 0));
  f.runFor(std::chrono::seconds(3), std::chrono::milliseconds(500));
  REQUIRE(f.sup->state() == AgentState::kStopping);
  // Hung: SIGKILL at once, not after the shutdown timeout; the report shows that exit.
  CHECK(f.launcher.signalsSent(SIGKILL) == 1);
  CHECK(f.sup->nextDeadline() <= f.clock.now() + std::chrono::seconds(5));
  f.sup->onWorkerExit(pid, ExitStatus{true, SIGKILL});
  CHECK(f.sup->state() == AgentState::kFailed);
  CHECK(f.sup->exitCode() == 1);
  REQUIRE(f.sup->failures().size() == 1);
  CHECK(f.sup->failures()[0].hang.find("worker hung: no heartbeat for 2.") == 0);
  CHECK(f.sup->failures()[0].exit.signaled);
  CHECK(f.sup->failures()[0].exit.code == SIGKILL);
}

TEST_CASE("workers that never touch their heartbeat file are never flagged", "[agent]") {
  Fixture f(2, /*max_restarts=*/0, Duration::zero(), std::chrono::seconds(2));
  f.sup->start();
  f.runFor(std::chrono::seconds(120), std::chrono::milliseconds(500));
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.launcher.signals.empty());
  CHECK(f.heartbeats.looks > 0);
  f.exitAll(0);
  CHECK(f.sup->state() == AgentState::kSucceeded);
  CHECK_FALSE(f.sup->nextDeadline().has_value());
}

TEST_CASE("a zero heartbeat timeout turns hang detection off", "[agent]") {
  Fixture f(1, /*max_restarts=*/0, Duration::zero(), Duration::zero());
  f.sup->start();
  f.heartbeats.touch(Fixture::heartbeatFile(0, 0));
  CHECK_FALSE(f.sup->nextDeadline().has_value());  // no timer at all
  f.runFor(std::chrono::hours(1), std::chrono::minutes(1));
  CHECK(f.heartbeats.looks == 0);
  CHECK(f.sup->state() == AgentState::kRunning);
}

TEST_CASE("with a failure grace, a hang is reported once the grace has passed", "[agent]") {
  Fixture f(1, /*max_restarts=*/1, std::chrono::seconds(1), std::chrono::seconds(2));
  f.sup->start();
  f.heartbeats.touch(Fixture::heartbeatFile(0, 0));
  f.runFor(std::chrono::seconds(3), std::chrono::milliseconds(500));
  REQUIRE(f.sup->state() == AgentState::kStopping);
  CHECK(f.rdzv.failures == 0);  // within the grace
  f.sup->onWorkerExit(f.current()[0], ExitStatus{true, SIGTERM});
  f.runFor(std::chrono::seconds(1), std::chrono::milliseconds(500));
  CHECK(f.rdzv.failures == 1);
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.sup->restartCount() == 1);
}

TEST_CASE("agent waits in the exit barrier once every worker succeeded, then succeeds",
          "[agent][barrier]") {
  Fixture f(2, 0, Duration::zero(), Duration::zero(), std::chrono::seconds(42));
  f.rdzv.hold_barrier = true;
  f.sup->start();
  f.exitAll(0);
  CHECK(f.sup->state() == AgentState::kExitBarrier);
  CHECK_FALSE(f.sup->finished());
  CHECK(f.rdzv.barriers == 1);
  CHECK(f.rdzv.barrier_timeout == std::chrono::seconds(42));
  REQUIRE(f.sup->nextDeadline().has_value());
  CHECK(*f.sup->nextDeadline() == f.clock.now() + std::chrono::seconds(42));
  f.rdzv.pending_barrier(Status::ok());
  CHECK(f.sup->state() == AgentState::kSucceeded);
  CHECK(f.sup->exitCode() == 0);
  CHECK_FALSE(f.sup->nextDeadline().has_value());
}

TEST_CASE("the exit barrier ends at its timeout when the rendezvous never answers",
          "[agent][barrier]") {
  Fixture f(1, 0, Duration::zero(), Duration::zero(), std::chrono::seconds(10));
  f.rdzv.hold_barrier = true;
  f.sup->start();
  f.exitAll(0);
  f.runFor(std::chrono::seconds(9), std::chrono::seconds(1));
  CHECK(f.sup->state() == AgentState::kExitBarrier);
  f.runFor(std::chrono::seconds(2), std::chrono::seconds(1));
  CHECK(f.sup->state() == AgentState::kSucceeded);
  CHECK(f.sup->exitCode() == 0);
  // The rendezvous' late answer changes nothing.
  f.rdzv.pending_barrier(unavailable("gone"));
  CHECK(f.sup->state() == AgentState::kSucceeded);
}

TEST_CASE("an exit barrier that ends in an error still succeeds", "[agent][barrier]") {
  Fixture f(1);
  f.rdzv.hold_barrier = true;
  f.sup->start();
  f.exitAll(0);
  f.rdzv.pending_barrier(unavailable("rendezvous gone"));
  CHECK(f.sup->state() == AgentState::kSucceeded);
  CHECK(f.sup->exitCode() == 0);
}

TEST_CASE("a terminating signal in the exit barrier leaves the run and exits 128+signal",
          "[agent][barrier]") {
  Fixture f(2);
  f.rdzv.hold_barrier = true;
  f.sup->start();
  f.exitAll(0);
  f.sup->onSignal(SIGUSR1);  // not terminating: nothing to forward, still waiting
  CHECK(f.sup->state() == AgentState::kExitBarrier);
  f.sup->onSignal(SIGTERM);
  CHECK(f.sup->state() == AgentState::kFailed);
  CHECK(f.sup->exitCode() == 128 + SIGTERM);
  CHECK(f.sup->leftRun());
  CHECK(f.rdzv.leaves == 1);
  CHECK(f.launcher.signals.empty());
  f.rdzv.pending_barrier(Status::ok());
  CHECK(f.sup->state() == AgentState::kFailed);
}

TEST_CASE("membership changes and peer failures do not disturb the exit barrier",
          "[agent][barrier]") {
  Fixture f(2, /*max_restarts=*/3);
  f.rdzv.hold_barrier = true;
  f.sup->start();
  f.exitAll(0);
  f.sup->onMembershipChange();
  f.sup->onPeerFailure(agent::FailureKind::kWorkers);
  CHECK(f.sup->state() == AgentState::kExitBarrier);
  CHECK(f.rdzv.joins == 1);
  CHECK(f.sup->restartCount() == 0);
  f.rdzv.pending_barrier(Status::ok());
  CHECK(f.sup->state() == AgentState::kSucceeded);
}

TEST_CASE("an exit barrier another node abandoned for a newer round joins it, not charged",
          "[agent][barrier]") {
  Fixture f(2, /*max_restarts=*/0, Duration::zero(), Duration::zero(), std::chrono::seconds(42));
  f.rdzv.hold_barrier = true;
  f.sup->start();
  f.exitAll(0);
  REQUIRE(f.sup->state() == AgentState::kExitBarrier);
  f.rdzv.pending_barrier(agent::roundAbandoned("node b went on"));
  // Its workers start again with the others' in the newer round; no worker of its own failed.
  CHECK(f.rdzv.joins == 2);
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.sup->restartCount() == 0);
  CHECK(f.launcher.spawned.size() == 4);
  // The old barrier's deadline is gone with it.
  f.runFor(std::chrono::seconds(43), std::chrono::seconds(1));
  CHECK(f.sup->state() == AgentState::kRunning);
  f.exitAll(0);
  CHECK(f.sup->state() == AgentState::kExitBarrier);
  CHECK(f.rdzv.barriers == 2);
  f.rdzv.pending_barrier(Status::ok());
  CHECK(f.sup->state() == AgentState::kSucceeded);
  CHECK(f.sup->exitCode() == 0);
}

TEST_CASE("a run closed while a node re-joined from its exit barrier ends that node with success",
          "[agent][barrier]") {
  Fixture f(2);
  f.rdzv.hold_barrier = true;
  f.sup->start();
  f.exitAll(0);
  f.rdzv.hold = true;
  f.rdzv.pending_barrier(agent::roundAbandoned("node b went on"));
  REQUIRE(f.rdzv.joins == 2);
  SECTION("closed: the others ended the job, and this node's workers had all succeeded") {
    f.rdzv.pending(rendezvous::runClosed("job"));
    CHECK(f.sup->state() == AgentState::kSucceeded);
    CHECK(f.sup->exitCode() == 0);
  }
  SECTION("any other error (the round never formed): exiting anyway, as the barrier does") {
    f.rdzv.pending(deadlineExceeded("join_timeout expired waiting for 2 nodes"));
    CHECK(f.sup->state() == AgentState::kSucceeded);
    CHECK(f.sup->exitCode() == 0);
    CHECK_FALSE(f.sup->leftRun());
  }
}

TEST_CASE("a round re-joined from the exit barrier must form within the barrier's time",
          "[agent][barrier]") {
  Fixture f(2, 0, Duration::zero(), Duration::zero(), std::chrono::seconds(42));
  f.rdzv.hold_barrier = true;
  f.sup->start();
  f.exitAll(0);
  f.runFor(std::chrono::seconds(30), std::chrono::seconds(1));
  f.rdzv.hold = true;
  f.rdzv.pending_barrier(agent::roundAbandoned("node b went on"));
  REQUIRE(f.rdzv.joins == 2);
  SECTION("it does not: the node leaves the run and succeeds") {
    f.runFor(std::chrono::seconds(11), std::chrono::seconds(1));
    CHECK(f.sup->state() == AgentState::kRendezvous);
    f.runFor(std::chrono::seconds(2), std::chrono::seconds(1));
    CHECK(f.sup->state() == AgentState::kSucceeded);
    CHECK(f.sup->exitCode() == 0);
    CHECK(f.rdzv.leaves == 1);
    CHECK(f.sup->leftRun());
    agent::RoundInfo late = f.rdzv.round;
    f.rdzv.pending(late);  // the join's late answer changes nothing
    CHECK(f.sup->state() == AgentState::kSucceeded);
    CHECK(f.launcher.spawned.size() == 2);
  }
  SECTION("it does: the workers run with no deadline but their own") {
    agent::RoundInfo r = f.rdzv.round;
    r.round = 1;
    f.rdzv.pending(r);
    CHECK(f.sup->state() == AgentState::kRunning);
    CHECK_FALSE(f.sup->nextDeadline().has_value());
    f.runFor(std::chrono::seconds(20), std::chrono::seconds(1));
    CHECK(f.sup->state() == AgentState::kRunning);
  }
}

TEST_CASE("a run closed before a node's first round fails it", "[agent][barrier]") {
  Fixture f(2);
  f.rdzv.hold = true;
  f.sup->start();
  f.rdzv.pending(rendezvous::runClosed("job"));
  CHECK(f.sup->state() == AgentState::kFailed);
  CHECK(f.sup->exitCode() == 1);
  CHECK(rendezvous::isRunClosed(rendezvous::runClosed("job")));
  CHECK_FALSE(rendezvous::isRunClosed(failedPrecondition("run job has other settings")));
  CHECK_FALSE(rendezvous::isRunClosed(Status(StatusCode::kUnavailable, "run job is closed")));
}

TEST_CASE(
    "in a multi-node job, an exit 0 after a peer's checkpoint stop re-forms instead of "
    "succeeding",
    "[agent][peer-stop]") {
  Fixture f(2, /*max_restarts=*/0, std::chrono::seconds(1), Duration::zero(),
            std::chrono::seconds(300), /*multi_node=*/true);
  f.sup->start();
  const auto first = f.current();
  f.heartbeats.touch(Fixture::stopFile(0, 0));
  f.heartbeats.touch(Fixture::stopFile(0, 1));
  f.sup->onWorkerExit(first[0], ExitStatus{false, 0});
  CHECK(f.sup->state() == AgentState::kStopping);
  CHECK(f.rdzv.barriers == 0);
  f.sup->onWorkerExit(first[1], ExitStatus{false, 0});
  CHECK(f.sup->state() == AgentState::kRunning);  // the next round, free of charge
  CHECK(f.rdzv.joins == 2);
  CHECK(f.sup->restartCount() == 0);
  CHECK(f.rdzv.failures == 0);
  // The next round's workers finish for real (the shell removed the old stop files): success.
  f.heartbeats.mtimes.clear();
  f.exitAll(0);
  CHECK(f.sup->state() == AgentState::kSucceeded);
}

TEST_CASE("a checkpoint signal this agent forwarded makes the exit 0 that follows a success",
          "[agent][peer-stop]") {
  Fixture f(2, 0, std::chrono::seconds(1), Duration::zero(), std::chrono::seconds(300),
            /*multi_node=*/true);
  f.sup->start();
  f.sup->onSignal(SIGUSR1);
  f.heartbeats.touch(Fixture::stopFile(0, 0));
  f.heartbeats.touch(Fixture::stopFile(0, 1));
  f.exitAll(0);
  CHECK(f.sup->state() == AgentState::kSucceeded);
  CHECK(f.rdzv.joins == 1);
}

TEST_CASE("a single-node job takes a stopped worker's exit 0 as it always did",
          "[agent][peer-stop]") {
  Fixture f(2);
  f.sup->start();
  f.heartbeats.touch(Fixture::stopFile(0, 0));
  f.heartbeats.touch(Fixture::stopFile(0, 1));
  f.exitAll(0);
  CHECK(f.sup->state() == AgentState::kSucceeded);
}

TEST_CASE(
    "every worker that failed by the time the group stopped is a failure, not only the "
    "first",
    "[agent]") {
  Fixture f(4);
  f.sup->start();
  const auto pids = f.current();
  f.sup->onWorkerExit(pids[2], ExitStatus{false, 1});  // the root cause
  REQUIRE(f.sup->state() == AgentState::kStopping);
  f.sup->onWorkerExit(pids[0], ExitStatus{false, 7});          // failed on its own meanwhile
  f.sup->onWorkerExit(pids[1], ExitStatus{true, SIGTERM});     // merely stopped
  f.runFor(std::chrono::seconds(6), std::chrono::seconds(1));  // past the shutdown timeout
  f.sup->onWorkerExit(pids[3], ExitStatus{true, SIGKILL});     // killed by us
  CHECK(f.sup->state() == AgentState::kFailed);
  REQUIRE(f.sup->failures().size() == 2);
  CHECK(f.sup->failures()[0].local_rank == 2);
  CHECK(f.sup->failures()[1].local_rank == 0);
  CHECK(f.sup->failures()[1].exit.code == 7);
}

TEST_CASE("a worker that is not reaped after SIGKILL is given up, its guardian ended", "[agent]") {
  // Its guardian was stopped (SIGSTOP): the worker's exit never reached the agent, which waited
  // for ever after "sending SIGKILL".
  Fixture f(2, /*max_restarts=*/0);
  f.sup->start();
  const auto pids = f.current();
  f.sup->onWorkerExit(pids[0], ExitStatus{false, 1});  // one fails: the group is stopped
  REQUIRE(f.sup->state() == AgentState::kStopping);
  f.runFor(std::chrono::seconds(5), std::chrono::milliseconds(500));  // the shutdown timeout
  CHECK(f.launcher.signalsSent(SIGKILL) == 1);
  CHECK(f.launcher.forced.empty());
  // 10 s more (reap_timeout) and it is given up: the launcher ends its guardian.
  REQUIRE(f.sup->nextDeadline().has_value());
  f.runFor(std::chrono::seconds(11), std::chrono::milliseconds(500));
  CHECK(f.launcher.forced == std::vector<int>{pids[1]});
  CHECK(f.sup->state() == AgentState::kFailed);
  CHECK(f.sup->exitCode() == 1);
  f.sup->onWorkerExit(pids[1], ExitStatus{true, SIGKILL});  // its late exit changes nothing
  CHECK(f.sup->state() == AgentState::kFailed);
}

TEST_CASE("a hung worker under a guardian that does not answer is given up after the reap bound",
          "[agent]") {
  Fixture f(1, /*max_restarts=*/0, Duration::zero(), std::chrono::seconds(2));
  f.sup->start();
  const int pid = f.current()[0];
  f.heartbeats.touch(Fixture::heartbeatFile(0, 0));
  f.runFor(std::chrono::seconds(3), std::chrono::milliseconds(500));
  REQUIRE(f.sup->state() == AgentState::kStopping);
  CHECK(f.launcher.signalsSent(SIGKILL) == 1);  // at once
  f.runFor(std::chrono::seconds(11), std::chrono::milliseconds(500));
  CHECK(f.launcher.forced == std::vector<int>{pid});
  CHECK(f.sup->state() == AgentState::kFailed);
  REQUIRE(f.sup->failures().size() == 1);
  CHECK(f.sup->failures()[0].exit.signaled);
  CHECK(f.sup->failures()[0].exit.code == SIGKILL);
}
