#include "ddprun/rendezvous/async_client.h"

#include <grpcpp/alarm.h>
#include <grpcpp/grpcpp.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <set>

#include "convert.h"
#include "ddprun/common/log.h"
#include "ddprun/common/strings.h"
#include "ddprun/common/thread_annotations.h"
#include "ddprun/rendezvous/v1/rendezvous.grpc.pb.h"

namespace ddprun::rendezvous {

namespace pb = ::ddprun::rendezvous::v1;
using convert::fromGrpc;
using convert::fromProto;
using convert::toProto;
using tcp = boost::asio::ip::tcp;

namespace {

// What cancelAll() and the destructor reach on the io thread: a call waiting on an Asio timer
// (backoff) or on a TCP probe.
class IoWait {
 public:
  virtual ~IoWait() = default;
  virtual void cancelIo() = 0;
};

Status cancelledStatus() { return Status(StatusCode::kCancelled, "cancelled"); }

// Runs a user callback; no exception crosses the Asio handler.
template <typename F>
void guarded(const char* what, F&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    logger("rendezvous")->error("{} callback threw: {}", what, e.what());
  } catch (...) {
    logger("rendezvous")->error("{} callback threw", what);
  }
}

}  // namespace

struct AsyncClient::Impl : std::enable_shared_from_this<AsyncClient::Impl> {
  using AttemptDone = std::function<void(grpc::Status)>;
  // Starts one attempt of a unary call on the stub's callback API.
  template <typename Resp>
  using Start =
      std::function<void(pb::Rendezvous::Stub*, grpc::ClientContext*, Resp*, AttemptDone)>;
  // Converts the final status and response into the user's result and calls the user back.
  template <typename Resp>
  using Finish = std::function<void(const Status&, Resp&)>;

