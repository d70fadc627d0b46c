// --snapshot-dir replication end to end (issue 11): agents on distinct loopback addresses, each
// with its OWN snapshot directory (no path is shared between nodes), real workers (PyTorch's DDP
// tutorial, the SDK's train, small shell programs), a node killed with kill -9 and replaced by a
// fresh node with an empty directory.
#include <sys/mount.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <regex>
#include <set>

#include "ddprun/common/crc32.h"
#include "ddprun/common/round_key.h"
#include "ddprun/rendezvous/client.h"
#include "ddprun/snapshot/transfer.h"
#include "multinode_helpers.h"
#include "process_helpers.h"
#include "rendezvous_daemon.h"
#include "test_pki.h"

using namespace ddprun;
using namespace ddprun::testing;
using namespace std::chrono_literals;

namespace {

struct NodeSpec {
  NodeSpec(std::string a, std::string dir, std::map<std::string, std::string> e = {},
           std::vector<std::string> f = {}, std::string c = "")
      : addr(std::move(a)),
        snapshot_dir(std::move(dir)),
        env(std::move(e)),
        flags(std::move(f)),
        conf(std::move(c)) {}
  std::string addr;
  std::string snapshot_dir;
  std::map<std::string, std::string> env;
  std::vector<std::string> flags;  // more ddprun flags
  std::string conf;                // more --rdzv-conf settings ("key=value,...")
  std::string ulimit;              // ulimit options the agent starts under ("-Sn 128")
  // How soon a silent node leaves the round (--rdzv-conf).
  std::string heartbeat = "heartbeat_interval=1,heartbeat_misses=3";
};

// One node: a ddprun agent advertising `addr`, replicating its own `snapshot_dir` (none when
// empty: no --snapshot-dir).
std::unique_ptr<Process> node(const NodeSpec& spec, const std::string& endpoint,
                              const std::string& nnodes, const std::string& run_id, int nproc,
                              const std::vector<std::string>& program) {
  std::vector<std::string> argv = {ddprunBin(),
                                   "--nnodes=" + nnodes,
                                   "--nproc-per-node=" + std::to_string(nproc),
                                   "--rdzv-backend=c10d",
                                   "--rdzv-endpoint=" + endpoint,
                                   "--rdzv-id=" + run_id,
                                   "--local-addr=" + spec.addr,
                                   "--max-restarts=3",
                                   "--rdzv-conf=last_call_timeout=1," + spec.heartbeat +
                                       (spec.conf.empty() ? "" : "," + spec.conf)};
  if (!spec.snapshot_dir.empty()) argv.push_back("--snapshot-dir=" + spec.snapshot_dir);
  // Replication without a token is refused unless accepted by name (issue 34): these tests run on
  // loopback, where only they can reach the agents.
  if (!spec.snapshot_dir.empty() && spec.conf.find("token_file=") == std::string::npos) {
    argv.push_back("--snapshot-allow-unauthenticated");
  }
  argv.insert(argv.end(), spec.flags.begin(), spec.flags.end());
  argv.insert(argv.end(), program.begin(), program.end());
  if (!spec.ulimit.empty()) {
    argv.insert(argv.begin(), {"/bin/sh", "-c", "ulimit " + spec.ulimit + " && exec \"$@\"", "sh"});
  }
  auto env = spec.env;
  env["PYTHON_EXEC"] = torchPython();
  env["PYTHONFAULTHANDLER"] = "1";  // a stuck Python worker says where it is (stuckReport)
  return std::make_unique<Process>(argv, env);
}

std::string trainBin() { return buildDir() + "/examples/train"; }

// The digests every rank printed ("final parameters sha256 X"): one value when all agree.
std::set<std::string> digests(const std::string& out) {
  std::set<std::string> found;
  std::regex re(R"(final parameters sha256 ([0-9a-f]+))");
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it) {
    found.insert((*it)[1].str());
  }
  return found;
}

std::unique_ptr<Finished> finish(Process& p, std::chrono::seconds bound) {
  auto r = p.wait(bound);
  if (!r) return nullptr;
  return std::make_unique<Finished>(*r);
}

// Two nodes run `program` to the end undisturbed; returns their combined stdout.
std::string uninterrupted(const std::vector<std::string>& program, const std::string& run_id) {
  RendezvousDaemon rdzv;
  TempDir a_dir, b_dir;
  auto a = node({"127.0.0.2", a_dir.path(), {}}, rdzv.endpoint, "2", run_id, 2, program);
  auto b = node({"127.0.0.3", b_dir.path(), {}}, rdzv.endpoint, "2", run_id, 2, program);
  auto ra = finish(*a, 300s), rb = finish(*b, 300s);
  INFO((ra ? "" : stuckReport(*a, "the first node", 300s))
       << (rb ? "" : stuckReport(*b, "the second node", 300s)) << "first node:\n"
       << a->err() << "\nsecond node:\n"
       << b->err());
  REQUIRE(ra);
  REQUIRE(rb);
  REQUIRE(ra->exit_code == 0);
  REQUIRE(rb->exit_code == 0);
  // The directories ended identical (the last snapshot replicated).
  CHECK(readFile(a_dir / "snapshot.pt") == readFile(b_dir / "snapshot.pt"));
  return ra->out + rb->out;
}

// The issue's replacement-node scenario: two nodes of two workers; after a few epochs the node
// holding RANK 0 is killed (agent and workers) and its directory deleted; a fresh node with an
// empty directory takes its place. Returns the stdout of the two nodes that finish.
std::string replaceRankZeroNode(const std::vector<std::string>& program, const std::string& run_id,
                                const std::string& progress) {
  RendezvousDaemon rdzv;
  auto a_dir = std::make_unique<TempDir>();
  auto b_dir = std::make_unique<TempDir>();
  TempDir c_dir;
  auto a = node({"127.0.0.2", a_dir->path(), {}}, rdzv.endpoint, "2", run_id, 2, program);
  auto b = node({"127.0.0.3", b_dir->path(), {}}, rdzv.endpoint, "2", run_id, 2, program);
  REQUIRE(waitUntil(
      [&] { return (a->err() + b->err()).find("group rank 0 of 2") != std::string::npos; }, 120s));
  const bool a_is_rank0 = a->err().find("group rank 0 of 2") != std::string::npos;
  auto& rank0 = a_is_rank0 ? a : b;
  auto& survivor = a_is_rank0 ? b : a;
  const std::string survivor_dir = a_is_rank0 ? b_dir->path() : a_dir->path();
  // A few epochs in, and the survivor holds a replicated snapshot in its own directory.
  REQUIRE(waitUntil(
      [&] {
        return (a->out() + b->out()).find(progress) != std::string::npos &&
               survivor->err().find("snapshot: fetched snapshot.pt") != std::string::npos;
      },
      240s));
  auto workers = workerPids(rank0->pid());
  rank0->signal(SIGKILL);
  REQUIRE(rank0->wait(10s));
  for (int w : workers) CHECK(waitUntil([&] { return !pidAlive(w); }, 10s));
  (a_is_rank0 ? a_dir : b_dir).reset();  // the reclaimed node's disk is gone
  auto c = node({"127.0.0.4", c_dir.path(), {}}, rdzv.endpoint, "2", run_id, 2, program);
  auto rs = finish(*survivor, 300s), rc = finish(*c, 300s);
  INFO((rs ? "" : stuckReport(*survivor, "the survivor", 300s))
       << (rc ? "" : stuckReport(*c, "the fresh node", 300s)) << "survivor:\n"
       << survivor->err() << "\nfresh node:\n"
       << c->err() << "\n"
       << c->out());
  REQUIRE(rs);
  REQUIRE(rc);
  CHECK(rs->exit_code == 0);
  CHECK(rc->exit_code == 0);
  // The fresh node fetched the snapshot before its workers started, and they resumed from it.
  CHECK(rc->err.find("snapshot: fetched snapshot.pt") != std::string::npos);
  CHECK(rc->err.find("snapshot: fetched snapshot.pt") < rc->err.find("started 2 worker(s)"));
  CHECK(rc->out.find("Resuming training from snapshot at Epoch") != std::string::npos);
  CHECK(readFile(c_dir / "snapshot.pt") == readFile(survivor_dir + "/snapshot.pt"));
  return rs->out + rc->out;
}

bool canMountTmpfs(const std::string& dir, const std::string& size) {
  return ::mount("tmpfs", dir.c_str(), "tmpfs", 0, ("size=" + size).c_str()) == 0;
}

}  // namespace

TEST_CASE("a PyTorch job resumes bit-identically on a fresh node from the replicated snapshot",
          "[snapshot][pytorch]") {
  if (!torchAvailable()) {
    WARN("skipped: no torch at " + torchPython());
    return;
  }
  // 16 steps an epoch over 4 ranks; rank 0 saves $DDPRUN_SNAPSHOT_DIR/snapshot.pt every epoch.
  const std::vector<std::string> prog = {sourceDir() + "/examples/pytorch/ddp_tutorial.py", "14",
                                         "1", "--step_delay", "0.03"};
  auto reference = digests(uninterrupted(prog, "snap-py-ref"));
  REQUIRE(reference.size() == 1);
  auto replaced = digests(replaceRankZeroNode(prog, "snap-py", "] Epoch 3 |"));
  CHECK(replaced == reference);
}

TEST_CASE("a train job resumes bit-identically on a fresh node from the replicated snapshot",
          "[snapshot]") {
  TempDir params;
  auto prog = [&](const std::string& dump) {
    return std::vector<std::string>{
        "--no-python", trainBin(),      "24", "1", "--step-delay", "0.15", "--dataset-size",
        "256",         "--dump-params", dump};
  };
  uninterrupted(prog(params / "reference.bin"), "snap-cc-ref");
  replaceRankZeroNode(prog(params / "replaced.bin"), "snap-cc", "] Epoch 3 |");
  const std::string reference = readFile(params / "reference.bin");
  REQUIRE(!reference.empty());
  CHECK(readFile(params / "replaced.bin") == reference);
}

namespace {

// A worker program: local rank 0 of the node started with WRITER=1 writes `name` with `content`
// (temp file, then rename), waits, and every worker exits 0 after a while.
std::vector<std::string> writerScript(const std::string& steps) {
  return {"--no-python", "/bin/sh", "-c", steps};
}

// A job of two nodes running `script`: the writer (WRITER=1) on 127.0.0.2 with `dir_a`, the other
// (WRITER=0) on 127.0.0.3 with `dir_b`.
std::vector<std::unique_ptr<Process>> writerAndReader(const RendezvousDaemon& rdzv,
                                                      const std::string& dir_a,
                                                      const std::string& dir_b,
                                                      const std::string& run_id,
                                                      const std::string& script) {
  std::vector<std::unique_ptr<Process>> nodes;
  nodes.push_back(node({"127.0.0.2", dir_a, {{"WRITER", "1"}}}, rdzv.endpoint, "2", run_id, 1,
                       writerScript(script)));
  nodes.push_back(node({"127.0.0.3", dir_b, {{"WRITER", "0"}}}, rdzv.endpoint, "2", run_id, 1,
                       writerScript(script)));
  return nodes;
}

// A later job of two nodes, each with its directory as an earlier job left it: 127.0.0.2 on
// `dir_a`, and `b`; a fresh rendezvous; both run `script` to the end and must exit 0.
std::pair<Finished, Finished> nextJob(const std::string& dir_a, const NodeSpec& b,
                                      const std::string& run_id, const std::string& script) {
  RendezvousDaemon rdzv;
  auto na = node({"127.0.0.2", dir_a}, rdzv.endpoint, "2", run_id, 1, writerScript(script));
  auto nb = node(b, rdzv.endpoint, "2", run_id, 1, writerScript(script));
  return bothSucceed(*na, *nb);
}

}  // namespace

