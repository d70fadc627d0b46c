// The launcher's long flags (SPEC §2): one table for the command-line parser (launcher/cli.h)
// and for the Slurm wrapper, which must find where the program starts in a ddprun command line.
// Constant data; thread-safe.
#pragma once

#include <vector>

namespace ddprun {

struct LaunchFlag {
  const char* name;  // canonical, underscores: "nproc_per_node"
  bool takes_value;
  const char* metavar;
  const char* help;
};

// In --help order.
const std::vector<LaunchFlag>& launchFlags();

}  // namespace ddprun
