// OpQueue: runs submitted operations one at a time, in submission order, on its own thread, and
// hands out Work handles for them. An exception thrown by an operation never crosses the thread:
// it is captured and rethrown as CommError from Work::wait(). After the first failure every later
// operation fails at once with the same message (the transport is presumed broken). abort() fails
// what is queued and whatever is submitted later at once (the running operation is the
// transport's to interrupt); waitIdle() tells when nothing runs any more.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "ddprun/common/thread_annotations.h"
#include "ddprun/worker/communicator.h"

namespace ddprun::worker {

class OpWork : public Work {
 public:
  void wait() override;
  bool isCompleted() override;
  void complete(std::string error);

 private:
  ddprun::Mutex mu_;
  std::condition_variable_any cv_;
  bool done_ GUARDED_BY(mu_) = false;
  std::string error_ GUARDED_BY(mu_);  // empty = success
};

class OpQueue {
 public:
  explicit OpQueue(std::string name);
  ~OpQueue();  // drains queued operations, then joins
  OpQueue(const OpQueue&) = delete;
  OpQueue& operator=(const OpQueue&) = delete;

  std::shared_ptr<Work> submit(std::function<void()> op);
  // Thread-safe, idempotent, does not wait: queued and later operations fail with `reason`.
  void abort(const std::string& reason);
  // True once no operation runs or is queued; waits at most `timeout`.
  bool waitIdle(std::chrono::milliseconds timeout);

 private:
  void run();

  std::string name_;
  ddprun::Mutex mu_;
  std::condition_variable_any cv_;
  std::deque<std::pair<std::function<void()>, std::shared_ptr<OpWork>>> queue_ GUARDED_BY(mu_);
  bool stopping_ GUARDED_BY(mu_) = false;
  bool running_ GUARDED_BY(mu_) = false;  // an operation is on the thread now
  std::string aborted_ GUARDED_BY(mu_);   // abort()'s reason; empty = not aborted
  std::string broken_;                    // first failure; only touched on the worker thread
  std::thread thread_;
};

}  // namespace ddprun::worker
