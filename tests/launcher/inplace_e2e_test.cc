// In-place recovery across nodes (issue 37; docs/in-place-recovery.md §2.1), end to end: two
// agents on 127.0.0.2 and 127.0.0.3 (a third, 127.0.0.4, joins as a replacement node) run `train`
// with --restart-mode=in-place over a standalone ddprun-rendezvous; real processes, real gloo.
// - A worker killed with SIGKILL mid-epoch: only it is replaced, the survivors on both nodes keep
//   their processes and go on from the last completed step; the parameters equal the fault-free
//   run's bit for bit.
// - A whole node killed: the survivors wait, a replacement node joins (--nnodes=2:2) and its new
//   workers take the live state; or nobody comes (--nnodes=1:2) and the world shrinks.
// - One node leaving on SIGTERM (a spot notice): the other goes on in place; a new node joining
//   afterwards takes its live state.
// - One node whose workers do not announce in-place support: one of them failing restarts every
//   worker at once (that node votes against the next rounds); once its fresh workers announce
//   support (a Trainer that had crashed early in its start-up), the next failure is recovered in
//   place again.
#include <sys/stat.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <csignal>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "etcd_cluster.h"
#include "process_helpers.h"
#include "rendezvous_daemon.h"

using namespace ddprun::testing;
using namespace std::chrono_literals;

namespace {

std::string trainBin() { return buildDir() + "/examples/train"; }

// train's arguments for `epochs` epochs of the linear model sleeping 0.2 s a step
// (--step-delay) in place of a larger model's compute, so that a fault lands mid-training: 6
// steps an epoch in a world of 4, 12 in a world of 2.
std::vector<std::string> pacedTrain(const std::string& epochs, const TempDir& dir) {
  return {epochs,           "1",   "--step-delay",    "0.2",
          "--dataset-size", "768", "--snapshot-path", dir / "snap.pt"};
}

// The rendezvous flags: a standalone ddprun-rendezvous ("127.0.0.1:port"), or etcd-v3's members
// ("etcd-v3 http://...").
std::vector<std::string> rendezvousFlags(const std::string& where) {
  const std::string etcd = "etcd-v3 ";
  if (where.rfind(etcd, 0) == 0) {
    return {"--rdzv-backend=etcd-v3", "--rdzv-endpoint=" + where.substr(etcd.size())};
  }
  return {"--rdzv-backend=c10d", "--rdzv-endpoint=" + where};
}

// One node of a 2-worker-per-node train job under `mode`.
std::unique_ptr<Process> node(const std::string& addr, const std::string& endpoint,
                              const std::string& nnodes, const std::string& run_id,
                              const std::string& mode, const std::vector<std::string>& train_args,
                              const std::map<std::string, std::string>& env = {},
                              int max_restarts = 1, const std::string& program = trainBin()) {
  std::vector<std::string> argv = {ddprunBin(), "--nnodes=" + nnodes, "--nproc-per-node=2"};
  for (auto& flag : rendezvousFlags(endpoint)) argv.push_back(flag);
  argv.insert(argv.end(),
              {"--rdzv-id=" + run_id, "--local-addr=" + addr,
               "--max-restarts=" + std::to_string(max_restarts), "--restart-mode=" + mode,
               "--rdzv-conf=last_call_timeout=1,heartbeat_interval=0.5,heartbeat_misses=3",
               "--no-python", program});
  argv.insert(argv.end(), train_args.begin(), train_args.end());
  auto e = env;
  e["OMP_NUM_THREADS"] = "1";
  return std::make_unique<Process>(argv, e);
}

// Two nodes (127.0.0.2, 127.0.0.3) of one in-place job, returned once either logged epoch 1;
// `b_env`: the second's environment.
std::pair<std::unique_ptr<Process>, std::unique_ptr<Process>> twoTraining(
    const std::string& endpoint, const std::string& nnodes, const std::string& run,
    const std::vector<std::string>& train_args,
    const std::map<std::string, std::string>& b_env = {}) {
  auto a = node("127.0.0.2", endpoint, nnodes, run, "in-place", train_args);
  auto b = node("127.0.0.3", endpoint, nnodes, run, "in-place", train_args, b_env);
  REQUIRE(waitUntil([&] { return (a->out() + b->out()).find("Epoch 1 |") != std::string::npos; },
                    180s));
  return {std::move(a), std::move(b)};
}

// "[RANK r] pid P joined generation G" lines: the pids that joined.
std::vector<int> joinedPids(const std::string& out) {
  std::vector<int> pids;
  static const std::regex line(R"(\[RANK \d+\] pid (\d+) joined generation)");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), line); it != std::sregex_iterator();
       ++it) {
    pids.push_back(std::stoi((*it)[1]));
  }
  return pids;
}

// Both nodes' results, asserted to have ended.
std::pair<Finished, Finished> finish(Process& a, Process& b, std::chrono::seconds bound = 240s) {
  auto ra = a.wait(bound), rb = b.wait(bound);
  INFO("first node:\n" << a.out() << a.err() << "\nsecond node:\n" << b.out() << b.err());
  REQUIRE(ra);
  REQUIRE(rb);
  return {*ra, *rb};
}

// The node's workers went on in place through a change of nodes: the same processes as
// `workers`, no restart, no snapshot read.
void checkKeptInPlace(const Finished& kept, const std::vector<int>& workers) {
  CHECK(kept.err.find("the job's nodes changed; recovering in place") != std::string::npos);
  CHECK(kept.err.find("restarting every worker") == std::string::npos);
  CHECK(kept.out.find("Resuming training from snapshot") == std::string::npos);
  const auto joined = joinedPids(kept.out);
  CHECK(std::set<int>(joined.begin(), joined.end()) ==
        std::set<int>(workers.begin(), workers.end()));
}

}  // namespace

