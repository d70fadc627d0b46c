// The etcd-v3 rendezvous backend (EtcdRendezvousService) against a real etcd started on loopback
// ports: the rendezvous behaviour cases the gRPC backend passes (formation at MIN and MAX, last
// call, scale-up, spares, a dead node, leave, close, stable ranks, one round per failure), plus
// the errors users meet (an unreachable member, failover between members). Each agent is one
// service on the test's io_context; the test thread runs the loop until what it waits for came.
#include "ddprun/etcd/rendezvous_service.h"

#include <boost/asio/io_context.hpp>
#include <catch2/catch.hpp>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>

#include "etcd_cluster.h"
#include "fake_etcd2.h"
#include "http_probe.h"

using namespace ddprun;
using namespace ddprun::etcd;
using ddprun::testing::EtcdCluster;

namespace {

#define REQUIRE_ETCD()                                                                      \
  do {                                                                                      \
    if (!ddprun::testing::etcdAvailable()) {                                                \
      WARN("SKIPPED: " + ddprun::testing::etcdBinary() +                                    \
           " is absent (apt-get install etcd-server etcd-client; deploy/install-deps.sh)"); \
      return;                                                                               \
    }                                                                                       \
  } while (0)

struct Agent;

class Job {
 public:
  Job(const std::string& endpoints, uint32_t min, uint32_t max, Duration last_call)
      : endpoints_(endpoints) {
    config_.min_nodes = min;
    config_.max_nodes = max;
    config_.last_call_timeout = last_call;
    config_.heartbeat_interval = std::chrono::milliseconds(500);
    config_.heartbeat_misses = 3;
    static int counter = 0;
    run_id_ = "test-run-" + std::to_string(::getpid()) + "-" + std::to_string(++counter);
  }

  std::unique_ptr<EtcdRendezvousService> service(Duration connect_for = std::chrono::seconds(30)) {
    EtcdServiceOptions o = options;
    o.run_id = run_id_;
    o.endpoints = endpoints_;
    o.run_config = config_;
    o.rpc_timeout = std::chrono::seconds(2);
    o.connect_for = connect_for;
    return std::make_unique<EtcdRendezvousService>(io, std::move(o));
  }
  // TLS and auth settings every service of the job gets.
  EtcdServiceOptions options;

  rendezvous::JoinRequest request(const std::string& node_id = "") const {
    rendezvous::JoinRequest r;
    r.run_id = run_id_;
    r.node_id = node_id;
    r.address = "127.0.0.1";
    r.local_world_size = 2;
    r.config = config_;
    r.join_timeout = std::chrono::seconds(60);
    return r;
  }

  // Runs the loop until `pred` holds (bounded); true when it did.
  bool runUntil(const std::function<bool()>& pred, Duration bound = std::chrono::seconds(30)) {
    const auto deadline = std::chrono::steady_clock::now() + bound;
    while (!pred()) {
      if (std::chrono::steady_clock::now() >= deadline) return false;
      io.restart();
      io.run_for(std::chrono::milliseconds(5));
    }
    return true;
  }

  boost::asio::io_context io;
  const std::string& runId() const { return run_id_; }

 private:
  std::string endpoints_;
  std::string run_id_;
  rendezvous::RunConfig config_;
};

// One agent: its service, its last join's answer and the changes it was pushed.
struct Agent {
  explicit Agent(Job& job) : job(job), service(job.service()) {
    service->watch("", [this](const rendezvous::RoundChange& c) { changes.push_back(c); });
  }
  void join(const std::string& node_id = "") {
    result.reset();
    service->join(job.request(node_id.empty() && info ? info->node_id : node_id),
                  [this](StatusOr<rendezvous::RoundInfo> r) {
                    result = r;
                    if (r.isOk()) info = r.value();
                  });
  }
  bool done() const { return result.has_value(); }
  int countChanges(rendezvous::ChangeKind kind, rendezvous::ChangeReason reason) const {
    int n = 0;
    for (const auto& c : changes) n += c.kind == kind && c.reason == reason ? 1 : 0;
    return n;
  }
  Job& job;
  std::unique_ptr<EtcdRendezvousService> service;
  std::optional<StatusOr<rendezvous::RoundInfo>> result;
  std::optional<rendezvous::RoundInfo> info;
  std::vector<rendezvous::RoundChange> changes;
};

bool allDone(const std::vector<Agent*>& agents) {
  for (Agent* a : agents) {
    if (!a->done()) return false;
  }
  return true;
}

// Every agent joins, then the loop runs until each has its answer; true when all did in time.
bool joinAll(Job& job, const std::vector<Agent*>& agents,
             Duration bound = std::chrono::seconds(30)) {
  for (Agent* a : agents) a->join();
  return job.runUntil([&] { return allDone(agents); }, bound);
}

}  // namespace

