#include "ddprun/rendezvous/client.h"

#include <grpcpp/alarm.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <set>
#include <thread>

#include "convert.h"
#include "ddprun/common/log.h"
#include "ddprun/rendezvous/v1/rendezvous.grpc.pb.h"

namespace ddprun::rendezvous {

namespace pb = ::ddprun::rendezvous::v1;
using convert::fromGrpc;
using convert::fromProto;
using convert::toProto;

struct Client::Impl {
  explicit Impl(ClientOptions opts) : options(std::move(opts)) {
    convert::routeGrpcLogs();
    std::shared_ptr<grpc::ChannelCredentials> creds;
    grpc::ChannelArguments args;
    if (!options.tls_root_cert_pem.empty()) {
      grpc::SslCredentialsOptions ssl;
      ssl.pem_root_certs = options.tls_root_cert_pem;
      creds = grpc::SslCredentials(ssl);
      if (!options.tls_server_name.empty()) {
        args.SetSslTargetNameOverride(options.tls_server_name);
      }
    } else {
      creds = grpc::InsecureChannelCredentials();
    }
    // Reconnect quickly after a server restart; the backoff of our own retries paces calls.
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    // Each client its own connection: a client's failure (or cancelAll) touches nobody else.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetMaxReceiveMessageSize(64 << 20);
    channel = grpc::CreateCustomChannel(options.endpoint, creds, args);
    stub = pb::Rendezvous::NewStub(channel);
  }

  // A ClientContext registered for cancelAll() while a call is in flight.
  class Call {
   public:
    Call(Impl* impl, Duration timeout, uint64_t epoch) : impl_(impl) {
      if (!impl->options.token.empty()) {
        ctx.AddMetadata("authorization", "Bearer " + impl->options.token);
      }
      if (timeout > Duration::zero()) {
        ctx.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::duration_cast<std::chrono::system_clock::duration>(timeout));
      }
      std::lock_guard<std::mutex> lock(impl->mu);
      if (impl->cancel_epoch != epoch || impl->closing)
        ctx.TryCancel();  // cancelAll() ran before we registered
      impl->calls.insert(&ctx);
    }
    ~Call() {
      std::lock_guard<std::mutex> lock(impl_->mu);
      impl_->calls.erase(&ctx);
    }
    grpc::ClientContext ctx;

   private:
    Impl* impl_;
  };

  // Runs `attempt(ctx)` until it returns something other than UNAVAILABLE or the retry budget
  // is spent, sleeping an exponential backoff in between (interruptible by cancelAll).
  template <typename Attempt>
  Status withRetries(Duration timeout, Attempt attempt) {
    const auto give_up = std::chrono::steady_clock::now() + options.retry_timeout;
    Duration backoff = options.initial_backoff;
    uint64_t epoch;
    {
      std::lock_guard<std::mutex> lock(mu);
      epoch = cancel_epoch;
    }
    for (;;) {
      Status st;
      {
        Call call(this, timeout, epoch);
        st = fromGrpc(attempt(call.ctx));
      }
      if (st.code() != StatusCode::kUnavailable) return st;
      if (std::chrono::steady_clock::now() + backoff > give_up) {
        return st.withContext("rendezvous at " + options.endpoint + " unreachable");
      }
      std::unique_lock<std::mutex> lock(mu);
      if (cv.wait_for(lock, backoff, [&] { return cancel_epoch != epoch || closing; })) {
        return Status(StatusCode::kCancelled, "cancelled");
      }
      backoff = std::min(backoff * 2, options.max_backoff);
    }
  }

  void cancelAll() {
    std::lock_guard<std::mutex> lock(mu);
    ++cancel_epoch;
    for (grpc::ClientContext* ctx : calls) ctx->TryCancel();
    cv.notify_all();
  }

  ClientOptions options;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<pb::Rendezvous::Stub> stub;
  std::mutex mu;
  std::condition_variable cv;
  std::set<grpc::ClientContext*> calls;    // guarded by mu
  std::vector<std::thread> async_threads;  // guarded by mu; joined by ~Client
  uint64_t cancel_epoch = 0;               // guarded by mu
  bool closing = false;                    // guarded by mu; set once ~Client starts
};

Client::Client(ClientOptions options) : impl_(std::make_shared<Impl>(std::move(options))) {}
Client::~Client() {
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->closing = true;  // async joins not yet in flight give up too
    threads.swap(impl_->async_threads);
  }
  impl_->cancelAll();
  for (auto& t : threads) t.join();
}

void Client::joinAsync(const JoinRequest& req, std::function<void(StatusOr<RoundInfo>)> done,
                       bool include_participants) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->async_threads.emplace_back([this, req, done = std::move(done), include_participants] {
    StatusOr<RoundInfo> result = join(req, include_participants);
    try {
      done(std::move(result));
    } catch (const std::exception& e) {
      logger("rendezvous")->error("joinAsync callback threw: {}", e.what());
    } catch (...) {
      logger("rendezvous")->error("joinAsync callback threw");
    }
  });
}