TEST_CASE(
    "in-place across nodes: a worker killed mid-epoch is replaced alone, the survivors on both "
    "nodes keep their processes, and the result equals a run without the fault",
    "[multinode][inplace]") {
  RendezvousDaemon rdzv;
  TempDir dir;
  // 3 epochs of 6 steps (768 samples, 192 per rank, batch 32); the last rank dies after step 8.
  auto args = [&](const std::string& tag, bool fault) {
    std::vector<std::string> a = {"3",
                                  "1",
                                  "--dataset-size",
                                  "768",
                                  "--snapshot-path",
                                  dir / (tag + "-" + "snap.pt"),
                                  "--dump-params",
                                  dir / (tag + ".bin")};
    if (fault) a.insert(a.end(), {"--fail-at-step", "8"});
    return a;
  };
  // Rank 0 dumps the parameters: on one of the two nodes.
  auto dumped = [&](const std::string& tag) {
    return fileExists(dir / (tag + "a.bin")) ? readFile(dir / (tag + "a.bin"))
                                             : readFile(dir / (tag + "b.bin"));
  };
  std::string clean;
  {
    auto a = node("127.0.0.2", rdzv.endpoint, "2", "clean", "process", args("a", false));
    auto b = node("127.0.0.3", rdzv.endpoint, "2", "clean", "process", args("b", false));
    auto [ra, rb] = finish(*a, *b);
    REQUIRE(ra.exit_code == 0);
    REQUIRE(rb.exit_code == 0);
    clean = dumped("");
    REQUIRE(clean.size() == 21 * 4);  // Linear(20, 1)
  }
  // The same over etcd-v3, where etcd is installed.
  std::unique_ptr<EtcdCluster> etcd;
  std::vector<std::string> backends = {rdzv.endpoint};
  if (etcdAvailable()) {
    etcd = std::make_unique<EtcdCluster>();
    backends.push_back("etcd-v3 " + etcd->endpoints());
  } else {
    WARN("etcd-v3 case skipped: " + etcdBinary() + " is absent (deploy/install-deps.sh)");
  }
  for (const auto& backend : backends) {
    const std::string tag = backend == rdzv.endpoint ? "c10d" : "etcd";
    INFO("rendezvous: " << tag);
    // At debug level the workers say how the new group got its shared-memory buckets.
    const std::map<std::string, std::string> debug = {{"DDPRUN_LOG_LEVEL", "debug"}};
    auto a =
        node("127.0.0.2", backend, "2", "faulty-" + tag, "in-place", args(tag + "a", true), debug);
    auto b =
        node("127.0.0.3", backend, "2", "faulty-" + tag, "in-place", args(tag + "b", true), debug);
    auto [ra, rb] = finish(*a, *b);
    const std::string all = ra.out + ra.err + rb.out + rb.err;
    INFO(all);
    CHECK(ra.exit_code == 0);
    CHECK(rb.exit_code == 0);
    CHECK(countOf(all, "fault injection: killing myself at step 8") == 1);
    // Both agents recovered in place: the failing node, and the other after the peer's report.
    CHECK(countOf(all, "recovering in place (1 of 1 restarts used)") == 2);
    CHECK(countOf(all, "in-place recovery, generation") == 2);
    CHECK(all.find("restarting every worker") == std::string::npos);
    CHECK(all.find("Resuming training from snapshot") == std::string::npos);
    // Three survivors went on after step 8, the last step every rank completed; the newcomer took
    // the live state of one of them.
    CHECK(countOf(all, "going on after step 8") == 3);
    CHECK(
        std::regex_search(all, std::regex(R"(\[RANK 3\] took rank \d's live state after step 8)")));
    // Four workers joined once, and the replacement: five pids, all distinct.
    const auto pids = joinedPids(all);
    CHECK(pids.size() == 5);
    CHECK(std::set<int>(pids.begin(), pids.end()).size() == 5);
    // The new group's buckets took the old ones' shared memory over on both nodes: the three
    // survivors kept their pages, the newcomer mapped its node's segment through its survivor.
    const int kept = countOf(all, "taken over from the aborted group (kept)");
    const int mapped = countOf(all, "taken over from the aborted group (mapped through pid");
    CHECK(kept > 0);
    CHECK(kept == 3 * mapped);
    CHECK(all.find("not taken over") == std::string::npos);
    CHECK(dumped(tag) == clean);
  }

  // A failure during the recovery itself (rank 0 exits while it sends the state): every node
  // falls back to restarting its workers, charged once (--max-restarts=1 suffices), and the job
  // still ends with the fault-free parameters.
  {
    INFO("DDPRUN_INPLACE_FAULT=sync:0");
    auto a = node("127.0.0.2", rdzv.endpoint, "2", "fault-sync", "in-place", args("synca", true),
                  {{"DDPRUN_INPLACE_FAULT", "sync:0"}});
    auto b = node("127.0.0.3", rdzv.endpoint, "2", "fault-sync", "in-place", args("syncb", true),
                  {{"DDPRUN_INPLACE_FAULT", "sync:0"}});
    auto [ra, rb] = finish(*a, *b);
    const std::string all = ra.out + ra.err + rb.out + rb.err;
    INFO(all);
    CHECK(ra.exit_code == 0);
    CHECK(rb.exit_code == 0);
    CHECK(countOf(all, "DDPRUN_INPLACE_FAULT: exiting during the sync") == 1);
    CHECK(ra.err.find("in-place recovery failed") != std::string::npos);
    CHECK(rb.err.find("in-place recovery failed") != std::string::npos);
    CHECK(countOf(all, "Resuming training from snapshot") == 4);  // every worker fresh
    CHECK(dumped("sync") == clean);
  }

  // Ranks that die before they heard of the recovery are replaced in it too, on either node, the
  // failure charged once: three ranks killed at one step (rank 1 on the first node, 2 and 3 on the
  // second; an agent may see its own dead only after the round formed), and rank 1 dying in its
  // abort of the failed group after rank 3 was killed (it never saw the new group). The others
  // keep their processes and the result is the fault-free one.
  for (const std::string fault : {"ranks:3", "abort:1"}) {
    const std::string tag = fault.substr(0, fault.find(':'));
    const bool three = tag == "ranks";
    INFO((three ? "--fail-ranks 3" : "DDPRUN_INPLACE_FAULT=abort:1"));
    auto with = [&](const std::string& t) {
      auto v = args(t, true);
      if (three) v.insert(v.end(), {"--fail-ranks", "3"});
      return v;
    };
    const std::map<std::string, std::string> env =
        three ? std::map<std::string, std::string>{}
              : std::map<std::string, std::string>{{"DDPRUN_INPLACE_FAULT", fault}};
    auto a = node("127.0.0.2", rdzv.endpoint, "2", "also-" + tag, "in-place", with(tag + "a"), env);
    auto b = node("127.0.0.3", rdzv.endpoint, "2", "also-" + tag, "in-place", with(tag + "b"), env);
    auto [ra, rb] = finish(*a, *b);
    const std::string all = ra.out + ra.err + rb.out + rb.err;
    INFO(all);
    CHECK(ra.exit_code == 0);
    CHECK(rb.exit_code == 0);
    CHECK(countOf(all, "fault injection: killing myself at step 8") == (three ? 3 : 1));
    if (!three) CHECK(countOf(all, "DDPRUN_INPLACE_FAULT: exiting during the abort") == 1);
    // Each death is recovered in place once: as the one that began its node's recovery, or as
    // one replaced in it too (which, depends on what each agent saw first: its own dead, or the
    // other node's report).
    CHECK(
        countOf(all, "was killed by signal 9; recovering in place") +
            countOf(all, "before it heard of the recovery; it is replaced in this recovery too") ==
        (three ? 3 : 2));
    CHECK(countOf(all, "in-place recovery, generation") == 2);  // one recovery on each node
    CHECK(all.find("restarting every worker") == std::string::npos);
    CHECK(all.find("in-place recovery failed") == std::string::npos);
    CHECK(all.find("Resuming training from snapshot") == std::string::npos);
    CHECK(countOf(all, "going on after step 8") == (three ? 1 : 2));
    CHECK(countOf(all, "'s live state after step 8") == (three ? 3 : 2));
    // The survivors joined once; each dead rank's replacement once more: 4 + 3 or 4 + 2 pids.
    const auto pids = joinedPids(all);
    CHECK(pids.size() == (three ? 7u : 6u));
    CHECK(std::set<int>(pids.begin(), pids.end()).size() == pids.size());
    CHECK(dumped(tag) == clean);
  }

  // One node under --restart-mode=process: its vote, cast as every round forms, has the other
  // node run as process mode does. Its workers form the process-mode group (without the vote the
  // two nodes' ranks formed groups under different store prefixes and hung 300 s from the start),
  // and a failure restarts every worker at once, whichever node the killed rank is on.
  {
    INFO("--restart-mode=in-place on one node, process on the other");
    auto a = node("127.0.0.2", rdzv.endpoint, "2", "mixed", "in-place", args("mixeda", true));
    auto b = node("127.0.0.3", rdzv.endpoint, "2", "mixed", "process", args("mixedb", true));
    auto [ra, rb] = finish(*a, *b);
    const std::string all = ra.out + ra.err + rb.out + rb.err;
    INFO(all);
    CHECK(ra.exit_code == 0);
    CHECK(rb.exit_code == 0);
    CHECK(std::regex_search(ra.err, std::regex(R"(--restart-mode=in-place: node [01] of round 1 )"
                                               R"(\(127\.0\.0\.3\) restarts its workers as )"
                                               R"(processes)")));
    CHECK(countOf(ra.err, "this job recovers by restarting processes") == 1);
    CHECK(all.find("recovering in place") == std::string::npos);
    CHECK(all.find("in-place recovery failed") == std::string::npos);
    CHECK(countOf(all, "Resuming training from snapshot") == 4);  // every worker fresh
    CHECK(dumped("mixed") == clean);
  }

  // The recovery fails on one node after the other's ended: rank 0 exits once it completed the
  // first step in the new group, before telling its agent (DDPRUN_INPLACE_FAULT=step:0). Its node
  // restarts its workers and says the failure was charged already; the other node, back in
  // RUNNING, takes them in, in place, without charging it again: --max-restarts=1 suffices.
  {
    INFO("DDPRUN_INPLACE_FAULT=step:0");
    const std::map<std::string, std::string> env = {{"DDPRUN_INPLACE_FAULT", "step:0"}};
    auto a =
        node("127.0.0.2", rdzv.endpoint, "2", "fault-step", "in-place", args("stepa", true), env);
    auto b =
        node("127.0.0.3", rdzv.endpoint, "2", "fault-step", "in-place", args("stepb", true), env);
    auto [ra, rb] = finish(*a, *b);
    const std::string all = ra.out + ra.err + rb.out + rb.err;
    INFO(all);
    CHECK(ra.exit_code == 0);
    CHECK(rb.exit_code == 0);
    CHECK(countOf(all, "DDPRUN_INPLACE_FAULT: exiting at the end of the step phase") == 1);
    // Rank 0's node fell back; the other took its restarted workers in.
    const bool a_failed = ra.err.find("in-place recovery failed (") != std::string::npos;
    const Finished& failed = a_failed ? ra : rb;
    const Finished& kept = a_failed ? rb : ra;
    CHECK(countOf(failed.err, "in-place recovery failed (local rank 0") == 1);
    CHECK(kept.err.find("in-place recovery failed (") == std::string::npos);
    CHECK(countOf(kept.err,
                  "another node's in-place recovery failed and it restarts its workers; "
                  "recovering in place (1 of 1 restarts used)") == 1);
    CHECK(all.find("restart budget") == std::string::npos);
    // The other node's workers kept their processes (two survivors and the replacement of rank
    // 3 where it was killed); the restarted ones took their live state, after step 9.
    CHECK(countOf(kept.out, "going on after step 9") == 2);
    CHECK(std::regex_search(
        failed.out, std::regex(R"(\[RANK [01]\] took rank [23]'s live state after step 9)")));
    CHECK(dumped("step") == clean);
  }
}

