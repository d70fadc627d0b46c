// runAgent: the agent daemon for one node — the Supervisor wired to real processes, signals and
// a rendezvous on one Boost.Asio io_context thread (the calling thread). Blocks until the job
// ends on this node and returns the process exit code (SPEC §4): 0 success, 1 workers failed
// past the restart budget (or the agent could not run them), 128+n stopped by signal n.
#pragma once

#include "ddprun/agent/config.h"

namespace ddprun::agent {

int runAgent(const AgentConfig& config);

}  // namespace ddprun::agent
