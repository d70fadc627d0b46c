#include "client.h"

#include <grpcpp/grpcpp.h>

#include "ddprun/common/strings.h"

namespace ddprun::etcd {

namespace ep = etcdserverpb;

struct EtcdClient::Member {
  std::string endpoint;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<ep::KV::Stub> kv;
  std::unique_ptr<ep::Watch::Stub> watch;
  std::unique_ptr<ep::Lease::Stub> lease;
  std::unique_ptr<ep::Auth::Stub> auth;
  std::unique_ptr<ep::Maintenance::Stub> maintenance;
};

StatusOr<std::vector<std::string>> splitEtcdEndpoints(const std::string& list) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= list.size()) {
    size_t comma = list.find(',', start);
    if (comma == std::string::npos) comma = list.size();
    std::string item = trim(list.substr(start, comma - start));
    if (item.empty()) {
      return invalidArgument("the etcd endpoint list '" + list +
                             "' has an empty item; give HOST:PORT[,HOST:PORT...]");
    }
    out.push_back(item);
    start = comma + 1;
  }
  return out;
}

EtcdClient::EtcdClient(EtcdOptions options) : options_(std::move(options)) {
  std::shared_ptr<grpc::ChannelCredentials> creds;
  if (options_.tls) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options_.ca_pem;
    ssl.pem_cert_chain = options_.cert_pem;
    ssl.pem_private_key = options_.key_pem;
    creds = grpc::SslCredentials(ssl);
  } else {
    creds = grpc::InsecureChannelCredentials();
  }
  for (const std::string& endpoint : options_.endpoints) {
    auto m = std::make_unique<Member>();
    m->endpoint = endpoint;
    grpc::ChannelArguments args;
    // A member that went away is retried quickly once it is back (default backoff reaches 120 s).
    // Not GRPC_ARG_MIN_RECONNECT_BACKOFF_MS: it is also how long one connection attempt may take,
    // and a busy etcd needs more than a few hundred milliseconds to answer.
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    m->channel = grpc::CreateCustomChannel(endpoint, creds, args);
    m->kv = ep::KV::NewStub(m->channel);
    m->watch = ep::Watch::NewStub(m->channel);
    m->lease = ep::Lease::NewStub(m->channel);
    m->auth = ep::Auth::NewStub(m->channel);
    m->maintenance = ep::Maintenance::NewStub(m->channel);
    members_.push_back(std::move(m));
  }
}

EtcdClient::~EtcdClient() { shutdown(); }

std::string EtcdClient::membersText() const { return join(options_.endpoints, ", "); }

void EtcdClient::track(grpc::ClientContext* ctx) {
  MutexLock lock(mu_);
  active_.insert(ctx);
  if (shut_down_) ctx->TryCancel();
}

void EtcdClient::untrack(grpc::ClientContext* ctx) {
  MutexLock lock(mu_);
  active_.erase(ctx);
}

void EtcdClient::shutdown() {
  MutexLock lock(mu_);
  shut_down_ = true;
  for (grpc::ClientContext* ctx : active_) ctx->TryCancel();
}

void EtcdClient::rotate() { current_ = (current_.load() + 1) % members_.size(); }

void EtcdClient::prepare(grpc::ClientContext& ctx) {
  MutexLock lock(mu_);
  if (!token_.empty()) ctx.AddMetadata("token", token_);
}

Status EtcdClient::fromGrpc(const char* what, const Member& m, const grpc::Status& st) const {
  const std::string msg = st.error_message();
  if (msg.find("authentication failed") != std::string::npos) {
    return Status(StatusCode::kUnauthenticated,
                  "etcd at " + m.endpoint + " refused user '" + options_.username +
                      "': wrong user name or password (check --rdzv-conf username= and the "
                      "password in password_file=)");
  }
  if (msg.find("user name is empty") != std::string::npos ||
      msg.find("user name not found") != std::string::npos ||
      (st.error_code() == grpc::StatusCode::INVALID_ARGUMENT &&
       msg.find("token") != std::string::npos)) {
    return Status(StatusCode::kUnauthenticated,
                  "etcd at " + m.endpoint + " requires authentication (" + msg +
                      "): give --rdzv-conf username= and password_file=");
  }
  if (msg.find("permission denied") != std::string::npos) {
    return Status(StatusCode::kPermissionDenied,
                  "etcd at " + m.endpoint + " denied " + what + " to user '" + options_.username +
                      "' (" + msg + "): grant it read/write on the key prefix");
  }
  return Status(static_cast<StatusCode>(st.error_code()),
                std::string("etcd ") + what + " at " + m.endpoint + ": " + msg);
}