void Client::cancelAll() { impl_->cancelAll(); }

StatusOr<RoundInfo> Client::join(const JoinRequest& req, bool include_participants) {
  pb::JoinRequest request;
  toProto(req, include_participants, &request);
  pb::JoinResponse response;
  // The server answers join_timeout itself; our deadline only guards against a silent server.
  Status st = impl_->withRetries(
      req.join_timeout + std::chrono::seconds(10),
      [&](grpc::ClientContext& ctx) { return impl_->stub->Join(&ctx, request, &response); });
  if (!st.isOk()) return st;
  return fromProto(response);
}

StatusOr<RunStatus> Client::heartbeat(const std::string& run_id, const std::string& node_id) {
  pb::RunRef request;
  request.set_run_id(run_id);
  request.set_node_id(node_id);
  pb::HeartbeatResponse response;
  Status st = impl_->withRetries(impl_->options.rpc_timeout, [&](grpc::ClientContext& ctx) {
    return impl_->stub->Heartbeat(&ctx, request, &response);
  });
  if (!st.isOk()) return st;
  return fromProto(response.status());
}

Status Client::leave(const std::string& run_id, const std::string& node_id) {
  pb::RunRef request;
  request.set_run_id(run_id);
  request.set_node_id(node_id);
  pb::LeaveResponse response;
  return impl_->withRetries(impl_->options.rpc_timeout, [&](grpc::ClientContext& ctx) {
    return impl_->stub->Leave(&ctx, request, &response);
  });
}

StatusOr<uint64_t> Client::reportFailure(const std::string& run_id, const std::string& node_id,
                                         uint64_t round) {
  pb::ReportFailureRequest request;
  request.set_run_id(run_id);
  request.set_node_id(node_id);
  request.set_round(round);
  pb::ReportFailureResponse response;
  Status st = impl_->withRetries(impl_->options.rpc_timeout, [&](grpc::ClientContext& ctx) {
    return impl_->stub->ReportFailure(&ctx, request, &response);
  });
  if (!st.isOk()) return st;
  return response.next_round();
}

Status Client::close(const std::string& run_id) {
  pb::CloseRequest request;
  request.set_run_id(run_id);
  pb::CloseResponse response;
  return impl_->withRetries(impl_->options.rpc_timeout, [&](grpc::ClientContext& ctx) {
    return impl_->stub->Close(&ctx, request, &response);
  });
}

Status Client::publishMaster(const std::string& run_id, const std::string& node_id, uint64_t round,
                             const MasterAddress& master) {
  pb::PublishMasterRequest request;
  request.set_run_id(run_id);
  request.set_node_id(node_id);
  request.set_round(round);
  request.set_master_addr(master.addr);
  request.set_master_port(master.port);
  pb::PublishMasterResponse response;
  return impl_->withRetries(impl_->options.rpc_timeout, [&](grpc::ClientContext& ctx) {
    return impl_->stub->PublishMaster(&ctx, request, &response);
  });
}

StatusOr<MasterAddress> Client::waitMaster(const std::string& run_id, uint64_t round,
                                           Duration timeout) {
  pb::GetMasterRequest request;
  request.set_run_id(run_id);
  request.set_round(round);
  request.set_timeout_s(convert::toSeconds(timeout));
  pb::GetMasterResponse response;
  Status st = impl_->withRetries(timeout + std::chrono::seconds(10), [&](grpc::ClientContext& ctx) {
    return impl_->stub->GetMaster(&ctx, request, &response);
  });
  if (!st.isOk()) return st;
  return MasterAddress{response.master_addr(), response.master_port()};
}

Status Client::kvSet(const std::string& run_id, const std::string& key, const std::string& value) {
  pb::KvSetRequest request;
  request.set_run_id(run_id);
  request.set_key(key);
  request.set_value(value);
  pb::KvSetResponse response;
  return impl_->withRetries(impl_->options.rpc_timeout, [&](grpc::ClientContext& ctx) {
    return impl_->stub->KvSet(&ctx, request, &response);
  });
}

StatusOr<std::string> Client::kvGet(const std::string& run_id, const std::string& key) {
  pb::KvGetRequest request;
  request.set_run_id(run_id);
  request.set_key(key);
  pb::KvGetResponse response;
  Status st = impl_->withRetries(impl_->options.rpc_timeout, [&](grpc::ClientContext& ctx) {
    return impl_->stub->KvGet(&ctx, request, &response);
  });
  if (!st.isOk()) return st;
  return response.value();
}

