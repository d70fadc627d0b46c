// StatHeartbeatProbe: hang detection's look at a worker's DDPRUN_HEARTBEAT_FILE (its mtime, and
// whether its first byte says the worker waits for its peers).
// Stateless; any thread.
#pragma once

#include <sys/stat.h>

#include <string>

#include "ddprun/agent/heartbeat.h"
#include "ddprun/common/proc_stat.h"

namespace ddprun::agent {

class StatHeartbeatProbe final : public HeartbeatProbe {
 public:
  std::optional<int64_t> modificationTime(const std::string& path) override {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) return std::nullopt;
    return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  }
  // /proc/<pid>/stat's state: T or t.
  bool stopped(int pid) override {
    const auto stat = readProcStat(pid);
    return stat && (stat->state == 'T' || stat->state == 't');
  }
  // The file's first byte.
  HeartbeatMark mark(const std::string& path) override { return readHeartbeatMark(path); }
  // No /proc/<pid>/stat, or ProcStat::ended (a killed worker's memory is torn down for tens of
  // milliseconds before it turns zombie, and its sockets may close meanwhile).
  bool ended(int pid) override {
    const auto stat = readProcStat(pid);
    return !stat || stat->ended();
  }
};

}  // namespace ddprun::agent
