// MetricsServer: a minimal HTTP/1.0 endpoint on the agent's io_context for /healthz and
// Prometheus-format /metrics. Each connection reads one request and gets one response; the body
// comes from a callback run on the io thread, so it may read the supervisor's state directly.
//
// Its port is reachable by anyone on the network, and /healthz is what a Kubernetes liveness
// probe asks, so it is bounded (MetricsServerLimits): a connection whose request and response do
// not pass within request_timeout is closed; past max_connections open at once, a new connection
// is closed as it is accepted; an accept that fails (out of file descriptors) is retried after
// accept_retry instead of ending the endpoint. Each is logged, at most once a minute.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <functional>
#include <memory>
#include <string>

#include "ddprun/common/clock.h"
#include "ddprun/common/log_throttle.h"
#include "ddprun/common/loop_affinity.h"
#include "ddprun/common/status.h"

namespace ddprun::agent {

struct MetricsServerLimits {
  Duration request_timeout = std::chrono::seconds(10);
  size_t max_connections = 64;
  Duration accept_retry = std::chrono::milliseconds(100);
};

class MetricsServer {
 public:
  using Render = std::function<std::string()>;
  // Listens on host:port (port 0 picks one); healthy() decides /healthz's 200 or 503.
  static StatusOr<std::unique_ptr<MetricsServer>> start(boost::asio::io_context& io,
                                                        const std::string& host, int port,
                                                        Render metrics,
                                                        std::function<bool()> healthy,
                                                        MetricsServerLimits limits = {});
  // Closes the listener; connections still open are answered or time out on their own.
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;
  int port() const { return port_; }
  // Connections open now (read, answered or timed out: not yet closed).
  size_t openConnections() const { return *open_; }

 private:
  struct Connection;
  MetricsServer(boost::asio::io_context& io, Render metrics, std::function<bool()> healthy,
                MetricsServerLimits limits)
      : acceptor_(io),
        retry_(io),
        metrics_(std::move(metrics)),
        healthy_(std::move(healthy)),
        limits_(limits) {}
  void accept();
  void serve(boost::asio::ip::tcp::socket socket);
  std::string respond(const std::string& method, const std::string& path);
  void warn(const std::string& key, const std::string& text);

  boost::asio::ip::tcp::acceptor acceptor_;
  boost::asio::steady_timer retry_;
  Render metrics_;
  std::function<bool()> healthy_;
  MetricsServerLimits limits_;
  // Shared with the connections, which may outlive the server in the io_context's queue; alive_
  // is false once the server is gone (its handlers then touch nothing of it).
  std::shared_ptr<size_t> open_ = std::make_shared<size_t>(0);
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
  LogThrottle log_throttle_{std::chrono::minutes(1)};
  LoopAffinity loop_{"MetricsServer"};
  int port_ = 0;
};

}  // namespace ddprun::agent
