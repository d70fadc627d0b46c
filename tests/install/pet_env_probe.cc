// Runs a command line and the environment through ddprun's own parser
// (launcher::parseCommandLine) without launching anything: prints "OK" and the resulting
// configuration, or "ERROR <message>" and exits 2. tests/install checks the Kubernetes manifests'
// commands and PET_* environment with it.
//   pet_env_probe [ddprun args ...]      (environment: this process's)
#include <unistd.h>

#include <chrono>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "ddprun/launcher/cli.h"

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  std::map<std::string, std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    const auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  const ddprun::launcher::HostFacts host{/*cpu_count=*/4, /*gpu_count=*/0};
  auto result = ddprun::launcher::parseCommandLine(args, env, host);
  if (!result.isOk()) {
    std::cout << "ERROR " << result.status().message() << std::endl;
    return 2;
  }
  const auto& c = result.value().config;
  const auto secs = [](auto d) { return std::chrono::duration<double>(d).count(); };
  std::cout << "OK nnodes=" << c.min_nodes << ":" << c.max_nodes
            << " nproc_per_node=" << c.nproc_per_node << " rdzv_backend="
            << (c.rdzv_backend == ddprun::agent::RendezvousBackend::kC10d ? "c10d" : "static")
            << " rdzv_endpoint=" << c.rdzv_endpoint << " rdzv_id=" << c.rdzv_id
            << " max_restarts=" << c.max_restarts << " shutdown_timeout=" << c.shutdown_timeout
            << " local_addr=" << c.local_addr << " snapshot_dir=" << c.snapshot_dir
            << " program=" << c.entrypoint << std::endl;
  std::cout << "rdzv_conf join_timeout=" << secs(c.rdzv_conf.join_timeout)
            << " last_call_timeout=" << secs(c.rdzv_conf.run.last_call_timeout)
            << " token=" << (c.rdzv_conf.token.empty() ? "none" : "read") << std::endl;
  return 0;
}
