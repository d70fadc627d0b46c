// Stopper: the service's stop signal, shared by its three threads. A thread pauses on it between
// attempts (a retry, a reconnect, the next keep-alive) and asks stopping() between its etcd
// calls; stop() wakes every pause at once, so the service's destructor never waits out a pause.
//
// Threading: every method from any thread. Lifetime: outlives the threads that use it.
#pragma once

#include <chrono>
#include <condition_variable>

#include "ddprun/common/clock.h"
#include "ddprun/common/status.h"
#include "ddprun/common/thread_annotations.h"

namespace ddprun::etcd {

class Stopper {
 public:
  void stop() EXCLUDES(mu_) {
    {
      MutexLock lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
  }

  bool stopping() EXCLUDES(mu_) {
    MutexLock lock(mu_);
    return stopping_;
  }

  // Waits up to `d` unless the service stops; false when it stops.
  bool pause(Duration d) EXCLUDES(mu_) {
    const auto until = std::chrono::steady_clock::now() + d;
    MutexLock lock(mu_);
    while (!stopping_) {
      if (cv_.wait_until(mu_, until) == std::cv_status::timeout) return !stopping_;
    }
    return false;
  }

  // Runs `call` again while etcd is unreachable (UNAVAILABLE, DEADLINE_EXCEEDED), every 250 ms
  // for up to `retry_for`, unless the service stops; the last status.
  template <typename Call>
  Status retrying(Duration retry_for, Call call) {
    const auto deadline = std::chrono::steady_clock::now() + retry_for;
    for (;;) {
      Status st = call();
      if (st.code() != StatusCode::kUnavailable && st.code() != StatusCode::kDeadlineExceeded) {
        return st;
      }
      if (std::chrono::steady_clock::now() >= deadline || !pause(std::chrono::milliseconds(250))) {
        return st;
      }
    }
  }

 private:
  Mutex mu_;
  std::condition_variable_any cv_;
  bool stopping_ GUARDED_BY(mu_) = false;
};

}  // namespace ddprun::etcd
