// ddprun-rendezvous: the standalone rendezvous daemon. Thin: flags, then RendezvousServer.
//   ddprun-rendezvous --listen HOST:PORT [--token-file F] [--tls-cert F --tls-key F]
#include <csignal>
#include <cstdio>
#include <iostream>
#include <string>

#include "ddprun/common/log.h"
#include "ddprun/rendezvous/server.h"

namespace {

constexpr const char* kUsage =
    "usage: ddprun-rendezvous --listen HOST:PORT [--token-file FILE] "
    "[--tls-cert FILE --tls-key FILE]";

int usageError(const std::string& msg) {
  std::cerr << "ddprun-rendezvous: " << msg << " (" << kUsage << ")" << std::endl;
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace ddprun;
  std::string listen, token_file, cert_file, key_file;
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
      std::cout << kUsage << std::endl;
      return 0;
    }
    std::string* target = nullptr;
    if (arg == "--listen") target = &listen;
    if (arg == "--token-file") target = &token_file;
    if (arg == "--tls-cert") target = &cert_file;
    if (arg == "--tls-key") target = &key_file;
    if (target == nullptr) return usageError("unknown argument '" + std::string(argv[i]) + "'");
    if (!has_inline) {
      if (i + 1 >= argc) return usageError(arg + " needs a value");
      value = argv[++i];
    }
    *target = value;
  }
  if (listen.empty()) return usageError("--listen HOST:PORT is required");
  if (cert_file.empty() != key_file.empty()) {
    return usageError("--tls-cert and --tls-key must be given together");
  }

  rendezvous::ServerOptions options;
  options.listen = listen;
  if (!token_file.empty()) {
    auto token = rendezvous::readTokenFile(token_file);
    if (!token.isOk()) return usageError("--token-file: " + token.status().message());
    options.token = token.value();
  }
  if (!cert_file.empty()) {
    auto cert = rendezvous::readFile(cert_file);
    if (!cert.isOk()) return usageError("--tls-cert: " + cert.status().message());
    auto key = rendezvous::readFile(key_file);
    if (!key.isOk()) return usageError("--tls-key: " + key.status().message());
    options.tls_cert_pem = cert.value();
    options.tls_key_pem = key.value();
  }

  // Block the stop signals before any thread starts, so only sigwait below receives them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  auto server = rendezvous::RendezvousServer::start(options);
  if (!server.isOk()) {
    std::cerr << "ddprun-rendezvous: --listen " << listen << ": " << server.status().message()
              << std::endl;
    return server.status().code() == StatusCode::kInvalidArgument ? 2 : 1;
  }
  std::cout << "listening on " << server.value()->address() << std::endl;

  int sig = 0;
  sigwait(&stop_signals, &sig);
  logger("rendezvous")->info("received signal {}, shutting down", sig);
  server.value()->shutdown();
  return 0;
}
