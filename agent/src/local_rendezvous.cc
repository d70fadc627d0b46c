#include "local_rendezvous.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/post.hpp>
#include <cerrno>
#include <cstring>

namespace ddprun::agent {

StatusOr<int> findFreePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return unavailable(std::string("socket: ") + std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    int err = errno;
    ::close(fd);
    return unavailable(std::string("cannot find a free port: ") + std::strerror(err));
  }
  ::close(fd);
  return static_cast<int>(ntohs(addr.sin_port));
}

void LocalRendezvous::nextRound(RoundCallback done) {
  StatusOr<RoundInfo> result = base_;
  if (closed_) {
    result = rendezvous::runClosed(base_.run_id);
  } else {
    RoundInfo round = base_;
    round.round = next_round_++;
    if (pick_free_port_) {
      auto port = findFreePort();
      if (port.isOk()) {
        round.master_port = *port;
        result = round;
      } else {
        result = port.status();
      }
    } else {
      result = round;
    }
  }
  boost::asio::post(io_, [done = std::move(done), result = std::move(result)]() mutable {
    done(std::move(result));
  });
}

void LocalRendezvous::exitBarrier(Duration, StatusCallback done) {
  boost::asio::post(io_, [done = std::move(done)] { done(Status::ok()); });
}

void LocalRendezvous::shutdown(bool, bool, std::function<void()> done) {
  closed_ = true;
  boost::asio::post(io_, std::move(done));
}

}  // namespace ddprun::agent
