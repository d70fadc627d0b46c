// ddprun-rendezvous: the standalone rendezvous daemon. Thin: flags, then RendezvousServer.
//   ddprun-rendezvous --listen HOST:PORT [--token-file F] [--tls-cert F --tls-key F]
//                     [--closed-run-ttl SECONDS] [--idle-run-ttl SECONDS] [quota flags]
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <set>
#include <string>
#include <tuple>

#include "ddprun/common/log.h"
#include "ddprun/common/open_files.h"
#include "ddprun/common/strings.h"
#include "ddprun/rendezvous/accept_guard.h"
#include "ddprun/rendezvous/protobuf_log.h"
#include "ddprun/rendezvous/server.h"

namespace {

constexpr const char* kUsage =
    "usage: ddprun-rendezvous --listen HOST:PORT [--token-file FILE] "
    "[--tls-cert FILE --tls-key FILE] [--closed-run-ttl SECONDS] [--idle-run-ttl SECONDS] "
    "[--max-run-keys N] [--max-run-kv-bytes N] [--max-kv-bytes N] [--max-run-spares N] "
    "[--max-runs N] "
    "[--max-streams-per-peer N] [--max-streams-per-host N] [--max-connections-per-peer N]";

constexpr const char* kHelp =
    "  --listen HOST:PORT         address to serve on; port 0 picks one (printed)\n"
    "  --token-file FILE          require this shared token on every call\n"
    "  --tls-cert FILE --tls-key FILE\n"
    "                             serve TLS with this certificate and key (PEM)\n"
    "  --closed-run-ttl SECONDS   how long a closed run's tombstone refuses joins (default 3600)\n"
    "  --idle-run-ttl SECONDS     drop a run with no live node, watch stream or key write for\n"
    "                             this long, with its key-value store (default 600)\n"
    "  --max-run-keys N           keys one run id may hold (default 65536)\n"
    "  --max-run-kv-bytes N       bytes (keys + values) one run id may hold (default 16777216)\n"
    "  --max-kv-bytes N           bytes (keys + values) all run ids together may hold\n"
    "                             (default 268435456)\n"
    "  --max-run-spares N         nodes of one run that may wait beyond nnodes MAX (default 1024)\n"
    "  --max-runs N               runs held at once (default 65536)\n"
    "  --max-streams-per-peer N   open Watch streams plus pending Join/KvWait/GetMaster calls of\n"
    "                             one client connection (default 1024)\n"
    "  --max-streams-per-host N   the same for all connections of one client host\n"
    "                             (default 8192)\n"
    "  --max-connections-per-peer N\n"
    "                             open connections of one client host (default 1024; a larger\n"
    "                             one where many nodes reach the daemon through one NAT address)\n"
    "  A write past a quota, a spare past its bound, or a stream past the bound, gets\n"
    "  RESOURCE_EXHAUSTED naming it; a connection past its bound is closed at once (logged).";

// Longest TTL accepted: a year keeps every deadline far from the clock's range.
constexpr double kMaxTtlSeconds = 365.0 * 24 * 3600;

int usageError(const std::string& msg) {
  // The message may quote an argument: one line, whatever it holds.
  std::cerr << "ddprun-rendezvous: " << ddprun::escapeControl(msg) << " (" << kUsage << ")"
            << std::endl;
  return 2;
}

// A positive number of seconds (fractions allowed), at most a year.
std::optional<ddprun::Duration> parseTtl(const std::string& text) {
  if (text.empty()) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  if (*end != '\0' || errno != 0 || !std::isfinite(v) || v <= 0 || v > kMaxTtlSeconds) {
    return std::nullopt;
  }
  return std::chrono::duration_cast<ddprun::Duration>(std::chrono::duration<double>(v));
}

// A count or size for a quota flag: a whole number in 1..2^40.
std::optional<size_t> parseQuota(const std::string& text) {
  if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos ||
      text.size() > 13) {
    return std::nullopt;
  }
  const unsigned long long v = std::strtoull(text.c_str(), nullptr, 10);
  if (v == 0 || v > (1ull << 40)) return std::nullopt;
  return static_cast<size_t>(v);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace ddprun;
  rendezvous::routeProtobufLogs();
  std::string listen, token_file, cert_file, key_file, closed_ttl, idle_ttl;
  std::string run_keys, run_kv_bytes, kv_bytes, run_spares, streams_per_peer, streams_per_host,
      connections_per_peer, max_runs;
  std::set<std::string> given;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string value;
    bool has_inline = false;
    if (auto eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_inline = true;
    }
    for (char& c : arg) {
      if (c == '_') c = '-';
    }
    if (arg == "-h" || arg == "--help") {
      std::cout << kUsage << "\n" << kHelp << std::endl;
      return 0;
    }
    std::string* target = nullptr;
    if (arg == "--listen") target = &listen;
    if (arg == "--token-file") target = &token_file;
    if (arg == "--tls-cert") target = &cert_file;
    if (arg == "--tls-key") target = &key_file;
    if (arg == "--closed-run-ttl") target = &closed_ttl;
    if (arg == "--idle-run-ttl") target = &idle_ttl;
    if (arg == "--max-run-keys") target = &run_keys;
    if (arg == "--max-run-kv-bytes") target = &run_kv_bytes;
    if (arg == "--max-kv-bytes") target = &kv_bytes;
    if (arg == "--max-run-spares") target = &run_spares;
    if (arg == "--max-streams-per-peer") target = &streams_per_peer;
    if (arg == "--max-streams-per-host") target = &streams_per_host;
    if (arg == "--max-runs") target = &max_runs;
    if (arg == "--max-connections-per-peer") target = &connections_per_peer;
    if (target == nullptr) return usageError("unknown argument '" + std::string(argv[i]) + "'");
    if (!has_inline) {
      if (i + 1 >= argc) return usageError(arg + " needs a value");
      value = argv[++i];
    }
    *target = value;
    given.insert(arg);
  }
  if (listen.empty()) return usageError("--listen HOST:PORT is required");
  if (cert_file.empty() != key_file.empty()) {
    return usageError("--tls-cert and --tls-key must be given together");
  }

  rendezvous::ServerOptions options;
  options.listen = listen;
  rendezvous::AcceptLimits accept_limits;
  accept_limits.how_to_raise = "ddprun-rendezvous --max-connections-per-peer";
  for (auto [flag, text, ttl] :
       {std::tuple{"--closed-run-ttl", &closed_ttl, &options.retention.closed_run_ttl},
        std::tuple{"--idle-run-ttl", &idle_ttl, &options.retention.idle_run_ttl}}) {
    if (given.count(flag) == 0) continue;
    auto parsed = parseTtl(*text);
    if (!parsed) {
      return usageError(std::string(flag) + ": '" + *text +
                        "' is not a number of seconds above 0 and at most one year");
    }
    *ttl = *parsed;
  }
  for (auto [flag, text, quota] :
       {std::tuple{"--max-run-keys", &run_keys, &options.limits.max_run_keys},
        std::tuple{"--max-run-kv-bytes", &run_kv_bytes, &options.limits.max_run_kv_bytes},
        std::tuple{"--max-kv-bytes", &kv_bytes, &options.limits.max_kv_bytes},
        std::tuple{"--max-run-spares", &run_spares, &options.limits.max_run_spares},
        std::tuple{"--max-runs", &max_runs, &options.limits.max_runs},
        std::tuple{"--max-streams-per-peer", &streams_per_peer, &options.max_streams_per_peer},
        std::tuple{"--max-streams-per-host", &streams_per_host, &options.max_streams_per_host},
        std::tuple{"--max-connections-per-peer", &connections_per_peer,
                   &accept_limits.max_connections_per_peer}}) {
    if (given.count(flag) == 0) continue;
    auto parsed = parseQuota(*text);
    if (!parsed) {
      return usageError(std::string(flag) + ": '" + *text +
                        "' is not a whole number in 1..1099511627776");
    }
    *quota = *parsed;
  }
  if (!token_file.empty()) {
    auto token = rendezvous::readTokenFile(token_file);
    if (!token.isOk()) return usageError("--token-file: " + token.status().message());
    options.token = token.value();
  }
  if (!cert_file.empty()) {
    auto cert = rendezvous::readPem("--tls-cert", cert_file, /*private_key=*/false);
    if (!cert.isOk()) return usageError(cert.status().message());
    auto key = rendezvous::readPem("--tls-key", key_file, /*private_key=*/true);
    if (!key.isOk()) return usageError(key.status().message());
    options.tls_cert_pem = cert.value();
    options.tls_key_pem = key.value();
  }

  rendezvous::setAcceptLimits(accept_limits);
  if (!rendezvous::acceptGuardInstalled()) {
    logger("rendezvous")
        ->warn(
            "this build's accept guard is not in use: running out of file "
            "descriptors stops the server from listening (gRPC 1.51)");
  }
  // Every client connection holds a descriptor: the soft limit goes up to the hard one (a peer
  // past it is still refused, and the server keeps listening: accept_guard.h).
  logger("rendezvous")->debug("up to {} open files", raiseOpenFileLimit());

  // Block the stop signals before any thread starts, so only sigwait below receives them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  auto server = rendezvous::RendezvousServer::start(options);
  if (!server.isOk()) {
    std::cerr << "ddprun-rendezvous: " << escapeControl(server.status().message()) << std::endl;
    return server.status().code() == StatusCode::kInvalidArgument ? 2 : 1;
  }
  std::cout << "listening on " << server.value()->address() << std::endl;

  int sig = 0;
  sigwait(&stop_signals, &sig);
  logger("rendezvous")->info("received signal {}, shutting down", sig);
  server.value()->shutdown();
  return 0;
}
