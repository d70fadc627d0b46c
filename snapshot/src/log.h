// The component's logger and the way it keeps warnings a peer or the file system can repeat to
// a few lines. Private to snapshot/src.
#pragma once

#include <optional>

#include "ddprun/common/log.h"

namespace ddprun::snapshot {

inline auto snapLog() { return logger("snapshot"); }

// Warnings of one kind (each counted in `count`): the first few are logged, the last of them
// saying so. The text to end the warning with, or nothing when this one is not logged.
inline std::optional<const char*> firstFew(int& count) {
  constexpr int kLogged = 5;
  if (++count > kLogged) return std::nullopt;
  return count == kLogged ? " (further such warnings: not logged)" : "";
}

}  // namespace ddprun::snapshot
