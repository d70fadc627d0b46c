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
  char buf[128];
  std::snprintf(buf, sizeof(buf), "worker hung: no heartbeat for %.1f s (timeout %g s)",
                std::chrono::duration<double>(silent).count(),
                std::chrono::duration<double>(timeout).count());
  return buf;
}

}  // namespace ddprun::agent