TEST_CASE("etcd-v3: a round forms at once at MAX", "[etcd]") {
  REQUIRE_ETCD();
  EtcdCluster etcd;
  Job job(etcd.endpoints(), 2, 3, std::chrono::seconds(600));
  Agent a(job), b(job), c(job);
  REQUIRE(joinAll(job, {&a, &b, &c}));
  std::set<uint32_t> ranks;
  for (Agent* x : {&a, &b, &c}) {
    REQUIRE(x->result->isOk());
    CHECK(x->info->round == 1);
    CHECK(x->info->group_world_size == 3);
    CHECK(x->info->world_size == 6);
    CHECK(x->info->base_rank == 2 * x->info->group_rank);
    ranks.insert(x->info->group_rank);
  }
  CHECK(ranks == std::set<uint32_t>{0, 1, 2});
}

TEST_CASE("etcd-v3: at MIN the round waits for the last call", "[etcd]") {
  REQUIRE_ETCD();
  EtcdCluster etcd;
  Job job(etcd.endpoints(), 2, 4, std::chrono::milliseconds(800));
  Agent a(job);
  a.join();
  // Alone below MIN: no round, however long (bounded here by a short run of the loop).
  job.runUntil([] { return false; }, std::chrono::milliseconds(1200));
  CHECK_FALSE(a.done());
  Agent b(job);
  b.join();
  const auto start = std::chrono::steady_clock::now();
  REQUIRE(job.runUntil([&] { return allDone({&a, &b}); }));
  // Completed by the last call (applied by whichever agent's timer fired first), not at once.
  CHECK(std::chrono::steady_clock::now() - start >= std::chrono::milliseconds(700));
  REQUIRE(a.result->isOk());
  REQUIRE(b.result->isOk());
  CHECK(a.info->group_world_size == 2);
  CHECK(a.info->round == b.info->round);
}

TEST_CASE("etcd-v3: scale-up re-forms with stable ranks", "[etcd]") {
  REQUIRE_ETCD();
  EtcdCluster etcd;
  Job job(etcd.endpoints(), 2, 3, std::chrono::milliseconds(300));
  Agent a(job), b(job);
  REQUIRE(joinAll(job, {&a, &b}));
  REQUIRE(a.result->isOk());
  const uint32_t rank_a = a.info->group_rank, rank_b = b.info->group_rank;
  Agent c(job);
  c.join();
  // The participants are pushed a pending round (a node joined) and re-join it.
  REQUIRE(job.runUntil([&] {
    return a.countChanges(rendezvous::ChangeKind::kRoundPending,
                          rendezvous::ChangeReason::kNodeJoined) == 1 &&
           b.countChanges(rendezvous::ChangeKind::kRoundPending,
                          rendezvous::ChangeReason::kNodeJoined) == 1;
  }));
  a.join();
  b.join();
  REQUIRE(job.runUntil([&] { return allDone({&a, &b, &c}); }));
  REQUIRE(c.result->isOk());
  CHECK(a.info->round == 2);
  CHECK(c.info->round == 2);
  CHECK(a.info->group_world_size == 3);
  CHECK(a.info->group_rank == rank_a);
  CHECK(b.info->group_rank == rank_b);
  CHECK(c.info->group_rank == 2);
}

TEST_CASE("etcd-v3: a node beyond MAX waits as a spare", "[etcd]") {
  REQUIRE_ETCD();
  EtcdCluster etcd;
  Job job(etcd.endpoints(), 1, 2, std::chrono::milliseconds(200));
  Agent a(job), b(job);
  REQUIRE(joinAll(job, {&a, &b}));
  REQUIRE(a.result->isOk());
  Agent spare(job);
  spare.join();
  job.runUntil([] { return false; }, std::chrono::milliseconds(800));
  CHECK_FALSE(spare.done());  // room is taken: no new round
  CHECK(a.countChanges(rendezvous::ChangeKind::kRoundPending,
                       rendezvous::ChangeReason::kNodeJoined) == 0);
  // A participant leaves: the spare is promoted into the next round.
  Agent& leaver = a.info->group_rank == 0 ? b : a;
  Agent& stayer = a.info->group_rank == 0 ? a : b;
  bool left = false;
  leaver.service->leave(leaver.info->node_id, {}, [&](Status st) { left = st.isOk(); });
  REQUIRE(job.runUntil([&] {
    return left && stayer.countChanges(rendezvous::ChangeKind::kRoundPending,
                                       rendezvous::ChangeReason::kNodeLeft) == 1;
  }));
  stayer.join();
  REQUIRE(job.runUntil([&] { return allDone({&stayer, &spare}); }));
  REQUIRE(spare.result->isOk());
  CHECK(stayer.info->round == 2);
  CHECK(stayer.info->group_rank == 0);  // rank 0 stays where its node stays
  CHECK(spare.info->group_rank == 1);
}

