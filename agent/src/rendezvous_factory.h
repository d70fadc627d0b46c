// makeRendezvous: builds what a RendezvousChoice (choose_rendezvous.h) names — the in-process
// rendezvous of one node, or the multi-node protocol over the gRPC service, starting the
// rendezvous server inside this agent when it hosts it. Called on the loop thread before it runs.
#pragma once

#include <boost/asio/io_context.hpp>
#include <memory>

#include "ddprun/agent/choose_rendezvous.h"
#include "ddprun/agent/multinode_rendezvous.h"
#include "ddprun/agent/rendezvous_client.h"
#include "ddprun/agent/rendezvous_service.h"
#include "ddprun/rendezvous/conf.h"
#include "ddprun/rendezvous/server.h"

namespace ddprun::agent {

// Everything the runner holds for the job's rendezvous. Destroy `client` before `service`, and
// both after the loop stopped (member order does that).
struct RendezvousSetup {
  std::unique_ptr<rendezvous::RendezvousServer> server;  // when this agent hosts it
  std::unique_ptr<RendezvousService> service;            // multi-node only
  std::unique_ptr<RendezvousClient> client;              // what the supervisor talks to
};

// UNAVAILABLE when this agent must host the rendezvous and cannot bind its endpoint.
StatusOr<RendezvousSetup> makeRendezvous(const RendezvousChoice& choice,
                                         const rendezvous::RendezvousConf& conf,
                                         boost::asio::io_context& io,
                                         MultiNodeRendezvous::EventSink sink);

}  // namespace ddprun::agent
