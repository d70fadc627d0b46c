// ProcessLauncher: the side effects of starting and signalling worker processes, behind an
// interface so the supervisor can be tested with tests/fakes/fake_process_launcher.h.
// Implementations are used from the agent's one event-loop thread only.
#pragma once

#include <string>
#include <vector>

#include "ddprun/common/status.h"

namespace ddprun::agent {

// How a worker ended: exited with `code`, or killed by signal `code`.
struct ExitStatus {
  bool signaled = false;
  int code = 0;
  bool success() const { return !signaled && code == 0; }
  // torchrun's convention: negative signal number when killed by a signal.
  int torchrunExitCode() const { return signaled ? -code : code; }
};

// Lines of a tee'd stream that contain one of `needles` are also appended, prefixed like the
// console's, to `file` (shared by every worker of the attempt). Empty file: no filter.
struct LineFilter {
  std::string file;
  std::vector<std::string> needles;
};

// Everything needed to start one worker.
struct WorkerLaunch {
  int local_rank = 0;
  int global_rank = 0;
  std::vector<std::string> argv;
  std::vector<std::string> env;  // "NAME=value", complete
  std::string error_file;
  // DDPRUN_HEARTBEAT_FILE of this worker (hang detection); empty: none.
  std::string heartbeat_file;
  // DDPRUN_STOP_FILE of this worker: present after an exit 0 when the worker only stopped on a
  // checkpoint request (worker SDK); empty: none.
  std::string stop_file;
  // Files the worker's streams go to; empty: inherit the agent's.
  std::string stdout_file;
  std::string stderr_file;
  // Tee: the stream also reaches the agent's console, each line prefixed with console_prefix.
  bool tee_stdout = false;
  bool tee_stderr = false;
  bool to_console = true;  // false: tee'd output goes to the file only (--local-ranks-filter)
  std::string console_prefix;
  LineFilter stdout_filter;  // applies when tee_stdout
  LineFilter stderr_filter;  // applies when tee_stderr
  // CPUs the worker may run on (--numa-binding); empty: the agent's own affinity.
  std::vector<int> cpu_affinity;
};

class ProcessLauncher {
 public:
  virtual ~ProcessLauncher() = default;
  // Starts the worker in a process group of its own, to die with the agent. Returns its pid,
  // which is also its process group id.
  virtual StatusOr<int> spawn(const WorkerLaunch& launch) = 0;
  // Sends `sig` to the worker's whole process group.
  virtual void signalGroup(int pid, int sig) = 0;
  // The worker was sent SIGKILL and still has not been reaped: whatever holds it (its guardian,
  // stopped or stuck) is killed too, so its exit can reach the agent; the caller stops waiting.
  virtual void forceEnd(int pid) = 0;
};

}  // namespace ddprun::agent
