#include "fault_hooks.h"

#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "ddprun/common/proc_stat.h"

namespace ddprun::worker {

bool recoveryFaultRequested(const char* phase, int rank) {
  const char* spec = std::getenv("DDPRUN_INPLACE_FAULT");
  if (spec == nullptr) return false;
  const std::string s(spec);
  return s == std::string(phase) + ":" + std::to_string(rank) || s == std::string(phase) + ":*";
}

void injectRecoveryFault(const char* phase, int rank) {
  if (!recoveryFaultRequested(phase, rank)) return;
  // This node's agent: this worker's guardian's parent.
  auto agent = [] {
    const auto guardian = readProcStat(static_cast<int>(::getppid()));
    return guardian && guardian->ppid > 1 ? guardian->ppid : 0;
  };
  if (std::strcmp(phase, "form") == 0) {
    // The node dies: its agent and, through the guardian, every worker on it.
    std::fprintf(stderr,
                 "[RANK %d] DDPRUN_INPLACE_FAULT: killing this node's agent in the %s phase\n",
                 rank, phase);
    std::fflush(nullptr);
    if (const int pid = agent(); pid > 0) ::kill(pid, SIGKILL);
    std::_Exit(1);
  }
  if (std::strcmp(phase, "connect") == 0) {
    // The node goes silent (a host that hangs, or is cut off): its agent and this rank stop, and
    // this rank's sockets stay open, so its peers get no reset, only silence.
    std::fprintf(stderr,
                 "[RANK %d] DDPRUN_INPLACE_FAULT: stopping this node's agent and this rank in the "
                 "%s phase\n",
                 rank, phase);
    std::fflush(nullptr);
    if (const int pid = agent(); pid > 0) ::kill(pid, SIGSTOP);
    std::raise(SIGSTOP);
    return;
  }
  if (std::strcmp(phase, "wait") == 0) {
    std::fprintf(stderr, "[RANK %d] DDPRUN_INPLACE_FAULT: sending myself SIGTERM in the %s phase\n",
                 rank, phase);
    std::raise(SIGTERM);
    return;
  }
  std::fprintf(stderr, "[RANK %d] DDPRUN_INPLACE_FAULT: exiting %s the %s phase\n", rank,
               std::strcmp(phase, "step") == 0 ? "at the end of" : "during", phase);
  std::fflush(nullptr);
  std::_Exit(1);
}

}  // namespace ddprun::worker
