// The supervisor's in-place recovery (--restart-mode=in-place; docs/in-place-recovery.md §2):
// a failed worker is replaced alone while the others re-form; whatever goes wrong falls back to
// restarting every worker, and a failure is charged once either way.
#include <catch2/catch.hpp>
#include <csignal>
#include <map>

#include "agent_metrics.h"
#include "ddprun/agent/supervisor.h"
#include "fake_clock.h"
#include "fake_control_channel.h"
#include "fake_heartbeat_probe.h"
#include "fake_process_launcher.h"
#include "fake_rendezvous.h"
#include "log_capture.h"

using namespace ddprun;
using namespace ddprun::agent;
using ddprun::testing::FakeClock;
using ddprun::testing::FakeControlChannel;
using ddprun::testing::FakeHeartbeatProbe;
using ddprun::testing::FakeProcessLauncher;
using ddprun::testing::FakeRendezvous;
using ddprun::testing::LogCapture;

namespace {

struct InPlaceFixture {
  explicit InPlaceFixture(int nproc = 3, int max_restarts = 1, bool multi_node = false,
                          Duration heartbeat_timeout = Duration::zero()) {
    rdzv.round.local_world_sizes = {nproc};
    rdzv.round.master_addr = "127.0.0.1";
    rdzv.round.master_port = 29500;
    SupervisorOptions opts;
    opts.max_restarts = max_restarts;
    opts.shutdown_timeout = std::chrono::seconds(5);
    opts.multi_node = multi_node;
    opts.restart_in_place = true;
    opts.inplace_timeout = std::chrono::seconds(10);
    opts.heartbeat_timeout = heartbeat_timeout;
    opts.failure_grace = multi_node ? Duration(std::chrono::seconds(1)) : Duration::zero();
    sup = std::make_unique<Supervisor>(
        opts, launcher, rdzv, clock,
        [this, heartbeat_timeout](const RoundInfo& r, int restarts) {
          planned.push_back(restarts);
          std::vector<WorkerLaunch> out;
          for (int i = 0; i < r.local_world_sizes[0]; ++i) {
            WorkerLaunch w;
            w.local_rank = i;
            w.global_rank = i;
            w.argv = {"/bin/train"};
            if (heartbeat_timeout > Duration::zero()) {
              w.heartbeat_file = "/hb/" + std::to_string(restarts) + "/" + std::to_string(i);
            }
            out.push_back(w);
          }
          return StatusOr<std::vector<WorkerLaunch>>(out);
        },
        &heartbeats, &channel);
    sup->setRecoveryListener([this](const InPlaceRecovery& r) { recoveries.push_back(r); });
  }
  // The phases of completed recovery i, by name.
  std::map<std::string, double> phasesOf(size_t i) const {
    return std::map<std::string, double>(recoveries.at(i).phases_ms.begin(),
                                         recoveries.at(i).phases_ms.end());
  }
  std::vector<int> first() const {
    auto all = launcher.pids();
    return std::vector<int>(all.begin(), all.begin() + rdzv.round.local_world_sizes[0]);
  }
  void say(int pid, ControlType type, std::map<std::string, std::string> fields) {
    sup->onControlMessage(pid, makeControl(type, std::move(fields)));
  }
  void hello(int pid) {
    say(pid, ControlType::kHello, {{"v", "1"}, {"pid", std::to_string(pid)}, {"caps", ""}});
  }
  // Worker `pid` says hello and that it can recover in place.
  void capable(int pid) {
    hello(pid);
    say(pid, ControlType::kCaps, {{"add", "inplace"}});
  }
  // Every worker does.
  void allCapable() {
    for (int pid : first()) capable(pid);
  }
  // Each of `pids` completed a step in generation `gen` (the last ends the recovery).
  void stepped(const std::vector<int>& pids, int gen) {
    for (int pid : pids) say(pid, ControlType::kStep, {{"gen", std::to_string(gen)}});
  }
  // Starts the workers, all capable, and kills the last one: a recovery begins. The first pids.
  std::vector<int> startThenLoseLast() {
    sup->start();
    allCapable();
    const auto pids = first();
    sup->onWorkerExit(pids.back(), ExitStatus{true, SIGKILL});
    REQUIRE(sup->state() == AgentState::kRecovering);
    return pids;
  }
  void fireDeadlines() {
    while (sup->nextDeadline() && *sup->nextDeadline() <= clock.now()) {
      const auto before = sup->nextDeadline();
      sup->onDeadline();
      if (sup->nextDeadline() == before) break;
    }
  }

  FakeClock clock;
  FakeHeartbeatProbe heartbeats;
  FakeProcessLauncher launcher;
  FakeRendezvous rdzv;
  FakeControlChannel channel;
  std::vector<int> planned;
  std::vector<InPlaceRecovery> recoveries;  // completed, in order
  std::unique_ptr<Supervisor> sup;
};

}  // namespace

TEST_CASE("in-place: hello is answered with the generation to form and the recovery bound",
          "[agent][inplace]") {
  InPlaceFixture f;
  f.sup->start();
  const int pid = f.first()[0];
  f.say(pid, ControlType::kHello, {{"v", "7"}, {"pid", std::to_string(pid)}, {"caps", ""}});
  auto welcome = f.channel.to(pid, ControlType::kWelcome);
  REQUIRE(welcome.size() == 1);
  CHECK(welcome[0].num("v") == 1);  // the lower of the two versions
  CHECK(welcome[0].num("gen") == 1);
  CHECK(welcome[0].num("timeout_ms") == 10000);
  // Not one of this attempt's workers: ignored.
  f.say(99999, ControlType::kHello, {{"v", "1"}, {"pid", "99999"}, {"caps", ""}});
  CHECK(f.channel.to(99999, ControlType::kWelcome).empty());
  CHECK(f.sup->isRunningWorker(pid));
  CHECK_FALSE(f.sup->isRunningWorker(99999));
}

TEST_CASE("in-place: a failed worker is replaced alone, the others are told to abort and re-form",
          "[agent][inplace]") {
  InPlaceFixture f;
  f.sup->start();
  f.allCapable();
  const auto pids = f.first();
  f.sup->onWorkerExit(pids[2], ExitStatus{true, SIGKILL});
  CHECK(f.sup->state() == AgentState::kRecovering);
  CHECK(f.sup->restartCount() == 1);  // charged once, at the start
  CHECK(f.launcher.signals.empty());  // no survivor is stopped
  CHECK(f.rdzv.joins == 1);           // no new round on a single node
  REQUIRE(f.launcher.spawned.size() == 4);
  CHECK(f.launcher.spawned.back().second.local_rank == 2);
  CHECK(f.planned.back() == 1);  // the replacement's TORCHELASTIC_RESTART_COUNT
  for (int survivor : {pids[0], pids[1]}) {
    auto abort = f.channel.to(survivor, ControlType::kAbort);
    REQUIRE(abort.size() == 1);
    CHECK(abort[0].num("gen") == 1);
    CHECK(abort[0].str("reason") == "failure");
    auto group = f.channel.to(survivor, ControlType::kGroup);
    REQUIRE(group.size() == 1);
    CHECK(group[0].num("gen") == 2);
    CHECK(group[0].num("world") == 3);
    CHECK(group[0].num("rank") == (survivor == pids[0] ? 0 : 1));
    CHECK(group[0].str("prefix") == "g2");
    CHECK(group[0].num("port") == 29500);
  }
  // The replacement's hello names the new generation.
  const int newcomer = f.launcher.spawned.back().first;
  f.say(newcomer, ControlType::kHello,
        {{"v", "1"}, {"pid", std::to_string(newcomer)}, {"caps", ""}});
  REQUIRE(f.channel.to(newcomer, ControlType::kWelcome).size() == 1);
  CHECK(f.channel.to(newcomer, ControlType::kWelcome)[0].num("gen") == 2);
  // Its program built its model 80 ms later: the Trainer's caps end the replacement's start-up.
  f.clock.advance(std::chrono::milliseconds(80));
  f.say(newcomer, ControlType::kCaps, {{"add", "inplace"}});
  f.clock.advance(std::chrono::milliseconds(20));
  f.say(newcomer, ControlType::kCaps, {{"add", "inplace"}});  // (only the first one counts)
  // Back to RUNNING once every worker completed a step in generation 2 (an old one's is not it).
  f.say(pids[0], ControlType::kStep, {{"gen", "1"}, {"n", "12"}});
  f.say(pids[0], ControlType::kStep, {{"gen", "2"}, {"n", "13"}});
  f.say(pids[1], ControlType::kStep, {{"gen", "2"}, {"n", "13"}});
  CHECK(f.sup->state() == AgentState::kRecovering);
  f.say(newcomer, ControlType::kStep, {{"gen", "2"}, {"n", "13"}});
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.sup->recoveredInPlace() == 1);
  CHECK_FALSE(f.sup->nextDeadline().has_value());  // no recovery deadline left
  REQUIRE(f.recoveries.size() == 1);
  auto phases = f.phasesOf(0);
  CHECK(phases.count("replacement_start") == 1);
  CHECK(phases["replacement_ready"] == Approx(80.0));
  CHECK(phases["first_step"] == Approx(100.0));
  // The job then ends as usual.
  for (int pid : {pids[0], pids[1], newcomer}) f.sup->onWorkerExit(pid, ExitStatus{false, 0});
  CHECK(f.sup->state() == AgentState::kSucceeded);
}

TEST_CASE(
    "in-place: a worker's collective that failed before the agent saw why dates the recovery, "
    "only the first of the running generation and only within inplace_timeout",
    "[agent][inplace]") {
  InPlaceFixture f(3, /*max_restarts=*/3);
  f.sup->start();
  f.allCapable();
  const auto pids = f.first();
  auto recoverFrom = [&](int killed, int gen) {
    f.sup->onWorkerExit(killed, ExitStatus{true, SIGKILL});
    REQUIRE(f.sup->state() == AgentState::kRecovering);
    const int newcomer = f.launcher.spawned.back().first;
    f.clock.advance(std::chrono::milliseconds(5));
    for (int pid : f.launcher.pids()) {
      if (f.sup->isRunningWorker(pid)) {
        f.say(pid, ControlType::kStep, {{"gen", std::to_string(gen)}, {"n", "9"}});
      }
    }
    REQUIRE(f.sup->state() == AgentState::kRunning);
    return newcomer;
  };
  LogCapture log("agent");
  // Out of bounds or not of this generation: ignored (a malformed one never gets here).
  f.say(pids[0], ControlType::kFault, {{"gen", "0"}, {"what", "timeout"}});
  f.say(pids[0], ControlType::kFault, {{"gen", "7"}, {"what", "timeout"}});
  f.clock.advance(std::chrono::milliseconds(100));
  // Rank 1's socket to rank 2 closed 30 ms before its agent reaps rank 2; rank 0's report later
  // does not move that.
  f.say(pids[1], ControlType::kFault, {{"gen", "1"}, {"what", "peer_closed"}});
  f.clock.advance(std::chrono::milliseconds(20));
  f.say(pids[0], ControlType::kFault, {{"gen", "1"}, {"what", "timeout"}});
  f.clock.advance(std::chrono::milliseconds(10));
  const int newcomer = recoverFrom(pids[2], 2);
  auto phases = f.phasesOf(0);
  CHECK(phases["detected"] == Approx(30.0));
  CHECK(phases["told"] == Approx(30.0));
  CHECK(phases["first_step"] == Approx(35.0));
  CHECK(log.count("seen at unix time 1700001000.100: local rank 1's collective failed first "
                  "(peer_closed), 30 ms earlier)") == 1);

  // The next failure, with a fault of the generation that ended (and one sent while recovering):
  // the agent's own detection.
  f.say(pids[0], ControlType::kFault, {{"gen", "1"}, {"what", "other"}});
  f.sup->onWorkerExit(newcomer, ExitStatus{true, SIGKILL});
  f.say(pids[0], ControlType::kFault, {{"gen", "3"}, {"what", "other"}});
  f.clock.advance(std::chrono::milliseconds(5));
  for (int pid : f.launcher.pids()) {
    if (f.sup->isRunningWorker(pid)) f.say(pid, ControlType::kStep, {{"gen", "3"}, {"n", "9"}});
  }
  REQUIRE(f.sup->state() == AgentState::kRunning);
  CHECK(f.phasesOf(1).count("detected") == 0);
  CHECK(f.phasesOf(1)["first_step"] == Approx(5.0));
  CHECK(log.count("failed first") == 1);

  // A fault more than inplace_timeout (10 s) before the failure belongs to no recovery: that
  // worker gave up waiting for a group long ago.
  f.say(pids[0], ControlType::kFault, {{"gen", "3"}, {"what", "timeout"}});
  f.clock.advance(std::chrono::seconds(11));
  recoverFrom(f.launcher.spawned.back().first, 4);
  CHECK(f.phasesOf(2).count("detected") == 0);
  CHECK(f.phasesOf(2)["first_step"] == Approx(5.0));
  CHECK(log.count("failed first") == 1);
  CHECK(f.sup->restartCount() == 3);
}