TEST_CASE(
    "a node without --snapshot-dir is named once, and the others neither wait for it nor tell it",
    "[snapshot]") {
  // Three nodes, the middle one without --snapshot-dir. Its identity says so: the two others
  // start each round without waiting (15 s) for holdings it never publishes, and replicate
  // between themselves; every node says once which node differs.
  RendezvousDaemon rdzv;
  TempDir a_dir, c_dir, flags;
  const std::string stop = flags / "stop";
  const std::string d = "\"$DDPRUN_SNAPSHOT_DIR\"";
  const std::string script = "if [ \"$WRITER\" = 1 ]; then echo v1 > " + d +
                             "/state.bin.tmp && mv " + d + "/state.bin.tmp " + d +
                             "/state.bin; fi; while [ ! -e '" + stop + "' ]; do sleep 0.05; done";
  std::vector<std::unique_ptr<Process>> nodes;
  nodes.push_back(node({"127.0.0.2", a_dir.path(), {{"WRITER", "1"}}}, rdzv.endpoint, "3",
                       "snap-without", 1, writerScript(script)));
  nodes.push_back(node({"127.0.0.3", "", {{"WRITER", "0"}}}, rdzv.endpoint, "3", "snap-without", 1,
                       writerScript(script)));
  nodes.push_back(node({"127.0.0.4", c_dir.path(), {{"WRITER", "0"}}}, rdzv.endpoint, "3",
                       "snap-without", 1, writerScript(script)));
  const bool arrived = waitUntil([&] { return readFile(c_dir / "state.bin") == "v1\n"; }, 60s);
  INFO(nodes[0]->err() << "\n" << nodes[1]->err() << "\n" << nodes[2]->err());
  REQUIRE(arrived);
  const std::string logs = logsThenStop(nodes, stop);
  INFO(logs);
  CHECK(logs.find("holdings did not arrive") == std::string::npos);
  // (Group ranks follow the order of the joins.)
  CHECK(countOf(logs, " (127.0.0.3) runs without --snapshot-dir") == 2);
  CHECK(countOf(logs, "runs with --snapshot-dir and this node without") == 1);
  // The node without is no node of the chain: the writer's one other node is told.
  CHECK(logs.find("announcing it to 1 of 1 other node(s)") != std::string::npos);
  CHECK(logs.find("failed at") == std::string::npos);
}

TEST_CASE(
    "a node whose holdings come after the others started the round is taken in: what each node "
    "writes reaches every node",
    "[snapshot]") {
  RendezvousDaemon rdzv;
  lateHoldingsTakenIn([&](const std::string& addr, const std::string& dir,
                          const std::vector<std::string>& program,
                          const std::map<std::string, std::string>& env) {
    return node({addr, dir, env}, rdzv.endpoint, "3", "snap-late", 1, program);
  });
}

TEST_CASE("a transfer corrupted in flight or at the source is rejected and retried", "[snapshot]") {
  // 70 MiB: a file announced before its hash is known, fetched over two streams; the CRC-32 that
  // exposes the source's corruption follows the last chunks.
  for (const auto& [fault, size] : {std::pair<std::string, size_t>{"in-flight:1", 300000},
                                    {"at-source:1", 300000},
                                    {"at-source:1", 70 << 20}}) {
    SECTION(fault + " " + std::to_string(size)) {
      RendezvousDaemon rdzv;
      TempDir a_dir, b_dir;
      const std::string script =
          "if [ \"$WRITER$LOCAL_RANK\" = 10 ]; then "
          "head -c " +
          std::to_string(size) +
          " /dev/urandom > \"$DDPRUN_SNAPSHOT_DIR/data.bin.tmp\" && "
          "mv \"$DDPRUN_SNAPSHOT_DIR/data.bin.tmp\" \"$DDPRUN_SNAPSHOT_DIR/data.bin\"; fi; "
          "sleep 4";
      auto a =
          node({"127.0.0.2", a_dir.path(), {{"WRITER", "1"}, {"DDPRUN_SNAPSHOT_FAULT", fault}}},
               rdzv.endpoint, "2", "snap-corrupt", 1, writerScript(script));
      auto b = node({"127.0.0.3", b_dir.path(), {{"WRITER", "0"}}}, rdzv.endpoint, "2",
                    "snap-corrupt", 1, writerScript(script));
      auto [ra, rb] = bothSucceed(*a, *b);
      INFO(a->err() << "\n" << b->err());
      const std::string why = fault == "in-flight:1" ? "fails its CRC-32 (corrupted in flight)"
                                                     : "does not match the announced CRC-32";
      CHECK(rb.err.find(why) != std::string::npos);
      CHECK(rb.err.find("snapshot: fetched data.bin") != std::string::npos);
      const bool same = readFile(b_dir / "data.bin") == readFile(a_dir / "data.bin");
      CHECK(same);
      CHECK(readFile(a_dir / "data.bin").size() == size);
      CHECK((ra.err.find("while it is hashed") != std::string::npos) == (size >= (64 << 20)));
    }
  }
}

TEST_CASE("a receiver without space keeps its previous version and the job goes on", "[snapshot]") {
  TempDir a_dir, b_dir;
  if (::geteuid() != 0 || !canMountTmpfs(b_dir.path(), "128k")) {
    WARN("skipped: cannot mount a small tmpfs (needs root)");
    return;
  }
  struct Unmount {
    std::string dir;
    ~Unmount() { ::umount2(dir.c_str(), MNT_DETACH); }
  } unmount{b_dir.path()};
  RendezvousDaemon rdzv;
  const std::string d = "\"$DDPRUN_SNAPSHOT_DIR\"";
  const std::string script =
      "if [ \"$WRITER$LOCAL_RANK\" = 10 ]; then "
      "echo first > " +
      d + "/big.bin.tmp && mv " + d + "/big.bin.tmp " + d +
      "/big.bin; "
      "sleep 2; head -c 400000 /dev/zero > " +
      d + "/big.bin.tmp && mv " + d + "/big.bin.tmp " + d + "/big.bin; echo small > " + d +
      "/small.txt.tmp && mv " + d + "/small.txt.tmp " + d + "/small.txt; fi; sleep 5";
  auto a = node({"127.0.0.2", a_dir.path(), {{"WRITER", "1"}}}, rdzv.endpoint, "2", "snap-full", 1,
                writerScript(script));
  auto b = node({"127.0.0.3", b_dir.path(), {{"WRITER", "0"}}}, rdzv.endpoint, "2", "snap-full", 1,
                writerScript(script));
  auto [ra, rb] = bothSucceed(*a, *b);
  INFO(a->err() << "\n" << b->err());
  std::smatch m;
  CHECK(std::regex_search(rb.err, m,
                          std::regex(R"(error: snapshot: no space for big.bin version \S+ in \S+: )"
                                     R"(needs 400000 bytes)")));
  CHECK(countOf(rb.err, "no space for big.bin") == 1);  // one line, not retried
  CHECK(readFile(b_dir / "big.bin") == "first\n");      // the previous version stays
  CHECK(readFile(b_dir / "small.txt") == "small\n");    // later versions still arrive
  CHECK(readFile(a_dir / "big.bin").size() == 400000);
}

TEST_CASE("when the writer dies mid-transfer the others resume from the previous version",
          "[snapshot]") {
  // With four nodes two receivers fetch from a relay that passes the version on as it arrives
  // (the chain from the writer): a relay's own fetch fails with the writer, and so does the one
  // below it. A writer stopped with SIGSTOP resets no connection and sends nothing more: the
  // next round, formed without it, ends the fetch from it (else it would hold the round's start
  // until the fetch's deadline, over a minute).
  const int sig = GENERATE(SIGKILL, SIGSTOP);
  const int count = GENERATE(3, 4);
  CAPTURE(sig, count);
  RendezvousDaemon rdzv;
  std::vector<std::unique_ptr<TempDir>> dirs;
  const std::string d = "\"$DDPRUN_SNAPSHOT_DIR\"";
  // Every worker says which version it starts from. In the first round the writer's node writes
  // v1, then a large v2 that its (slowed) replication service is still sending when the test
  // kills that node; the survivors' next round (after the membership change) ends the job.
  const std::string script = "echo \"resumed from $(head -c 2 " + d +
                             "/state.bin 2>/dev/null || echo none)\"; "
                             "if [ \"$DDPRUN_MEMBERSHIP_EPOCH\" != 0 ]; then sleep 2; exit 0; fi; "
                             "if [ \"$WRITER$LOCAL_RANK\" = 10 ]; then "
                             "echo v1 > " +
                             d + "/state.bin.tmp && mv " + d + "/state.bin.tmp " + d +
                             "/state.bin; "
                             "sleep 2; (echo v2; head -c 20000000 /dev/zero) > " +
                             d + "/state.bin.tmp && mv " + d + "/state.bin.tmp " + d +
                             "/state.bin; fi; sleep 60";
  const std::string nnodes = "2:" + std::to_string(count);
  std::vector<std::unique_ptr<Process>> nodes;
  for (int i = 0; i < count; ++i) {
    dirs.push_back(std::make_unique<TempDir>());
    std::map<std::string, std::string> env = {{"WRITER", i == 0 ? "1" : "0"}};
    if (i == 0) env["DDPRUN_SNAPSHOT_FAULT"] = "slow:200";
    nodes.push_back(node({"127.0.0." + std::to_string(2 + i), dirs[i]->path(), env}, rdzv.endpoint,
                         nnodes, "snap-dies", 1, writerScript(script)));
  }
  // Every receiver holds v1 and is receiving v2 (its temp file exists).
  auto receiving = [](const TempDir& dir) {
    return readFile(dir / "state.bin") == "v1\n" &&
           std::system(("ls -a '" + dir.path() + "' | grep -q '^.ddprun-recv'").c_str()) == 0;
  };
  REQUIRE(waitUntil(
      [&] {
        return std::all_of(dirs.begin() + 1, dirs.end(),
                           [&](auto& dir) { return receiving(*dir); });
      },
      120s));
  nodes[0]->signal(sig);
  if (sig == SIGKILL) REQUIRE(nodes[0]->wait(10s));
  int relays = 0, below_relay = 0, ended = 0;
  for (int i = 1; i < count; ++i) {
    auto r = finish(*nodes[i], 180s);
    INFO(nodes[i]->err());
    REQUIRE(r);
    CHECK(r->exit_code == 0);
    CHECK(r->out.find("resumed from v1") != std::string::npos);  // the second round's workers
    CHECK(readFile(*dirs[i] / "state.bin") == "v1\n");
    // No partial copy is left behind.
    CHECK(std::system(("ls -a '" + dirs[i]->path() + "' | grep -q '^.ddprun-recv'").c_str()) != 0);
    const std::string err = nodes[i]->err();
    relays += err.find("snapshot: passing state.bin") != std::string::npos;
    below_relay += err.find("served as it arrived, failed") != std::string::npos;
    ended += std::regex_search(
        err, std::regex(R"(fetching state.bin version \S+ from 127\.0\.0\.2:\d+ failed \(attempt )"
                        R"(\d+\): 127\.0\.0\.2:\d+ is not a node of round \d+)"));
  }
  CHECK(relays == count - 2);
  // Below a relay, the fetch fails with the relay's own. After a SIGKILL on a loaded host the
  // next round's sync may end the fetch below first (as it may the relay's, below), and then that
  // node names no relay failure: what it holds and resumes from is checked above either way.
  if (sig == SIGSTOP) {
    CHECK(below_relay == relays);
  } else {
    CHECK(below_relay <= relays);
  }
  // The fetch from a stopped writer is ended by the next round's sync. From a killed one it fails
  // on its own when the connection resets, or, where the sync comes first (a loaded host: the
  // fetch thread runs at background priority), is ended by it the same way; so may the retry
  // from the writer of a node below the relay (the failed relay names the writer to it).
  if (sig == SIGSTOP) {
    CHECK(ended == 1);
  } else {
    CHECK(ended <= count - 1);
  }
  if (sig == SIGSTOP) {
    nodes[0]->signal(SIGKILL);
    CHECK(nodes[0]->wait(10s));
  }
}

