// LogThrottle: says when a warning that a peer can cause over and over (a refused call, an
// ignored announcement) is worth a log line: the first of a key at once, then at most one per
// interval, which tells how many there were since the last line. A flood of refused calls is then
// a few lines a minute, each naming its peer and a count, instead of one line per call.
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
  explicit LogThrottle(Duration interval, size_t max_keys = 1024)
      : interval_(interval), max_keys_(max_keys == 0 ? 1 : max_keys) {}

  // One more event of `key` at `now`: the number of events of that key to report in a line now
  // (this one and those not logged since the last line), or nullopt when no line is due.
  std::optional<uint64_t> note(const std::string& key, TimePoint now) {
    auto it = keys_.find(key);
    if (it == keys_.end()) {
      if (keys_.size() >= max_keys_) forgetOldest();
      keys_.emplace(key, Entry{now, 0});
      return 1;
    }
    Entry& e = it->second;
    ++e.unlogged;
    if (now - e.last_logged < interval_) return std::nullopt;
    const uint64_t n = e.unlogged;
    e = Entry{now, 0};
    return n;
  }

 private:
  struct Entry {
    TimePoint last_logged;
    uint64_t unlogged = 0;
  };
  void forgetOldest() {
    auto oldest = keys_.begin();
    for (auto it = keys_.begin(); it != keys_.end(); ++it) {
      if (it->second.last_logged < oldest->second.last_logged) oldest = it;
    }
    keys_.erase(oldest);
  }
  Duration interval_;
  size_t max_keys_;
  std::map<std::string, Entry> keys_;
};

}  // namespace ddprun