TEST_CASE("in-place: a worker that did not announce support means a process restart",
          "[agent][inplace]") {
  InPlaceFixture f;
  f.sup->start();
  const auto pids = f.first();
  for (int pid : {pids[0], pids[2]}) f.capable(pid);  // pids[1] never says it can
  LogCapture log("agent");
  f.sup->onWorkerExit(pids[2], ExitStatus{false, 1});
  CHECK(f.sup->state() == AgentState::kStopping);
  CHECK(f.rdzv.failures == 1);
  CHECK(f.channel.sent.size() == 2);  // the welcomes only: no abort, no group
  CHECK(log.count("--restart-mode=in-place: local rank 1 (pid " + std::to_string(pids[1]) +
                  ") did not announce in-place support on DDPRUN_CONTROL_SOCKET") == 1);
}

TEST_CASE("in-place: with the restart budget spent the job fails as in process mode",
          "[agent][inplace]") {
  InPlaceFixture f(3, /*max_restarts=*/0);
  f.sup->start();
  f.allCapable();
  f.sup->onWorkerExit(f.first()[1], ExitStatus{false, 1});
  CHECK(f.sup->state() == AgentState::kStopping);
  for (int pid : {f.first()[0], f.first()[2]}) f.sup->onWorkerExit(pid, ExitStatus{true, SIGTERM});
  CHECK(f.sup->state() == AgentState::kFailed);
  CHECK(f.sup->exitCode() == 1);
}

namespace {

// A started job of `nproc` capable workers whose worker `index` was sent SIGTERM by someone else
// than its agent: it left after the agreed step (`goodbye reason=stop`, exit 0).
std::unique_ptr<InPlaceFixture> oneLeft(int nproc, int max_restarts, int index) {
  auto f = std::make_unique<InPlaceFixture>(nproc, max_restarts);
  f->sup->start();
  f->allCapable();
  const int pid = f->first()[static_cast<size_t>(index)];
  f->say(pid, ControlType::kGoodbye, {{"reason", "stop"}});
  f->sup->onWorkerExit(pid, ExitStatus{false, 0});
  return f;
}

}  // namespace

TEST_CASE(
    "in-place: a worker that left on a signal sent to it alone is replaced like a failed one, "
    "while one that merely finished first is waited for",
    "[agent][inplace]") {
  // Rank 2 left; ranks 0 and 1 re-form in place without it and the agent starts its replacement.
  auto owned = oneLeft(3, /*max_restarts=*/2, 2);
  InPlaceFixture& f = *owned;
  const auto pids = f.first();
  CHECK(f.sup->state() == AgentState::kRecovering);
  CHECK(f.sup->restartCount() == 1);  // charged, as torchrun charges a worker ended by a signal
  CHECK(f.launcher.signals.empty());
  REQUIRE(f.launcher.spawned.size() == 4);
  CHECK(f.launcher.spawned.back().second.local_rank == 2);
  for (int survivor : {pids[0], pids[1]}) {
    CHECK(f.channel.to(survivor, ControlType::kAbort).size() == 1);
    REQUIRE(f.channel.to(survivor, ControlType::kGroup).size() == 1);
    CHECK(f.channel.to(survivor, ControlType::kGroup)[0].num("world") == 3);
  }
  const int newcomer = f.launcher.spawned.back().first;
  for (int pid : {pids[0], pids[1], newcomer}) {
    f.say(pid, ControlType::kStep, {{"gen", "2"}, {"n", "13"}});
  }
  CHECK(f.sup->state() == AgentState::kRunning);
  // Without a goodbye an exit 0 is a worker done before the others: nothing to recover.
  f.sup->onWorkerExit(pids[0], ExitStatus{false, 0});
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.launcher.spawned.size() == 4);
  // Any other goodbye does not count as leaving.
  f.say(pids[1], ControlType::kGoodbye, {{"reason", "done"}});
  f.sup->onWorkerExit(pids[1], ExitStatus{false, 0});
  f.sup->onWorkerExit(newcomer, ExitStatus{false, 0});
  CHECK(f.sup->state() == AgentState::kSucceeded);
}

TEST_CASE(
    "in-place: a failure while another worker's control channel is closed restarts every worker, "
    "and says why",
    "[agent][inplace]") {
  InPlaceFixture f(3, /*max_restarts=*/2);
  f.sup->start();
  f.allCapable();
  const auto pids = f.first();
  f.sup->onControlClosed(pids[2]);  // no goodbye: it cannot hear a group
  LogCapture log("agent");
  f.sup->onWorkerExit(pids[0], ExitStatus{true, SIGKILL});
  CHECK(f.sup->state() == AgentState::kStopping);
  CHECK(f.channel.to(pids[1], ControlType::kAbort).empty());
  CHECK(log.count("no in-place recovery this time: local rank 2 (pid " + std::to_string(pids[2]) +
                  ") closed its DDPRUN_CONTROL_SOCKET connection; restarting every worker") == 1);
  CHECK(log.count("did not announce") == 0);  // it did announce: that is not the reason
  for (int pid : {pids[1], pids[2]}) f.sup->onWorkerExit(pid, ExitStatus{true, SIGTERM});
  CHECK(f.sup->state() == AgentState::kRunning);  // every worker started again
  CHECK(f.sup->restartCount() == 1);

  // Unless that worker has ended, its exit not reaped yet (killed with the first: its channel
  // closed before the agent saw the first exit): it is replaced in the same recovery.
  InPlaceFixture g(3, /*max_restarts=*/2);
  g.sup->start();
  g.allCapable();
  const auto p = g.first();
  g.sup->onControlClosed(p[2]);
  g.heartbeats.ended_pids.insert(p[2]);
  g.sup->onWorkerExit(p[0], ExitStatus{true, SIGKILL});
  REQUIRE(g.sup->state() == AgentState::kRecovering);
  g.sup->onWorkerExit(p[2], ExitStatus{true, SIGKILL});
  CHECK(g.sup->state() == AgentState::kRecovering);
  CHECK(g.sup->restartCount() == 1);
  REQUIRE(g.launcher.spawned.size() == 5);
  CHECK(g.launcher.spawned[3].second.local_rank == 0);
  CHECK(g.launcher.spawned[4].second.local_rank == 2);
  CHECK(g.launcher.signals.empty());
}

TEST_CASE(
    "in-place: a worker that left on a signal when it cannot be replaced in place re-forms every "
    "worker, not charged",
    "[agent][inplace]") {
  auto owned = oneLeft(2, /*max_restarts=*/0, 1);
  InPlaceFixture& f = *owned;
  const auto pids = f.first();
  CHECK(f.sup->state() == AgentState::kStopping);
  f.sup->onWorkerExit(pids[0], ExitStatus{true, SIGTERM});
  CHECK(f.sup->state() == AgentState::kRunning);  // every worker started again
  CHECK(f.sup->restartCount() == 0);
  CHECK(f.launcher.spawned.size() == 4);
}

TEST_CASE(
    "in-place: workers sent SIGTERM together leave at one step and are replaced in one recovery, "
    "charged once",
    "[agent][inplace]") {
  // Ranks 1 and 2 of 4 left at the same agreed step; the agent reaps one (when the other's
  // channel closed already), then the other while the survivors already re-form.
  InPlaceFixture f(4, /*max_restarts=*/1);
  f.sup->start();
  f.allCapable();
  const auto pids = f.first();
  for (int pid : {pids[1], pids[2]}) f.say(pid, ControlType::kGoodbye, {{"reason", "stop"}});
  f.sup->onControlClosed(pids[2]);
  f.sup->onWorkerExit(pids[1], ExitStatus{false, 0});
  REQUIRE(f.sup->state() == AgentState::kRecovering);
  f.sup->onWorkerExit(pids[2], ExitStatus{false, 0});
  CHECK(f.sup->state() == AgentState::kRecovering);
  CHECK(f.sup->restartCount() == 1);
  CHECK(f.launcher.signals.empty());
  REQUIRE(f.launcher.spawned.size() == 6);
  CHECK(f.launcher.spawned[4].second.local_rank == 1);
  CHECK(f.launcher.spawned[5].second.local_rank == 2);
  CHECK(f.planned == std::vector<int>{0, 1, 1});
  const std::vector<int> group{pids[0], pids[3], f.launcher.spawned[4].first,
                               f.launcher.spawned[5].first};
  for (int pid : group) f.say(pid, ControlType::kStep, {{"gen", "2"}, {"n", "13"}});
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.sup->restartCount() == 1);
}

namespace {

// The second of two nodes of two workers each (ranks 2 and 3), every worker capable.
struct TwoNodes : InPlaceFixture {
  // `veto`: the first round's (another node restarts processes; JobIdentityClient).
  explicit TwoNodes(std::string veto = "", Duration heartbeat_timeout = Duration::zero())
      : InPlaceFixture(2, 2, /*multi_node=*/true, heartbeat_timeout) {
    rdzv.round.local_world_sizes = {2, 2};
    rdzv.round.group_rank = 1;
    rdzv.round.in_place_veto = std::move(veto);
    sup->start();
    allCapable();
  }
  // Answers the join held by the rendezvous with round `n` (master port 29500 + n).
  void formRound(int n) {
    REQUIRE(rdzv.pending);
    RoundInfo r = rdzv.round;
    r.round = n;
    r.master_port = 29500 + n;
    auto done = std::move(rdzv.pending);
    rdzv.pending = nullptr;
    done(r);
  }
};

}  // namespace

TEST_CASE(
    "in-place across nodes: a local failure is reported, the next round forms without stopping "
    "the survivors, and the replacement starts in it",
    "[agent][inplace]") {
  TwoNodes f;
  const auto pids = f.first();
  // The group generation is the round + 1, the same on every node.
  CHECK(f.channel.to(pids[0], ControlType::kWelcome).at(0).num("gen") == 1);
  f.rdzv.hold = true;
  f.sup->onWorkerExit(pids[1], ExitStatus{true, SIGKILL});
  CHECK(f.sup->state() == AgentState::kRecovering);
  CHECK(f.sup->restartCount() == 1);
  CHECK(f.rdzv.failures == 1);  // the other nodes learn at once (no failure grace)
  CHECK(f.rdzv.joins == 2);     // the next round, the survivors still running
  CHECK(f.launcher.signals.empty());
  CHECK(f.launcher.spawned.size() == 2);  // the replacement waits for the round's ranks
  REQUIRE(f.channel.to(pids[0], ControlType::kAbort).size() == 1);
  CHECK(f.channel.to(pids[0], ControlType::kAbort)[0].num("gen") == 1);
  CHECK(f.channel.to(pids[0], ControlType::kGroup).empty());
  f.say(pids[0], ControlType::kAborted, {{"gen", "1"}});

  f.formRound(3);
  auto group = f.channel.to(pids[0], ControlType::kGroup);
  REQUIRE(group.size() == 1);
  CHECK(group[0].num("gen") == 4);
  CHECK(group[0].num("rank") == 2);  // this node's first rank: 2 after the other node's 2
  CHECK(group[0].num("world") == 4);
  CHECK(group[0].num("port") == 29503);
  CHECK(group[0].str("prefix") == "g4");
  REQUIRE(f.launcher.spawned.size() == 3);
  CHECK(f.launcher.spawned.back().second.local_rank == 1);
  CHECK(f.planned.back() == 1);
  const int newcomer = f.launcher.spawned.back().first;
  f.say(newcomer, ControlType::kHello,
        {{"v", "1"}, {"pid", std::to_string(newcomer)}, {"caps", ""}});
  CHECK(f.channel.to(newcomer, ControlType::kWelcome).at(0).num("gen") == 4);
  f.say(pids[0], ControlType::kStep, {{"gen", "4"}, {"n", "13"}});
  f.say(newcomer, ControlType::kStep, {{"gen", "4"}, {"n", "13"}});
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.sup->recoveredInPlace() == 1);
  CHECK(f.launcher.signals.empty());
}

