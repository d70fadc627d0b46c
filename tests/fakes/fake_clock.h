// FakeClock: time that moves only when a test says so. Not thread-safe; tests drive it from
// the one thread that owns the object under test.
#pragma once

#include "ddprun/common/clock.h"

namespace ddprun::testing {

class FakeClock final : public Clock {
 public:
  TimePoint now() const override { return now_; }
  double wallSeconds() const override {
    return 1.7e9 + std::chrono::duration<double>(now_.time_since_epoch()).count();
  }
  void advance(Duration d) { now_ += d; }

 private:
  TimePoint now_{std::chrono::seconds(1000)};
};

}  // namespace ddprun::testing
