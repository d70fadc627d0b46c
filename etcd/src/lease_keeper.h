// LeaseKeeper: this agent's etcd lease and the alive keys of its nodes under it. Liveness comes
// from the lease, not from heartbeats written into the state: the TTL is the run's heartbeat
// interval x misses (whole seconds, at least 2), the keeper thread renews the lease every TTL/4,
// and when a lease lapses etcd deletes the alive keys under it, which every agent's watch sees.
// A lease etcd no longer has (it expired while etcd was unreachable) is replaced once, and the
// alive keys of this agent's nodes are put again under the new one, so the node ids live on.
//
// Threading: grant(), underLease(), putAlive(), keep() and drop() on the transaction worker; the
// keeper thread renews; start(), join() and revoke() on the service's loop. The lease id is an
// atomic, the node set is guarded by its mutex. Lifetime: join() before revoke() and before the
// client goes.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <thread>

#include "ddprun/common/clock.h"
#include "ddprun/common/status.h"
#include "ddprun/common/thread_annotations.h"
#include "ddprun/rendezvous/types.h"
#include "keys.h"
#include "stopper.h"

namespace ddprun::etcd {

class EtcdClient;

class LeaseKeeper {
 public:
  LeaseKeeper(EtcdClient& client, Stopper& stopper, const Keys& keys, int64_t ttl_seconds);
  ~LeaseKeeper();
  LeaseKeeper(const LeaseKeeper&) = delete;
  LeaseKeeper& operator=(const LeaseKeeper&) = delete;

  // The TTL for a run: heartbeat interval x misses, in whole seconds, at least 2.
  static int64_t ttlFor(const rendezvous::RunConfig& config);
  int64_t ttl() const { return ttl_; }

  // Takes the lease (first contact), retrying an unreachable etcd for up to `retry_for`.
  Status grant(Duration retry_for);
  // Starts the keeper thread (once granted).
  void start();
  void join();
  // Others learn at once that this agent is gone (its alive keys go with the lease): a last call
  // on a client of its own, since the service's was shut down. Once.
  void revoke();

  // Runs `call` with the lease; when etcd answers that it is gone (it expired while etcd was
  // down, and the keeper has not noticed yet), once more under a fresh one.
  Status underLease(const std::function<Status(int64_t lease)>& call);
  // Puts the alive key of `node` under the lease.
  Status putAlive(const std::string& node);
  // The node ids whose alive keys this agent keeps (put again under a replaced lease).
  void keep(const std::string& node) EXCLUDES(nodes_mu_);
  void drop(const std::string& node) EXCLUDES(nodes_mu_);

 private:
  void keepAliveLoop();
  // The lease `lost` expired: a new one, and the alive keys again. Taken once, however many
  // threads (the keeper, a transaction) saw `lost` go.
  Status replace(int64_t lost) EXCLUDES(renew_mu_, nodes_mu_);
  Status putAliveUnder(const std::string& node, int64_t lease);

  EtcdClient& client_;
  Stopper& stopper_;
  const Keys& keys_;
  const int64_t ttl_;
  std::atomic<int64_t> lease_{0};
  Mutex renew_mu_;  // held while a lost lease is replaced
  Mutex nodes_mu_;
  std::set<std::string> nodes_ GUARDED_BY(nodes_mu_);
  std::thread thread_;  // started and joined on the loop
};

}  // namespace ddprun::etcd