TEST_CASE(
    "in-place across nodes: a replacement started for a round that a change of nodes voided is "
    "killed and started again with the next round, the survivor re-forms, charged once",
    "[agent][inplace]") {
  TwoNodes f;
  const auto pids = f.first();
  f.rdzv.hold = true;
  f.sup->onWorkerExit(pids[1], ExitStatus{true, SIGKILL});
  f.formRound(3);
  REQUIRE(f.launcher.spawned.size() == 3);
  const int newcomer = f.launcher.spawned.back().first;
  f.say(newcomer, ControlType::kHello,
        {{"v", "1"}, {"pid", std::to_string(newcomer)}, {"caps", ""}});
  // The other node is lost while the group of generation 4 forms.
  LogCapture log("agent");
  f.sup->onMembershipChange();
  CHECK(f.sup->state() == AgentState::kRecovering);
  CHECK(f.launcher.signals == std::vector<std::pair<int, int>>{{newcomer, SIGKILL}});
  REQUIRE(f.channel.to(pids[0], ControlType::kAbort).size() == 2);
  CHECK(f.channel.to(pids[0], ControlType::kAbort)[1].num("gen") == 4);
  CHECK(f.rdzv.joins == 3);
  CHECK(log.count("local rank 1 (pid " + std::to_string(newcomer) +
                  ") was started for round 3, which the nodes' change voided") == 1);
  SECTION("its exit, before the next round, is expected") {
    f.sup->onWorkerExit(newcomer, ExitStatus{true, SIGKILL});
    CHECK(f.sup->state() == AgentState::kRecovering);
  }
  f.rdzv.round.local_world_sizes = {2};
  f.rdzv.round.group_rank = 0;
  f.formRound(4);
  auto group = f.channel.to(pids[0], ControlType::kGroup);
  REQUIRE(group.size() == 2);
  CHECK(group[1].num("gen") == 5);
  CHECK(group[1].num("world") == 2);
  CHECK(group[1].num("rank") == 0);
  REQUIRE(f.launcher.spawned.size() == 4);  // a new replacement, with round 4's environment
  const int second = f.launcher.spawned.back().first;
  CHECK(f.launcher.spawned.back().second.local_rank == 1);
  CHECK(f.planned.back() == 1);
  SECTION("its exit, after the new one started, is no one's") {
    f.sup->onWorkerExit(newcomer, ExitStatus{true, SIGKILL});
    CHECK(f.sup->state() == AgentState::kRecovering);
  }
  f.hello(second);
  f.say(pids[0], ControlType::kStep, {{"gen", "5"}, {"n", "9"}});
  f.say(second, ControlType::kStep, {{"gen", "5"}, {"n", "9"}});
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.sup->restartCount() == 1);
  CHECK(f.launcher.signals.size() == 1);  // the survivor was never stopped
}

TEST_CASE(
    "in-place across nodes: a peer's failure is charged once and a change of nodes is free, "
    "no worker is stopped",
    "[agent][inplace]") {
  TwoNodes f;
  const auto pids = f.first();
  f.rdzv.hold = true;
  f.sup->onPeerFailure(agent::FailureKind::kWorkers);
  CHECK(f.sup->state() == AgentState::kRecovering);
  CHECK(f.sup->restartCount() == 1);
  CHECK(f.rdzv.failures == 0);  // the peer reported it
  for (int pid : pids) CHECK(f.channel.to(pid, ControlType::kAbort).size() == 1);
  f.sup->onMembershipChange();  // while the round forms: its join answers with the newest
  CHECK(f.rdzv.joins == 2);
  f.formRound(1);
  for (int pid : pids) {
    REQUIRE(f.channel.to(pid, ControlType::kGroup).size() == 1);
    CHECK(f.channel.to(pid, ControlType::kGroup)[0].num("gen") == 2);
    f.say(pid, ControlType::kStep, {{"gen", "2"}, {"n", "7"}});
  }
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.launcher.spawned.size() == 2);  // nobody replaced

  // The other node leaves for good: this one goes on alone, free of charge, once failure_grace
  // passed without a stop of its own.
  f.rdzv.round.local_world_sizes = {2};
  f.rdzv.round.group_rank = 0;
  f.sup->onMembershipChange();
  CHECK(f.sup->state() == AgentState::kRunning);
  f.clock.advance(std::chrono::seconds(1));
  f.fireDeadlines();
  CHECK(f.sup->state() == AgentState::kRecovering);
  CHECK(f.sup->restartCount() == 1);
  f.formRound(2);
  for (int pid : pids) {
    auto group = f.channel.to(pid, ControlType::kGroup);
    REQUIRE(group.size() == 2);
    CHECK(group[1].num("gen") == 3);
    CHECK(group[1].num("world") == 2);
    CHECK(group[1].num("rank") == (pid == pids[0] ? 0 : 1));
  }
  // A group sent to nodes that changed again: abort it, form the next round.
  f.sup->onMembershipChange();
  CHECK(f.rdzv.joins == 4);
  CHECK(f.channel.to(pids[0], ControlType::kAbort).back().num("gen") == 3);
  // A step the void group completed meanwhile ends nothing.
  for (int pid : pids) f.say(pid, ControlType::kStep, {{"gen", "3"}, {"n", "8"}});
  CHECK(f.sup->state() == AgentState::kRecovering);
  f.formRound(3);
  for (int pid : pids) f.say(pid, ControlType::kStep, {{"gen", "4"}, {"n", "9"}});
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.sup->recoveredInPlace() == 2);
  CHECK(f.launcher.signals.empty());
}

TEST_CASE(
    "in-place across nodes: a fallback tells the other nodes, unless a peer's failure caused it",
    "[agent][inplace]") {
  for (const bool peer : {false, true}) {
    INFO((peer ? "a peer failed during the recovery" : "a survivor exited during the recovery"));
    TwoNodes f;
    const auto pids = f.first();
    f.rdzv.hold = true;
    f.sup->onWorkerExit(pids[1], ExitStatus{true, SIGKILL});
    REQUIRE(f.rdzv.failures == 1);
    f.formRound(1);
    if (peer) {
      f.sup->onPeerFailure(agent::FailureKind::kWorkers);
    } else {
      // It heard of the recovery (it may be forming the group): a failure of the recovery.
      f.say(pids[0], ControlType::kAborted, {{"gen", "1"}});
      f.sup->onWorkerExit(pids[0], ExitStatus{false, 1});
    }
    CHECK(f.sup->state() == AgentState::kStopping);
    CHECK(f.rdzv.failures == (peer ? 1 : 2));
    CHECK(f.sup->restartCount() == 1);  // charged once
    // The first report is a new failure; the fallback's says it was charged already.
    CHECK(f.rdzv.failure_kinds.front() == agent::FailureKind::kWorkers);
    if (!peer) CHECK(f.rdzv.failure_kinds.back() == agent::FailureKind::kRecovery);
  }
}

TEST_CASE(
    "in-place across nodes: a node lost is dated from the first local collective that failed, "
    "before the rendezvous said so",
    "[agent][inplace]") {
  for (const bool aborted_first : {false, true}) {
    INFO((aborted_first ? "every worker here aborted on its own: no failure grace"
                        : "the recovery waits failure_grace for a stop under way"));
    TwoNodes f;
    const auto pids = f.first();
    f.rdzv.hold = true;
    LogCapture log("agent");
    // The other node died: this node's ranks see their sockets close at once, the rendezvous
    // tells the agent 200 ms later.
    const double t0 = f.clock.wallSeconds();
    f.say(pids[0], ControlType::kFault, {{"gen", "1"}, {"what", "peer_closed"}});
    if (aborted_first) {
      f.clock.advance(std::chrono::milliseconds(5));
      f.say(pids[0], ControlType::kAborted, {{"gen", "1"}});
      f.say(pids[1], ControlType::kFault, {{"gen", "1"}, {"what", "timeout"}});
      f.clock.advance(std::chrono::milliseconds(3));
      f.say(pids[1], ControlType::kAborted, {{"gen", "1"}});
      f.clock.advance(std::chrono::milliseconds(192));
    } else {
      f.clock.advance(std::chrono::milliseconds(200));
    }
    f.rdzv.round.local_world_sizes = {2};
    f.rdzv.round.group_rank = 0;
    f.sup->onMembershipChange();
    if (!aborted_first) {
      CHECK(f.sup->state() == AgentState::kRunning);
      f.clock.advance(std::chrono::seconds(1));
      f.fireDeadlines();
    }
    REQUIRE(f.sup->state() == AgentState::kRecovering);
    f.formRound(1);
    f.clock.advance(std::chrono::milliseconds(50));
    for (int pid : pids) f.say(pid, ControlType::kStep, {{"gen", "2"}, {"n", "7"}});
    REQUIRE(f.sup->state() == AgentState::kRunning);
    REQUIRE(f.recoveries.size() == 1);
    auto phases = f.phasesOf(0);
    const double seen = aborted_first ? 200.0 : 1200.0;
    CHECK(phases["detected"] == Approx(seen));
    CHECK(phases["told"] == Approx(seen));
    CHECK(phases["aborted"] == Approx(aborted_first ? 8.0 : 0.0));
    CHECK(phases["first_step"] == Approx(seen + 50.0));
    CHECK(log.count(fmt::format("seen at unix time {:.3f}: local rank 0's collective failed "
                                "first (peer_closed), {:.0f} ms earlier)",
                                t0, seen)) == 1);
  }
}

TEST_CASE(
    "in-place across nodes: a peer whose recovery failed after this node's finished is not "
    "charged again, whether its workers are taken in place or restarted",
    "[agent][inplace]") {
  for (const bool in_place : {true, false}) {
    INFO((in_place ? "this node's workers take the peer's restarted ones in"
                   : "a worker here cannot recover in place: restart"));
    TwoNodes f;
    const auto pids = f.first();
    f.rdzv.hold = true;
    f.sup->onPeerFailure(agent::FailureKind::kWorkers);  // charged: 1 of 2
    f.formRound(1);
    for (int pid : pids) f.say(pid, ControlType::kStep, {{"gen", "2"}, {"n", "7"}});
    REQUIRE(f.sup->state() == AgentState::kRunning);
    REQUIRE(f.sup->restartCount() == 1);
    if (!in_place) f.sup->onControlClosed(pids[1]);
    LogCapture log("agent");
    // The peer gave up that recovery and restarts its workers: the failure was charged here.
    f.sup->onPeerFailure(agent::FailureKind::kRecovery);
    CHECK(f.sup->restartCount() == 1);
    CHECK(f.rdzv.failures == 0);  // the peer reported it; nothing new to tell
    if (in_place) {
      CHECK(f.sup->state() == AgentState::kRecovering);
      CHECK(log.count("another node's in-place recovery failed and it restarts its workers") == 1);
      f.formRound(2);
      for (int pid : pids) f.say(pid, ControlType::kStep, {{"gen", "3"}, {"n", "7"}});
      CHECK(f.sup->state() == AgentState::kRunning);
      CHECK(f.launcher.signals.empty());
    } else {
      CHECK(f.sup->state() == AgentState::kStopping);
      CHECK(log.count("the failure was charged when the recovery began") == 1);
      for (int pid : pids) f.sup->onWorkerExit(pid, ExitStatus{true, SIGTERM});
      CHECK(f.sup->state() == AgentState::kRendezvous);
      f.formRound(2);
      CHECK(f.sup->state() == AgentState::kRunning);
      CHECK(f.planned.back() == 1);  // TORCHELASTIC_RESTART_COUNT stays 1
      REQUIRE(f.launcher.spawned.size() == 4);
      for (size_t i = 2; i < 4; ++i) f.capable(f.launcher.spawned[i].first);
    }
    CHECK(f.sup->restartCount() == 1);
    // A new failure afterwards is charged as usual.
    f.sup->onPeerFailure(agent::FailureKind::kWorkers);
    CHECK(f.sup->restartCount() == 2);
  }
}

TEST_CASE(
    "in-place across nodes: a peer's failed recovery ends this node's too, charged only if this "
    "one's was for a change of nodes and the peer's report is a new failure",
    "[agent][inplace]") {
  for (const auto kind : {agent::FailureKind::kRecovery, agent::FailureKind::kWorkers}) {
    const bool recovery = kind == agent::FailureKind::kRecovery;
    INFO((recovery ? "RECOVERY_FAILED" : "FAILURE_REPORTED"));
    TwoNodes f;
    const auto pids = f.first();
    f.rdzv.hold = true;
    f.rdzv.round.local_world_sizes = {2};
    f.rdzv.round.group_rank = 0;
    f.sup->onMembershipChange();  // a free episode, once failure_grace passed
    f.clock.advance(std::chrono::seconds(1));
    f.fireDeadlines();
    REQUIRE(f.sup->state() == AgentState::kRecovering);
    REQUIRE(f.sup->restartCount() == 0);
    f.sup->onPeerFailure(kind);
    CHECK(f.sup->state() == AgentState::kStopping);
    CHECK(f.rdzv.failures == 0);
    for (int pid : pids) f.sup->onWorkerExit(pid, ExitStatus{true, SIGTERM});
    CHECK(f.sup->state() == AgentState::kRendezvous);
    CHECK(f.sup->restartCount() == (recovery ? 0 : 1));
  }
}

TEST_CASE("in-place across nodes: a round that does not form falls back", "[agent][inplace]") {
  TwoNodes f;
  f.rdzv.hold = true;
  f.sup->onPeerFailure(agent::FailureKind::kWorkers);
  REQUIRE(f.rdzv.pending);
  auto done = std::move(f.rdzv.pending);
  f.rdzv.pending = nullptr;
  done(Status(StatusCode::kDeadlineExceeded, "join timeout expired"));
  CHECK(f.sup->state() == AgentState::kStopping);
  // Bounded meanwhile by inplace_timeout, like the group's forming.
  TwoNodes g;
  g.rdzv.hold = true;
  g.sup->onMembershipChange();
  g.clock.advance(std::chrono::seconds(1));
  g.fireDeadlines();
  REQUIRE(g.sup->state() == AgentState::kRecovering);
  g.clock.advance(std::chrono::seconds(11));
  g.fireDeadlines();
  CHECK(g.sup->state() == AgentState::kStopping);
}

