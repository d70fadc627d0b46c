// TransferPool: the replicator's one pool of threads for what blocks (looking at and hashing
// files, fetches, announcements, letting go of large files). Work runs on a pool thread and its
// `then` on the loop afterwards. Two lanes with a bound each on the work running at once, so that
// announcements stuck on a stopped node never hold up fetches: at most 8 fetches and 32 others
// (a checkpoint directory of thousands of files written at once otherwise started a thread for
// each fetch, 331 in one receiving agent, and past the process's limit the agent would fail).
// More waits its turn, first come, first served. Threads are started as work needs them, reused,
// and end after a while without work.
//
// A thread runs either background work (bulk: hashing, fetching, which the workers' training
// comes before: SCHED_IDLE, else nice 10) or prompt work (the few system calls and small RPCs a
// replication waits on, at the agent's own priority). A thread cannot get its priority back once
// it gave it up, so each thread keeps one urgency for its life.
//
// Threading: run() on the loop thread only; the work on pool threads; `then` posted to the loop.
// Lifetime: the destructor drops the work still waiting (its `then` never runs), waits for the
// work running and joins every thread; no `then` runs after it.
#pragma once

#include <array>
#include <boost/asio/io_context.hpp>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ddprun/common/clock.h"
#include "ddprun/common/loop_affinity.h"
#include "ddprun/common/thread_annotations.h"

namespace ddprun::snapshot {

class TransferPool {
 public:
  enum class Lane { kGeneral, kFetch };
  enum class Urgency { kBackground, kPrompt };
  struct Options {
    size_t general = 32;  // work running at once in each lane
    size_t fetch = 8;
    Duration idle = std::chrono::seconds(5);  // a thread without work this long ends
  };

  TransferPool(boost::asio::io_context& io, Options options);
  explicit TransferPool(boost::asio::io_context& io) : TransferPool(io, Options{}) {}
  ~TransferPool();
  TransferPool(const TransferPool&) = delete;
  TransferPool& operator=(const TransferPool&) = delete;

  // Runs `work` on a pool thread, then `then` on the loop. When no thread can be had at all
  // (ulimit -u, memory) and none of its kind is alive, both run here, on the loop (warned).
  void run(std::function<void()> work, std::function<void()> then,
           Urgency urgency = Urgency::kBackground, Lane lane = Lane::kGeneral);

 private:
  struct Work {
    std::function<void()> work;
    std::function<void()> then;
  };
  // The work of one lane and urgency, and the threads that run it.
  struct Queue {
    std::deque<Work> waiting;
    size_t threads = 0;  // alive
    size_t idle = 0;     // of them, waiting for work
  };
  static size_t index(Lane lane, Urgency urgency) {
    return static_cast<size_t>(lane) * 2 + static_cast<size_t>(urgency);
  }
  // Starts a thread for queue `q`; false (and why) when none can be had.
  bool startThread(size_t q, std::string* why) REQUIRES(mu_);
  // Joins the threads that ended (each past its last use of mu_).
  void joinEnded() REQUIRES(mu_);
  void threadMain(size_t q, std::weak_ptr<int> alive);
  // The work of queue `q` that may start now (its lane below its bound), if any.
  bool takeWork(size_t q, Work* out) REQUIRES(mu_);

  boost::asio::io_context& io_;
  const Options options_;
  LoopAffinity loop_{"snapshot TransferPool"};
  Mutex mu_;
  std::condition_variable_any wake_;
  std::array<Queue, 4> queues_ GUARDED_BY(mu_);             // by index(lane, urgency)
  std::array<size_t, 2> running_ GUARDED_BY(mu_) = {0, 0};  // work running, by lane
  bool stopping_ GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_ GUARDED_BY(mu_);
  std::vector<std::thread::id> ended_ GUARDED_BY(mu_);     // threads past their last work
  std::shared_ptr<int> alive_ = std::make_shared<int>(0);  // for the posted `then`s
};

}  // namespace ddprun::snapshot
