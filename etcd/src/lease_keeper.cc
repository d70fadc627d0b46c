#include "lease_keeper.h"

#include <cmath>
#include <vector>

#include "client.h"
#include "log.h"

namespace ddprun::etcd {

namespace ep = etcdserverpb;

LeaseKeeper::LeaseKeeper(EtcdClient& client, Stopper& stopper, const Keys& keys,
                         int64_t ttl_seconds)
    : client_(client), stopper_(stopper), keys_(keys), ttl_(ttl_seconds) {}

LeaseKeeper::~LeaseKeeper() { join(); }

int64_t LeaseKeeper::ttlFor(const rendezvous::RunConfig& config) {
  const double expiry =
      std::chrono::duration<double>(config.heartbeat_interval).count() * config.heartbeat_misses;
  return std::max<int64_t>(2, static_cast<int64_t>(std::ceil(expiry)));
}

Status LeaseKeeper::grant(Duration retry_for) {
  StatusOr<int64_t> lease = unavailable("not tried");
  Status st = stopper_.retrying(retry_for, [&] {
    lease = client_.leaseGrant(ttl_);
    return lease.status();
  });
  if (!st.isOk()) return st;
  lease_ = lease.value();
  return Status::ok();
}

void LeaseKeeper::start() {
  thread_ = std::thread([this] { keepAliveLoop(); });
}

void LeaseKeeper::join() {
  if (thread_.joinable()) thread_.join();
}

void LeaseKeeper::revoke() {
  const int64_t lease = lease_.exchange(0);
  if (lease == 0) return;
  EtcdOptions quick = client_.options();
  quick.rpc_timeout = std::chrono::seconds(1);
  EtcdClient last(quick);
  (void)last.leaseRevoke(lease);
}

void LeaseKeeper::keepAliveLoop() {
  const auto period = std::chrono::milliseconds(ttl_ * 1000 / 4);
  while (stopper_.pause(period)) {
    StatusOr<int64_t> ttl = client_.leaseKeepAliveOnce(lease_.load());
    if (!ttl.isOk()) {
      etcdLog()->debug("etcd rendezvous: lease keep-alive: {}", ttl.status().message());
      continue;
    }
    if (ttl.value() > 0) continue;
    (void)replace(lease_.load());
  }
}

Status LeaseKeeper::replace(int64_t lost) {
  MutexLock renewing(renew_mu_);
  if (lease_.load() != lost) return Status::ok();  // replaced already
  etcdLog()->warn("etcd rendezvous: this agent's lease expired; taking a new one");
  StatusOr<int64_t> fresh = client_.leaseGrant(ttl_);
  if (!fresh.isOk()) return fresh.status();
  lease_ = fresh.value();
  std::vector<std::string> nodes;
  {
    MutexLock lock(nodes_mu_);
    nodes.assign(nodes_.begin(), nodes_.end());
  }
  for (const std::string& node : nodes) (void)putAliveUnder(node, fresh.value());
  return Status::ok();
}

Status LeaseKeeper::underLease(const std::function<Status(int64_t lease)>& call) {
  const int64_t lease = lease_.load();
  Status st = call(lease);
  // etcd's only NOT_FOUND: ErrGRPCLeaseNotFound.
  if (st.code() != StatusCode::kNotFound) return st;
  Status renewed = replace(lease);
  if (!renewed.isOk()) return renewed;
  return call(lease_.load());
}

Status LeaseKeeper::putAlive(const std::string& node) {
  return underLease([&](int64_t lease) { return putAliveUnder(node, lease); });
}

Status LeaseKeeper::putAliveUnder(const std::string& node, int64_t lease) {
  ep::PutRequest put;
  put.set_key(keys_.alive + node);
  put.set_value("1");
  put.set_lease(lease);
  ep::PutResponse resp;
  return client_.put(put, &resp);
}

void LeaseKeeper::keep(const std::string& node) {
  MutexLock lock(nodes_mu_);
  nodes_.insert(node);
}

void LeaseKeeper::drop(const std::string& node) {
  MutexLock lock(nodes_mu_);
  nodes_.erase(node);
}

}  // namespace ddprun::etcd