TEST_CASE("etcd-v3: a dead node opens a round for the survivors", "[etcd]") {
  REQUIRE_ETCD();
  EtcdCluster etcd;
  Job job(etcd.endpoints(), 1, 2, std::chrono::milliseconds(200));
  Agent a(job);
  auto b = std::make_unique<Agent>(job);
  a.join();
  b->join();
  REQUIRE(job.runUntil([&] { return a.done() && b->done(); }));
  REQUIRE(a.result->isOk());
  // b's agent goes away without leaving: its lease ends, etcd deletes its alive key, and the
  // survivor declares it dead.
  b.reset();
  REQUIRE(job.runUntil([&] {
    return a.countChanges(rendezvous::ChangeKind::kRoundPending,
                          rendezvous::ChangeReason::kNodeDead) == 1;
  }));
  a.join();
  REQUIRE(job.runUntil([&] { return a.done(); }));
  REQUIRE(a.result->isOk());
  CHECK(a.info->round == 2);
  CHECK(a.info->group_world_size == 1);
  CHECK(a.info->group_rank == 0);
}

TEST_CASE("etcd-v3: failure reports of one round cost one round", "[etcd]") {
  REQUIRE_ETCD();
  EtcdCluster etcd;
  Job job(etcd.endpoints(), 2, 2, std::chrono::milliseconds(200));
  Agent a(job), b(job);
  REQUIRE(joinAll(job, {&a, &b}));
  REQUIRE(a.result->isOk());
  std::optional<StatusOr<uint64_t>> ra, rb;
  a.service->reportFailure(a.info->node_id, 1, rendezvous::FailureKind::kWorkers,
                           [&](StatusOr<uint64_t> r) { ra = r; });
  b.service->reportFailure(b.info->node_id, 1, rendezvous::FailureKind::kWorkers,
                           [&](StatusOr<uint64_t> r) { rb = r; });
  REQUIRE(job.runUntil([&] { return ra && rb; }));
  REQUIRE(ra->isOk());
  REQUIRE(rb->isOk());
  CHECK(ra->value() == 2);
  CHECK(rb->value() == 2);
  REQUIRE(job.runUntil([&] {
    return a.countChanges(rendezvous::ChangeKind::kRoundPending,
                          rendezvous::ChangeReason::kFailureReported) >= 1;
  }));
  job.runUntil([] { return false; }, std::chrono::milliseconds(300));
  CHECK(a.countChanges(rendezvous::ChangeKind::kRoundPending,
                       rendezvous::ChangeReason::kFailureReported) == 1);
  REQUIRE(joinAll(job, {&a, &b}));
  CHECK(a.info->round == 2);
}

// After an etcd outage longer than the lease's TTL, a transaction that puts an alive key may come
// before the keeper notices that the lease is gone: it is written under a fresh lease, not failed
// with etcd's "requested lease not found" (which ended the agent).
TEST_CASE("etcd-v3: a join under a lease etcd no longer has is made under a fresh one", "[etcd]") {
  REQUIRE_ETCD();
  EtcdCluster etcd;
  Job job(etcd.endpoints(), 1, 1, std::chrono::milliseconds(200));
  Agent a(job);
  REQUIRE(joinAll(job, {&a}));
  REQUIRE(a.result->isOk());
  auto leases = [&] {
    auto listed = etcd.etcdctl({"lease", "list"});
    std::vector<std::string> ids;
    std::istringstream in(listed.out);
    for (std::string line; std::getline(in, line);) {
      if (!line.empty() && line.find(' ') == std::string::npos) ids.push_back(line);
    }
    return ids;
  };
  const std::vector<std::string> before = leases();
  REQUIRE(before.size() == 1);
  // etcd loses the lease (as when it expired while etcd was down); the agent re-joins at once,
  // well within the keeper's period (a quarter of the TTL).
  REQUIRE(etcd.etcdctl({"lease", "revoke", before[0]}).exit_code == 0);
  a.join();
  REQUIRE(job.runUntil([&] { return a.done(); }));
  INFO(a.result->status().toString());
  REQUIRE(a.result->isOk());
  const std::vector<std::string> after = leases();
  REQUIRE(after.size() == 1);
  CHECK(after[0] != before[0]);
  auto alive = etcd.etcdctl({"get", "--prefix", "--keys-only", "/ddprun/rdzv/"});
  CHECK_THAT(alive.out, Catch::Contains("/alive/" + a.info->node_id));
}

