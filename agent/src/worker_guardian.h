// Worker guardian: a small process the agent forks between itself and each worker, so that no
// process of the worker's tree outlives the agent — not even one that left the worker's process
// group or session (setsid), which the worker's own parent-death signal cannot reach.
//
// The guardian makes itself a child subreaper, so every orphaned descendant of the worker is
// reparented to it. It learns of the agent's death from EOF on a lifeline pipe whose write end
// only the agent holds (and from PR_SET_PDEATHSIG as a second, checked, source); it then SIGKILLs
// the worker's process group and every remaining descendant, and exits. While the agent lives it
// reaps orphans, and once the worker exits it kills what is left of the tree and exits without
// reaping the worker: the worker's zombie is handed to the agent, a child subreaper too, so the
// agent's waitpid sees the worker's own pid and status exactly as if it had forked it. The
// guardian's own exit is a pid the supervisor does not know and ignores.
//
// The worker is started by the guardian in a process group of its own (its pid), with
// PR_SET_PDEATHSIG(SIGKILL) against the guardian. The guardian is a fork of a possibly
// multi-threaded agent: after fork it runs async-signal-safe code only (raw syscalls, no heap).
//
// Threading: call spawnGuardedWorker from one thread at a time (the agent's event loop).
// Lifetime: the first call makes the calling process a child subreaper and opens the lifeline,
// both for the rest of the process's life.
#pragma once

#include <sched.h>
#include <sys/types.h>

#include <string>

#include "ddprun/common/status.h"

namespace ddprun::agent {

// What the worker is started with, prepared before fork (nothing is allocated after it).
struct GuardedExec {
  char* const* argv = nullptr;              // null-terminated; argv[0] is the program's path
  char* const* envp = nullptr;              // null-terminated, complete
  int stdout_fd = -1;                       // dup2'd onto the worker's stdout; -1: inherit
  int stderr_fd = -1;                       // dup2'd onto the worker's stderr; -1: inherit
  const cpu_set_t* cpu_affinity = nullptr;  // set on the worker before exec; null: inherit
};

struct GuardedPids {
  int worker = 0;    // also the worker's process group id
  int guardian = 0;  // the worker's parent; the agent kills it when it does not answer
};

// Forks a guardian that starts the worker and returns the worker's pid (also its process group
// id) and the guardian's once the worker's exec succeeded. A failed exec is reported here
// ("cannot execute <argv[0]>: <reason>") with the guardian already reaped. A guardian that does
// not report within `report_within` (stopped, stuck) is killed and reaped, and that is the error:
// the agent never waits for it without a bound. The caller keeps ownership of
// stdout_fd/stderr_fd.
StatusOr<GuardedPids> spawnGuardedWorker(const GuardedExec& exec, int report_within_ms = 30000);

// The children of `self` (the pid of a single-threaded process, or of a process's main thread),
// at most `max` of them, into `out`; their number. Async-signal-safe (the guardian's, after fork).
// childrenListed reads the kernel's list of the thread's children (CONFIG_PROC_CHILDREN; -1 where
// the kernel has none), childrenScanned /proc/<pid>/stat of every process, and childrenOf the
// first where it can: with N workers ending at once, each guardian scanning every process made
// the teardown O(N^2) (a 1024-worker job of /bin/true took 10 s to end, 2048 took 63 s).
int childrenListed(pid_t self, pid_t* out, int max);
int childrenScanned(pid_t self, pid_t* out, int max);
int childrenOf(pid_t self, pid_t* out, int max);

}  // namespace ddprun::agent