TEST_CASE(
    "in-place: a recovery that misses its deadline falls back to restarting every worker, "
    "charged once",
    "[agent][inplace]") {
  InPlaceFixture f;
  f.sup->start();
  f.allCapable();
  const auto pids = f.first();
  f.sup->onWorkerExit(pids[0], ExitStatus{true, SIGKILL});
  REQUIRE(f.sup->state() == AgentState::kRecovering);
  REQUIRE(f.sup->nextDeadline().has_value());
  f.clock.advance(std::chrono::seconds(11));
  f.fireDeadlines();
  CHECK(f.sup->state() == AgentState::kStopping);
  const int newcomer = f.launcher.spawned.back().first;
  for (int pid : {pids[1], pids[2], newcomer}) {
    CHECK(f.launcher.signalsSent(SIGTERM) >= 1);
    f.sup->onWorkerExit(pid, ExitStatus{true, SIGTERM});
  }
  CHECK(f.sup->state() == AgentState::kRunning);  // a new round, every worker fresh
  CHECK(f.sup->restartCount() == 1);              // no second charge
  CHECK(f.rdzv.joins == 2);
  CHECK(f.planned.back() == 1);
}

TEST_CASE(
    "in-place: a rank lost after the last step is recovered, and the ranks that took the state "
    "and found no step left end the job with success",
    "[agent][inplace]") {
  InPlaceFixture f(3, /*max_restarts=*/1);
  const auto pids = f.startThenLoseLast();
  const int newcomer = f.launcher.spawned.back().first;
  f.capable(newcomer);
  for (int pid : {pids[0], pids[1], newcomer}) {
    f.say(pid, ControlType::kAborted, {{"gen", "1"}});
    f.say(pid, ControlType::kFormed, {{"gen", "2"}, {"rank", "0"}, {"world", "3"}});
    f.say(pid, ControlType::kSynced, {{"gen", "2"}, {"step", "96"}, {"source", "0"}});
  }
  // The job's 96 steps were done: each goes on after step 96, to its end.
  f.sup->onWorkerExit(pids[0], ExitStatus{false, 0});
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.sup->recoveredInPlace() == 1);
  CHECK(f.launcher.signals.empty());  // nobody stopped, nothing restarted
  REQUIRE(f.recoveries.size() == 1);
  CHECK(f.phasesOf(0).count("synced") == 1);
  CHECK(f.phasesOf(0).count("first_step") == 0);  // none came
  f.sup->onWorkerExit(pids[1], ExitStatus{false, 0});
  f.sup->onWorkerExit(newcomer, ExitStatus{false, 0});
  CHECK(f.sup->state() == AgentState::kSucceeded);
  CHECK(f.planned.size() == 2);  // the first attempt and the replacement only
  CHECK(f.sup->restartCount() == 1);
}

TEST_CASE("in-place: a worker that exits 0 during the recovery before it took the state falls back",
          "[agent][inplace]") {
  InPlaceFixture f(3, /*max_restarts=*/3);
  const auto pids = f.startThenLoseLast();
  f.say(pids[1], ControlType::kSynced, {{"gen", "1"}, {"step", "5"}, {"source", "0"}});  // old gen
  f.sup->onWorkerExit(pids[1], ExitStatus{false, 0});
  CHECK(f.sup->state() == AgentState::kStopping);
  CHECK(f.sup->recoveredInPlace() == 0);
}

TEST_CASE("in-place: a second failure or a give-up during the recovery falls back, charged once",
          "[agent][inplace]") {
  for (const bool give_up : {false, true}) {
    InPlaceFixture f(3, /*max_restarts=*/3);
    f.sup->start();
    f.allCapable();
    const auto pids = f.first();
    f.sup->onWorkerExit(pids[2], ExitStatus{true, SIGKILL});
    REQUIRE(f.sup->state() == AgentState::kRecovering);
    if (give_up) {
      f.say(pids[1], ControlType::kGoodbye, {{"reason", "giveup"}});
    } else {
      // It heard of the recovery (it may be forming the group): a failure of the recovery.
      f.say(pids[1], ControlType::kAborted, {{"gen", "1"}});
      f.sup->onWorkerExit(pids[1], ExitStatus{false, 1});
    }
    CHECK(f.sup->state() == AgentState::kStopping);
    CHECK(f.sup->restartCount() == 1);
    for (int pid : f.launcher.pids()) {
      if (f.sup->isRunningWorker(pid)) f.sup->onWorkerExit(pid, ExitStatus{true, SIGTERM});
    }
    CHECK(f.sup->state() == AgentState::kRunning);
    CHECK(f.sup->restartCount() == 1);
  }
}

TEST_CASE(
    "in-place: a worker that died before it heard of the recovery (several died at once) is "
    "replaced in the same recovery, charged once, and one that heard falls back",
    "[agent][inplace]") {
  InPlaceFixture f(3, /*max_restarts=*/1);
  f.sup->start();
  f.allCapable();
  const auto pids = f.first();
  LogCapture log("agent");
  f.sup->onWorkerExit(pids[2], ExitStatus{true, SIGKILL});
  REQUIRE(f.sup->state() == AgentState::kRecovering);
  const int first_newcomer = f.launcher.spawned.back().first;
  // pids[1] was killed with pids[2]: it was sent the abort and the group, but never said
  // `aborted`. Its rank in generation 2 is free: a replacement takes it.
  f.clock.advance(std::chrono::milliseconds(40));
  f.sup->onWorkerExit(pids[1], ExitStatus{true, SIGKILL});
  CHECK(f.sup->state() == AgentState::kRecovering);
  CHECK(f.sup->restartCount() == 1);  // one event, one charge
  CHECK(f.launcher.signals.empty());  // pids[0] keeps its process
  REQUIRE(f.launcher.spawned.size() == 5);
  CHECK(f.launcher.spawned.back().second.local_rank == 1);
  CHECK(f.planned.back() == 1);
  CHECK(log.count("in-place recovery: local rank 1 (pid " + std::to_string(pids[1]) +
                  ") was killed by signal 9 too, before it heard of the recovery; it is replaced "
                  "in this recovery too") == 1);
  CHECK(log.count("in-place recovery failed") == 0);
  const int second_newcomer = f.launcher.spawned.back().first;
  for (int newcomer : {first_newcomer, second_newcomer}) {
    f.hello(newcomer);
    REQUIRE(f.channel.to(newcomer, ControlType::kWelcome).size() == 1);
    CHECK(f.channel.to(newcomer, ControlType::kWelcome)[0].num("gen") == 2);
    f.say(newcomer, ControlType::kCaps, {{"add", "inplace"}});
  }
  // The survivor's group was sent once: generation 2 stands.
  CHECK(f.channel.to(pids[0], ControlType::kGroup).size() == 1);
  f.say(pids[0], ControlType::kAborted, {{"gen", "1"}});
  for (int pid : {pids[0], first_newcomer, second_newcomer}) {
    f.say(pid, ControlType::kStep, {{"gen", "2"}, {"n", "13"}});
  }
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.sup->recoveredInPlace() == 1);
  REQUIRE(f.recoveries.size() == 1);
  auto phases = f.phasesOf(0);
  CHECK(phases["replacement_ready"] == Approx(40.0));  // the last replacement's start-up
  CHECK(log.count("(local rank 2 (pid " + std::to_string(pids[2]) +
                  ") was killed by signal 9; local rank 1 (pid " + std::to_string(pids[1]) +
                  ") was killed by signal 9, seen at") == 1);

  // A replacement that fails, or a survivor that had said `aborted` (it may be forming the group
  // or sending its state), is a failure of the recovery: every worker restarts, charged once. Its
  // `aborted` counts even when the agent reads it only as it handles the exit (the channel still
  // held it): what a worker wrote comes before its exit.
  for (const int how : {0, 1, 2}) {
    const bool newcomer = how == 0, unread = how == 2;
    INFO((newcomer ? "the replacement failed"
          : unread ? "a survivor failed after its abort, not read yet"
                   : "a survivor failed after its abort"));
    InPlaceFixture g(3, /*max_restarts=*/2);
    g.sup->start();
    g.allCapable();
    const auto p = g.first();
    g.sup->onWorkerExit(p[2], ExitStatus{true, SIGKILL});
    if (newcomer) {
      g.sup->onWorkerExit(g.launcher.spawned.back().first, ExitStatus{true, SIGKILL});
    } else if (unread) {
      g.channel.reader = [&g](int pid, const ControlMessage& m) {
        g.sup->onControlMessage(pid, m);
      };
      g.channel.unread[p[1]] = {makeControl(ControlType::kAborted, {{"gen", "1"}})};
      g.sup->onWorkerExit(p[1], ExitStatus{true, SIGKILL});
      CHECK(g.channel.unread.empty());
    } else {
      g.say(p[1], ControlType::kAborted, {{"gen", "1"}});
      g.sup->onWorkerExit(p[1], ExitStatus{true, SIGKILL});
    }
    CHECK(g.sup->state() == AgentState::kStopping);
    CHECK(g.sup->restartCount() == 1);
    CHECK(g.launcher.spawned.size() == 4);
  }
}

TEST_CASE(
    "in-place across nodes: a local worker that died before it heard of the recovery is "
    "replaced in the same round, before or after the round formed",
    "[agent][inplace]") {
  for (const bool formed : {false, true}) {
    INFO((formed ? "it is reaped after the round formed" : "it is reaped while the round forms"));
    TwoNodes f;
    const auto pids = f.first();
    f.rdzv.hold = true;
    f.sup->onPeerFailure(agent::FailureKind::kWorkers);  // a rank on the other node died first
    REQUIRE(f.sup->state() == AgentState::kRecovering);
    CHECK(f.sup->restartCount() == 1);
    if (formed) f.formRound(1);
    // Its own death at the same moment reached this agent later (the kernel's teardown).
    f.sup->onWorkerExit(pids[1], ExitStatus{true, SIGKILL});
    CHECK(f.sup->state() == AgentState::kRecovering);
    CHECK(f.sup->restartCount() == 1);
    CHECK(f.rdzv.failures == 0);  // nothing for the other nodes: the round holds its rank
    CHECK(f.rdzv.joins == 2);
    if (!formed) {
      CHECK(f.launcher.spawned.size() == 2);  // it starts with the round's ranks
      f.formRound(1);
    }
    REQUIRE(f.launcher.spawned.size() == 3);
    CHECK(f.launcher.spawned.back().second.local_rank == 1);
    CHECK(f.launcher.spawned.back().second.global_rank == 1);
    const int newcomer = f.launcher.spawned.back().first;
    f.hello(newcomer);
    CHECK(f.channel.to(newcomer, ControlType::kWelcome).at(0).num("gen") == 2);
    REQUIRE(f.channel.to(pids[0], ControlType::kGroup).size() == 1);
    CHECK(f.channel.to(pids[0], ControlType::kGroup)[0].num("gen") == 2);
    for (int pid : {pids[0], newcomer}) f.say(pid, ControlType::kStep, {{"gen", "2"}, {"n", "5"}});
    CHECK(f.sup->state() == AgentState::kRunning);
    CHECK(f.launcher.signals.empty());
  }
  // Ranks on both nodes died together: each node reported its own, and the other's report reaches
  // this node while the round forms. It is part of that round (the other node replaces its ranks
  // in it): no fallback, no second charge. Once a group is out, a peer's failure still falls back
  // (the first test above on fallbacks), as does a peer's failed recovery, and a peer's report
  // in a change of nodes' episode (the next test).
  {
    TwoNodes f;
    f.rdzv.hold = true;
    f.sup->onWorkerExit(f.first()[1], ExitStatus{true, SIGKILL});
    f.sup->onPeerFailure(agent::FailureKind::kRecovery);
    CHECK(f.sup->state() == AgentState::kStopping);
    CHECK(f.sup->restartCount() == 1);
  }
  {
    TwoNodes f;
    const auto pids = f.first();
    f.rdzv.hold = true;
    LogCapture log("agent");
    f.sup->onWorkerExit(pids[1], ExitStatus{true, SIGKILL});
    REQUIRE(f.rdzv.failures == 1);
    f.sup->onPeerFailure(agent::FailureKind::kWorkers);
    CHECK(f.sup->state() == AgentState::kRecovering);
    CHECK(f.sup->restartCount() == 1);
    CHECK(f.rdzv.failures == 1);
    CHECK(log.count("workers on another node failed too while the round forms; that node "
                    "replaces them in this recovery") == 1);
    f.formRound(1);
    REQUIRE(f.launcher.spawned.size() == 3);
    const int newcomer = f.launcher.spawned.back().first;
    for (int pid : {pids[0], newcomer}) f.say(pid, ControlType::kStep, {{"gen", "2"}, {"n", "5"}});
    CHECK(f.sup->state() == AgentState::kRunning);
    CHECK(log.count("workers on another node failed; seen at") == 0);
    CHECK(log.count("(local rank 1 (pid " + std::to_string(pids[1]) +
                    ") was killed by signal 9; workers on another node failed, seen at") == 1);
  }
  // In a free episode (a change of nodes) such a death is the first failure: it is charged
  // then, or, with no restart left, the recovery falls back and the job fails.
  for (const int max_restarts : {1, 0}) {
    INFO("--max-restarts=" << max_restarts);
    InPlaceFixture f(2, max_restarts, /*multi_node=*/true);
    f.rdzv.round.local_world_sizes = {2, 2};
    f.rdzv.round.group_rank = 1;
    f.sup->start();
    f.allCapable();
    f.rdzv.hold = true;
    f.sup->onMembershipChange();
    f.clock.advance(std::chrono::seconds(2));
    f.fireDeadlines();
    REQUIRE(f.sup->state() == AgentState::kRecovering);
    CHECK(f.sup->restartCount() == 0);
    f.sup->onWorkerExit(f.first()[0], ExitStatus{true, SIGKILL});
    if (max_restarts == 1) {
      CHECK(f.sup->state() == AgentState::kRecovering);
      CHECK(f.sup->restartCount() == 1);
    } else {
      CHECK(f.sup->state() == AgentState::kStopping);
      f.sup->onWorkerExit(f.first()[1], ExitStatus{true, SIGTERM});
      CHECK(f.sup->state() == AgentState::kFailed);
    }
  }
}