TEST_CASE("etcd-v3: master address, key-value store and close", "[etcd]") {
  REQUIRE_ETCD();
  EtcdCluster etcd;
  Job job(etcd.endpoints(), 2, 2, std::chrono::milliseconds(200));
  Agent a(job), b(job);
  REQUIRE(joinAll(job, {&a, &b}));
  Agent& rank0 = a.info->group_rank == 0 ? a : b;
  Agent& rank1 = a.info->group_rank == 0 ? b : a;
  std::optional<StatusOr<rendezvous::MasterAddress>> master;
  rank1.service->waitMaster(1, std::chrono::seconds(20),
                            [&](StatusOr<rendezvous::MasterAddress> m) { master = m; });
  std::optional<Status> published;
  rank0.service->publishMaster(rank0.info->node_id, 1, {"127.0.0.1", 29555},
                               [&](Status st) { published = st; });
  REQUIRE(job.runUntil([&] { return master && published; }));
  REQUIRE(published->isOk());
  REQUIRE(master->isOk());
  CHECK(master->value().port == 29555);
  // Only the rank 0 of the round may publish.
  std::optional<Status> refused;
  rank1.service->publishMaster(rank1.info->node_id, 1, {"127.0.0.1", 1},
                               [&](Status st) { refused = st; });
  REQUIRE(job.runUntil([&] { return refused.has_value(); }));
  CHECK_FALSE(refused->isOk());

  std::optional<StatusOr<std::vector<std::string>>> values;
  a.service->kvWait({"x", "y"}, std::chrono::seconds(20), {},
                    [&](StatusOr<std::vector<std::string>> v) { values = v; });
  int set = 0;
  b.service->kvSet("x", "1", {}, [&](Status st) { set += st.isOk(); });
  b.service->kvSet("y", "2", {}, [&](Status st) { set += st.isOk(); });
  REQUIRE(job.runUntil([&] { return values.has_value() && set == 2; }));
  REQUIRE(values->isOk());
  CHECK(values->value() == std::vector<std::string>{"1", "2"});
  std::optional<StatusOr<std::vector<std::string>>> timed_out;
  a.service->kvWait({"never"}, std::chrono::milliseconds(300), {},
                    [&](StatusOr<std::vector<std::string>> v) { timed_out = v; });
  REQUIRE(job.runUntil([&] { return timed_out.has_value(); }));
  CHECK(timed_out->status().code() == StatusCode::kDeadlineExceeded);

  // A range delete removes the keys in [from, to) and no other, from every agent's mirror.
  b.service->kvSet("r/1", "1", {}, [&](Status st) { set += st.isOk(); });
  b.service->kvSet("r/2", "2", {}, [&](Status st) { set += st.isOk(); });
  REQUIRE(job.runUntil([&] { return set == 4 && a.service->mirroredKv().first == 4; }));
  std::optional<Status> ranged, empty;
  b.service->kvDeleteRange("r/", "r/2", {}, [&](Status st) { ranged = st; });
  b.service->kvDeleteRange("r/2", "r/", {}, [&](Status st) { empty = st; });
  REQUIRE(job.runUntil([&] { return ranged && empty && a.service->mirroredKv().first == 3; }));
  CHECK(ranged->isOk());
  CHECK(empty->code() == StatusCode::kInvalidArgument);
  std::optional<StatusOr<std::vector<std::string>>> kept, deleted;
  a.service->kvWait({"x", "y", "r/2"}, std::chrono::seconds(5), {},
                    [&](StatusOr<std::vector<std::string>> v) { kept = v; });
  a.service->kvWait({"r/1"}, std::chrono::milliseconds(300), {},
                    [&](StatusOr<std::vector<std::string>> v) { deleted = v; });
  REQUIRE(job.runUntil([&] { return kept && deleted; }));
  CHECK(kept->value() == std::vector<std::string>{"1", "2", "2"});
  CHECK(deleted->status().code() == StatusCode::kDeadlineExceeded);

  std::optional<Status> closed;
  a.service->close({}, [&](Status st) { closed = st; });
  REQUIRE(job.runUntil([&] {
    return closed &&
           b.countChanges(rendezvous::ChangeKind::kClosed, rendezvous::ChangeReason::kNone) >= 1;
  }));
  REQUIRE(closed->isOk());
  Agent late(job);
  late.join();
  REQUIRE(job.runUntil([&] { return late.done(); }));
  CHECK(late.result->status().code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(late.result->status().message(), Catch::Contains("closed"));
}

// The most memory this process has held (VmHWM), in KiB.
long peakRssKb() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stol(line.substr(6));
  }
  return 0;
}

