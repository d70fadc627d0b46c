// In-place recovery end to end (issue 37; docs/in-place-recovery.md): ddprun with
// --restart-mode=in-place runs `train` on three local workers; one is killed with SIGKILL
// mid-epoch. Only it is replaced: the survivors keep their processes, re-form the group, hand the
// newcomer the live state and go on from the last completed step. The parameters at the end are
// bit-identical to those of a run without the fault.
#include <catch2/catch.hpp>
#include <filesystem>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "test_util.h"

namespace t = ddprun::worker::testing;
using namespace std::chrono_literals;

namespace {

std::string ddprunBin() {
  return t::envOr("DDPRUN_TEST_DDPRUN", t::buildDir() + "/launcher/ddprun");
}

// train on 3 local workers: 3 epochs of 8 steps (768 samples, 256 per rank, batch 32).
std::vector<std::string> trainArgv(const std::vector<std::string>& launcher_flags,
                                   const std::vector<std::string>& train_flags) {
  std::vector<std::string> argv{ddprunBin(), "--standalone", "--nproc-per-node=3"};
  argv.insert(argv.end(), launcher_flags.begin(), launcher_flags.end());
  argv.insert(argv.end(), {t::buildDir() + "/examples/train", "3", "1", "--dataset-size", "768"});
  argv.insert(argv.end(), train_flags.begin(), train_flags.end());
  return argv;
}

// "[RANK r] pid P joined generation G" lines: rank -> the pids that joined as it.
std::map<int, std::vector<int>> joinedPids(const std::string& out) {
  std::map<int, std::vector<int>> pids;
  static const std::regex line(R"(\[RANK (\d+)\] pid (\d+) joined generation)");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), line); it != std::sregex_iterator();
       ++it) {
    pids[std::stoi((*it)[1])].push_back(std::stoi((*it)[2]));
  }
  return pids;
}

// The parameters of the job run without a fault (process mode), the reference of every case.
std::string faultFreeParameters(const t::TempDir& dir) {
  t::Process clean(trainArgv({"--max-restarts=1"}, {"--snapshot-path", dir.str() + "/a/snap.pt",
                                                    "--dump-params", dir.str() + "/a.bin"}),
                   {{"OMP_NUM_THREADS", "1"}}, {dir.str() + "/clean.log", true});
  auto c = clean.waitExit(240s);
  INFO("run without a fault:\n" << clean.output());
  REQUIRE(c.has_value());
  REQUIRE(*c == 0);
  const std::string a = t::readFile(dir.str() + "/a.bin");
  REQUIRE(a.size() == 21 * 4);  // Linear(20, 1)
  return a;
}

// In-place recovery needs ddprun's agent: false (with a warning) where it is not built.
bool haveDdprun() {
  if (std::filesystem::exists(ddprunBin())) return true;
  WARN("ddprun is not built here: in-place recovery needs ddprun's agent; skipped");
  return false;
}

// The job under --restart-mode=in-place with the last rank killed after step 12 (in the middle of
// epoch 1, steps 9-16, four steps after the snapshot of epoch 0); snapshot, parameters and log
// under dir/<tag>.
std::unique_ptr<t::Process> inPlaceRun(const t::TempDir& dir, const std::string& tag,
                                       std::map<std::string, std::string> env,
                                       const std::string& signal = "KILL", int fail_ranks = 1) {
  env["OMP_NUM_THREADS"] = "1";
  return std::make_unique<t::Process>(
      trainArgv({"--max-restarts=1", "--restart-mode=in-place"},
                {"--snapshot-path", dir.str() + "/" + tag + "/snap.pt", "--dump-params",
                 dir.str() + "/" + tag + ".bin", "--fail-at-step", "12", "--fail-signal", signal,
                 "--fail-ranks", std::to_string(fail_ranks)}),
      env, t::ProcessOptions{dir.str() + "/" + tag + ".log", true});
}

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Ranks 0 and 1 went on in place after `step` (none lost, none trained twice), keeping their
// processes; rank 2's replacement took rank 0's live state, not the snapshot, and nobody restarted.
void checkRank2ReplacedAlone(const std::string& out, int step) {
  const std::string after = "after step " + std::to_string(step);
  CHECK(count(out, "going on " + after) == 2);
  CHECK_THAT(out, Catch::Contains("[RANK 2] took rank 0's live state " + after));
  CHECK_THAT(out, !Catch::Contains("Resuming training from snapshot"));
  CHECK_THAT(out, !Catch::Contains("restarting every worker"));
  // Ranks 0 and 1 joined once (the same processes throughout); rank 2 twice (the replacement).
  const auto pids = joinedPids(out);
  REQUIRE(pids.count(0) == 1);
  REQUIRE(pids.count(1) == 1);
  REQUIRE(pids.count(2) == 1);
  CHECK(pids.at(0).size() == 1);
  CHECK(pids.at(1).size() == 1);
  REQUIRE(pids.at(2).size() == 2);
  CHECK(pids.at(2)[0] != pids.at(2)[1]);
}

}  // namespace

