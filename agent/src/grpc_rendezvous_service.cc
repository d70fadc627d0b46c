#include "grpc_rendezvous_service.h"

namespace ddprun::agent {

namespace {
rendezvous::CallOptions toCallOptions(const CallPolicy& policy) {
  rendezvous::CallOptions o;
  o.rpc_timeout = policy.attempt_timeout;
  o.retry_timeout = policy.retry_for;
  return o;
}
}  // namespace

GrpcRendezvousService::GrpcRendezvousService(boost::asio::io_context& io,
                                             GrpcServiceOptions options)
    : options_(std::move(options)), client_(io, options_.client) {}

GrpcRendezvousService::~GrpcRendezvousService() {
  watch_.reset();
  client_.cancelAll();
}

void GrpcRendezvousService::join(const rendezvous::JoinRequest& req,
                                 Done<rendezvous::RoundInfo> done) {
  loop_.check();
  client_.join(req, std::move(done));
}

void GrpcRendezvousService::heartbeat(const std::string& node_id, CallPolicy policy,
                                      Done<rendezvous::RunStatus> done) {
  loop_.check();
  client_.heartbeat(options_.run_id, node_id, std::move(done), toCallOptions(policy));
}

void GrpcRendezvousService::leave(const std::string& node_id, CallPolicy policy, StatusDone done) {
  loop_.check();
  client_.leave(options_.run_id, node_id, std::move(done), toCallOptions(policy));
}

void GrpcRendezvousService::reportFailure(const std::string& node_id, uint64_t round,
                                          FailureKind kind, Done<uint64_t> done) {
  loop_.check();
  client_.reportFailure(options_.run_id, node_id, round, kind, std::move(done));
}

void GrpcRendezvousService::close(CallPolicy policy, StatusDone done) {
  loop_.check();
  client_.close(options_.run_id, std::move(done), toCallOptions(policy));
}

void GrpcRendezvousService::publishMaster(const std::string& node_id, uint64_t round,
                                          const rendezvous::MasterAddress& master,
                                          StatusDone done) {
  loop_.check();
  client_.publishMaster(options_.run_id, node_id, round, master, std::move(done));
}

void GrpcRendezvousService::waitMaster(uint64_t round, Duration timeout,
                                       Done<rendezvous::MasterAddress> done) {
  loop_.check();
  client_.waitMaster(options_.run_id, round, timeout, std::move(done));
}

void GrpcRendezvousService::kvSet(const std::string& key, const std::string& value,
                                  CallPolicy policy, StatusDone done) {
  loop_.check();
  client_.kvSet(options_.run_id, key, value, std::move(done), toCallOptions(policy));
}

void GrpcRendezvousService::kvWait(const std::vector<std::string>& keys, Duration timeout,
                                   CallPolicy policy, Done<std::vector<std::string>> done) {
  loop_.check();
  client_.kvWait(options_.run_id, keys, timeout, std::move(done), toCallOptions(policy));
}

void GrpcRendezvousService::kvDeleteRange(const std::string& from, const std::string& to,
                                          CallPolicy policy, StatusDone done) {
  loop_.check();
  client_.kvDeleteRange(
      options_.run_id, from, to,
      [done = std::move(done)](StatusOr<uint64_t> deleted) { done(deleted.status()); },
      toCallOptions(policy));
}

void GrpcRendezvousService::watch(const std::string& node_id, ChangeSink on_change) {
  loop_.check();
  watch_.reset();
  watch_ = client_.watch(options_.run_id, node_id, std::move(on_change));
}

void GrpcRendezvousService::stopWatch() { watch_.reset(); }

void GrpcRendezvousService::cancelAll() { client_.cancelAll(); }

Status GrpcRendezvousService::explainUnavailable(const Status& st) const {
  Status out = explainTransport(st);
  if (options_.hosting_note.empty()) return out;
  return Status(out.code(), out.message() + " (" + options_.hosting_note + ")");
}

Status GrpcRendezvousService::explainTransport(const Status& st) const {
  const std::string& endpoint = options_.client.endpoint;
  if (!options_.unreachable_note.empty() && options_.client.tls_root_cert_pem.empty()) {
    return Status(st.code(), st.message() + " (" + options_.unreachable_note + ")");
  }
  if (options_.client.tls_root_cert_pem.empty()) {
    return Status(st.code(), st.message() +
                                 " (this agent speaks plaintext gRPC: if the rendezvous at " +
                                 endpoint +
                                 " serves TLS, give --rdzv-conf tls_ca=<the CA certificate of "
                                 "its certificate>)");
  }
  const std::string host = endpoint.substr(0, endpoint.rfind(':'));
  return Status(st.code(), st.message() + " (this agent speaks TLS to " + endpoint +
                               ", trusting tls_ca=" + options_.tls_ca_file +
                               ": check that the rendezvous serves TLS with a certificate for " +
                               host + " signed by that CA)");
}

}  // namespace ddprun::agent
