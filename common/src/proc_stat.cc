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
  return ProcStat{state[0], static_cast<int>(ppid)};
}

std::optional<ProcStat> readProcStat(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  if (!in) return std::nullopt;
  return parseProcStat(
      std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>()));
}

}  // namespace ddprun