TEST_CASE("in-place: SIGTERM during a recovery stops the agent as usual", "[agent][inplace]") {
  InPlaceFixture f;
  f.sup->start();
  f.allCapable();
  const auto pids = f.first();
  f.sup->onWorkerExit(pids[2], ExitStatus{true, SIGKILL});
  f.sup->onSignal(SIGTERM);
  CHECK(f.sup->state() == AgentState::kStopping);
  for (int pid : f.launcher.pids()) {
    if (f.sup->isRunningWorker(pid)) f.sup->onWorkerExit(pid, ExitStatus{true, SIGTERM});
  }
  CHECK(f.sup->state() == AgentState::kFailed);
  CHECK(f.sup->exitCode() == 128 + SIGTERM);
}

TEST_CASE("in-place: metrics count a recovery's failure once and each outcome",
          "[agent][inplace]") {
  AgentMetrics m;
  m.onState(AgentState::kRunning, 0, 1);
  m.onState(AgentState::kRecovering, 1, 2);
  m.onState(AgentState::kRunning, 1, 3);
  CHECK(m.failures == 1);
  CHECK(m.inplace_recovered == 1);
  CHECK(m.inplace_fallbacks == 0);
  // A second failure whose recovery falls back: one failure, one fallback, no membership change.
  m.onState(AgentState::kRecovering, 2, 4);
  m.onState(AgentState::kStopping, 2, 5);
  m.onState(AgentState::kRestarting, 2, 6);
  m.onState(AgentState::kRendezvous, 2, 6);
  m.onState(AgentState::kRunning, 2, 7);
  CHECK(m.failures == 2);
  CHECK(m.inplace_recovered == 1);
  CHECK(m.inplace_fallbacks == 1);
  CHECK(m.membership_changes == 0);
  m.onInPlaceRecovery(InPlaceRecovery{2, {{"formed", 3.0}, {"first_step", 420.0}}, 12});
  REQUIRE(m.inplace_phases.count("formed") == 1);
  CHECK(m.inplace_phases["formed"].total == 1);
  CHECK(m.inplace_phases["formed"].counts.front() == 0);  // 3 ms > 1 ms
  CHECK(m.inplace_phases["formed"].counts[1] == 1);       // <= 5 ms
  CHECK(m.inplace_phases["first_step"].counts[5] == 0);   // 420 ms > 250 ms
  CHECK(m.inplace_phases["first_step"].counts[6] == 1);   // <= 500 ms
}

namespace {

// A started single-node job of `nproc` capable workers with heartbeat files (timeout 10 s).
struct HeartbeatJob : InPlaceFixture {
  explicit HeartbeatJob(int nproc = 3) : InPlaceFixture(nproc, 1, false, std::chrono::seconds(10)) {
    sup->start();
    allCapable();
  }
};

// Local ranks `ranks` touch their heartbeat files now; the agent's loop runs `look_after` later.
void touchThenLook(InPlaceFixture& f, const std::vector<int>& ranks, Duration look_after) {
  for (int r : ranks) f.heartbeats.touch("/hb/0/" + std::to_string(r));
  f.clock.advance(look_after);
  f.fireDeadlines();
}

// What the heartbeat files of attempt 0 say, by local rank from 0.
void markFiles(InPlaceFixture& f, const std::vector<HeartbeatMark>& by_local_rank) {
  f.heartbeats.marks.clear();
  for (size_t r = 0; r < by_local_rank.size(); ++r) {
    f.heartbeats.marks["/hb/0/" + std::to_string(r)] = by_local_rank[r];
  }
}

// Three workers with heartbeat files (timeout 10 s), every one has stepped once, which the agent
// sees a second later; then nobody steps again for `silence`, checked as the agent's loop would.
void goSilent(InPlaceFixture& f, Duration silence) {
  touchThenLook(f, {0, 1, 2}, std::chrono::seconds(1));
  f.clock.advance(silence);
  f.fireDeadlines();
}

}  // namespace

TEST_CASE(
    "in-place: a hung worker stopped by a signal is killed and replaced alone, the others, stalled "
    "behind it, are not",
    "[agent][inplace]") {
  HeartbeatJob f;
  const auto pids = f.first();
  f.heartbeats.stopped_pids = {pids[1]};
  goSilent(f, std::chrono::seconds(11));
  CHECK(f.sup->state() == AgentState::kRecovering);
  REQUIRE(f.launcher.signals.size() == 1);
  CHECK(f.launcher.signals[0] == std::make_pair(pids[1], SIGKILL));
  CHECK(f.sup->restartCount() == 1);
  REQUIRE(f.launcher.spawned.size() == 4);
  CHECK(f.launcher.spawned.back().second.local_rank == 1);
  for (int survivor : {pids[0], pids[2]}) {
    CHECK(f.channel.to(survivor, ControlType::kAbort).size() == 1);
    CHECK(f.channel.to(survivor, ControlType::kGroup).size() == 1);
  }
  // The killed one's exit, when it is reaped, ends nothing.
  f.sup->onWorkerExit(pids[1], ExitStatus{true, SIGKILL});
  CHECK(f.sup->state() == AgentState::kRecovering);
  const int newcomer = f.launcher.spawned.back().first;
  f.stepped({pids[0], pids[2], newcomer}, 2);
  CHECK(f.sup->state() == AgentState::kRunning);
}

TEST_CASE(
    "in-place: hung workers whose heartbeat files say they do not wait while their peers' say they "
    "do are killed and replaced in one episode, the others keep their processes",
    "[agent][inplace]") {
  for (const int not_waiting : {1, 2}) {
    INFO(not_waiting << " not waiting");
    LogCapture log("agent");
    HeartbeatJob f;
    const auto pids = f.first();
    f.heartbeats.marks = {
        {"/hb/0/0", HeartbeatMark::kWaiting},
        {"/hb/0/1", HeartbeatMark::kNotWaiting},
        {"/hb/0/2", not_waiting == 1 ? HeartbeatMark::kWaiting : HeartbeatMark::kNotWaiting}};
    goSilent(f, std::chrono::seconds(11));
    CHECK(f.sup->state() == AgentState::kRecovering);
    CHECK(f.sup->restartCount() == 1);  // one failure, charged once
    std::vector<int> culprits = {pids[1]};
    if (not_waiting == 2) culprits.push_back(pids[2]);
    REQUIRE(f.launcher.signals.size() == culprits.size());
    for (size_t i = 0; i < culprits.size(); ++i) {
      CHECK(f.launcher.signals[i] == std::make_pair(culprits[i], SIGKILL));
      CHECK(log.count("local rank " + std::to_string(i + 1) + " (pid " +
                      std::to_string(culprits[i]) +
                      ") is hung while its peers wait for it: sending SIGKILL") == 1);
    }
    REQUIRE(f.launcher.spawned.size() == 3 + culprits.size());
    std::vector<int> members = {pids[0]};
    if (not_waiting == 1) members.push_back(pids[2]);
    for (size_t i = 0; i < culprits.size(); ++i) {
      const auto& [pid, launch] = f.launcher.spawned[3 + i];
      CHECK(launch.local_rank == static_cast<int>(i) + 1);
      members.push_back(pid);
    }
    CHECK(f.channel.to(pids[0], ControlType::kAbort).size() == 1);
    CHECK(f.channel.to(pids[0], ControlType::kGroup).size() == 1);
    // The killed ones' exits, when they are reaped, end nothing.
    for (int pid : culprits) f.sup->onWorkerExit(pid, ExitStatus{true, SIGKILL});
    CHECK(f.sup->state() == AgentState::kRecovering);
    f.stepped(members, 2);
    CHECK(f.sup->state() == AgentState::kRunning);
    CHECK(f.sup->restartCount() == 1);
  }
}

TEST_CASE(
    "in-place: a second worker not waiting that the agent saw touch its file one look later is a "
    "culprit too once it would be hung at the next look, not before",
    "[agent][inplace]") {
  // Timeout 10 s: the agent looks every second, so 9 s of silence is hung at the next look.
  for (const int touched_at_s : {2, 4}) {
    INFO("rank 2 last touched at " << touched_at_s << " s");
    HeartbeatJob f;
    const auto pids = f.first();
    markFiles(f, {HeartbeatMark::kWaiting, HeartbeatMark::kNotWaiting, HeartbeatMark::kNotWaiting});
    touchThenLook(f, {0, 1, 2}, std::chrono::seconds(1));
    f.clock.advance(std::chrono::seconds(touched_at_s - 1));
    touchThenLook(f, {0, 2}, Duration::zero());
    f.clock.advance(std::chrono::milliseconds(11500 - 1000 * touched_at_s));
    f.fireDeadlines();  // at 11.5 s: rank 1 silent 10.5 s, rank 2 9.5 s or 7.5 s
    CHECK(f.sup->state() == AgentState::kRecovering);
    if (touched_at_s == 2) {
      REQUIRE(f.launcher.signals.size() == 2);
      CHECK(f.launcher.signals[1] == std::make_pair(pids[2], SIGKILL));
      CHECK(f.launcher.spawned.size() == 5);
    } else {
      REQUIRE(f.launcher.signals.size() == 1);
      CHECK(f.launcher.spawned.size() == 4);
      CHECK(f.channel.to(pids[2], ControlType::kGroup).size() == 1);
    }
    CHECK(f.launcher.signals[0] == std::make_pair(pids[1], SIGKILL));
    CHECK(f.channel.to(pids[0], ControlType::kGroup).size() == 1);
  }
}

TEST_CASE(
    "in-place: a worker whose wait ends as the agent looks (its mark written between the look at "
    "its file's time and the look at its mark) is not taken for hung in its own code",
    "[agent][inplace]") {
  // The agent read the file's time (silent past the timeout) and then its mark, which the worker
  // had just written (its collective ended): every mark written touches the file, so the time is
  // read again.
  const bool in_episode = GENERATE(false, true);
  INFO((in_episode ? "during the recovery" : "at the hang check"));
  HeartbeatJob f;
  const auto pids = f.first();
  markFiles(f, {HeartbeatMark::kWaiting, HeartbeatMark::kNotWaiting, HeartbeatMark::kWaiting});
  touchThenLook(f, {0, 1, 2}, std::chrono::seconds(1));
  if (!in_episode) {
    // 11.5 s: all three silent 10.5 s; rank 1 hangs, rank 0's wait ends as it is looked at.
    f.heartbeats.flips["/hb/0/0"] = HeartbeatMark::kNotWaiting;
    f.clock.advance(std::chrono::milliseconds(10500));
    f.fireDeadlines();
    REQUIRE(f.sup->state() == AgentState::kRecovering);
    REQUIRE(f.launcher.signals.size() == 1);
    CHECK(f.launcher.signals[0] == std::make_pair(pids[1], SIGKILL));
    return;
  }
  f.clock.advance(std::chrono::milliseconds(10500));
  f.fireDeadlines();  // 11.5 s: rank 1 is hung, the others wait
  REQUIRE(f.sup->state() == AgentState::kRecovering);
  REQUIRE(f.launcher.signals.size() == 1);
  // Told to abort, rank 2 ends its wait and writes its mark just as the agent looks; its
  // `aborted` is not sent yet.
  f.heartbeats.flips["/hb/0/2"] = HeartbeatMark::kNotWaiting;
  f.clock.advance(std::chrono::seconds(1));
  f.fireDeadlines();
  CHECK(f.heartbeats.flips.empty());  // it was looked at
  CHECK(f.launcher.signals.size() == 1);
  CHECK(f.launcher.spawned.size() == 4);
}

