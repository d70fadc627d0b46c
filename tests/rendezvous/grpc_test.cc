// Integration tests of the gRPC rendezvous: real server and clients over 127.0.0.1, port 0.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <future>
#include <mutex>
#include <set>
#include <thread>

#include "ddprun/rendezvous/client.h"
#include "ddprun/rendezvous/protobuf_log.h"
#include "ddprun/rendezvous/server.h"
#include "ddprun/rendezvous/v1/rendezvous.grpc.pb.h"
#include "raw_grpc.h"
#include "sanitizer.h"
#include "server_fixture.h"

using namespace ddprun;
using namespace ddprun::rendezvous;
using namespace std::chrono_literals;
using ddprun::rendezvous::testing::selfSignedTls;
using ddprun::rendezvous::testing::startServer;
using ddprun::rendezvous::testing::waitUntil;

namespace {

ClientOptions clientFor(const RendezvousServer& server) {
  ClientOptions o;
  o.endpoint = server.address();
  o.retry_timeout = 20s;
  return o;
}

JoinRequest joinRequest(const std::string& run, uint32_t min, uint32_t max,
                        const std::string& node_id = "") {
  JoinRequest r;
  r.run_id = run;
  r.node_id = node_id;
  r.address = "127.0.0.1";
  r.local_world_size = 1;
  r.config.min_nodes = min;
  r.config.max_nodes = max;
  r.config.last_call_timeout = 100ms;
  r.config.heartbeat_interval = 5s;
  r.join_timeout = 30s;
  return r;
}

// Collects a watch's changes and lets a test wait for one.
struct ChangeLog {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<RoundChange> changes;
  std::vector<Status> breaks;

  Client::ChangeCallback onChange() {
    return [this](const RoundChange& c) {
      std::lock_guard<std::mutex> lock(mu);
      changes.push_back(c);
      cv.notify_all();
    };
  }
  Client::BreakCallback onBreak() {
    return [this](const Status& s) {
      std::lock_guard<std::mutex> lock(mu);
      breaks.push_back(s);
      cv.notify_all();
    };
  }
  template <typename Pred>
  bool waitUntil(Pred pred, Duration bound = 20s) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, bound, [&] { return pred(changes); });
  }
  static bool has(const std::vector<RoundChange>& cs, ChangeKind kind, uint64_t round) {
    for (const auto& c : cs) {
      if (c.kind == kind && c.round == round) return true;
    }
    return false;
  }
};

}  // namespace

TEST_CASE("32 clients joining at once over loopback form one round with distinct ranks",
          "[rendezvous][grpc]") {
  auto server = startServer();
  constexpr int kNodes = 32;
  std::vector<StatusOr<RoundInfo>> results(kNodes, Status(StatusCode::kUnknown, "not run"));
  std::vector<std::thread> threads;
  for (int i = 0; i < kNodes; ++i) {
    threads.emplace_back([&, i] {
      Client client(clientFor(*server));
      auto req = joinRequest("many", kNodes, kNodes);
      req.local_world_size = 1 + i % 3;
      results[i] = client.join(req);
    });
  }
  for (auto& t : threads) t.join();
  std::set<uint32_t> ranks;
  uint32_t world = 0;
  for (auto& r : results) {
    INFO(r.status().toString());
    REQUIRE(r.isOk());
    CHECK(r->round == 1);
    CHECK(r->group_world_size == kNodes);
    REQUIRE(r->participants->size() == kNodes);
    CHECK(r->participants->at(r->group_rank).node_id == r->node_id);
    ranks.insert(r->group_rank);
    world += r->participants->at(r->group_rank).local_world_size;
  }
  CHECK(ranks.size() == kNodes);
  CHECK(*ranks.rbegin() == kNodes - 1);
  CHECK(results[0]->world_size == world);
}

TEST_CASE("a client that gives up mid-join is removed and the others still complete",
          "[rendezvous][grpc]") {
  auto server = startServer();
  Client victim(clientFor(*server));
  Client probe(clientFor(*server));
  StatusOr<RoundInfo> victim_result = Status(StatusCode::kUnknown, "not run");
  std::thread t([&] { victim_result = victim.join(joinRequest("cancel", 3, 3, "victim")); });
  REQUIRE(waitUntil([&] { return probe.heartbeat("cancel", "victim").isOk(); }));
  victim.cancelAll();
  t.join();
  REQUIRE_FALSE(victim_result.isOk());
  CHECK(victim_result.status().code() == StatusCode::kCancelled);
  // The server forgot the victim: it is no longer a pending participant.
  REQUIRE(waitUntil([&] {
    return probe.heartbeat("cancel", "victim").status().code() == StatusCode::kNotFound;
  }));

  std::vector<StatusOr<RoundInfo>> results(3, Status(StatusCode::kUnknown, "not run"));
  std::vector<std::thread> threads;
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([&, i] {
      Client c(clientFor(*server));
      results[i] = c.join(joinRequest("cancel", 3, 3, "n" + std::to_string(i)));
    });
  }
  for (auto& th : threads) th.join();
  for (auto& r : results) {
    REQUIRE(r.isOk());
    CHECK(r->group_world_size == 3);
    for (const auto& p : *r->participants) CHECK(p.node_id != "victim");
  }
}

