// Clock: the only way the pure cores learn the time, so tests can drive time by hand
// (tests/fakes/fake_clock.h). SteadyClock is the production implementation. Thread-safe.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>

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

// The largest number of seconds any duration flag or --rdzv-conf key takes: larger values would
// overflow Duration (and nobody means a timeout of 30 years). Parsers refuse more with a message.
inline constexpr double kMaxDurationSeconds = 1e9;

// Seconds as a Duration; for options given in (fractional) seconds. Clamped to
// [0, kMaxDurationSeconds] (NaN gives 0), so no input can overflow the conversion.
inline Duration seconds(double s) {
  if (!(s > 0)) return Duration::zero();
  if (s > kMaxDurationSeconds) s = kMaxDurationSeconds;
  return std::chrono::duration_cast<Duration>(std::chrono::duration<double>(s));
}

// `d` in whole milliseconds as an int (gRPC's channel arguments): at least 1, at most INT_MAX.
inline int millisForInt(Duration d) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
  return static_cast<int>(std::clamp<std::int64_t>(ms, 1, std::numeric_limits<int>::max()));
}

}  // namespace ddprun
