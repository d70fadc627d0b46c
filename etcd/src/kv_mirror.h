// KvMirror: the run's key-value store (<prefix>/kv/) as this agent's watch delivered it, within
// bounds (kv_max_keys=, kv_max_bytes= in --rdzv-conf; the gRPC server's per-run quotas): what is
// beyond is not kept (a warning a minute, with a count), and this agent's own writes past them
// are refused. kvWait is answered from it.
//
// Threading: the service's loop only (a plain value it owns).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ddprun/common/log_throttle.h"
#include "ddprun/common/status.h"

namespace ddprun::etcd {

class KvMirror {
 public:
  // `where`: the store's key prefix, for messages.
  KvMirror(std::string where, uint64_t max_keys, uint64_t max_bytes);

  // Keeps `key` unless it would take the mirror past its bounds (then an older value of it is
  // dropped too: a waiter must not see a value the store no longer has).
  void keep(const std::string& key, std::string value);
  void forget(const std::string& key);
  void clear();
  // Whether a write of `key` with `value_size` bytes stays within the bounds: RESOURCE_EXHAUSTED
  // naming the bound otherwise.
  Status admits(const std::string& key, uint64_t value_size) const;
  // The values of `keys` in order, once all are here.
  std::optional<std::vector<std::string>> values(const std::vector<std::string>& keys) const;
  // Keys and bytes (keys and values) held.
  std::pair<uint64_t, uint64_t> size() const { return {kv_.size(), bytes_}; }

 private:
  // Bytes held without `key`.
  uint64_t bytesWithout(const std::string& key) const;

  const std::string where_;
  const uint64_t max_keys_, max_bytes_;
  std::map<std::string, std::string> kv_;
  uint64_t bytes_ = 0;                             // of the keys and values in kv_
  LogThrottle dropped_{std::chrono::seconds(60)};  // keys not kept
};

}  // namespace ddprun::etcd
