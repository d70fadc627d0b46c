// rendezvous_bench: N simulated agents against an embedded RendezvousServer on 127.0.0.1.
//
// For each N it measures
//   round: time from the last agent's Join to every agent holding its rank (min = max = N, so
//          the last join completes the round), and, with all N re-joining at once after a
//          failure, from the first Join to every agent holding its rank;
//   change delivery: every agent watches the run through the client library; one agent reports
//          a failure, and we take the time until each watcher's stream delivered the change.
// Joins use the gRPC callback API directly (thousands of agents, no thread each); watchers use
// ddprun::rendezvous::Client::watch, the code path the agent uses.
//
// usage: rendezvous_bench [--sizes 2,8,64,512,4096] [--trials 3] [--participants auto|on|off]
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <mutex>
#include <string>
#include <vector>

#include "bench_stats.h"
#include "ddprun/common/log.h"
#include "ddprun/common/strings.h"
#include "ddprun/rendezvous/client.h"
#include "ddprun/rendezvous/server.h"
#include "ddprun/rendezvous/v1/rendezvous.grpc.pb.h"

namespace pb = ddprun::rendezvous::v1;
using namespace ddprun;
using namespace ddprun::rendezvous;
using ddprun::bench_stats::BenchClock;
using ddprun::bench_stats::ms;
using ddprun::bench_stats::percentile;

namespace {

class Agents {
 public:
  Agents(const std::string& endpoint, int n, std::string run, bool participants)
      : n_(n), run_(std::move(run)), participants_(participants) {
    const int channels = std::min(n, 16);
    for (int i = 0; i < channels; ++i) {
      grpc::ChannelArguments args;
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
      args.SetMaxReceiveMessageSize(256 << 20);
      stubs_.push_back(pb::Rendezvous::NewStub(
          grpc::CreateCustomChannel(endpoint, grpc::InsecureChannelCredentials(), args)));
    }
  }

  struct Call {
    grpc::ClientContext ctx;
    pb::JoinRequest req;
    pb::JoinResponse resp;
  };

  // Starts agent i's join; completion is counted in done_.
  void startJoin(int i) {
    auto& call = calls_[i];
    call = std::make_unique<Call>();
    call->req.set_run_id(run_);
    call->req.set_node_id("n" + std::to_string(i));
    call->req.set_address("127.0.0." + std::to_string(1 + i % 250));
    call->req.set_local_world_size(1 + i % 4);
    call->req.mutable_config()->set_min_nodes(n_);
    call->req.mutable_config()->set_max_nodes(n_);
    call->req.mutable_config()->set_last_call_timeout_s(30);
    call->req.mutable_config()->set_heartbeat_interval_s(600);
    call->req.mutable_config()->set_heartbeat_misses(3);
    call->req.set_join_timeout_s(120);
    call->req.set_include_participants(participants_);
    call->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(150));
    stubs_[i % stubs_.size()]->async()->Join(&call->ctx, &call->req, &call->resp,
                                             [this, i](grpc::Status s) {
                                               std::lock_guard<std::mutex> lock(mu_);
                                               if (!s.ok()) {
                                                 ++failed_;
                                                 error_ = s.error_message();
                                               }
                                               done_at_[i] = BenchClock::now();
                                               ++done_;
                                               cv_.notify_all();
                                             });
  }

  // Staggered round: agents 0..n-2 join, we wait until the server knows all of them, then agent
  // n-1 joins; returns last join -> all held in ms. Burst round: all n join at once (agents
  // restarting after a failure); returns first join -> all held in ms.
  double round(bool burst) {
    calls_.clear();
    calls_.resize(n_);
    done_at_.assign(n_, BenchClock::time_point{});
    done_ = 0;
    failed_ = 0;
    auto first = BenchClock::now();
    for (int i = 0; i < n_ - 1; ++i) startJoin(i);
    // Wait until every early joiner is registered (a heartbeat answers for a pending joiner).
    for (int i = 0; i < n_ - 1 && !burst; ++i) {
      for (;;) {
        grpc::ClientContext ctx;
        pb::RunRef ref;
        ref.set_run_id(run_);
        ref.set_node_id("n" + std::to_string(i));
        pb::HeartbeatResponse resp;
        if (stubs_[0]->Heartbeat(&ctx, ref, &resp).ok()) break;
      }
    }
    auto last = BenchClock::now();
    startJoin(n_ - 1);
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_ == n_; });
    if (failed_ != 0) {
      std::cerr << failed_ << " joins failed: " << error_ << std::endl;
      std::exit(1);
    }
    auto all = *std::max_element(done_at_.begin(), done_at_.end());
    // Sanity: one round, distinct ranks 0..n-1.
    std::vector<bool> seen(n_, false);
    for (auto& c : calls_) {
      uint32_t r = c->resp.group_rank();
      if (r >= static_cast<uint32_t>(n_) || seen[r] ||
          c->resp.group_world_size() != static_cast<uint32_t>(n_)) {
        std::cerr << "bad round result" << std::endl;
        std::exit(1);
      }
      seen[r] = true;
    }
    round_no_ = calls_[0]->resp.round();
    return burst ? ms(all - first) : ms(all - last);
  }

  uint64_t roundNo() const { return round_no_; }

 private:
  int n_;
  std::string run_;
  bool participants_;
  std::vector<std::unique_ptr<pb::Rendezvous::Stub>> stubs_;
  std::vector<std::unique_ptr<Call>> calls_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<BenchClock::time_point> done_at_;
  int done_ = 0;
  int failed_ = 0;
  std::string error_;
  uint64_t round_no_ = 0;
};

