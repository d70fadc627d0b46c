// accept4() over libc's: see accept_guard.h. Linked only into executables (an OBJECT library),
// never into a library a user links.
#include "ddprun/rendezvous/accept_guard.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>

#include "ddprun/common/log.h"
#include "ddprun/common/log_throttle.h"
#include "ddprun/common/open_files.h"
#include "ddprun/common/thread_annotations.h"
#include "ddprun/rendezvous/peer_connections.h"

namespace ddprun::rendezvous {
namespace {

using Accept4 = int (*)(int, sockaddr*, socklen_t*, int);

// Connections refused in one call before it answers EAGAIN: a flood cannot hold gRPC's poller.
constexpr int kMaxRefusedPerCall = 1024;

// Shared by every thread that accepts (gRPC's pollers).
struct Guard {
  Mutex mu;
  PeerConnections connections GUARDED_BY(mu){AcceptLimits{}.max_connections_per_peer};
  std::string how_to_raise GUARDED_BY(mu) = AcceptLimits{}.how_to_raise;
  LogThrottle log GUARDED_BY(mu){std::chrono::minutes(1)};
  // /dev/null, closed to make room for one accept when out of descriptors.
  int reserve GUARDED_BY(mu) = -1;
};

// Never destroyed: gRPC's threads may accept while static destructors run.
Guard& guard() {
  static Guard* g = [] {
    auto* made = new Guard;
    MutexLock lock(made->mu);
    made->reserve = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    return made;
  }();
  return *g;
}

Accept4 libcAccept4() {
  static const Accept4 real = reinterpret_cast<Accept4>(::dlsym(RTLD_NEXT, "accept4"));
  return real;
}

// HOST (an IPv4-mapped IPv6 address as IPv4) and HOST:PORT of a TCP peer; nullopt for others.
std::optional<std::pair<std::string, std::string>> peerOf(const sockaddr_storage& a) {
  char text[INET6_ADDRSTRLEN] = {0};
  if (a.ss_family == AF_INET) {
    const auto& v4 = reinterpret_cast<const sockaddr_in&>(a);
    ::inet_ntop(AF_INET, &v4.sin_addr, text, sizeof text);
    return std::make_pair(std::string(text),
                          std::string(text) + ":" + std::to_string(ntohs(v4.sin_port)));
  }
  if (a.ss_family == AF_INET6) {
    const auto& v6 = reinterpret_cast<const sockaddr_in6&>(a);
    const std::string port = std::to_string(ntohs(v6.sin6_port));
    if (IN6_IS_ADDR_V4MAPPED(&v6.sin6_addr)) {
      ::inet_ntop(AF_INET, &v6.sin6_addr.s6_addr[12], text, sizeof text);
      return std::make_pair(std::string(text), std::string(text) + ":" + port);
    }
    ::inet_ntop(AF_INET6, &v6.sin6_addr, text, sizeof text);
    const std::string host = "[" + std::string(text) + "]";
    return std::make_pair(host, host + ":" + port);
  }
  return std::nullopt;
}

bool stillHolds(int fd, const std::string& endpoint) {
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return false;
  auto peer = peerOf(a);
  return peer && peer->second == endpoint;
}

void warnThrottled(Guard& g, const std::string& key, const std::string& text) {
  std::optional<uint64_t> n;
  {
    MutexLock lock(g.mu);
    n = g.log.note(key, std::chrono::steady_clock::now());
  }
  if (!n) return;
  logger("net")->warn("{}", withCount(text, *n));
}

// Out of descriptors: takes one pending connection off `listener` through the reserve and closes
// it. False when there was none (or no reserve to make room with). Never blocks: a blocking
// listener with nothing pending fails with EMFILE too, before it would wait.
bool dropOnePending(Guard& g, int listener) {
  pollfd pending{listener, POLLIN, 0};
  if (::poll(&pending, 1, 0) != 1 || (pending.revents & POLLIN) == 0) return false;
  MutexLock lock(g.mu);
  if (g.reserve < 0) g.reserve = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (g.reserve < 0) return false;
  ::close(g.reserve);
  g.reserve = -1;
  const int c = libcAccept4()(listener, nullptr, nullptr, SOCK_CLOEXEC);
  if (c >= 0) ::close(c);
  g.reserve = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  return c >= 0;
}

int guardedAccept(int listener, sockaddr* addr, socklen_t* len, int flags) {
  const Accept4 real = libcAccept4();
  if (real == nullptr) {
    errno = ENOSYS;
    return -1;
  }
  Guard& g = guard();
  for (int refused = 0; refused < kMaxRefusedPerCall; ++refused) {
    sockaddr_storage own{};
    socklen_t own_len = sizeof own;
    const int c = real(listener, reinterpret_cast<sockaddr*>(&own), &own_len, flags);
    if (c < 0) {
      const int err = errno;
      if (err != EMFILE && err != ENFILE) return -1;
      if (!dropOnePending(g, listener)) {
        errno = EAGAIN;
        return -1;
      }
      warnThrottled(g, "out of descriptors",
                    std::string("out of file descriptors (") + std::strerror(err) + ", limit " +
                        std::to_string(openFileLimit()) +
                        "): closed a pending connection so that the server keeps listening; "
                        "raise the limit (ulimit -n), or find the peers that hold the "
                        "connections (ss -tn)");
      continue;
    }
    auto peer = peerOf(own);
    const size_t limit = static_cast<size_t>(openFileLimit());
    if (peer && limit != 0 && leavesTooFewDescriptors(c, limit)) {
      ::close(c);
      warnThrottled(g, "few descriptors",
                    "refused a connection from " + peer->first +
                        ": its descriptor would be number " + std::to_string(c) +
                        " of this process's " + std::to_string(limit) + ", and the last " +
                        std::to_string(descriptorsKept(limit)) +
                        " are kept for its own work; raise the limit (ulimit -n), or find the "
                        "peers that hold the connections (ss -tn)");
      continue;
    }
    if (peer) {
      bool admitted = false;
      size_t bound = 0;
      std::string how;
      {
        MutexLock lock(g.mu);
        admitted = g.connections.admit(peer->first, peer->second, c, stillHolds);
        bound = g.connections.maxPerHost();
        how = g.how_to_raise;
      }
      if (!admitted) {
        ::close(c);
        warnThrottled(
            g, "peer " + peer->first,
            "refused a connection from " + peer->first + ": it holds " + std::to_string(bound) +
                " connections to this process's servers, the most one host may (" + how + ")");
        continue;
      }
    }
    if (addr != nullptr && len != nullptr) {
      const socklen_t n = std::min(*len, own_len);
      std::memcpy(addr, &own, n);
      *len = own_len;
    }
    return c;
  }
  errno = EAGAIN;
  return -1;
}

}  // namespace

void setAcceptLimits(const AcceptLimits& limits) {
  Guard& g = guard();
  MutexLock lock(g.mu);
  g.connections.setMaxPerHost(limits.max_connections_per_peer);
  g.how_to_raise = limits.how_to_raise;
}

bool acceptGuardInstalled() {
  return ::dlsym(RTLD_DEFAULT, "accept4") == reinterpret_cast<void*>(&::accept4);
}

}  // namespace ddprun::rendezvous

// Exported by the executable (-Wl,--export-dynamic-symbol=accept4), so libgrpc's calls bind here.
extern "C" int accept4(int fd, sockaddr* addr, socklen_t* len, int flags) {
  return ddprun::rendezvous::guardedAccept(fd, addr, len, flags);
}
