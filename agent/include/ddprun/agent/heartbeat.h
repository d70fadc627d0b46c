// Hang detection from workers' heartbeat files (SPEC §6): each worker gets its own
// DDPRUN_HEARTBEAT_FILE, which the worker SDK touches every step. HeartbeatProbe is how the
// supervisor looks at those files (a stat() in production, tests/fakes in tests); Heartbeat is
// the pure per-worker bookkeeping that decides when a worker counts as hung.
//
// A worker is armed once its file exists (it was touched at least once in this attempt, so
// programs that never touch it are never flagged). From then on it is hung when the agent has
// seen no change of the file's modification time for longer than the timeout. Changes are timed
// on the agent's steady clock, never by comparing the mtime with the wall clock, so a clock step
// or a file server with a skewed clock cannot make a live worker look hung.
//
// ProcessLauncher-style threading: used from the agent's one event-loop thread only.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "ddprun/common/clock.h"
#include "ddprun/common/heartbeat_file.h"

namespace ddprun::agent {

// The supervisor also asks it whether a worker's DDPRUN_STOP_FILE exists (a time: it does).
class HeartbeatProbe {
 public:
  virtual ~HeartbeatProbe() = default;
  // The file's modification time (nanoseconds since the epoch), or nullopt when it does not
  // exist or cannot be read (a worker that has not touched it yet).
  virtual std::optional<int64_t> modificationTime(const std::string& path) = 0;
  // True when process `pid` is stopped by a signal (SIGSTOP, SIGTSTP, a debugger). In-place
  // recovery tells such a worker from the others, whose heartbeats stall with it.
  virtual bool stopped(int pid) {
    (void)pid;
    return false;
  }
  // What the heartbeat file at `path` says of its worker (ddprun/common/heartbeat_file.h: a
  // worker SDK Trainer says whether a collective waits for its peers). In-place recovery tells a
  // rank that hangs from the ranks stalled behind it.
  virtual HeartbeatMark mark(const std::string& path) {
    (void)path;
    return HeartbeatMark::kUnknown;
  }
  // True when process `pid` has ended (exiting, a zombie not reaped yet, or gone): its exit is on
  // its way. In-place recovery tells a worker killed with the failed one (its channel closed
  // first) from a live one that hung up.
  virtual bool ended(int pid) {
    (void)pid;
    return false;
  }
};

// How often the supervisor looks at the files for a given timeout: a quarter of it, at most 1 s
// and at least 10 ms (no busy polling for tiny timeouts).
Duration heartbeatCheckInterval(Duration timeout);

// One worker's heartbeat as the agent has seen it.
class Heartbeat {
 public:
  // Records one look at the file at `now`.
  void observe(std::optional<int64_t> mtime_ns, TimePoint now);
  // True once the file was seen at all.
  bool armed() const { return last_mtime_.has_value(); }
  // How long no change was seen, as of `now`; zero while not armed.
  Duration silentFor(TimePoint now) const;
  // Armed and silent for longer than `timeout`.
  bool hung(TimePoint now, Duration timeout) const;

 private:
  std::optional<int64_t> last_mtime_;
  TimePoint last_change_{};
};

// "worker hung: no heartbeat for 12.0 s (timeout 10 s)"
std::string hangMessage(Duration silent, Duration timeout);

}  // namespace ddprun::agent