TEST_CASE(
    "in-place recovery: a worker killed mid-epoch is replaced alone, the survivors keep "
    "their processes and the result equals a run without the fault",
    "[worker][train][inplace]") {
  if (!haveDdprun()) return;
  t::TempDir dir;
  const std::string a = faultFreeParameters(dir);

  auto faulty = inPlaceRun(dir, "b", {});
  auto c = faulty->waitExit(240s);
  const std::string out = faulty->output();
  INFO("run with a fault, recovered in place:\n" << out);
  REQUIRE(c.has_value());
  CHECK(*c == 0);
  CHECK_THAT(out, Catch::Contains("fault injection: killing myself at step 12"));
  CHECK_THAT(out, Catch::Contains("recovering in place as generation"));
  CHECK_THAT(out, Catch::Contains("in-place recovery, generation"));
  // Step 12 is the last step every rank completed.
  checkRank2ReplacedAlone(out, 12);
  CHECK(t::readFile(dir.str() + "/b.bin") == a);
}

TEST_CASE(
    "in-place recovery: ranks that die before they heard of the recovery (two killed at once, "
    "or one in its abort) are replaced in it too, charged once, and the result equals a run "
    "without the fault",
    "[worker][train][inplace]") {
  if (!haveDdprun()) return;
  t::TempDir dir;
  const std::string a = faultFreeParameters(dir);

  for (const std::string tag : {"two", "abort"}) {
    const bool two = tag == std::string("two");
    auto faulty = two ? inPlaceRun(dir, tag, {}, "KILL", /*fail_ranks=*/2)
                      : inPlaceRun(dir, tag, {{"DDPRUN_INPLACE_FAULT", "abort:1"}});
    auto c = faulty->waitExit(240s);
    const std::string out = faulty->output();
    INFO(tag << ":\n" << out);
    REQUIRE(c.has_value());
    CHECK(*c == 0);  // --max-restarts=1: one failure
    CHECK(count(out, "fault injection: killing myself at step 12") == (two ? 2 : 1));
    if (!two) CHECK_THAT(out, Catch::Contains("DDPRUN_INPLACE_FAULT: exiting during the abort"));
    CHECK(count(out, "before it heard of the recovery; it is replaced in this recovery too") == 1);
    CHECK_THAT(out, !Catch::Contains("restarting every worker"));
    CHECK_THAT(out, !Catch::Contains("Resuming training from snapshot"));
    // Rank 0 kept its process and went on after step 12; ranks 1 and 2 joined twice each (the
    // second time as replacements, which took rank 0's live state).
    CHECK(count(out, "going on after step 12") == 1);
    CHECK(count(out, "took rank 0's live state after step 12") == 2);
    const auto pids = joinedPids(out);
    REQUIRE(pids.count(0) == 1);
    CHECK(pids.at(0).size() == 1);
    for (int r : {1, 2}) {
      REQUIRE(pids.count(r) == 1);
      CHECK(pids.at(r).size() == 2);
    }
    CHECK(t::readFile(dir.str() + "/" + tag + ".bin") == a);
  }
}

