// The torchrun-compatible command line (SPEC §2): turns argv and the environment (PET_<NAME>
// defaults) into an AgentConfig, or a usage error naming the flag and the accepted form.
// Pure apart from looking up the program on the file system. Thread-compatible.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "ddprun/agent/config.h"
#include "ddprun/common/status.h"

namespace ddprun::launcher {

// Facts about this host the parser needs for `cpu`, `gpu` and `auto`.
struct HostFacts {
  int cpu_count = 1;
  int gpu_count = 0;
  int xpu_count = 0;  // Intel GPUs (render nodes of vendor 0x8086), for --nproc-per-node=xpu
  std::string sysfs_root = "/sys/devices/system";  // the CPU topology, for --numa-binding
};

// Which launcher's command line: torchrun's (`ddprun ...`), or torch.distributed.launch's
// (`ddprun launch ...`), whose scripts get --local-rank=N unless --use-env is given.
enum class CliMode { kTorchrun, kLaunch };

struct CliResult {
  bool show_help = false;
  std::string completion_shell;  // --print-completion SHELL: print completionScript(SHELL), exit
  agent::AgentConfig config;
  std::vector<std::string> notices;  // one-line notices for the user (e.g. OMP_NUM_THREADS)
};

// `args` excludes argv[0]. Errors are INVALID_ARGUMENT with a message such as
// "argument --nnodes: expected N or MIN:MAX with 0 < MIN <= MAX, got '3:1'".
StatusOr<CliResult> parseCommandLine(const std::vector<std::string>& args,
                                     const std::map<std::string, std::string>& env,
                                     const HostFacts& host, CliMode mode = CliMode::kTorchrun);

std::string helpText(CliMode mode = CliMode::kTorchrun);

// A completion script for `ddprun` in `shell` (bash, zsh or tcsh), from the flag table: its flags,
// the values of those with few fixed ones (LaunchFlag::choices), directories for DIR values, and
// files for the program and its arguments. `ddprun launch` and `ddprun slurm` complete the same
// flags (bash, tcsh).
std::string completionScript(const std::string& shell);

// Counts this host's CPUs, CUDA devices and Intel GPUs.
HostFacts probeHost();

}  // namespace ddprun::launcher