TEST_CASE(
    "past rounds' holdings and identities are deleted: a job of many rounds stays within the run's "
    "key-value quota",
    "[snapshot]") {
  // 1000 files of distinct contents, on both nodes: each round's holdings take ~24 KB of the
  // run's store (deflated). The rendezvous allows the run 60 KB: two rounds' worth (the previous
  // round's keys are deleted as the next one starts). Kept, the third round's could not be
  // published, and the nodes would start it without knowing each other.
  RendezvousDaemon rdzv({"--max-run-kv-bytes", "60000"});
  TempDir a_dir, b_dir;
  const std::string d = "\"$DDPRUN_SNAPSHOT_DIR\"";
  const std::string script =
      "if [ \"$WRITER$TORCHELASTIC_RESTART_COUNT\" = 10 ]; then i=0; while [ $i -lt 1000 ]; do "
      "echo $i > " +
      d +
      "/f-$i.bin; i=$((i+1)); done; fi; sleep 2; "
      "[ \"$TORCHELASTIC_RESTART_COUNT\" -ge 3 ]";
  auto a = node({"127.0.0.2", a_dir.path(), {{"WRITER", "1"}}}, rdzv.endpoint, "2", "snap-rounds",
                1, writerScript(script));
  auto b = node({"127.0.0.3", b_dir.path(), {{"WRITER", "0"}}}, rdzv.endpoint, "2", "snap-rounds",
                1, writerScript(script));
  auto [ra, rb] = bothSucceed(*a, *b, 240s);
  const std::string logs = ra.err + "\n" + rb.err;
  INFO(logs);
  CHECK(countOf(ra.err, "started 1 worker(s)") == 4);  // 3 failures: 4 rounds
  CHECK(logs.find("cannot publish") == std::string::npos);
  CHECK(logs.find("max-run-kv-bytes") == std::string::npos);
  CHECK(logs.find("did not arrive") == std::string::npos);
  size_t files = 0;
  for (int i = 0; i < 1000; ++i)
    files += readFile(b_dir / ("f-" + std::to_string(i) + ".bin")) == std::to_string(i) + "\n";
  CHECK(files == 1000);
}

TEST_CASE(
    "the keys of a node gone are deleted too when its replacement is the new round's lowest node",
    "[snapshot]") {
  // The rank-1 node writes 1000 files, which both nodes then hold; the rank-0 node is killed and
  // a fresh one takes its rank (survivors keep theirs) on its disk, three times. Each holds the
  // 1000 files: ~12 KB of holdings per node and round; the run's quota (60 KB) holds two rounds.
  // A lowest node new to the job knew no previous round to delete: each node gone left its
  // holdings behind, and by the fourth round they no longer fit.
  RendezvousDaemon rdzv({"--max-run-kv-bytes", "60000"});
  TempDir a_dir, b_dir, stop_dir;
  const std::string d = "\"$DDPRUN_SNAPSHOT_DIR\"";
  const std::string stop = stop_dir.path() + "/stop";
  const std::string script = "if [ \"$RANK\" = 1 ] && [ ! -e " + d +
                             "/f-999.bin ]; then i=0; while [ $i -lt 1000 ]; "
                             "do echo $i > " +
                             d + "/f-$i.bin; i=$((i+1)); done; fi; while [ ! -e '" + stop +
                             "' ]; do sleep 0.2; done";
  auto a = node({"127.0.0.2", a_dir.path(), {}}, rdzv.endpoint, "2", "snap-gone", 1,
                writerScript(script));
  auto b = node({"127.0.0.3", b_dir.path(), {}}, rdzv.endpoint, "2", "snap-gone", 1,
                writerScript(script));
  REQUIRE(waitUntil(
      [&] { return (a->err() + b->err()).find("group rank 0 of 2") != std::string::npos; }, 120s));
  const bool a_low = a->err().find("group rank 0 of 2") != std::string::npos;
  std::unique_ptr<Process> low = std::move(a_low ? a : b), high = std::move(a_low ? b : a);
  const std::string low_dir = a_low ? a_dir.path() : b_dir.path();
  const std::string high_dir = a_low ? b_dir.path() : a_dir.path();
  const auto holdsAll = [](const std::string& dir) {
    for (int i = 0; i < 1000; i += 37) {  // the files' contents are their numbers
      if (readFile(dir + "/f-" + std::to_string(i) + ".bin") != std::to_string(i) + "\n") {
        return false;
      }
    }
    return readFile(dir + "/f-999.bin") == "999\n";
  };
  rendezvous::ClientOptions o;
  o.endpoint = rdzv.endpoint;
  rendezvous::Client client(o);
  const auto lastRound = [](const std::string& err) {
    const std::regex line(R"(round (\d+): group rank 0 of 2)");
    uint64_t round = 0;
    for (auto it = std::sregex_iterator(err.begin(), err.end(), line); it != std::sregex_iterator();
         ++it) {
      round = std::stoull((*it)[1].str());
    }
    return round;
  };
  const auto holds = [&](const char* kind, uint64_t round, int rank) {
    return client.kvGet("snap-gone", roundKeyPrefix(kind, round) + std::to_string(rank)).isOk();
  };
  uint64_t round = 0;
  for (int replaced = 0;; ++replaced) {
    INFO("replaced " << replaced << "\nlowest node:\n"
                     << low->err() << "\nother node:\n"
                     << high->err());
    // The lowest node of this round holds every file, and both nodes' holdings are published.
    REQUIRE(waitUntil([&] { return lastRound(low->err()) > round; }, 120s));
    round = lastRound(low->err());
    REQUIRE(waitUntil([&] { return holdsAll(low_dir) && holdsAll(high_dir); }, 120s));
    // This round's holdings and identities, each of both nodes, are published (and stay).
    REQUIRE(waitUntil(
        [&] {
          for (const char* kind : {"snapshot", "job"}) {
            if (!holds(kind, round, 0) || !holds(kind, round, 1)) return false;
          }
          return true;
        },
        60s));
    // Every key of an earlier round is gone, those of the nodes killed included.
    CHECK(waitUntil(
        [&] {
          for (uint64_t r = 1; r < round; ++r) {
            for (const char* kind : {"snapshot", "job"}) {
              if (holds(kind, r, 0) || holds(kind, r, 1)) return false;
            }
          }
          return true;
        },
        30s));
    if (replaced == 3) break;
    auto workers = workerPids(low->pid());
    low->signal(SIGKILL);
    REQUIRE(low->wait(10s));
    for (int w : workers) CHECK(waitUntil([&] { return !pidAlive(w); }, 10s));
    // Its replacement, on the same disk, at another address.
    low = node({"127.0.0." + std::to_string(4 + replaced), low_dir, {}}, rdzv.endpoint, "2",
               "snap-gone", 1, writerScript(script));
  }
  std::vector<std::unique_ptr<Process>> last;
  last.push_back(std::move(low));
  last.push_back(std::move(high));
  const std::string logs = logsThenStop(last, stop);
  INFO(logs);
  CHECK(countOf(logs, "started 1 worker(s)") >= 5);  // the first round's two, and each fresh node
  CHECK(logs.find("cannot publish") == std::string::npos);
  CHECK(logs.find("max-run-kv-bytes") == std::string::npos);
}

TEST_CASE("a job started again keeps the versions its nodes held", "[snapshot]") {
  // The first job ends with its nodes holding different versions: the writer's node wrote v2
  // after the other node was killed (which held v1 by then). A second job on the same
  // directories, with new agents and a new rendezvous whose rounds start again at 1, must
  // resume everywhere from v2: the directory's version table keeps what each node held. (Were
  // every file there version 0, each node would keep its own and the workers would disagree.)
  const bool garbage = GENERATE(false, true);  // the other node's table is not one
  CAPTURE(garbage);
  TempDir a_dir, b_dir;
  const std::string d = "\"$DDPRUN_SNAPSHOT_DIR\"";
  {
    RendezvousDaemon rdzv;
    const std::string script =
        "if [ \"$WRITER$LOCAL_RANK\" = 10 ]; then "
        "if [ \"$WORLD_SIZE\" = 2 ]; then echo v1 > " +
        d + "/state.bin.tmp && mv " + d + "/state.bin.tmp " + d +
        "/state.bin; "
        "elif [ \"$(cat " +
        d + "/state.bin 2>/dev/null)\" = v1 ]; then echo v2 > " + d + "/state.bin.tmp && mv " + d +
        "/state.bin.tmp " + d + "/state.bin; exit 0; fi; fi; sleep 60";
    auto a = node({"127.0.0.2", a_dir.path(), {{"WRITER", "1"}}}, rdzv.endpoint, "1:2",
                  "snap-keep-1", 1, writerScript(script));
    auto b = node({"127.0.0.3", b_dir.path(), {{"WRITER", "0"}}}, rdzv.endpoint, "1:2",
                  "snap-keep-1", 1, writerScript(script));
    REQUIRE(waitUntil([&] { return readFile(b_dir / "state.bin") == "v1\n"; }, 120s));
    b->signal(SIGKILL);
    REQUIRE(b->wait(10s));
    auto ra = finish(*a, 120s);
    INFO(a->err());
    REQUIRE(ra);
    REQUIRE(ra->exit_code == 0);
  }
  REQUIRE(readFile(a_dir / "state.bin") == "v2\n");
  REQUIRE(readFile(b_dir / "state.bin") == "v1\n");
  CHECK(readFile(a_dir / ".ddprun-versions").find("\nstate.bin\t") != std::string::npos);
  if (garbage) {
    std::ofstream(b_dir / ".ddprun-versions") << std::string("\0\xff\nstate.bin\t1\n", 14);
  }

  const std::string script = "echo \"resumed from $(cat " + d + "/state.bin)\"";
  auto [ra, rb] = nextJob(a_dir.path(), {"127.0.0.3", b_dir.path()}, "snap-keep-2", script);
  INFO(ra.err << "\n" << rb.err);
  CHECK(ra.out.find("resumed from v2") != std::string::npos);
  CHECK(rb.out.find("resumed from v2") != std::string::npos);
  CHECK(ra.err.find("state.bin (3 bytes) is version ") != std::string::npos);
  CHECK(rb.err.find("snapshot: fetched state.bin version ") != std::string::npos);
  CHECK((rb.err.find("ignoring the version table " + b_dir.path() +
                     "/.ddprun-versions: not a version table") != std::string::npos) == garbage);
  CHECK(readFile(b_dir / "state.bin") == "v2\n");
  // The table was rewritten with what the node holds now.
  CHECK(readFile(b_dir / ".ddprun-versions").find("\nstate.bin\t") != std::string::npos);
}