TEST_CASE("etcd-v3: a stored state that claims a huge snapshot is one error, not 1 GiB", "[etcd]") {
  REQUIRE_ETCD();
  EtcdCluster etcd;
  Job job(etcd.endpoints(), 1, 1, std::chrono::milliseconds(200));
  // The 46-byte value of issue 34 (etcdctl put), which took every agent from 19 MB to 1.07 GB.
  REQUIRE(etcd.etcdctl(
                  {"put", "/ddprun/rdzv/" + job.runId() + "/state", "v3;-;0:0:z1073741824:garbage"})
              .exit_code == 0);
  const long before = peakRssKb();
  Agent a(job);
  a.join();
  REQUIRE(job.runUntil([&] { return a.done(); }));
  REQUIRE_FALSE(a.result->isOk());
  CHECK_THAT(a.result->status().message(),
             Catch::Contains("says its snapshot inflates to 1073741824 bytes, more than the"));
  CHECK(peakRssKb() - before < 128 * 1024);
}

TEST_CASE("etcd-v3: an etcd restarted on an empty data directory is noticed and the run re-forms",
          "[etcd]") {
  // The watch resumed at a revision the new store never reaches: every change after the restart
  // went unseen, and the nodes waited out the whole exit barrier.
  REQUIRE_ETCD();
  EtcdCluster etcd;
  Job job(etcd.endpoints(), 2, 2, std::chrono::milliseconds(200));
  Agent a(job), b(job);
  REQUIRE(joinAll(job, {&a, &b}));
  REQUIRE(a.result->isOk());
  int set = 0;
  for (int i = 0; i < 40; ++i) {  // the old store's revision well above the new one's
    a.service->kvSet("k" + std::to_string(i), "v", {}, [&](Status st) { set += st.isOk(); });
  }
  REQUIRE(job.runUntil([&] { return set == 40; }));

  etcd.kill(0);
  etcd.wipe(0);
  etcd.start(0);
  REQUIRE(etcd.waitHealthy());
  // The store is new: both agents join again and a round forms there, and the key-value store
  // (the exit barrier's) carries what is written now.
  REQUIRE(joinAll(job, {&a, &b}, std::chrono::seconds(60)));
  INFO(a.result->status().toString() << " / " << b.result->status().toString());
  REQUIRE(a.result->isOk());
  REQUIRE(b.result->isOk());
  std::optional<StatusOr<std::vector<std::string>>> values;
  a.service->kvWait({"after"}, std::chrono::seconds(20), {},
                    [&](StatusOr<std::vector<std::string>> v) { values = v; });
  bool written = false;
  b.service->kvSet("after", "1", {}, [&](Status st) { written = st.isOk(); });
  REQUIRE(job.runUntil([&] { return values.has_value() && written; }, std::chrono::seconds(30)));
  REQUIRE(values->isOk());
  CHECK(values->value() == std::vector<std::string>{"1"});
  std::optional<StatusOr<std::vector<std::string>>> gone;
  a.service->kvWait({"k5"}, std::chrono::milliseconds(300), {},
                    [&](StatusOr<std::vector<std::string>> v) { gone = v; });
  REQUIRE(job.runUntil([&] { return gone.has_value(); }));
  CHECK(gone->status().code() == StatusCode::kDeadlineExceeded);  // the old store's keys are gone
}

TEST_CASE("etcd-v3: an unreachable etcd is named in one error", "[etcd]") {
  const int port = ddprun::testing::freePort();
  Job job("127.0.0.1:" + std::to_string(port), 1, 1, Duration::zero());
  auto service = job.service(std::chrono::seconds(1));
  std::optional<StatusOr<rendezvous::RoundInfo>> result;
  service->join(job.request(), [&](StatusOr<rendezvous::RoundInfo> r) { result = r; });
  REQUIRE(job.runUntil([&] { return result.has_value(); }, std::chrono::seconds(60)));
  REQUIRE_FALSE(result->isOk());
  CHECK(result->status().code() == StatusCode::kUnavailable);
  CHECK_THAT(result->status().message(), Catch::Contains("127.0.0.1:" + std::to_string(port)));
  CHECK(result->status().message().find('\n') == std::string::npos);
}

