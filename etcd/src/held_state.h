// HeldState: the newest value of the state key this agent has seen (from its watch, its reads
// and its own transactions) and the revisions it was current at. A transaction starts from it
// instead of reading first, so a request on a current copy costs one round trip (txn_worker.h).
//
// Threading: written by the watch thread and the transaction worker, read by the worker; every
// method from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "ddprun/common/thread_annotations.h"

namespace ddprun::etcd {

struct StoredValue {
  std::shared_ptr<const std::string> value;  // null: none seen yet ("": no key)
  int64_t mod = 0;                           // its mod_revision (0: no key)
  int64_t revision = 0;                      // the store revision it was read at
};

class HeldState {
 public:
  // Keeps `v` unless what is held was current at a later revision.
  void note(StoredValue v) EXCLUDES(mu_) {
    MutexLock lock(mu_);
    if (held_.value && v.revision < held_.revision) return;
    held_ = std::move(v);
  }

  // What is held (a null value when nothing is).
  StoredValue get() EXCLUDES(mu_) {
    MutexLock lock(mu_);
    return held_;
  }

  // The store went back (another cluster, or an older data directory): nothing read from it is
  // kept.
  void forget() EXCLUDES(mu_) {
    MutexLock lock(mu_);
    held_ = StoredValue{};
  }

 private:
  Mutex mu_;
  StoredValue held_ GUARDED_BY(mu_);
};

}  // namespace ddprun::etcd
