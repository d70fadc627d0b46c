// The bookkeeping of the service's calls, on its loop: Calls holds each call in flight until it
// completes once (or every one fails with cancelAll), and Readiness holds calls that need the
// first full picture of the run until it came (or the first contact failed).
//
// Threading: the service's loop only (plain values it owns).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <utility>
#include <vector>

#include "ddprun/common/status.h"

namespace ddprun::etcd {

class Calls {
 public:
  using Fail = std::function<void(Status)>;

  // A new call; its id.
  template <typename T>
  uint64_t track(std::function<void(StatusOr<T>)> done) {
    const uint64_t id = next_id_++;
    inflight_[id] = [done](Status st) { done(std::move(st)); };
    return id;
  }
  // Completes call `id` unless it was cancelled or timed out: whether it was still in flight.
  bool finish(uint64_t id) { return inflight_.erase(id) != 0; }
  bool has(uint64_t id) const { return inflight_.count(id) != 0; }
  // Takes call `id` out to fail it (empty when it is not in flight).
  Fail take(uint64_t id) {
    auto it = inflight_.find(id);
    if (it == inflight_.end()) return nullptr;
    Fail fail = std::move(it->second);
    inflight_.erase(it);
    return fail;
  }
  // Takes every call out.
  std::map<uint64_t, Fail> takeAll() { return std::exchange(inflight_, {}); }

 private:
  uint64_t next_id_ = 1;
  std::map<uint64_t, Fail> inflight_;
};

class Readiness {
 public:
  // Runs `fn` with the outcome once there is one (now, when there is).
  void whenReady(std::function<void(Status)> fn) {
    if (ready_ || !error_.isOk()) {
      fn(error_);
    } else {
      waiting_.push_back(std::move(fn));
    }
  }
  bool ready() const { return ready_; }
  bool failed() const { return !error_.isOk(); }
  // The first full picture came.
  void becomeReady() {
    if (ready_) return;
    ready_ = true;
    for (auto& fn : std::exchange(waiting_, {})) fn(Status::ok());
  }
  // The first contact failed: every waiting call, and every later one, gets `st`.
  void fail(Status st) {
    error_ = st;
    for (auto& fn : std::exchange(waiting_, {})) fn(st);
  }

 private:
  bool ready_ = false;
  Status error_;
  std::vector<std::function<void(Status)>> waiting_;
};

}  // namespace ddprun::etcd
