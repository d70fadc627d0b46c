// The shared body of the `ddprun` and `ddprun-agent` mains: parse the command line, report usage
// errors in one line with exit code 2, and run this node's agent.
#pragma once

namespace ddprun::launcher {

int launcherMain(const char* program_name, int argc, char** argv);

}  // namespace ddprun::launcher
