// MetricsServer against real loopback clients: its answers, and its bounds (a client that sends
// nothing, too many clients at once, an accept that fails for want of descriptors).
#include "metrics_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/executor_work_guard.hpp>
#include <catch2/catch.hpp>
#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "log_capture.h"
#include "process_helpers.h"
#include "sanitizer.h"

using namespace ddprun;
using namespace ddprun::agent;
using namespace ddprun::testing;
using namespace std::chrono_literals;

namespace {

// The server on an io_context of its own thread.
struct Served {
  explicit Served(MetricsServerLimits limits = {}) {
    std::promise<int> port;
    thread = std::thread([&] {
      auto started = MetricsServer::start(
          io, "127.0.0.1", 0, [] { return std::string("ddprun_up 1\n"); }, [] { return true; },
          limits);
      if (!started.isOk()) {
        port.set_value(-1);
        return;
      }
      server = std::move(started).value();
      port.set_value(server->port());
      io.run();
      server.reset();  // on its loop
    });
    this->port = port.get_future().get();
    REQUIRE(this->port > 0);
  }
  ~Served() {
    work.reset();
    io.stop();
    thread.join();
  }
  size_t open() {
    std::promise<size_t> n;
    boost::asio::post(io, [&] { n.set_value(server->openConnections()); });
    return n.get_future().get();
  }
  boost::asio::io_context io;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work{io.get_executor()};
  std::unique_ptr<MetricsServer> server;
  std::thread thread;
  int port = 0;
};

// A blocking loopback client: fd < 0 when it could not connect.
struct Conn {
  explicit Conn(int port) {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(static_cast<uint16_t>(port));
    ::inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
    if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) != 0) {
      ::close(fd);
      fd = -1;
    }
  }
  struct Adopt {};
  Conn(Adopt, int descriptor) : fd(descriptor) {}
  ~Conn() {
    if (fd >= 0) ::close(fd);
  }
  void send(const std::string& text) const {
    REQUIRE(::send(fd, text.data(), text.size(), MSG_NOSIGNAL) ==
            static_cast<ssize_t>(text.size()));
  }
  // What the server sent until it closed the connection, or nullopt when it did not close it
  // within `bound`.
  std::optional<std::string> untilClosed(std::chrono::milliseconds bound = 5000ms) const {
    std::string got;
    const auto until = std::chrono::steady_clock::now() + bound;
    while (std::chrono::steady_clock::now() < until) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 50) != 1) continue;
      char buf[4096];
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) return got;
      got.append(buf, static_cast<size_t>(n));
    }
    return std::nullopt;
  }
  int fd = -1;
};

std::string get(int port, const std::string& path) {
  Conn c(port);
  REQUIRE(c.fd >= 0);
  c.send("GET " + path + " HTTP/1.0\r\n\r\n");
  auto got = c.untilClosed();
  REQUIRE(got.has_value());
  return *got;
}

}  // namespace

TEST_CASE("the metrics endpoint answers /healthz, /metrics and nothing else", "[agent]") {
  Served s;
  CHECK_THAT(get(s.port, "/healthz"),
             Catch::StartsWith("HTTP/1.0 200 OK") && Catch::EndsWith("ok\n"));
  CHECK_THAT(get(s.port, "/metrics"), Catch::EndsWith("\r\n\r\nddprun_up 1\n"));
  CHECK_THAT(get(s.port, "/other"), Catch::StartsWith("HTTP/1.0 404"));
  Conn post(s.port);
  post.send("POST /healthz HTTP/1.0\r\n\r\n");
  CHECK_THAT(post.untilClosed().value_or(""), Catch::StartsWith("HTTP/1.0 405"));
  // A request past 8 KiB without its end is closed unanswered.
  Conn huge(s.port);
  huge.send("GET /" + std::string(9000, 'a'));
  CHECK(huge.untilClosed() == std::string());
  CHECK(waitUntil([&] { return s.open() == 0; }, 5s));
}

TEST_CASE("a metrics client that sends nothing is closed after the request timeout", "[agent]") {
  MetricsServerLimits limits;
  limits.request_timeout = 300ms;
  Served s(limits);
  LogCapture log("agent");
  Conn silent(s.port);
  Conn half(s.port);
  half.send("GET /healthz HTTP/1.0\r\n");  // never ends its request
  const auto start = std::chrono::steady_clock::now();
  CHECK(silent.untilClosed(5000ms) == std::string());
  CHECK(half.untilClosed(5000ms) == std::string());
  CHECK(std::chrono::steady_clock::now() - start < 3s);
  CHECK(waitUntil([&] { return s.open() == 0; }, 5s));
  CHECK_THAT(get(s.port, "/healthz"), Catch::StartsWith("HTTP/1.0 200 OK"));
}

TEST_CASE("past max_connections a metrics client is closed at once, and served again after",
          "[agent]") {
  MetricsServerLimits limits;
  limits.max_connections = 4;
  limits.request_timeout = 60s;
  Served s(limits);
  LogCapture log("agent");
  std::vector<std::unique_ptr<Conn>> idle;
  for (int i = 0; i < 4; ++i) idle.push_back(std::make_unique<Conn>(s.port));
  REQUIRE(waitUntil([&] { return s.open() == 4; }, 5s));
  Conn fifth(s.port);
  CHECK(fifth.untilClosed(2000ms) == std::string());
  Conn sixth(s.port);
  CHECK(sixth.untilClosed(2000ms) == std::string());
  CHECK(log.count("metrics endpoint: closed a connection from 127.0.0.1: 4 are open, the most it "
                  "serves at once") == 1);
  idle.clear();
  CHECK(waitUntil([&] { return s.open() == 0; }, 5s));
  CHECK_THAT(get(s.port, "/healthz"), Catch::StartsWith("HTTP/1.0 200 OK"));
}

// Out of descriptors, Asio's accept fails (EMFILE); the endpoint used to end there for good.
TEST_CASE("a metrics endpoint out of descriptors serves the waiting clients once it has them again",
          "[agent]") {
  if (kNoDescriptorsToSpare) {
    WARN("skipped in the sanitizer build: UBSan's vptr check needs a descriptor (sanitizer.h)");
    return;
  }
  MetricsServerLimits limits;
  limits.accept_retry = 50ms;
  Served s(limits);
  LogCapture log("agent");
  // The clients' sockets first: connect() needs no descriptor of its own.
  std::vector<int> fds;
  for (int i = 0; i < 3; ++i) fds.push_back(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  rlimit lim{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &lim) == 0);
  rlimit none = lim;
  none.rlim_cur = 0;
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &none) == 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(s.port));
  ::inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
  for (int fd : fds) {
    CHECK(::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) == 0);
    const std::string request = "GET /healthz HTTP/1.0\r\n\r\n";
    CHECK(::send(fd, request.data(), request.size(), MSG_NOSIGNAL) ==
          static_cast<ssize_t>(request.size()));
  }
  const bool failed = waitUntil([&] { return log.count("accepting a connection failed") > 0; }, 5s);
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &lim) == 0);
  CHECK(failed);
  for (int fd : fds) {
    Conn answered(Conn::Adopt{}, fd);
    CHECK_THAT(answered.untilClosed().value_or(""), Catch::StartsWith("HTTP/1.0 200 OK"));
  }
  CHECK(log.count("metrics endpoint: accepting a connection failed: Too many open files; "
                  "retrying every 50 ms") == 1);
}
