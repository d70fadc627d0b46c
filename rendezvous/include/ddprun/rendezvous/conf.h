// RendezvousConf: the --rdzv-conf keys (SPEC §2) turned into the settings of the rendezvous
// client, server and run, with ddprun's defaults. The one parser of --rdzv-conf: the launcher
// validates with it and the agent configures itself from it, so both agree on every key, spelling
// and default. Pure functions; no I/O except reading the token and TLS files named.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "ddprun/common/status.h"
#include "ddprun/rendezvous/types.h"

namespace ddprun::rendezvous {

enum class IsHost { kAuto, kTrue, kFalse };

// ddprun's liveness defaults: a dead node is noticed within 1.5 s (a product promise), unlike
// RunConfig's library default of 5 s beats.
inline constexpr Duration kDefaultHeartbeatInterval = std::chrono::milliseconds(500);
// The least heartbeat_interval --rdzv-conf takes.
inline constexpr Duration kMinHeartbeatInterval = std::chrono::milliseconds(100);
inline constexpr uint32_t kDefaultHeartbeatMisses = 3;

struct RendezvousConf {
  // last_call_timeout (30 s), heartbeat_interval (kDefaultHeartbeatInterval), heartbeat_misses
  // (kDefaultHeartbeatMisses), min/max nodes as passed.
  RunConfig run;
  Duration join_timeout = std::chrono::seconds(600);  // join_timeout= or torchrun's timeout=
  Duration close_timeout = std::chrono::seconds(30);
  Duration read_timeout = std::chrono::seconds(60);  // client: per-call deadline
  // How long a local worker crash is held before it is reported, so that a crash caused by a
  // peer's death counts as the membership change it is. Default: two heartbeat intervals.
  Duration failure_grace = 2 * kDefaultHeartbeatInterval;
  // --restart-mode=in-place: the bound on each phase of one recovery (inplace_timeout=, > 0).
  Duration inplace_timeout = std::chrono::seconds(60);
  IsHost is_host = IsHost::kAuto;
  std::string token;         // from token_file=
  std::string tls_cert_pem;  // tls_cert= (served when this agent hosts the rendezvous)
  std::string tls_key_pem;   // tls_key=
  std::string tls_ca_pem;    // tls_ca= (client: speak TLS, trusting this certificate)
  std::string tls_ca_file;   // the path given as tls_ca=, for messages
  // The etcd-v3 backend: protocol=http|https, cacert=, cert=, key= (client TLS), username=,
  // password_file= (etcd auth), key_prefix= (default /ddprun/rdzv/<run_id>). Other backends
  // ignore them.
  struct Etcd {
    bool https = false;
    std::string ca_pem, ca_file;
    std::string cert_pem, cert_file;
    std::string key_pem;
    std::string username;
    std::string password;
    std::string key_prefix;
    // Bounds of the run's key-value store as each agent mirrors it (kv_max_keys=,
    // kv_max_bytes=): the gRPC server's per-run quotas.
    uint64_t max_kv_keys = 65536;
    uint64_t max_kv_bytes = uint64_t{16} << 20;
  } etcd;
  // Keys of none of kRendezvousConfKeys, as given. torchrun hands such keys to its backend
  // (e.g. store_type=tcp for c10d) and runs; so do we, and the launcher names them in one notice.
  std::vector<std::string> unknown_keys;
};

// Keys accepted, in the order error messages list them. Keys may be spelled with '-' for '_'
// (one spelling per key: both at once is an error).
inline constexpr const char* kRendezvousConfKeys[] = {"join_timeout",
                                                      "last_call_timeout",
                                                      "close_timeout",
                                                      "heartbeat_interval",
                                                      "heartbeat_misses",
                                                      "is_host",
                                                      "read_timeout",
                                                      "token_file",
                                                      "timeout",
                                                      "failure_grace",
                                                      "tls_cert",
                                                      "tls_key",
                                                      "tls_ca",
                                                      "protocol",
                                                      "cacert",
                                                      "cert",
                                                      "key",
                                                      "username",
                                                      "password_file",
                                                      "key_prefix",
                                                      "kv_max_keys",
                                                      "kv_max_bytes",
                                                      "inplace_timeout"};

// Parses `conf` (the k=v pairs of --rdzv-conf) for a run of min_nodes..max_nodes:
//   join_timeout, timeout (torchrun's alias; join_timeout wins), read_timeout, heartbeat_interval:
//     seconds > 0;  last_call_timeout, close_timeout, failure_grace: seconds >= 0 (at most 1e9);
//   inplace_timeout: seconds > 0;  heartbeat_misses: integer 1..1000000;  is_host: auto, true or
//   false (also 1/0, yes/no, on/off); token_file: a file holding the shared token;  tls_ca: a PEM
//   certificate that clients trust (TLS on);  kv_max_keys, kv_max_bytes: whole numbers >= 1
//   (etcd-v3, the mirrored key-value store);  tls_cert + tls_key: the PEM certificate and key
//   served when hosting (need tls_ca, which this agent's own client uses; for a self-signed
//   certificate, the same file).
// Unknown keys are accepted and listed in `unknown_keys` (torchrun passes them to its backend).
// Malformed values are INVALID_ARGUMENT with one line naming the key and the accepted form, e.g.
// "join_timeout must be a number of seconds > 0, got '-3'". The message does not say where the
// pairs came from: callers prefix that ("argument --rdzv-conf: ").
StatusOr<RendezvousConf> parseRendezvousConf(const std::map<std::string, std::string>& conf,
                                             uint32_t min_nodes, uint32_t max_nodes);

}  // namespace ddprun::rendezvous