struct Result {
  int n;
  bool participants;
  std::vector<double> round_ms, first_ms, change_ms;
};

Result bench(const std::string& endpoint, int n, int trials, bool participants) {
  Result res{n, participants, {}, {}, {}};
  const std::string run = "bench-" + std::to_string(n) + (participants ? "-p" : "");
  Agents agents(endpoint, n, run, participants);

  // Watchers: one per agent, through the client library (a few clients share connections).
  std::mutex mu;
  std::condition_variable cv;
  uint64_t target_round = 0;
  std::vector<BenchClock::time_point> got(n);
  int delivered = 0;
  int subscribed = 0;
  std::vector<std::unique_ptr<Client>> clients;
  std::vector<std::unique_ptr<Watch>> watches;
  {
    for (int c = 0; c < std::min(n, 16); ++c) {
      ClientOptions o;
      o.endpoint = endpoint;
      clients.push_back(std::make_unique<Client>(o));
    }
    for (int i = 0; i < n; ++i) {
      watches.push_back(clients[i % clients.size()]->watch(
          run, "n" + std::to_string(i), [&, i](const RoundChange& c) {
            auto now = BenchClock::now();
            std::lock_guard<std::mutex> lock(mu);
            if (c.kind == ChangeKind::kSnapshot) {
              ++subscribed;
            } else if (c.kind == ChangeKind::kRoundPending && c.round == target_round) {
              got[i] = now;
              ++delivered;
            }
            cv.notify_all();
          }));
    }
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return subscribed >= n; });
  }

  ClientOptions o;
  o.endpoint = endpoint;
  Client control(o);
  auto fail = [&] {
    auto next = control.reportFailure(run, "n0", agents.roundNo());
    if (!next.isOk() || next.value() != agents.roundNo() + 1) {
      std::cerr << "reportFailure: " << next.status() << std::endl;
      std::exit(1);
    }
  };
  for (int t = 0; t < trials; ++t) {
    if (t > 0) fail();  // open the next round for the staggered measurement
    res.round_ms.push_back(agents.round(false));
    {
      std::lock_guard<std::mutex> lock(mu);
      target_round = agents.roundNo() + 1;
      delivered = 0;
    }
    auto start = BenchClock::now();
    fail();
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return delivered == n; });
      for (auto& g : got) res.change_ms.push_back(ms(g - start));
    }
    // Every agent re-joins at once, as after a failure.
    res.first_ms.push_back(agents.round(true));
  }
  watches.clear();
  return res;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> sizes = {2, 8, 64, 512, 4096};
  int trials = 3;
  std::string participants = "auto";
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--sizes") {
      sizes.clear();
      for (auto& s : split(value, ',')) sizes.push_back(static_cast<int>(*parseInt(s)));
    } else if (flag == "--trials") {
      trials = static_cast<int>(*parseInt(value));
    } else if (flag == "--participants") {
      participants = value;
    } else {
      std::cerr << "unknown flag " << flag << std::endl;
      return 2;
    }
  }
  logger("rendezvous");  // create it, so the level applies
  setLogLevel("warn");
  auto server = RendezvousServer::start({});
  if (!server.isOk()) {
    std::cerr << server.status() << std::endl;
    return 1;
  }
  const std::string endpoint = server.value()->address();
  std::printf(
      "| N | participant list in Join reply | last join -> all ranks held (ms, median of %d) "
      "| all re-join at once after a failure -> all held (ms) | change delivery p50 (ms) | p99 "
      "(ms) | max (ms) |\n",
      trials);
  std::printf("|---|---|---|---|---|---|---|\n");
  for (int n : sizes) {
    std::vector<bool> modes;
    if (participants == "on")
      modes = {true};
    else if (participants == "off")
      modes = {false};
    else
      modes = n >= 512 ? std::vector<bool>{true, false} : std::vector<bool>{true};
    for (bool p : modes) {
      Result r = bench(endpoint, n, trials, p);
      std::printf("| %d | %s | %.1f | %.1f | %.2f | %.2f | %.2f |\n", n, p ? "yes" : "no",
                  percentile(r.round_ms, 0.5), percentile(r.first_ms, 0.5),
                  percentile(r.change_ms, 0.5), percentile(r.change_ms, 0.99),
                  percentile(r.change_ms, 1.0));
      std::fflush(stdout);
    }
  }
  server.value()->shutdown();
  return 0;
}
