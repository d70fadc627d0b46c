// The shell's one pool of threads (snapshot/src/transfer_pool.h): each lane's bound on the work
// running at once, the lanes independent of each other, threads reused, every `then` on the loop.
// Work blocks on a gate the test opens; nothing sleeps. Prompt work only: background threads run
// at SCHED_IDLE, which a busy machine may starve.
#include "transfer_pool.h"

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <catch2/catch.hpp>
#include <condition_variable>
#include <functional>
#include <set>
#include <thread>

#include "ddprun/common/thread_annotations.h"

using namespace ddprun;
using namespace ddprun::snapshot;

namespace {

// Work that blocks until open(), counting how much of it runs at once.
class Gate {
 public:
  std::function<void()> work() {
    return [this] {
      MutexLock lock(mu_);
      ++running_;
      most_ = std::max(most_, running_);
      changed_.notify_all();
      while (!open_) changed_.wait(mu_);
      --running_;
    };
  }
  void waitRunning(int n) {
    MutexLock lock(mu_);
    while (running_ != n) changed_.wait(mu_);
  }
  void open() {
    MutexLock lock(mu_);
    open_ = true;
    changed_.notify_all();
  }
  int most() {
    MutexLock lock(mu_);
    return most_;
  }

 private:
  Mutex mu_;
  std::condition_variable_any changed_;
  int running_ GUARDED_BY(mu_) = 0;
  int most_ GUARDED_BY(mu_) = 0;
  bool open_ GUARDED_BY(mu_) = false;
};

TransferPool::Options bounds(size_t general, size_t fetch) {
  TransferPool::Options o;
  o.general = general;
  o.fetch = fetch;
  return o;
}

void runPrompt(TransferPool& pool, std::function<void()> work, std::function<void()> then,
               TransferPool::Lane lane = TransferPool::Lane::kGeneral) {
  pool.run(std::move(work), std::move(then), TransferPool::Urgency::kPrompt, lane);
}

}  // namespace

TEST_CASE("no more work of a lane runs at once than its bound, and the rest waits its turn",
          "[transfer_pool]") {
  boost::asio::io_context io;
  auto busy = boost::asio::make_work_guard(io);  // run_one() waits for the posted `then`s
  TransferPool pool(io, bounds(2, 1));
  Gate gate;
  int done = 0;
  const auto loop = std::this_thread::get_id();
  bool on_loop = true;
  for (int i = 0; i < 5; ++i) {
    runPrompt(pool, gate.work(), [&] {
      on_loop = on_loop && std::this_thread::get_id() == loop;
      ++done;
    });
  }
  gate.waitRunning(2);
  gate.open();
  while (done < 5) io.run_one();
  CHECK(gate.most() == 2);
  CHECK(on_loop);
}

TEST_CASE("a fetch runs while the other lane is full", "[transfer_pool]") {
  boost::asio::io_context io;
  auto busy = boost::asio::make_work_guard(io);  // run_one() waits for the posted `then`s
  TransferPool pool(io, bounds(1, 1));
  Gate general;
  Gate fetch;
  int done = 0;
  runPrompt(pool, general.work(), [&] { ++done; });
  general.waitRunning(1);
  runPrompt(
      pool, fetch.work(), [&] { ++done; }, TransferPool::Lane::kFetch);
  fetch.waitRunning(1);  // the general lane is full: the fetch ran all the same
  fetch.open();
  general.open();
  while (done < 2) io.run_one();
  CHECK(general.most() == 1);
  CHECK(fetch.most() == 1);
}

TEST_CASE("a lane's thread is reused for the work that follows", "[transfer_pool]") {
  boost::asio::io_context io;
  auto busy = boost::asio::make_work_guard(io);  // run_one() waits for the posted `then`s
  TransferPool pool(io, bounds(1, 1));
  Mutex mu;
  std::set<std::thread::id> threads;  // guarded by mu (a local: not annotated)
  int done = 0;
  auto record = [&] {
    MutexLock lock(mu);
    threads.insert(std::this_thread::get_id());
  };
  std::function<void()> next = [&] {
    if (++done == 10) return;
    runPrompt(pool, record, next);
  };
  runPrompt(pool, record, next);
  while (done < 10) io.run_one();
  MutexLock lock(mu);
  CHECK(threads.size() == 1);
  CHECK(threads.count(std::this_thread::get_id()) == 0);
}

TEST_CASE("no then runs once the pool is gone", "[transfer_pool]") {
  boost::asio::io_context io;
  bool then_ran = false;
  {
    Gate gate;  // outlives the pool, whose destructor waits for the work that holds it
    TransferPool pool(io, bounds(1, 1));
    runPrompt(pool, gate.work(), [&] { then_ran = true; });
    gate.waitRunning(1);
    gate.open();
  }  // waits for the work; its `then`, posted or not, is dropped
  io.run();
  CHECK_FALSE(then_ran);
}
