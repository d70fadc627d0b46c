// RenamePairs: matches a rename's two inotify events (IN_MOVED_FROM, then IN_MOVED_TO with the
// same cookie) for the snapshot core (core.h). The kernel queues the two one
// after the other, not at once (inotify(7)): a read can return the IN_MOVED_FROM before its
// IN_MOVED_TO is queued. So a name renamed away counts as gone (renamed out of the watched tree,
// a deletion) only once nothing more is queued and `wait` has passed since its IN_MOVED_FROM was
// read; taken as gone at once, a rename whose second event came late became a new file (hashed,
// announced and fetched whole by every other node) plus a deletion.
// Pure: the caller reads the events and the clock. Threading: none (the agent's loop).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "ddprun/common/clock.h"

namespace ddprun::snapshot {

// How long a name renamed away waits for its IN_MOVED_TO. The two events are queued within one
// rename(2), microseconds apart unless the renaming thread is preempted in between; a deletion
// told this much later costs nothing.
inline constexpr Duration kRenamePairWait = std::chrono::milliseconds(50);

class RenamePairs {
 public:
  // A name renamed away, until its IN_MOVED_TO comes or it is gone.
  struct Away {
    std::string name;  // relative to the watched top
    bool dir = false;
  };

  explicit RenamePairs(Duration wait) : wait_(wait) {}

  // An IN_MOVED_FROM read at `now` (cookie non-zero).
  void movedFrom(uint32_t cookie, Away away, TimePoint now);
  // An IN_MOVED_TO: the name renamed away under the same cookie, if one is waiting (taken).
  std::optional<Away> movedTo(uint32_t cookie);
  // The names renamed away at least `wait` before `now` whose IN_MOVED_TO did not come, in the
  // order they were read (taken). Call only when nothing more is queued to be read.
  std::vector<Away> gone(TimePoint now);
  // When the earliest waiting name is due (nullopt: none waits).
  std::optional<TimePoint> nextDue() const;

 private:
  struct Waiting {
    Away away;
    TimePoint read_at;
    uint64_t order;
  };
  Duration wait_;
  std::map<uint32_t, Waiting> waiting_;  // by cookie
  uint64_t next_order_ = 0;
};

}  // namespace ddprun::snapshot
