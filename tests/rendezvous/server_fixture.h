// Shared pieces of the gRPC rendezvous tests: a server started on 127.0.0.1 with a free port,
// TLS material for it, and waiting (bounded) for an event that has no push notification.
#pragma once

#include <catch2/catch.hpp>
#include <cstdlib>
#include <memory>
#include <string>

#include "ddprun/rendezvous/server.h"
#include "process_helpers.h"

namespace ddprun::rendezvous::testing {

using ddprun::testing::waitUntil;

// Server options with TLS on: a fresh self-signed certificate for localhost and 127.0.0.1 (made
// with openssl in a temp dir that is removed again); clients trust options.tls_cert_pem.
inline ServerOptions selfSignedTls() {
  char dir_template[] = "/tmp/ddprun-tls-XXXXXX";
  REQUIRE(mkdtemp(dir_template) != nullptr);
  const std::string dir = dir_template;
  const std::string cmd =
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost"
      " -addext subjectAltName=DNS:localhost,IP:127.0.0.1 -keyout " +
      dir + "/key.pem -out " + dir + "/cert.pem 2>/dev/null";
  REQUIRE(std::system(cmd.c_str()) == 0);
  ServerOptions options;
  options.tls_cert_pem = readFile(dir + "/cert.pem").value();
  options.tls_key_pem = readFile(dir + "/key.pem").value();
  REQUIRE(std::system(("rm -rf " + dir).c_str()) == 0);
  return options;
}

inline std::unique_ptr<RendezvousServer> startServer(ServerOptions options = {}) {
  auto server = RendezvousServer::start(std::move(options));
  REQUIRE(server.isOk());
  return std::move(server).value();
}

}  // namespace ddprun::rendezvous::testing
