// Tests of AsyncClient: a real server on 127.0.0.1 (port 0) and a real io_context run by the test
// on a thread of its own, standing in for the agent's event loop.
#include "ddprun/rendezvous/async_client.h"

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <catch2/catch.hpp>
#include <condition_variable>
#include <cstdlib>
#include <future>
#include <mutex>
#include <thread>

#include "ddprun/rendezvous/client.h"
#include "ddprun/rendezvous/server.h"
#include "log_capture.h"
#include "server_fixture.h"

using namespace ddprun;
using namespace ddprun::rendezvous;
using namespace std::chrono_literals;
using ddprun::rendezvous::testing::selfSignedTls;
using ddprun::rendezvous::testing::startServer;
using ddprun::rendezvous::testing::waitUntil;

namespace {

// The caller's event loop: one thread running an io_context until destroyed.
struct Loop {
  Loop() : work(boost::asio::make_work_guard(io)), thread([this] { io.run(); }) {}
  ~Loop() {
    work.reset();
    thread.join();
  }
  bool onLoop() const { return std::this_thread::get_id() == thread.get_id(); }
  // Runs `fn` on the loop and waits for it.
  template <typename F>
  void run(F fn) {
    std::promise<void> done;
    boost::asio::post(io, [&] {
      fn();
      done.set_value();
    });
    done.get_future().get();
  }

  boost::asio::io_context io;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work;
  std::thread thread;
};

// Results of callbacks, with the thread they ran on.
template <typename T>
struct Results {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<T> values;
  bool all_on_loop = true;

  std::function<void(T)> callback(const Loop& loop) {
    return [this, &loop](T v) {
      std::lock_guard<std::mutex> lock(mu);
      all_on_loop = all_on_loop && loop.onLoop();
      values.push_back(std::move(v));
      cv.notify_all();
    };
  }
  bool waitFor(size_t n, Duration bound = 20s) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, bound, [&] { return values.size() >= n; });
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mu);
    return values.size();
  }
};

ClientOptions clientFor(const std::string& address) {
  ClientOptions o;
  o.endpoint = address;
  o.retry_timeout = 20s;
  return o;
}

JoinRequest joinRequest(const std::string& run, uint32_t min, uint32_t max,
                        const std::string& node_id) {
  JoinRequest r;
  r.run_id = run;
  r.node_id = node_id;
  r.address = "127.0.0.1";
  r.config.min_nodes = min;
  r.config.max_nodes = max;
  r.config.last_call_timeout = 100ms;
  r.join_timeout = 30s;
  return r;
}

// A port nothing listens on right now (bound once, then released).
int freePort() {
  boost::asio::io_context io;
  boost::asio::ip::tcp::acceptor acceptor(
      io, boost::asio::ip::tcp::endpoint(boost::asio::ip::make_address("127.0.0.1"), 0));
  return acceptor.local_endpoint().port();
}

}  // namespace

TEST_CASE("an async join reports its round through its callback, on the caller's io thread",
          "[rendezvous][async]") {
  auto server = startServer();
  Loop loop;
  AsyncClient client(loop.io, clientFor(server->address()));
  Results<StatusOr<RoundInfo>> joins;
  client.join(joinRequest("async", 2, 2, "a"), joins.callback(loop));
  client.join(joinRequest("async", 2, 2, "b"), joins.callback(loop));
  REQUIRE(joins.waitFor(2));
  CHECK(joins.all_on_loop);
  REQUIRE(joins.values[0].isOk());
  REQUIRE(joins.values[1].isOk());
  CHECK(joins.values[0]->group_rank + joins.values[1]->group_rank == 1);
  CHECK(joins.values[0]->participants->size() == 2);

  // The master of the round, typed end to end.
  const RoundInfo& rank0 = joins.values[0]->group_rank == 0 ? *joins.values[0] : *joins.values[1];
  Results<Status> published;
  Results<StatusOr<MasterAddress>> masters;
  client.waitMaster("async", rank0.round, 10s, masters.callback(loop));
  client.publishMaster("async", rank0.node_id, rank0.round, {"10.1.2.3", 29500},
                       published.callback(loop));
  REQUIRE(published.waitFor(1));
  CHECK(published.values[0].isOk());
  REQUIRE(masters.waitFor(1));
  REQUIRE(masters.values[0].isOk());
  CHECK(masters.values[0]->addr == "10.1.2.3");
  CHECK(masters.values[0]->port == 29500);
  CHECK(masters.all_on_loop);
  loop.run([&] {});  // the client is destroyed before the loop
}

