// The fields of /proc/<pid>/stat that ddprun reads: a process's state letter (T or t: stopped by
// a signal or a debugger), its parent and its kernel flags (PF_EXITING: on its way out, its memory
// being torn down before it turns zombie). Linux only; pure parsing apart from readProcStat.
#pragma once

#include <optional>
#include <string>

namespace ddprun {

struct ProcStat {
  char state = '?';
  int ppid = -1;
  unsigned long flags = 0;  // the kernel's PF_* word (0 when the line stops before it)
  // PF_EXITING: the process has begun to exit (a SIGKILL taken, exit() called) and can never run
  // its own code again; a large one stays in state R for tens of milliseconds before it is a
  // zombie.
  bool exiting() const { return (flags & 0x4UL) != 0; }
  // Its exit is on its way: exiting, a zombie (Z) or dead (X).
  bool ended() const { return state == 'Z' || state == 'X' || exiting(); }
};

// The text of a /proc/<pid>/stat line; nullopt when it is not one. The command name, in
// parentheses, may itself hold spaces and parentheses: the fields start after the last ')'.
std::optional<ProcStat> parseProcStat(const std::string& text);
// /proc/<pid>/stat of a live process; nullopt when it is gone (or not readable).
std::optional<ProcStat> readProcStat(int pid);

}  // namespace ddprun
