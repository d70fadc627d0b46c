// The fields of /proc/<pid>/stat that ddprun reads: a process's state letter (T or t: stopped by
// a signal or a debugger) and its parent. Linux only; pure parsing apart from readProcStat.
#pragma once

#include <optional>
#include <string>

namespace ddprun {

struct ProcStat {
  char state = '?';
  int ppid = -1;
};

// The text of a /proc/<pid>/stat line; nullopt when it is not one. The command name, in
// parentheses, may itself hold spaces and parentheses: the fields start after the last ')'.
std::optional<ProcStat> parseProcStat(const std::string& text);
// /proc/<pid>/stat of a live process; nullopt when it is gone (or not readable).
std::optional<ProcStat> readProcStat(int pid);

}  // namespace ddprun
