#include "ddprun/agent/choose_rendezvous.h"

#include "ddprun/common/strings.h"

namespace ddprun::agent {

StatusOr<RendezvousChoice> chooseRendezvous(const AgentConfig& cfg, const std::string& local_addr,
                                            const IsThisHost& is_this_host) {
  const rendezvous::RendezvousConf& conf = cfg.rdzv_conf;
  RendezvousChoice out;
  const bool static_backend = cfg.rdzv_backend == RendezvousBackend::kStatic;
  if (cfg.standalone || (static_backend && cfg.max_nodes == 1)) {
    out.kind = RendezvousKind::kLocal;
    out.local_round.run_id = cfg.rdzv_id;
    out.local_round.local_world_sizes = {cfg.nproc_per_node};
    out.local_round.master_addr = cfg.standalone ? local_addr : cfg.master_addr;
    out.local_round.master_port = cfg.standalone ? 0 : cfg.master_port;
    out.pick_free_port = cfg.standalone;
    return out;
  }

  out.kind = cfg.rdzv_backend == RendezvousBackend::kEtcdV3 ? RendezvousKind::kEtcd
                                                            : RendezvousKind::kGrpc;
  MultiNodeOptions& o = out.multinode;
  out.endpoint = cfg.rdzv_endpoint;
  if (out.kind == RendezvousKind::kEtcd) {
    o.master_port = cfg.master_port_given ? cfg.master_port : 0;
    out.hosting = Hosting::kNo;
  } else if (static_backend) {
    // The agents' own rendezvous sits next to the workers' store: MASTER_PORT+1 on the master.
    if (out.endpoint.empty()) {
      if (cfg.master_port >= 65535) {
        return invalidArgument(
            "--master-port: the static backend needs MASTER_PORT+1 free for the agents' "
            "rendezvous; pick a port below 65535 or give --rdzv-endpoint");
      }
      out.endpoint = hostPort(cfg.master_addr, cfg.master_port + 1);  // IPv6: given bare
      out.endpoint_note = "the static backend's agents meet on MASTER_PORT+1 = " + out.endpoint +
                          ", which must be free on node 0 and reachable from every node; pick "
                          "another --master-port, or place it with --rdzv-endpoint=HOST:PORT";
    }
    o.static_node_rank = cfg.node_rank;
    o.static_master_addr = cfg.master_addr;
    o.master_port = cfg.master_port;
    out.hosting = cfg.node_rank == 0 ? Hosting::kMust : Hosting::kNo;
  } else {
    o.master_port = cfg.master_port_given ? cfg.master_port : 0;
    if (conf.is_host == rendezvous::IsHost::kAuto) {
      const std::string host = out.endpoint.substr(0, out.endpoint.rfind(':'));
      out.hosting = is_this_host(host) ? Hosting::kMay : Hosting::kNo;
    } else {
      out.hosting = conf.is_host == rendezvous::IsHost::kTrue ? Hosting::kMust : Hosting::kNo;
    }
  }
  if (out.hosting != Hosting::kNo && !conf.tls_ca_pem.empty() && conf.tls_cert_pem.empty()) {
    // The agents connect with TLS (tls_ca=), and this one has no certificate to serve it with:
    // what it hosted would speak plaintext and nobody, itself included, could join.
    if (out.hosting == Hosting::kMust) {
      return invalidArgument(
          "--rdzv-conf tls_ca= makes the agents connect with TLS, and this node hosts the "
          "rendezvous (" +
          std::string(static_backend ? "node rank 0 of the static backend" : "is_host=true") +
          ") without a certificate to serve it: give tls_cert= and tls_key= too");
    }
    out.hosting = Hosting::kNo;  // the endpoint on this host is a TLS daemon's (or another's)
  }
  o.run_id = cfg.rdzv_id;
  o.local_addr = local_addr;
  o.local_world_size = cfg.nproc_per_node;
  o.run_config = conf.run;  // min/max nodes, last call, heartbeats
  o.join_timeout = conf.join_timeout;
  // Longer than the time the rendezvous takes to notice a dead peer (one heartbeat interval
  // after its watch stream broke), so a crash caused by that peer is not charged.
  out.failure_grace = conf.failure_grace;
  return out;
}

}  // namespace ddprun::agent