TEST_CASE("heartbeats from the io loop keep a node alive, and without them it is declared dead",
          "[rendezvous][async]") {
  auto server = startServer();
  Loop loop;
  AsyncClient client(loop.io, clientFor(server->address()));
  Results<RoundChange> changes;
  auto watch = client.watch("alive", "", changes.callback(loop));
  auto req = joinRequest("alive", 1, 1, "a");
  req.config.heartbeat_interval = 200ms;
  req.config.heartbeat_misses = 5;  // dead after 1 s of silence: room for a loaded machine
  Results<StatusOr<RoundInfo>> joined;
  client.join(req, joined.callback(loop));
  REQUIRE(joined.waitFor(1));
  REQUIRE(joined.values[0].isOk());

  // A heartbeat every 50 ms on an Asio timer of the loop, as the agent does.
  std::atomic<bool> beating{true};
  std::atomic<int> beats{0};
  boost::asio::steady_timer timer(loop.io);
  std::function<void()> beat = [&] {
    if (!beating) return;
    client.heartbeat("alive", "a", [&](StatusOr<RunStatus> s) {
      if (s.isOk()) ++beats;
      if (!beating) return;
      timer.expires_after(50ms);
      timer.async_wait([&](const boost::system::error_code& ec) {
        if (!ec) beat();
      });
    });
  };
  loop.run(beat);
  auto dead = [&] {
    std::lock_guard<std::mutex> lock(changes.mu);
    for (auto& c : changes.values) {
      if (c.reason == ChangeReason::kNodeDead) return true;
    }
    return false;
  };
  std::this_thread::sleep_for(1500ms);  // more than the expiry: a duration, not an event
  CHECK_FALSE(dead());
  CHECK(beats > 5);
  beating = false;
  loop.run([&] { timer.cancel(); });
  REQUIRE(waitUntil(dead));
  Results<StatusOr<RunStatus>> after;
  client.heartbeat("alive", "a", after.callback(loop));
  REQUIRE(after.waitFor(1));
  CHECK(after.values[0].status().code() == StatusCode::kNotFound);
  loop.run([&] { watch.reset(); });
}

TEST_CASE("cancelAll completes the calls in flight with CANCELLED, callbacks still posted",
          "[rendezvous][async]") {
  auto server = startServer();
  Loop loop;
  AsyncClient client(loop.io, clientFor(server->address()));
  Client probe(clientFor(server->address()));
  Results<StatusOr<RoundInfo>> joins;
  Results<StatusOr<std::vector<std::string>>> waits;
  client.join(joinRequest("cancel", 2, 2, "victim"), joins.callback(loop));
  client.kvWait("cancel", {"never"}, 30s, waits.callback(loop));
  REQUIRE(waitUntil([&] { return probe.heartbeat("cancel", "victim").isOk(); }));
  client.cancelAll();
  REQUIRE(joins.waitFor(1));
  REQUIRE(waits.waitFor(1));
  CHECK(joins.values[0].status().code() == StatusCode::kCancelled);
  CHECK(waits.values[0].status().code() == StatusCode::kCancelled);
  CHECK(joins.all_on_loop);
  CHECK(waits.all_on_loop);
  // The server forgot the victim's join.
  REQUIRE(waitUntil([&] {
    return probe.heartbeat("cancel", "victim").status().code() == StatusCode::kNotFound;
  }));
  // Calls after cancelAll are not affected.
  Results<Status> set;
  client.kvSet("cancel", "k", "v", set.callback(loop));
  REQUIRE(set.waitFor(1));
  CHECK(set.values[0].isOk());
}

TEST_CASE("destroying the client cancels an abandoned async join and no callback runs after it",
          "[rendezvous][async]") {
  auto server = startServer();
  Loop loop;
  Client probe(clientFor(server->address()));
  std::atomic<int> callbacks{0};
  auto client = std::make_unique<AsyncClient>(loop.io, clientFor(server->address()));
  client->join(joinRequest("abandoned", 2, 2, "lonely"), [&](StatusOr<RoundInfo>) { ++callbacks; });
  client->kvWait("abandoned", {"never"}, 30s,
                 [&](StatusOr<std::vector<std::string>>) { ++callbacks; });
  REQUIRE(waitUntil([&] { return probe.heartbeat("abandoned", "lonely").isOk(); }));
  loop.run([&] { client.reset(); });  // on the loop, as the agent would
  // The join was cancelled: the server drops the node that no longer waits.
  REQUIRE(waitUntil([&] {
    return probe.heartbeat("abandoned", "lonely").status().code() == StatusCode::kNotFound;
  }));
  loop.run([&] {});  // whatever was posted before has run
  CHECK(callbacks == 0);
}

TEST_CASE("a client may be destroyed off the loop while calls are in flight",
          "[rendezvous][async]") {
  auto server = startServer();
  Loop loop;
  std::atomic<int> callbacks{0};
  {
    AsyncClient client(loop.io, clientFor(server->address()));
    for (int i = 0; i < 20; ++i) {
      client.kvWait("offloop", {"k" + std::to_string(i)}, 30s,
                    [&](StatusOr<std::vector<std::string>>) { ++callbacks; });
    }
  }
  loop.run([&] {});
  CHECK(callbacks == 0);
}

