// PeerConnections: the per-host bound of the accept guard (accept_guard.h), with a fake table of
// which descriptors still hold which connection.
#include "ddprun/rendezvous/peer_connections.h"

#include <catch2/catch.hpp>
#include <map>
#include <string>

using ddprun::rendezvous::PeerConnections;

namespace {

// The descriptors the "kernel" holds: fd -> peer endpoint.
struct Open {
  std::map<int, std::string> fds;
  int asked = 0;
  PeerConnections::Alive alive() {
    return [this](int fd, const std::string& endpoint) {
      ++asked;
      auto it = fds.find(fd);
      return it != fds.end() && it->second == endpoint;
    };
  }
  bool accept(PeerConnections& c, const std::string& host, int port, int fd) {
    const std::string endpoint = host + ":" + std::to_string(port);
    fds[fd] = endpoint;
    const bool ok = c.admit(host, endpoint, fd, alive());
    if (!ok) fds.erase(fd);  // the guard closes it
    return ok;
  }
};

}  // namespace

TEST_CASE("a host is refused connections past the bound, another host is not", "[rendezvous]") {
  PeerConnections c(3);
  Open open;
  CHECK(open.accept(c, "10.0.0.1", 1001, 10));
  CHECK(open.accept(c, "10.0.0.1", 1002, 11));
  CHECK(open.accept(c, "10.0.0.1", 1003, 12));
  CHECK(open.asked == 0);  // under the bound nothing is checked
  CHECK_FALSE(open.accept(c, "10.0.0.1", 1004, 13));
  CHECK(c.count("10.0.0.1") == 3);
  CHECK(open.accept(c, "10.0.0.2", 2001, 14));
  CHECK(c.count("10.0.0.2") == 1);
}

TEST_CASE("connections closed since are found when the bound is reached and make room",
          "[rendezvous]") {
  PeerConnections c(2);
  Open open;
  REQUIRE(open.accept(c, "h", 1, 10));
  REQUIRE(open.accept(c, "h", 2, 11));
  open.fds.erase(10);  // gRPC closed it; the guard did not see that
  CHECK(open.accept(c, "h", 3, 12));
  CHECK(c.count("h") == 2);
  // Descriptor 11 reused by a connection of another peer: not h's any more.
  open.fds[11] = "other:9";
  CHECK(open.accept(c, "h", 4, 13));
  CHECK_FALSE(open.accept(c, "h", 5, 14));
}

TEST_CASE("a process keeps an eighth of its descriptors, 32 to half of them", "[rendezvous]") {
  using ddprun::rendezvous::descriptorsKept;
  using ddprun::rendezvous::leavesTooFewDescriptors;
  CHECK(descriptorsKept(1024) == 128);
  CHECK(descriptorsKept(1048576) == 131072);
  CHECK(descriptorsKept(128) == 32);
  CHECK(descriptorsKept(40) == 20);
  CHECK(descriptorsKept(0) == 0);
  CHECK_FALSE(leavesTooFewDescriptors(895, 1024));
  CHECK(leavesTooFewDescriptors(896, 1024));
  CHECK(leavesTooFewDescriptors(10, 20));
  CHECK_FALSE(leavesTooFewDescriptors(9, 20));
  CHECK_FALSE(leavesTooFewDescriptors(-1, 20));
}

TEST_CASE("a descriptor accepted again replaces its old record", "[rendezvous]") {
  PeerConnections c(1);
  Open open;
  REQUIRE(open.accept(c, "a", 1, 10));
  // 10 closed and accepted again, now from host b: a holds nothing any more.
  open.fds.erase(10);
  REQUIRE(open.accept(c, "b", 1, 10));
  CHECK(c.count("a") == 0);
  CHECK(c.count("b") == 1);
  CHECK(open.accept(c, "a", 2, 11));
  // The bound may change while connections are held: those held stay, new ones are refused.
  c.setMaxPerHost(0);
  CHECK_FALSE(open.accept(c, "a", 3, 12));
  CHECK(c.count("a") == 1);
}
