// EtcdRendezvousService: the rendezvous service (rendezvous::Service, ddprun/rendezvous/service.h)
// over etcd v3 (--rdzv-backend=etcd-v3), for one run: the adapter beside the gRPC one.
//
// The run's rendezvous state lives in etcd, under the key prefix (default /ddprun/rdzv/<run_id>):
//   <prefix>/state       the run as RendezvousState::exportRun writes it, preceded by the round
//                        changes and join answers of the transaction that wrote it (what
//                        watchers are pushed; etcd/src/state_value.h)
//   <prefix>/kv/<key>    the run's key-value store (static node ranks, the exit barrier)
//   <prefix>/alive/<id>  one key per node, attached to its agent's lease
// Every request is applied by the agent that makes it, with the same pure RendezvousState code as
// the gRPC server: take the state and its mod_revision, import it, apply, export, and write it
// back in a transaction that compares the mod_revision (retrying on conflict with the state the
// refused transaction returns), so two agents never race a read-modify-write. The state taken
// first is the newest this agent holds (from its watch or its last transaction), so a request
// costs one round trip when that copy is current; a result of "nothing to write" is only trusted
// on a state read from etcd. A joiner whose round completes later finds its answer (rank, sizes,
// participants) by its call id in the pushed value, without parsing the whole run.
// Deadlines in the state are wall-clock times, so any agent can apply them: each agent arms a timer
// at the state's next deadline and applies tick() when it fires. Liveness comes from etcd leases,
// not from heartbeats written into the state: an agent keeps its lease alive; when a lease expires
// etcd deletes the node's alive key, and every agent that sees the DELETE applies declareDead (one
// of them wins the transaction, the rest find nothing to do). Everything is pushed by one etcd
// watch on the prefix: round changes, key writes, deaths.
//
// Threading: as rendezvous::Service: called on the agent's loop, callbacks posted to it. Blocking
// etcd calls run on three threads of this object, each a file of etcd/src: the transaction worker
// (requests in order), the watcher (the watch on the prefix) and the lease keeper (keep-alives).
// They touch nothing of the loop's: they share the client, the newest state value seen and the
// lease (each under its mutex), and post their results to the loop, where the domain logic runs
// (etcd/src/loop_service.h).
// Lifetime: the destructor cancels what is in flight, joins the threads and revokes the lease.
#pragma once

#include <boost/asio/io_context.hpp>
#include <memory>
#include <string>
#include <vector>

#include "ddprun/rendezvous/service.h"
#include "ddprun/rendezvous/types.h"

namespace ddprun::etcd {

class LoopService;

struct EtcdServiceOptions {
  std::string run_id;
  std::string endpoints;   // "h1:2379,h2:2379"
  std::string key_prefix;  // empty: /ddprun/rdzv/<run_id>
  bool tls = false;
  std::string ca_pem, cert_pem, key_pem, ca_file, cert_file;
  std::string username, password;
  // The run's heartbeat interval x misses is the lease TTL (whole seconds, at least 2).
  rendezvous::RunConfig run_config;
  Duration rpc_timeout = std::chrono::seconds(5);    // one etcd call on one member
  Duration connect_for = std::chrono::seconds(600);  // how long an unreachable etcd is retried
  // Every agent mirrors the run's key-value store (<prefix>/kv/) from the watch: at most this
  // many keys and bytes of keys and values (kv_max_keys=, kv_max_bytes= in --rdzv-conf; the gRPC
  // server's per-run quotas). What is beyond is not kept (one warning a minute), and kvSet
  // refuses it (RESOURCE_EXHAUSTED naming the bound).
  uint64_t max_kv_keys = 65536;
  uint64_t max_kv_bytes = uint64_t{16} << 20;
};

class EtcdRendezvousService final : public rendezvous::Service {
 public:
  EtcdRendezvousService(boost::asio::io_context& io, EtcdServiceOptions options);
  ~EtcdRendezvousService() override;

  void join(const rendezvous::JoinRequest& req, Done<rendezvous::RoundInfo> done) override;
  void heartbeat(const std::string& node_id, rendezvous::CallPolicy policy,
                 Done<rendezvous::RunStatus> done) override;
  void leave(const std::string& node_id, rendezvous::CallPolicy policy, StatusDone done) override;
  void reportFailure(const std::string& node_id, uint64_t round, rendezvous::FailureKind kind,
                     Done<uint64_t> done) override;
  void close(rendezvous::CallPolicy policy, StatusDone done) override;
  void publishMaster(const std::string& node_id, uint64_t round,
                     const rendezvous::MasterAddress& master, StatusDone done) override;
  void waitMaster(uint64_t round, Duration timeout, Done<rendezvous::MasterAddress> done) override;
  void kvSet(const std::string& key, const std::string& value, rendezvous::CallPolicy policy,
             StatusDone done) override;
  void kvWait(const std::vector<std::string>& keys, Duration timeout, rendezvous::CallPolicy policy,
              Done<std::vector<std::string>> done) override;
  void kvDeleteRange(const std::string& from, const std::string& to, rendezvous::CallPolicy policy,
                     StatusDone done) override;
  // Keys and bytes (keys and values) of the run's key-value store mirrored here (loop thread).
  std::pair<uint64_t, uint64_t> mirroredKv() const;
  void watch(const std::string& node_id, ChangeSink on_change) override;
  void stopWatch() override;
  void cancelAll() override;
  Status explainUnavailable(const Status& status) const override;

  // The key prefix in use (tests, messages).
  const std::string& keyPrefix() const;

 private:
  std::shared_ptr<LoopService> service_;  // shared: posts to the loop hold a weak_ptr to it
};

}  // namespace ddprun::etcd
