// EtcdRendezvousService: the public face of the LoopService (loop_service.h), which it forwards
// to; the LoopService is shared so that what the threads post to the loop can hold a weak_ptr to
// it.
#include "ddprun/etcd/rendezvous_service.h"

#include "loop_service.h"

namespace ddprun::etcd {

EtcdRendezvousService::EtcdRendezvousService(boost::asio::io_context& io,
                                             EtcdServiceOptions options)
    : service_(std::make_shared<LoopService>(io, std::move(options))) {
  service_->start();
}

EtcdRendezvousService::~EtcdRendezvousService() { service_->stop(); }

void EtcdRendezvousService::join(const rendezvous::JoinRequest& req,
                                 Done<rendezvous::RoundInfo> done) {
  service_->join(req, std::move(done));
}
void EtcdRendezvousService::heartbeat(const std::string& node_id, rendezvous::CallPolicy,
                                      Done<rendezvous::RunStatus> done) {
  service_->heartbeat(node_id, std::move(done));
}
void EtcdRendezvousService::leave(const std::string& node_id, rendezvous::CallPolicy policy,
                                  StatusDone done) {
  service_->leave(node_id, policy, std::move(done));
}
void EtcdRendezvousService::reportFailure(const std::string& node_id, uint64_t round,
                                          rendezvous::FailureKind kind, Done<uint64_t> done) {
  service_->reportFailure(node_id, round, kind, std::move(done));
}
void EtcdRendezvousService::close(rendezvous::CallPolicy policy, StatusDone done) {
  service_->close(policy, std::move(done));
}
void EtcdRendezvousService::publishMaster(const std::string& node_id, uint64_t round,
                                          const rendezvous::MasterAddress& master,
                                          StatusDone done) {
  service_->publishMaster(node_id, round, master, std::move(done));
}
void EtcdRendezvousService::waitMaster(uint64_t round, Duration timeout,
                                       Done<rendezvous::MasterAddress> done) {
  service_->waitMaster(round, timeout, std::move(done));
}
void EtcdRendezvousService::kvSet(const std::string& key, const std::string& value,
                                  rendezvous::CallPolicy policy, StatusDone done) {
  service_->kvSet(key, value, policy, std::move(done));
}
void EtcdRendezvousService::kvWait(const std::vector<std::string>& keys, Duration timeout,
                                   rendezvous::CallPolicy, Done<std::vector<std::string>> done) {
  service_->kvWait(keys, timeout, std::move(done));
}
void EtcdRendezvousService::kvDeleteRange(const std::string& from, const std::string& to,
                                          rendezvous::CallPolicy policy, StatusDone done) {
  service_->kvDeleteRange(from, to, policy, std::move(done));
}
std::pair<uint64_t, uint64_t> EtcdRendezvousService::mirroredKv() const {
  return service_->mirroredKv();
}
void EtcdRendezvousService::watch(const std::string&, ChangeSink on_change) {
  service_->watch(std::move(on_change));
}
void EtcdRendezvousService::stopWatch() { service_->stopWatch(); }
void EtcdRendezvousService::cancelAll() { service_->cancelAll(); }
Status EtcdRendezvousService::explainUnavailable(const Status& status) const {
  return service_->explain(status);
}
const std::string& EtcdRendezvousService::keyPrefix() const { return service_->prefix(); }

}  // namespace ddprun::etcd
