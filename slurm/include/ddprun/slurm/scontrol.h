// The real AddressLookup: asks Slurm for a node's NodeAddr with `scontrol show node -o NAME`
// (a node's address may differ from its name: NodeName=gpu01 NodeAddr=10.1.0.17). Runs scontrol
// as a child process with a bounded wait; blocking, callable from any thread. The parsing is a
// separate pure function so it is tested without Slurm.
#pragma once

#include <chrono>
#include <string>

#include "ddprun/common/status.h"
#include "ddprun/slurm/launch.h"

namespace ddprun::slurm {

struct ScontrolOptions {
  std::string scontrol = "scontrol";  // looked up on PATH
  std::chrono::milliseconds timeout = std::chrono::seconds(30);
};

// NOT_FOUND when scontrol is missing, UNAVAILABLE when it fails (with its stderr),
// DEADLINE_EXCEEDED past the timeout, INVALID_ARGUMENT when its answer has no NodeAddr.
AddressLookup scontrolAddressLookup(const ScontrolOptions& options = {});

// NodeAddr=... from `scontrol show node -o NAME` output (one line per node); the node's own
// line is picked by NodeName=NAME.
StatusOr<std::string> parseNodeAddr(const std::string& scontrol_output,
                                    const std::string& node_name);

}  // namespace ddprun::slurm
