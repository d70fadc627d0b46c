// etcd-v3 rendezvous benchmark: N simulated agents (one EtcdRendezvousService each, all on one
// io_context in this process) against an etcd given on the command line.
//
// Measured, as rendezvous_bench.cc measures the gRPC rendezvous:
// - last join -> all ranks held: --nnodes=N:N; N-1 agents join and wait (their joins are in the
//   stored state before the clock starts), then the last agent joins; time until every agent's
//   join has returned its rank.
// - change delivery: one agent reports a failure; time from the call until each agent's watch
//   got the ROUND_PENDING change (p50/p99/max over all agents x trials).
// Every simulated agent imports each pushed state (O(N) to parse) on the one loop of this
// process, so at large N the times include N x that work on 2 cores, which real agents (one
// process each) do not share.
//
// - etcd's own cost (--probe K): K linearizable Ranges of one key and K compare-revision Txns
//   that put a value of the size the N=8 state has, one at a time from one client; what the
//   member takes for one read and for one committed write (its fsync included), with no
//   rendezvous code around them.
//
// usage: etcd_bench --endpoints 127.0.0.1:2379 [--sizes 8,64,512] [--trials 3] [--probe 200]
#include <algorithm>
#include <boost/asio/io_context.hpp>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "bench_stats.h"
#include "client.h"
#include "ddprun/common/log.h"
#include "ddprun/common/strings.h"
#include "ddprun/etcd/rendezvous_service.h"
#include "ddprun/rendezvous/state.h"
#include "state_value.h"

using namespace ddprun;
using namespace ddprun::etcd;
using ddprun::bench_stats::BenchClock;
using ddprun::bench_stats::ms;
using ddprun::bench_stats::percentile;