TEST_CASE(
    "in-place recovery: a rank lost while the others build their buckets at start-up ends their "
    "wait at the agent's abort, and the job recovers at once, not after inplace_timeout",
    "[worker][train][inplace]") {
  if (!haveDdprun()) return;
  t::TempDir dir;
  const std::string a = faultFreeParameters(dir);
  // Rank 2 said it can recover in place, then exits before it publishes its buckets' shared
  // memory: ranks 0 and 1 wait for its key in the store. They waited for inplace_timeout (60 s),
  // and only then did the agent restart every worker. Now their wait ends at the agent's abort;
  // they exit before they could say `aborted`, so they are replaced in the same recovery.
  t::Process faulty(trainArgv({"--max-restarts=1", "--restart-mode=in-place"},
                              {"--snapshot-path", dir.str() + "/b/snap.pt", "--dump-params",
                               dir.str() + "/b.bin"}),
                    {{"OMP_NUM_THREADS", "1"}, {"DDPRUN_INPLACE_FAULT", "buckets:2"}},
                    {dir.str() + "/b.log", true});
  auto c = faulty.waitExit(240s);
  const std::string out = faulty.output();
  INFO(out);
  REQUIRE(c.has_value());
  CHECK(*c == 0);
  CHECK_THAT(out, Catch::Contains("DDPRUN_INPLACE_FAULT: exiting during the buckets phase"));
  CHECK_THAT(out, Catch::Contains("gave up waiting for store keys"));
  CHECK_THAT(out, Catch::Contains("the agent aborted generation 1"));
  CHECK_THAT(out, !Catch::Contains("inplace_timeout"));
  CHECK(t::readFile(dir.str() + "/b.bin") == a);
}

TEST_CASE(
    "in-place recovery: a failure during the state sync falls back to restarting every worker, "
    "charged once, with nothing left running",
    "[worker][train][inplace]") {
  if (!haveDdprun()) return;
  t::TempDir dir;
  const std::string a = faultFreeParameters(dir);

  for (const std::string fault : {"sync:0"}) {
    const std::string tag = fault.substr(0, fault.find(':'));
    auto faulty = inPlaceRun(dir, tag, {{"DDPRUN_INPLACE_FAULT", fault}});
    auto c = faulty->waitExit(240s);
    const std::string out = faulty->output();
    INFO("DDPRUN_INPLACE_FAULT=" << fault << ":\n" << out);
    REQUIRE(c.has_value());
    CHECK(*c == 0);  // --max-restarts=1 covers the failure and its fallback: charged once
    CHECK_THAT(out, Catch::Contains("DDPRUN_INPLACE_FAULT: exiting during the " + tag));
    CHECK_THAT(out, Catch::Contains("in-place recovery failed"));
    CHECK_THAT(out, Catch::Contains("restarting every worker (the failure is charged once)"));
    CHECK_THAT(out, Catch::Contains("Resuming training from snapshot at Epoch 1"));
    CHECK(t::readFile(dir.str() + "/" + tag + ".bin") == a);
    // Nothing of the run outlives it (the bracket keeps pgrep's own shell from matching).
    CHECK(t::run("pgrep -f '" + dir.str() + "/" + tag + "/snap[.]pt' 2>&1").output.empty());
  }
}