StatusOr<int64_t> Client::kvAdd(const std::string& run_id, const std::string& key, int64_t delta) {
  pb::KvAddRequest request;
  request.set_run_id(run_id);
  request.set_key(key);
  request.set_delta(delta);
  pb::KvAddResponse response;
  // Not idempotent: retried only when the server is UNAVAILABLE (the add did not happen).
  Status st = impl_->withRetries(impl_->options.rpc_timeout, [&](grpc::ClientContext& ctx) {
    return impl_->stub->KvAdd(&ctx, request, &response);
  });
  if (!st.isOk()) return st;
  return response.value();
}

StatusOr<std::string> Client::kvCompareSet(const std::string& run_id, const std::string& key,
                                           const std::string& expected,
                                           const std::string& desired) {
  pb::KvCompareSetRequest request;
  request.set_run_id(run_id);
  request.set_key(key);
  request.set_expected(expected);
  request.set_desired(desired);
  pb::KvCompareSetResponse response;
  Status st = impl_->withRetries(impl_->options.rpc_timeout, [&](grpc::ClientContext& ctx) {
    return impl_->stub->KvCompareSet(&ctx, request, &response);
  });
  if (!st.isOk()) return st;
  return response.value();
}

StatusOr<std::vector<std::string>> Client::kvWait(const std::string& run_id,
                                                  const std::vector<std::string>& keys,
                                                  Duration timeout) {
  pb::KvWaitRequest request;
  request.set_run_id(run_id);
  for (const auto& k : keys) request.add_keys(k);
  request.set_timeout_s(convert::toSeconds(timeout));
  pb::KvWaitResponse response;
  Status st = impl_->withRetries(timeout + std::chrono::seconds(10), [&](grpc::ClientContext& ctx) {
    return impl_->stub->KvWait(&ctx, request, &response);
  });
  if (!st.isOk()) return st;
  return std::vector<std::string>(response.values().begin(), response.values().end());
}

StatusOr<bool> Client::kvDelete(const std::string& run_id, const std::string& key) {
  pb::KvDeleteRequest request;
  request.set_run_id(run_id);
  request.set_key(key);
  pb::KvDeleteResponse response;
  Status st = impl_->withRetries(impl_->options.rpc_timeout, [&](grpc::ClientContext& ctx) {
    return impl_->stub->KvDelete(&ctx, request, &response);
  });
  if (!st.isOk()) return st;
  return response.deleted();
}

namespace {

// A subscription on gRPC's callback API (no thread of its own): each attempt is a
// ClientReadReactor; when one ends unexpectedly a grpc::Alarm re-subscribes after a backoff.
class GrpcWatch final : public Watch {
 public:
  GrpcWatch(std::shared_ptr<Client::Impl> impl, std::string run_id, std::string node_id,
            Client::ChangeCallback on_change, Client::BreakCallback on_break)
      : impl_(std::move(impl)),
        on_change_(std::move(on_change)),
        on_break_(std::move(on_break)),
        backoff_(impl_->options.initial_backoff) {
    request_.set_run_id(std::move(run_id));
    request_.set_node_id(std::move(node_id));
    std::lock_guard<std::mutex> lock(mu_);
    subscribe();
  }

  ~GrpcWatch() override {
    std::unique_lock<std::mutex> lock(mu_);
    stop_ = true;
    if (stream_ != nullptr) stream_->ctx.TryCancel();
    if (alarm_) alarm_->Cancel();
    cv_.wait(lock, [&] { return !active_; });
  }

 private:
  struct Stream final : grpc::ClientReadReactor<pb::RoundChange> {
    explicit Stream(GrpcWatch* w) : watch(w) {}
    void OnReadDone(bool ok) override {
      if (!ok) return;  // the stream ended; OnDone follows
      RoundChange change = fromProto(msg);
      closed = change.kind == ChangeKind::kClosed;
      watch->deliver(change);
      StartRead(&msg);
    }
    void OnDone(const grpc::Status& status) override { watch->onStreamDone(this, status); }

    GrpcWatch* watch;
    grpc::ClientContext ctx;
    pb::RoundChange msg;
    bool closed = false;  // touched only by this stream's callbacks, which gRPC serialises
  };

  // Requires mu_.
  void subscribe() {
    auto* stream = new Stream(this);  // deleted in onStreamDone
    if (!impl_->options.token.empty()) {
      stream->ctx.AddMetadata("authorization", "Bearer " + impl_->options.token);
    }
    stream_ = stream;
    impl_->stub->async()->Watch(&stream->ctx, &request_, stream);
    stream->StartRead(&stream->msg);
    stream->StartCall();
  }

