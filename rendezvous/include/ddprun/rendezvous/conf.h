// RendezvousConf: the --rdzv-conf keys (SPEC §2) turned into the settings of the rendezvous
// client, server and run. Pure functions; no I/O except reading the token and TLS files named.
#pragma once

#include <map>
#include <string>

#include "ddprun/common/status.h"
#include "ddprun/rendezvous/types.h"

namespace ddprun::rendezvous {

enum class IsHost { kAuto, kTrue, kFalse };

struct RendezvousConf {
  RunConfig run;  // last_call_timeout, heartbeat_*
  Duration join_timeout = std::chrono::seconds(600);
  Duration close_timeout = std::chrono::seconds(30);
  Duration read_timeout = std::chrono::seconds(60);  // client: per-call deadline and retry budget
  IsHost is_host = IsHost::kAuto;
  std::string token;         // from token_file=
  std::string tls_cert_pem;  // tls_cert= (server, when hosting)
  std::string tls_key_pem;   // tls_key=
  std::string tls_ca_pem;    // tls_ca= (client: the certificate to trust)
};

// Parses `conf` (keys as in --rdzv-conf: join_timeout, last_call_timeout, close_timeout,
// heartbeat_interval, heartbeat_misses, is_host, read_timeout, token_file, tls_cert, tls_key,
// tls_ca) for a run of min_nodes..max_nodes. Unknown keys and malformed values are
// INVALID_ARGUMENT naming the key and the accepted form.
StatusOr<RendezvousConf> parseRendezvousConf(const std::map<std::string, std::string>& conf,
                                             uint32_t min_nodes, uint32_t max_nodes);

}  // namespace ddprun::rendezvous
