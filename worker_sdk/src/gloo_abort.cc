#include "gloo_abort.h"

#include <gloo/transport/tcp/pair.h>
#include <sys/socket.h>

#include <mutex>

namespace ddprun::worker {

namespace {

// Names tcp::Pair's protected members through a derived class (never instantiated).
struct PairAccess : gloo::transport::tcp::Pair {
  static bool shutdownSocket(gloo::transport::tcp::Pair& pair) {
    std::mutex& mu = pair.*(&PairAccess::m_);
    std::lock_guard<std::mutex> lock(mu);
    const int fd = pair.*(&PairAccess::fd_);
    return fd >= 0 && ::shutdown(fd, SHUT_RDWR) == 0;
  }
};

}  // namespace

int shutdownGlooPairs(gloo::Context& ctx) {
  int n = 0;
  for (int i = 0; i < ctx.size; ++i) {
    if (i == ctx.rank) continue;
    auto& pair = ctx.getPair(i);
    auto* tcp = dynamic_cast<gloo::transport::tcp::Pair*>(pair.get());
    if (tcp != nullptr && PairAccess::shutdownSocket(*tcp)) ++n;
  }
  return n;
}

}  // namespace ddprun::worker