TEST_CASE(
    "a checkpoint written just before the job is stopped is recorded, and the next job "
    "resumes from it",
    "[snapshot]") {
  // A job stopped as a whole (SIGTERM to every agent, as a Slurm requeue does) right after the
  // writer saved a new version: its agent must still hash and record it before it exits. Before,
  // a stopping agent went at once, the new file (200 MB: announced before its hash, recorded
  // once hashed) was missing from its version table, counted as version 0 in the next job, and
  // the older version the other node held was fetched over it.
  TempDir a_dir, b_dir, flags;
  const std::string d = "\"$DDPRUN_SNAPSHOT_DIR\"";
  const std::string trigger = flags / "write-new", written = flags / "new-written";
  {
    RendezvousDaemon rdzv;
    const std::string script =
        "if [ \"$WRITER\" = 1 ]; then echo v1 > " + d + "/state.bin.tmp && mv " + d +
        "/state.bin.tmp " + d + "/state.bin; while [ ! -e " + trigger +
        " ]; do sleep 0.05; done; head -c 200000000 /dev/zero > " + d + "/state.bin.tmp && mv " +
        d + "/state.bin.tmp " + d + "/state.bin && touch " + written + "; fi; sleep 60";
    auto nodes = writerAndReader(rdzv, a_dir.path(), b_dir.path(), "snap-stop-1", script);
    REQUIRE(waitUntil([&] { return readFile(b_dir / "state.bin") == "v1\n"; }, 120s));
    std::ofstream(trigger) << "";
    REQUIRE(waitUntil([&] { return std::filesystem::exists(written); }, 60s));
    for (auto& n : nodes) n->signal(SIGTERM);
    for (auto& n : nodes) REQUIRE(n->wait(60s));
    INFO(nodes[0]->err());
    CHECK(std::filesystem::file_size(a_dir / "state.bin") == 200000000);
    CHECK(readFile(a_dir / ".ddprun-versions").find("\t200000000\t") != std::string::npos);
  }
  REQUIRE(std::filesystem::file_size(a_dir / "state.bin") == 200000000);
  const std::string script = "echo \"resumed from $(stat -c %s " + d + "/state.bin) bytes\"";
  auto [ra, rb] = nextJob(a_dir.path(), {"127.0.0.3", b_dir.path()}, "snap-stop-2", script);
  INFO(ra.err << "\n" << rb.err);
  CHECK(ra.out.find("resumed from 200000000 bytes") != std::string::npos);
  CHECK(rb.out.find("resumed from 200000000 bytes") != std::string::npos);
}

TEST_CASE("files written just before a failure are in the restarted round before its workers start",
          "[snapshot]") {
  // The writer's worker writes a checkpoint of 300 files in place and fails at once; its agent
  // takes 10 ms more to hash each file (DDPRUN_SNAPSHOT_FAULT=slow-hash:10, as a large sharded
  // checkpoint would take), so some 3 s. Each file is hashed before it is announced; the
  // restart's round must not start the other node's workers until all of them are versioned and
  // fetched. Before, the writer published its holdings as they were when the round formed,
  // without the files still to be hashed, and the other node's worker started without them.
  RendezvousDaemon rdzv;
  TempDir a_dir, b_dir;
  const std::string d = "\"$DDPRUN_SNAPSHOT_DIR\"";
  const std::string script =
      "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then if [ \"$WRITER\" = 1 ]; then mkdir " + d +
      "/ckpt; i=0; while [ $i -lt 300 ]; do echo $i > " + d +
      "/ckpt/f$i; i=$((i+1)); done; exit 1; fi; sleep 60; fi; echo \"saw $(ls " + d +
      "/ckpt | wc -l) files\"";
  auto a = node(
      {"127.0.0.2", a_dir.path(), {{"WRITER", "1"}, {"DDPRUN_SNAPSHOT_FAULT", "slow-hash:10"}}},
      rdzv.endpoint, "2", "snap-fail-sync", 1, writerScript(script));
  auto b = node({"127.0.0.3", b_dir.path(), {{"WRITER", "0"}}}, rdzv.endpoint, "2",
                "snap-fail-sync", 1, writerScript(script));
  auto [ra, rb] = bothSucceed(*a, *b);
  INFO(ra.err << "\n" << rb.err);
  CHECK(ra.out.find("saw 300 files") != std::string::npos);
  CHECK(rb.out.find("saw 300 files") != std::string::npos);
}

TEST_CASE("nodes that wrote one name under one version end with the same bytes", "[snapshot]") {
  // Two nodes' workers each write same.bin at once, before either hears of the other's write:
  // both number it above the same last version, so the numbers may be equal. Whatever the
  // numbers, both directories must end with the same bytes.
  SECTION("written on both nodes in one round") {
    TempDir a_dir, b_dir, triggers;
    RendezvousDaemon rdzv;
    const std::string d = "\"$DDPRUN_SNAPSHOT_DIR\"";
    const std::string script = "echo \"written on $NODE\" > " + d + "/same.bin.tmp && mv " + d +
                               "/same.bin.tmp " + d + "/same.bin; while [ ! -e '" +
                               triggers / "stop" + "' ]; do sleep 0.1; done";
    auto a = node({"127.0.0.2", a_dir.path(), {{"NODE", "a"}}}, rdzv.endpoint, "2", "snap-same-1",
                  1, writerScript(script));
    auto b = node({"127.0.0.3", b_dir.path(), {{"NODE", "bb"}}}, rdzv.endpoint, "2", "snap-same-1",
                  1, writerScript(script));
    const bool same = waitUntil(
        [&] {
          const std::string in_a = readFile(a_dir / "same.bin");
          return !in_a.empty() && in_a == readFile(b_dir / "same.bin");
        },
        60s);
    std::ofstream(triggers / "stop") << "";
    auto [ra, rb] = bothSucceed(*a, *b);
    INFO(ra.err << "\n" << rb.err);
    CHECK(same);
    CHECK(readFile(a_dir / "same.bin") == readFile(b_dir / "same.bin"));
  }
  SECTION("written on four nodes in one round") {
    // Versions the nodes announce under one number each travel a chain of their own; whichever
    // wins (a higher number, written after hearing of another, or at one number the greater
    // content) reaches every node in this round, not only at the next round's sync.
    std::vector<std::unique_ptr<TempDir>> dirs;
    std::vector<std::unique_ptr<Process>> nodes;
    TempDir triggers;
    RendezvousDaemon rdzv;
    const std::string d = "\"$DDPRUN_SNAPSHOT_DIR\"";
    const std::string script = "echo \"written on $NODE\" > " + d + "/same.bin.tmp && mv " + d +
                               "/same.bin.tmp " + d + "/same.bin; while [ ! -e '" +
                               triggers / "stop" + "' ]; do sleep 0.1; done";
    for (int i = 0; i < 4; ++i) {
      dirs.push_back(std::make_unique<TempDir>());
      nodes.push_back(node({"127.0.0.2" + std::to_string(i),
                            dirs[i]->path(),
                            {{"NODE", std::string(static_cast<size_t>(i + 1), 'n')}}},
                           rdzv.endpoint, "4", "snap-same-4", 1, writerScript(script)));
    }
    const bool converged = waitUntil(
        [&] {
          const std::string first = readFile(*dirs[0] / "same.bin");
          return !first.empty() && std::all_of(dirs.begin(), dirs.end(), [&](const auto& dir) {
            return readFile(*dir / "same.bin") == first;
          });
        },
        60s);
    const std::string logs = logsThenStop(nodes, triggers / "stop");
    INFO(logs);
    CHECK(converged);
    CHECK(logs.find("round 2") == std::string::npos);
  }
  SECTION("recorded under one version with other bytes") {
    // Deterministic: each node's version table records state.bin at the same version, with the
    // bytes its directory holds (as a past job that wrote on both nodes at once could leave
    // them). The greater content (here the longer) wins on both before any worker starts.
    TempDir a_dir, b_dir;
    const uint64_t version = (3ull << 32) | 1;  // round 3, the first write
    auto hold = [&](const TempDir& dir, const std::string& bytes) {
      std::ofstream(dir / "state.bin") << bytes;
      std::ofstream(dir / ".ddprun-versions")
          << "ddprun snapshot versions 1\nstate.bin\t" << version << "\t" << bytes.size() << "\t"
          << crc32Update(0, bytes.data(), bytes.size()) << "\n";
    };
    hold(a_dir, "b\n");
    hold(b_dir, "a longer one\n");
    RendezvousDaemon rdzv;
    const std::string script = "echo \"resumed from $(cat \"$DDPRUN_SNAPSHOT_DIR\"/state.bin)\"";
    auto a = node({"127.0.0.2", a_dir.path(), {}}, rdzv.endpoint, "2", "snap-same-2", 1,
                  writerScript(script));
    auto b = node({"127.0.0.3", b_dir.path(), {}}, rdzv.endpoint, "2", "snap-same-2", 1,
                  writerScript(script));
    auto [ra, rb] = bothSucceed(*a, *b);
    INFO(ra.err << "\n" << rb.err);
    CHECK(ra.err.find("state.bin (2 bytes) is version ") != std::string::npos);  // table taken
    CHECK(ra.out.find("resumed from a longer one") != std::string::npos);
    CHECK(rb.out.find("resumed from a longer one") != std::string::npos);
    CHECK(ra.err.find("snapshot: fetched state.bin version ") != std::string::npos);
    CHECK(rb.err.find("snapshot: fetched state.bin") == std::string::npos);
  }
}

