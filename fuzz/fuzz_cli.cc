// libFuzzer target: ddprun's whole command line (launcher/src/cli.cc over the flag table and
// tokenizer of common/src/launch_flags.cc). The input is split at newlines into arguments; an
// argument "@NAME=VALUE" goes to the environment instead (PET_<NAME> defaults, PYTHON_EXEC...).
// The first byte picks torchrun's or torch.distributed.launch's grammar and the host's CPU and
// GPU counts. Checks: no crash, a refusal is one line without control bytes (the values it quotes
// are escaped), and an accepted command line is one an agent can run.
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ddprun/common/strings.h"
#include "ddprun/launcher/cli.h"
#include "fuzz_check.h"

using namespace ddprun;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t shape = data[0];
  std::vector<std::string> args;
  std::map<std::string, std::string> env;
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  for (const auto& item : split(text, '\n')) {
    if (startsWith(item, "@")) {
      const auto eq = item.find('=');
      if (eq != std::string::npos) env[item.substr(1, eq - 1)] = item.substr(eq + 1);
      continue;
    }
    args.push_back(item);
  }
  launcher::HostFacts host;
  host.cpu_count = 1 + (shape >> 1) % 8;
  host.gpu_count = (shape >> 4) % 3;
  host.sysfs_root = "/nonexistent-ddprun-fuzz";  // --numa-binding is refused, deterministically
  const auto mode = (shape & 1) != 0 ? launcher::CliMode::kLaunch : launcher::CliMode::kTorchrun;
  auto parsed = launcher::parseCommandLine(args, env, host, mode);
  if (!parsed.isOk()) {
    FUZZ_CHECK(isOneCleanLine(parsed.status().message()));
    return 0;
  }
  if (parsed.value().show_help) return 0;
  const agent::AgentConfig& c = parsed.value().config;
  FUZZ_CHECK(c.min_nodes >= 1 && c.min_nodes <= c.max_nodes);
  FUZZ_CHECK(c.nproc_per_node >= 1);
  FUZZ_CHECK(!c.worker_argv.empty() && !c.worker_argv[0].empty());
  FUZZ_CHECK(c.rdzv_conf.run.min_nodes == static_cast<uint32_t>(c.min_nodes));
  FUZZ_CHECK(c.rdzv_conf.run.max_nodes == static_cast<uint32_t>(c.max_nodes));
  FUZZ_CHECK(c.shutdown_timeout >= 0 && c.exit_barrier_timeout >= 0 && c.heartbeat_timeout >= 0);
  FUZZ_CHECK(c.max_restarts >= 0);
  FUZZ_CHECK(c.local_rank_arg_at <= c.worker_argv.size());
  return 0;
}