TEST_CASE(
    "in-place across nodes: a node killed mid-training is replaced by a new node whose workers "
    "take the survivors' live state, or the world shrinks when none comes",
    "[multinode][inplace]") {
  // 0: a new node joins; 1: nobody comes; 2: the new node runs --restart-mode=process.
  const int variant = GENERATE(0, 1, 2);
  const bool replace = variant != 1;
  const bool process_joins = variant == 2;
  INFO((replace ? "--nnodes=2:2, a new node joins" : "--nnodes=1:2, the world shrinks")
       << (process_joins ? " (under --restart-mode=process)" : ""));
  RendezvousDaemon rdzv;
  TempDir dir;
  const std::string nnodes = replace ? "2:2" : "1:2";
  const std::string run = replace ? "nodekill" + std::to_string(variant) : "nodeleave";
  // 6 epochs of 6 steps, so the kill lands mid-training: the mlp where the new node takes the
  // survivors' live state (50 MB of it: about 0.2 s a step here), elsewhere pacedTrain's.
  const std::vector<std::string> train_args = variant == 0
                                                  ? std::vector<std::string>{"6",
                                                                             "1",
                                                                             "--model",
                                                                             "mlp",
                                                                             "--dataset-size",
                                                                             "768",
                                                                             "--snapshot-path",
                                                                             dir / "snap.pt"}
                                                  : pacedTrain("6", dir);
  auto a = node("127.0.0.2", rdzv.endpoint, nnodes, run, "in-place", train_args);
  auto b = node("127.0.0.3", rdzv.endpoint, nnodes, run, "in-place", train_args);
  REQUIRE(waitUntil([&] { return (a->out() + b->out()).find("Epoch 2 |") != std::string::npos; },
                    180s));
  const auto a_workers = workerPids(a->pid());
  const auto b_workers = workerPids(b->pid());
  REQUIRE(a_workers.size() == 2);
  REQUIRE(b_workers.size() == 2);
  b->signal(SIGKILL);
  REQUIRE(b->wait(10s));
  CHECK(waitUntil([&] { return !pidAlive(b_workers[0]) && !pidAlive(b_workers[1]); }, 10s));
  std::unique_ptr<Process> c;
  if (replace) {
    c = node("127.0.0.4", rdzv.endpoint, nnodes, run, process_joins ? "process" : "in-place",
             train_args);
  }
  auto ra = a->wait(300s);
  std::optional<Finished> rc;
  if (c) rc = c->wait(120s);
  INFO("surviving node:\n" << a->out() << a->err());
  INFO("new node:\n" << (c ? c->out() + c->err() : std::string("(none)")));
  REQUIRE(ra);
  CHECK(ra->exit_code == 0);
  const std::string all = ra->out + ra->err + (rc ? rc->out + rc->err : "");
  CHECK(all.find("Epoch 5 |") != std::string::npos);
  if (process_joins) {
    // The round the survivors waited for has a node that restarts processes: they give up at once
    // (not at inplace_timeout), and every node restarts its workers from the snapshot.
    REQUIRE(rc);
    CHECK(rc->exit_code == 0);
    CHECK(countOf(ra->err, "in-place recovery failed (node ") == 1);
    CHECK(ra->err.find("(127.0.0.4) restarts its workers as processes") != std::string::npos);
    CHECK(ra->err.find("inplace_timeout") == std::string::npos);
    CHECK(countOf(all, "Resuming training from snapshot") == 4);
    // (Not rank 0's "Epoch 5 | Training snapshot saved".)
    CHECK(countOf(rc->out, "] Epoch 5 |") == 2);
    return;
  }
  // The survivors kept their processes: they joined once, and still ran at the end.
  const auto joined = joinedPids(ra->out);
  CHECK(std::set<int>(joined.begin(), joined.end()) ==
        std::set<int>(a_workers.begin(), a_workers.end()));
  CHECK(ra->err.find("the job's nodes changed; recovering in place") != std::string::npos);
  CHECK(countOf(ra->out, "going on after step") == 2);
  CHECK(ra->err.find("restarting every worker") == std::string::npos);
  CHECK(all.find("Resuming training from snapshot") == std::string::npos);
  if (replace) {
    REQUIRE(rc);
    CHECK(rc->exit_code == 0);
    CHECK(std::regex_search(rc->out, std::regex(R"(took rank \d's live state after step \d+)")));
    CHECK(countOf(ra->out, "formed (world 4)") == 2);
  } else {
    CHECK(countOf(ra->out, "formed (world 2)") == 2);
  }
}