TEST_CASE("a file deleted on one node is deleted on the others, and stays deleted", "[snapshot]") {
  // Three nodes: the writer's worker writes keep.bin and old.bin, then deletes old.bin; the
  // deletion travels the chain like a version. A second job, where one node's disk came back
  // from before the deletion (old.bin there again, its version table gone), deletes it there
  // too: the others' tables recorded the deletion.
  TempDir triggers;
  std::vector<std::unique_ptr<TempDir>> dirs;
  for (int i = 0; i < 3; ++i) dirs.push_back(std::make_unique<TempDir>());
  const std::string d = "\"$DDPRUN_SNAPSHOT_DIR\"";
  auto wait_for = [&](const std::string& name) {
    return "while [ ! -e '" + triggers / name + "' ]; do sleep 0.1; done; ";
  };
  std::string old_copy;
  {
    RendezvousDaemon rdzv;
    const std::string script = "if [ \"$WRITER$LOCAL_RANK\" = 10 ]; then echo keep > " + d +
                               "/keep.bin.tmp && mv " + d + "/keep.bin.tmp " + d +
                               "/keep.bin; head -c 100000 /dev/urandom > " + d +
                               "/old.bin.tmp && mv " + d + "/old.bin.tmp " + d + "/old.bin; " +
                               wait_for("delete") + "rm " + d + "/old.bin; fi; " + wait_for("stop");
    std::vector<std::unique_ptr<Process>> nodes;
    for (int i = 0; i < 3; ++i) {
      nodes.push_back(node(
          {"127.0.0." + std::to_string(2 + i), dirs[i]->path(), {{"WRITER", i == 0 ? "1" : "0"}}},
          rdzv.endpoint, "3", "snap-delete-1", 1, writerScript(script)));
    }
    auto everywhere = [&](const std::string& name) {
      return std::all_of(dirs.begin(), dirs.end(),
                         [&](auto& dir) { return fileExists(*dir / name); });
    };
    REQUIRE(waitUntil(
        [&] {
          return everywhere("keep.bin") && everywhere("old.bin") &&
                 readFile(*dirs[2] / "old.bin").size() == 100000;
        },
        120s));
    old_copy = readFile(*dirs[2] / "old.bin");
    std::ofstream(triggers / "delete") << "";
    const bool deleted = waitUntil(
        [&] {
          return std::none_of(dirs.begin(), dirs.end(),
                              [&](auto& dir) { return fileExists(*dir / "old.bin"); });
        },
        60s);
    std::ofstream(triggers / "stop") << "";
    for (auto& n : nodes) {
      auto r = finish(*n, 120s);
      INFO(n->err());
      REQUIRE(r);
      CHECK(r->exit_code == 0);
    }
    INFO(nodes[0]->err() << nodes[1]->err() << nodes[2]->err());
    REQUIRE(deleted);
    CHECK(std::regex_search(
        nodes[0]->err(), std::regex(R"(snapshot: old.bin version \S+ \(a deletion\) made here)")));
    for (int i : {1, 2}) {
      CHECK(nodes[i]->err().find("snapshot: deleted old.bin (version ") != std::string::npos);
      CHECK(readFile(*dirs[i] / "keep.bin") == "keep\n");
    }
  }

  // The third node's disk, as it was before the deletion.
  std::ofstream(*dirs[2] / "old.bin") << old_copy;
  REQUIRE(::unlink((*dirs[2] / ".ddprun-versions").c_str()) == 0);
  RendezvousDaemon rdzv;
  const std::string script = "ls " + d;
  std::vector<std::unique_ptr<Process>> nodes;
  for (int i = 0; i < 3; ++i) {
    nodes.push_back(node({"127.0.0." + std::to_string(2 + i), dirs[i]->path(), {}}, rdzv.endpoint,
                         "3", "snap-delete-2", 1, writerScript(script)));
  }
  std::string out;
  for (auto& n : nodes) {
    auto r = finish(*n, 120s);
    INFO(n->err());
    REQUIRE(r);
    CHECK(r->exit_code == 0);
    out += r->out;
  }
  INFO(out << nodes[2]->err());
  CHECK(countOf(out, "keep.bin") == 3);
  CHECK(out.find("old.bin") == std::string::npos);
  CHECK(nodes[2]->err().find("snapshot: deleted old.bin (version ") != std::string::npos);
  CHECK_FALSE(fileExists(*dirs[2] / "old.bin"));
}

TEST_CASE("checkpoint directories are replicated at any depth, and deleted directories go too",
          "[snapshot]") {
  // The writer saves checkpoints as directories, as torch.distributed.checkpoint and Hugging
  // Face's Trainer do: ckpt-1 file by file (DCP's ".metadata" renamed from ".metadata.tmp"),
  // ckpt-2 written under a temp name and renamed into place whole (with a directory inside),
  // ckpt-3 made and written at once. Then ckpt-1 is removed (rm -rf) and ckpt-2 renamed away:
  // both go on the other node, files and directories. A fresh node with an empty directory then
  // gets what is left before its worker starts.
  TempDir triggers, a_dir, b_dir;
  const std::string d = "\"$DDPRUN_SNAPSHOT_DIR\"";
  auto wait_for = [&](const std::string& name) {
    return "while [ ! -e '" + triggers / name + "' ]; do sleep 0.1; done; ";
  };
  const std::string big = triggers / "big.bin";
  {
    std::ofstream out(big, std::ios::binary);
    for (uint32_t i = 0; i < 300000; ++i) out.put(static_cast<char>(i * 7919u % 251u));
  }
  // A name as long as a file name may be: its receiving temp file's name must fit too.
  const std::string longest = "ckpt-1/" + std::string(255, 'n');
  const std::map<std::string, std::string> expected = {{"ckpt-1/model.pt", "model1\n"},
                                                       {"ckpt-1/.metadata", "meta1\n"},
                                                       {longest, "long\n"},
                                                       {"ckpt-2/model.pt", "model2\n"},
                                                       {"ckpt-2/sub/deep.bin", "deep\n"},
                                                       {"ckpt-3/optimizer.pt", readFile(big)}};
  const std::string script =
      "if [ \"$WRITER$LOCAL_RANK\" = 10 ]; then cd " + d + " && mkdir ckpt-1 && " +
      "echo model1 > ckpt-1/model.pt.tmp && mv ckpt-1/model.pt.tmp ckpt-1/model.pt && " +
      "echo meta1 > ckpt-1/.metadata.tmp && mv ckpt-1/.metadata.tmp ckpt-1/.metadata && " +
      "echo long > ckpt-1/x.tmp && mv ckpt-1/x.tmp " + longest + " && " +
      "mkdir -p ckpt-2.tmp/sub && echo model2 > ckpt-2.tmp/model.pt && " +
      "echo deep > ckpt-2.tmp/sub/deep.bin && mv ckpt-2.tmp ckpt-2 && " + "mkdir ckpt-3 && cat '" +
      big + "' > ckpt-3/optimizer.pt && " + wait_for("delete") + "rm -rf ckpt-1 && mv ckpt-2 \"" +
      triggers / "moved-away" + "\"; fi; " + wait_for("stop");
  auto holds = [&](const TempDir& dir, const std::string& name, const std::string& content) {
    return fileExists(dir / name) && readFile(dir / name) == content;
  };
  {
    RendezvousDaemon rdzv;
    auto nodes = writerAndReader(rdzv, a_dir.path(), b_dir.path(), "snap-dirs-1", script);
    const bool arrived = waitUntil(
        [&] {
          return std::all_of(expected.begin(), expected.end(),
                             [&](const auto& f) { return holds(b_dir, f.first, f.second); });
        },
        60s);
    // A file is renamed into place before its fetch is logged: the line follows at once.
    if (arrived) {
      waitUntil(
          [&] {
            return nodes[1]->err().find("snapshot: fetched ckpt-2/sub/deep.bin version ") !=
                   std::string::npos;
          },
          10s);
    }
    std::ofstream(triggers / "delete") << "";
    const bool deleted =
        arrived &&
        waitUntil(
            [&] {
              // A deletion is logged after its file and emptied directories are gone.
              return !fileExists(b_dir / "ckpt-1") && !fileExists(b_dir / "ckpt-2") &&
                     nodes[1]->err().find("snapshot: deleted ckpt-1/.metadata (version ") !=
                         std::string::npos;
            },
            60s);
    const std::string logs = logsThenStop(nodes, triggers / "stop");
    INFO(logs);
    REQUIRE(arrived);
    CHECK(deleted);
    CHECK(holds(b_dir, "ckpt-3/optimizer.pt", expected.at("ckpt-3/optimizer.pt")));
    CHECK(fileExists(triggers / "moved-away/sub/deep.bin"));
    CHECK(std::regex_search(logs, std::regex(R"(snapshot: fetched ckpt-2/sub/deep.bin version )")));
    CHECK(logs.find("snapshot: deleted ckpt-1/.metadata (version ") != std::string::npos);
    // Nothing of the agent's own, or of a temp name, arrived.
    for (const auto& entry : std::filesystem::recursive_directory_iterator(b_dir.path())) {
      const std::string name = entry.path().filename().string();
      CHECK(name.find(".tmp") == std::string::npos);
      CHECK((name.rfind(".ddprun", 0) != 0 || name == ".ddprun-versions"));
    }
  }

  // A fresh node with an empty directory: ckpt-3 arrives before its worker starts.
  TempDir c_dir;
  const std::string list = "cd " + d + " && find . -type f ! -name .ddprun-versions | sort";
  auto [ra, rc] = nextJob(a_dir.path(), {"127.0.0.4", c_dir.path()}, "snap-dirs-2", list);
  INFO(ra.err << "\n" << rc.err);
  for (const auto& out : {ra.out, rc.out}) {
    CHECK(countOf(out, "./ckpt-") == 1);
    CHECK(out.find("./ckpt-3/optimizer.pt\n") != std::string::npos);
  }
  CHECK(holds(c_dir, "ckpt-3/optimizer.pt", expected.at("ckpt-3/optimizer.pt")));
}

TEST_CASE(
    "a file or directory renamed in the snapshot dir is copied from the old name, not fetched",
    "[snapshot]") {
  // The writer saves under staging names that are not temp names (replicated as they are), then
  // renames: a file to a new name, a checkpoint directory to its final name, a file over an older
  // version of its new name, and a file to a temp name (which deletes it). The other node holds
  // the old names already: it copies its own files under the new names (no fetch), deletes the
  // old ones, and ends with the writer's names and bytes.
  TempDir triggers, a_dir, b_dir;
  auto wait_for = [&](const std::string& name) {
    return "while [ ! -e '" + triggers / name + "' ]; do sleep 0.1; done; ";
  };
  std::string contents[2];
  for (uint32_t k = 0; k < 2; ++k) {
    for (uint32_t i = 0; i < 300000; ++i) contents[k].push_back(static_cast<char>(i * (7 + k)));
    std::ofstream(triggers / ("big" + std::to_string(k)), std::ios::binary) << contents[k];
  }
  const std::string big0 = triggers / "big0", big1 = triggers / "big1";
  const std::string script =
      "if [ \"$WRITER$LOCAL_RANK\" = 10 ]; then cd \"$DDPRUN_SNAPSHOT_DIR\" && cat '" + big0 +
      "' > staging.pt && mkdir -p stage-1/sub && cat '" + big1 +
      "' > stage-1/model.pt && echo deep > stage-1/sub/deep.bin && " + wait_for("1") +
      "mv staging.pt snapshot.pt && mv stage-1 ckpt-1 && " + wait_for("2") + "cat '" + big1 +
      "' > staging.pt && " + wait_for("3") + "mv staging.pt snapshot.pt && " + wait_for("4") +
      "mv snapshot.pt snapshot.pt.tmp; fi; " + wait_for("stop");
  auto holds = [&](const std::string& name, const std::string& content) {
    return fileExists(b_dir / name) && readFile(b_dir / name) == content;
  };
  auto step = [&](const std::string& trigger, const std::function<bool()>& done) {
    const bool ok = waitUntil(done, 60s);
    if (ok && !trigger.empty()) std::ofstream(triggers / trigger) << "";
    return ok;
  };
  RendezvousDaemon rdzv;
  auto nodes = writerAndReader(rdzv, a_dir.path(), b_dir.path(), "snap-renames", script);
  const bool ok =
      step("1",
           [&] {
             return holds("staging.pt", contents[0]) && holds("stage-1/model.pt", contents[1]) &&
                    holds("stage-1/sub/deep.bin", "deep\n");
           }) &&
      step("2",
           [&] {
             return holds("snapshot.pt", contents[0]) && holds("ckpt-1/model.pt", contents[1]) &&
                    holds("ckpt-1/sub/deep.bin", "deep\n") && !fileExists(b_dir / "staging.pt") &&
                    !fileExists(b_dir / "stage-1");
           }) &&
      step("3", [&] { return holds("staging.pt", contents[1]); }) &&
      step(
          "4",
          [&] { return holds("snapshot.pt", contents[1]) && !fileExists(b_dir / "staging.pt"); }) &&
      step("", [&] {
        // A deletion is logged after its file is gone.
        return !fileExists(b_dir / "snapshot.pt") &&
               nodes[1]->err().find("snapshot: deleted snapshot.pt (version ") != std::string::npos;
      });
  const std::string logs = logsThenStop(nodes, triggers / "stop");
  const std::string reader = nodes[1]->err();
  INFO(logs);
  REQUIRE(ok);
  CHECK(logs.find("ckpt-1/model.pt version ") != std::string::npos);
  CHECK(logs.find("(renamed from stage-1/model.pt)") != std::string::npos);
  CHECK(logs.find("(renamed from staging.pt)") != std::string::npos);
  // Every renamed file came from the reader's own file of the old name: linked while it still
  // held it, copied when the old name's deletion came first.
  auto taken = [&](const std::string& bytes, const std::string& from) {
    return countOf(reader, bytes + " bytes linked from " + from + " here") +
           countOf(reader, bytes + " bytes copied from " + from + " here");
  };
  CHECK(taken("300000", "staging.pt") == 2);
  CHECK(taken("300000", "stage-1/model.pt") == 1);
  CHECK(taken("5", "stage-1/sub/deep.bin") == 1);
  CHECK(reader.find("snapshot: fetched snapshot.pt") == std::string::npos);
  CHECK(reader.find("snapshot: fetched ckpt-1/") == std::string::npos);
  CHECK(reader.find("snapshot: deleted stage-1/model.pt (version ") != std::string::npos);
  CHECK(reader.find("snapshot: deleted snapshot.pt (version ") != std::string::npos);
}