TEST_CASE("etcd-v3: the client fails over to a member that answers", "[etcd]") {
  REQUIRE_ETCD();
  EtcdCluster etcd;
  const int dead = ddprun::testing::freePort();
  Job job("127.0.0.1:" + std::to_string(dead) + "," + etcd.endpoints(), 1, 1, Duration::zero());
  Agent a(job);
  a.join();
  REQUIRE(job.runUntil([&] { return a.done(); }));
  REQUIRE(a.result->isOk());
  CHECK(a.info->group_world_size == 1);
}

namespace {

// Joins one node of a one-node job; the join's result.
StatusOr<rendezvous::RoundInfo> joinAlone(Job& job, Duration connect_for) {
  auto service = job.service(connect_for);
  std::optional<StatusOr<rendezvous::RoundInfo>> result;
  service->join(job.request(), [&](StatusOr<rendezvous::RoundInfo> r) { result = r; });
  REQUIRE(job.runUntil([&] { return result.has_value(); }, std::chrono::seconds(60)));
  return *result;
}

std::string readAll(const std::string& path) { return ddprun::testing::readFile(path); }

}  // namespace

TEST_CASE("etcd-v3: what an HTTP/1.x answer to GET /version says about the member", "[etcd]") {
  const std::string head = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n";
  // etcd 2.x and 3.x answer with their versions.
  CHECK(etcdVersionFromHttpReply(head + R"({"etcdserver":"2.3.8","etcdcluster":"2.3.0"})") ==
        "2.3.8");
  CHECK(etcdVersionFromHttpReply(head + R"({ "etcdserver" : "3.4.23", "etcdcluster":"3.4.0"})") ==
        "3.4.23");
  CHECK(etcdVersionFromHttpReply("HTTP/1.0 200 OK\r\n\r\n{\"etcdserver\":\"2.0.0-rc.1\"}") ==
        "2.0.0-rc.1");
  // A TLS-only member (Go's answer to plaintext), other servers, nothing, damaged and hostile
  // replies: not an etcd version.
  CHECK_FALSE(etcdVersionFromHttpReply(
      "HTTP/1.0 400 Bad Request\r\n\r\nClient sent an HTTP request to an HTTPS server.\n"));
  CHECK_FALSE(etcdVersionFromHttpReply(head + R"({"version":"1.2"})"));
  CHECK_FALSE(etcdVersionFromHttpReply(""));
  CHECK_FALSE(etcdVersionFromHttpReply(R"({"etcdserver":"2.3.8"})"));  // not HTTP
  CHECK_FALSE(
      etcdVersionFromHttpReply("HTTP/1.1 200 OK\r\n"
                               R"({"etcdserver":"2.3.8"})"));
  CHECK_FALSE(etcdVersionFromHttpReply(head + R"({"etcdserver":"2.3.8)"));  // cut short
  CHECK_FALSE(etcdVersionFromHttpReply(head + R"({"etcdserver":""})"));
  CHECK_FALSE(etcdVersionFromHttpReply(head + R"({"etcdserver":2})"));
  CHECK_FALSE(etcdVersionFromHttpReply(head + R"({"etcdserver":"2.3\n8; rm -rf /"})"));
  CHECK_FALSE(
      etcdVersionFromHttpReply(head + "{\"etcdserver\":\"" + std::string(100000, '2') + "\"}"));
  // Nothing listening: an empty reply, not a hang or a throw.
  CHECK(httpGetVersion("127.0.0.1:" + std::to_string(ddprun::testing::freePort()),
                       std::chrono::seconds(1))
            .empty());
  CHECK(httpGetVersion("no-port", std::chrono::seconds(1)).empty());
}

TEST_CASE("etcd-v3: an etcd that serves only the v2 API is refused at once, named with its version",
          "[etcd]") {
  ddprun::testing::FakeEtcd2 old("2.3.8");
  Job job(old.endpoint(), 1, 1, Duration::zero());
  // A generous connect_for: the refusal must not wait it out (only UNAVAILABLE is retried).
  auto r = joinAlone(job, std::chrono::seconds(60));
  REQUIRE_FALSE(r.isOk());
  CHECK(r.status().code() == StatusCode::kFailedPrecondition);
  CHECK_THAT(r.status().message(),
             Catch::Contains("etcd at " + old.endpoint() + " is version 2.3.8"));
  CHECK_THAT(r.status().message(), Catch::Contains("only the v2 API"));
  CHECK_THAT(r.status().message(), Catch::Contains("etcd 3.0 or newer"));
  CHECK(r.status().message().find('\n') == std::string::npos);
  CHECK(old.connections() >= 2);  // the gRPC handshake, then GET /version
}

TEST_CASE("etcd-v3: a v2-only member in the list is passed over for a v3 one", "[etcd]") {
  REQUIRE_ETCD();
  ddprun::testing::FakeEtcd2 old("2.3.8");
  EtcdCluster etcd;
  Job job(old.endpoint() + "," + etcd.endpoints(), 1, 1, Duration::zero());
  auto r = joinAlone(job, std::chrono::seconds(30));
  REQUIRE(r.isOk());
  CHECK(r.value().group_world_size == 1);
}

TEST_CASE("etcd-v3: TLS with a client certificate, and a TLS mismatch named", "[etcd]") {
  REQUIRE_ETCD();
  ddprun::testing::TempDir certs;
  auto tls = ddprun::testing::makeEtcdTls(certs.path());
  EtcdCluster::Options eo;
  eo.tls = tls;
  EtcdCluster etcd(eo);
  {
    Job job(etcd.endpoints(), 1, 1, Duration::zero());
    job.options.tls = true;
    job.options.ca_pem = readAll(tls.ca);
    job.options.ca_file = tls.ca;
    job.options.cert_pem = readAll(tls.cert);
    job.options.key_pem = readAll(tls.key);
    auto r = joinAlone(job, std::chrono::seconds(10));
    REQUIRE(r.isOk());
    CHECK(r.value().group_world_size == 1);
  }
  {
    // Plaintext against a TLS member: unreachable, and the message says what to check.
    Job job(etcd.endpoints(), 1, 1, Duration::zero());
    auto r = joinAlone(job, std::chrono::seconds(1));
    REQUIRE_FALSE(r.isOk());
    CHECK(r.status().code() == StatusCode::kUnavailable);
    CHECK_THAT(r.status().message(), Catch::Contains("protocol=https"));
    CHECK_THAT(r.status().message(), Catch::Contains(etcd.endpoint(0)));
  }
  {
    // TLS without the client certificate the members ask for.
    Job job(etcd.endpoints(), 1, 1, Duration::zero());
    job.options.tls = true;
    job.options.ca_pem = readAll(tls.ca);
    job.options.ca_file = tls.ca;
    auto r = joinAlone(job, std::chrono::seconds(1));
    REQUIRE_FALSE(r.isOk());
    CHECK_THAT(r.status().message(), Catch::Contains("cacert=" + tls.ca));
  }
}

TEST_CASE("etcd-v3: etcd auth with a password, and a wrong one in one line", "[etcd]") {
  REQUIRE_ETCD();
  EtcdCluster etcd;
  REQUIRE(etcd.etcdctl({"user", "add", "root:rootpw"}).exit_code == 0);
  REQUIRE(etcd.etcdctl({"auth", "enable"}).exit_code == 0);
  {
    Job job(etcd.endpoints(), 1, 1, Duration::zero());
    job.options.username = "root";
    job.options.password = "rootpw";
    auto r = joinAlone(job, std::chrono::seconds(10));
    REQUIRE(r.isOk());
  }
  {
    Job job(etcd.endpoints(), 1, 1, Duration::zero());
    job.options.username = "root";
    job.options.password = "wrong";
    auto r = joinAlone(job, std::chrono::seconds(10));
    REQUIRE_FALSE(r.isOk());
    CHECK(r.status().code() == StatusCode::kUnauthenticated);
    CHECK_THAT(r.status().message(), Catch::Contains("wrong user name or password"));
    CHECK(r.status().message().find('\n') == std::string::npos);
  }
  {
    // No credentials against a cluster with auth on.
    Job job(etcd.endpoints(), 1, 1, Duration::zero());
    auto r = joinAlone(job, std::chrono::seconds(10));
    REQUIRE_FALSE(r.isOk());
    CHECK_THAT(r.status().message(), Catch::Contains("username="));
  }
}

TEST_CASE("etcd-v3: a 3-member cluster loses its leader and the rendezvous goes on", "[etcd]") {
  REQUIRE_ETCD();
  EtcdCluster::Options eo;
  eo.members = 3;
  EtcdCluster etcd(eo);
  Job job(etcd.endpoints(), 2, 3, std::chrono::milliseconds(300));
  Agent a(job), b(job);
  REQUIRE(joinAll(job, {&a, &b}));
  REQUIRE(a.result->isOk());
  const int leader = etcd.leader();
  REQUIRE(leader >= 0);
  etcd.kill(leader);
  // Leases outlive a leader election: nobody is declared dead while the cluster fails over.
  job.runUntil([] { return false; }, std::chrono::seconds(3));
  CHECK(a.countChanges(rendezvous::ChangeKind::kRoundPending,
                       rendezvous::ChangeReason::kNodeDead) == 0);
  // A later membership change still reaches every agent, and the round re-forms.
  Agent c(job);
  c.join();
  REQUIRE(job.runUntil(
      [&] {
        return a.countChanges(rendezvous::ChangeKind::kRoundPending,
                              rendezvous::ChangeReason::kNodeJoined) == 1 &&
               b.countChanges(rendezvous::ChangeKind::kRoundPending,
                              rendezvous::ChangeReason::kNodeJoined) == 1;
      },
      std::chrono::seconds(60)));
  a.join();
  b.join();
  REQUIRE(job.runUntil([&] { return allDone({&a, &b, &c}); }, std::chrono::seconds(60)));
  REQUIRE(c.result->isOk());
  CHECK(c.info->round == 2);
  CHECK(a.info->group_world_size == 3);
}

TEST_CASE("etcd-v3: the run's key-value store each agent mirrors is bounded", "[etcd]") {
  // 100 values of 1 MB under the job's kv/ took every agent to 131 MB: all of it was mirrored.
  REQUIRE_ETCD();
  EtcdCluster etcd;
  Job job(etcd.endpoints(), 1, 1, std::chrono::milliseconds(200));
  job.options.max_kv_keys = 20;
  job.options.max_kv_bytes = 1 << 20;
  Agent a(job);
  REQUIRE(joinAll(job, {&a}));
  REQUIRE(a.result->isOk());
  const std::string prefix = "/ddprun/rdzv/" + job.runId() + "/kv/";
  const std::string big(100 * 1000, 'b');
  for (int i = 0; i < 15; ++i) {  // 1.5 MB: the last ones are beyond the bytes
    REQUIRE(etcd.etcdctl({"put", prefix + "big" + std::to_string(i), big}).exit_code == 0);
  }
  REQUIRE(etcd.etcdctl({"put", prefix + "last", "x"}).exit_code == 0);
  std::optional<StatusOr<std::vector<std::string>>> last;
  a.service->kvWait({"last"}, std::chrono::seconds(20), {},
                    [&](StatusOr<std::vector<std::string>> v) { last = v; });
  REQUIRE(job.runUntil([&] { return last.has_value(); }));
  REQUIRE(last->isOk());  // small keys still fit
  auto [keys, bytes] = a.service->mirroredKv();
  CHECK(bytes <= (1u << 20));
  CHECK(keys <= 20);
  CHECK(keys >= 10);
  // What is beyond is not there for a waiter, and this agent's own kvSet is refused, named.
  std::optional<StatusOr<std::vector<std::string>>> beyond;
  a.service->kvWait({"big14"}, std::chrono::milliseconds(500), {},
                    [&](StatusOr<std::vector<std::string>> v) { beyond = v; });
  REQUIRE(job.runUntil([&] { return beyond.has_value(); }));
  CHECK(beyond->status().code() == StatusCode::kDeadlineExceeded);
  std::optional<Status> refused;
  a.service->kvSet("huge", std::string(2 << 20, 'h'), {}, [&](Status st) { refused = st; });
  REQUIRE(job.runUntil([&] { return refused.has_value(); }));
  CHECK(refused->code() == StatusCode::kResourceExhausted);
  CHECK_THAT(refused->message(), Catch::Contains("more than kv_max_bytes=1048576"));
  // Many small keys: bounded by the number of keys.
  for (int i = 0; i < 30; ++i) {
    REQUIRE(etcd.etcdctl({"put", prefix + "s" + std::to_string(i), "1"}).exit_code == 0);
  }
  std::optional<StatusOr<std::vector<std::string>>> s0;
  a.service->kvWait({"s0"}, std::chrono::seconds(20), {},
                    [&](StatusOr<std::vector<std::string>> v) { s0 = v; });
  REQUIRE(job.runUntil([&] { return s0.has_value(); }));
  CHECK(a.service->mirroredKv().first <= 20);
}
