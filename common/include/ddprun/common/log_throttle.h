// LogThrottle: says when a warning that a peer can cause over and over (a refused call, an
// ignored announcement) is worth a log line: the first `burst` of a key in an interval at once,
// then none until the interval is over; the next line tells how many there were since the last. A
// flood of refused calls is then a few lines a minute, each naming its peer and a count, instead of
// one line per call.
//
// Pure (time passed in); keeps at most `max_keys` keys (the least recently logged are forgotten
// first, so a peer that sends under many names cannot grow it). Not thread-safe: a caller shared
// between threads guards it with its own mutex.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "ddprun/common/clock.h"

namespace ddprun {

class LogThrottle {
 public:
  explicit LogThrottle(Duration interval, size_t max_keys = 1024, uint64_t burst = 1)
      : interval_(interval),
        max_keys_(max_keys == 0 ? 1 : max_keys),
        burst_(burst == 0 ? 1 : burst) {}

  // One more event of `key` at `now`: the number of events of that key to report in a line now
  // (this one and those not logged since the last line), or nullopt when no line is due.
  std::optional<uint64_t> note(const std::string& key, TimePoint now) {
    auto it = keys_.find(key);
    if (it == keys_.end()) {
      if (keys_.size() >= max_keys_) forgetOldest();
      keys_.emplace(key, Entry{now, 1, 0});
      return 1;
    }
    Entry& e = it->second;
    if (now - e.window_start >= interval_) e = Entry{now, 0, e.unlogged};
    if (e.logged >= burst_) {
      ++e.unlogged;
      return std::nullopt;
    }
    ++e.logged;
    const uint64_t n = e.unlogged + 1;
    e.unlogged = 0;
    return n;
  }

 private:
  struct Entry {
    TimePoint window_start;  // of the interval its lines count against
    uint64_t logged = 0;     // lines in that interval
    uint64_t unlogged = 0;   // events not logged since the last line
  };
  void forgetOldest() {
    auto oldest = keys_.begin();
    for (auto it = keys_.begin(); it != keys_.end(); ++it) {
      if (it->second.window_start < oldest->second.window_start) oldest = it;
    }
    keys_.erase(oldest);
  }
  Duration interval_;
  size_t max_keys_;
  uint64_t burst_;
  std::map<std::string, Entry> keys_;
};

// The line for `n` events note() reported: `what`, and from the second on how many there were.
inline std::string withCount(const std::string& what, uint64_t n) {
  return n > 1 ? what + " (" + std::to_string(n) + " times since the last such line)" : what;
}

}  // namespace ddprun
