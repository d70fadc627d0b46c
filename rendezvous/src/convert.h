// Conversions between the wire types (ddprun.rendezvous.v1) and the plain types of types.h, and
// between Status and grpc::Status. Private to the rendezvous library.
#pragma once

#include <grpc/support/log.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/support/status.h>

#include <mutex>

#include "ddprun/common/log.h"
#include "ddprun/common/status.h"
#include "ddprun/rendezvous/types.h"
#include "ddprun/rendezvous/v1/rendezvous.pb.h"

namespace ddprun::rendezvous::convert {

namespace pb = ::ddprun::rendezvous::v1;

// A server's TLS credentials from PEM text (the callers decide when TLS is on).
inline std::shared_ptr<grpc::ServerCredentials> serverTls(const std::string& cert_pem,
                                                          const std::string& key_pem) {
  grpc::SslServerCredentialsOptions ssl;
  ssl.pem_key_cert_pairs.push_back({key_pem, cert_pem});
  return grpc::SslServerCredentials(ssl);
}

// A channel's TLS credentials that trust the CA certificates in `root_pem`.
inline std::shared_ptr<grpc::ChannelCredentials> channelTls(const std::string& root_pem) {
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = root_pem;
  return grpc::SslCredentials(ssl);
}

inline grpc::Status toGrpc(const Status& s) {
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), s.message());
}
inline Status fromGrpc(const grpc::Status& s) {
  if (s.ok()) return Status::ok();
  return Status(static_cast<StatusCode>(s.error_code()), s.error_message());
}

// Sends gRPC's own log lines to our logger at debug level: every failure they describe reaches
// users as a Status with a message of ours, and a daemon's usage error stays one line.
inline void routeGrpcLogs() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Leaked on purpose: gRPC threads may still log while static destructors run.
    static auto* log = new std::shared_ptr<spdlog::logger>(logger("rendezvous"));
    gpr_set_log_function([](gpr_log_func_args* args) {
      (*log)->debug("grpc {}:{}: {}", args->file, args->line, args->message);
    });
  });
}

inline double toSeconds(Duration d) { return std::chrono::duration<double>(d).count(); }

inline void toProto(const RunConfig& c, pb::RunConfig* out) {
  out->set_min_nodes(c.min_nodes);
  out->set_max_nodes(c.max_nodes);
  out->set_last_call_timeout_s(toSeconds(c.last_call_timeout));
  out->set_heartbeat_interval_s(toSeconds(c.heartbeat_interval));
  out->set_heartbeat_misses(c.heartbeat_misses);
}
inline RunConfig fromProto(const pb::RunConfig& c) {
  RunConfig out;
  out.min_nodes = c.min_nodes();
  out.max_nodes = c.max_nodes();
  out.last_call_timeout = seconds(c.last_call_timeout_s());
  out.heartbeat_interval = seconds(c.heartbeat_interval_s());
  out.heartbeat_misses = c.heartbeat_misses();
  return out;
}

inline void toProto(const JoinRequest& r, bool include_participants, pb::JoinRequest* out) {
  out->set_run_id(r.run_id);
  out->set_node_id(r.node_id);
  out->set_address(r.address);
  out->set_local_world_size(r.local_world_size);
  toProto(r.config, out->mutable_config());
  out->set_join_timeout_s(toSeconds(r.join_timeout));
  out->set_include_participants(include_participants);
}
inline JoinRequest fromProto(const pb::JoinRequest& r) {
  JoinRequest out;
  out.run_id = r.run_id();
  out.node_id = r.node_id();
  out.address = r.address();
  out.local_world_size = r.local_world_size();
  out.config = fromProto(r.config());
  out.join_timeout = seconds(r.join_timeout_s());
  return out;
}

inline void toProto(const RoundInfo& i, bool include_participants, pb::JoinResponse* out) {
  out->set_round(i.round);
  out->set_node_id(i.node_id);
  out->set_group_rank(i.group_rank);
  out->set_group_world_size(i.group_world_size);
  out->set_base_rank(i.base_rank);
  out->set_world_size(i.world_size);
  out->set_master_addr(i.master_addr);
  out->set_master_port(i.master_port);
  if (include_participants && i.participants) {
    out->mutable_participants()->Reserve(static_cast<int>(i.participants->size()));
    for (const Participant& p : *i.participants) {
      pb::Participant* q = out->add_participants();
      q->set_node_id(p.node_id);
      q->set_address(p.address);
      q->set_local_world_size(p.local_world_size);
      q->set_group_rank(p.group_rank);
    }
  }
}
inline RoundInfo fromProto(const pb::JoinResponse& r) {
  RoundInfo out;
  out.round = r.round();
  out.node_id = r.node_id();
  out.group_rank = r.group_rank();
  out.group_world_size = r.group_world_size();
  out.base_rank = r.base_rank();
  out.world_size = r.world_size();
  out.master_addr = r.master_addr();
  out.master_port = r.master_port();
  auto participants = std::make_shared<std::vector<Participant>>();
  for (const pb::Participant& p : r.participants()) {
    participants->push_back({p.node_id(), p.address(), p.local_world_size(), p.group_rank()});
  }
  out.participants = std::move(participants);
  return out;
}

inline void toProto(const RunStatus& s, pb::RunStatus* out) {
  out->set_completed_round(s.completed_round);
  out->set_pending_round(s.pending_round);
  out->set_closed(s.closed);
  out->set_participants(s.participants);
  out->set_waiting(s.waiting);
  out->set_spares(s.spares);
}
inline RunStatus fromProto(const pb::RunStatus& s) {
  RunStatus out;
  out.completed_round = s.completed_round();
  out.pending_round = s.pending_round();
  out.closed = s.closed();
  out.participants = s.participants();
  out.waiting = s.waiting();
  out.spares = s.spares();
  return out;
}

inline void toProto(const RoundChange& c, pb::RoundChange* out) {
  out->set_kind(static_cast<pb::RoundChange::Kind>(static_cast<int>(c.kind)));
  out->set_reason(static_cast<pb::RoundChange::Reason>(static_cast<int>(c.reason)));
  out->set_node_id(c.node_id);
  out->set_round(c.round);
  toProto(c.status, out->mutable_status());
}
inline RoundChange fromProto(const pb::RoundChange& c) {
  RoundChange out;
  out.kind = static_cast<ChangeKind>(static_cast<int>(c.kind()));
  out.reason = static_cast<ChangeReason>(static_cast<int>(c.reason()));
  out.node_id = c.node_id();
  out.round = c.round();
  out.status = fromProto(c.status());
  return out;
}

}  // namespace ddprun::rendezvous::convert
