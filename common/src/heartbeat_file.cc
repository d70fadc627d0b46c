#include "ddprun/common/heartbeat_file.h"

#include <fcntl.h>
#include <unistd.h>

namespace ddprun {

HeartbeatMark readHeartbeatMark(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return HeartbeatMark::kUnknown;
  char first = 0;
  const bool read = ::pread(fd, &first, 1, 0) == 1;
  ::close(fd);
  if (read && first == kWaitingForPeers) return HeartbeatMark::kWaiting;
  if (read && first == kNotWaiting) return HeartbeatMark::kNotWaiting;
  return HeartbeatMark::kUnknown;
}

}  // namespace ddprun