Status EtcdClient::authenticate(Member& m) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + options_.rpc_timeout);
  track(&ctx);
  ep::AuthenticateRequest req;
  req.set_name(options_.username);
  req.set_password(options_.password);
  ep::AuthenticateResponse resp;
  grpc::Status st = m.auth->Authenticate(&ctx, req, &resp);
  untrack(&ctx);
  if (!st.ok()) {
    if (st.error_code() == grpc::StatusCode::FAILED_PRECONDITION ||
        st.error_message().find("authentication is not enabled") != std::string::npos) {
      // Auth off on this cluster: no token needed.
      return Status::ok();
    }
    return fromGrpc("authentication", m, st);
  }
  MutexLock lock(mu_);
  token_ = resp.token();
  return Status::ok();
}

template <typename Call>
Status EtcdClient::onSomeMember(const char* what, Call call) {
  if (shut_down_) return Status(StatusCode::kCancelled, "etcd client shut down");
  const size_t n = members_.size();
  const size_t first = current_.load();
  std::vector<std::string> failures, too_old;
  for (size_t i = 0; i < n; ++i) {
    const size_t idx = (first + i) % n;
    Member& m = *members_[idx];
    bool need_token = false;
    {
      MutexLock lock(mu_);
      need_token = !options_.username.empty() && token_.empty();
    }
    if (need_token) {
      Status auth = authenticate(m);
      if (auth.code() == StatusCode::kUnavailable || auth.code() == StatusCode::kDeadlineExceeded) {
        failures.push_back(m.endpoint + " (" + auth.message() + ")");
        continue;
      }
      if (!auth.isOk()) return auth;
    }
    for (int attempt = 0; attempt < 2; ++attempt) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + options_.rpc_timeout);
      prepare(ctx);
      track(&ctx);
      grpc::Status st = call(m, ctx);
      untrack(&ctx);
      if (st.ok()) {
        current_ = idx;
        return Status::ok();
      }
      if (shut_down_) return Status(StatusCode::kCancelled, "etcd client shut down");
      const std::string msg = st.error_message();
      const bool token_expired = msg.find("invalid auth token") != std::string::npos ||
                                 (msg.find("token") != std::string::npos &&
                                  st.error_code() == grpc::StatusCode::UNAUTHENTICATED);
      if (token_expired && !options_.username.empty() && attempt == 0) {
        Status auth = authenticate(m);
        if (!auth.isOk()) return auth;
        continue;
      }
      if (st.error_code() == grpc::StatusCode::UNAVAILABLE ||
          st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
        // gRPC's words for a server that answered the HTTP/2 preface in HTTP/1.x: an etcd 2.x
        // (v2 API only), a TLS-only member, or not etcd. etcd's `GET /version` tells which.
        if (msg.find("http1.x") != std::string::npos) {
          if (auto v =
                  etcdVersionFromHttpReply(httpGetVersion(m.endpoint, std::chrono::seconds(1)));
              v && !v->empty() && (*v)[0] < '3') {
            too_old.push_back("etcd at " + m.endpoint + " is version " + *v);
          }
        }
        failures.push_back(m.endpoint + " (" + msg + ")");
        break;
      }
      return fromGrpc(what, m, st);
    }
  }
  if (!too_old.empty()) {
    // Not transient: waiting will not turn a v2-only etcd into a v3 one.
    return failedPrecondition(join(too_old, "; ") + ", which serves only the v2 API: " +
                              "--rdzv-backend=etcd-v3 needs etcd 3.0 or newer (its v3 gRPC " +
                              "API)" +
                              (failures.size() > too_old.size()
                                   ? "; the other members did not answer: " + join(failures, ", ")
                                   : std::string()));
  }
  std::string hint;
  if (!options_.tls) {
    hint =
        "; if the members serve TLS give --rdzv-conf protocol=https cacert=<their CA>, and if "
        "one answers on that port but not to v3 gRPC it may be an etcd older than 3.0 (v2 "
        "API only), which etcd-v3 cannot use";
  } else {
    hint = "; this agent speaks TLS trusting cacert=" + options_.ca_file +
           ": check that the members serve TLS with certificates signed by that CA" +
           (options_.cert_file.empty() ? std::string(", and give cert=/key= if they ask for a "
                                                     "client certificate")
                                       : std::string(""));
  }
  return unavailable(std::string("no etcd member answered ") + what + ": " + join(failures, ", ") +
                     hint);
}

