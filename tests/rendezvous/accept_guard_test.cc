// The accept guard (accept_guard.h) in this test binary: it links ddprun::accept_guard, so its
// ::accept4 calls are the guard's, as libgrpc's are in the executables.
#include "ddprun/rendezvous/accept_guard.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <string>

#include "ddprun/rendezvous/peer_connections.h"
#include "log_capture.h"
#include "sanitizer.h"

using namespace ddprun::rendezvous;
using ddprun::testing::LogCapture;

namespace {

struct Fd {
  explicit Fd(int f = -1) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int fd;
};

sockaddr_in loopback(const char* host, int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, host, &a.sin_addr);
  return a;
}

// A non-blocking listener on 127.0.0.1, as gRPC's.
struct Listener {
  Listener() : sock(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)) {
    sockaddr_in a = loopback("127.0.0.1", 0);
    REQUIRE(::bind(sock.fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(::listen(sock.fd, 64) == 0);
    socklen_t len = sizeof a;
    REQUIRE(::getsockname(sock.fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
    port = ntohs(a.sin_port);
  }
  // The guard's accept4: the descriptor, or -errno.
  int accept() {
    sockaddr_storage peer{};
    socklen_t len = sizeof peer;
    const int c =
        ::accept4(sock.fd, reinterpret_cast<sockaddr*>(&peer), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    return c >= 0 ? c : -errno;
  }
  Fd sock;
  int port = 0;
};

// A client socket made now (descriptors may be scarce later) and connected by connect().
struct Client {
  Client() : sock(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {}
  bool connect(int port, const char* from = "127.0.0.1") {
    sockaddr_in src = loopback(from, 0);
    sockaddr_in dst = loopback("127.0.0.1", port);
    return ::bind(sock.fd, reinterpret_cast<sockaddr*>(&src), sizeof src) == 0 &&
           ::connect(sock.fd, reinterpret_cast<sockaddr*>(&dst), sizeof dst) == 0;
  }
  // Whether the server closed it (EOF or reset within 2 s).
  bool closedByServer() {
    pollfd p{sock.fd, POLLIN, 0};
    if (::poll(&p, 1, 2000) != 1) return false;
    char c;
    return ::recv(sock.fd, &c, 1, 0) <= 0;
  }
  Fd sock;
};

int lowestFreeDescriptor() {
  const int probe = ::dup(0);
  ::close(probe);
  return probe;
}

// Sets the soft descriptor limit for the scope.
struct SoftLimit {
  explicit SoftLimit(rlim_t soft) {
    REQUIRE(::getrlimit(RLIMIT_NOFILE, &saved) == 0);
    rlimit lowered = saved;
    lowered.rlim_cur = soft;
    REQUIRE(::setrlimit(RLIMIT_NOFILE, &lowered) == 0);
  }
  ~SoftLimit() { ::setrlimit(RLIMIT_NOFILE, &saved); }
  rlimit saved{};
};

}  // namespace

TEST_CASE("the guard's accept4 is the one this executable's libraries call", "[rendezvous]") {
  CHECK(acceptGuardInstalled());
}

TEST_CASE("out of descriptors the guard closes the pending connection and the listener lives",
          "[rendezvous]") {
  if (ddprun::testing::kNoDescriptorsToSpare) {
    WARN("skipped in the sanitizer build: UBSan's vptr check needs a descriptor (sanitizer.h)");
    return;
  }
  setAcceptLimits({});  // the guard and its reserve descriptor exist before the limit is lowered
  LogCapture log("net");
  Listener l;
  Client first, second;
  REQUIRE(first.connect(l.port));
  REQUIRE(second.connect(l.port));
  {
    SoftLimit none(static_cast<rlim_t>(lowestFreeDescriptor()));
    CHECK(l.accept() == -EAGAIN);  // both taken off the queue and closed
  }
  CHECK(first.closedByServer());
  CHECK(second.closedByServer());
  CHECK(log.count("out of file descriptors (Too many open files, limit ") == 1);
  CHECK(log.count("closed a pending connection so that the server keeps listening") == 1);
  // Descriptors again: the next connection is accepted.
  Client third;
  REQUIRE(third.connect(l.port));
  const int c = l.accept();
  CHECK(c >= 0);
  Fd accepted(c);
  CHECK_FALSE(third.closedByServer());
}

TEST_CASE("a connection that would leave the process too few descriptors is refused",
          "[rendezvous]") {
  setAcceptLimits({});
  LogCapture log("net");
  Listener l;
  Client client;
  REQUIRE(client.connect(l.port));
  const int next = lowestFreeDescriptor();
  {
    SoftLimit few(static_cast<rlim_t>(next) + 4);  // 4 left: fewer than it keeps
    CHECK(l.accept() == -EAGAIN);
  }
  CHECK(client.closedByServer());
  CHECK(log.count("refused a connection from 127.0.0.1: its descriptor would be number " +
                  std::to_string(next) + " of this process's " + std::to_string(next + 4)) == 1);
}

TEST_CASE("a host past max_connections_per_peer is refused by the guard, another host is not",
          "[rendezvous]") {
  setAcceptLimits({2, "the test's bound"});
  LogCapture log("net");
  Listener l;
  Client a1, a2, a3, b1;
  REQUIRE(a1.connect(l.port));
  REQUIRE(a2.connect(l.port));
  Fd s1(l.accept()), s2(l.accept());
  CHECK(s1.fd >= 0);
  CHECK(s2.fd >= 0);
  REQUIRE(a3.connect(l.port));
  CHECK(l.accept() == -EAGAIN);
  CHECK(a3.closedByServer());
  CHECK(log.count("refused a connection from 127.0.0.1: it holds 2 connections to this "
                  "process's servers, the most one host may (the test's bound)") == 1);
  REQUIRE(b1.connect(l.port, "127.0.0.2"));
  Fd t1(l.accept());
  CHECK(t1.fd >= 0);
  // One of 127.0.0.1's closes: it may connect again.
  ::close(s1.fd);
  s1.fd = -1;
  Client a4;
  REQUIRE(a4.connect(l.port));
  Fd s4(l.accept());
  CHECK(s4.fd >= 0);
  setAcceptLimits({});
}
