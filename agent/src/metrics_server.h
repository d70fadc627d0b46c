// MetricsServer: a minimal HTTP/1.0 endpoint on the agent's io_context for /healthz and
// Prometheus-format /metrics. Each connection reads one request and gets one response; the body
// comes from a callback run on the io thread, so it may read the supervisor's state directly.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <functional>
#include <string>

#include "ddprun/common/status.h"

namespace ddprun::agent {

class MetricsServer {
 public:
  using Render = std::function<std::string()>;
  // Listens on host:port (port 0 picks one); healthy() decides /healthz's 200 or 503.
  static StatusOr<std::unique_ptr<MetricsServer>> start(boost::asio::io_context& io,
                                                        const std::string& host, int port,
                                                        Render metrics,
                                                        std::function<bool()> healthy);
  int port() const { return port_; }

 private:
  MetricsServer(boost::asio::io_context& io, Render metrics, std::function<bool()> healthy)
      : acceptor_(io), metrics_(std::move(metrics)), healthy_(std::move(healthy)) {}
  void accept();

  boost::asio::ip::tcp::acceptor acceptor_;
  Render metrics_;
  std::function<bool()> healthy_;
  int port_ = 0;
};

}  // namespace ddprun::agent
