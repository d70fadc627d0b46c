#include "rendezvous_factory.h"

#include "ddprun/common/log.h"
#include "ddprun/etcd/rendezvous_service.h"
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
  if (choice.kind == RendezvousKind::kEtcd) {
    log->info(
        "waiting up to {:.0f} s (join_timeout) for {} node(s) to join the rendezvous in etcd "
        "at {}",
        std::chrono::duration<double>(conf.join_timeout).count(),
        choice.multinode.run_config.min_nodes, choice.endpoint);
    etcd::EtcdServiceOptions o;
    o.run_id = choice.multinode.run_id;
    o.endpoints = choice.endpoint;
    o.key_prefix = conf.etcd.key_prefix;
    o.max_kv_keys = conf.etcd.max_kv_keys;
    o.max_kv_bytes = conf.etcd.max_kv_bytes;
    o.tls = conf.etcd.https;
    o.ca_pem = conf.etcd.ca_pem;
    o.ca_file = conf.etcd.ca_file;
    o.cert_pem = conf.etcd.cert_pem;
    o.cert_file = conf.etcd.cert_file;
    o.key_pem = conf.etcd.key_pem;
    o.username = conf.etcd.username;
    o.password = conf.etcd.password;
    o.run_config = choice.multinode.run_config;
    o.rpc_timeout = std::min<Duration>(conf.read_timeout, std::chrono::seconds(5));
    o.connect_for = conf.join_timeout;
    out.service = std::make_unique<etcd::EtcdRendezvousService>(io, std::move(o));
    out.client =
        std::make_unique<MultiNodeRendezvous>(io, choice.multinode, *out.service, std::move(sink));
    return out;
  }
  const std::string note = choice.endpoint_note.empty() ? "" : " (" + choice.endpoint_note + ")";
  std::string hosting_note;
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
                         server.status().message() + note);
    } else {
      // Usually another agent on this host hosts it; if nothing does, the wait below ends in an
      // error that says why this agent did not host it (the port may be another program's).
      log->info("rendezvous at {} not hosted here ({}): joining the agent that hosts it",
                choice.endpoint, server.status().message());
      hosting_note = "this agent could not host it: " + server.status().message() +
                     "; unless another agent or a ddprun-rendezvous serves it, some other "
                     "program holds that port";
    }
  }
  // Say what this node waits for, and where, before the wait (it may be long).
  const int min_nodes = static_cast<int>(choice.multinode.run_config.min_nodes);
  log->info("waiting up to {:.0f} s (join_timeout) for {} node(s) to join the rendezvous at {}{}",
            std::chrono::duration<double>(conf.join_timeout).count(), min_nodes, choice.endpoint,
            note);
  GrpcServiceOptions o;
  o.run_id = choice.multinode.run_id;
  o.client.endpoint = choice.endpoint;
  o.client.rpc_timeout = conf.read_timeout;
  o.client.retry_timeout = conf.join_timeout;
  o.client.token = conf.token;
  o.client.tls_root_cert_pem = conf.tls_ca_pem;
  o.tls_ca_file = conf.tls_ca_file;
  o.unreachable_note = choice.endpoint_note;
  o.hosting_note = hosting_note;
  out.service = std::make_unique<GrpcRendezvousService>(io, std::move(o));
  out.client =
      std::make_unique<MultiNodeRendezvous>(io, choice.multinode, *out.service, std::move(sink));
  return out;
}

}  // namespace ddprun::agent
