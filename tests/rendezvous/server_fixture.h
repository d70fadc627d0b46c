// Shared pieces of the gRPC rendezvous tests: a server started on 127.0.0.1 with a free port,
// and waiting (bounded) for an event that has no push notification.
#pragma once

#include <catch2/catch.hpp>
#include <memory>

#include "ddprun/rendezvous/server.h"
#include "process_helpers.h"

namespace ddprun::rendezvous::testing {

using ddprun::testing::waitUntil;

inline std::unique_ptr<RendezvousServer> startServer(ServerOptions options = {}) {
  auto server = RendezvousServer::start(std::move(options));
  REQUIRE(server.isOk());
  return std::move(server).value();
}

}  // namespace ddprun::rendezvous::testing
