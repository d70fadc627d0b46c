#include "http_probe.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <memory>

namespace ddprun::etcd {

std::optional<std::string> etcdVersionFromHttpReply(const std::string& reply) {
  if (reply.rfind("HTTP/1.", 0) != 0) return std::nullopt;
  const size_t body = reply.find("\r\n\r\n");
  if (body == std::string::npos) return std::nullopt;
  const std::string key = "\"etcdserver\"";
  size_t at = reply.find(key, body);
  if (at == std::string::npos) return std::nullopt;
  at = reply.find_first_not_of(" \t\r\n", at + key.size());
  if (at == std::string::npos || reply[at] != ':') return std::nullopt;
  at = reply.find_first_not_of(" \t\r\n", at + 1);
  if (at == std::string::npos || reply[at] != '"') return std::nullopt;
  const size_t end = reply.find('"', at + 1);
  if (end == std::string::npos || end == at + 1 || end - at > 64) return std::nullopt;
  std::string version = reply.substr(at + 1, end - at - 1);
  for (char c : version) {
    const bool ok = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                    c == '.' || c == '-' || c == '+';
    if (!ok) return std::nullopt;
  }
  return version;
}

namespace {

// A socket whose descriptor is closed on every return path.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// Waits for `events` on `fd` until `deadline`; false on timeout or error.
bool waitFor(int fd, short events, std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, static_cast<int>(left.count()));
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) return false;
  }
}

}  // namespace

std::string httpGetVersion(const std::string& endpoint, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const size_t colon = endpoint.rfind(':');
  if (colon == std::string::npos || colon == 0) return "";
  std::string host = endpoint.substr(0, colon);
  const std::string port = endpoint.substr(colon + 1);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0 || res == nullptr) return "";
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> own(res, &::freeaddrinfo);
  Fd sock;
  sock.fd = ::socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (sock.fd < 0) return "";
  if (::connect(sock.fd, res->ai_addr, res->ai_addrlen) != 0) {
    if (errno != EINPROGRESS || !waitFor(sock.fd, POLLOUT, deadline)) return "";
    int err = 0;
    socklen_t len = sizeof(err);
    if (::getsockopt(sock.fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) return "";
  }
  const std::string request =
      "GET /version HTTP/1.1\r\nHost: " + endpoint + "\r\nConnection: close\r\n\r\n";
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = ::send(sock.fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
    } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      if (!waitFor(sock.fd, POLLOUT, deadline)) return "";
    } else {
      return "";
    }
  }
  // etcd's answer is well under a kilobyte; whatever is bigger is not it.
  std::string reply;
  char buf[4096];
  while (reply.size() < 16384 && waitFor(sock.fd, POLLIN, deadline)) {
    const ssize_t n = ::recv(sock.fd, buf, sizeof(buf), 0);
    if (n > 0) {
      reply.append(buf, static_cast<size_t>(n));
    } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
      break;
    }
  }
  return reply;
}

}  // namespace ddprun::etcd