TEST_CASE(
    "in-place: a worker stopped with SIGSTOP is found by its heartbeat and replaced alone, the "
    "others keep their processes, and the result equals a run without the fault",
    "[inplace]") {
  TempDir dir;
  // 3 workers, 3 epochs of 1000 quick steps (96000 samples, batch 32).
  auto run = [&](const std::string& tag, const std::string& mode) {
    return std::make_unique<Process>(
        std::vector<std::string>{ddprunBin(), "--standalone", "--nproc-per-node=3",
                                 "--max-restarts=1", "--heartbeat-timeout=2",
                                 "--restart-mode=" + mode, "--no-python", trainBin(), "3", "1",
                                 "--dataset-size", "96000", "--snapshot-path", dir / (tag + ".pt"),
                                 "--dump-params", dir / (tag + ".bin")},
        std::map<std::string, std::string>{{"OMP_NUM_THREADS", "1"}});
  };
  auto clean = run("clean", "process");
  auto rc = clean->wait(240s);
  REQUIRE(rc);
  REQUIRE(rc->exit_code == 0);

  auto job = run("stopped", "in-place");
  std::smatch m;
  std::string out;
  REQUIRE(waitUntil(
      [&] {
        out = job->out();
        return out.find("Epoch 0 |") != std::string::npos &&
               std::regex_search(out, m, std::regex(R"(\[RANK 2\] pid (\d+) joined generation)"));
      },
      120s));
  const int stopped = std::stoi(m[1]);
  REQUIRE(::kill(stopped, SIGSTOP) == 0);
  auto r = job->wait(240s);
  REQUIRE(r);
  const std::string all = r->out + r->err;
  INFO(all);
  CHECK(r->exit_code == 0);
  CHECK(all.find("is hung and stopped by a signal: sending SIGKILL") != std::string::npos);
  CHECK(all.find("worker hung: no heartbeat for") != std::string::npos);
  CHECK(countOf(all, "going on after step") == 2);
  CHECK(all.find("restarting every worker") == std::string::npos);
  // Ranks 0 and 1 joined once; rank 2 twice (the stopped one, then its replacement).
  const auto pids = joinedPids(all);
  CHECK(pids.size() == 4);
  CHECK(countOf(all, "[RANK 2] pid") == 2);
  CHECK(readFile(dir / "stopped.bin") == readFile(dir / "clean.bin"));
}