  Impl(boost::asio::io_context& io_context, ClientOptions opts)
      : io(io_context), options(std::move(opts)), tls(!options.tls_root_cert_pem.empty()) {
    convert::routeGrpcLogs();
    std::shared_ptr<grpc::ChannelCredentials> creds;
    grpc::ChannelArguments args;
    if (tls) {
      creds = convert::channelTls(options.tls_root_cert_pem);
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

  // The one generic unary call: defined below.
  template <typename Resp>
  void call(Start<Resp> start, Finish<Resp> finish, Duration attempt_timeout, const CallOptions& o);

  void addToken(grpc::ClientContext& ctx) const {
    if (!options.token.empty()) ctx.AddMetadata("authorization", "Bearer " + options.token);
  }

  bool cancelled(uint64_t call_epoch) {
    ddprun::MutexLock lock(mu);
    return closed || epoch != call_epoch;
  }

  // Runs `fn` (which calls the user back) unless the client is gone; on the io thread only.
  template <typename F>
  void callBack(const char* what, F&& fn) {
    ddprun::RecursiveMutexLock guard(callback_mu);
    {
      ddprun::MutexLock lock(mu);
      if (closed) return;
    }
    guarded(what, std::forward<F>(fn));
  }

  // Cancels every timer and probe of calls started before now (posted to the io thread).
  void cancelIoWaits() {
    boost::asio::post(io, [self = shared_from_this()] {
      std::vector<std::shared_ptr<IoWait>> waits(self->io_waits.begin(), self->io_waits.end());
      for (auto& w : waits) w->cancelIo();
    });
  }

  void cancelAll() {
    {
      ddprun::MutexLock lock(mu);
      ++epoch;
      for (grpc::ClientContext* ctx : contexts) ctx->TryCancel();
    }
    cancelIoWaits();
  }

  boost::asio::io_context& io;
  ClientOptions options;
  const bool tls;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<pb::Rendezvous::Stub> stub;

  // User callbacks run holding callback_mu, so the destructor (which takes it to set `closed`)
  // returns only once none runs; recursive, so a callback may destroy the client.
  ddprun::RecursiveMutex callback_mu;
  ddprun::Mutex mu;
  bool closed GUARDED_BY(mu) = false;                      // the AsyncClient was destroyed
  uint64_t epoch GUARDED_BY(mu) = 0;                       // bumped by cancelAll()
  std::set<grpc::ClientContext*> contexts GUARDED_BY(mu);  // attempts in flight
  // Attempts whose gRPC completion has not yet handed its call over to `io`. The destructor waits
  // for them: a completion of a cancelled call comes on a gRPC thread after TryCancel, and would
  // otherwise post to `io` after the client (and perhaps `io`, which need outlive only the client)
  // was gone.
  size_t completing GUARDED_BY(mu) = 0;
  std::condition_variable_any completed;

  // io thread only.
  std::set<std::shared_ptr<IoWait>> io_waits;  // calls in a backoff or a TCP probe
  bool listener_seen = false;                  // TLS: the endpoint accepted a connection once
  bool logged_wait = false;
  // Since when calls have been retried for want of the server (none since: unset), and the last
  // warning about it. The io thread's.
  std::optional<std::chrono::steady_clock::time_point> unreachable_since;
  std::chrono::steady_clock::time_point unreachable_noticed{};
};

namespace {

// One logical unary call: attempts, backoff and (TLS) the listener probe, all driven from the io
// thread; gRPC's completion callback only posts back into it.
template <typename Resp>
class UnaryCall final : public IoWait, public std::enable_shared_from_this<UnaryCall<Resp>> {
 public:
  using Impl = AsyncClient::Impl;

  UnaryCall(std::shared_ptr<Impl> impl, Impl::Start<Resp> start, Impl::Finish<Resp> finish,
            Duration attempt_timeout, Duration retry_timeout, uint64_t epoch)
      : impl_(std::move(impl)),
        start_(std::move(start)),
        finish_(std::move(finish)),
        attempt_timeout_(attempt_timeout),
        give_up_(std::chrono::steady_clock::now() + retry_timeout),
        backoff_(impl_->options.initial_backoff),
        epoch_(epoch) {}

  // io thread from here on.
  void attempt() {
    if (impl_->cancelled(epoch_)) return complete(cancelledStatus());
    if (impl_->tls && !impl_->listener_seen) return probe();
    ctx_ = std::make_unique<grpc::ClientContext>();
    impl_->addToken(*ctx_);
    if (attempt_timeout_ > Duration::zero()) {
      ctx_->set_deadline(
          std::chrono::system_clock::now() +
          std::chrono::duration_cast<std::chrono::system_clock::duration>(attempt_timeout_));
    }
    bool cancelled = false;
    {
      ddprun::MutexLock lock(impl_->mu);
      cancelled = impl_->closed || impl_->epoch != epoch_;
      if (!cancelled) {
        impl_->contexts.insert(ctx_.get());
        ++impl_->completing;
      }
    }
    if (cancelled) return complete(cancelledStatus());
    response_ = Resp();
    auto self = this->shared_from_this();
    // The completion only posts back to the io thread, handing over its reference: the call (and
    // with the last one the channel) is never destroyed on a gRPC thread.
    start_(impl_->stub.get(), ctx_.get(), &response_, [self](grpc::Status status) mutable {
      const std::shared_ptr<Impl> impl = self->impl_;
      {
        ddprun::MutexLock lock(impl->mu);
        impl->contexts.erase(self->ctx_.get());
      }
      boost::asio::post(impl->io, [self = std::move(self), status = std::move(status)] {
        self->onAttemptDone(status);
      });
      {
        ddprun::MutexLock lock(impl->mu);
        --impl->completing;
      }
      impl->completed.notify_all();
    });
  }

  void cancelIo() override {
    if (timer_) timer_->cancel();
    if (resolver_) resolver_->cancel();
    if (socket_) {
      boost::system::error_code ignored;
      socket_->close(ignored);
    }
  }

 private:
  void onAttemptDone(const grpc::Status& grpc_status) {
    Status st = fromGrpc(grpc_status);
    if (st.code() == StatusCode::kUnavailable) return retryLater(st);
    complete(st);
  }

  void retryLater(const Status& st) {
    if (impl_->cancelled(epoch_)) return complete(cancelledStatus());
    const auto now = std::chrono::steady_clock::now();
    if (now + backoff_ > give_up_) {
      return complete(st.withContext("rendezvous at " + impl_->options.endpoint + " unreachable"));
    }
    noticeUnreachable(st, now);
    timer_.emplace(impl_->io);
    timer_->expires_after(backoff_);
    backoff_ = std::min(backoff_ * 2, impl_->options.max_backoff);
    auto self = this->shared_from_this();
    impl_->io_waits.insert(self);
    timer_->async_wait([self](const boost::system::error_code&) {
      self->impl_->io_waits.erase(self);
      self->timer_.reset();
      self->attempt();  // sees a cancellation first
    });
  }

  // gRPC 1.51 quirk (see async_client.h): over TLS, wait until the endpoint accepts a TCP
  // connection before the first attempt.
  void probe() {
    const std::string& endpoint = impl_->options.endpoint;
    const auto colon = endpoint.rfind(':');
    if (colon == std::string::npos) {
      return complete(invalidArgument("rendezvous endpoint '" + endpoint + "' is not HOST:PORT"));
    }
    std::string host = endpoint.substr(0, colon);
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
      host = host.substr(1, host.size() - 2);
    }
    auto self = this->shared_from_this();
    impl_->io_waits.insert(self);
    resolver_.emplace(impl_->io);
    resolver_->async_resolve(
        host, endpoint.substr(colon + 1),
        [self](const boost::system::error_code& ec, tcp::resolver::results_type results) {
          self->resolver_.reset();
          if (ec) return self->probed(false);
          self->socket_.emplace(self->impl_->io);
          self->timer_.emplace(self->impl_->io);
          self->timer_->expires_after(std::chrono::seconds(1));
          self->timer_->async_wait([self](const boost::system::error_code& tec) {
            if (!tec && self->socket_) {
              boost::system::error_code ignored;
              self->socket_->close(ignored);
            }
          });
          boost::asio::async_connect(
              *self->socket_, results,
              [self](const boost::system::error_code& cec, const tcp::endpoint&) {
                self->timer_->cancel();
                self->timer_.reset();
                boost::system::error_code ignored;
                self->socket_->close(ignored);
                self->socket_.reset();
                self->probed(!cec);
              });
        });
  }

  void probed(bool accepted) {
    impl_->io_waits.erase(this->shared_from_this());
    if (accepted) {
      impl_->listener_seen = true;
      return attempt();
    }
    if (!impl_->logged_wait) {
      impl_->logged_wait = true;
      logger("rendezvous")
          ->info("waiting for the rendezvous at {} to accept connections", impl_->options.endpoint);
    }
    retryLater(unavailable("nothing accepted a TCP connection"));
  }

  // One warning every unreachable_notice_every while calls wait for the server, so a node that
  // cannot reach it says so, not only at its join_timeout.
  void noticeUnreachable(const Status& st, std::chrono::steady_clock::time_point now) {
    if (!impl_->unreachable_since) impl_->unreachable_since = now;
    const Duration every = impl_->options.unreachable_notice_every;
    if (now - *impl_->unreachable_since < every || now - impl_->unreachable_noticed < every) return;
    impl_->unreachable_noticed = now;
    logger("rendezvous")
        ->warn(
            "cannot reach the rendezvous at {} for {:.0f} s ({}); trying again for up to {:.0f} "
            "s more",
            impl_->options.endpoint, convert::toSeconds(now - *impl_->unreachable_since),
            quotePeerText(st.message()), convert::toSeconds(give_up_ - now));
  }

  void complete(const Status& st) {
    if (st.code() != StatusCode::kUnavailable) impl_->unreachable_since.reset();
    impl_->callBack("rendezvous call", [&] { finish_(st, response_); });
  }

  std::shared_ptr<Impl> impl_;
  Impl::Start<Resp> start_;  // holds the request
  Impl::Finish<Resp> finish_;
  const Duration attempt_timeout_;
  const std::chrono::steady_clock::time_point give_up_;
  Duration backoff_;
  const uint64_t epoch_;
  std::unique_ptr<grpc::ClientContext> ctx_;  // of the attempt in flight
  Resp response_;
  std::optional<boost::asio::steady_timer> timer_;  // backoff, or the probe's connect timeout
  std::optional<tcp::resolver> resolver_;
  std::optional<tcp::socket> socket_;
};

}  // namespace

template <typename Resp>
void AsyncClient::Impl::call(Start<Resp> start, Finish<Resp> finish, Duration attempt_timeout,
                             const CallOptions& o) {
  uint64_t call_epoch;
  {
    ddprun::MutexLock lock(mu);
    call_epoch = epoch;
  }
  auto c = std::make_shared<UnaryCall<Resp>>(
      shared_from_this(), std::move(start), std::move(finish),
      o.rpc_timeout.value_or(attempt_timeout), o.retry_timeout.value_or(options.retry_timeout),
      call_epoch);
  boost::asio::post(io, [c] { c->attempt(); });
}

AsyncClient::AsyncClient(boost::asio::io_context& io, ClientOptions options)
    : impl_(std::make_shared<Impl>(io, std::move(options))) {}

AsyncClient::~AsyncClient() {
  {
    ddprun::RecursiveMutexLock guard(impl_->callback_mu);  // no callback runs now
    ddprun::MutexLock lock(impl_->mu);
    impl_->closed = true;
    for (grpc::ClientContext* ctx : impl_->contexts) ctx->TryCancel();
  }
  impl_->cancelIoWaits();
  // The cancelled attempts' completions come promptly; none posts to `io` once this returns.
  ddprun::MutexLock lock(impl_->mu);
  while (impl_->completing > 0) impl_->completed.wait(impl_->mu);
}

void AsyncClient::cancelAll() { impl_->cancelAll(); }

namespace {

// The server answers its own waits (join_timeout, a wait's timeout); the attempt deadline only
// guards against a silent server.
constexpr Duration kServerWaitSlack = std::chrono::seconds(10);

// Adapts a callback without a value to Finish.
template <typename Resp>
AsyncClient::Impl::Finish<Resp> statusOnly(AsyncClient::StatusDone done) {
  return [done = std::move(done)](const Status& st, Resp&) { done(st); };
}

// Adapts a Done<T> to Finish: `get` reads the value from the response.
template <typename Resp, typename T, typename Get>
AsyncClient::Impl::Finish<Resp> withValue(AsyncClient::Done<T> done, Get get) {
  return [done = std::move(done), get](const Status& st, Resp& resp) {
    if (!st.isOk()) return done(st);
    done(StatusOr<T>(get(resp)));
  };
}

}  // namespace

using Stub = pb::Rendezvous::Stub;
using AttemptDone = AsyncClient::Impl::AttemptDone;

void AsyncClient::join(const JoinRequest& req, Done<RoundInfo> done, CallOptions o,
                       bool include_participants) {
  pb::JoinRequest request;
  toProto(req, include_participants, &request);
  impl_->call<pb::JoinResponse>(
      [request](Stub* s, grpc::ClientContext* c, pb::JoinResponse* r, AttemptDone d) {
        s->async()->Join(c, &request, r, std::move(d));
      },
      withValue<pb::JoinResponse, RoundInfo>(std::move(done),
                                             [](pb::JoinResponse& r) { return fromProto(r); }),
      req.join_timeout + kServerWaitSlack, o);
}

void AsyncClient::heartbeat(const std::string& run, const std::string& node, Done<RunStatus> done,
                            CallOptions o) {
  pb::RunRef request;
  request.set_run_id(run);
  request.set_node_id(node);
  impl_->call<pb::HeartbeatResponse>(
      [request](Stub* s, grpc::ClientContext* c, pb::HeartbeatResponse* r, AttemptDone d) {
        s->async()->Heartbeat(c, &request, r, std::move(d));
      },
      withValue<pb::HeartbeatResponse, RunStatus>(
          std::move(done), [](pb::HeartbeatResponse& r) { return fromProto(r.status()); }),
      impl_->options.rpc_timeout, o);
}

void AsyncClient::leave(const std::string& run, const std::string& node, StatusDone done,
                        CallOptions o) {
  pb::RunRef request;
  request.set_run_id(run);
  request.set_node_id(node);
  impl_->call<pb::LeaveResponse>(
      [request](Stub* s, grpc::ClientContext* c, pb::LeaveResponse* r, AttemptDone d) {
        s->async()->Leave(c, &request, r, std::move(d));
      },
      statusOnly<pb::LeaveResponse>(std::move(done)), impl_->options.rpc_timeout, o);
}

void AsyncClient::reportFailure(const std::string& run, const std::string& node, uint64_t round,
                                FailureKind kind, Done<uint64_t> done, CallOptions o) {
  pb::ReportFailureRequest request;
  request.set_run_id(run);
  request.set_node_id(node);
  request.set_round(round);
  request.set_recovery_failed(kind == FailureKind::kRecovery);
  impl_->call<pb::ReportFailureResponse>(
      [request](Stub* s, grpc::ClientContext* c, pb::ReportFailureResponse* r, AttemptDone d) {
        s->async()->ReportFailure(c, &request, r, std::move(d));
      },
      withValue<pb::ReportFailureResponse, uint64_t>(
          std::move(done), [](pb::ReportFailureResponse& r) { return r.next_round(); }),
      impl_->options.rpc_timeout, o);
}

void AsyncClient::close(const std::string& run, StatusDone done, CallOptions o) {
  pb::CloseRequest request;
  request.set_run_id(run);
  impl_->call<pb::CloseResponse>(
      [request](Stub* s, grpc::ClientContext* c, pb::CloseResponse* r, AttemptDone d) {
        s->async()->Close(c, &request, r, std::move(d));
      },
      statusOnly<pb::CloseResponse>(std::move(done)), impl_->options.rpc_timeout, o);
}

void AsyncClient::publishMaster(const std::string& run, const std::string& node, uint64_t round,
                                const MasterAddress& m, StatusDone done, CallOptions o) {
  pb::PublishMasterRequest request;
  request.set_run_id(run);
  request.set_node_id(node);
  request.set_round(round);
  request.set_master_addr(m.addr);
  request.set_master_port(m.port);
  impl_->call<pb::PublishMasterResponse>(
      [request](Stub* s, grpc::ClientContext* c, pb::PublishMasterResponse* r, AttemptDone d) {
        s->async()->PublishMaster(c, &request, r, std::move(d));
      },
      statusOnly<pb::PublishMasterResponse>(std::move(done)), impl_->options.rpc_timeout, o);
}

void AsyncClient::waitMaster(const std::string& run, uint64_t round, Duration timeout,
                             Done<MasterAddress> done, CallOptions o) {
  pb::GetMasterRequest request;
  request.set_run_id(run);
  request.set_round(round);
  request.set_timeout_s(convert::toSeconds(timeout));
  impl_->call<pb::GetMasterResponse>(
      [request](Stub* s, grpc::ClientContext* c, pb::GetMasterResponse* r, AttemptDone d) {
        s->async()->GetMaster(c, &request, r, std::move(d));
      },
      withValue<pb::GetMasterResponse, MasterAddress>(
          std::move(done),
          [](pb::GetMasterResponse& r) {
            return MasterAddress{r.master_addr(), r.master_port()};
          }),
      timeout + kServerWaitSlack, o);
}

void AsyncClient::kvSet(const std::string& run, const std::string& key, const std::string& value,
                        StatusDone done, CallOptions o) {
  pb::KvSetRequest request;
  request.set_run_id(run);
  request.set_key(key);
  request.set_value(value);
  impl_->call<pb::KvSetResponse>(
      [request](Stub* s, grpc::ClientContext* c, pb::KvSetResponse* r, AttemptDone d) {
        s->async()->KvSet(c, &request, r, std::move(d));
      },
      statusOnly<pb::KvSetResponse>(std::move(done)), impl_->options.rpc_timeout, o);
}

void AsyncClient::kvGet(const std::string& run, const std::string& key, Done<std::string> done,
                        CallOptions o) {
  pb::KvGetRequest request;
  request.set_run_id(run);
  request.set_key(key);
  impl_->call<pb::KvGetResponse>(
      [request](Stub* s, grpc::ClientContext* c, pb::KvGetResponse* r, AttemptDone d) {
        s->async()->KvGet(c, &request, r, std::move(d));
      },
      withValue<pb::KvGetResponse, std::string>(
          std::move(done), [](pb::KvGetResponse& r) { return std::move(*r.mutable_value()); }),
      impl_->options.rpc_timeout, o);
}

void AsyncClient::kvAdd(const std::string& run, const std::string& key, int64_t delta,
                        Done<int64_t> done, CallOptions o) {
  pb::KvAddRequest request;
  request.set_run_id(run);
  request.set_key(key);
  request.set_delta(delta);
  impl_->call<pb::KvAddResponse>(
      [request](Stub* s, grpc::ClientContext* c, pb::KvAddResponse* r, AttemptDone d) {
        s->async()->KvAdd(c, &request, r, std::move(d));
      },
      withValue<pb::KvAddResponse, int64_t>(std::move(done),
                                            [](pb::KvAddResponse& r) { return r.value(); }),
      impl_->options.rpc_timeout, o);
}

void AsyncClient::kvCompareSet(const std::string& run, const std::string& key,
                               const std::string& expected, const std::string& desired,
                               Done<std::string> done, CallOptions o) {
  pb::KvCompareSetRequest request;
  request.set_run_id(run);
  request.set_key(key);
  request.set_expected(expected);
  request.set_desired(desired);
  impl_->call<pb::KvCompareSetResponse>(
      [request](Stub* s, grpc::ClientContext* c, pb::KvCompareSetResponse* r, AttemptDone d) {
        s->async()->KvCompareSet(c, &request, r, std::move(d));
      },
      withValue<pb::KvCompareSetResponse, std::string>(
          std::move(done),
          [](pb::KvCompareSetResponse& r) { return std::move(*r.mutable_value()); }),
      impl_->options.rpc_timeout, o);
}

void AsyncClient::kvWait(const std::string& run, const std::vector<std::string>& keys,
                         Duration timeout, Done<std::vector<std::string>> done, CallOptions o) {
  pb::KvWaitRequest request;
  request.set_run_id(run);
  for (const auto& k : keys) request.add_keys(k);
  request.set_timeout_s(convert::toSeconds(timeout));
  impl_->call<pb::KvWaitResponse>(
      [request](Stub* s, grpc::ClientContext* c, pb::KvWaitResponse* r, AttemptDone d) {
        s->async()->KvWait(c, &request, r, std::move(d));
      },
      withValue<pb::KvWaitResponse, std::vector<std::string>>(
          std::move(done),
          [](pb::KvWaitResponse& r) {
            return std::vector<std::string>(r.values().begin(), r.values().end());
          }),
      timeout + kServerWaitSlack, o);
}

void AsyncClient::kvDelete(const std::string& run, const std::string& key, Done<bool> done,
                           CallOptions o) {
  pb::KvDeleteRequest request;
  request.set_run_id(run);
  request.set_key(key);
  impl_->call<pb::KvDeleteResponse>(
      [request](Stub* s, grpc::ClientContext* c, pb::KvDeleteResponse* r, AttemptDone d) {
        s->async()->KvDelete(c, &request, r, std::move(d));
      },
      withValue<pb::KvDeleteResponse, bool>(std::move(done),
                                            [](pb::KvDeleteResponse& r) { return r.deleted(); }),
      impl_->options.rpc_timeout, o);
}

void AsyncClient::kvDeleteRange(const std::string& run, const std::string& from,
                                const std::string& to, Done<uint64_t> done, CallOptions o) {
  // An empty range end would be the single-key delete of `from`. (Answered on `io`, as any call.)
  if (to.empty() || !(from < to)) {
    boost::asio::post(impl_->io, [done = std::move(done)] {
      done(invalidArgument("the range of keys to delete is empty"));
    });
    return;
  }
  pb::KvDeleteRequest request;
  request.set_run_id(run);
  request.set_key(from);
  request.set_range_end(to);
  impl_->call<pb::KvDeleteResponse>(
      [request](Stub* s, grpc::ClientContext* c, pb::KvDeleteResponse* r, AttemptDone d) {
        s->async()->KvDelete(c, &request, r, std::move(d));
      },
      [done = std::move(done), endpoint = impl_->options.endpoint](const Status& st,
                                                                   pb::KvDeleteResponse& r) {
        if (!st.isOk()) return done(st);
        if (!r.ranged()) {  // it read the range as one key, `from`, and deleted that alone
          return done(Status(StatusCode::kUnimplemented,
                             "the rendezvous server at " + endpoint +
                                 " predates range deletes (KvDelete's range_end): past rounds' "
                                 "keys stay until the run closes; run the same ddprun release "
                                 "there as on the nodes"));
        }
        done(StatusOr<uint64_t>(r.deleted_keys()));
      },
      impl_->options.rpc_timeout, o);
}

namespace {

// Where a watch delivers: posted to the client's io thread; `alive` is cleared (under the
// recursive mutex the callbacks run under) by ~GrpcWatch, so none runs after it returned.
struct WatchSink {
  ddprun::RecursiveMutex mu;
  bool alive GUARDED_BY(mu) = true;
  AsyncClient::ChangeCallback on_change;
  AsyncClient::BreakCallback on_break;
};

// A subscription on gRPC's callback API (no thread of its own): each attempt is a
// ClientReadReactor; when one ends unexpectedly a grpc::Alarm re-subscribes after a backoff.
class GrpcWatch final : public Watch {
 public:
  GrpcWatch(std::shared_ptr<AsyncClient::Impl> impl, std::string run_id, std::string node_id,
            AsyncClient::ChangeCallback on_change, AsyncClient::BreakCallback on_break)
      : impl_(std::move(impl)),
        sink_(std::make_shared<WatchSink>()),
        backoff_(impl_->options.initial_backoff) {
    sink_->on_change = std::move(on_change);
    sink_->on_break = std::move(on_break);
    request_.set_run_id(std::move(run_id));
    request_.set_node_id(std::move(node_id));
    ddprun::MutexLock lock(mu_);
    subscribe();
  }

