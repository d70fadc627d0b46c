// FakeHeartbeatProbe: heartbeat files as a map from path to modification time. A test "touches"
// a worker's file by bumping its entry; a path not in the map does not exist. Not thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>

#include "ddprun/agent/heartbeat.h"

namespace ddprun::testing {

class FakeHeartbeatProbe final : public agent::HeartbeatProbe {
 public:
  std::optional<int64_t> modificationTime(const std::string& path) override {
    ++looks;
    auto it = mtimes.find(path);
    if (it == mtimes.end()) return std::nullopt;
    return it->second;
  }
  void touch(const std::string& path) { mtimes[path] = ++stamp_; }
  bool stopped(int pid) override { return stopped_pids.count(pid) > 0; }
  bool ended(int pid) override { return ended_pids.count(pid) > 0; }
  HeartbeatMark mark(const std::string& path) override {
    // A worker that writes a new mark just before it is read (its wait ended): the write touches
    // the file too.
    if (auto flip = flips.find(path); flip != flips.end()) {
      marks[path] = flip->second;
      touch(path);
      flips.erase(flip);
    }
    auto it = marks.find(path);
    return it == marks.end() ? HeartbeatMark::kUnknown : it->second;
  }

  std::map<std::string, int64_t> mtimes;
  std::set<int> stopped_pids;
  std::set<int> ended_pids;
  std::map<std::string, HeartbeatMark> marks;  // what heartbeat files say (else kUnknown)
  std::map<std::string, HeartbeatMark> flips;  // marks written as they are next read
  int looks = 0;

 private:
  int64_t stamp_ = 1700000000LL * 1000000000LL;
};

}  // namespace ddprun::testing