TEST_CASE(
    "in-place: workers that hang in their own code are told from the others waiting for them, "
    "and replaced alone, and the result equals a run without the fault",
    "[inplace]") {
  TempDir dir;
  // 3 workers, 2 epochs of 10 steps (960 samples, batch 32); the last rank, or the last two,
  // hang after step 4.
  auto run = [&](const std::string& tag, const std::string& mode, int hung) {
    std::vector<std::string> argv = {ddprunBin(),
                                     "--standalone",
                                     "--nproc-per-node=3",
                                     "--max-restarts=1",
                                     "--heartbeat-timeout=2",
                                     "--restart-mode=" + mode,
                                     "--no-python",
                                     trainBin(),
                                     "2",
                                     "1",
                                     "--dataset-size",
                                     "960",
                                     "--snapshot-path",
                                     dir / (tag + ".pt"),
                                     "--dump-params",
                                     dir / (tag + ".bin")};
    if (hung > 0) {
      argv.insert(argv.end(), {"--fail-at-step", "4", "--fail-signal", "HANG", "--fail-ranks",
                               std::to_string(hung)});
    }
    return std::make_unique<Process>(argv,
                                     std::map<std::string, std::string>{{"OMP_NUM_THREADS", "1"}});
  };
  auto clean = run("clean", "process", 0);
  auto rc = clean->wait(240s);
  REQUIRE(rc);
  REQUIRE(rc->exit_code == 0);

  for (const int hung : {1, 2}) {
    INFO(hung << " hung");
    const std::string tag = "hung" + std::to_string(hung);
    auto r = run(tag, "in-place", hung)->wait(240s);
    REQUIRE(r);
    const std::string all = r->out + r->err;
    INFO(all);
    CHECK(r->exit_code == 0);
    CHECK(countOf(all, "fault injection: hanging at step 4") == hung);
    // (A second rank that the agent saw stall a look later is replaced in the recovery, with
    // the other line.)
    for (int local_rank = 3 - hung; local_rank < 3; ++local_rank) {
      CHECK(std::regex_search(
          all, std::regex("local rank " + std::to_string(local_rank) +
                          R"( \(pid \d+\) is hung (while its peers wait for it|during the )"
                          R"(recovery and never heard of it): sending SIGKILL)")));
      // Each hung rank joined twice: the hung one, then its replacement.
      CHECK(countOf(all, "[RANK " + std::to_string(local_rank) + "] pid") == 2);
    }
    CHECK(countOf(all, "is hung while its peers wait for it: sending SIGKILL") +
              countOf(all, "is hung during the recovery and never heard of it: sending SIGKILL") ==
          hung);
    CHECK(all.find("worker hung: no heartbeat for") != std::string::npos);
    CHECK(countOf(all, "in-place recovery, generation") == 1);
    CHECK(countOf(all, "going on after step 4") == 3 - hung);
    CHECK(all.find("restarting every worker") == std::string::npos);
    CHECK(all.find("Resuming training from snapshot") == std::string::npos);
    CHECK(joinedPids(all).size() == static_cast<size_t>(3 + hung));
    CHECK(readFile(dir / (tag + ".bin")) == readFile(dir / "clean.bin"));
  }
}

TEST_CASE(
    "in-place across nodes: a node gone silent mid-training (SIGSTOP, its sockets open) is given "
    "up "
    "at its missed heartbeats, and the other node's workers go on in place in a world of 2",
    "[multinode][inplace]") {
  // The silent node: 0, the one without rank 0 (the group's store stays up); 1, the one whose
  // rank 0 hosts the store. Its agent and workers stop, so the others get no reset, only silence:
  // their collectives block until their agent, having seen the node's heartbeats stop, aborts
  // them.
  const int which = GENERATE(0, 1);
  const bool silent_hosts_store = which == 1;
  INFO((silent_hosts_store ? "the node of rank 0 goes silent" : "the other node goes silent"));
  RendezvousDaemon rdzv;
  TempDir dir;
  const std::string run = "silent" + std::to_string(which);
  const std::vector<std::string> train_args = pacedTrain("6", dir);
  auto nodes = twoTraining(rdzv.endpoint, "1:2", run, train_args);
  auto& a = nodes.first;
  auto& b = nodes.second;
  const bool a_has_rank0 = a->out().find("[RANK 0] pid") != std::string::npos;
  Process& silent = a_has_rank0 == silent_hosts_store ? *a : *b;
  Process& kept = &silent == a.get() ? *b : *a;
  const auto kept_workers = workerPids(kept.pid());
  const auto silent_workers = workerPids(silent.pid());
  REQUIRE(kept_workers.size() == 2);
  REQUIRE(silent_workers.size() == 2);
  silent.signal(SIGSTOP);
  for (int pid : silent_workers) ::kill(pid, SIGSTOP);
  auto rk = kept.wait(300s);
  silent.signal(SIGKILL);  // its guardians then kill its stopped workers
  auto rs = silent.wait(60s);
  INFO("kept node:\n"
       << kept.out() << kept.err() << "\nsilent node:\n"
       << silent.out() << silent.err());
  REQUIRE(rk);
  REQUIRE(rs);
  CHECK(rk->exit_code == 0);
  CHECK(rs->exit_code == 128 + SIGKILL);
  for (int pid : silent_workers) CHECK(waitUntil([&] { return !pidAlive(pid); }, 30s));
  // The same processes went on, in a world of 2, from the live state: no snapshot read, no
  // restart.
  CHECK(rk->out.find("Epoch 5 |") != std::string::npos);
  CHECK(countOf(rk->out, "formed (world 2)") == 2);
  checkKeptInPlace(*rk, kept_workers);
}

TEST_CASE(
    "in-place across nodes: SIGTERM to every node still ends the job with a checkpoint, and one "
    "node leaving (a spot notice) leaves the other's workers training in place, no step lost",
    "[multinode][inplace]") {
  // 0: SIGTERM to both agents; 1: to one agent; 2: to one agent, over etcd-v3.
  const int which = GENERATE(0, 1, 2);
  const bool everyone = which == 0;
  INFO((everyone ? "SIGTERM to both agents" : "SIGTERM to one agent (--nnodes=1:2)"));
  RendezvousDaemon rdzv;
  std::unique_ptr<EtcdCluster> etcd;
  std::string backend = rdzv.endpoint;
  if (which == 2) {
    if (!etcdAvailable()) {
      WARN("etcd-v3 case skipped: " + etcdBinary() + " is absent (deploy/install-deps.sh)");
      return;
    }
    etcd = std::make_unique<EtcdCluster>();
    backend = "etcd-v3 " + etcd->endpoints();
  }
  INFO("rendezvous: " << backend);
  TempDir dir;
  const std::string run = everyone ? "stopall" : "spot" + std::to_string(which);
  const std::vector<std::string> train_args = pacedTrain("6", dir);
  auto nodes = twoTraining(backend, "1:2", run, train_args);
  auto& a = nodes.first;
  auto& b = nodes.second;
  const auto a_workers = workerPids(a->pid());
  REQUIRE(a_workers.size() == 2);
  b->signal(SIGTERM);
  if (everyone) a->signal(SIGTERM);
  auto rb = b->wait(60s);
  auto ra = a->wait(300s);
  INFO("first node:\n" << a->out() << a->err() << "\nsecond node:\n" << b->out() << b->err());
  REQUIRE(ra);
  REQUIRE(rb);
  CHECK(rb->exit_code == 128 + SIGTERM);
  const std::string all = ra->out + ra->err + rb->out + rb->err;
  if (everyone) {
    // The workers agreed to stop and rank 0 saved a snapshot; no agent started a recovery. (Had
    // the signals reached the nodes a step apart, the first node's ranks would leave and rank 0
    // save that step; the others then stop too while they re-form.)
    CHECK(ra->exit_code == 128 + SIGTERM);
    CHECK(all.find("Training snapshot saved at " + (dir / "snap.pt") + " (checkpoint signal") !=
          std::string::npos);
    CHECK(all.find("; recovering in place (") == std::string::npos);
  } else {
    // The leaving node's ranks left after the agreed step (rank 0, if among them, saved it), and
    // the other node's workers went on from it in place, in a world of 2: the same processes, no
    // snapshot read.
    CHECK(ra->exit_code == 0);
    CHECK(ra->out.find("Epoch 5 |") != std::string::npos);
    std::smatch left;
    REQUIRE(std::regex_search(
        all, left, std::regex(R"(left the job on SIGTERM after step (\d+); the other)")));
    CHECK(countOf(all, "left the job on SIGTERM after step") == 2);
    CHECK(countOf(ra->out, "going on after step " + left[1].str()) == 2);
    CHECK(countOf(ra->out, "formed (world 2)") == 2);
    const bool rank0_left = all.find("[RANK 0] left the job") != std::string::npos;
    CHECK((all.find("Training snapshot saved at " + (dir / "snap.pt") + " (checkpoint signal)") !=
           std::string::npos) == rank0_left);
    checkKeptInPlace(*ra, a_workers);
  }
}

