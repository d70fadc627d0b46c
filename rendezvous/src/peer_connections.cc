#include "ddprun/rendezvous/peer_connections.h"

#include <algorithm>
#include <vector>

namespace ddprun::rendezvous {

void PeerConnections::erase(int fd) {
  auto it = by_fd_.find(fd);
  if (it == by_fd_.end()) return;
  auto host = by_host_.find(it->second.host);
  if (host != by_host_.end()) {
    host->second.erase(fd);
    if (host->second.empty()) by_host_.erase(host);
  }
  by_fd_.erase(it);
}

bool PeerConnections::admit(const std::string& host, const std::string& endpoint, int fd,
                            const Alive& alive) {
  erase(fd);  // the number was closed and accepted again: its old connection is gone
  auto it = by_host_.find(host);
  if (it != by_host_.end() && it->second.size() >= max_per_host_) {
    std::vector<int> gone;
    for (const auto& [held, at] : it->second) {
      if (!alive(held, at)) gone.push_back(held);
    }
    for (int held : gone) erase(held);
    it = by_host_.find(host);
    if (it != by_host_.end() && it->second.size() >= max_per_host_) return false;
  }
  by_fd_[fd] = Record{host, endpoint};
  by_host_[host][fd] = endpoint;
  return true;
}

size_t descriptorsKept(size_t limit) {
  return std::min(std::max<size_t>(32, limit / 8), limit / 2);
}

bool leavesTooFewDescriptors(int fd, size_t limit) {
  return fd >= 0 && static_cast<size_t>(fd) + descriptorsKept(limit) >= limit;
}

size_t PeerConnections::count(const std::string& host) const {
  auto it = by_host_.find(host);
  return it == by_host_.end() ? 0 : it->second.size();
}

}  // namespace ddprun::rendezvous