TEST_CASE(
    "in-place: a survivor that hangs in its own code a step after the failure, and so never says "
    "aborted, is killed and replaced in the same recovery, and one that waits is not",
    "[agent][inplace]") {
  // (unread: it said `aborted` before the agent's look, which had not read it yet.)
  const bool unread = GENERATE(false, true);
  INFO((unread ? "its aborted unread" : "silent"));
  LogCapture log("agent");
  HeartbeatJob f;
  f.channel.reader = [&f](int pid, const ControlMessage& m) { f.sup->onControlMessage(pid, m); };
  const auto pids = f.first();
  // Rank 1 hangs at 1 s; rank 2 at 4 s, when rank 0 starts waiting for both.
  markFiles(f, {HeartbeatMark::kWaiting, HeartbeatMark::kNotWaiting, HeartbeatMark::kNotWaiting});
  touchThenLook(f, {0, 1, 2}, std::chrono::seconds(1));
  f.clock.advance(std::chrono::seconds(3));
  touchThenLook(f, {0, 2}, Duration::zero());
  f.clock.advance(std::chrono::milliseconds(7500));
  f.fireDeadlines();  // 11.5 s: rank 1 is hung, rank 2 only silent for 7.5 s
  REQUIRE(f.sup->state() == AgentState::kRecovering);
  REQUIRE(f.launcher.signals.size() == 1);
  CHECK(f.launcher.signals[0] == std::make_pair(pids[1], SIGKILL));
  const int first_newcomer = f.launcher.spawned.back().first;
  f.clock.advance(std::chrono::seconds(2));
  f.fireDeadlines();  // 13.5 s: not yet
  CHECK(f.launcher.signals.size() == 1);
  f.clock.advance(std::chrono::seconds(1));
  if (unread) {
    f.channel.unread[pids[2]] = {makeControl(ControlType::kAborted, {{"gen", "1"}})};
    f.fireDeadlines();  // 14.5 s: it heard, and forms the group
    CHECK(f.channel.unread.empty());
    CHECK(f.launcher.signals.size() == 1);
    f.stepped({pids[0], pids[2], first_newcomer}, 2);
    CHECK(f.sup->state() == AgentState::kRunning);
    return;
  }
  f.fireDeadlines();  // 14.5 s: rank 2 silent 10.5 s, never said aborted, not waiting
  CHECK(f.sup->state() == AgentState::kRecovering);
  REQUIRE(f.launcher.signals.size() == 2);
  CHECK(f.launcher.signals[1] == std::make_pair(pids[2], SIGKILL));
  CHECK(log.count("local rank 2 (pid " + std::to_string(pids[2]) +
                  ") is hung during the recovery and never heard of it: sending SIGKILL") == 1);
  REQUIRE(f.launcher.spawned.size() == 5);
  CHECK(f.launcher.spawned.back().second.local_rank == 2);
  CHECK(f.sup->restartCount() == 1);  // one failure
  // Rank 0 waits (its file says so) and never said aborted either: it is left alone.
  f.clock.advance(std::chrono::seconds(3));
  f.fireDeadlines();
  CHECK(f.launcher.signals.size() == 2);
  f.sup->onWorkerExit(pids[2], ExitStatus{true, SIGKILL});  // reaped: ends nothing
  CHECK(f.sup->state() == AgentState::kRecovering);
  f.stepped({pids[0], first_newcomer, f.launcher.spawned.back().first}, 2);
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.sup->restartCount() == 1);
}

TEST_CASE(
    "in-place across nodes: a survivor that hangs during a change of nodes' recovery, with the "
    "restart budget spent, fails the job as a crash would, charged",
    "[agent][inplace]") {
  InPlaceFixture f(2, /*max_restarts=*/0, /*multi_node=*/true, std::chrono::seconds(10));
  f.rdzv.round.local_world_sizes = {2, 2};
  f.rdzv.round.group_rank = 1;
  f.sup->start();
  f.allCapable();
  const auto pids = f.first();
  markFiles(f, {HeartbeatMark::kWaiting, HeartbeatMark::kNotWaiting});
  // Seen at 1 s; rank 1 then hangs in its own code.
  touchThenLook(f, {0, 1}, std::chrono::seconds(1));
  f.clock.advance(std::chrono::seconds(4));
  touchThenLook(f, {0}, Duration::zero());
  f.rdzv.hold = true;
  f.sup->onMembershipChange();               // at 5 s, free: the budget of 0 allows it
  f.clock.advance(std::chrono::seconds(1));  // the failure grace
  f.fireDeadlines();
  REQUIRE(f.sup->state() == AgentState::kRecovering);
  CHECK(f.sup->restartCount() == 0);
  f.say(pids[0], ControlType::kAborted, {{"gen", "1"}});
  f.clock.advance(std::chrono::seconds(6));
  f.fireDeadlines();  // 12 s: rank 1 silent 11 s, never said aborted, not waiting
  CHECK(f.launcher.signals.size() >= 1);
  CHECK(f.launcher.signals.at(0) == std::make_pair(pids[1], SIGKILL));
  CHECK(f.sup->state() == AgentState::kStopping);
  CHECK(f.rdzv.failures == 1);  // reported as a failure: the other nodes charge it too
  for (int pid : pids) f.sup->onWorkerExit(pid, ExitStatus{true, SIGKILL});
  CHECK(f.sup->state() == AgentState::kFailed);
  CHECK(f.sup->exitCode() == 1);
}

TEST_CASE(
    "in-place: hung workers stopped by a signal, and one not waiting beside them, are killed and "
    "replaced in one episode, the one waiting for them is not, and with no such one left every "
    "worker restarts",
    "[agent][inplace]") {
  // (stopped, or not waiting) x 2, and the third waits; then all three are culprits.
  for (const bool third_waits : {true, false}) {
    INFO((third_waits ? "rank 1 waits" : "rank 1 does not wait either"));
    for (const bool both_stopped : {true, false}) {
      INFO((both_stopped ? "ranks 0 and 2 stopped" : "rank 0 stopped, rank 2 not waiting"));
      LogCapture log("agent");
      HeartbeatJob f;
      const auto pids = f.first();
      f.heartbeats.stopped_pids = {pids[0]};
      if (both_stopped) f.heartbeats.stopped_pids.insert(pids[2]);
      // A stopped worker's own mark says nothing: the signal decides.
      f.heartbeats.marks = {
          {"/hb/0/1", third_waits ? HeartbeatMark::kWaiting : HeartbeatMark::kNotWaiting},
          {"/hb/0/2", both_stopped ? HeartbeatMark::kWaiting : HeartbeatMark::kNotWaiting}};
      goSilent(f, std::chrono::seconds(11));
      if (!third_waits) {
        // On one node, no survivor would keep anything: every worker restarts as processes.
        CHECK(f.sup->state() == AgentState::kStopping);
        CHECK(f.launcher.signalsSent(SIGKILL) == 3);
        continue;
      }
      CHECK(f.sup->state() == AgentState::kRecovering);
      REQUIRE(f.launcher.signals.size() == 2);
      CHECK(f.launcher.signals[0] == std::make_pair(pids[0], SIGKILL));
      CHECK(f.launcher.signals[1] == std::make_pair(pids[2], SIGKILL));
      CHECK(log.count("is hung and stopped by a signal: sending SIGKILL") ==
            (both_stopped ? 2 : 1));
      CHECK(log.count("is hung while its peers wait for it: sending SIGKILL") ==
            (both_stopped ? 0 : 1));
      REQUIRE(f.launcher.spawned.size() == 5);
      CHECK(f.launcher.spawned[3].second.local_rank == 0);
      CHECK(f.launcher.spawned[4].second.local_rank == 2);
      CHECK(f.channel.to(pids[1], ControlType::kGroup).size() == 1);
      // The killed ones' exits end nothing; the one that waits is never killed.
      for (int pid : {pids[0], pids[2]}) f.sup->onWorkerExit(pid, ExitStatus{true, SIGKILL});
      f.say(pids[1], ControlType::kAborted, {{"gen", "1"}});
      f.clock.advance(std::chrono::seconds(3));
      f.fireDeadlines();
      CHECK(f.launcher.signals.size() == 2);
      f.stepped({pids[1], f.launcher.spawned[3].first, f.launcher.spawned[4].first}, 2);
      CHECK(f.sup->state() == AgentState::kRunning);
      CHECK(f.sup->restartCount() == 1);
    }
  }
}

TEST_CASE(
    "in-place across nodes: a node whose hung workers all say they do not wait replaces both in "
    "the next round, the other node's keep their processes",
    "[agent][inplace]") {
  TwoNodes f("", std::chrono::seconds(10));
  const auto pids = f.first();
  markFiles(f, {HeartbeatMark::kNotWaiting, HeartbeatMark::kNotWaiting});
  f.rdzv.hold = true;
  goSilent(f, std::chrono::seconds(11));
  CHECK(f.sup->state() == AgentState::kRecovering);
  CHECK(f.sup->restartCount() == 1);
  CHECK(f.rdzv.failures == 1);  // the other node's workers recover in place too
  REQUIRE(f.launcher.signals.size() == 2);
  CHECK(f.launcher.signals[0] == std::make_pair(pids[0], SIGKILL));
  CHECK(f.launcher.signals[1] == std::make_pair(pids[1], SIGKILL));
  CHECK(f.launcher.spawned.size() == 2);  // the replacements wait for the round's ranks
  for (int pid : pids) f.sup->onWorkerExit(pid, ExitStatus{true, SIGKILL});
  CHECK(f.sup->state() == AgentState::kRecovering);
  f.formRound(3);
  REQUIRE(f.launcher.spawned.size() == 4);
  CHECK(f.launcher.spawned[2].second.local_rank == 0);
  CHECK(f.launcher.spawned[3].second.local_rank == 1);
  f.stepped({f.launcher.spawned[2].first, f.launcher.spawned[3].first}, 4);
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.sup->restartCount() == 1);
}

TEST_CASE(
    "in-place across nodes: a survivor that hangs while the recovery's round forms is replaced "
    "once the round is out, with the others, charged once",
    "[agent][inplace]") {
  TwoNodes f("", std::chrono::seconds(10));
  const auto pids = f.first();
  markFiles(f, {HeartbeatMark::kWaiting, HeartbeatMark::kNotWaiting});
  // Seen at 1 s; local rank 1 then hangs in its own code.
  touchThenLook(f, {0, 1}, std::chrono::seconds(1));
  f.clock.advance(std::chrono::seconds(4));
  touchThenLook(f, {0}, Duration::zero());
  f.rdzv.hold = true;
  f.sup->onPeerFailure(agent::FailureKind::kWorkers);  // at 5 s: another node's worker died
  REQUIRE(f.sup->state() == AgentState::kRecovering);
  CHECK(f.sup->restartCount() == 1);
  f.say(pids[0], ControlType::kAborted, {{"gen", "1"}});
  f.clock.advance(std::chrono::seconds(7));
  f.fireDeadlines();  // 12 s: local rank 1 silent 11 s, never said aborted, not waiting
  REQUIRE(f.launcher.signals.size() == 1);
  CHECK(f.launcher.signals[0] == std::make_pair(pids[1], SIGKILL));
  CHECK(f.launcher.spawned.size() == 2);  // its replacement waits for the round's ranks
  f.sup->onWorkerExit(pids[1], ExitStatus{true, SIGKILL});  // reaped: ends nothing
  CHECK(f.sup->state() == AgentState::kRecovering);
  f.formRound(3);
  REQUIRE(f.launcher.spawned.size() == 3);
  CHECK(f.launcher.spawned.back().second.local_rank == 1);
  CHECK(f.channel.to(pids[0], ControlType::kGroup).size() == 1);
  f.stepped({pids[0], f.launcher.spawned.back().first}, 4);
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.sup->restartCount() == 1);
}

TEST_CASE(
    "in-place: when a second hung worker's replacement cannot start, every worker restarts and "
    "the killed ones are waited for",
    "[agent][inplace]") {
  HeartbeatJob f;
  const auto pids = f.first();
  markFiles(f, {HeartbeatMark::kWaiting, HeartbeatMark::kNotWaiting, HeartbeatMark::kNotWaiting});
  f.launcher.fail_local_ranks = {2};
  goSilent(f, std::chrono::seconds(11));
  CHECK(f.sup->state() == AgentState::kStopping);
  CHECK(f.launcher.signalsSent(SIGKILL) == 2);
  // Rank 2, SIGKILLed and not reaped yet, is still one the stop waits for.
  CHECK(f.sup->isRunningWorker(pids[2]));
  CHECK(f.sup->isRunningWorker(pids[0]));
  f.launcher.fail_local_ranks.clear();
  const size_t before = f.launcher.spawned.size();
  for (int pid : f.launcher.pids()) {
    if (f.sup->isRunningWorker(pid)) f.sup->onWorkerExit(pid, ExitStatus{true, SIGKILL});
  }
  // Once every one ended, the workers restart as processes, the failure charged once.
  CHECK(f.sup->state() == AgentState::kRunning);
  CHECK(f.launcher.spawned.size() == before + 3);
  CHECK(f.sup->restartCount() == 1);
}

