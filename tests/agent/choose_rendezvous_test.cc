#include "ddprun/agent/choose_rendezvous.h"

#include <catch2/catch.hpp>

using namespace ddprun;
using namespace ddprun::agent;

namespace {

rendezvous::RendezvousConf conf() {
  auto c = rendezvous::parseRendezvousConf({}, 2, 2);
  REQUIRE(c.isOk());
  return *c;
}

AgentConfig multiNode(RendezvousBackend backend, const std::string& endpoint) {
  AgentConfig cfg;
  cfg.min_nodes = 2;
  cfg.max_nodes = 2;
  cfg.nproc_per_node = 3;
  cfg.rdzv_backend = backend;
  cfg.rdzv_endpoint = endpoint;
  cfg.rdzv_id = "job7";
  cfg.rdzv_conf = conf();
  return cfg;
}

bool never(const std::string&) { return false; }

}  // namespace

TEST_CASE("standalone and one-node static jobs use the in-process rendezvous", "[agent]") {
  AgentConfig cfg;
  cfg.standalone = true;
  cfg.nproc_per_node = 4;
  cfg.rdzv_id = "r1";
  auto c = chooseRendezvous(cfg, "me.host", never);
  REQUIRE(c.isOk());
  CHECK(c->kind == RendezvousKind::kLocal);
  CHECK(c->pick_free_port);
  CHECK(c->local_round.master_addr == "me.host");
  CHECK(c->local_round.local_world_sizes == std::vector<int>{4});
  CHECK(c->local_round.run_id == "r1");
  CHECK(c->failure_grace == Duration::zero());

  AgentConfig one;  // static, --nnodes=1
  one.master_addr = "10.0.0.1";
  one.master_port = 29501;
  c = chooseRendezvous(one, "me.host", never);
  REQUIRE(c.isOk());
  CHECK(c->kind == RendezvousKind::kLocal);
  CHECK_FALSE(c->pick_free_port);
  CHECK(c->local_round.master_addr == "10.0.0.1");
  CHECK(c->local_round.master_port == 29501);
}

TEST_CASE("a c10d job hosts the rendezvous when the endpoint is this host", "[agent]") {
  std::string asked;
  auto c = chooseRendezvous(multiNode(RendezvousBackend::kC10d, "node1:29400"), "node1",
                            [&](const std::string& host) {
                              asked = host;
                              return true;
                            });
  REQUIRE(c.isOk());
  CHECK(asked == "node1");
  CHECK(c->kind == RendezvousKind::kGrpc);
  CHECK(c->endpoint == "node1:29400");
  CHECK(c->hosting == Hosting::kMay);
  CHECK(c->multinode.run_id == "job7");
  CHECK(c->multinode.local_addr == "node1");
  CHECK(c->multinode.local_world_size == 3);
  CHECK(c->multinode.master_port == 0);  // a free port when this node is rank 0
  CHECK(c->multinode.static_node_rank == -1);
  CHECK(c->multinode.run_config.min_nodes == 2);
  CHECK(c->failure_grace == conf().failure_grace);

  c = chooseRendezvous(multiNode(RendezvousBackend::kC10d, "[::1]:29400"), "x", never);
  REQUIRE(c.isOk());
  CHECK(c->hosting == Hosting::kNo);
}

TEST_CASE("is_host overrides the host check either way", "[agent]") {
  auto yes = multiNode(RendezvousBackend::kC10d, "elsewhere:1");
  yes.rdzv_conf.is_host = rendezvous::IsHost::kTrue;
  auto c = chooseRendezvous(yes, "me", never);
  REQUIRE(c.isOk());
  CHECK(c->hosting == Hosting::kMust);
  auto no = multiNode(RendezvousBackend::kC10d, "me:1");
  no.rdzv_conf.is_host = rendezvous::IsHost::kFalse;
  c = chooseRendezvous(no, "me", [](const std::string&) { return true; });
  REQUIRE(c.isOk());
  CHECK(c->hosting == Hosting::kNo);
}

TEST_CASE("a --master-port given to a c10d job is the workers' master port", "[agent]") {
  auto cfg = multiNode(RendezvousBackend::kC10d, "h:1");
  cfg.master_port = 40000;
  cfg.master_port_given = true;
  auto c = chooseRendezvous(cfg, "me", never);
  REQUIRE(c.isOk());
  CHECK(c->multinode.master_port == 40000);
}

