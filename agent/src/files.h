// Small file-system helpers of the agent's shell (log directories, attempt directories).
// Thread-compatible; each call does its own I/O.
#pragma once

#include <string>

#include "ddprun/common/status.h"

namespace ddprun::agent {

// mkdir -p: creates `path` and its missing parents (mode 0755).
Status makeDirs(const std::string& path);
// A fresh directory `parent/prefixXXXXXX` (parent created if missing).
StatusOr<std::string> makeTempDir(const std::string& parent, const std::string& prefix);
// Removes `path` if it exists; a missing file is fine.
Status removeIfExists(const std::string& path);

}  // namespace ddprun::agent
