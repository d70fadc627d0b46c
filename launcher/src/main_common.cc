#include "main_common.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iostream>

#include "ddprun/agent/agent_runner.h"
#include "ddprun/common/launch_flags.h"
#include "ddprun/common/strings.h"
#include "ddprun/launcher/cli.h"
#include "ddprun/rendezvous/protobuf_log.h"
#include "ddprun/slurm/launch.h"
#include "ddprun/slurm/scontrol.h"

namespace ddprun::launcher {

namespace {

// `ddprun slurm [flags] prog args`: one agent per node of the allocation through srun.
int slurmMain(const char* program_name, const std::vector<std::string>& args,
              const std::map<std::string, std::string>& env, const HostFacts& host) {
  char self[4096] = {0};
  ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  const std::string ddprun_path = n > 0 ? std::string(self, static_cast<size_t>(n)) : "ddprun";
  std::vector<std::string> rest(args.begin() + 1, args.end());
  // --print-completion needs no allocation (as --help): answered before Slurm is asked.
  for (const ArgToken& t : tokenizeLaunchArgs(rest, launchFlags()).tokens) {
    if (t.kind != ArgToken::Kind::kFlag || std::string(t.flag->name) != "print_completion")
      continue;
    auto parsed = parseCommandLine({t.source + "=" + t.value.value_or("")}, env, host);
    if (!parsed.isOk()) {
      std::fprintf(stderr, "%s: error: %s\n", program_name,
                   escapeControl(parsed.status().message()).c_str());
      return 2;
    }
    std::cout << completionScript(parsed->completion_shell);
    return 0;
  }
  auto plan = slurm::srunCommand(rest, env, ddprun_path, slurm::scontrolAddressLookup());
  if (!plan.isOk()) {
    std::fprintf(stderr, "%s: error: %s\n", program_name,
                 escapeControl(plan.status().message()).c_str());
    return 2;
  }
  if (plan->show_help) {
    std::cout << slurm::slurmHelpText();
    return 0;
  }
  // A usage error is reported once here, not once per node.
  auto parsed = parseCommandLine(plan->ddprun_args, env, host);
  if (!parsed.isOk()) {
    std::fprintf(stderr, "%s: error: %s\n", program_name,
                 escapeControl(parsed.status().message()).c_str());
    return 2;
  }
  std::fprintf(stderr, "%s: %s\n", program_name, join(plan->argv, " ").c_str());
  std::fflush(stderr);
  std::vector<char*> argv;
  for (auto& a : plan->argv) argv.push_back(a.data());
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  std::fprintf(stderr, "%s: error: cannot run %s: %s\n", program_name, argv[0],
               std::strerror(errno));
  return 2;
}

}  // namespace

int launcherMain(const char* program_name, int argc, char** argv) {
  // The agent serves peers (snapshot replication, a hosted rendezvous): what they send must not
  // make libprotobuf write a line per call.
  rendezvous::routeProtobufLogs();
  try {
    std::vector<std::string> args(argv + 1, argv + argc);
    const std::map<std::string, std::string> env = environmentMap();
    const HostFacts host = probeHost();
    if (!args.empty() && args[0] == "slurm") return slurmMain(program_name, args, env, host);
    // `ddprun launch ...`: torch.distributed.launch's command line (--local-rank=N for scripts).
    CliMode mode = CliMode::kTorchrun;
    if (!args.empty() && args[0] == "launch") {
      mode = CliMode::kLaunch;
      args.erase(args.begin());
    }
    // As an srun task (one per node), derive --nnodes, --rdzv-* and --local-addr from Slurm.
    auto step = slurm::stepArgs(args, env, slurm::scontrolAddressLookup());
    if (!step.isOk()) {
      std::fprintf(stderr, "%s: error: %s\n", program_name,
                   escapeControl(step.status().message()).c_str());
      return 2;
    }
    if (!step->added.empty()) {
      std::fprintf(stderr, "%s: inside Slurm step: using %s\n", program_name,
                   join(step->added, " ").c_str());
    }
    args = step->args;
    auto parsed = parseCommandLine(args, env, host, mode);
    if (!parsed.isOk()) {
      std::fprintf(stderr, "%s: error: %s\n", program_name,
                   escapeControl(parsed.status().message()).c_str());
      return 2;
    }
    if (parsed->show_help) {
      std::cout << helpText(mode);
      return 0;
    }
    if (!parsed->completion_shell.empty()) {
      std::cout << completionScript(parsed->completion_shell);
      return 0;
    }
    for (const auto& notice : parsed->notices) {
      std::fprintf(stderr, "%s: %s\n", program_name, notice.c_str());
    }
    return agent::runAgent(parsed->config);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: internal error: %s\n", program_name, e.what());
    return 1;
  }
}

}  // namespace ddprun::launcher
