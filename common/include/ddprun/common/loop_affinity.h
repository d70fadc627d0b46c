// LoopAffinity: a loop-only object's check that it runs on its loop. The object holds one and
// calls check() where it touches its state; the first call binds it to the calling thread (the
// object's loop, in production the agent's one Asio thread), and in debug builds a call from
// another thread aborts naming the object. Release builds (NDEBUG) compile it to nothing unless
// DDPRUN_LOOP_CHECKS is defined (CMake option DDPRUN_LOOP_CHECKS, on where the tests are built).
// As Envoy's isThreadSafe(): loop-only state needs no mutex, and this says so where it matters.
#pragma once

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <thread>

namespace ddprun {

class LoopAffinity {
 public:
  explicit LoopAffinity(const char* owner) : owner_(owner) {}

  void check() const {
#if !defined(NDEBUG) || defined(DDPRUN_LOOP_CHECKS)
    const std::thread::id me = std::this_thread::get_id();
    std::thread::id expected{};
    if (bound_.compare_exchange_strong(expected, me) || expected == me) return;
    std::fprintf(stderr, "ddprun: %s used off its loop thread\n", owner_);
    std::abort();
#endif
  }

 private:
  [[maybe_unused]] const char* owner_;
  [[maybe_unused]] mutable std::atomic<std::thread::id> bound_{};
};

}  // namespace ddprun