TEST_CASE("the static backend puts the agents' rendezvous on MASTER_PORT+1 of node rank 0",
          "[agent]") {
  auto cfg = multiNode(RendezvousBackend::kStatic, "");
  cfg.master_addr = "m";
  cfg.master_port = 29500;
  cfg.node_rank = 0;
  auto c = chooseRendezvous(cfg, "me", never);
  REQUIRE(c.isOk());
  CHECK(c->endpoint == "m:29501");
  CHECK(c->hosting == Hosting::kMust);
  CHECK(c->multinode.static_node_rank == 0);
  CHECK(c->multinode.static_master_addr == "m");
  CHECK(c->multinode.master_port == 29500);
  // Every message about the endpoint says where the second port comes from and how to move it.
  CHECK(c->endpoint_note ==
        "the static backend's agents meet on MASTER_PORT+1 = m:29501, which must be free on node "
        "0 and reachable from every node; pick another --master-port, or place it with "
        "--rdzv-endpoint=HOST:PORT");

  cfg.node_rank = 1;
  c = chooseRendezvous(cfg, "me", never);
  REQUIRE(c.isOk());
  CHECK(c->hosting == Hosting::kNo);

  cfg.rdzv_endpoint = "other:7";  // an explicit endpoint wins
  c = chooseRendezvous(cfg, "me", never);
  REQUIRE(c.isOk());
  CHECK(c->endpoint == "other:7");
  CHECK(c->endpoint_note.empty());
}

TEST_CASE("the static backend refuses a master port with no room above it", "[agent]") {
  auto cfg = multiNode(RendezvousBackend::kStatic, "");
  cfg.master_port = 65535;
  auto c = chooseRendezvous(cfg, "me", never);
  REQUIRE_FALSE(c.isOk());
  CHECK(c.status().code() == StatusCode::kInvalidArgument);
  CHECK(c.status().message().find("--master-port") != std::string::npos);
}

TEST_CASE("agents that connect with TLS never host a plaintext rendezvous", "[agent]") {
  // tls_ca= without tls_cert=: this node cannot serve TLS, and what it served in plaintext
  // nobody could join (it waited out join_timeout, then failed on its own handshake).
  auto must = multiNode(RendezvousBackend::kC10d, "me:1");
  must.rdzv_conf.tls_ca_pem = "-----BEGIN CERTIFICATE-----";
  must.rdzv_conf.is_host = rendezvous::IsHost::kTrue;
  auto c = chooseRendezvous(must, "me", never);
  REQUIRE_FALSE(c.isOk());
  CHECK(c.status().code() == StatusCode::kInvalidArgument);
  CHECK(c.status().message() ==
        "--rdzv-conf tls_ca= makes the agents connect with TLS, and this node hosts the "
        "rendezvous (is_host=true) without a certificate to serve it: give tls_cert= and tls_key= "
        "too");
  // The endpoint is this host's: a TLS daemon here serves it; this agent only joins.
  auto may = multiNode(RendezvousBackend::kC10d, "me:1");
  may.rdzv_conf.tls_ca_pem = "-----BEGIN CERTIFICATE-----";
  c = chooseRendezvous(may, "me", [](const std::string&) { return true; });
  REQUIRE(c.isOk());
  CHECK(c->hosting == Hosting::kNo);
  // With a certificate it hosts as before.
  may.rdzv_conf.tls_cert_pem = "-----BEGIN CERTIFICATE-----";
  may.rdzv_conf.tls_key_pem = "-----BEGIN PRIVATE KEY-----";
  c = chooseRendezvous(may, "me", [](const std::string&) { return true; });
  REQUIRE(c.isOk());
  CHECK(c->hosting == Hosting::kMay);
  // The static backend's node 0 must host.
  auto fixed = multiNode(RendezvousBackend::kStatic, "");
  fixed.master_addr = "m";
  fixed.master_port = 29500;
  fixed.rdzv_conf.tls_ca_pem = "-----BEGIN CERTIFICATE-----";
  c = chooseRendezvous(fixed, "me", never);
  REQUIRE_FALSE(c.isOk());
  CHECK(c.status().message().find("(node rank 0 of the static backend)") != std::string::npos);
}

TEST_CASE("an IPv6 master address is bracketed in the static backend's endpoint", "[agent]") {
  auto cfg = multiNode(RendezvousBackend::kStatic, "");
  cfg.master_addr = "::1";
  cfg.master_port = 29500;
  auto c = chooseRendezvous(cfg, "me", never);
  REQUIRE(c.isOk());
  CHECK(c->endpoint == "[::1]:29501");
}
