#include "ddprun/common/proc_stat.h"

#include <fstream>
#include <iterator>
#include <sstream>

namespace ddprun {

std::optional<ProcStat> parseProcStat(const std::string& text) {
  const auto close = text.rfind(')');
  if (close == std::string::npos) return std::nullopt;
  std::istringstream rest(text.substr(close + 1));
  std::string state;
  long ppid = -1;
  rest >> state >> ppid;
  if (!rest || state.size() != 1) return std::nullopt;
  ProcStat stat{state[0], static_cast<int>(ppid)};
  // pgrp, session, tty_nr, tpgid, then flags (proc(5)).
  long skipped = 0;
  unsigned long flags = 0;
  if (rest >> skipped >> skipped >> skipped >> skipped >> flags) stat.flags = flags;
  return stat;
}

std::optional<ProcStat> readProcStat(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  if (!in) return std::nullopt;
  return parseProcStat(
      std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>()));
}

}  // namespace ddprun
