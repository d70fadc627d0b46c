// The NCCL communicator's life without NCCL or a GPU: non-blocking init polled with a deadline,
// the watchdog that aborts a collective past op_timeout or after an asynchronous error, and the
// abort on every way out, driven through a fake of the few NCCL calls and a fake clock.
#include "nccl_health.h"  // worker_sdk/src

#include <atomic>
#include <catch2/catch.hpp>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ddprun/worker/errors.h"

using ddprun::worker::CommError;
using ddprun::worker::NcclComm;
using ddprun::worker::NcclHealth;
using ddprun::worker::NcclStatus;
using namespace std::chrono_literals;

namespace {

// ncclCommGetAsyncError answers from a script (then repeats its last answer); ncclCommAbort is
// counted. Calls after the abort are counted too: there must be none.
class FakeNcclComm : public NcclComm {
 public:
  explicit FakeNcclComm(std::deque<NcclStatus> answers = {}) : answers_(std::move(answers)) {}
  NcclStatus asyncError() override {
    std::lock_guard<std::mutex> lock(mu_);
    ++polls;
    if (aborts > 0) ++calls_after_abort;
    if (answers_.empty()) return last_;
    last_ = answers_.front();
    answers_.pop_front();
    return last_;
  }
  void abort() override {
    std::lock_guard<std::mutex> lock(mu_);
    ++aborts;
  }
  void answer(NcclStatus s) {
    std::lock_guard<std::mutex> lock(mu_);
    answers_.clear();
    last_ = std::move(s);
  }
  std::atomic<int> polls{0};
  std::atomic<int> aborts{0};
  std::atomic<int> calls_after_abort{0};

