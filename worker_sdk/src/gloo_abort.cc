#include "gloo_abort.h"

#include <gloo/transport/tcp/pair.h>
#include <sys/socket.h>

#include <mutex>
#include <string>

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
  // Fails the pair as Gloo does on its own timeouts (under the pair's lock, once): whatever waits
  // on it wakes with an IoException carrying `why`, and its socket is closed.
  static bool fail(gloo::transport::tcp::Pair& pair, const std::string& why) {
    const auto signal = &PairAccess::signalExceptionExternal;
    return (pair.*signal)(why) != nullptr;
  }
};

}  // namespace

namespace {

// Calls `act` on each of ctx's TCP pairs; counts those it returned true for.
template <typename Act>
int eachTcpPair(gloo::Context& ctx, Act act) {
  int n = 0;
  for (int i = 0; i < ctx.size; ++i) {
    if (i == ctx.rank) continue;
    auto* tcp = dynamic_cast<gloo::transport::tcp::Pair*>(ctx.getPair(i).get());
    if (tcp != nullptr && act(*tcp)) ++n;
  }
  return n;
}

}  // namespace

int shutdownGlooPairs(gloo::Context& ctx) {
  return eachTcpPair(ctx,
                     [](gloo::transport::tcp::Pair& p) { return PairAccess::shutdownSocket(p); });
}

int failGlooPairs(gloo::Context& ctx, const std::string& why) {
  return eachTcpPair(ctx, [&](gloo::transport::tcp::Pair& p) { return PairAccess::fail(p, why); });
}

}  // namespace ddprun::worker