TEST_CASE(
    "in-place across nodes: a node lost while the others form the new group is given up, and the "
    "survivors form the next one in place instead of waiting out inplace_timeout",
    "[multinode][inplace]") {
  // The last rank (3) dies after step 8. In the recovery one rank kills its node's agent as it
  // starts forming the new group (DDPRUN_INPLACE_FAULT=form:<rank>). The other node sees it
  // gone, aborts the generation its workers are forming, and the world shrinks to it
  // (--nnodes=1:2), its survivors keeping their processes and going on after step 8.
  // - form:2: the node of ranks 2 and 3 is lost; ranks 0 and 1 go on.
  // - form:0: the node of ranks 0 and 1, which hosts the new group's store, is lost while the
  //   other node's replacement of rank 3 starts for the voided round: rank 2 goes on, and a new
  //   replacement, started with the next round, takes its live state.
  // - connect:2: the node of ranks 2 and 3 goes silent (rank 2 stops its agent and itself, its
  //   sockets open) once rank 2 published its Gloo pair addresses. Ranks 0 and 1 either listen
  //   for rank 2's connect, which never comes, or connect to it and wait for it in the planning's
  //   collective: the agent's abort fails their pairs, and they form the next group (without it
  //   Gloo waits 5 x the connect timeout, and the agent falls back at inplace_timeout). The
  //   silent node is killed once the other ended.
  const auto [phase, killer] =
      GENERATE(std::make_pair(std::string("form"), 2), std::make_pair(std::string("form"), 0),
               std::make_pair(std::string("connect"), 2));
  const bool lost_replacement_node = killer == 2;
  const std::string fault = phase + ":" + std::to_string(killer);
  INFO("DDPRUN_INPLACE_FAULT=" << fault);
  RendezvousDaemon rdzv;
  TempDir dir;
  const std::vector<std::string> train_args = {
      "3", "1", "--dataset-size", "768", "--snapshot-path", dir / "snap.pt", "--fail-at-step", "8"};
  const std::map<std::string, std::string> env = {{"DDPRUN_INPLACE_FAULT", fault}};
  const std::string run = phase + "lost" + std::to_string(killer);
  auto a = node("127.0.0.2", rdzv.endpoint, "1:2", run, "in-place", train_args, env);
  auto b = node("127.0.0.3", rdzv.endpoint, "1:2", run, "in-place", train_args, env);
  if (phase == "connect") {
    REQUIRE(waitUntil([&] { return a->wait(50ms) || b->wait(50ms); }, 240s));
    (a->wait(1ms) ? *b : *a).signal(SIGKILL);  // its workers go with it (their guardians)
  }
  auto [ra, rb] = finish(*a, *b);
  const std::string all = ra.out + ra.err + rb.out + rb.err;
  INFO(all);
  const bool a_lost = ra.exit_code == 128 + SIGKILL;
  const Finished& lost = a_lost ? ra : rb;
  const Finished& kept = a_lost ? rb : ra;
  CHECK(lost.exit_code == 128 + SIGKILL);
  CHECK(kept.exit_code == 0);
  CHECK(countOf(all, "fault injection: killing myself at step 8") == 1);
  CHECK(countOf(all, phase == "connect" ? "DDPRUN_INPLACE_FAULT: stopping this node's agent and "
                                          "this rank in the connect phase"
                                        : "DDPRUN_INPLACE_FAULT: killing this node's agent in "
                                          "the form phase") == 1);
  const std::string kept_all = kept.out + kept.err;
  if (phase == "connect") {
    // The survivors gave the silent rank up when their agent aborted the generation, not at a
    // timeout of their own.
    CHECK(countOf(kept_all, "gave up forming its group") >= 1);
  }
  // The survivors gave the aborted generation up and formed the next one, world 2. (Here every
  // survivor was forming it when the node was lost; one that reached its wait only after the next
  // group came would skip it.)
  CHECK(countOf(kept_all, "was aborted by the agent before its state sync") >= 1);
  CHECK(countOf(kept.out, "formed (world 2), going on after step 8") ==
        (lost_replacement_node ? 2 : 1));
  CHECK(kept_all.find("restarting every worker") == std::string::npos);
  CHECK(kept_all.find("Resuming training from snapshot") == std::string::npos);
  CHECK(kept_all.find("in-place recovery failed") == std::string::npos);
  CHECK(countOf(kept.err, "which the nodes' change voided; a new one starts with the next round") ==
        (lost_replacement_node ? 0 : 1));
  // The survivors kept their processes: each joined once; on the other node, rank 3 and its
  // second replacement joined too (the first never formed a group).
  const auto pids = joinedPids(kept.out);
  CHECK(pids.size() == (lost_replacement_node ? 2u : 3u));
  CHECK(std::set<int>(pids.begin(), pids.end()).size() == pids.size());
  if (!lost_replacement_node) {
    CHECK(std::regex_search(kept.out,
                            std::regex(R"(\[RANK 1\] took rank 0's live state after step 8)")));
  }
}

