// GrpcRendezvousService: RendezvousService over ddprun's own gRPC rendezvous
// (rendezvous/async_client.h), for one run. Adds what a user should check to UNAVAILABLE errors
// (a server that is down and a TLS mismatch look the same to gRPC).
// Threading and lifetime: as RendezvousService; callbacks are posted to the agent's io_context by
// the AsyncClient.
#pragma once

#include <boost/asio/io_context.hpp>
#include <memory>
#include <string>

#include "ddprun/agent/rendezvous_service.h"
#include "ddprun/common/loop_affinity.h"
#include "ddprun/rendezvous/async_client.h"

namespace ddprun::agent {

struct GrpcServiceOptions {
  std::string run_id;
  rendezvous::ClientOptions client;  // endpoint, token, TLS, timeouts
  std::string tls_ca_file;           // where client.tls_root_cert_pem came from, for messages
  // What an unreachable endpoint most likely means, when the caller knows better than the TLS
  // guess (the static backend's MASTER_PORT+1).
  std::string unreachable_note;
  // Why this agent did not host an endpoint it tried to host (its port was taken), added to
  // whatever an unreachable endpoint is reported with.
  std::string hosting_note;
};

class GrpcRendezvousService final : public RendezvousService {
 public:
  GrpcRendezvousService(boost::asio::io_context& io, GrpcServiceOptions options);
  ~GrpcRendezvousService() override;

  void join(const rendezvous::JoinRequest& req, Done<rendezvous::RoundInfo> done) override;
  void heartbeat(const std::string& node_id, CallPolicy policy,
                 Done<rendezvous::RunStatus> done) override;
  void leave(const std::string& node_id, CallPolicy policy, StatusDone done) override;
  void reportFailure(const std::string& node_id, uint64_t round, FailureKind kind,
                     Done<uint64_t> done) override;
  void close(CallPolicy policy, StatusDone done) override;
  void publishMaster(const std::string& node_id, uint64_t round,
                     const rendezvous::MasterAddress& master, StatusDone done) override;
  void waitMaster(uint64_t round, Duration timeout, Done<rendezvous::MasterAddress> done) override;
  void kvSet(const std::string& key, const std::string& value, CallPolicy policy,
             StatusDone done) override;
  void kvWait(const std::vector<std::string>& keys, Duration timeout, CallPolicy policy,
              Done<std::vector<std::string>> done) override;
  void kvDeleteRange(const std::string& from, const std::string& to, CallPolicy policy,
                     StatusDone done) override;
  void watch(const std::string& node_id, ChangeSink on_change) override;
  void stopWatch() override;
  void cancelAll() override;
  Status explainUnavailable(const Status& status) const override;

 private:
  // What an unreachable endpoint most likely means for the transport (plaintext or TLS).
  Status explainTransport(const Status& status) const;

  GrpcServiceOptions options_;
  rendezvous::AsyncClient client_;
  std::unique_ptr<rendezvous::Watch> watch_;
  LoopAffinity loop_{"GrpcRendezvousService"};
};

}  // namespace ddprun::agent