TEST_CASE(
    "in-place recovery: workers sent SIGTERM alone leave after the agreed step, replacements "
    "take the survivors' live state and the result equals a run without it",
    "[worker][train][inplace]") {
  if (!haveDdprun()) return;
  t::TempDir dir;
  const std::string a = faultFreeParameters(dir);

  auto job = inPlaceRun(dir, "term", {}, "TERM");
  auto c = job->waitExit(240s);
  const std::string out = job->output();
  INFO("run with rank 2 sent SIGTERM after step 12:\n" << out);
  REQUIRE(c.has_value());
  CHECK(*c == 0);
  CHECK_THAT(out, Catch::Contains("fault injection: sending myself SIGTERM at step 12"));
  // The request is agreed on one step late: everyone stops at the boundary after step 13, where
  // rank 2 leaves and ranks 0 and 1 re-form without it (rank 0 stays: it saves nothing then).
  CHECK_THAT(out, Catch::Contains("[RANK 2] left the job on SIGTERM after step 13"));
  CHECK_THAT(out, !Catch::Contains("(checkpoint signal"));
  CHECK_THAT(out, Catch::Contains("1 of 3 ranks were sent SIGTERM and left the job after step 13"));
  CHECK_THAT(out, Catch::Contains("after it left the job on a signal sent to it; recovering in "
                                  "place as generation 2 (1 of 1 restarts used)"));
  checkRank2ReplacedAlone(out, 13);
  CHECK(t::readFile(dir.str() + "/term.bin") == a);

  // Ranks 1 and 2 sent SIGTERM at the same step leave together; the agent reaps one, starts its
  // replacement, and replaces the other in the same recovery (charged once).
  auto two = inPlaceRun(dir, "term2", {}, "TERM", /*fail_ranks=*/2);
  c = two->waitExit(240s);
  const std::string out2 = two->output();
  INFO("run with ranks 1 and 2 sent SIGTERM after step 12:\n" << out2);
  REQUIRE(c.has_value());
  CHECK(*c == 0);
  for (int rank : {1, 2}) {
    const std::string r = "[RANK " + std::to_string(rank) + "] ";
    CHECK_THAT(out2, Catch::Contains(r + "left the job on SIGTERM after step 13"));
    CHECK_THAT(out2, Catch::Contains(r + "took rank 0's live state after step 13"));
  }
  CHECK_THAT(out2,
             Catch::Contains("2 of 3 ranks were sent SIGTERM and left the job after step 13"));
  CHECK_THAT(out2, Catch::Contains("(1 of 1 restarts used)"));
  CHECK_THAT(out2, Catch::Contains("it is replaced in this recovery too"));
  CHECK_THAT(out2, !Catch::Contains("Resuming training from snapshot"));
  CHECK_THAT(out2, !Catch::Contains("restarting every worker"));
  const auto pids = joinedPids(out2);
  REQUIRE(pids.count(0) == 1);
  CHECK(pids.at(0).size() == 1);  // rank 0 kept its process
  for (int rank : {1, 2}) {
    REQUIRE(pids.count(rank) == 1);
    CHECK(pids.at(rank).size() == 2);
  }
  CHECK(t::readFile(dir.str() + "/term2.bin") == a);

  // Rank 2 killed after step 12; rank 1 is sent SIGTERM as it starts waiting for the new group
  // (the group is there already: the agent sends it with the abort). It leaves at once with the
  // last step it completed, and is replaced in the same recovery, charged once.
  auto wait = inPlaceRun(dir, "wait", {{"DDPRUN_INPLACE_FAULT", "wait:1"}});
  c = wait->waitExit(240s);
  const std::string out3 = wait->output();
  INFO("run with rank 2 killed after step 12 and rank 1 sent SIGTERM mid-recovery:\n" << out3);
  REQUIRE(c.has_value());
  CHECK(*c == 0);
  CHECK_THAT(out3, Catch::Contains("[RANK 1] DDPRUN_INPLACE_FAULT: sending myself SIGTERM"));
  CHECK_THAT(out3, Catch::Contains("[RANK 1] left the job on a signal during the in-place "
                                   "recovery, after step 12"));
  CHECK_THAT(out3, Catch::Contains("it is replaced in this recovery too"));
  CHECK_THAT(out3, Catch::Contains("(1 of 1 restarts used)"));
  for (int rank : {1, 2}) {
    CHECK_THAT(out3, Catch::Contains("[RANK " + std::to_string(rank) +
                                     "] took rank 0's live state after step 12"));
  }
  CHECK_THAT(out3, !Catch::Contains("Resuming training from snapshot"));
  CHECK_THAT(out3, !Catch::Contains("restarting every worker"));
  const auto pids3 = joinedPids(out3);
  REQUIRE(pids3.count(0) == 1);
  CHECK(pids3.at(0).size() == 1);
  CHECK(t::readFile(dir.str() + "/wait.bin") == a);
}