  ~GrpcWatch() override {
    {
      ddprun::RecursiveMutexLock guard(sink_->mu);
      sink_->alive = false;
    }
    ddprun::MutexLock lock(mu_);
    stop_ = true;
    if (stream_ != nullptr) stream_->ctx.TryCancel();
    if (alarm_) alarm_->Cancel();
    while (active_) cv_.wait(mu_);
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

  void subscribe() REQUIRES(mu_) {
    auto* stream = new Stream(this);  // deleted in onStreamDone
    impl_->addToken(stream->ctx);
    stream_ = stream;
    impl_->stub->async()->Watch(&stream->ctx, &request_, stream);
    stream->StartRead(&stream->msg);
    stream->StartCall();
  }

  // Posts `fn(sink)` to the io thread, where it runs unless the watch is gone.
  template <typename F>
  void post(F fn) {
    boost::asio::post(impl_->io, [sink = sink_, fn = std::move(fn)] {
      ddprun::RecursiveMutexLock guard(sink->mu);
      if (!sink->alive) return;
      guarded("watch", [&] { fn(*sink); });
    });
  }

  void deliver(const RoundChange& change) {
    {
      ddprun::MutexLock lock(mu_);
      backoff_ = impl_->options.initial_backoff;
    }
    post([change](WatchSink& sink) { sink.on_change(change); });
  }

  void onStreamDone(Stream* stream, const grpc::Status& grpc_status) {
    const bool closed = stream->closed && grpc_status.ok();
    Status st = fromGrpc(grpc_status);
    {
      // Unpublish the stream before freeing it: ~GrpcWatch calls TryCancel on stream_ under
      // mu_, and must never reach a stream that is already deleted.
      ddprun::MutexLock lock(mu_);
      stream_ = nullptr;
    }
    delete stream;
    ddprun::MutexLock lock(mu_);
    if (stop_ || closed) return finish();
    if (sink_->on_break) {
      post([st](WatchSink& sink) { sink.on_break(st); });
    }
    logger("rendezvous")
        ->debug("watch of run {} broke ({}); re-subscribing in {} ms", request_.run_id(),
                st.toString(),
                std::chrono::duration_cast<std::chrono::milliseconds>(backoff_).count());
    alarm_ = std::make_unique<grpc::Alarm>();
    alarm_->Set(std::chrono::system_clock::now() +
                    std::chrono::duration_cast<std::chrono::system_clock::duration>(backoff_),
                [this](bool fired) {
                  ddprun::MutexLock lock(mu_);
                  if (stop_ || !fired) return finish();
                  subscribe();
                });
    backoff_ = std::min(backoff_ * 2, impl_->options.max_backoff);
  }

  // Nothing of this watch is in flight any more.
  void finish() REQUIRES(mu_) {
    active_ = false;
    cv_.notify_all();
  }

  std::shared_ptr<AsyncClient::Impl> impl_;
  std::shared_ptr<WatchSink> sink_;
  pb::WatchRequest request_;
  ddprun::Mutex mu_;
  std::condition_variable_any cv_;
  Duration backoff_ GUARDED_BY(mu_);
  bool stop_ GUARDED_BY(mu_) = false;
  bool active_ GUARDED_BY(mu_) = true;  // a stream or an alarm is pending
  Stream* stream_ GUARDED_BY(mu_) = nullptr;
  std::unique_ptr<grpc::Alarm> alarm_ GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<Watch> AsyncClient::watch(const std::string& run, const std::string& node,
                                          ChangeCallback on_change, BreakCallback on_break) {
  return std::make_unique<GrpcWatch>(impl_, run, node, std::move(on_change), std::move(on_break));
}

}  // namespace ddprun::rendezvous
