// Clock: the only way the pure cores learn the time, so tests can drive time by hand
// (tests/fakes/fake_clock.h). SteadyClock is the production implementation. Thread-safe.
#pragma once

#include <chrono>

namespace ddprun {

using Duration = std::chrono::steady_clock::duration;
using TimePoint = std::chrono::steady_clock::time_point;

class Clock {
 public:
  virtual ~Clock() = default;
  virtual TimePoint now() const = 0;
  // Wall-clock seconds since the epoch, for timestamps users read (error reports).
  virtual double wallSeconds() const = 0;
};

class SteadyClock final : public Clock {
 public:
  TimePoint now() const override { return std::chrono::steady_clock::now(); }
  double wallSeconds() const override {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
};

// Seconds as a Duration; for options given in (fractional) seconds.
inline Duration seconds(double s) {
  return std::chrono::duration_cast<Duration>(std::chrono::duration<double>(s));
}

}  // namespace ddprun