TEST_CASE("a file still open for writing in a directory renamed into place is announced once",
          "[snapshot]") {
  // The writer makes ckpt.tmp/part.bin, renames the directory into place while the file is still
  // open (a shell's descriptor 3), writes more, and only then closes it. The new directory is read
  // when it appears; the open file is left to its IN_CLOSE_WRITE, so its first half is never
  // announced: one version, with all the bytes, reaches the other node.
  TempDir triggers, a_dir, b_dir;
  const std::string script =
      "if [ \"$WRITER$LOCAL_RANK\" = 10 ]; then cd \"$DDPRUN_SNAPSHOT_DIR\" && mkdir ckpt.tmp && "
      "exec 3> ckpt.tmp/part.bin && printf first >&3 && echo whole > ckpt.tmp/closed.bin && "
      "mv ckpt.tmp ckpt && while [ ! -e '" +
      triggers / "more" + "' ]; do sleep 0.1; done && printf second >&3 && exec 3>&-; fi; " +
      "while [ ! -e '" + triggers / "stop" + "' ]; do sleep 0.1; done";
  RendezvousDaemon rdzv;
  auto nodes = writerAndReader(rdzv, a_dir.path(), b_dir.path(), "snap-open", script);
  // The closed file in the same directory arrives; then the open one is written further.
  const bool closed_arrived = waitUntil(
      [&] {
        return fileExists(b_dir / "ckpt/closed.bin") &&
               readFile(b_dir / "ckpt/closed.bin") == "whole\n";
      },
      60s);
  std::this_thread::sleep_for(1s);  // time enough for a half-written part.bin to be announced
  const bool early = fileExists(b_dir / "ckpt/part.bin");
  std::ofstream(triggers / "more") << "";
  const bool arrived =
      closed_arrived && waitUntil(
                            [&] {
                              return fileExists(b_dir / "ckpt/part.bin") &&
                                     readFile(b_dir / "ckpt/part.bin") == "firstsecond";
                            },
                            60s);
  // The file is renamed into place before its fetch is logged: the line follows at once.
  if (arrived) {
    waitUntil([&] { return countOf(nodes[1]->err(), "snapshot: fetched ckpt/part.bin") > 0; }, 10s);
  }
  const std::string logs = logsThenStop(nodes, triggers / "stop");
  INFO(logs);
  REQUIRE(arrived);
  CHECK_FALSE(early);
  CHECK(countOf(logs, "snapshot: ckpt/part.bin version ") == 1);
  CHECK(std::regex_search(
      logs, std::regex(R"(snapshot: ckpt/part.bin version \S+ \(11 bytes\) written here)")));
  CHECK(countOf(logs, "snapshot: fetched ckpt/part.bin version ") == 1);
}

TEST_CASE(
    "a rename whose deletion arrives before its new name is linked from the old file set aside",
    "[snapshot]") {
  // Announcements travel on calls of their own, so a node may learn of the old name's deletion
  // before the new name's version. The test plays the writer's agent for those two announcements,
  // in that order: the reader sets staging.pt aside under a hidden name instead of deleting it,
  // and links final.pt to it (no fetch: the writer never held final.pt; no copy). A deletion
  // whose new name never comes (other.pt) has its file set aside only a while.
  TempDir triggers, a_dir, b_dir;
  std::string content;
  for (uint32_t i = 0; i < 200000; ++i) content.push_back(static_cast<char>(i * 13));
  std::ofstream(triggers / "big", std::ios::binary) << content;
  const std::string script =
      "if [ \"$WRITER$LOCAL_RANK\" = 10 ]; then cat '" + triggers / "big" +
      "' > \"$DDPRUN_SNAPSHOT_DIR/staging.pt\" && cp \"$DDPRUN_SNAPSHOT_DIR/staging.pt\" "
      "\"$DDPRUN_SNAPSHOT_DIR/other.pt\"; fi; while [ ! -e '" +
      triggers / "stop" + "' ]; do sleep 0.1; done";
  RendezvousDaemon rdzv;
  auto nodes = writerAndReader(rdzv, a_dir.path(), b_dir.path(), "snap-rename-order", script);
  auto holds = [&](const std::string& name) {
    return fileExists(b_dir / name) && readFile(b_dir / name) == content;
  };
  // Each file is renamed into place before its fetch is logged: wait for both lines too.
  const bool arrived = waitUntil(
      [&] {
        const std::string err = nodes[1]->err();
        return holds("staging.pt") && holds("other.pt") &&
               err.find("fetched staging.pt version") != std::string::npos &&
               err.find("fetched other.pt version") != std::string::npos;
      },
      60s);
  // The files set aside: hidden names at the top of the reader's directory.
  auto aside = [&] {
    int n = 0;
    for (const auto& e : std::filesystem::directory_iterator(b_dir.path())) {
      n += e.path().filename().string().rfind(".ddprun-recv.kept.", 0) == 0;
    }
    return n;
  };
  int aside_before_link = 0;
  bool aside_gone = false;
  auto serving = [&](int i) {
    std::smatch m;
    const std::string err = nodes[i]->err();
    return std::regex_search(err, m, std::regex(R"(serving at (127\.0\.0\.\d+:\d+))"))
               ? m[1].str()
               : std::string();
  };
  std::smatch m;
  const std::string reader_log = nodes[1]->err();
  const bool versioned =
      std::regex_search(reader_log, m, std::regex(R"(fetched staging\.pt version (\d+)\.(\d+):)"));
  std::smatch other_m;
  const bool other_versioned = std::regex_search(
      reader_log, other_m, std::regex(R"(fetched other\.pt version (\d+)\.(\d+):)"));
  bool renamed = false;
  if (arrived && versioned) {
    const uint64_t held = (std::stoull(m[1].str()) << 32) | std::stoull(m[2].str());
    const snapshot::SnapshotPeer reader{serving(1), "snap-rename-order", {}};
    const std::string writer = serving(0);
    snapshot::SnapshotFile gone{"staging.pt", held + 10, 0, 0};
    gone.deleted = true;
    gone.moved_to = "final.pt";
    snapshot::SnapshotFile moved{"final.pt", held + 11, content.size(),
                                 crc32Update(0, content.data(), content.size())};
    moved.moved_from = "staging.pt";
    moved.moved_from_version = held;
    REQUIRE(snapshot::announceSnapshot(reader, gone, writer, writer, 5s).isOk());
    REQUIRE(waitUntil([&] { return !fileExists(b_dir / "staging.pt"); }, 30s));
    aside_before_link = aside();
    REQUIRE(snapshot::announceSnapshot(reader, moved, writer, writer, 5s).isOk());
    renamed = waitUntil([&] { return holds("final.pt"); }, 30s);
    if (other_versioned) {
      const uint64_t other = (std::stoull(other_m[1].str()) << 32) | std::stoull(other_m[2].str());
      snapshot::SnapshotFile other_gone{"other.pt", other + 20, 0, 0};
      other_gone.deleted = true;
      other_gone.moved_to = "never.pt";
      REQUIRE(snapshot::announceSnapshot(reader, other_gone, writer, writer, 5s).isOk());
      REQUIRE(waitUntil([&] { return !fileExists(b_dir / "other.pt"); }, 30s));
      // Let go after the kept time (10 s), with nothing left behind.
      aside_gone = waitUntil([&] { return aside() == 0; }, 30s);
    }
  }
  const std::string logs = logsThenStop(nodes, triggers / "stop");
  INFO(logs);
  REQUIRE(arrived);
  REQUIRE(versioned);
  REQUIRE(other_versioned);
  CHECK(renamed);
  CHECK(aside_before_link == 1);
  CHECK(countOf(logs, "200000 bytes linked from staging.pt here (renamed on another node)") == 1);
  CHECK(logs.find("snapshot: fetched final.pt") == std::string::npos);
  CHECK(aside_gone);
  CHECK_FALSE(fileExists(b_dir / "never.pt"));
}

TEST_CASE("a checkpoint of 2000 files arrives whole, fetched a few files at a time", "[snapshot]") {
  // A sharded checkpoint (torch.distributed.checkpoint writes a file per rank and storage unit),
  // written under a temp name and renamed into place: all its files appear at once. Every file
  // arrives on the other node, with the receiving agent running a bounded number of threads (it
  // started one per fetch before: 300 and more at the peak).
  TempDir triggers, a_dir, b_dir;
  const std::string d = "\"$DDPRUN_SNAPSHOT_DIR\"";
  constexpr int kFiles = 2000;
  const std::string script =
      "if [ \"$WRITER$LOCAL_RANK\" = 10 ]; then mkdir -p " + d + "/ckpt.tmp/shards && i=0 && " +
      "while [ $i -lt " + std::to_string(kFiles) + " ]; do head -c 4096 /dev/urandom > " + d +
      "/ckpt.tmp/shards/__${i}_0.distcp; i=$((i+1)); done; mv " + d + "/ckpt.tmp " + d +
      "/ckpt; fi; while [ ! -e '" + triggers / "stop" + "' ]; do sleep 0.1; done";
  RendezvousDaemon rdzv;
  auto nodes = writerAndReader(rdzv, a_dir.path(), b_dir.path(), "snap-many", script);
  auto threadsOf = [](int pid) {
    const std::string status = readFile("/proc/" + std::to_string(pid) + "/status");
    const auto at = status.find("Threads:");
    return at == std::string::npos ? 0 : std::atoi(status.c_str() + at + 8);
  };
  int peak = 0;
  auto count = [&] {
    peak = std::max(peak, threadsOf(nodes[1]->pid()));
    std::error_code ec;
    const auto dir = std::filesystem::path(b_dir.path()) / "ckpt/shards";
    int n = 0;
    for (auto it = std::filesystem::directory_iterator(dir, ec);
         !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
      n += it->path().filename().string().rfind("__", 0) == 0 ? 1 : 0;
    }
    return n;
  };
  const bool arrived = waitUntil([&] { return count() == kFiles; }, 120s);
  const std::string logs = logsThenStop(nodes, triggers / "stop");
  INFO(logs);
  REQUIRE(arrived);
  for (int i = 0; i < kFiles; ++i) {
    const std::string name = "ckpt/shards/__" + std::to_string(i) + "_0.distcp";
    REQUIRE(readFile(b_dir / name) == readFile(a_dir / name));
  }
  INFO("the receiving agent ran " << peak << " threads at the most");
  CHECK(peak > 0);
  // At most 8 fetch and 32 other replication threads, the agent's own, and gRPC's pools, which
  // grow on a loaded host (60-61 on an idle 2-core VM, 64 once in CI beside a build); one thread
  // per fetch was 300 and more.
  CHECK(peak < 100);
}

