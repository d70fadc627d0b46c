// Communicator::abort (in-place recovery, docs/in-place-recovery.md §3.1): a collective blocked on
// a peer that never comes is woken by abort() from another thread, on every route all_reduce can
// take (Gloo's ring, shared memory, a ring per local index across hosts, the leaders' pipeline),
// fails with CommError, and leaves no thread behind; later collectives fail at once.
#include <ATen/ATen.h>
#include <gloo/transport/tcp/device.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ddprun/worker/errors.h"
#include "gloo_communicator.h"
#include "thread_ranks.h"

using namespace ddprun::worker;
namespace t = ddprun::worker::testing;

TEST_CASE(
    "abort wakes an all_reduce blocked on an absent peer on every route, and later "
    "collectives fail at once",
    "[worker][comm][inplace]") {
  const auto layout = GENERATE(std::vector<std::string>{"A", "A", "A"},       // shared memory
                               std::vector<std::string>{"A", "B", "C"},       // Gloo's ring
                               std::vector<std::string>{"A", "A", "B", "B"},  // columns
                               std::vector<std::string>{"A", "A", "B"});      // leaders
  const int world = static_cast<int>(layout.size());
  const int absent = world - 1;  // joins the group, never the all_reduce
  INFO("hosts of the ranks: " << layout.size() << ", first " << layout.front() << ", last "
                              << layout.back());
  std::atomic<int> finished{0};
  std::mutex mu;
  std::vector<std::string> outcomes;
  t::runRanks(
      world,
      [&](ProcessGroup& pg) {
        if (pg.rank() == absent) {
          while (finished.load() < world - 1)
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
          return;
        }
        auto tensor = at::ones({1 << 16});
        auto work = pg.comm().allReduceAsync(tensor, ReduceOp::kSum);
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        const bool done_before = work->isCompleted();
        const auto t0 = std::chrono::steady_clock::now();
        pg.abort("test");  // this thread is not the op thread, as the control channel's is not
        std::string outcome;
        try {
          work->wait();
          outcome = "completed";
        } catch (const CommError& e) {
          outcome = "failed";
        }
        const auto woke = std::chrono::steady_clock::now() - t0;
        const bool idle = pg.comm().awaitIdle(std::chrono::seconds(5));
        std::string later;
        try {
          pg.comm().allReduceAsync(at::ones({4}), ReduceOp::kSum)->wait();
          later = "ran";
        } catch (const CommError& e) {
          later = std::string("failed: ") + e.what();
        }
        {
          std::lock_guard<std::mutex> lock(mu);
          outcomes.push_back(
              "rank " + std::to_string(pg.rank()) + ": " + outcome +
              (done_before ? " (done before the abort)" : "") + ", idle " + (idle ? "yes" : "no") +
              ", woke within 30 s: " + (woke < std::chrono::seconds(30) ? "yes" : "no") +
              ", later op " +
              (later.find("aborted (test)") != std::string::npos ? "failed with the reason"
                                                                 : later));
        }
        ++finished;
      },
      [&](int rank) {
        ProcessGroupOptions o = t::fastOptions();
        o.op_timeout = std::chrono::minutes(10);  // only the abort can end the wait
        o.host_identity = layout[static_cast<size_t>(rank)];
        return o;
      });
  REQUIRE(outcomes.size() == static_cast<size_t>(world - 1));
  for (const auto& o : outcomes) {
    INFO(o);
    // A peer's abort may fail this rank's op first (its sockets close): failed either way.
    CHECK(o.find(": failed") != std::string::npos);
    CHECK(o.find(", idle yes, woke within 30 s: yes, later op failed with the reason") !=
          std::string::npos);
  }
}

TEST_CASE(
    "a group forming with a peer that published its pair addresses and never connects gives up "
    "at the store's cancel, not at Gloo's connect timeout",
    "[worker][comm][inplace]") {
  // The peer, rank 1 of 2, on 127.0.0.2: above rank 0's 127.0.0.1, so rank 0's pair listens for
  // it (Gloo's client is the side with the greater address). It publishes a real pair's address
  // and never connects: a node lost after publishing. Without the cancel, Gloo would wait 5 x the
  // connect timeout and say "Connect timeout".
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.2";
  auto peer_device = gloo::transport::tcp::CreateDevice(attr);
  auto peer_pairs = peer_device->createContext(1, 2);
  const std::vector<char> peer_address = peer_pairs->createPair(0)->address().bytes();
  auto store = KeyValueStore::inMemory(std::chrono::seconds(60));
  store->set("cancel/gloo/1", peer_address);
  std::atomic<bool> aborted{false};
  store->setCancel([&]() -> std::string {
    return aborted ? "the agent aborted generation 3 while it formed" : "";
  });
  const GlooOptions options{
      "127.0.0.1", "cancel", std::chrono::seconds(5), std::chrono::seconds(5), 0, false, ""};
  std::thread canceller([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    aborted = true;
  });
  std::string error;
  try {
    makeGlooCommunicator(0, 2, store, options);
  } catch (const CommError& e) {
    error = e.what();
  }
  canceller.join();
  INFO(error);
  CHECK(error.find("gloo: rank 0 gave up forming its group (connect to its 1 peers): the agent "
                   "aborted generation 3 while it formed") != std::string::npos);
  CHECK(error.find("Connect timeout") == std::string::npos);
}

TEST_CASE("a peer's malformed pair addresses fail the group with a clear error, not a crash",
          "[worker][comm]") {
  const GlooOptions options{"127.0.0.1", "bad", std::chrono::seconds(5), std::chrono::seconds(5), 0,
                            false,       ""};
  // None at all; a size that is no address; two ranks' worth where one is due.
  const auto published =
      GENERATE(std::vector<char>{}, std::vector<char>{'x', 'y', 'z'}, std::vector<char>(600, 'a'));
  INFO(published.size() << " bytes");
  auto store = KeyValueStore::inMemory(std::chrono::seconds(60));
  store->set("bad/gloo/1", published);
  std::string error;
  try {
    makeGlooCommunicator(0, 2, store, options);
  } catch (const CommError& e) {
    error = e.what();
  }
  INFO(error);
  CHECK(error.find("gloo: rank 0 could not connect to its 1 peers: rank 1 published " +
                   std::to_string(published.size()) + " bytes of pair addresses, not 1 of ") == 0);
}
