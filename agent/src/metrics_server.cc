#include "metrics_server.h"

#include <boost/asio/read_until.hpp>
#include <boost/asio/streambuf.hpp>
#include <boost/asio/write.hpp>
#include <memory>

namespace ddprun::agent {

namespace asio = boost::asio;
using asio::ip::tcp;

StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::start(asio::io_context& io,
                                                              const std::string& host, int port,
                                                              Render metrics,
                                                              std::function<bool()> healthy) {
  std::unique_ptr<MetricsServer> server(
      new MetricsServer(io, std::move(metrics), std::move(healthy)));
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

void MetricsServer::accept() {
  acceptor_.async_accept([this](const boost::system::error_code& ec, tcp::socket socket) {
    if (ec) return;  // closed
    auto sock = std::make_shared<tcp::socket>(std::move(socket));
    auto buf = std::make_shared<asio::streambuf>(8192);
    asio::async_read_until(
        *sock, *buf, "\r\n\r\n", [this, sock, buf](const boost::system::error_code& rec, size_t) {
          if (rec && rec != asio::error::eof) return;
          std::istream in(buf.get());
          std::string method, path;
          in >> method >> path;
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
          auto out =
              std::make_shared<std::string>("HTTP/1.0 " + status + "\r\nContent-Type: " + type +
                                            "\r\nContent-Length: " + std::to_string(body.size()) +
                                            "\r\nConnection: close\r\n\r\n" + body);
          asio::async_write(*sock, asio::buffer(*out),
                            [sock, out](const boost::system::error_code&, size_t) {
                              boost::system::error_code ignored;
                              sock->shutdown(tcp::socket::shutdown_both, ignored);
                            });
        });
    accept();
  });
}

}  // namespace ddprun::agent