TEST_CASE(
    "in-place: hung workers none of which is stopped restart every worker, as in process mode",
    "[agent][inplace]") {
  HeartbeatJob f;
  goSilent(f, std::chrono::seconds(11));
  CHECK(f.sup->state() == AgentState::kStopping);
  CHECK(f.launcher.signalsSent(SIGKILL) == 3);
}

TEST_CASE(
    "in-place across nodes: stalled workers wait a grace for the peer's report, which recovers "
    "them in place",
    "[agent][inplace]") {
  InPlaceFixture f(3, 1, /*multi_node=*/true, std::chrono::seconds(10));
  f.sup->start();
  f.allCapable();
  goSilent(f, std::chrono::seconds(11));
  CHECK(f.sup->state() == AgentState::kRunning);  // within the grace: nothing done
  CHECK(f.launcher.signals.empty());
  f.sup->onPeerFailure(agent::FailureKind::kWorkers);
  CHECK(f.sup->state() == AgentState::kRecovering);
  CHECK(f.launcher.signals.empty());
  // Without the report, the grace ends in the usual path.
  InPlaceFixture g(3, 1, /*multi_node=*/true, std::chrono::seconds(10));
  g.sup->start();
  g.allCapable();
  goSilent(g, std::chrono::seconds(11));
  g.clock.advance(std::chrono::seconds(3));
  g.fireDeadlines();
  CHECK(g.sup->state() == AgentState::kStopping);
  CHECK(g.launcher.signalsSent(SIGKILL) == 3);
}

TEST_CASE(
    "in-place across nodes: a change of nodes waits failure_grace, so a stop under way keeps its "
    "checkpoint",
    "[agent][inplace]") {
  SECTION("this node is stopped too (SIGTERM to the whole job)") {
    TwoNodes f;
    f.sup->onMembershipChange();
    f.sup->onSignal(SIGTERM);
    CHECK(f.sup->state() == AgentState::kStopping);
    CHECK(f.launcher.signalsSent(SIGTERM) == 2);
    for (int pid : f.first()) CHECK(f.channel.to(pid, ControlType::kAbort).empty());
    f.clock.advance(std::chrono::seconds(2));
    f.fireDeadlines();
    CHECK(f.sup->state() == AgentState::kStopping);  // no recovery started late
  }
  SECTION("a peer's failure during the grace starts the (charged) recovery at once") {
    TwoNodes f;
    f.rdzv.hold = true;
    f.sup->onMembershipChange();
    f.sup->onPeerFailure(agent::FailureKind::kWorkers);
    CHECK(f.sup->state() == AgentState::kRecovering);
    CHECK(f.sup->restartCount() == 1);
    CHECK(f.rdzv.joins == 2);
    f.clock.advance(std::chrono::seconds(2));
    f.fireDeadlines();
    CHECK(f.rdzv.joins == 2);  // the grace's end starts nothing more
  }
}

TEST_CASE(
    "in-place across nodes: a change of nodes recovers without the grace once every worker "
    "aborted on its own (a node died, or its ranks left on SIGTERM)",
    "[agent][inplace]") {
  // The generation the workers run: the one their welcome named.
  auto current = [](TwoNodes& f) {
    return f.channel.to(f.first()[0], ControlType::kWelcome).at(0).num("gen");
  };
  auto abortedOnItsOwn = [&](TwoNodes& f, int pid) {
    f.say(pid, ControlType::kAborted, {{"gen", std::to_string(current(f))}});
  };
  SECTION("the workers aborted before the change arrived") {
    TwoNodes f;
    for (int pid : f.first()) abortedOnItsOwn(f, pid);
    CHECK(f.sup->state() == AgentState::kRunning);  // nothing happens without a change of nodes
    f.sup->onMembershipChange();
    CHECK(f.sup->state() == AgentState::kRecovering);
    CHECK(f.sup->restartCount() == 0);
  }
  SECTION("the last worker aborted during the grace") {
    TwoNodes f;
    abortedOnItsOwn(f, f.first()[0]);
    f.sup->onMembershipChange();
    CHECK(f.sup->state() == AgentState::kRunning);  // one still runs the old group: the grace
    abortedOnItsOwn(f, f.first()[1]);
    CHECK(f.sup->state() == AgentState::kRecovering);
  }
  SECTION("an abort of an older generation does not count") {
    TwoNodes f;
    f.say(f.first()[0], ControlType::kAborted, {{"gen", std::to_string(current(f) - 1)}});
    abortedOnItsOwn(f, f.first()[1]);
    f.sup->onMembershipChange();
    CHECK(f.sup->state() == AgentState::kRunning);
    f.clock.advance(std::chrono::seconds(2));
    f.fireDeadlines();
    CHECK(f.sup->state() == AgentState::kRecovering);  // after the grace, as before
  }
}

TEST_CASE(
    "in-place across nodes: workers that left together start in the recovery's round, and one "
    "that leaves in a change of nodes' recovery charges it",
    "[agent][inplace]") {
  auto leave = [](TwoNodes& f, int pid) {
    f.say(pid, ControlType::kGoodbye, {{"reason", "stop"}});
    f.sup->onWorkerExit(pid, ExitStatus{false, 0});
  };
  SECTION("both workers of this node left at one step") {
    TwoNodes f;
    f.rdzv.hold = true;
    const auto pids = f.first();
    leave(f, pids[0]);
    CHECK(f.sup->state() == AgentState::kRecovering);
    leave(f, pids[1]);  // while the round forms
    CHECK(f.sup->state() == AgentState::kRecovering);
    CHECK(f.sup->restartCount() == 1);
    CHECK(f.launcher.spawned.size() == 2);
    f.formRound(2);
    REQUIRE(f.launcher.spawned.size() == 4);
    CHECK(f.launcher.spawned[2].second.local_rank == 0);
    CHECK(f.launcher.spawned[3].second.local_rank == 1);
    CHECK(f.sup->state() == AgentState::kRecovering);
  }
  SECTION("a worker leaves after the round of a change of nodes formed") {
    TwoNodes f;
    f.rdzv.hold = true;
    const auto pids = f.first();
    for (int pid : pids) {
      f.say(pid, ControlType::kAborted,
            {{"gen", std::to_string(f.channel.to(pid, ControlType::kWelcome).at(0).num("gen"))}});
    }
    f.sup->onMembershipChange();
    REQUIRE(f.sup->state() == AgentState::kRecovering);
    CHECK(f.sup->restartCount() == 0);
    f.formRound(2);
    CHECK(f.channel.to(pids[1], ControlType::kGroup).size() == 1);
    leave(f, pids[1]);
    CHECK(f.sup->state() == AgentState::kRecovering);
    CHECK(f.sup->restartCount() == 1);  // the signal is a failure, as torchrun counts it
    REQUIRE(f.launcher.spawned.size() == 3);
    CHECK(f.launcher.spawned[2].second.local_rank == 1);
    CHECK(f.planned.back() == 1);
  }
}

TEST_CASE(
    "in-place across nodes: SIGTERM leaves the rendezvous once the workers are gone, so the other "
    "nodes recover after the step the leavers agreed on",
    "[agent][inplace]") {
  SECTION("every worker a Trainer") {
    TwoNodes f;
    const auto pids = f.first();
    f.sup->onSignal(SIGTERM);
    CHECK(f.sup->state() == AgentState::kStopping);
    CHECK(f.launcher.signalsSent(SIGTERM) == 2);
    CHECK(f.rdzv.leaves == 0);  // still a member while its ranks finish the step
    f.say(pids[0], ControlType::kGoodbye, {{"reason", "stop"}});
    CHECK(f.rdzv.leaves == 0);
    f.say(pids[1], ControlType::kGoodbye, {{"reason", "stop"}});
    CHECK(f.rdzv.leaves == 1);  // every rank left its group: their exits are not waited for
    f.sup->onWorkerExit(pids[0], ExitStatus{false, 0});
    f.sup->onWorkerExit(pids[1], ExitStatus{false, 0});
    CHECK(f.sup->state() == AgentState::kFailed);
    CHECK(f.sup->exitCode() == 128 + SIGTERM);
    CHECK(f.rdzv.leaves == 1);
    CHECK(f.sup->leftRun());
  }
  SECTION("workers that stop with the others (SIGTERM to every node) end first") {
    TwoNodes f;
    const auto pids = f.first();
    f.sup->onSignal(SIGTERM);
    f.sup->onWorkerExit(pids[0], ExitStatus{false, 0});
    CHECK(f.rdzv.leaves == 0);
    f.sup->onWorkerExit(pids[1], ExitStatus{false, 0});
    CHECK(f.rdzv.leaves == 1);
    CHECK(f.sup->state() == AgentState::kFailed);
  }
  SECTION("a worker that is no Trainer: the leave is told at once, as in process mode") {
    TwoNodes f;
    const auto pids = f.first();
    f.sup->onControlClosed(pids[1]);
    f.sup->onSignal(SIGTERM);
    CHECK(f.rdzv.leaves == 1);
    for (int pid : pids) f.sup->onWorkerExit(pid, ExitStatus{true, SIGTERM});
    CHECK(f.sup->state() == AgentState::kFailed);
    CHECK(f.rdzv.leaves == 1);
  }
}

TEST_CASE(
    "in-place across nodes: a worker crash during the grace after a change of nodes is that "
    "change, free of charge",
    "[agent][inplace]") {
  TwoNodes f;
  f.sup->onMembershipChange();
  f.sup->onWorkerExit(f.first()[0], ExitStatus{false, 1});
  CHECK(f.sup->state() == AgentState::kStopping);
  CHECK(f.sup->restartCount() == 0);
  CHECK(f.rdzv.failures == 0);
  f.sup->onWorkerExit(f.first()[1], ExitStatus{true, SIGTERM});
  CHECK(f.sup->state() == AgentState::kRunning);  // re-formed, every worker fresh
  CHECK(f.sup->restartCount() == 0);
}

TEST_CASE(
    "in-place across nodes: a failure that ends a free recovery (a change of nodes) in a fallback "
    "is charged once, and fails the job with the budget spent",
    "[agent][inplace]") {
  SECTION("a worker exits non-zero during the recovery") {
    TwoNodes f;
    f.rdzv.hold = true;
    f.sup->onMembershipChange();
    f.clock.advance(std::chrono::seconds(2));
    f.fireDeadlines();
    REQUIRE(f.sup->state() == AgentState::kRecovering);
    CHECK(f.sup->restartCount() == 0);  // a change of nodes is free
    // The group is out, and this worker heard of the recovery.
    f.formRound(1);
    f.say(f.first()[0], ControlType::kAborted, {{"gen", "1"}});
    f.sup->onWorkerExit(f.first()[0], ExitStatus{false, 1});
    CHECK(f.sup->state() == AgentState::kStopping);
    f.sup->onWorkerExit(f.first()[1], ExitStatus{true, SIGTERM});
    CHECK(f.sup->state() == AgentState::kRendezvous);  // every worker restarts in a new round
    CHECK(f.sup->restartCount() == 1);                 // its failure is charged, once
  }
  SECTION("a worker gives up, with no restart left") {
    InPlaceFixture f(2, /*max_restarts=*/0, /*multi_node=*/true);
    f.rdzv.round.local_world_sizes = {2, 2};
    f.rdzv.round.group_rank = 1;
    f.sup->start();
    f.allCapable();
    f.rdzv.hold = true;
    f.sup->onMembershipChange();
    f.clock.advance(std::chrono::seconds(2));
    f.fireDeadlines();
    REQUIRE(f.sup->state() == AgentState::kRecovering);
    f.say(f.first()[1], ControlType::kGoodbye, {{"reason", "giveup"}});
    CHECK(f.sup->state() == AgentState::kStopping);
    for (int pid : f.first()) f.sup->onWorkerExit(pid, ExitStatus{false, 1});
    CHECK(f.sup->state() == AgentState::kFailed);
    CHECK(f.sup->exitCode() == 1);
    CHECK_THAT(f.sup->errorMessage(),
               Catch::Contains("gave up recovering") && Catch::Contains("--max-restarts=0"));
  }
  SECTION("the round does not form in time: the rendezvous's, still free") {
    TwoNodes f;
    f.rdzv.hold = true;
    f.sup->onMembershipChange();
    f.clock.advance(std::chrono::seconds(2));
    f.fireDeadlines();
    REQUIRE(f.sup->state() == AgentState::kRecovering);
    f.clock.advance(std::chrono::seconds(11));
    f.fireDeadlines();
    CHECK(f.sup->state() == AgentState::kStopping);
    for (int pid : f.first()) f.sup->onWorkerExit(pid, ExitStatus{true, SIGTERM});
    CHECK(f.sup->restartCount() == 0);
  }
}

TEST_CASE("in-place across nodes: the exit barrier has no grace left to wait for",
          "[agent][inplace]") {
  TwoNodes f;
  f.rdzv.hold_barrier = true;
  f.sup->onMembershipChange();
  for (int pid : f.first()) f.sup->onWorkerExit(pid, ExitStatus{false, 0});
  CHECK(f.sup->state() == AgentState::kExitBarrier);
  // Only the barrier's own deadline remains (no past deadline the loop would spin on).
  REQUIRE(f.sup->nextDeadline().has_value());
  CHECK(*f.sup->nextDeadline() > f.clock.now());
}