TEST_CASE("a job that writes a new name and deletes old ones keeps only the newest 1024 deletions",
          "[snapshot]") {
  // 1100 checkpoints, each under a name of its own, then all but the last deleted: both nodes
  // delete them, and each version table records the newest 1024 deletions, not all 1099.
  constexpr int kFiles = 1100;
  TempDir a_dir, b_dir, triggers;
  const std::string d = "\"$DDPRUN_SNAPSHOT_DIR\"";
  auto wait_for = [&](const std::string& name) {
    return "while [ ! -e '" + triggers / name + "' ]; do sleep 0.1; done; ";
  };
  const std::string last = std::to_string(kFiles - 1);
  const std::string script = "if [ \"$WRITER$LOCAL_RANK\" = 10 ]; then for i in $(seq 0 " + last +
                             "); do echo $i > " + d + "/ckpt$i.tmp && mv " + d + "/ckpt$i.tmp " +
                             d + "/ckpt$i; done; " + wait_for("delete") + "for i in $(seq 0 " +
                             std::to_string(kFiles - 2) + "); do rm " + d + "/ckpt$i; done; fi; " +
                             wait_for("stop");
  RendezvousDaemon rdzv;
  auto a = node({"127.0.0.2", a_dir.path(), {{"WRITER", "1"}}}, rdzv.endpoint, "2", "snap-tombs", 1,
                writerScript(script));
  auto b = node({"127.0.0.3", b_dir.path(), {{"WRITER", "0"}}}, rdzv.endpoint, "2", "snap-tombs", 1,
                writerScript(script));
  auto files = [](const TempDir& dir) {
    int n = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
      n += e.path().filename().string().rfind("ckpt", 0) == 0 ? 1 : 0;
    }
    return n;
  };
  auto deletions = [](const TempDir& dir) {
    return countOf(readFile(dir / ".ddprun-versions"), "\tdeleted\n");
  };
  const bool copied = waitUntil([&] { return files(b_dir) == kFiles; }, 180s);
  std::ofstream(triggers / "delete") << "";
  const bool deleted = waitUntil(
      [&] {
        return files(a_dir) == 1 && files(b_dir) == 1 && deletions(a_dir) == 1024 &&
               deletions(b_dir) == 1024;
      },
      180s);
  std::ofstream(triggers / "stop") << "";
  auto ra = finish(*a, 120s), rb = finish(*b, 120s);
  INFO("tables: " << deletions(a_dir) << " and " << deletions(b_dir)
                  << " deletions; files: " << files(a_dir) << " and " << files(b_dir) << "\n"
                  << a->err().substr(0, 3000) << b->err().substr(0, 3000));
  REQUIRE(copied);
  REQUIRE(deleted);
  REQUIRE(ra);
  REQUIRE(rb);
  CHECK(ra->exit_code == 0);
  CHECK(rb->exit_code == 0);
  CHECK(readFile(b_dir / ("ckpt" + last)) == last + "\n");
  // The oldest deletions were forgotten, the newest kept.
  const std::string table = readFile(b_dir / ".ddprun-versions");
  CHECK(table.find("ckpt0\t") == std::string::npos);
  CHECK(table.find("ckpt" + std::to_string(kFiles - 2) + "\t") != std::string::npos);
}

namespace {

// Four nodes of one job on 127.0.0.10-13, each replicating a directory of its own. The first
// node's worker writes data.bin (2 MiB of random bytes); every worker runs until stop().
struct FourNodes {
  FourNodes() {
    for (int i = 0; i < 4; ++i) dirs.push_back(std::make_unique<TempDir>());
  }
  // `env(i)`: node i's environment besides WRITER.
  void start(const std::string& run_id,
             const std::function<std::map<std::string, std::string>(int)>& env,
             const std::vector<std::string>& flags = {}) {
    const std::string d = "\"$DDPRUN_SNAPSHOT_DIR\"";
    const std::string script =
        "if [ \"$WRITER$LOCAL_RANK\" = 10 ]; then head -c 2097152 /dev/urandom > " + d +
        "/data.bin.tmp && mv " + d + "/data.bin.tmp " + d +
        "/data.bin; fi; "
        "while [ ! -e '" +
        stop_dir / "now" + "' ]; do sleep 0.1; done";
    for (int i = 0; i < 4; ++i) {
      auto e = env(i);
      e["WRITER"] = i == 0 ? "1" : "0";
      nodes.push_back(node({"127.0.0.1" + std::to_string(i), dirs[i]->path(), e, flags},
                           rdzv.endpoint, "4", run_id, 1, writerScript(script)));
    }
  }
  // Every node holds the 2 MiB the writer wrote.
  bool everywhere() const {
    const std::string written = *dirs[0] / "data.bin";
    if (!fileExists(written)) return false;
    const std::string want = readFile(written);
    for (const auto& dir : dirs) {
      if (readFile(*dir / "data.bin") != want) return false;
    }
    return want.size() == 2097152;
  }
  // Where node i fetched data.bin from ("127.0.0.X"), once it logged the fetch.
  std::string fetchedFrom(int i) const {
    std::smatch m;
    const std::string err = nodes[i]->err();
    if (!std::regex_search(err, m,
                           std::regex(R"(fetched data.bin version \S+: 2097152 bytes )"
                                      R"(from (127\.0\.0\.\d+):\d+ in [0-9.]+ s)"))) {
      return "";
    }
    return m[1];
  }
  // Every node's log, for a failure's report.
  std::string logs() const {
    std::string all;
    for (size_t i = 0; i < nodes.size(); ++i) {
      all += "--- node " + std::to_string(i) + ":\n" + nodes[i]->err();
    }
    return all;
  }
  void stop() {
    std::ofstream(stop_dir / "now") << "";
    for (auto& n : nodes) {
      auto r = n->wait(120s);
      REQUIRE(r);
      CHECK(r->exit_code == 0);
    }
  }
  RendezvousDaemon rdzv;
  TempDir stop_dir;
  std::vector<std::unique_ptr<TempDir>> dirs;
  std::vector<std::unique_ptr<Process>> nodes;
};

}  // namespace

TEST_CASE("with four nodes a version travels a chain and /metrics counts what arrived",
          "[snapshot]") {
  FourNodes job;
  auto& dirs = job.dirs;
  for (int i = 0; i < 4; ++i) {
    // A partial copy left by an agent that crashed mid-transfer is removed at start.
    std::ofstream(*dirs[i] / ".ddprun-recv.data.bin.1.2") << "partial";
  }
  // A file one node had before the job (version 0) reaches the others before the workers start.
  std::ofstream(*dirs[3] / "old.bin") << "from before";
  job.start("snap-tree", [](int) { return std::map<std::string, std::string>{}; },
            {"--metrics-port=0"});
  const bool everywhere = waitUntil([&] { return job.everywhere(); }, 120s);
  INFO(job.logs());
  REQUIRE(everywhere);
  // Every receiver logged its fetch. The four nodes form a chain from the writer: one fetched
  // from the writer, two from a relay that passed the version on as it arrived, before its own
  // copy was complete.
  int from_writer = 0, from_relay = 0, relays = 0;
  for (int i = 1; i < 4; ++i) {
    REQUIRE(waitUntil([&] { return !job.fetchedFrom(i).empty(); }, 30s));
    (job.fetchedFrom(i) == "127.0.0.10" ? from_writer : from_relay) += 1;
    const std::string err = job.nodes[i]->err();
    const auto passed = err.find("snapshot: passing data.bin version");
    if (passed != std::string::npos) {
      ++relays;
      CHECK(passed < err.find("snapshot: fetched data.bin"));
    }
  }
  CHECK(from_writer == 1);
  CHECK(from_relay == 2);
  CHECK(relays == 2);
  for (int i = 0; i < 4; ++i) {
    CHECK(readFile(*dirs[i] / "old.bin") == "from before");
    CHECK_FALSE(fileExists(*dirs[i] / ".ddprun-recv.data.bin.1.2"));
    if (i < 3) {
      const std::string err = job.nodes[i]->err();
      CHECK(err.find("snapshot: fetched old.bin version 0.0") < err.find("started 1 worker(s)"));
    }
  }
  // /metrics of a receiver.
  std::smatch m;
  const std::string err = job.nodes[1]->err();
  REQUIRE(
      std::regex_search(err, m, std::regex(R"(metrics on http://127\.0\.0\.11:(\d+)/metrics)")));
  const std::string metrics =
      run({torchPython(), "-c",
           "import urllib.request\nprint(urllib.request.urlopen('http://127.0.0.11:" + m[1].str() +
               "/metrics',timeout=10).read().decode())"})
          .out;
  INFO(metrics);
  CHECK(metrics.find("ddprun_snapshot_versions_replicated_total 2\n") != std::string::npos);
  CHECK(metrics.find("ddprun_snapshot_bytes_replicated_total 2097163\n") != std::string::npos);
  CHECK(metrics.find("ddprun_snapshot_transfer_failures_total 0\n") != std::string::npos);
  CHECK(metrics.find("ddprun_snapshot_replication_lag_seconds ") != std::string::npos);
  job.stop();
}

TEST_CASE(
    "a version a relay passes on as it arrives, corrupted on the way down, is rejected and "
    "fetched again",
    "[snapshot]") {
  FourNodes job;
  // Every node but the writer damages the first chunk it serves: the two relays of the chain.
  job.start("snap-relay-corrupt", [](int i) {
    return i == 0 ? std::map<std::string, std::string>{}
                  : std::map<std::string, std::string>{{"DDPRUN_SNAPSHOT_FAULT", "in-flight:1"}};
  });
  const bool everywhere = waitUntil([&] { return job.everywhere(); }, 120s);
  INFO(job.logs());
  REQUIRE(everywhere);
  int relayed = 0;
  for (int i = 1; i < 4; ++i) {
    REQUIRE(waitUntil([&] { return !job.fetchedFrom(i).empty(); }, 30s));
    if (job.fetchedFrom(i) == "127.0.0.10") continue;
    ++relayed;  // a node below a relay: its first copy failed its check, the next arrived
    const std::string err = job.nodes[i]->err();
    INFO(err);
    CHECK(err.find("fails its CRC-32 (corrupted in flight)") < err.find("snapshot: fetched"));
  }
  CHECK(relayed == 2);
  job.stop();
}

