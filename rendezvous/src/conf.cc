#include "ddprun/rendezvous/conf.h"

#include <optional>

#include "ddprun/common/strings.h"
#include "ddprun/rendezvous/files.h"

namespace ddprun::rendezvous {

namespace {

constexpr long long kMaxHeartbeatMisses = 1000000;

StatusOr<Duration> parseSeconds(const std::string& key, const std::string& value, bool allow_zero) {
  auto v = parseDouble(value);
  if (!v || *v < 0 || (!allow_zero && *v == 0)) {
    return invalidArgument(key + " must be a number of seconds " + (allow_zero ? ">= 0" : "> 0") +
                           ", got '" + value + "'");
  }
  if (*v > kMaxDurationSeconds) {
    return invalidArgument(key + " must be at most 1e9 seconds, got '" + value + "'");
  }
  return seconds(*v);
}

}  // namespace

namespace {

// What the keys say about each other, checked once all of them are read.
struct Given {
  bool join_timeout = false;
  std::optional<Duration> timeout_alias;
  bool failure_grace = false;
  std::string tls_cert_file, tls_key_file;
};

// The etcd-v3 backend's keys; false when `key` is none of them.
StatusOr<bool> applyEtcdKey(const std::string& key, const std::string& value,
                            RendezvousConf::Etcd& etcd) {
  if (key == "protocol") {
    const std::string v = toLower(value);
    if (v != "http" && v != "https") {
      return invalidArgument("protocol must be http or https (etcd-v3), got '" + value + "'");
    }
    etcd.https = v == "https";
  } else if (key == "cacert") {
    DDPRUN_ASSIGN_OR_RETURN(etcd.ca_pem, readPem(key, value, false));
    etcd.ca_file = value;
  } else if (key == "cert") {
    DDPRUN_ASSIGN_OR_RETURN(etcd.cert_pem, readPem(key, value, false));
    etcd.cert_file = value;
  } else if (key == "key") {
    DDPRUN_ASSIGN_OR_RETURN(etcd.key_pem, readPem(key, value, true));
  } else if (key == "username") {
    if (value.empty()) return invalidArgument("username needs a name, got ''");
    etcd.username = value;
  } else if (key == "password_file") {
    if (value.empty()) return invalidArgument("password_file needs a path, got ''");
    auto password = readTokenFile(value);
    if (!password.isOk()) return invalidArgument("password_file: " + password.status().message());
    etcd.password = password.value();
  } else if (key == "key_prefix") {
    if (value.empty() || value[0] != '/') {
      return invalidArgument("key_prefix must be an etcd key starting with '/', got '" + value +
                             "'");
    }
    etcd.key_prefix = value;
  } else if (key == "kv_max_keys" || key == "kv_max_bytes") {
    auto v = parseInt(value);
    const long long most = key == "kv_max_keys" ? 10000000LL : (1LL << 40);
    if (!v || *v < 1 || *v > most) {
      return invalidArgument(key + " must be a whole number from 1 to " + std::to_string(most) +
                             " (etcd-v3: the run's key-value store each agent keeps), got '" +
                             value + "'");
    }
    (key == "kv_max_keys" ? etcd.max_kv_keys : etcd.max_kv_bytes) = static_cast<uint64_t>(*v);
  } else {
    return false;
  }
  return true;
}

// One key of --rdzv-conf (spelled with '_'); an unknown one is listed for a notice.
Status applyKey(const std::string& key, const std::string& raw_key, const std::string& value,
                RendezvousConf& out, Given& given) {
  if (key == "join_timeout") {
    DDPRUN_ASSIGN_OR_RETURN(out.join_timeout, parseSeconds(key, value, false));
    given.join_timeout = true;
  } else if (key == "timeout") {
    // torchrun's name for the join timeout; an explicit join_timeout wins whatever the order.
    DDPRUN_ASSIGN_OR_RETURN(Duration t, parseSeconds(key, value, false));
    given.timeout_alias = t;
  } else if (key == "last_call_timeout") {
    DDPRUN_ASSIGN_OR_RETURN(out.run.last_call_timeout, parseSeconds(key, value, true));
  } else if (key == "close_timeout") {
    DDPRUN_ASSIGN_OR_RETURN(out.close_timeout, parseSeconds(key, value, true));
  } else if (key == "heartbeat_interval") {
    DDPRUN_ASSIGN_OR_RETURN(out.run.heartbeat_interval, parseSeconds(key, value, false));
    // Below it an agent's heartbeats cannot keep up (its loop, the network): its own node is
    // declared dead over and over, and a one-node job never ends.
    if (out.run.heartbeat_interval < kMinHeartbeatInterval) {
      return invalidArgument("heartbeat_interval must be at least 0.1 s, got '" + value + "'");
    }
  } else if (key == "read_timeout") {
    DDPRUN_ASSIGN_OR_RETURN(out.read_timeout, parseSeconds(key, value, false));
  } else if (key == "inplace_timeout") {
    DDPRUN_ASSIGN_OR_RETURN(out.inplace_timeout, parseSeconds(key, value, false));
  } else if (key == "failure_grace") {
    DDPRUN_ASSIGN_OR_RETURN(out.failure_grace, parseSeconds(key, value, true));
    given.failure_grace = true;
  } else if (key == "heartbeat_misses") {
    auto v = parseInt(value);
    if (!v || *v < 1 || *v > kMaxHeartbeatMisses) {
      return invalidArgument("heartbeat_misses must be an integer from 1 to " +
                             std::to_string(kMaxHeartbeatMisses) + ", got '" + value + "'");
    }
    out.run.heartbeat_misses = static_cast<uint32_t>(*v);
  } else if (key == "is_host") {
    if (toLower(value) == "auto") {
      out.is_host = IsHost::kAuto;
    } else if (auto b = parseBool(value)) {
      out.is_host = *b ? IsHost::kTrue : IsHost::kFalse;
    } else {
      return invalidArgument("is_host must be auto, true or false, got '" + value + "'");
    }
  } else if (key == "token_file") {
    if (value.empty()) return invalidArgument("token_file needs a path, got ''");
    auto token = readTokenFile(value);
    if (!token.isOk()) return invalidArgument("token_file: " + token.status().message());
    out.token = token.value();
  } else if (key == "tls_cert") {
    DDPRUN_ASSIGN_OR_RETURN(out.tls_cert_pem, readPem(key, value, false));
    given.tls_cert_file = value;
  } else if (key == "tls_key") {
    DDPRUN_ASSIGN_OR_RETURN(out.tls_key_pem, readPem(key, value, true));
    given.tls_key_file = value;
  } else if (key == "tls_ca") {
    DDPRUN_ASSIGN_OR_RETURN(out.tls_ca_pem, readPem(key, value, false));
    out.tls_ca_file = value;
  } else {
    DDPRUN_ASSIGN_OR_RETURN(const bool etcd, applyEtcdKey(key, value, out.etcd));
    // torchrun hands keys it does not know to the backend; ours has none, so the caller warns.
    if (!etcd) out.unknown_keys.push_back(raw_key);
  }
  return Status::ok();
}

// The rules between keys, and the defaults that depend on others.
Status finish(RendezvousConf& out, const Given& given) {
  if (given.timeout_alias && !given.join_timeout) out.join_timeout = *given.timeout_alias;
  if (!given.tls_cert_file.empty() && given.tls_key_file.empty()) {
    return invalidArgument("tls_cert=" + given.tls_cert_file +
                           " needs tls_key= too (the certificate's private key)");
  }
  if (!given.tls_key_file.empty() && given.tls_cert_file.empty()) {
    return invalidArgument("tls_key=" + given.tls_key_file +
                           " needs tls_cert= too (the certificate it belongs to)");
  }
  if (!given.tls_cert_file.empty() && out.tls_ca_pem.empty()) {
    return invalidArgument(
        "tls_cert= and tls_key= (serve TLS) need tls_ca= too: the certificate every agent trusts, "
        "this one included (for a self-signed certificate, the same file as tls_cert)");
  }
  if (out.etcd.cert_pem.empty() != out.etcd.key_pem.empty()) {
    return invalidArgument("cert= and key= (the etcd client certificate) go together; give both");
  }
  if (!out.etcd.username.empty() && out.etcd.password.empty()) {
    return invalidArgument("username=" + out.etcd.username +
                           " needs password_file= (a file holding the etcd password)");
  }
  if ((!out.etcd.ca_pem.empty() || !out.etcd.cert_pem.empty()) && !out.etcd.https) {
    out.etcd.https = true;  // TLS files given: speak TLS (torchrun's etcd backend does the same)
  }
  if (!given.failure_grace) out.failure_grace = 2 * out.run.heartbeat_interval;
  return Status::ok();
}

}  // namespace

StatusOr<RendezvousConf> parseRendezvousConf(const std::map<std::string, std::string>& conf,
                                             uint32_t min_nodes, uint32_t max_nodes) {
  RendezvousConf out;
  out.run.min_nodes = min_nodes;
  out.run.max_nodes = max_nodes;
  out.run.heartbeat_interval = kDefaultHeartbeatInterval;
  out.run.heartbeat_misses = kDefaultHeartbeatMisses;
  Given given;
  std::map<std::string, std::string> spelled;  // key -> how it was given
  for (const auto& [raw_key, value] : conf) {
    std::string key = raw_key;
    for (char& c : key) {
      if (c == '-') c = '_';
    }
    if (auto [it, fresh] = spelled.emplace(key, raw_key); !fresh) {
      // Which one was meant is anybody's guess (e.g. a user's is-host and a tool's is_host).
      return invalidArgument(key + " is given twice, as '" + it->second + "' and '" + raw_key +
                             "'; give it once");
    }
    DDPRUN_RETURN_IF_ERROR(applyKey(key, raw_key, value, out, given));
  }
  DDPRUN_RETURN_IF_ERROR(finish(out, given));
  return out;
}

}  // namespace ddprun::rendezvous