TEST_CASE("membership changes are pushed to every watcher and close ends the run",
          "[rendezvous][grpc]") {
  auto server = startServer();
  Client client(clientFor(*server));
  ChangeLog log_a, log_b;
  // A last call long enough that re-joining survivors are never left out on a loaded machine.
  auto pushJoin = [](const std::string& node) {
    auto r = joinRequest("push", 2, 3, node);
    r.config.last_call_timeout = 1s;
    return r;
  };
  auto watch_a = client.watch("push", "a", log_a.onChange());
  auto watch_b = client.watch("push", "b", log_b.onChange());
  REQUIRE(log_a.waitUntil([](auto& cs) { return !cs.empty(); }));  // both subscribed
  REQUIRE(log_b.waitUntil([](auto& cs) { return !cs.empty(); }));
  CHECK(log_a.changes.front().kind == ChangeKind::kSnapshot);

  StatusOr<RoundInfo> a = Status(StatusCode::kUnknown, ""), b = a;
  std::thread ta([&] { a = client.join(pushJoin("a")); });
  std::thread tb([&] { b = client.join(pushJoin("b")); });
  ta.join();
  tb.join();
  REQUIRE(a.isOk());
  REQUIRE(b.isOk());
  REQUIRE(
      log_b.waitUntil([](auto& cs) { return ChangeLog::has(cs, ChangeKind::kRoundComplete, 1); }));

  // A late node: both watchers learn that round 2 is forming.
  StatusOr<RoundInfo> c = Status(StatusCode::kUnknown, "");
  std::thread tc([&] { c = client.join(pushJoin("c")); });
  for (ChangeLog* log : {&log_a, &log_b}) {
    REQUIRE(
        log->waitUntil([](auto& cs) { return ChangeLog::has(cs, ChangeKind::kRoundPending, 2); }));
    std::lock_guard<std::mutex> lock(log->mu);
    for (auto& ch : log->changes) {
      if (ch.kind == ChangeKind::kRoundPending) {
        CHECK(ch.reason == ChangeReason::kNodeJoined);
        CHECK(ch.node_id == "c");
      }
    }
  }
  {
    // A watch that begins now (or resumes after a break) is told the same in its snapshot.
    ChangeLog late;
    auto watch_late = client.watch("push", "late", late.onChange());
    REQUIRE(late.waitUntil([](auto& cs) { return !cs.empty(); }));
    std::lock_guard<std::mutex> lock(late.mu);
    const RoundChange& first = late.changes.front();
    CHECK(first.kind == ChangeKind::kSnapshot);
    CHECK(first.status.pending_round == 2);
    CHECK(first.reason == ChangeReason::kNodeJoined);
    CHECK(first.node_id == "c");
  }
  StatusOr<RoundInfo> a2 = Status(StatusCode::kUnknown, ""), b2 = a2;
  std::thread ta2([&] { a2 = client.join(pushJoin("a")); });
  std::thread tb2([&] { b2 = client.join(pushJoin("b")); });
  ta2.join();
  tb2.join();
  tc.join();
  INFO(a2.status().toString() + " / " + b2.status().toString());
  REQUIRE(a2.isOk());
  REQUIRE(b2.isOk());
  REQUIRE(c.isOk());
  CHECK(a2->round == 2);
  CHECK(a2->group_rank == a->group_rank);
  CHECK(b2->group_rank == b->group_rank);
  CHECK(c->group_rank == 2);

  // Rank 0 publishes the master; the others wait for it.
  const RoundInfo& rank0 = a2->group_rank == 0 ? a2.value() : b2.value();
  std::thread publisher([&] {
    REQUIRE(client.publishMaster("push", rank0.node_id, 2, {"127.0.0.1", 29517}).isOk());
  });
  auto master = client.waitMaster("push", 2, 10s);
  publisher.join();
  REQUIRE(master.isOk());
  CHECK(master->addr == "127.0.0.1");
  CHECK(master->port == 29517);

  // A failure report: every watcher sees one FAILURE_REPORTED round.
  auto next = client.reportFailure("push", "c", 2);
  REQUIRE(next.isOk());
  CHECK(next.value() == 3);
  REQUIRE(
      log_b.waitUntil([](auto& cs) { return ChangeLog::has(cs, ChangeKind::kRoundPending, 3); }));
  // ... and a failed in-place recovery's report arrives as RECOVERY_FAILED (not charged again).
  std::vector<std::thread> joins;
  std::vector<Status> joined(3, Status(StatusCode::kUnknown, ""));
  for (int i = 0; i < 3; ++i) {
    joins.emplace_back(
        [&, i] { joined[i] = client.join(pushJoin(std::string(1, 'a' + i))).status(); });
  }
  for (auto& t : joins) t.join();
  for (const auto& st : joined) REQUIRE(st.isOk());
  auto after = client.reportFailure("push", "c", 3, FailureKind::kRecovery);
  REQUIRE(after.isOk());
  CHECK(after.value() == 4);
  REQUIRE(log_b.waitUntil([](auto& cs) {
    return std::any_of(cs.begin(), cs.end(), [](const RoundChange& c) {
      return c.kind == ChangeKind::kRoundPending && c.round == 4 &&
             c.reason == ChangeReason::kRecoveryFailed && c.node_id == "c";
    });
  }));

  REQUIRE(client.close("push").isOk());
  REQUIRE(log_a.waitUntil(
      [](auto& cs) { return !cs.empty() && cs.back().kind == ChangeKind::kClosed; }));
  auto late = client.join(pushJoin("d"));
  REQUIRE_FALSE(late.isOk());
  CHECK(late.status().code() == StatusCode::kFailedPrecondition);
  CHECK(late.status().message() == "run push is closed");
}

TEST_CASE("a watched closed run becomes a tombstone once its watcher took kClosed, idle runs go",
          "[rendezvous][grpc]") {
  ServerOptions so;
  so.retention.idle_run_ttl = 200ms;
  auto server = startServer(so);
  Client client(clientFor(*server));
  ChangeLog log;
  auto watch = client.watch("gc", "", log.onChange());
  REQUIRE(log.waitUntil([](auto& cs) { return !cs.empty(); }));
  REQUIRE(client.join(joinRequest("gc", 1, 1)).isOk());
  CHECK(server->census().runs == 1);
  CHECK(server->census().watch_streams == 1);

  REQUIRE(client.close("gc").isOk());
  REQUIRE(
      log.waitUntil([](auto& cs) { return !cs.empty() && cs.back().kind == ChangeKind::kClosed; }));
  CHECK(waitUntil([&] {
    auto c = server->census();
    return c.watch_streams == 0 && c.runs == 0 && c.tombstones == 1;
  }));
  auto late = client.join(joinRequest("gc", 1, 1));
  REQUIRE_FALSE(late.isOk());
  CHECK(late.status().message() == "run gc is closed");
  // A watcher subscribing after the shrink is still told the run is closed.
  ChangeLog late_log;
  auto late_watch = client.watch("gc", "", late_log.onChange());
  CHECK(late_log.waitUntil(
      [](auto& cs) { return !cs.empty() && cs.back().kind == ChangeKind::kClosed; }));

  // A store nobody writes to any more is dropped after the idle TTL.
  REQUIRE(client.kvSet("scratch", "k", "v").isOk());
  CHECK(server->census().kv_spaces == 1);  // current once the call returned
  CHECK(waitUntil([&] { return server->census().kv_spaces == 0; }));
  CHECK(client.kvGet("scratch", "k").status().code() == StatusCode::kNotFound);
}

