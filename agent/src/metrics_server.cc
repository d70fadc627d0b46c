#include "metrics_server.h"

#include <boost/asio/read_until.hpp>
#include <boost/asio/streambuf.hpp>
#include <boost/asio/write.hpp>
#include <istream>
#include <memory>

#include "ddprun/common/log.h"

namespace ddprun::agent {

namespace asio = boost::asio;
using asio::ip::tcp;

// One connection: its socket, its request buffer (one request of at most 8 KiB), and the timer
// that closes it at request_timeout. Counted in `open` until it is destroyed.
struct MetricsServer::Connection {
  Connection(tcp::socket s, std::shared_ptr<size_t> count)
      : socket(std::move(s)), timer(socket.get_executor()), open(std::move(count)) {
    ++*open;
  }
  ~Connection() { --*open; }
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;
  void close() {
    boost::system::error_code ignored;
    timer.cancel();
    socket.shutdown(tcp::socket::shutdown_both, ignored);
    socket.close(ignored);
  }
  tcp::socket socket;
  asio::steady_timer timer;
  asio::streambuf request{8192};
  std::string response;
  std::shared_ptr<size_t> open;
};

StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::start(asio::io_context& io,
                                                              const std::string& host, int port,
                                                              Render metrics,
                                                              std::function<bool()> healthy,
                                                              MetricsServerLimits limits) {
  std::unique_ptr<MetricsServer> server(
      new MetricsServer(io, std::move(metrics), std::move(healthy), limits));
  boost::system::error_code ec;
  auto addr = asio::ip::make_address(host, ec);
  if (ec)
    return invalidArgument("--metrics-port: cannot listen on '" + host + "': " + ec.message());
  tcp::endpoint ep(addr, static_cast<unsigned short>(port));
  server->acceptor_.open(ep.protocol(), ec);
  if (!ec) server->acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) server->acceptor_.bind(ep, ec);
  if (!ec) server->acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return unavailable("--metrics-port: cannot listen on " + host + ":" + std::to_string(port) +
                       ": " + ec.message());
  }
  server->port_ = server->acceptor_.local_endpoint().port();
  server->accept();
  return server;
}

MetricsServer::~MetricsServer() {
  *alive_ = false;
  boost::system::error_code ignored;
  acceptor_.close(ignored);
  retry_.cancel();
}

void MetricsServer::warn(const std::string& key, const std::string& text) {
  const auto n = log_throttle_.note(key, std::chrono::steady_clock::now());
  if (!n) return;
  logger("agent")->warn("metrics endpoint: {}", withCount(text, *n));
}

void MetricsServer::accept() {
  acceptor_.async_accept(
      [this, alive = alive_](const boost::system::error_code& ec, tcp::socket socket) {
        if (!*alive || ec == asio::error::operation_aborted) return;  // the server is gone
        loop_.check();
        if (ec) {
          // Out of descriptors (or another transient error): the endpoint stays, and tries again.
          warn("accept", "accepting a connection failed: " + ec.message() + "; retrying every " +
                             std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(
                                                limits_.accept_retry)
                                                .count()) +
                             " ms");
          retry_.expires_after(limits_.accept_retry);
          retry_.async_wait([this, alive](const boost::system::error_code& wait_ec) {
            if (!wait_ec && *alive) accept();
          });
          return;
        }
        if (*open_ >= limits_.max_connections) {
          boost::system::error_code peer_ec;
          const auto peer = socket.remote_endpoint(peer_ec);
          warn("full", "closed a connection from " +
                           (peer_ec ? std::string("?") : peer.address().to_string()) + ": " +
                           std::to_string(*open_) + " are open, the most it serves at once");
          boost::system::error_code ignored;
          socket.close(ignored);
        } else {
          serve(std::move(socket));
        }
        accept();
      });
}

void MetricsServer::serve(tcp::socket socket) {
  auto conn = std::make_shared<Connection>(std::move(socket), open_);
  conn->timer.expires_after(limits_.request_timeout);
  // The timer holds the connection until it fires or is cancelled: a client that sends nothing,
  // or does not read, is closed then.
  conn->timer.async_wait([conn](const boost::system::error_code& ec) {
    if (!ec) conn->close();
  });
  asio::async_read_until(conn->socket, conn->request, "\r\n\r\n",
                         [this, conn, alive = alive_](const boost::system::error_code& ec, size_t) {
                           if (ec == asio::error::operation_aborted) return;  // timed out
                           if (!*alive || (ec && ec != asio::error::eof)) {
                             conn->close();
                             return;
                           }
                           std::istream in(&conn->request);
                           std::string method, path;
                           in >> method >> path;
                           conn->response = respond(method, path);
                           asio::async_write(
                               conn->socket, asio::buffer(conn->response),
                               [conn](const boost::system::error_code&, size_t) { conn->close(); });
                         });
}

std::string MetricsServer::respond(const std::string& method, const std::string& path) {
  std::string status = "200 OK", body, type = "text/plain";
  if (method != "GET") {
    status = "405 Method Not Allowed";
    body = "only GET\n";
  } else if (path == "/healthz") {
    const bool ok = healthy_();
    status = ok ? "200 OK" : "503 Service Unavailable";
    body = ok ? "ok\n" : "unhealthy\n";
  } else if (path == "/metrics") {
    body = metrics_();
    type = "text/plain; version=0.0.4";
  } else {
    status = "404 Not Found";
    body = "try /healthz or /metrics\n";
  }
  return "HTTP/1.0 " + status + "\r\nContent-Type: " + type +
         "\r\nContent-Length: " + std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" +
         body;
}

}  // namespace ddprun::agent
