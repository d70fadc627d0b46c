// The etcd adapter's logger ("[ddprun etcd] ..."): one per component (common/log.h).
#pragma once

#include <memory>

#include "ddprun/common/log.h"

namespace ddprun::etcd {

inline std::shared_ptr<spdlog::logger> etcdLog() { return logger("etcd"); }

}  // namespace ddprun::etcd