  void deliver(const RoundChange& change) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      backoff_ = impl_->options.initial_backoff;
    }
    try {
      on_change_(change);
    } catch (const std::exception& e) {
      logger("rendezvous")->error("watch callback threw: {}", e.what());
    } catch (...) {
      logger("rendezvous")->error("watch callback threw");
    }
  }

  void onStreamDone(Stream* stream, const grpc::Status& grpc_status) {
    const bool closed = stream->closed && grpc_status.ok();
    Status st = fromGrpc(grpc_status);
    {
      // Unpublish the stream before freeing it: ~GrpcWatch calls TryCancel on stream_ under
      // mu_, and must never reach a stream that is already deleted.
      std::lock_guard<std::mutex> lock(mu_);
      stream_ = nullptr;
    }
    delete stream;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_ || closed) return finish();
    }
    if (on_break_) {
      try {
        on_break_(st);
      } catch (const std::exception& e) {
        logger("rendezvous")->error("watch break callback threw: {}", e.what());
      } catch (...) {
        logger("rendezvous")->error("watch break callback threw");
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return finish();
    logger("rendezvous")
        ->debug("watch of run {} broke ({}); re-subscribing in {} ms", request_.run_id(),
                st.toString(),
                std::chrono::duration_cast<std::chrono::milliseconds>(backoff_).count());
    alarm_ = std::make_unique<grpc::Alarm>();
    alarm_->Set(std::chrono::system_clock::now() +
                    std::chrono::duration_cast<std::chrono::system_clock::duration>(backoff_),
                [this](bool fired) {
                  std::lock_guard<std::mutex> lock(mu_);
                  if (stop_ || !fired) return finish();
                  subscribe();
                });
    backoff_ = std::min(backoff_ * 2, impl_->options.max_backoff);
  }

  // Requires mu_: nothing of this watch is in flight any more.
  void finish() {
    active_ = false;
    cv_.notify_all();
  }

  std::shared_ptr<Client::Impl> impl_;
  pb::WatchRequest request_;
  Client::ChangeCallback on_change_;
  Client::BreakCallback on_break_;
  std::mutex mu_;
  std::condition_variable cv_;
  Duration backoff_;                    // guarded by mu_
  bool stop_ = false;                   // guarded by mu_
  bool active_ = true;                  // guarded by mu_: a stream or an alarm is pending
  Stream* stream_ = nullptr;            // guarded by mu_
  std::unique_ptr<grpc::Alarm> alarm_;  // guarded by mu_
};

}  // namespace

namespace {

class GrpcKeepAlive final : public KeepAlive {
 public:
  GrpcKeepAlive(std::shared_ptr<Client::Impl> impl, std::string run_id, std::string node_id,
                Duration interval, std::function<void(const Status&)> on_error)
      : impl_(std::move(impl)), interval_(interval), on_error_(std::move(on_error)) {
    request_.set_run_id(std::move(run_id));
    request_.set_node_id(std::move(node_id));
    thread_ = std::thread([this] { run(); });
  }

  ~GrpcKeepAlive() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      if (ctx_ != nullptr) ctx_->TryCancel();
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  void run() {
    for (;;) {
      grpc::ClientContext ctx;
      if (!impl_->options.token.empty()) {
        ctx.AddMetadata("authorization", "Bearer " + impl_->options.token);
      }
      ctx.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::duration_cast<std::chrono::system_clock::duration>(interval_));
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stop_) return;
        ctx_ = &ctx;
      }
      pb::HeartbeatResponse response;
      Status st = fromGrpc(impl_->stub->Heartbeat(&ctx, request_, &response));
      {
        std::lock_guard<std::mutex> lock(mu_);
        ctx_ = nullptr;
        if (stop_) return;
      }
      if (!st.isOk() && on_error_) {
        try {
          on_error_(st);
        } catch (...) {
          logger("rendezvous")->error("keep-alive error callback threw");
        }
      }
      std::unique_lock<std::mutex> lock(mu_);
      if (cv_.wait_for(lock, interval_, [&] { return stop_; })) return;
    }
  }

  std::shared_ptr<Client::Impl> impl_;
  Duration interval_;
  std::function<void(const Status&)> on_error_;
  pb::RunRef request_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;                   // guarded by mu_
  grpc::ClientContext* ctx_ = nullptr;  // guarded by mu_
  std::thread thread_;
};

}  // namespace

std::unique_ptr<KeepAlive> Client::keepAlive(const std::string& run_id, const std::string& node_id,
                                             Duration interval,
                                             std::function<void(const Status&)> on_error) {
  return std::make_unique<GrpcKeepAlive>(impl_, run_id, node_id, interval, std::move(on_error));
}

std::unique_ptr<Watch> Client::watch(const std::string& run_id, const std::string& node_id,
                                     ChangeCallback on_change, BreakCallback on_break) {
  return std::make_unique<GrpcWatch>(impl_, run_id, node_id, std::move(on_change),
                                     std::move(on_break));
}

}  // namespace ddprun::rendezvous
