#include "ddprun/agent/heartbeat.h"

#include <algorithm>
#include <cstdio>

namespace ddprun::agent {

Duration heartbeatCheckInterval(Duration timeout) {
  const Duration quarter = timeout / 4;
  return std::clamp<Duration>(quarter, std::chrono::milliseconds(10), std::chrono::seconds(1));
}

void Heartbeat::observe(std::optional<int64_t> mtime_ns, TimePoint now) {
  // A file that disappears again (someone cleaned the log dir) keeps the worker armed: it was
  // alive once, and silence from here on is still silence.
  if (!mtime_ns) return;
  if (last_mtime_ != mtime_ns) {
    last_mtime_ = mtime_ns;
    last_change_ = now;
  }
}

Duration Heartbeat::silentFor(TimePoint now) const {
  if (!armed()) return Duration::zero();
  return std::max(Duration::zero(), now - last_change_);
}

bool Heartbeat::hung(TimePoint now, Duration timeout) const {
  return armed() && timeout > Duration::zero() && silentFor(now) > timeout;
}

std::string hangMessage(Duration silent, Duration timeout) {
  // Tenths of a second rounded up, so a silence just past a 2 s timeout reads 2.1 s, not 2.0 s.
  const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(silent).count();
  const int64_t tenths = (std::max<int64_t>(ns, 0) + 99999999) / 100000000;
  char buf[128];
  std::snprintf(buf, sizeof(buf), "worker hung: no heartbeat for %lld.%lld s (timeout %g s)",
                static_cast<long long>(tenths / 10), static_cast<long long>(tenths % 10),
                std::chrono::duration<double>(timeout).count());
  return buf;
}

}  // namespace ddprun::agent