Status EtcdClient::range(const ep::RangeRequest& req, ep::RangeResponse* out) {
  return onSomeMember(
      "range", [&](Member& m, grpc::ClientContext& ctx) { return m.kv->Range(&ctx, req, out); });
}

Status EtcdClient::txn(const ep::TxnRequest& req, ep::TxnResponse* out) {
  return onSomeMember(
      "txn", [&](Member& m, grpc::ClientContext& ctx) { return m.kv->Txn(&ctx, req, out); });
}

Status EtcdClient::put(const ep::PutRequest& req, ep::PutResponse* out) {
  return onSomeMember(
      "put", [&](Member& m, grpc::ClientContext& ctx) { return m.kv->Put(&ctx, req, out); });
}

Status EtcdClient::deleteRange(const ep::DeleteRangeRequest& req) {
  ep::DeleteRangeResponse resp;
  return onSomeMember("delete", [&](Member& m, grpc::ClientContext& ctx) {
    return m.kv->DeleteRange(&ctx, req, &resp);
  });
}

StatusOr<int64_t> EtcdClient::leaseGrant(int64_t ttl_seconds) {
  ep::LeaseGrantRequest req;
  req.set_ttl(ttl_seconds);
  ep::LeaseGrantResponse resp;
  Status st = onSomeMember("lease grant", [&](Member& m, grpc::ClientContext& ctx) {
    return m.lease->LeaseGrant(&ctx, req, &resp);
  });
  if (!st.isOk()) return st;
  if (!resp.error().empty()) return unavailable("etcd lease grant: " + resp.error());
  return resp.id();
}

Status EtcdClient::leaseRevoke(int64_t lease) {
  ep::LeaseRevokeRequest req;
  req.set_id(lease);
  ep::LeaseRevokeResponse resp;
  return onSomeMember("lease revoke", [&](Member& m, grpc::ClientContext& ctx) {
    return m.lease->LeaseRevoke(&ctx, req, &resp);
  });
}

StatusOr<int64_t> EtcdClient::leaseKeepAliveOnce(int64_t lease) {
  int64_t ttl = 0;
  Status st = onSomeMember("lease keep-alive", [&](Member& m, grpc::ClientContext& ctx) {
    auto stream = m.lease->LeaseKeepAlive(&ctx);
    ep::LeaseKeepAliveRequest req;
    req.set_id(lease);
    ep::LeaseKeepAliveResponse resp;
    if (!stream->Write(req) || !stream->Read(&resp)) {
      grpc::Status s = stream->Finish();
      return s.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "keep-alive stream ended") : s;
    }
    ttl = resp.ttl();
    stream->WritesDone();
    ctx.TryCancel();
    stream->Finish();
    return grpc::Status::OK;
  });
  if (!st.isOk()) return st;
  return ttl;
}

StatusOr<std::string> EtcdClient::version() {
  ep::StatusRequest req;
  ep::StatusResponse resp;
  Status st = onSomeMember("status", [&](Member& m, grpc::ClientContext& ctx) {
    return m.maintenance->Status(&ctx, req, &resp);
  });
  if (!st.isOk()) return st;
  return resp.version();
}

std::unique_ptr<grpc::ClientReaderWriter<ep::WatchRequest, ep::WatchResponse>>
EtcdClient::openWatch(grpc::ClientContext* ctx) {
  prepare(*ctx);
  track(ctx);
  Member& m = *members_[current_.load() % members_.size()];
  return m.watch->Watch(ctx);
}

}  // namespace ddprun::etcd
