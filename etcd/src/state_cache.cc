#include "state_cache.h"

#include "log.h"

namespace ddprun::etcd {

Status StateCache::load(std::shared_ptr<const std::string> stored) {
  auto parsed = StateValue::parse(std::move(stored));
  if (!parsed.isOk()) return parsed.status();
  value_ = std::move(parsed).value();
  stale_ = true;
  return Status::ok();
}

rendezvous::RendezvousState& StateCache::state() {
  if (stale_) {
    stale_ = false;
    StatusOr<std::string> snapshot = value_.snapshot();
    Status st = snapshot.isOk() ? state_.importRun(run_id_, snapshot.value()) : snapshot.status();
    if (!st.isOk()) etcdLog()->error("etcd rendezvous: {}", st.message());
  }
  return state_;
}

}  // namespace ddprun::etcd