TEST_CASE("async calls are retried across a server restart", "[rendezvous][async]") {
  auto server = startServer();
  const std::string address = server->address();
  Loop loop;
  AsyncClient client(loop.io, clientFor(address));
  Results<Status> first;
  client.kvSet("restart", "k", "v1", first.callback(loop));
  REQUIRE(first.waitFor(1));
  REQUIRE(first.values[0].isOk());

  server->shutdown();
  server.reset();
  Results<Status> second;
  client.kvSet("restart", "k", "v2", second.callback(loop));
  std::this_thread::sleep_for(200ms);  // let a few attempts fail: the scenario, not a wait
  CHECK(second.size() == 0);
  ServerOptions options;
  options.listen = address;
  auto restarted = startServer(options);
  REQUIRE(second.waitFor(1));
  CHECK(second.values[0].isOk());
  CHECK(second.all_on_loop);

  // With no retry budget an unreachable server fails at once.
  restarted->shutdown();
  Results<Status> once;
  CallOptions no_retry;
  no_retry.retry_timeout = Duration::zero();
  no_retry.rpc_timeout = 2s;
  client.kvSet("restart", "k", "v3", once.callback(loop), no_retry);
  REQUIRE(once.waitFor(1));
  CHECK(once.values[0].code() == StatusCode::kUnavailable);
}

TEST_CASE(
    "calls retried while the server cannot be reached warn every so often, not only at "
    "their end",
    "[rendezvous][async]") {
  ddprun::testing::LogCapture log("rendezvous");
  Loop loop;
  const std::string address = "127.0.0.1:" + std::to_string(freePort());
  ClientOptions options = clientFor(address);
  options.retry_timeout = 2500ms;
  options.max_backoff = 100ms;
  options.unreachable_notice_every = 700ms;
  AsyncClient client(loop.io, options);
  Results<Status> done;
  client.kvSet("away", "k", "v", done.callback(loop));
  REQUIRE(done.waitFor(1));
  CHECK(done.values[0].code() == StatusCode::kUnavailable);
  INFO(log.text());
  // At 0.7 s, 1.4 s and 2.1 s of the 2.5 s (give or take a backoff): each says how long so far.
  const int notices = log.count("warning: cannot reach the rendezvous at " + address + " for ");
  CHECK(notices >= 2);
  CHECK(notices <= 3);
  CHECK(log.text().find("s more") != std::string::npos);
  // A server that answers again: the next call goes through (its channel may first wait out a
  // reconnect backoff, and say so).
  ServerOptions listen;
  listen.listen = address;
  auto server = startServer(listen);
  Results<Status> after;
  client.kvSet("away", "k", "v", after.callback(loop));
  REQUIRE(after.waitFor(1));
  CHECK(after.values[0].isOk());
}

TEST_CASE("a watch delivers the snapshot and a membership change on the io thread",
          "[rendezvous][async]") {
  auto server = startServer();
  Loop loop;
  AsyncClient client(loop.io, clientFor(server->address()));
  Results<RoundChange> changes;
  auto watch = client.watch("members", "", changes.callback(loop));
  REQUIRE(changes.waitFor(1));
  CHECK(changes.values[0].kind == ChangeKind::kSnapshot);

  Results<StatusOr<RoundInfo>> joins;
  client.join(joinRequest("members", 1, 2, "a"), joins.callback(loop));
  REQUIRE(joins.waitFor(1));
  REQUIRE(joins.values[0].isOk());
  client.join(joinRequest("members", 1, 2, "b"), joins.callback(loop));
  auto pending_for_b = [&] {
    std::lock_guard<std::mutex> lock(changes.mu);
    for (auto& c : changes.values) {
      if (c.kind == ChangeKind::kRoundPending && c.reason == ChangeReason::kNodeJoined &&
          c.node_id == "b") {
        return true;
      }
    }
    return false;
  };
  REQUIRE(waitUntil(pending_for_b));
  CHECK(changes.all_on_loop);
  client.cancelAll();
  REQUIRE(joins.waitFor(2));
  loop.run([&] { watch.reset(); });
}

TEST_CASE("TLS: a client started before its server's listener still joins",
          "[rendezvous][async][tls]") {
  ServerOptions options = selfSignedTls();
  options.listen = "127.0.0.1:" + std::to_string(freePort());

  Loop loop;
  ClientOptions co = clientFor(options.listen);
  co.tls_root_cert_pem = options.tls_cert_pem;
  co.tls_server_name = "localhost";
  AsyncClient client(loop.io, co);
  Results<StatusOr<RoundInfo>> joins;
  client.join(joinRequest("tls-late", 1, 1, "a"), joins.callback(loop));
  std::this_thread::sleep_for(500ms);  // the client starts first: the scenario, not a wait
  CHECK(joins.size() == 0);
  auto server = startServer(options);
  REQUIRE(joins.waitFor(1));
  REQUIRE(joins.values[0].isOk());
  CHECK(joins.values[0]->group_world_size == 1);
}