 private:
  std::mutex mu_;
  std::deque<NcclStatus> answers_;
  NcclStatus last_ = NcclStatus::success();
};

// Time moves only when the code under test pauses (or the test says so).
struct FakeTime {
  NcclHealth::Clock::time_point t{};
  NcclHealth::Now now() {
    return [this] { return t; };
  }
  NcclHealth::Pause pause() {
    return [this](std::chrono::microseconds d) { t += d; };
  }
};

std::string messageOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const CommError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("a non-blocking init that NCCL finishes after a few polls succeeds without an abort",
          "[worker][nccl][health]") {
  FakeNcclComm comm({NcclStatus::inProgress(), NcclStatus::inProgress(), NcclStatus::success()});
  FakeTime time;
  NcclHealth health(comm, 10s, time.now(), time.pause());
  health.settle(NcclStatus::inProgress(), "comm init", time.t + 5s, "connect_timeout (5000 ms)");
  CHECK(comm.polls == 3);
  CHECK(comm.aborts == 0);
  CHECK(health.failure().empty());
  CHECK(time.t < NcclHealth::Clock::time_point{} + 1s);  // it polled, it did not sleep long
}

TEST_CASE("an init whose peer never arrives is aborted at connect_timeout with a clear error",
          "[worker][nccl][health]") {
  FakeNcclComm comm;
  comm.answer(NcclStatus::inProgress());  // a rank that never calls ncclCommInitRank
  FakeTime time;
  NcclHealth health(comm, 10s, time.now(), time.pause());
  const auto deadline = time.t + 5s;
  const std::string m = messageOf([&] {
    health.settle(NcclStatus::inProgress(), "comm init", deadline, "connect_timeout (5000 ms)");
  });
  CHECK(m ==
        "nccl comm init did not complete within connect_timeout (5000 ms); the communicator was "
        "aborted");
  CHECK(comm.aborts == 1);
  CHECK(time.t >= deadline);
  CHECK(time.t < deadline + 100ms);  // not long after it
  CHECK(health.aborted());
  CHECK(comm.calls_after_abort == 0);
}

TEST_CASE("an init that NCCL fails is aborted and names NCCL's error", "[worker][nccl][health]") {
  FakeNcclComm comm({NcclStatus::inProgress(), NcclStatus::failure("remote process exited")});
  FakeTime time;
  NcclHealth health(comm, 10s, time.now(), time.pause());
  const std::string m = messageOf([&] {
    health.settle(NcclStatus::inProgress(), "comm init", time.t + 5s, "connect_timeout");
  });
  CHECK(m == "nccl comm init failed: remote process exited; the communicator was aborted");
  CHECK(comm.aborts == 1);
  // A call that failed at once (no polling) is handled the same way.
  FakeNcclComm comm2;
  NcclHealth health2(comm2, 10s, time.now(), time.pause());
  CHECK_THROWS_WITH(health2.settle(NcclStatus::failure("invalid argument"), "all_reduce",
                                   time.t + 1s, "op_timeout"),
                    "nccl all_reduce failed: invalid argument; the communicator was aborted");
  CHECK(comm2.aborts == 1);
  CHECK(comm2.polls == 0);
}

TEST_CASE("the watchdog aborts a collective that outlives op_timeout while nobody waits on it",
          "[worker][nccl][health]") {
  FakeNcclComm comm;
  FakeTime time;
  NcclHealth health(comm, 2s, time.now(), time.pause());
  bool first_done = false;
  health.track("broadcast", time.t, [&] { return first_done; });
  health.track("all_reduce", time.t + 10ms, [] { return false; });  // a peer died mid-way
  CHECK(health.check().empty());
  time.t += 1500ms;
  first_done = true;
  CHECK(health.check().empty());
  CHECK(health.inFlight() == 1);
  time.t += 400ms;  // all_reduce has run 1.89 s
  CHECK(health.check().empty());
  CHECK(comm.aborts == 0);
  time.t += 200ms;
  CHECK(health.check() ==
        "nccl all_reduce did not complete within op_timeout (2000 ms): a peer is gone or stuck; "
        "the communicator was aborted");
  CHECK(comm.aborts == 1);
  // Later passes report the same failure and abort nothing more; no NCCL call follows the abort.
  const int polls = comm.polls;
  CHECK(health.check() == health.failure());
  CHECK(comm.aborts == 1);
  CHECK(comm.polls == polls);
  CHECK(health.call([] { return NcclStatus::success(); }).code == NcclStatus::Code::kError);
  CHECK(comm.calls_after_abort == 0);
}

TEST_CASE("an asynchronous NCCL error aborts the communicator at the next watchdog pass",
          "[worker][nccl][health]") {
  FakeNcclComm comm;
  FakeTime time;
  NcclHealth health(comm, 600s, time.now(), time.pause());
  health.track("all_gather", time.t, [] { return false; });
  CHECK(health.check().empty());
  comm.answer(NcclStatus::failure("unhandled system error (peer 1 closed the connection)"));
  CHECK(health.check() ==
        "nccl reported an asynchronous error: unhandled system error (peer 1 closed the "
        "connection); the communicator was aborted");
  CHECK(comm.aborts == 1);
}

TEST_CASE("an enqueue failure aborts once and stays the reported failure",
          "[worker][nccl][health]") {
  FakeNcclComm comm;
  FakeTime time;
  NcclHealth health(comm, 1s, time.now(), time.pause());
  health.fail("nccl all_reduce failed: invalid usage");
  health.fail("a second failure");
  CHECK(comm.aborts == 1);
  CHECK(health.failure() == "nccl all_reduce failed: invalid usage");
  CHECK(health.check() == "nccl all_reduce failed: invalid usage");
  const NcclStatus refused = health.call([] { return NcclStatus::success(); });
  CHECK(refused.code == NcclStatus::Code::kError);
  CHECK(refused.error == "nccl all_reduce failed: invalid usage");
}

TEST_CASE("a watchdog and waiters racing on one timed-out collective abort it exactly once",
          "[worker][nccl][health]") {
  FakeNcclComm comm;
  NcclHealth health(
      comm, 1ms, [] { return NcclHealth::Clock::now(); },
      [](std::chrono::microseconds d) { std::this_thread::sleep_for(d); });
  health.track("all_reduce", NcclHealth::Clock::now() - 1s, [] { return false; });
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&] {
      for (int k = 0; k < 100; ++k) {
        if (!health.check().empty()) ++failures;
        health.call([&] { return comm.asyncError(); });
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(failures == 800);
  CHECK(comm.aborts == 1);
  CHECK(comm.calls_after_abort == 0);
}

TEST_CASE(
    "an init given up by its cancel (the agent aborted the generation being formed) is aborted at "
    "once, naming the reason, before the deadline",
    "[worker][nccl][health][inplace]") {
  FakeNcclComm comm;
  comm.answer(NcclStatus::inProgress());  // a peer node lost while NCCL bootstraps
  FakeTime time;
  NcclHealth health(comm, 10s, time.now(), time.pause());
  int asked = 0;
  const auto start = time.t;
  const std::string m = messageOf([&] {
    health.settle(NcclStatus::inProgress(), "comm init", time.t + 300s, "connect_timeout",
                  [&]() -> std::string {
                    return ++asked < 5 ? "" : "the agent aborted generation 4 while it formed";
                  });
  });
  CHECK(m ==
        "nccl comm init given up: the agent aborted generation 4 while it formed; the "
        "communicator was aborted");
  CHECK(asked == 5);
  CHECK(comm.aborts == 1);
  CHECK(comm.calls_after_abort == 0);
  CHECK(time.t < start + 1s);
  CHECK(health.aborted());
  // An init that completes is not asked again, and a cancel with no reason changes nothing.
  FakeNcclComm ok({NcclStatus::inProgress(), NcclStatus::success()});
  NcclHealth healthy(ok, 10s, time.now(), time.pause());
  asked = 0;
  healthy.settle(NcclStatus::inProgress(), "comm init", time.t + 5s, "connect_timeout",
                 [&]() -> std::string {
                   ++asked;
                   return "";
                 });
  CHECK(asked == 2);
  CHECK(ok.aborts == 0);
}
