// A stand-in for an etcd 2.x member's client port, for the "etcd too old" cases: etcd 2 serves
// HTTP/1.1 only (Go's net/http), so it answers gRPC's HTTP/2 preface with "400 Bad Request" and
// `GET /version` with {"etcdserver":"2.3.8","etcdcluster":"2.3.0"}, and this server does the
// same on a free loopback port. No real etcd 2 ships with Debian 12, and etcd 3.4 cannot turn
// its v3 API off.
//
// Threading: one accept thread, answering one connection at a time; the destructor stops it.
#pragma once

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <stdexcept>
#include <string>
#include <thread>

namespace ddprun::testing {

class FakeEtcd2 {
 public:
  explicit FakeEtcd2(std::string version = "2.3.8") : version_(std::move(version)) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
        ::listen(fd_, 64) != 0 ||
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      throw std::runtime_error("FakeEtcd2: cannot listen on 127.0.0.1");
    }
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~FakeEtcd2() {
    stop_ = true;
    thread_.join();
    ::close(fd_);
  }
  FakeEtcd2(const FakeEtcd2&) = delete;
  FakeEtcd2& operator=(const FakeEtcd2&) = delete;

  std::string endpoint() const { return "127.0.0.1:" + std::to_string(port_); }
  int connections() const { return connections_; }

 private:
  void serve() {
    while (!stop_) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      const int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) continue;
      ++connections_;
      answer(c);
      ::close(c);
    }
  }

  // Reads what arrives within 500 ms (a request line is enough) and answers as etcd 2 does.
  void answer(int c) {
    std::string request;
    char buf[4096];
    pollfd p{c, POLLIN, 0};
    while (request.find("\r\n") == std::string::npos && ::poll(&p, 1, 500) > 0) {
      const ssize_t n = ::recv(c, buf, sizeof(buf), 0);
      if (n <= 0) break;
      request.append(buf, static_cast<size_t>(n));
    }
    std::string reply;
    if (request.rfind("GET /version ", 0) == 0) {
      const std::string body =
          "{\"etcdserver\":\"" + version_ + "\",\"etcdcluster\":\"" + version_ + "\"}";
      reply = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " +
              std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" + body;
    } else {
      reply =
          "HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
          "Connection: close\r\n\r\n400 Bad Request";
    }
    (void)::send(c, reply.data(), reply.size(), MSG_NOSIGNAL);
  }

  std::string version_;
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> connections_{0};
  std::thread thread_;
};

}  // namespace ddprun::testing