TEST_CASE("bad input gets precise statuses and the server keeps serving", "[rendezvous][grpc]") {
  auto server = startServer();
  Client client(clientFor(*server));
  auto zero = joinRequest("bad", 1, 2);
  zero.local_world_size = 0;
  CHECK(client.join(zero).status().code() == StatusCode::kInvalidArgument);
  CHECK(client.join(joinRequest("", 1, 2)).status().code() == StatusCode::kInvalidArgument);
  CHECK(client.kvSet("bad", "big", std::string(2 << 20, 'x')).code() ==
        StatusCode::kInvalidArgument);
  CHECK(client.kvSet("bad", "huge", std::string(8 << 20, 'x')).code() ==
        StatusCode::kResourceExhausted);
  CHECK(client.heartbeat("bad", "nobody").status().code() == StatusCode::kNotFound);
  CHECK(client.kvWait("bad", {"never"}, 50ms).status().code() == StatusCode::kDeadlineExceeded);

  StatusOr<RoundInfo> first = Status(StatusCode::kUnknown, "");
  std::thread t([&] { first = client.join(joinRequest("bad", 2, 2, "first")); });
  REQUIRE(waitUntil([&] { return client.heartbeat("bad", "first").isOk(); }));
  auto mismatch = client.join(joinRequest("bad", 1, 2, "other"));
  CHECK(mismatch.status().code() == StatusCode::kFailedPrecondition);
  CHECK(mismatch.status().message() == "run bad has nnodes 2:2 but this node asked for 1:2");
  auto second = client.join(joinRequest("bad", 2, 2, "second"));
  t.join();
  REQUIRE(first.isOk());
  REQUIRE(second.isOk());

  REQUIRE(client.kvSet("bad", "k", "v").isOk());
  CHECK(client.kvGet("bad", "k").value() == "v");
  CHECK(client.kvAdd("bad", "n", 3).value() == 3);
  CHECK(client.kvCompareSet("bad", "k", "v", "w").value() == "w");
  CHECK(client.kvWait("bad", {"k", "n"}, 1s).value() == std::vector<std::string>{"w", "3"});
  CHECK(client.kvDelete("bad", "k").value());
  REQUIRE(client.kvSet("bad", "r/1", "v").isOk());
  REQUIRE(client.kvSet("bad", "r/2", "v").isOk());
  CHECK(client.kvDeleteRange("bad", "r/", "r/2").value() == 1);
  CHECK(client.kvGet("bad", "r/2").value() == "v");
  CHECK(client.kvDeleteRange("bad", "r/", "r/2").value() == 0);
  CHECK(client.kvDeleteRange("bad", "r/3", "r/").status().code() == StatusCode::kInvalidArgument);
  CHECK(client.kvDeleteRange("bad", "r/", "").status().code() == StatusCode::kInvalidArgument);
  CHECK(client.kvDeleteRange("bad", "A", "z").status().code() == StatusCode::kInvalidArgument);
  CHECK(client.kvGet("bad", "r/2").value() == "v");
}

