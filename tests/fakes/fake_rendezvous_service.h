// FakeRendezvousService: a RendezvousService that records every call and answers only when the
// test says so. Answers are posted to the io_context, as the real service's are; the test runs
// them with poll(). cancelAll() answers everything pending with CANCELLED, as gRPC does.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "ddprun/agent/rendezvous_service.h"

namespace ddprun::testing {

class FakeRendezvousService final : public agent::RendezvousService {
 public:
  template <typename Callback>
  using Queue = std::deque<std::pair<std::string, Callback>>;  // (what was asked, callback)

  explicit FakeRendezvousService(boost::asio::io_context& io) : io_(io) {}

  void join(const rendezvous::JoinRequest& req, Done<rendezvous::RoundInfo> done) override {
    record("join");
    last_join = req;
    joins.emplace_back(req.node_id, std::move(done));
  }
  void heartbeat(const std::string& node_id, agent::CallPolicy policy,
                 Done<rendezvous::RunStatus> done) override {
    heartbeat_policy = policy;
    heartbeats.emplace_back(node_id, std::move(done));
  }
  void leave(const std::string& node_id, agent::CallPolicy, StatusDone done) override {
    record("leave");
    leaves.emplace_back(node_id, std::move(done));
  }
  void reportFailure(const std::string& node_id, uint64_t round, rendezvous::FailureKind kind,
                     Done<uint64_t> done) override {
    record("reportFailure");
    failure_reports.emplace_back(
        node_id + "@" + std::to_string(round) +
            (kind == rendezvous::FailureKind::kRecovery ? "/recovery" : ""),
        std::move(done));
  }
  void close(agent::CallPolicy, StatusDone done) override {
    record("close");
    closes.emplace_back("", std::move(done));
  }
  void publishMaster(const std::string& node_id, uint64_t round,
                     const rendezvous::MasterAddress& master, StatusDone done) override {
    record("publishMaster");
    publishes.emplace_back(master.addr + ":" + std::to_string(master.port), std::move(done));
  }
  void waitMaster(uint64_t round, Duration, Done<rendezvous::MasterAddress> done) override {
    record("waitMaster");
    master_waits.emplace_back(std::to_string(round), std::move(done));
  }
  void kvSet(const std::string& key, const std::string& value, agent::CallPolicy,
             StatusDone done) override {
    record("kvSet " + key);
    kv_sets.emplace_back(key + "=" + value, std::move(done));
  }
  void kvWait(const std::vector<std::string>& keys, Duration, agent::CallPolicy,
              Done<std::vector<std::string>> done) override {
    std::string all;
    for (const auto& k : keys) all += (all.empty() ? "" : ",") + k;
    record("kvWait " + all);
    kv_waits.emplace_back(all, std::move(done));
  }
  void kvDeleteRange(const std::string& from, const std::string& to, agent::CallPolicy,
                     StatusDone done) override {
    record("kvDeleteRange " + from + " " + to);
    done(Status::ok());
  }
  void watch(const std::string& node_id, ChangeSink on_change) override {
    ++watches;
    sink = std::move(on_change);
  }
  void stopWatch() override {
    ++stopped_watches;
    sink = nullptr;
  }
  void cancelAll() override {
    ++cancels;
    const Status cancelled(StatusCode::kCancelled, "cancelled");
    failAll(joins, cancelled);
    failAll(heartbeats, cancelled);
    failAll(leaves, cancelled);
    failAll(failure_reports, cancelled);
    failAll(closes, cancelled);
    failAll(publishes, cancelled);
    failAll(master_waits, cancelled);
    failAll(kv_sets, cancelled);
    failAll(kv_waits, cancelled);
  }
  Status explainUnavailable(const Status& st) const override {
    return Status(st.code(), st.message() + " (check the fake)");
  }

  // Answers the oldest call of `queue` with `result` (posted to the loop).
  template <typename Callback, typename Result>
  void answer(Queue<Callback>& queue, Result result) {
    Callback done = std::move(queue.front().second);
    queue.pop_front();
    boost::asio::post(io_, [done = std::move(done), result = std::move(result)]() mutable {
      done(std::move(result));
    });
  }
  template <typename Callback>
  void failAll(Queue<Callback>& queue, const Status& st) {
    while (!queue.empty()) answer(queue, st);
  }
  // A pushed round change, delivered on the loop.
  void push(const rendezvous::RoundChange& change) {
    boost::asio::post(io_, [this, change] {
      if (sink) sink(change);
    });
  }

  rendezvous::JoinRequest last_join;
  agent::CallPolicy heartbeat_policy;
  Queue<Done<rendezvous::RoundInfo>> joins;
  Queue<Done<rendezvous::RunStatus>> heartbeats;
  Queue<StatusDone> leaves;
  Queue<Done<uint64_t>> failure_reports;
  Queue<StatusDone> closes;
  Queue<StatusDone> publishes;
  Queue<Done<rendezvous::MasterAddress>> master_waits;
  Queue<StatusDone> kv_sets;
  Queue<Done<std::vector<std::string>>> kv_waits;
  std::vector<std::string> calls;  // every call but heartbeats, in order
  ChangeSink sink;
  int watches = 0, stopped_watches = 0, cancels = 0;

 private:
  void record(std::string what) { calls.push_back(std::move(what)); }
  boost::asio::io_context& io_;
};

}  // namespace ddprun::testing
