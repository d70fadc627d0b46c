// Keys: where one run lives in etcd, under its prefix (default /ddprun/rdzv/<run_id>):
//   <prefix>/state       the run's state value (state_value.h)
//   <prefix>/kv/<key>    the run's key-value store (static node ranks, the exit barrier)
//   <prefix>/alive/<id>  one key per node, attached to its agent's lease
// Threading: immutable once made; the loop and the threads read it without a lock.
#pragma once

#include <string>

namespace ddprun::etcd {

struct Keys {
  std::string prefix;
  std::string state;  // <prefix>/state
  std::string kv;     // <prefix>/kv/
  std::string alive;  // <prefix>/alive/

  // `key_prefix` empty: /ddprun/rdzv/<run_id>.
  static Keys of(const std::string& run_id, const std::string& key_prefix) {
    Keys k;
    k.prefix = key_prefix.empty() ? "/ddprun/rdzv/" + run_id : key_prefix;
    k.state = k.prefix + "/state";
    k.kv = k.prefix + "/kv/";
    k.alive = k.prefix + "/alive/";
    return k;
  }
};

// The end of the key range holding every key that starts with `prefix`.
inline std::string prefixEnd(std::string prefix) {
  for (size_t i = prefix.size(); i > 0; --i) {
    auto& c = reinterpret_cast<unsigned char&>(prefix[i - 1]);
    if (c < 0xff) {
      ++c;
      prefix.resize(i);
      return prefix;
    }
  }
  return std::string(1, '\0');
}

}  // namespace ddprun::etcd