TEST_CASE(
    "in-place across nodes: after a node left on SIGTERM, a new node joins and its workers take "
    "the survivors' live state while the survivors keep their processes",
    "[multinode][inplace]") {
  RendezvousDaemon rdzv;
  TempDir dir;
  // 8 epochs of 12 steps in a world of 2 (6 in a world of 4): time enough for the new node.
  const std::vector<std::string> train_args = pacedTrain("8", dir);
  auto nodes = twoTraining(rdzv.endpoint, "1:2", "leavejoin", train_args);
  auto& a = nodes.first;
  auto& b = nodes.second;
  const auto a_workers = workerPids(a->pid());
  REQUIRE(a_workers.size() == 2);
  b->signal(SIGTERM);  // a spot notice: its ranks leave after the agreed step
  auto rb = b->wait(60s);
  INFO("first node:\n" << a->out() << a->err() << "\nleaving node:\n" << b->out() << b->err());
  REQUIRE(rb);
  CHECK(rb->exit_code == 128 + SIGTERM);
  // Once the world of 2 completed a step (the agent's summary of that recovery); a node joining
  // before that would void the group being formed and the two changes be recovered as one.
  REQUIRE(waitUntil([&] { return countOf(a->err(), "in-place recovery, generation") == 1; }, 60s));
  CHECK(countOf(a->out(), "formed (world 2)") == 2);
  auto c = node("127.0.0.4", rdzv.endpoint, "1:2", "leavejoin", "in-place", train_args);
  auto ra = a->wait(300s);
  auto rc = c->wait(120s);
  REQUIRE(ra);
  REQUIRE(rc);
  INFO("first node, to the end:\n" << ra->out << ra->err << "\nnew node:\n" << rc->out << rc->err);
  CHECK(ra->exit_code == 0);
  CHECK(rc->exit_code == 0);
  const std::string all = ra->out + ra->err + rc->out + rc->err;
  // Both changes of nodes were recovered in place, free: the survivors formed a world of 2, then
  // one of 4 with the new node, whose ranks took the live state (no snapshot was read).
  CHECK(countOf(ra->err, "the job's nodes changed; recovering in place") == 2);
  CHECK(countOf(ra->out, "formed (world 4)") == 2);
  CHECK(std::regex_search(rc->out, std::regex(R"(took rank \d's live state after step \d+)")));
  CHECK(countOf(rc->out, "live state after step") == 2);
  CHECK(all.find("restarting every worker") == std::string::npos);
  CHECK(all.find("Resuming training from snapshot") == std::string::npos);
  CHECK(ra->err.find("(1 of 1 restarts used)") == std::string::npos);  // neither was charged
  CHECK(all.find("Epoch 7 |") != std::string::npos);
  // The survivors kept their processes throughout.
  const auto joined = joinedPids(ra->out);
  CHECK(std::set<int>(joined.begin(), joined.end()) ==
        std::set<int>(a_workers.begin(), a_workers.end()));
}

TEST_CASE(
    "in-place across nodes: a worker that fails without having announced in-place support "
    "restarts every worker at once, without waiting for inplace_timeout",
    "[multinode][inplace]") {
  // The second node runs the same program, but its Trainers keep from announcing support (the
  // hook caps:*), as a program that does not speak the control channel; one of them is killed.
  RendezvousDaemon rdzv;
  TempDir dir;
  const std::vector<std::string> train_args = pacedTrain("4", dir);
  auto nodes = twoTraining(rdzv.endpoint, "2", "unannounced", train_args,
                           {{"DDPRUN_INPLACE_FAULT", "caps:*"}});
  auto& a = nodes.first;
  auto& b = nodes.second;
  const auto victims = workerPids(b->pid());
  REQUIRE(victims.size() == 2);
  ::kill(victims[1], SIGKILL);
  auto [ra, rb] = finish(*a, *b);
  INFO("first node:\n" << ra.err << "\nsecond node:\n" << rb.err);
  CHECK(ra.exit_code == 0);
  CHECK(rb.exit_code == 0);
  // The second node said why once and voted against the next round: the first gave its in-place
  // recovery up as that round formed (not at inplace_timeout), and every worker restarted from
  // the snapshot.
  CHECK(countOf(rb.err, "local rank 1 (pid " + std::to_string(victims[1]) +
                            ") did not announce in-place support on DDPRUN_CONTROL_SOCKET") == 1);
  CHECK(countOf(rb.err, "did not announce in-place support on DDPRUN_CONTROL_SOCKET") == 1);
  CHECK(countOf(ra.err, "in-place recovery failed (node ") == 1);
  CHECK(ra.err.find("(127.0.0.3) restarts its workers as processes") != std::string::npos);
  CHECK((ra.err + rb.err).find("inplace_timeout") == std::string::npos);
  CHECK(rb.err.find("this node (node ") == std::string::npos);  // its own vote: said why already
  CHECK(countOf(ra.out + rb.out, "Resuming training from snapshot") >= 4);
  CHECK(countOf(ra.out + rb.out, "] Epoch 3 |") >= 4);
}

TEST_CASE(
    "in-place across nodes: a peer's failure beside a node whose Trainers never announced support "
    "restarts that node's workers, whose fresh Trainers join the survivors and take their live "
    "state",
    "[multinode][inplace]") {
  // The second node's Trainers keep from announcing support (the hook caps:*): its agent cannot
  // recover them in place, and restarts them; a worker of the first node is killed.
  RendezvousDaemon rdzv;
  TempDir dir;
  auto nodes = twoTraining(rdzv.endpoint, "2", "silentpeer", pacedTrain("6", dir),
                           {{"DDPRUN_INPLACE_FAULT", "caps:*"}});
  auto& a = nodes.first;
  auto& b = nodes.second;
  const auto a_workers = workerPids(a->pid());
  REQUIRE(a_workers.size() == 2);
  ::kill(a_workers[1], SIGKILL);
  auto [ra, rb] = finish(*a, *b);
  INFO("first node:\n" << ra.out << ra.err << "\nsecond node:\n" << rb.out << rb.err);
  CHECK(ra.exit_code == 0);
  CHECK(rb.exit_code == 0);
  // The second node said why once and restarted its workers; the first recovered in place, its
  // survivor kept, and nobody waited for inplace_timeout or read the snapshot.
  CHECK(countOf(rb.err, "did not announce in-place support on DDPRUN_CONTROL_SOCKET") == 1);
  CHECK(countOf(rb.err, "workers on another node failed; restarting this node's workers too") == 1);
  CHECK(countOf(ra.err, "in-place recovery, generation") == 1);
  CHECK(ra.err.find("in-place recovery failed") == std::string::npos);
  CHECK((ra.err + rb.err).find("inplace_timeout") == std::string::npos);
  CHECK((ra.out + rb.out).find("Resuming training from snapshot") == std::string::npos);
  CHECK(countOf(rb.out, "live state after step") == 2);
  // The first node's survivor went on (the same process); its killed rank joined once more.
  CHECK(countOf(ra.out, "going on after step") == 1);
  CHECK(joinedPids(ra.out).size() == 3);
  CHECK(countOf(ra.out + rb.out, "] Epoch 5 |") >= 4);
}