namespace {
const std::string kVeto =
    "node 0 of round 0 (127.0.0.2) restarts its workers as processes (its agent runs "
    "--restart-mode=process, or a ddprun without in-place recovery)";
}  // namespace

TEST_CASE(
    "in-place across nodes: in a round where another node restarts processes, every failure "
    "restarts processes here too, at once, and the round says so once",
    "[agent][inplace]") {
  LogCapture log("agent");
  const std::string line =
      "--restart-mode=in-place: " + kVeto + "; this job recovers by restarting processes";
  SECTION("a worker fails") {
    TwoNodes f(kVeto);
    CHECK(log.count(line) == 1);
    const auto pids = f.first();
    f.sup->onWorkerExit(pids[1], ExitStatus{true, SIGKILL});
    CHECK(f.sup->state() == AgentState::kStopping);
    CHECK(f.launcher.signalsSent(SIGTERM) == 1);
    CHECK(f.channel.to(pids[0], ControlType::kAbort).empty());
    f.clock.advance(std::chrono::seconds(1));  // failure_grace: reported as in process mode
    f.fireDeadlines();
    CHECK(f.rdzv.failures == 1);
    f.sup->onWorkerExit(pids[0], ExitStatus{true, SIGTERM});
    CHECK(f.sup->state() == AgentState::kRunning);
    CHECK(f.sup->restartCount() == 1);
    CHECK(log.count(line) == 1);
  }
  SECTION("the nodes change: no grace, no recovery") {
    TwoNodes f(kVeto);
    f.sup->onMembershipChange();
    CHECK(f.sup->state() == AgentState::kStopping);
    CHECK_FALSE(f.sup->nextDeadline() == f.clock.now() + std::chrono::seconds(1));
  }
  SECTION("SIGTERM: the leave is told at once, as in process mode") {
    TwoNodes f(kVeto);
    f.sup->onSignal(SIGTERM);
    CHECK(f.rdzv.leaves == 1);
  }
  SECTION("a peer fails") {
    TwoNodes f(kVeto);
    f.sup->onPeerFailure(agent::FailureKind::kWorkers);
    CHECK(f.sup->state() == AgentState::kStopping);
    CHECK(f.rdzv.joins == 1);
  }
}

TEST_CASE(
    "in-place across nodes: a node that restarts processes in the round a recovery forms ends "
    "the recovery at once: every node restarts into the next round, nothing charged twice",
    "[agent][inplace]") {
  for (const bool charged : {true, false}) {
    INFO((charged ? "a local failure" : "a change of nodes"));
    LogCapture log("agent");
    TwoNodes f;
    const auto pids = f.first();
    f.rdzv.hold = true;
    if (charged) {
      f.sup->onWorkerExit(pids[1], ExitStatus{true, SIGKILL});
    } else {
      f.say(pids[0], ControlType::kAborted, {{"gen", "1"}});  // its collectives failed: no grace
      f.say(pids[1], ControlType::kAborted, {{"gen", "1"}});
      f.sup->onMembershipChange();
    }
    REQUIRE(f.sup->state() == AgentState::kRecovering);
    const int failures = f.rdzv.failures;
    f.rdzv.round.in_place_veto = kVeto;
    f.formRound(1);
    CHECK(f.sup->state() == AgentState::kStopping);
    CHECK(log.count("in-place recovery failed (" + kVeto + "); restarting every worker") == 1);
    // The others restart too, and the snapshot the old rank 0 saves now reaches them in that round.
    CHECK(f.rdzv.failures == failures + 1);
    CHECK(f.rdzv.failure_kinds.back() == agent::FailureKind::kRecovery);
    CHECK(f.channel.to(pids[0], ControlType::kGroup).empty());
    for (int pid : pids) {
      if (charged && pid == pids[1]) continue;
      f.sup->onWorkerExit(pid, ExitStatus{true, SIGTERM});
    }
    CHECK(f.sup->state() == AgentState::kRendezvous);
    CHECK(f.sup->restartCount() == (charged ? 1 : 0));
  }
}

namespace {
// The second of two nodes of two workers each, started; its workers never announce support.
struct UnannouncedSecondNode : InPlaceFixture {
  explicit UnannouncedSecondNode(int max_restarts = 2)
      : InPlaceFixture(2, max_restarts, /*multi_node=*/true) {
    rdzv.round.local_world_sizes = {2, 2};
    rdzv.round.group_rank = 1;
    sup->start();
  }
};
}  // namespace

TEST_CASE(
    "in-place across nodes: the restarting-processes line is said once per reason, and again "
    "when the reason changes",
    "[agent][inplace]") {
  LogCapture log("agent");
  UnannouncedSecondNode f;
  f.sup->onPeerFailure(agent::FailureKind::kWorkers);
  CHECK(log.count("did not announce in-place support") == 1);
  f.rdzv.round.in_place_veto = kVeto;  // the next round has a node under process
  for (int pid : f.first()) f.sup->onWorkerExit(pid, ExitStatus{true, SIGTERM});
  REQUIRE(f.sup->state() == AgentState::kRunning);
  CHECK(log.count(kVeto + "; this job recovers by restarting processes") == 1);
  f.sup->onPeerFailure(agent::FailureKind::kWorkers);
  CHECK(f.sup->state() == AgentState::kStopping);
  CHECK(log.count(kVeto) == 1);
  CHECK(log.count("did not announce in-place support") == 1);
}

TEST_CASE(
    "in-place: a failed worker that never announced support means a process restart, even when "
    "every other one did",
    "[agent][inplace]") {
  for (const bool multi_node : {false, true}) {
    INFO("multi-node " << multi_node);
    LogCapture log("agent");
    InPlaceFixture f(2, 2, multi_node);
    if (multi_node) f.rdzv.round.local_world_sizes = {2, 2};
    f.sup->start();
    const auto pids = f.first();
    f.capable(pids[0]);
    f.hello(pids[1]);  // it never says it can
    CHECK(f.sup->inPlaceVote() == InPlaceVote::kInPlace);
    f.sup->onControlClosed(pids[1]);  // a dying worker's channel closes before its exit
    f.sup->onWorkerExit(pids[1], ExitStatus{true, SIGKILL});
    if (multi_node) f.clock.advance(std::chrono::seconds(1));  // the failure grace
    f.fireDeadlines();
    // Its replacement, the same program, would not join the survivors' group either.
    CHECK(f.sup->state() == AgentState::kStopping);
    CHECK(f.launcher.spawned.size() == 2);
    CHECK(f.channel.to(pids[0], ControlType::kAbort).empty());
    CHECK(log.count("--restart-mode=in-place: local rank 1 (pid " + std::to_string(pids[1]) +
                    ") did not announce in-place support") == 1);
    CHECK(log.count("closed its DDPRUN_CONTROL_SOCKET") == 0);
    CHECK(f.rdzv.failures == 1);
    // The next round's vote (multi-node) is against, with the channel kept open: this node's
    // fresh workers run as processes, and may say they can.
    CHECK(f.sup->inPlaceVote() == InPlaceVote::kListen);
    f.sup->onWorkerExit(pids[0], ExitStatus{true, SIGTERM});
    CHECK(f.sup->state() == AgentState::kRunning);
    CHECK(f.sup->restartCount() == 1);
    CHECK(f.sup->inPlaceVote() == InPlaceVote::kListen);  // until one announces support
    f.capable(f.launcher.spawned.back().first);
    CHECK(f.sup->inPlaceVote() == InPlaceVote::kInPlace);
  }
}

TEST_CASE(
    "in-place: a failed worker that announced support is replaced alone after its channel "
    "closed",
    "[agent][inplace]") {
  InPlaceFixture f(2);
  f.sup->start();
  f.allCapable();
  const auto pids = f.first();
  f.sup->onControlClosed(pids[1]);
  f.sup->onWorkerExit(pids[1], ExitStatus{true, SIGKILL});
  CHECK(f.sup->state() == AgentState::kRecovering);
  CHECK(f.launcher.spawned.size() == 3);
  CHECK(f.sup->inPlaceVote() == InPlaceVote::kInPlace);
}

TEST_CASE(
    "in-place across nodes: a node whose worker failed unannounced votes against the next "
    "rounds, runs them as process mode, and says why once (workers still starting do not)",
    "[agent][inplace]") {
  LogCapture log("agent");
  UnannouncedSecondNode f(/*max_restarts=*/4);
  // A peer's failure while its workers have not announced support (they may be starting): this
  // node restarts its workers, and still votes for in-place recovery.
  f.sup->onPeerFailure(agent::FailureKind::kWorkers);
  CHECK(f.sup->state() == AgentState::kStopping);
  CHECK(f.sup->inPlaceVote() == InPlaceVote::kInPlace);
  for (int pid : f.first()) f.sup->onWorkerExit(pid, ExitStatus{true, SIGTERM});
  REQUIRE(f.sup->state() == AgentState::kRunning);
  // One of the new workers fails before it announced support: its replacement would not either.
  const int failed = f.launcher.spawned.back().first;
  f.sup->onWorkerExit(failed, ExitStatus{false, 1});
  f.clock.advance(std::chrono::seconds(1));  // the failure grace
  f.fireDeadlines();
  CHECK(f.sup->state() == AgentState::kStopping);
  CHECK(f.sup->inPlaceVote() == InPlaceVote::kListen);
  // The identity exchange hands the round up with this node's own vote against, soft (its agent
  // listens on its channel).
  f.rdzv.round.in_place_veto = "this node (node 1 of round 1) restarts its workers as processes";
  f.rdzv.round.in_place_veto_own = true;
  f.rdzv.round.in_place_veto_soft = true;
  f.sup->onWorkerExit(f.launcher.spawned[2].first, ExitStatus{true, SIGTERM});
  REQUIRE(f.sup->state() == AgentState::kRunning);
  CHECK(log.count("did not announce in-place support") == 1);
  CHECK(log.count("this node (node 1") == 0);  // its reason was said
  CHECK(f.sup->inPlaceVote() == InPlaceVote::kListen);
  // A failure in that round while its workers have not announced support restarts processes at
  // once, with no other line on why.
  f.sup->onPeerFailure(agent::FailureKind::kWorkers);
  CHECK(f.sup->state() == AgentState::kStopping);
  CHECK(log.count("this job recovers by restarting processes") == 1);
  CHECK(log.count("this node (node 1") == 0);
  const size_t stopped = f.launcher.spawned.size();
  for (size_t i = stopped - 2; i < stopped; ++i) {
    f.sup->onWorkerExit(f.launcher.spawned[i].first, ExitStatus{true, SIGTERM});
  }
  REQUIRE(f.sup->state() == AgentState::kRunning);
  // Its fresh workers announce support (a Trainer that had crashed early in its start-up): the
  // vote is back, and a failure in this round already starts an in-place recovery, which the
  // next round's votes decide.
  const size_t n = f.launcher.spawned.size();
  for (size_t i = n - 2; i < n; ++i) f.capable(f.launcher.spawned[i].first);
  CHECK(f.sup->inPlaceVote() == InPlaceVote::kInPlace);
  f.rdzv.hold = true;
  f.sup->onPeerFailure(agent::FailureKind::kWorkers);
  CHECK(f.sup->state() == AgentState::kRecovering);
  CHECK(f.channel.to(f.launcher.spawned[n - 1].first, ControlType::kAbort).size() == 1);
}

TEST_CASE(
    "in-place across nodes: under a hard veto (a node under process mode) a failure restarts "
    "processes at once, and under a soft one (every agent listens) it starts an in-place recovery",
    "[agent][inplace]") {
  for (const bool soft : {false, true}) {
    INFO((soft ? "soft" : "hard"));
    InPlaceFixture f(2, 2, /*multi_node=*/true);
    f.rdzv.round.local_world_sizes = {2, 2};
    f.rdzv.round.in_place_veto = kVeto;
    f.rdzv.round.in_place_veto_soft = soft;
    f.sup->start();
    f.allCapable();
    f.rdzv.hold = true;
    f.sup->onWorkerExit(f.first()[1], ExitStatus{true, SIGKILL});
    if (!soft) {
      f.clock.advance(std::chrono::seconds(1));  // the failure grace
      f.fireDeadlines();
    }
    CHECK(f.sup->state() == (soft ? AgentState::kRecovering : AgentState::kStopping));
    CHECK(f.channel.to(f.first()[0], ControlType::kAbort).size() == (soft ? 1u : 0u));
  }
}

TEST_CASE("in-place across nodes: a node that recovers in place votes for it in the next round",
          "[agent][inplace]") {
  TwoNodes f;
  const auto pids = f.first();
  f.rdzv.hold = true;
  f.sup->onWorkerExit(pids[1], ExitStatus{true, SIGKILL});
  REQUIRE(f.sup->state() == AgentState::kRecovering);
  CHECK(f.sup->inPlaceVote() == InPlaceVote::kInPlace);
}
