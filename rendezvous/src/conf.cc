#include "ddprun/rendezvous/conf.h"

#include "ddprun/common/strings.h"
#include "ddprun/rendezvous/server.h"

namespace ddprun::rendezvous {

namespace {

StatusOr<Duration> positiveSeconds(const std::string& key, const std::string& value,
                                   bool allow_zero) {
  auto v = parseDouble(value);
  if (!v || *v < 0 || (!allow_zero && *v == 0)) {
    return invalidArgument("--rdzv-conf " + key + "=" + value + ": expected " +
                           (allow_zero ? "seconds >= 0" : "seconds > 0"));
  }
  return seconds(*v);
}

}  // namespace

StatusOr<RendezvousConf> parseRendezvousConf(const std::map<std::string, std::string>& conf,
                                             uint32_t min_nodes, uint32_t max_nodes) {
  RendezvousConf out;
  out.run.min_nodes = min_nodes;
  out.run.max_nodes = max_nodes;
  for (const auto& [raw_key, value] : conf) {
    std::string key = raw_key;
    for (char& c : key) {
      if (c == '-') c = '_';
    }
    if (key == "join_timeout") {
      DDPRUN_ASSIGN_OR_RETURN(out.join_timeout, positiveSeconds(key, value, false));
    } else if (key == "last_call_timeout") {
      DDPRUN_ASSIGN_OR_RETURN(out.run.last_call_timeout, positiveSeconds(key, value, true));
    } else if (key == "close_timeout") {
      DDPRUN_ASSIGN_OR_RETURN(out.close_timeout, positiveSeconds(key, value, true));
    } else if (key == "heartbeat_interval") {
      DDPRUN_ASSIGN_OR_RETURN(out.run.heartbeat_interval, positiveSeconds(key, value, false));
    } else if (key == "read_timeout") {
      DDPRUN_ASSIGN_OR_RETURN(out.read_timeout, positiveSeconds(key, value, false));
    } else if (key == "heartbeat_misses") {
      auto v = parseInt(value);
      if (!v || *v < 1 || *v > 1000000) {
        return invalidArgument("--rdzv-conf heartbeat_misses=" + value +
                               ": expected an integer >= 1");
      }
      out.run.heartbeat_misses = static_cast<uint32_t>(*v);
    } else if (key == "is_host") {
      const std::string v = toLower(value);
      if (v == "auto") {
        out.is_host = IsHost::kAuto;
      } else if (auto b = parseBool(v)) {
        out.is_host = *b ? IsHost::kTrue : IsHost::kFalse;
      } else {
        return invalidArgument("--rdzv-conf is_host=" + value + ": expected auto, true or false");
      }
    } else if (key == "token_file") {
      auto token = readTokenFile(value);
      if (!token.isOk())
        return invalidArgument("--rdzv-conf token_file: " + token.status().message());
      out.token = token.value();
    } else if (key == "tls_cert" || key == "tls_key" || key == "tls_ca") {
      auto pem = readFile(value);
      if (!pem.isOk()) return invalidArgument("--rdzv-conf " + key + ": " + pem.status().message());
      (key == "tls_cert"  ? out.tls_cert_pem
       : key == "tls_key" ? out.tls_key_pem
                          : out.tls_ca_pem) = pem.value();
    } else {
      return invalidArgument("--rdzv-conf: unknown key '" + raw_key +
                             "' (known: join_timeout, last_call_timeout, close_timeout, "
                             "heartbeat_interval, heartbeat_misses, is_host, read_timeout, "
                             "token_file, tls_cert, tls_key, tls_ca)");
    }
  }
  if (out.tls_cert_pem.empty() != out.tls_key_pem.empty()) {
    return invalidArgument("--rdzv-conf: tls_cert and tls_key must be given together");
  }
  return out;
}

}  // namespace ddprun::rendezvous
