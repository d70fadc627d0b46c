#include "rendezvous_factory.h"

#include "ddprun/common/log.h"
#include "grpc_rendezvous_service.h"
#include "local_rendezvous.h"

namespace ddprun::agent {

StatusOr<RendezvousSetup> makeRendezvous(const RendezvousChoice& choice,
                                         const rendezvous::RendezvousConf& conf,
                                         boost::asio::io_context& io,
                                         MultiNodeRendezvous::EventSink sink) {
  RendezvousSetup out;
  if (choice.kind == RendezvousKind::kLocal) {
    out.client = std::make_unique<LocalRendezvous>(io, choice.local_round, choice.pick_free_port);
    return out;
  }
  auto log = logger("agent");
  if (choice.hosting != Hosting::kNo) {
    rendezvous::ServerOptions so;
    so.listen = choice.endpoint;
    so.token = conf.token;
    so.tls_cert_pem = conf.tls_cert_pem;
    so.tls_key_pem = conf.tls_key_pem;
    auto server = rendezvous::RendezvousServer::start(so);
    if (server.isOk()) {
      out.server = std::move(server).value();
      log->info("hosting the rendezvous at {}{}", out.server->address(),
                conf.tls_cert_pem.empty() ? "" : " (TLS)");
    } else if (choice.hosting == Hosting::kMust) {
      return unavailable("cannot host the rendezvous at " + choice.endpoint + ": " +
                         server.status().message());
    } else {
      log->info("rendezvous at {} is hosted by another agent", choice.endpoint);
    }
  }
  GrpcServiceOptions o;
  o.run_id = choice.multinode.run_id;
  o.client.endpoint = choice.endpoint;
  o.client.rpc_timeout = conf.read_timeout;
  o.client.retry_timeout = conf.join_timeout;
  o.client.token = conf.token;
  o.client.tls_root_cert_pem = conf.tls_ca_pem;
  o.tls_ca_file = conf.tls_ca_file;
  out.service = std::make_unique<GrpcRendezvousService>(io, std::move(o));
  out.client =
      std::make_unique<MultiNodeRendezvous>(io, choice.multinode, *out.service, std::move(sink));
  return out;
}

}  // namespace ddprun::agent