TEST_CASE("a node that does not take an announcement is stepped over, and told again later",
          "[snapshot]") {
  // Three nodes. The agent after the writer in the chain is stopped (SIGSTOP) when the version is
  // written: it neither answers nor leaves the round (a minute of heartbeats may be missed). The
  // node after it must not wait for the next round: the writer tells it instead. Once the stopped
  // agent runs again, it is told too, in the same round. Then a directory of 200 files is renamed
  // into place while it is stopped: the later announcements step over it without trying it, and
  // it is told of them all once it runs again.
  TempDir go;
  RendezvousDaemon rdzv;
  std::vector<std::unique_ptr<TempDir>> dirs;
  std::vector<std::unique_ptr<Process>> nodes;
  const std::string d = "\"$DDPRUN_SNAPSHOT_DIR\"";
  const std::string script =
      "if [ \"$WRITER\" = 1 ]; then while [ ! -e '" + go / "write" +
      "' ]; do sleep 0.05; done; head -c 1048576 /dev/urandom > " + d + "/data.bin.tmp && mv " + d +
      "/data.bin.tmp " + d + "/data.bin; while [ ! -e '" + go / "many" +
      "' ]; do sleep 0.05; done; mkdir " + d + "/many.tmp && for i in $(seq " +
      "200); do echo $i > " + d + "/many.tmp/$i; done && mv " + d + "/many.tmp " + d +
      "/many; fi; while [ ! -e '" + go / "stop" + "' ]; do sleep 0.1; done";
  for (int i = 0; i < 3; ++i) {
    dirs.push_back(std::make_unique<TempDir>());
    NodeSpec spec("127.0.0.3" + std::to_string(i), dirs[i]->path(),
                  {{"WRITER", i == 0 ? "1" : "0"}});
    spec.heartbeat = "heartbeat_interval=1,heartbeat_misses=60";
    nodes.push_back(node(spec, rdzv.endpoint, "3", "snap-step-over", 1, writerScript(script)));
  }
  std::vector<int> ranks(3, -1);
  REQUIRE(waitUntil(
      [&] {
        for (int i = 0; i < 3; ++i) {
          std::smatch m;
          const std::string err = nodes[i]->err();
          if (!std::regex_search(err, m, std::regex(R"(round 1: group rank (\d) of 3)")) ||
              err.find("started 1 worker(s)") == std::string::npos) {
            return false;
          }
          ranks[i] = std::stoi(m[1]);
        }
        return true;
      },
      120s));
  const int next =
      static_cast<int>(std::find(ranks.begin(), ranks.end(), (ranks[0] + 1) % 3) - ranks.begin());
  const int last = 3 - next;  // the nodes are 0 (the writer), 1 and 2
  nodes[next]->signal(SIGSTOP);
  std::ofstream(go / "write") << "";
  auto holds = [&](int i) {
    const std::string written = readFile(*dirs[0] / "data.bin");
    return written.size() == 1048576 && readFile(*dirs[i] / "data.bin") == written;
  };
  const bool last_has_it = waitUntil([&] { return holds(last); }, 30s);
  // The file is renamed into place before its fetch is logged, and the writer logs the node it
  // stepped over once its announcements are done: both lines follow at once, in either order.
  if (last_has_it) {
    waitUntil(
        [&] {
          return nodes[last]->err().find("snapshot: fetched data.bin") != std::string::npos &&
                 nodes[0]->err().find("told the next node of the chain") != std::string::npos;
        },
        10s);
  }
  const std::string writer_log = nodes[0]->err();
  const std::string last_log = nodes[last]->err();
  nodes[next]->signal(SIGCONT);
  const bool next_has_it = waitUntil([&] { return holds(next); }, 30s);
  auto holds_many = [&](int i) {
    for (int k = 1; k <= 200; ++k) {
      if (readFile(*dirs[i] / ("many/" + std::to_string(k))) != std::to_string(k) + "\n") {
        return false;
      }
    }
    return true;
  };
  nodes[next]->signal(SIGSTOP);
  std::ofstream(go / "many") << "";
  const bool last_has_many = waitUntil([&] { return holds_many(last); }, 60s);
  nodes[next]->signal(SIGCONT);
  const bool next_has_many = waitUntil([&] { return holds_many(next); }, 60s);
  const std::string logs = logsThenStop(nodes, go / "stop");
  INFO(logs);
  CHECK(last_has_it);
  CHECK(last_log.find("from 127.0.0.30:") != std::string::npos);  // the writer told it
  CHECK(writer_log.find("told the next node of the chain") != std::string::npos);
  CHECK(next_has_it);
  CHECK(last_has_many);
  CHECK(next_has_many);
  CHECK(logs.find("round 2") == std::string::npos);
}

TEST_CASE("an agent started under a low open-file limit replicates more files than it",
          "[snapshot]") {
  // The agent keeps one descriptor per replicated name: under a soft limit of 128 it raises the
  // limit to the hard one and all 300 files arrive; where the hard limit is 128 too, the files
  // it cannot open are named in a warning that says what to raise, and the job goes on.
  const std::string d = "\"$DDPRUN_SNAPSHOT_DIR\"";
  const std::string script =
      "if [ \"$WRITER$LOCAL_RANK\" = 10 ]; then for i in $(seq 1 300); do "
      "echo $i > " +
      d + "/f$i.tmp && mv " + d + "/f$i.tmp " + d + "/f$i; done; fi; sleep 4";
  auto files = [](const TempDir& dir) {
    int n = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
      n += e.path().filename().string()[0] == 'f' ? 1 : 0;
    }
    return n;
  };
  for (const std::string limit : {"-Sn 128", "-n 128"}) {
    INFO("ulimit " << limit);
    RendezvousDaemon rdzv;
    TempDir a_dir, b_dir;
    NodeSpec writer{"127.0.0.2", a_dir.path(), {{"WRITER", "1"}}};
    writer.ulimit = limit;
    auto a = node(writer, rdzv.endpoint, "2", "snap-nofile", 1, writerScript(script));
    auto b = node({"127.0.0.3", b_dir.path(), {{"WRITER", "0"}}}, rdzv.endpoint, "2", "snap-nofile",
                  1, writerScript(script));
    auto [ra, rb] = bothSucceed(*a, *b);
    INFO(ra.err.substr(0, 4000));
    CHECK(files(a_dir) == 300);
    if (limit == "-Sn 128") {
      CHECK(files(b_dir) == 300);
      CHECK(ra.err.find("is not replicated") == std::string::npos);
    } else {
      CHECK(files(b_dir) < 300);
      CHECK(countOf(ra.err, "is not replicated") == 5);
      CHECK(ra.err.find("Too many open files (the agent keeps one open file per replicated name; "
                        "its limit is 128: raise the hard limit, ulimit -Hn); ") !=
            std::string::npos);
      CHECK(ra.err.find("(further such warnings: not logged)") != std::string::npos);
    }
  }
}

TEST_CASE("over TLS the nodes replicate with the rendezvous' token and certificates",
          "[snapshot][tls]") {
  // Each node's replication service serves TLS with the job's certificate (valid for every
  // node's address) and requires the token; the rendezvous daemon too.
  TempDir pki_dir, a_dir, b_dir;
  TestPki pki(pki_dir, {"127.0.0.1", "127.0.0.2", "127.0.0.3"});
  if (!pki.ok) {
    WARN("skipped: " + pki.why);
    return;
  }
  const std::string token = pki_dir / "token";
  std::ofstream(token) << "snapshot-tls\n";
  RendezvousDaemon rdzv({"--tls-cert", pki.cert, "--tls-key", pki.key, "--token-file", token});
  const std::string tls =
      "token_file=" + token + ",tls_ca=" + pki.ca + ",tls_cert=" + pki.cert + ",tls_key=" + pki.key;
  const std::string d = "\"$DDPRUN_SNAPSHOT_DIR\"";
  const std::string script =
      "if [ \"$WRITER$LOCAL_RANK\" = 10 ]; then head -c 3000000 "
      "/dev/urandom > " +
      d + "/data.bin.tmp && mv " + d + "/data.bin.tmp " + d + "/data.bin; fi; sleep 3";
  auto a = node({"127.0.0.2", a_dir.path(), {{"WRITER", "1"}}, {}, tls}, rdzv.endpoint, "2",
                "snap-tls", 1, writerScript(script));
  auto b = node({"127.0.0.3", b_dir.path(), {{"WRITER", "0"}}, {}, tls}, rdzv.endpoint, "2",
                "snap-tls", 1, writerScript(script));
  auto [ra, rb] = bothSucceed(*a, *b);
  INFO(ra.err << "\n" << rb.err);
  CHECK(std::regex_search(ra.err, std::regex(R"(serving at 127\.0\.0\.2:\d+ \(TLS\))")));
  CHECK(std::regex_search(
      rb.err, std::regex(R"(fetched data.bin version \S+: 3000000 bytes from 127\.0\.0\.2:\d+)")));
  CHECK(readFile(b_dir / "data.bin") == readFile(a_dir / "data.bin"));
  CHECK(readFile(b_dir / "data.bin").size() == 3000000);

  // A node that trusts the CA but has no certificate of its own cannot serve TLS: a usage error
  // before anything starts.
  auto c = node({"127.0.0.4", b_dir.path(), {}, {}, "token_file=" + token + ",tls_ca=" + pki.ca},
                rdzv.endpoint, "2", "snap-tls-2", 1, writerScript("true"));
  auto rc = finish(*c, 30s);
  REQUIRE(rc);
  CHECK(rc->exit_code == 2);
  CHECK(rc->err.find("--snapshot-dir with TLS (tls_ca= in --rdzv-conf) needs tls_cert= and "
                     "tls_key=") != std::string::npos);
}

TEST_CASE("a missing or unwritable --snapshot-dir is a usage error before anything starts",
          "[snapshot]") {
  TempDir dir;
  auto r = run({ddprunBin(), "--standalone", "--snapshot-dir=" + dir / "missing", "--no-python",
                "/bin/true"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--snapshot-dir: " + dir / "missing" + " does not exist") != std::string::npos);
  std::ofstream(dir / "file") << "x";
  r = run(
      {ddprunBin(), "--standalone", "--snapshot-dir=" + dir / "file", "--no-python", "/bin/true"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("is no directory") != std::string::npos);
}

TEST_CASE("a bad DDPRUN_SNAPSHOT_STREAMS is a usage error naming the variable", "[snapshot]") {
  TempDir dir;
  for (const std::string bad : {"0", "17", "two", "-1", "2x"}) {
    CAPTURE(bad);
    auto r = run({ddprunBin(), "--nnodes=1:2", "--rdzv-backend=c10d",
                  "--rdzv-endpoint=127.0.0.1:" + std::to_string(freePort()), "--rdzv-id=streams",
                  "--snapshot-dir=" + dir.path(), "--snapshot-allow-unauthenticated", "--no-python",
                  "/bin/true"},
                 {{"DDPRUN_SNAPSHOT_STREAMS", bad}});
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("DDPRUN_SNAPSHOT_STREAMS: '" + bad + "' is not a whole number from 1 to 16") !=
          std::string::npos);
  }
  auto r = run({ddprunBin(), "--nnodes=1:2", "--rdzv-backend=c10d",
                "--rdzv-endpoint=127.0.0.1:" + std::to_string(freePort()), "--rdzv-id=streams",
                "--rdzv-conf=last_call_timeout=0", "--snapshot-dir=" + dir.path(),
                "--snapshot-allow-unauthenticated", "--no-python", "/bin/true"},
               {{"DDPRUN_SNAPSHOT_STREAMS", "4"}});
  CHECK(r.exit_code == 0);
}
