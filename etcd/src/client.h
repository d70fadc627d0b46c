// EtcdClient: a small blocking client of etcd's v3 gRPC API (KV, Watch, Lease, Auth,
// Maintenance), generated from etcd's own .proto files, over the gRPC++ already in the build.
// It fails over between the members given: a call goes to the member that answered last and
// moves on to the next one when that member is unreachable. With a user name it authenticates
// and sends the token in the `token` metadata, authenticating again when etcd says the token
// expired. Errors name the members tried and what each said.
//
// Threading: every method may be called from any thread at once (the etcd-v3 rendezvous service
// calls it from its transaction worker, watcher and lease keeper threads). Calls block for at most
// their deadline; shutdown() cancels every call in flight and makes later calls fail at once.
// Lifetime: outlives the threads that call it.
#pragma once

#include <atomic>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "ddprun/common/clock.h"
#include "ddprun/common/status.h"
#include "ddprun/common/thread_annotations.h"
#include "etcd/etcdserver/etcdserverpb/rpc.grpc.pb.h"
#include "http_probe.h"

namespace ddprun::etcd {

struct EtcdOptions {
  std::vector<std::string> endpoints;  // HOST:PORT of each member
  bool tls = false;                    // protocol=https
  std::string ca_pem, cert_pem, key_pem;
  std::string ca_file, cert_file;  // for messages
  std::string username;            // empty: no auth
  std::string password;
  Duration rpc_timeout = std::chrono::seconds(5);  // one attempt on one member
};

// Splits "h1:2379,h2:2379" (blanks around items allowed); empty items are an error.
StatusOr<std::vector<std::string>> splitEtcdEndpoints(const std::string& list);

class EtcdClient {
 public:
  explicit EtcdClient(EtcdOptions options);
  ~EtcdClient();
  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;

  // Each of these tries every member once (from the one that answered last) within its
  // deadline; UNAVAILABLE names every member and its error when none answered.
  Status range(const etcdserverpb::RangeRequest& req, etcdserverpb::RangeResponse* out);
  Status txn(const etcdserverpb::TxnRequest& req, etcdserverpb::TxnResponse* out);
  Status put(const etcdserverpb::PutRequest& req, etcdserverpb::PutResponse* out);
  Status deleteRange(const etcdserverpb::DeleteRangeRequest& req);
  StatusOr<int64_t> leaseGrant(int64_t ttl_seconds);
  Status leaseRevoke(int64_t lease);
  // One keep-alive; the lease's remaining TTL (0 when the lease is gone).
  StatusOr<int64_t> leaseKeepAliveOnce(int64_t lease);
  // The version of the member that answered (Maintenance.Status), e.g. "3.4.23".
  StatusOr<std::string> version();

  // Opens a Watch stream on the member that answers; the caller reads it. `ctx` must outlive
  // the stream; it is cancelled by shutdown().
  std::unique_ptr<grpc::ClientReaderWriter<etcdserverpb::WatchRequest, etcdserverpb::WatchResponse>>
  openWatch(grpc::ClientContext* ctx);
  // Forgets the member the last watch used, so the next one starts elsewhere.
  void rotate();
  // The watch's context is done (its stream finished): shutdown() no longer cancels it.
  void release(grpc::ClientContext* ctx) { untrack(ctx); }

  // Cancels every call in flight; later calls fail with CANCELLED.
  void shutdown() EXCLUDES(mu_);
  bool isShutDown() const { return shut_down_.load(); }

  const EtcdOptions& options() const { return options_; }
  // "h1:2379, h2:2379": the members, for messages.
  std::string membersText() const;

 private:
  struct Member;
  // Runs `call(member, ctx)` on each member in turn until one answers. `what` names the call.
  template <typename Call>
  Status onSomeMember(const char* what, Call call);
  Status authenticate(Member& m) EXCLUDES(mu_);
  void prepare(grpc::ClientContext& ctx) EXCLUDES(mu_);
  Status fromGrpc(const char* what, const Member& m, const grpc::Status& st) const;
  void track(grpc::ClientContext* ctx) EXCLUDES(mu_);
  void untrack(grpc::ClientContext* ctx) EXCLUDES(mu_);

  EtcdOptions options_;
  std::vector<std::unique_ptr<Member>> members_;
  std::atomic<size_t> current_{0};
  std::atomic<bool> shut_down_{false};
  Mutex mu_;
  std::string token_ GUARDED_BY(mu_);
  std::set<grpc::ClientContext*> active_ GUARDED_BY(mu_);  // cancelled by shutdown()
};

}  // namespace ddprun::etcd