TEST_CASE("a watch whose client stops reading is ended once too far behind, not buffered",
          "[rendezvous][grpc]") {
  ServerOptions options;
  options.max_watch_queue = 16;
  auto server = startServer(options);
  // A raw stub: the client library reads every message at once, this client never reads again.
  auto stub = v1::Rendezvous::NewStub(
      grpc::CreateChannel(server->address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  v1::WatchRequest req;
  req.set_run_id("busy");
  auto reader = stub->Watch(&ctx, req);
  v1::RoundChange change;
  REQUIRE(reader->Read(&change));  // the snapshot: the stream is open

  // 16000 changes of ~1 KB (a node joins a 1:1 run, then leaves): more than gRPC's flow-control
  // window lets through to the client (~8 MB here), so the server's queue for the stream fills.
  Client client(clientFor(*server));
  for (int i = 0; i < 8000; ++i) {
    const std::string node = std::to_string(i) + std::string(1000, 'n');
    auto joined = client.join(joinRequest("busy", 1, 1, node));
    REQUIRE(joined.isOk());
    REQUIRE(client.leave("busy", node).isOk());
  }
  REQUIRE(client.close("busy").isOk());  // would end a stream that kept up with OK

  int read = 0;
  while (reader->Read(&change)) ++read;
  grpc::Status status = reader->Finish();
  INFO("read " << read << " changes after the snapshot");
  CHECK(status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK_THAT(status.error_message(), Catch::Contains("max_watch_queue"));
  CHECK(read < 16000);
  // The server still serves, and the stream's place is free again.
  CHECK(client.kvSet("other", "k", "v").isOk());
  CHECK(waitUntil([&] { return server->census().watch_streams == 0; }));
}

TEST_CASE("clients retry and re-subscribe across a server restart", "[rendezvous][grpc]") {
  auto server = startServer();
  const std::string address = server->address();
  Client client(clientFor(*server));
  ChangeLog log;
  auto watch = client.watch("restart", "a", log.onChange(), log.onBreak());
  REQUIRE(log.waitUntil([](auto& cs) { return !cs.empty(); }));  // subscribed
  auto first = client.join(joinRequest("restart", 1, 1, "a"));
  REQUIRE(first.isOk());
  REQUIRE(
      log.waitUntil([](auto& cs) { return ChangeLog::has(cs, ChangeKind::kRoundComplete, 1); }));

  server->shutdown();
  server.reset();
  {
    std::unique_lock<std::mutex> lock(log.mu);
    REQUIRE(log.cv.wait_for(lock, 20s, [&] { return !log.breaks.empty(); }));
  }
  // A join while the server is down is retried until the new server answers.
  StatusOr<RoundInfo> again = Status(StatusCode::kUnknown, "");
  std::thread joiner([&] { again = client.join(joinRequest("restart", 1, 1, "a")); });
  ServerOptions options;
  options.listen = address;
  auto restarted = startServer(options);
  joiner.join();
  REQUIRE(again.isOk());
  CHECK(again->round == 1);  // the new server starts the run afresh
  CHECK(again->node_id == "a");
  // The watch re-subscribed to the new server: a fresh snapshot, and it learns of the new
  // server's round 1 (from that snapshot or from the change, whichever came first).
  REQUIRE(log.waitUntil([](auto& cs) {
    int snapshots = 0;
    for (auto& c : cs) snapshots += c.kind == ChangeKind::kSnapshot;
    return snapshots >= 2 && cs.back().status.completed_round == 1;
  }));
}

TEST_CASE("calls without the right token are refused with UNAUTHENTICATED", "[rendezvous][grpc]") {
  ServerOptions options;
  options.token = "s3cret";
  auto server = startServer(options);
  Client anonymous(clientFor(*server));
  auto refused = anonymous.join(joinRequest("secure", 1, 1));
  REQUIRE_FALSE(refused.isOk());
  CHECK(refused.status().code() == StatusCode::kUnauthenticated);
  CHECK(anonymous.kvSet("secure", "k", "v").code() == StatusCode::kUnauthenticated);

  ClientOptions wrong = clientFor(*server);
  wrong.token = "guess";
  Client guesser(wrong);
  CHECK(guesser.kvGet("secure", "k").status().code() == StatusCode::kUnauthenticated);
  ChangeLog log;
  {
    auto watch = guesser.watch("secure", "", log.onChange(), log.onBreak());
    std::unique_lock<std::mutex> lock(log.mu);
    REQUIRE(log.cv.wait_for(lock, 20s, [&] { return !log.breaks.empty(); }));
    CHECK(log.breaks.front().code() == StatusCode::kUnauthenticated);
    CHECK(log.changes.empty());
  }

  ClientOptions right = clientFor(*server);
  right.token = "s3cret";
  Client member(right);
  auto joined = member.join(joinRequest("secure", 1, 1));
  REQUIRE(joined.isOk());
  CHECK(joined->group_world_size == 1);
}

namespace {

std::string buildDir() {
  const char* d = std::getenv("DDPRUN_BUILD_DIR");
  return d != nullptr ? d : ".";
}

// Runs the daemon with `args`; returns its pid and a FILE* on its stdout (and stderr, merged).
// `asan_options`: the daemon's ASAN_OPTIONS, where not empty (sanitizer.h); `nofile`: its
// descriptor limit, soft and hard, where not 0.
pid_t spawnDaemon(const std::vector<std::string>& args, FILE** out, bool with_stderr = false,
                  const std::string& asan_options = "", rlim_t nofile = 0) {
  int fds[2];
  REQUIRE(pipe(fds) == 0);
  // Made before the fork: the child only execs.
  std::string bin = buildDir() + "/rendezvous/ddprun-rendezvous";
  std::vector<std::string> copy = args;
  std::vector<char*> argv;
  argv.push_back(bin.data());
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_copy;
  for (char** e = environ; *e != nullptr; ++e) {
    if (asan_options.empty() || std::string(*e).rfind("ASAN_OPTIONS=", 0) != 0) {
      env_copy.emplace_back(*e);
    }
  }
  if (!asan_options.empty()) env_copy.push_back("ASAN_OPTIONS=" + asan_options);
  std::vector<char*> envp;
  for (auto& e : env_copy) envp.push_back(e.data());
  envp.push_back(nullptr);
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    dup2(fds[1], 1);
    if (with_stderr) dup2(fds[1], 2);
    close(fds[0]);
    close(fds[1]);
    if (nofile != 0) {
      const rlimit lim{nofile, nofile};
      if (setrlimit(RLIMIT_NOFILE, &lim) != 0) _exit(126);
    }
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  close(fds[1]);
  *out = fdopen(fds[0], "r");
  return pid;
}

std::string readAll(FILE* in) {
  std::string text;
  char buf[512];
  size_t n = 0;
  while ((n = fread(buf, 1, sizeof buf, in)) > 0) text.append(buf, n);
  return text;
}

int waitExit(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace

TEST_CASE("the daemon prints its bound port, serves, and stops cleanly on SIGTERM",
          "[rendezvous][daemon]") {
  char dir_template[] = "/tmp/ddprun-rdzv-XXXXXX";
  REQUIRE(mkdtemp(dir_template) != nullptr);
  const std::string token_file = std::string(dir_template) + "/token";
  std::ofstream(token_file) << "tok\n";
  FILE* out = nullptr;
  pid_t pid = spawnDaemon({"--listen", "127.0.0.1:0", "--token-file", token_file}, &out);
  char line[256] = {0};
  REQUIRE(fgets(line, sizeof line, out) != nullptr);
  std::string text(line);
  REQUIRE(text.rfind("listening on 127.0.0.1:", 0) == 0);
  const std::string endpoint = text.substr(13, text.find('\n') - 13);
  CHECK(endpoint != "127.0.0.1:0");

  ClientOptions options;
  options.endpoint = endpoint;
  options.token = "tok";
  Client client(options);
  auto joined = client.join(joinRequest("daemon", 1, 1));
  REQUIRE(joined.isOk());
  CHECK(joined->round == 1);

  kill(pid, SIGTERM);
  CHECK(waitExit(pid) == 0);
  fclose(out);
  std::remove(token_file.c_str());
  rmdir(dir_template);
}

TEST_CASE("the daemon rejects bad flags with exit code 2", "[rendezvous][daemon]") {
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"--bogus"},
           {},
           {"--listen", "nowhere"},
           {"--listen", "127.0.0.1:0", "--tls-cert", "x"},
           {"--listen", "127.0.0.1:0", "--token-file", "/nonexistent/token"},
           {"--listen", "127.0.0.1:\n5"}}) {
    FILE* out = nullptr;
    pid_t pid = spawnDaemon(args, &out, true);
    const std::string text = readAll(out);
    CHECK(waitExit(pid) == 2);
    // One line, even when it quotes a value holding a newline.
    CHECK(text.find('\n') == text.size() - 1);
    fclose(out);
  }
}

TEST_CASE("a --listen address that cannot be used is exit 2 and its one real reason",
          "[rendezvous][daemon]") {
  // Every case used to be rc 1 and "(address in use, not local, or malformed)".
  const int busy = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(busy, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  REQUIRE(::listen(busy, 1) == 0);
  socklen_t len = sizeof(addr);
  REQUIRE(::getsockname(busy, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  const std::string port = std::to_string(ntohs(addr.sin_port));
  for (const auto& [listen, why] : std::vector<std::pair<std::string, std::string>>{
           {"127.0.0.1:" + port,
            "port " + port + " is in use (another process listens there; pick another port)"},
           {"192.0.2.1:29400", "'192.0.2.1' is not an address of this host"},
           {"nosuchhost.invalid:29400", "'nosuchhost.invalid' does not resolve"}}) {
    CAPTURE(listen);
    FILE* out = nullptr;
    pid_t pid = spawnDaemon({"--listen", listen}, &out, true);
    const std::string text = readAll(out);
    CHECK(waitExit(pid) == 2);
    CHECK(text.find("cannot listen on " + listen + ": " + why) != std::string::npos);
    CHECK(text.find('\n') == text.size() - 1);
    fclose(out);
  }
  ::close(busy);
}

TEST_CASE("the daemon validates --closed-run-ttl and --idle-run-ttl and lists them in --help",
          "[rendezvous][daemon]") {
  for (const auto& [flag, value] :
       std::vector<std::pair<std::string, std::string>>{{"--closed-run-ttl", "0"},
                                                        {"--closed-run-ttl", "-5"},
                                                        {"--idle-run-ttl", "ten"},
                                                        {"--idle-run-ttl", "1e12"},
                                                        {"--idle-run-ttl", ""}}) {
    FILE* out = nullptr;
    pid_t pid = spawnDaemon({"--listen", "127.0.0.1:0", flag + "=" + value}, &out, true);
    const std::string text = readAll(out);
    CHECK(waitExit(pid) == 2);
    INFO(text);
    CHECK(text.find(flag + ": '" + value + "' is not a number of seconds") != std::string::npos);
    fclose(out);
  }
  FILE* out = nullptr;
  pid_t pid = spawnDaemon({"--help"}, &out);
  const std::string help = readAll(out);
  CHECK(waitExit(pid) == 0);
  CHECK(help.find("--closed-run-ttl SECONDS") != std::string::npos);
  CHECK(help.find("--idle-run-ttl SECONDS") != std::string::npos);
  fclose(out);
}

TEST_CASE("the daemon frees a closed run's id after --closed-run-ttl", "[rendezvous][daemon]") {
  FILE* out = nullptr;
  pid_t pid = spawnDaemon({"--listen", "127.0.0.1:0", "--closed-run-ttl", "0.3"}, &out);
  char line[256] = {0};
  REQUIRE(fgets(line, sizeof line, out) != nullptr);
  std::string text(line);
  REQUIRE(text.rfind("listening on 127.0.0.1:", 0) == 0);
  ClientOptions options;
  options.endpoint = text.substr(13, text.find('\n') - 13);
  Client client(options);

  auto first = client.join(joinRequest("reused", 1, 1));
  REQUIRE(first.isOk());
  REQUIRE(client.kvSet("reused", "k", "old").isOk());
  REQUIRE(client.close("reused").isOk());
  auto refused = client.join(joinRequest("reused", 1, 1));
  REQUIRE_FALSE(refused.isOk());
  CHECK(refused.status().message() == "run reused is closed");
  // Refused until the tombstone expires, then a fresh run under the same id.
  StatusOr<RoundInfo> again = refused.status();
  CHECK(waitUntil([&] {
    again = client.join(joinRequest("reused", 1, 1));
    return again.isOk();
  }));
  REQUIRE(again.isOk());
  CHECK(again->round == 1);
  CHECK(client.kvGet("reused", "k").status().code() == StatusCode::kNotFound);

  kill(pid, SIGTERM);
  CHECK(waitExit(pid) == 0);
  fclose(out);
}

// VmRSS of `pid` in bytes, from /proc/<pid>/status.
size_t residentBytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  FAIL("no VmRSS for pid " << pid);
  return 0;
}

TEST_CASE("the daemon validates its quota flags and lists them in --help", "[rendezvous][daemon]") {
  for (const std::string arg :
       {"--max-run-keys=0", "--max-run-kv-bytes=-1", "--max-kv-bytes=1e9",
        "--max-streams-per-peer=", "--max-kv-bytes=99999999999999999999", "--max-run-spares=many",
        "--max-connections-per-peer=0", "--max-streams-per-host=x", "--max-runs=-5"}) {
    FILE* out = nullptr;
    pid_t pid = spawnDaemon({"--listen", "127.0.0.1:0", arg}, &out, true);
    const std::string text = readAll(out);
    CHECK(waitExit(pid) == 2);
    INFO(text);
    CHECK(text.find(arg.substr(0, arg.find('=')) + ": '" + arg.substr(arg.find('=') + 1) +
                    "' is not a whole number") != std::string::npos);
    fclose(out);
  }
  FILE* out = nullptr;
  pid_t pid = spawnDaemon({"--help"}, &out);
  const std::string help = readAll(out);
  CHECK(waitExit(pid) == 0);
  for (const char* flag :
       {"--max-run-keys N", "--max-run-kv-bytes N", "--max-kv-bytes N", "--max-run-spares N",
        "--max-streams-per-peer N", "--max-streams-per-host N", "--max-connections-per-peer N",
        "--max-runs N"}) {
    CHECK(help.find(flag) != std::string::npos);
  }
  fclose(out);
}

// Spares on connections of their own (the per-connection bound does not see them) are bounded
// per run.
TEST_CASE("the daemon refuses a run's spares past --max-run-spares, naming it",
          "[rendezvous][daemon]") {
  FILE* out = nullptr;
  pid_t pid = spawnDaemon({"--listen", "127.0.0.1:0", "--max-run-spares", "1"}, &out);
  char line[256] = {0};
  REQUIRE(fgets(line, sizeof line, out) != nullptr);
  const std::string text(line);
  REQUIRE(text.rfind("listening on 127.0.0.1:", 0) == 0);
  ClientOptions options;
  options.endpoint = text.substr(13, text.find('\n') - 13);
  Client member(options);
  REQUIRE(member.join(joinRequest("spares", 1, 1, "a")).isOk());
  Client first(options);
  StatusOr<RoundInfo> waited = Status(StatusCode::kUnknown, "not answered");
  std::thread spare([&] { waited = first.join(joinRequest("spares", 1, 1, "s1")); });
  CHECK(waitUntil([&] {
    auto st = member.heartbeat("spares", "a");
    return st.isOk() && st->spares == 1;
  }));
  Client second(options);
  auto refused = second.join(joinRequest("spares", 1, 1, "s2"));
  CHECK(refused.status().code() == StatusCode::kResourceExhausted);
  CHECK_THAT(refused.status().message(),
             Catch::Contains("run spares already has 1 nodes waiting beyond nnodes MAX 1 (spares): "
                             "max-run-spares = 1 (ddprun-rendezvous --max-run-spares)"));
  REQUIRE(member.close("spares").isOk());
  spare.join();
  CHECK(waited.status().code() == StatusCode::kFailedPrecondition);
  kill(pid, SIGTERM);
  CHECK(waitExit(pid) == 0);
  fclose(out);
}

// libprotobuf logs a line for each request whose string field is not UTF-8, before any ddprun
// code runs: the daemon routes those lines through its logger, a few a minute.
TEST_CASE(
    "requests that are not valid protobuf messages are refused and logged a few times a minute",
    "[rendezvous][daemon]") {
  FILE* out = nullptr;
  pid_t pid = spawnDaemon({"--listen", "127.0.0.1:0"}, &out, true);
  std::string text;  // stderr too: its log line comes first
  char line[256] = {0};
  while (text.rfind("listening on 127.0.0.1:", 0) != 0) {
    REQUIRE(fgets(line, sizeof line, out) != nullptr);
    text = line;
  }
  const std::string endpoint = text.substr(13, text.find('\n') - 13);
  auto channel = grpc::CreateChannel(endpoint, grpc::InsecureChannelCredentials());
  const std::string bad = ddprun::testing::rawStringField(1, "run") +
                          ddprun::testing::rawStringField(2, "\xff\xfe key");
  for (int i = 0; i < 300; ++i) {
    const grpc::Status st =
        ddprun::testing::rawUnaryCall(channel, "/ddprun.rendezvous.v1.Rendezvous/KvGet", bad);
    REQUIRE_FALSE(st.ok());
    REQUIRE(st.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  // A cut message (a length past its end) is refused too.
  CHECK_FALSE(ddprun::testing::rawUnaryCall(channel, "/ddprun.rendezvous.v1.Rendezvous/KvGet",
                                            std::string("\x0a\x7f", 2) + "run")
                  .ok());
  // It still serves.
  ClientOptions options;
  options.endpoint = endpoint;
  Client client(options);
  auto got = client.kvGet("run", "key");
  CHECK(got.status().code() == StatusCode::kNotFound);
  kill(pid, SIGTERM);
  CHECK(waitExit(pid) == 0);
  const std::string log = readAll(out);
  fclose(out);
  INFO(log);
  size_t lines = 0;
  for (size_t at = log.find("invalid UTF-8"); at != std::string::npos;
       at = log.find("invalid UTF-8", at + 1)) {
    ++lines;
    const size_t start = log.rfind('\n', at) + 1;
    CHECK(log.compare(start, 27, "[ddprun protobuf] warning: ") == 0);
  }
  CHECK(lines >= 1);
  CHECK(lines <= kProtobufLinesPerMinute);
  CHECK(log.find("[libprotobuf") == std::string::npos);
}

// Reads the daemon's output up to "listening on HOST:PORT" and returns HOST:PORT.
std::string daemonEndpoint(FILE* out) {
  std::string text;
  char line[256] = {0};
  while (text.rfind("listening on 127.0.0.1:", 0) != 0) {
    if (fgets(line, sizeof line, out) == nullptr) return "";
    text = line;
  }
  return text.substr(13, text.find('\n') - 13);
}

int portOf(const std::string& endpoint) {
  return std::stoi(endpoint.substr(endpoint.rfind(':') + 1));
}

// Opens `n` raw connections to the daemon at `endpoint` into `held`; how many it answered.
size_t holdConnections(const std::string& endpoint, int n,
                       std::vector<std::unique_ptr<ddprun::testing::RawConnection>>& held) {
  size_t answered = 0;
  for (int i = 0; i < n; ++i) {
    held.push_back(std::make_unique<ddprun::testing::RawConnection>("127.0.0.1", portOf(endpoint)));
    REQUIRE(held.back()->fd() >= 0);
    if (held.back()->answered(2000)) ++answered;
  }
  return answered;
}

// A node joins a run of its own at `endpoint` (the daemon still listens), then the daemon is
// stopped with SIGTERM and exits 0; returns all it wrote.
std::string joinThenStop(pid_t pid, FILE* out, const std::string& endpoint,
                         const std::string& run) {
  ClientOptions options;
  options.endpoint = endpoint;
  options.retry_timeout = 20s;
  {
    Client client(options);
    CHECK(client.join(joinRequest(run, 1, 1)).isOk());
  }
  kill(pid, SIGTERM);
  CHECK(waitExit(pid) == 0);
  const std::string log = readAll(out);
  fclose(out);
  return log;
}

// gRPC 1.51 stops accepting for good once accept4() fails with EMFILE (grpc/grpc#20418). The
// daemon's accept guard refuses connections once it has fewer descriptors left than it keeps (and
// closes pending ones when it is out of them: accept_guard_test.cc), and keeps listening.
TEST_CASE("a daemon short of file descriptors refuses connections and serves again once they close",
          "[rendezvous][daemon]") {
  FILE* out = nullptr;
  pid_t pid = spawnDaemon({"--listen", "127.0.0.1:0"}, &out, true, "", 64);
  const std::string endpoint = daemonEndpoint(out);
  REQUIRE(!endpoint.empty());
  std::vector<std::unique_ptr<ddprun::testing::RawConnection>> held;
  const size_t answered = holdConnections(endpoint, 100, held);
  CHECK(answered > 0);
  CHECK(answered < 32);  // the rest were closed, not left pending
  held.clear();
  // Listening still: a node joins.
  const std::string log = joinThenStop(pid, out, endpoint, "after-emfile");
  INFO(log);
  CHECK(log.find("[ddprun net] warning: refused a connection from 127.0.0.1: its descriptor would "
                 "be number ") != std::string::npos);
  CHECK(log.find(" of this process's 64, and the last 32 are kept for its own work; raise the "
                 "limit (ulimit -n), or find the peers that hold the connections (ss -tn)") !=
        std::string::npos);
  CHECK(ddprun::testing::countOf(log, "refused a connection") == 1);  // once a minute
}

TEST_CASE("a host past --max-connections-per-peer is refused its next connections, others are not",
          "[rendezvous][daemon]") {
  FILE* out = nullptr;
  pid_t pid =
      spawnDaemon({"--listen", "127.0.0.1:0", "--max-connections-per-peer", "8"}, &out, true);
  const std::string endpoint = daemonEndpoint(out);
  REQUIRE(!endpoint.empty());
  {
    std::vector<std::unique_ptr<ddprun::testing::RawConnection>> held;
    CHECK(holdConnections(endpoint, 20, held) == 8);
    // Another host is not held to 127.0.0.1's connections.
    ddprun::testing::RawConnection other("127.0.0.1", portOf(endpoint), "127.0.0.2");
    CHECK(other.answered());
  }
  // Once the 8 closed, 127.0.0.1 connects again: a node joins.
  const std::string log = joinThenStop(pid, out, endpoint, "after-cap");
  INFO(log);
  CHECK(log.find("[ddprun net] warning: refused a connection from 127.0.0.1: it holds 8 "
                 "connections to this process's servers, the most one host may "
                 "(ddprun-rendezvous --max-connections-per-peer)") != std::string::npos);
  CHECK(ddprun::testing::countOf(log, "refused a connection") == 1);
}

TEST_CASE(
    "a connection that sends nothing, or holds no call, is closed after its bound, one with a "
    "call in flight is kept, and an idle client's next call connects again",
    "[rendezvous]") {
  ServerOptions options;
  options.handshake_timeout = 1s;
  options.max_connection_idle = 2s;
  auto server = startServer(options);
  const auto start = std::chrono::steady_clock::now();
  ddprun::testing::RawConnection silent("127.0.0.1", server->port(), "127.0.0.1", true);
  ddprun::testing::RawConnection idle("127.0.0.1", server->port());
  REQUIRE(idle.answered());
  Client client(clientFor(*server));
  REQUIRE(client.kvSet("idle", "k", "v").isOk());
  // A KvWait that outlasts both bounds, on a channel of its own.
  auto channel = grpc::CreateChannel(server->address(), grpc::InsecureChannelCredentials());
  auto stub = v1::Rendezvous::NewStub(channel);
  grpc::ClientContext ctx;
  v1::KvWaitRequest request;
  request.set_run_id("idle");
  request.add_keys("later");
  request.set_timeout_s(30);
  v1::KvWaitResponse response;
  std::promise<grpc::Status> waited;
  stub->async()->KvWait(&ctx, &request, &response,
                        [&waited](grpc::Status st) { waited.set_value(std::move(st)); });
  CHECK(silent.closedWithin(10000));
  CHECK(std::chrono::steady_clock::now() - start >= 800ms);  // at its bound, not at once
  CHECK(idle.closedWithin(10000));
  CHECK(std::chrono::steady_clock::now() - start >= 1800ms);
  std::this_thread::sleep_for(1s);
  CHECK(channel->GetState(false) == GRPC_CHANNEL_READY);  // the waiting call's connection is kept
  // The client's own connection was idle as long: its next calls connect again.
  CHECK(client.kvGet("idle", "k").value() == "v");
  REQUIRE(client.kvSet("idle", "later", "x").isOk());
  const grpc::Status st = waited.get_future().get();
  INFO(st.error_message());
  REQUIRE(st.ok());
  REQUIRE(response.values_size() == 1);
  CHECK(response.values(0) == "x");
}

TEST_CASE("a throttled protobuf line says how many like it were not logged", "[rendezvous]") {
  CHECK(protobufLogLine("String field 'x' contains invalid UTF-8 data. ", 1) ==
        "String field 'x' contains invalid UTF-8 data.");
  CHECK(protobufLogLine("bad\x1b[2J", 42) ==
        "bad\\x1b[2J (and 41 more like it since the last such line: at most 3 a minute are "
        "logged)");
}

// A host's connections together hold at most --max-streams-per-host streams and waits (each
// connection at most --max-streams-per-peer).
TEST_CASE("a host's connections together are held to --max-streams-per-host",
          "[rendezvous][daemon]") {
  FILE* out = nullptr;
  pid_t pid = spawnDaemon(
      {"--listen", "127.0.0.1:0", "--max-streams-per-peer", "16", "--max-streams-per-host", "24"},
      &out, true);
  ClientOptions options;
  options.endpoint = daemonEndpoint(out);
  REQUIRE(!options.endpoint.empty());
  {
    Client a(options), b(options);
    ChangeLog log;
    std::vector<std::unique_ptr<Watch>> watches;
    for (int i = 0; i < 16; ++i)
      watches.push_back(a.watch("hs", "a" + std::to_string(i), log.onChange()));
    for (int i = 0; i < 8; ++i)
      watches.push_back(b.watch("hs", "b" + std::to_string(i), log.onChange()));
    REQUIRE(log.waitUntil([](const std::vector<RoundChange>& cs) { return cs.size() >= 24; }));
    auto refused = b.kvWait("hs", {"never"}, 30s);
    CHECK(refused.status().code() == StatusCode::kResourceExhausted);
    CHECK_THAT(refused.status().message(),
               Catch::Contains("this client's host already holds 24 watch streams, joins and "
                               "waits: max-streams-per-host = 24 (ddprun-rendezvous "
                               "--max-streams-per-host)"));
    // One of a's ends: b may wait.
    watches.front().reset();
    CHECK(waitUntil([&] {
      return b.kvWait("hs", {"never"}, 50ms).status().code() == StatusCode::kDeadlineExceeded;
    }));
  }
  kill(pid, SIGTERM);
  CHECK(waitExit(pid) == 0);
  const std::string text = readAll(out);
  fclose(out);
  CHECK(ddprun::testing::countOf(text,
                                 "holds 24 streams and waits: refusing more "
                                 "(max-streams-per-host)") == 1);
}

// A hostile client pushes past every bound; the daemon refuses with RESOURCE_EXHAUSTED (or
// INVALID_ARGUMENT) naming it, keeps serving, and its resident memory stays near what the
// quotas allow (without them these writes alone add ~330 MB).
TEST_CASE("the daemon refuses writes and streams past its quotas and its memory stays bounded",
          "[rendezvous][daemon]") {
  FILE* out = nullptr;
  // Under ASan its quarantine is held to 16 MiB, so its resident memory is what it holds.
  pid_t pid = spawnDaemon({"--listen", "127.0.0.1:0", "--max-run-keys", "1000", "--max-kv-bytes",
                           "33554432", "--max-streams-per-peer", "16"},
                          &out, false, ddprun::testing::asanOptionsWithQuarantine(16));
  char line[256] = {0};
  REQUIRE(fgets(line, sizeof line, out) != nullptr);
  std::string text(line);
  REQUIRE(text.rfind("listening on 127.0.0.1:", 0) == 0);
  ClientOptions options;
  options.endpoint = text.substr(13, text.find('\n') - 13);
  Client client(options);
  REQUIRE(client.kvSet("warm-up", "k", "v").isOk());
  const size_t rss_before = residentBytes(pid);
  const std::string mib(1 << 20, 'x');

  // 100 x 1 MiB in one run: the default max-run-kv-bytes (16 MiB) stops it.
  int stored = 0;
  Status refused;
  for (int i = 0; i < 100; ++i) {
    Status st = client.kvSet("big", "k" + std::to_string(i), mib);
    if (st.isOk()) {
      ++stored;
    } else {
      refused = st;
    }
  }
  CHECK(stored == 15);  // 15 x (1 MiB + key) fit in 16 MiB, a 16th does not
  CHECK(refused.code() == StatusCode::kResourceExhausted);
  CHECK_THAT(refused.message(), Catch::Contains("max-run-kv-bytes = 16777216"));

  // 10 runs x 20 MiB: --max-kv-bytes (32 MiB) stops them all together.
  stored = 0;
  for (int r = 0; r < 10; ++r) {
    for (int i = 0; i < 20; ++i) {
      Status st = client.kvSet("spray-" + std::to_string(r), "k" + std::to_string(i), mib);
      if (st.isOk()) {
        ++stored;
      } else {
        refused = st;
      }
    }
  }
  CHECK(stored == 16);  // 32 MiB less the 15 MiB of "big", within each run's 16 MiB
  CHECK(refused.code() == StatusCode::kResourceExhausted);
  CHECK_THAT(refused.message(), Catch::Contains("max-kv-bytes = 33554432"));

  // Many small keys: --max-run-keys.
  stored = 0;
  for (int i = 0; i < 1010; ++i) {
    Status st = client.kvSet("keys", std::to_string(i), "");
    if (st.isOk()) {
      ++stored;
    } else {
      refused = st;
    }
  }
  CHECK(stored == 1000);
  CHECK(refused.code() == StatusCode::kResourceExhausted);
  CHECK_THAT(refused.message(), Catch::Contains("max-run-keys = 1000"));

  // Watch validates its run id as every other call: 20 streams on 1 MB ids are refused.
  {
    Client hostile(options);
    ChangeLog log;
    std::vector<std::unique_ptr<Watch>> watches;
    for (int i = 0; i < 20; ++i) {
      watches.push_back(
          hostile.watch(std::string(1 << 20, char('a' + i)), "", log.onChange(), log.onBreak()));
    }
    std::unique_lock<std::mutex> lock(log.mu);
    REQUIRE(log.cv.wait_for(lock, 20s, [&] { return log.breaks.size() >= 20; }));
    CHECK(log.changes.empty());
    CHECK(log.breaks[0].code() == StatusCode::kInvalidArgument);
    CHECK_THAT(log.breaks[0].message(), Catch::Contains("run id is 1048576 bytes"));
  }

  // One connection holds at most 16 streams and waits (--max-streams-per-peer).
  {
    Client peer(options);
    ChangeLog log;
    std::vector<std::unique_ptr<Watch>> watches;
    for (int i = 0; i < 16; ++i) {
      watches.push_back(peer.watch("streams", "n" + std::to_string(i), log.onChange()));
    }
    REQUIRE(log.waitUntil([](const std::vector<RoundChange>& cs) { return cs.size() >= 16; }));
    auto wait = peer.kvWait("streams", {"never"}, 30s);
    CHECK(wait.status().code() == StatusCode::kResourceExhausted);
    CHECK_THAT(wait.status().message(), Catch::Contains("max-streams-per-peer = 16"));
    // A join waits for its round too: a flood of joins under new node ids (spares) is bounded.
    auto spare = peer.join(joinRequest("streams-join", 2, 2, "spare"));
    CHECK(spare.status().code() == StatusCode::kResourceExhausted);
    CHECK_THAT(spare.status().message(), Catch::Contains("joins and waits"));
    ChangeLog extra_log;
    auto extra = peer.watch("streams", "extra", extra_log.onChange(), extra_log.onBreak());
    {
      std::unique_lock<std::mutex> lock(extra_log.mu);
      REQUIRE(extra_log.cv.wait_for(lock, 20s, [&] { return !extra_log.breaks.empty(); }));
      CHECK(extra_log.breaks[0].code() == StatusCode::kResourceExhausted);
    }
    // An ended stream frees its place; another connection was never limited by this one.
    extra.reset();
    watches.pop_back();
    CHECK(waitUntil([&] {
      return peer.kvWait("streams", {"never"}, 50ms).status().code() ==
             StatusCode::kDeadlineExceeded;
    }));
    // Answered joins free theirs: many in a row on the one place left.
    for (int i = 0; i < 40; ++i) {
      const std::string run = "streams-joined-" + std::to_string(i);
      REQUIRE(peer.join(joinRequest(run, 1, 1, "n")).isOk());
    }
    CHECK(peer.kvWait("streams", {"never"}, 50ms).status().code() == StatusCode::kDeadlineExceeded);
    CHECK(client.kvWait("streams", {"never"}, 50ms).status().code() ==
          StatusCode::kDeadlineExceeded);
  }

  // Still serving, and the memory it holds is what the quotas allow plus slack, not the ~330 MB
  // that was sent.
  REQUIRE(client.kvGet("big", "k0").isOk());
  const size_t rss_after = residentBytes(pid);
  INFO("VmRSS " << rss_before / 1024 << " kB before, " << rss_after / 1024 << " kB after");
  CHECK(rss_after < rss_before + (96u << 20));

  kill(pid, SIGTERM);
  CHECK(waitExit(pid) == 0);
  fclose(out);
}

TEST_CASE("TLS: a client trusting the server's certificate joins, a plaintext one cannot",
          "[rendezvous][grpc][tls]") {
  ServerOptions options = selfSignedTls();
  auto server = startServer(options);

  ClientOptions secure = clientFor(*server);
  secure.tls_root_cert_pem = options.tls_cert_pem;
  secure.tls_server_name = "localhost";
  Client client(secure);
  auto joined = client.join(joinRequest("tls", 1, 1));
  REQUIRE(joined.isOk());

  ClientOptions plain = clientFor(*server);
  plain.retry_timeout = 200ms;
  Client insecure(plain);
  CHECK_FALSE(insecure.kvGet("tls", "k").isOk());
}

TEST_CASE("an agent process killed mid-join is dropped and the others complete without it",
          "[rendezvous][grpc]") {
  auto server = startServer();
  Client probe(clientFor(*server));
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    std::string bin = buildDir() + "/tests/rendezvous/rendezvous_join_probe";
    execl(bin.c_str(), bin.c_str(), server->address().c_str(), "killed", "doomed", "2", "2",
          static_cast<char*>(nullptr));
    _exit(127);
  }
  // The doomed agent is waiting in its join; kill it without any chance to clean up.
  REQUIRE(waitUntil([&] { return probe.heartbeat("killed", "doomed").isOk(); }));
  kill(pid, SIGKILL);
  CHECK(waitExit(pid) == 128 + SIGKILL);
  REQUIRE(waitUntil([&] {
    return probe.heartbeat("killed", "doomed").status().code() == StatusCode::kNotFound;
  }));
  StatusOr<RoundInfo> a = Status(StatusCode::kUnknown, ""), b = a;
  std::thread ta([&] { a = probe.join(joinRequest("killed", 2, 2, "a")); });
  std::thread tb([&] { b = probe.join(joinRequest("killed", 2, 2, "b")); });
  ta.join();
  tb.join();
  REQUIRE(a.isOk());
  REQUIRE(b.isOk());
  for (const auto& p : *a->participants) CHECK(p.node_id != "doomed");
}

TEST_CASE("a node that stops heartbeating is declared dead and watchers are told",
          "[rendezvous][grpc]") {
  auto server = startServer();
  Client client(clientFor(*server));
  ChangeLog log;
  auto watch = client.watch("hb", "a", log.onChange());
  REQUIRE(log.waitUntil([](auto& cs) { return !cs.empty(); }));
  auto fast = [](const std::string& node) {
    auto r = joinRequest("hb", 1, 2, node);
    r.config.last_call_timeout = 30s;  // the first round completes when both are in (max)
    r.config.heartbeat_interval = 100ms;
    r.config.heartbeat_misses = 2;
    return r;
  };
  StatusOr<RoundInfo> a = Status(StatusCode::kUnknown, ""), b = a;
  std::thread ta([&] { a = client.join(fast("a")); });
  std::thread tb([&] { b = client.join(fast("b")); });
  ta.join();
  tb.join();
  REQUIRE(a.isOk());
  REQUIRE(b.isOk());
  REQUIRE(a->round == b->round);
  // a keeps beating until the server gives up on b.
  bool dead_seen = false;
  auto until = std::chrono::steady_clock::now() + 20s;
  while (!dead_seen && std::chrono::steady_clock::now() < until) {
    REQUIRE(client.heartbeat("hb", "a").isOk());
    dead_seen = log.waitUntil(
        [](auto& cs) {
          for (auto& c : cs) {
            if (c.kind == ChangeKind::kRoundPending && c.reason == ChangeReason::kNodeDead &&
                c.node_id == "b") {
              return true;
            }
          }
          return false;
        },
        50ms);
  }
  REQUIRE(dead_seen);
  CHECK(client.heartbeat("hb", "b").status().code() == StatusCode::kNotFound);
  auto again = client.join(fast("a"));
  REQUIRE(again.isOk());
  CHECK(again->group_world_size == 1);
  CHECK(again->group_rank == 0);
}

TEST_CASE("a range delete against a server from before ranges is named, not taken as done",
          "[rendezvous][grpc]") {
  // Such a server reads KvDelete's range end as nothing and deletes the start key alone.
  struct OldServer final : public ddprun::rendezvous::v1::Rendezvous::Service {
    grpc::Status KvDelete(grpc::ServerContext*, const ddprun::rendezvous::v1::KvDeleteRequest* req,
                          ddprun::rendezvous::v1::KvDeleteResponse* resp) override {
      keys.push_back(req->key());
      resp->set_deleted(false);
      return grpc::Status::OK;
    }
    std::vector<std::string> keys;
  } old;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&old);
  auto server = builder.BuildAndStart();
  REQUIRE(server);
  ClientOptions o;
  o.endpoint = "127.0.0.1:" + std::to_string(port);
  Client client(o);
  auto deleted = client.kvDeleteRange("run", "job/", "job/5");
  CHECK(deleted.status().code() == StatusCode::kUnimplemented);
  CHECK_THAT(deleted.status().message(), Catch::Contains("predates range deletes"));
  CHECK(old.keys == std::vector<std::string>{"job/"});
  server->Shutdown();
}