TEST_CASE(
    "in-place across nodes: after a worker crashed before it announced support, its node's fresh "
    "Trainers announce it and the next failure is recovered in place",
    "[multinode][inplace]") {
  // Both nodes run one wrapper (one program name); on the second node, its first attempt's local
  // rank 1 exits before train starts, as a Trainer that crashes early in its start-up.
  RendezvousDaemon rdzv;
  TempDir dir;
  const std::string program = dir / "job";
  {
    std::ofstream script(program);
    script << "#!/bin/sh\n"
              "if [ -n \"$CRASH_EARLY\" ] && [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ] && "
              "[ \"$LOCAL_RANK\" = 1 ]; then sleep 0.3; echo crashing early >&2; exit 3; fi\n"
              "exec "
           << trainBin() << " \"$@\"\n";
  }
  REQUIRE(::chmod(program.c_str(), 0755) == 0);
  const std::vector<std::string> train_args = pacedTrain("5", dir);
  auto a =
      node("127.0.0.2", rdzv.endpoint, "2", "crashearly", "in-place", train_args, {}, 3, program);
  auto b = node("127.0.0.3", rdzv.endpoint, "2", "crashearly", "in-place", train_args,
                {{"CRASH_EARLY", "1"}}, 3, program);
  REQUIRE(waitUntil([&] { return (a->out() + b->out()).find("Epoch 1 |") != std::string::npos; },
                    180s));
  INFO("first node:\n" << a->out() << a->err() << "\nsecond node:\n" << b->out() << b->err());
  REQUIRE(countOf(b->err(), "crashing early") == 1);
  CHECK(countOf(b->err(), "did not announce in-place support on DDPRUN_CONTROL_SOCKET") == 1);
  const std::string resumed = "Resuming training from snapshot";
  const int resumed_before = countOf(a->out() + b->out(), resumed);
  const auto a_workers = workerPids(a->pid());
  const auto b_workers = workerPids(b->pid());
  REQUIRE(a_workers.size() == 2);
  REQUIRE(b_workers.size() == 2);
  const size_t a_err_before = a->err().size();
  const size_t b_err_before = b->err().size();
  ::kill(b_workers[1], SIGKILL);
  // Once both nodes said their recovery ended, the survivors are the same processes.
  const std::string summary = "in-place recovery, generation";
  const bool recovered = waitUntil(
      [&] {
        return countOf(a->err().substr(a_err_before), summary) +
                   countOf(b->err().substr(b_err_before), summary) ==
               2;
      },
      60s);
  if (recovered) {
    CHECK(workerPids(a->pid()) == a_workers);
    const auto b_now = workerPids(b->pid());
    CHECK(std::count(b_now.begin(), b_now.end(), b_workers[0]) == 1);
    CHECK(std::count(b_now.begin(), b_now.end(), b_workers[1]) == 0);
  }
  auto [ra, rb] = finish(*a, *b);
  INFO("first node, to the end:\n" << ra.err << "\nsecond node, to the end:\n" << rb.err);
  CHECK(ra.exit_code == 0);
  CHECK(rb.exit_code == 0);
  // The kill was recovered in place on both nodes: the second node's vote came back once its
  // fresh workers announced support (before the fix it stayed against for the rest of the job).
  CHECK(recovered);
  const std::string after = ra.err.substr(a_err_before) + rb.err.substr(b_err_before);
  CHECK(countOf(after, summary) == 2);
  CHECK(after.find("restarting every worker") == std::string::npos);
  CHECK(after.find("restarts its workers as processes") == std::string::npos);
  CHECK(countOf(ra.out + rb.out, resumed) == resumed_before);
  // The killed rank's replacement (a worker of the program that crashed before) took the live
  // state of a survivor.
  CHECK(std::regex_search(rb.out, std::regex(R"(took rank \d's live state after step \d+)")));
  CHECK(countOf(ra.out + rb.out, "] Epoch 4 |") >= 1);
}

TEST_CASE(
    "in-place across nodes: ranks hung in their own code are replaced alone, and the other ranks, "
    "which wait for them, keep their processes",
    "[multinode][inplace]") {
  // The last rank hangs, or the last two: both of one node's.
  const int hung = GENERATE(1, 2);
  INFO(hung << " hung");
  RendezvousDaemon rdzv;
  TempDir dir;
  // 3 epochs of 6 steps; they hang after step 8.
  const std::vector<std::string> args = {"3",
                                         "1",
                                         "--dataset-size",
                                         "768",
                                         "--snapshot-path",
                                         dir / "snap.pt",
                                         "--fail-at-step",
                                         "8",
                                         "--fail-signal",
                                         "HANG",
                                         "--fail-ranks",
                                         std::to_string(hung)};
  const std::map<std::string, std::string> env = {{"PET_HEARTBEAT_TIMEOUT", "2"}};
  auto a = node("127.0.0.2", rdzv.endpoint, "2", "hung", "in-place", args, env);
  auto b = node("127.0.0.3", rdzv.endpoint, "2", "hung", "in-place", args, env);
  auto [ra, rb] = finish(*a, *b);
  const std::string all = ra.out + ra.err + rb.out + rb.err;
  INFO(all);
  CHECK(ra.exit_code == 0);
  CHECK(rb.exit_code == 0);
  CHECK(countOf(all, "fault injection: hanging at step 8") == hung);
  // (Rank 3 is on either node: the rendezvous orders them.)
  CHECK(std::regex_search(all, std::regex(R"(local rank 1 \(pid \d+\) is hung (while its peers )"
                                          R"(wait for it|during the recovery and never heard of )"
                                          R"(it): sending SIGKILL)")));
  CHECK(countOf(all, "is hung while its peers wait for it: sending SIGKILL") +
            countOf(all, "is hung during the recovery and never heard of it: sending SIGKILL") ==
        hung);
  CHECK(all.find("is hung: sending SIGKILL") == std::string::npos);
  CHECK(countOf(all, "in-place recovery, generation") == 2);
  CHECK(countOf(all, "going on after step 8") == 4 - hung);
  CHECK(all.find("restarting every worker") == std::string::npos);
  CHECK(all.find("Resuming training from snapshot") == std::string::npos);
  const auto pids = joinedPids(all);
  CHECK(pids.size() == static_cast<size_t>(4 + hung));
  CHECK(std::set<int>(pids.begin(), pids.end()).size() == static_cast<size_t>(4 + hung));
}
