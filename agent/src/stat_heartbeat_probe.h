// StatHeartbeatProbe: hang detection's look at a worker's DDPRUN_HEARTBEAT_FILE (its mtime).
// Stateless; any thread.
#pragma once

#include <sys/stat.h>

#include <fstream>
#include <iterator>
#include <string>

#include "ddprun/agent/heartbeat.h"

namespace ddprun::agent {

class StatHeartbeatProbe final : public HeartbeatProbe {
 public:
  std::optional<int64_t> modificationTime(const std::string& path) override {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) return std::nullopt;
    return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  }
  // /proc/<pid>/stat: the state after the command's closing parenthesis, T or t.
  bool stopped(int pid) override {
    std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
    const std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto close = stat.rfind(')');
    if (close == std::string::npos || close + 2 >= stat.size()) return false;
    return stat[close + 2] == 'T' || stat[close + 2] == 't';
  }
};

}  // namespace ddprun::agent