namespace {

struct Result {
  double round_ms = 0;
  std::vector<double> delivery_ms;
};

bool runUntil(boost::asio::io_context& io, const std::function<bool()>& pred,
              std::chrono::seconds bound) {
  const auto deadline = BenchClock::now() + bound;
  while (!pred()) {
    if (BenchClock::now() >= deadline) return false;
    io.restart();
    io.run_for(std::chrono::milliseconds(1));
  }
  return true;
}

// Runs the loop until it has been idle for `quiet`: every agent has processed what etcd pushed
// so far (all agents share this process's one loop, so a backlog would be measured otherwise).
void drain(boost::asio::io_context& io, std::chrono::milliseconds quiet) {
  auto idle_since = BenchClock::now();
  while (BenchClock::now() - idle_since < quiet) {
    io.restart();
    if (io.poll() > 0) {
      idle_since = BenchClock::now();
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
}

// How many joiners the stored state of `run` holds in its forming round.
uint32_t waiting(EtcdClient& client, const std::string& prefix, const std::string& run) {
  etcdserverpb::RangeRequest req;
  req.set_key(prefix + "/state");
  etcdserverpb::RangeResponse resp;
  if (!client.range(req, &resp).isOk() || resp.kvs_size() == 0) return 0;
  auto value = StateValue::parse(std::make_shared<const std::string>(resp.kvs(0).value()));
  rendezvous::RendezvousState st;
  if (!value.isOk()) return 0;
  auto snapshot = value->snapshot();
  if (!snapshot.isOk() || !st.importRun(run, snapshot.value()).isOk()) return 0;
  auto status = st.status(run);
  return status.isOk() ? status.value().waiting : 0;
}

std::optional<Result> trial(const std::string& endpoints, int n, int trial_no) {
  boost::asio::io_context io;
  const std::string run = "bench-" + std::to_string(::getpid()) + "-" + std::to_string(n) + "-" +
                          std::to_string(trial_no);
  rendezvous::RunConfig config;
  config.min_nodes = static_cast<uint32_t>(n);
  config.max_nodes = static_cast<uint32_t>(n);
  config.last_call_timeout = std::chrono::seconds(30);
  config.heartbeat_interval = std::chrono::seconds(2);
  config.heartbeat_misses = 3;
  std::vector<std::unique_ptr<EtcdRendezvousService>> agents;
  std::vector<std::optional<BenchClock::time_point>> got_change(n);
  std::optional<BenchClock::time_point> report_at;
  for (int i = 0; i < n; ++i) {
    EtcdServiceOptions o;
    o.run_id = run;
    o.endpoints = endpoints;
    o.run_config = config;
    o.connect_for = std::chrono::seconds(60);
    agents.push_back(std::make_unique<EtcdRendezvousService>(io, std::move(o)));
    agents.back()->watch("", [&got_change, &report_at, i](const rendezvous::RoundChange& c) {
      if (report_at && c.kind == rendezvous::ChangeKind::kRoundPending &&
          c.reason == rendezvous::ChangeReason::kFailureReported && !got_change[i]) {
        got_change[i] = BenchClock::now();
      }
    });
  }
  std::vector<std::optional<StatusOr<rendezvous::RoundInfo>>> joined(n);
  auto join = [&](int i) {
    rendezvous::JoinRequest req;
    req.run_id = run;
    req.address = "127.0.0.1";
    req.local_world_size = 1;
    req.config = config;
    req.join_timeout = std::chrono::seconds(600);
    agents[i]->join(req, [&joined, i](StatusOr<rendezvous::RoundInfo> r) { joined[i] = r; });
  };
  EtcdOptions co;
  co.endpoints = splitEtcdEndpoints(endpoints).value();
  EtcdClient probe(co);
  const std::string prefix = "/ddprun/rdzv/" + run;
  // N-1 joiners, in waves of 16 so their transactions do not all conflict at once.
  for (int i = 0; i < n - 1; i += 16) {
    const int end = std::min(n - 1, i + 16);
    for (int j = i; j < end; ++j) join(j);
    if (!runUntil(
            io, [&] { return waiting(probe, prefix, run) >= static_cast<uint32_t>(end); },
            std::chrono::seconds(120))) {
      std::fprintf(stderr, "N=%d: joiners did not all arrive\n", n);
      return std::nullopt;
    }
  }
  drain(io, std::chrono::milliseconds(300));
  Result r;
  const auto t0 = BenchClock::now();
  join(n - 1);
  auto all_joined = [&] {
    for (auto& j : joined) {
      if (!j) return false;
    }
    return true;
  };
  if (!runUntil(io, all_joined, std::chrono::seconds(120))) return std::nullopt;
  r.round_ms = ms(BenchClock::now() - t0);
  for (auto& j : joined) {
    if (!j->isOk()) {
      std::fprintf(stderr, "join failed: %s\n", j->status().toString().c_str());
      return std::nullopt;
    }
  }
  drain(io, std::chrono::milliseconds(300));
  // Change delivery: agent 0 reports a failure of round 1.
  report_at = BenchClock::now();
  agents[0]->reportFailure(joined[0]->value().node_id, 1, rendezvous::FailureKind::kWorkers,
                           [](StatusOr<uint64_t>) {});
  auto all_told = [&] {
    for (auto& g : got_change) {
      if (!g) return false;
    }
    return true;
  };
  if (!runUntil(io, all_told, std::chrono::seconds(60))) return std::nullopt;
  for (auto& g : got_change) r.delivery_ms.push_back(ms(*g - *report_at));
  // Leave quietly: close the run, then tear the agents down.
  bool closed = false;
  agents[0]->close({}, [&](Status) { closed = true; });
  runUntil(
      io, [&] { return closed; }, std::chrono::seconds(30));
  agents.clear();
  return r;
}

// Times one Range and one compare-revision Txn (put) against the member, `k` of each.
void probe(const std::string& endpoints, int k) {
  EtcdOptions co;
  co.endpoints = splitEtcdEndpoints(endpoints).value();
  EtcdClient client(co);
  const std::string key = "/ddprun/bench-probe/" + std::to_string(::getpid());
  const std::string value(1200, 'x');  // about the size of the stored state of an N=8 run
  int64_t mod = 0;
  std::vector<double> reads, writes;
  for (int i = 0; i < k; ++i) {
    etcdserverpb::TxnRequest txn;
    etcdserverpb::Compare* cmp = txn.add_compare();
    cmp->set_key(key);
    cmp->set_result(etcdserverpb::Compare::EQUAL);
    cmp->set_target(etcdserverpb::Compare::MOD);
    cmp->set_mod_revision(mod);
    etcdserverpb::PutRequest* put = txn.add_success()->mutable_request_put();
    put->set_key(key);
    put->set_value(value);
    txn.add_failure()->mutable_request_range()->set_key(key);
    etcdserverpb::TxnResponse tr;
    auto t0 = BenchClock::now();
    if (!client.txn(txn, &tr).isOk() || !tr.succeeded()) {
      std::fprintf(stderr, "probe: txn failed\n");
      return;
    }
    writes.push_back(ms(BenchClock::now() - t0));
    mod = tr.header().revision();
    etcdserverpb::RangeRequest range;
    range.set_key(key);
    etcdserverpb::RangeResponse rr;
    t0 = BenchClock::now();
    if (!client.range(range, &rr).isOk()) return;
    reads.push_back(ms(BenchClock::now() - t0));
  }
  etcdserverpb::DeleteRangeRequest del;
  del.set_key(key);
  (void)client.deleteRange(del);
  std::printf("| etcd alone (%d each) | p50 (ms) | p90 (ms) | max (ms) |\n|---|---|---|---|\n", k);
  std::printf("| Range (linearizable read) | %.2f | %.2f | %.2f |\n", percentile(reads, 0.5),
              percentile(reads, 0.9), percentile(reads, 1.0));
  std::printf("| Txn compare-revision + put | %.2f | %.2f | %.2f |\n", percentile(writes, 0.5),
              percentile(writes, 0.9), percentile(writes, 1.0));
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  std::string endpoints = "127.0.0.1:2379";
  std::vector<int> sizes = {8, 64, 512};
  int trials = 3;
  int probe_count = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--endpoints") {
      endpoints = value;
    } else if (flag == "--sizes") {
      sizes.clear();
      for (const auto& s : split(value, ',')) sizes.push_back(std::stoi(s));
    } else if (flag == "--trials") {
      trials = std::stoi(value);
    } else if (flag == "--probe") {
      probe_count = std::stoi(value);
    }
  }
  setLogLevel("warn");
  if (probe_count > 0) {
    probe(endpoints, probe_count);
    std::printf("\n");
  }
  std::printf(
      "| N | last join -> all ranks held (ms), median | trials (ms) | change delivery p50 (ms) | "
      "p99 (ms) | max (ms) |\n");
  std::printf("|---|---|---|---|---|---|\n");
  for (int n : sizes) {
    std::vector<double> rounds, delivery;
    std::string each;
    for (int t = 0; t < trials; ++t) {
      auto r = trial(endpoints, n, t);
      if (!r) {
        std::fprintf(stderr, "N=%d trial %d failed\n", n, t);
        continue;
      }
      rounds.push_back(r->round_ms);
      char one[32];
      std::snprintf(one, sizeof(one), "%s%.1f", each.empty() ? "" : ", ", r->round_ms);
      each += one;
      delivery.insert(delivery.end(), r->delivery_ms.begin(), r->delivery_ms.end());
    }
    std::printf("| %d | %.1f | %s | %.2f | %.2f | %.2f |\n", n, percentile(rounds, 0.5),
                each.c_str(), percentile(delivery, 0.5), percentile(delivery, 0.99),
                percentile(delivery, 1.0));
    std::fflush(stdout);
  }
  return 0;
}
