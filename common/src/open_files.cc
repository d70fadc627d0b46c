#include "ddprun/common/open_files.h"

#include <sys/resource.h>

namespace ddprun {

uint64_t openFileLimit() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return 0;
  return static_cast<uint64_t>(lim.rlim_cur);
}

uint64_t raiseOpenFileLimit() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return 0;
  if (lim.rlim_cur < lim.rlim_max) {
    rlimit raised = lim;
    raised.rlim_cur = lim.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) lim = raised;
  }
  return static_cast<uint64_t>(lim.rlim_cur);
}

}  // namespace ddprun
