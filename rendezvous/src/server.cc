#include "ddprun/rendezvous/server.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/security/server_credentials.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <deque>
#include <thread>
#include <unordered_map>

#include "convert.h"
#include "ddprun/common/log.h"
#include "ddprun/common/strings.h"
#include "ddprun/common/thread_annotations.h"
#include "ddprun/rendezvous/v1/rendezvous.grpc.pb.h"

namespace ddprun::rendezvous {

namespace pb = ::ddprun::rendezvous::v1;
using convert::fromProto;
using convert::toGrpc;
using convert::toProto;
using CallId = RendezvousState::CallId;

namespace {

// A long Join: finished by the io thread when the round completes, or on cancellation.
class JoinReactor final : public grpc::ServerUnaryReactor {
 public:
  JoinReactor(RendezvousServer::Impl* impl, CallId id) : impl_(impl), id_(id) {}
  void OnCancel() override;
  void OnDone() override { delete this; }

 private:
  RendezvousServer::Impl* impl_;
  CallId id_;
};

// A long-poll wait (KvWait, GetMaster).
class WaitReactor final : public grpc::ServerUnaryReactor {
 public:
  WaitReactor(RendezvousServer::Impl* impl, CallId id) : impl_(impl), id_(id) {}
  void OnCancel() override;
  void OnDone() override { delete this; }

 private:
  RendezvousServer::Impl* impl_;
  CallId id_;
};

class WatchReactor final : public grpc::ServerWriteReactor<pb::RoundChange> {
 public:
  WatchReactor(RendezvousServer::Impl* impl, CallId id) : impl_(impl), id_(id) {}
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override { delete this; }

 private:
  RendezvousServer::Impl* impl_;
  CallId id_;
};

bool constantTimeEquals(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

class RendezvousService;

struct RendezvousServer::Impl {
  explicit Impl(ServerOptions opts)
      : options(std::move(opts)),
        state(options.limits, options.retention),
        work(boost::asio::make_work_guard(io)),
        timer(io) {}

  // Runs `fn` on the io thread. Safe from any thread, including gRPC callbacks.
  template <typename F>
  void post(F&& fn) {
    boost::asio::post(io, std::forward<F>(fn));
  }

  TimePoint now() const { return clock.now(); }

  // --- everything below runs on the io thread only ---
  struct PendingJoin {
    JoinReactor* reactor;
    pb::JoinResponse* response;
    bool include_participants;
    std::string peer;  // counted against max_streams_per_peer until answered
  };
  struct PendingWait {
    WaitReactor* reactor;
    pb::KvWaitResponse* kv = nullptr;         // KvWait
    pb::GetMasterResponse* master = nullptr;  // GetMaster
    std::string peer;
  };
  struct WatchSession {
    WatchReactor* reactor;
    std::string peer;
    std::string run_id;
    std::string node_id;  // may be empty (an observer)
    std::deque<pb::RoundChange> queue;
    pb::RoundChange current;  // the message of the write in flight
    bool writing = false;
    bool finish_after_queue = false;  // closed run: end the stream once the queue drained
    bool cancelled = false;
    bool overflowed = false;  // fell max_watch_queue changes behind: end it, queue dropped
  };

  // A connection's (or a host's) open Watch streams plus pending waits.
  struct PeerStreams {
    size_t open = 0;
    bool warned = false;  // a refusal was logged
  };

  // Counts a long call (Watch, Join, KvWait, GetMaster) of `peer` against max_streams_per_peer,
  // and against max_streams_per_host for its host.
  Status admitStream(const std::string& peer) {
    const std::string host = hostOfGrpcPeer(peer);
    PeerStreams& h = streams_by_host[host];
    if (Status st = refuseBeyond(h, options.max_streams_per_host, "host " + host,
                                 "this client's host", "max-streams-per-host");
        !st.isOk()) {
      return st;
    }
    PeerStreams& p = streams_by_peer[peer];
    if (Status st = refuseBeyond(p, options.max_streams_per_peer, "peer " + peer, "this connection",
                                 "max-streams-per-peer");
        !st.isOk()) {
      return st;
    }
    ++p.open;
    ++h.open;
    return Status::ok();
  }
  // RESOURCE_EXHAUSTED naming `flag` when `s` holds `bound` streams (logged once per holder, not
  // once per refused call); ok otherwise.
  static Status refuseBeyond(PeerStreams& s, size_t bound, const std::string& who_logged,
                             const std::string& who, const std::string& flag) {
    if (s.open < bound) return Status::ok();
    if (!s.warned) {
      s.warned = true;
      logger("rendezvous")
          ->warn("{} holds {} streams and waits: refusing more ({})", who_logged, s.open, flag);
    }
    return Status(StatusCode::kResourceExhausted, who + " already holds " + std::to_string(s.open) +
                                                      " watch streams, joins and waits: " + flag +
                                                      " = " + std::to_string(bound) +
                                                      " (ddprun-rendezvous --" + flag + ")");
  }
  void releaseStream(const std::string& peer) {
    auto it = streams_by_peer.find(peer);
    if (it == streams_by_peer.end()) return;
    if (--it->second.open == 0) streams_by_peer.erase(it);
    auto host = streams_by_host.find(hostOfGrpcPeer(peer));
    if (host != streams_by_host.end() && --host->second.open == 0) streams_by_host.erase(host);
  }

  void flush() {
    RendezvousState::Outbox out = state.drain();
    {
      ddprun::MutexLock lock(census_mu);  // before any answer leaves
      census = state.census();
    }
    for (auto& j : out.joins) {
      auto it = joins.find(j.id);
      if (it == joins.end()) continue;
      PendingJoin p = it->second;
      joins.erase(it);
      releaseStream(p.peer);
      if (j.result.isOk()) {
        toProto(j.result.value(), p.include_participants, p.response);
        p.reactor->Finish(grpc::Status::OK);
      } else {
        p.reactor->Finish(toGrpc(j.result.status()));
      }
    }
    for (auto& w : out.waits) {
      auto it = waits.find(w.id);
      if (it == waits.end()) continue;
      PendingWait p = it->second;
      waits.erase(it);
      releaseStream(p.peer);
      if (!w.values.isOk()) {
        p.reactor->Finish(toGrpc(w.values.status()));
        continue;
      }
      for (auto& v : w.values.value()) p.kv->add_values(std::move(v));
      p.reactor->Finish(grpc::Status::OK);
    }
    for (auto& m : out.masters) {
      auto it = waits.find(m.id);
      if (it == waits.end()) continue;
      PendingWait p = it->second;
      waits.erase(it);
      releaseStream(p.peer);
      if (!m.master.isOk()) {
        p.reactor->Finish(toGrpc(m.master.status()));
        continue;
      }
      p.master->set_master_addr(m.master.value().addr);
      p.master->set_master_port(m.master.value().port);
      p.reactor->Finish(grpc::Status::OK);
    }
    for (auto& c : out.changes) {
      auto r = watchers_by_run.find(c.run_id);
      if (r == watchers_by_run.end()) continue;
      pb::RoundChange msg;
      toProto(c.change, &msg);
      std::vector<CallId> overflowed;  // ended after the loop: ending one edits r->second
      for (CallId id : r->second) {
        WatchSession& s = watches.at(id);
        if (s.overflowed) continue;
        if (s.queue.size() >= options.max_watch_queue) {
          s.queue.clear();
          s.overflowed = true;
          overflowed.push_back(id);
          continue;
        }
        s.queue.push_back(msg);
        if (c.change.kind == ChangeKind::kClosed) s.finish_after_queue = true;
        pump(id);
      }
      for (CallId id : overflowed) {
        logger("rendezvous")
            ->warn("watch of run {} by {} fell {} changes behind: ending it (max_watch_queue)",
                   c.run_id, watches.at(id).peer, options.max_watch_queue);
        pump(id);
      }
    }
    armTimer();
  }

  void armTimer() {
    if (shutting_down) return;
    std::optional<TimePoint> next = state.nextDeadline();
    if (next == armed) return;
    armed = next;
    if (!next) {
      timer.cancel();
      return;
    }
    timer.expires_at(*next);
    timer.async_wait([this](const boost::system::error_code& ec) {
      if (ec) return;
      armed.reset();
      state.tick(now());
      flush();
    });
  }

  // Starts the next write of a watch stream, or finishes it.
  void pump(CallId id) {
    auto it = watches.find(id);
    if (it == watches.end()) return;
    WatchSession& s = it->second;
    if (s.writing) return;
    if (s.cancelled) return endWatch(id, grpc::Status::CANCELLED);
    if (s.overflowed) {
      return endWatch(id,
                      grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                                   "this watch fell " + std::to_string(options.max_watch_queue) +
                                       " changes behind its run (max_watch_queue); subscribe "
                                       "again for a fresh snapshot"));
    }
    if (!s.queue.empty()) {
      s.current = std::move(s.queue.front());
      s.queue.pop_front();
      s.writing = true;
      s.reactor->StartWrite(&s.current);
      return;
    }
    if (s.finish_after_queue) endWatch(id, grpc::Status::OK);
  }

  void endWatch(CallId id, const grpc::Status& status) {
    auto it = watches.find(id);
    if (it == watches.end()) return;
    WatchReactor* reactor = it->second.reactor;
    auto r = watchers_by_run.find(it->second.run_id);
    if (r != watchers_by_run.end()) {
      r->second.erase(id);
      if (r->second.empty()) watchers_by_run.erase(r);
    }
    state.watchClosed(it->second.run_id, now());  // may schedule collection: callers arm the timer
    releaseStream(it->second.peer);
    watches.erase(it);
    reactor->Finish(status);  // the io thread's last touch of the reactor
  }

  void onJoinCancelled(CallId id) {
    auto it = joins.find(id);
    if (it == joins.end()) return;
    JoinReactor* reactor = it->second.reactor;
    releaseStream(it->second.peer);
    joins.erase(it);
    state.cancelJoin(id, now());
    reactor->Finish(grpc::Status::CANCELLED);
    flush();
  }

  void onWaitCancelled(CallId id) {
    auto it = waits.find(id);
    if (it == waits.end()) return;
    WaitReactor* reactor = it->second.reactor;
    releaseStream(it->second.peer);
    waits.erase(it);
    state.cancelWait(id, now());
    reactor->Finish(grpc::Status::CANCELLED);
    flush();
  }

  void onWatchWriteDone(CallId id, bool ok) {
    auto it = watches.find(id);
    if (it == watches.end()) return;
    it->second.writing = false;
    if (!ok) it->second.cancelled = true;
    pump(id);
    flush();
  }

  void onWatchCancelled(CallId id) {
    auto it = watches.find(id);
    if (it == watches.end()) return;
    it->second.cancelled = true;
    if (!shutting_down && !it->second.node_id.empty()) {
      state.watchLost(it->second.run_id, it->second.node_id, now());
    }
    pump(id);
    flush();
  }

  // Ends every long call; new calls are refused from now on.
  void stopServing() {
    shutting_down = true;
    state.abortAll(unavailable("rendezvous server is shutting down"));
    flush();
    timer.cancel();
    std::vector<CallId> ids;
    for (auto& [id, s] : watches) ids.push_back(id);
    for (CallId id : ids) {
      WatchSession& s = watches.at(id);
      s.queue.clear();
      s.finish_after_queue = true;
      if (!s.writing)
        endWatch(id,
                 grpc::Status(grpc::StatusCode::UNAVAILABLE, "rendezvous server is shutting down"));
    }
    timer.cancel();
  }

  ServerOptions options;
  SteadyClock clock;
  RendezvousState state;
  boost::asio::io_context io;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work;
  boost::asio::steady_timer timer;
  std::optional<TimePoint> armed;
  std::thread io_thread;
  std::unique_ptr<RendezvousService> service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::string address;
  ddprun::Mutex shutdown_mu;
  bool stopped GUARDED_BY(shutdown_mu) = false;

  bool shutting_down = false;
  std::unordered_map<CallId, PendingJoin> joins;
  std::unordered_map<CallId, PendingWait> waits;
  std::unordered_map<CallId, WatchSession> watches;
  std::unordered_map<std::string, std::set<CallId>> watchers_by_run;
  std::unordered_map<std::string, PeerStreams> streams_by_peer;  // admitStream / releaseStream
  std::unordered_map<std::string, PeerStreams> streams_by_host;  // by hostOfGrpcPeer(peer)

  mutable ddprun::Mutex census_mu;
  StateCensus census GUARDED_BY(census_mu);  // refreshed by every flush()
};

namespace {

void JoinReactor::OnCancel() {
  auto* impl = impl_;
  CallId id = id_;
  impl->post([impl, id] { impl->onJoinCancelled(id); });
}
void WaitReactor::OnCancel() {
  auto* impl = impl_;
  CallId id = id_;
  impl->post([impl, id] { impl->onWaitCancelled(id); });
}
void WatchReactor::OnWriteDone(bool ok) {
  auto* impl = impl_;
  CallId id = id_;
  impl->post([impl, id, ok] { impl->onWatchWriteDone(id, ok); });
}
void WatchReactor::OnCancel() {
  auto* impl = impl_;
  CallId id = id_;
  impl->post([impl, id] { impl->onWatchCancelled(id); });
}

const grpc::Status kShuttingDown(grpc::StatusCode::UNAVAILABLE,
                                 "rendezvous server is shutting down");

// A long call (Join, KvWait, GetMaster) of `peer` starts, on the io thread: false, with `reactor`
// finished, when the server shuts down or `peer` already holds max-streams-per-peer long calls.
template <typename Reactor>
bool startLongCall(RendezvousServer::Impl* impl, Reactor* reactor, const std::string& peer) {
  if (impl->shutting_down) {
    reactor->Finish(kShuttingDown);
    return false;
  }
  if (Status admit = impl->admitStream(peer); !admit.isOk()) {
    reactor->Finish(toGrpc(admit));
    return false;
  }
  return true;
}

}  // namespace

class RendezvousService final : public pb::Rendezvous::CallbackService {
 public:
  explicit RendezvousService(RendezvousServer::Impl* impl) : impl_(impl) {}

  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* ctx, const pb::JoinRequest* req,
                                 pb::JoinResponse* resp) override {
    Status auth = authorize(ctx, "Join");
    if (!auth.isOk()) return finishNow(ctx, auth);
    Impl* impl = impl_;
    CallId id = nextId();
    auto* reactor = new JoinReactor(impl, id);
    JoinRequest request = fromProto(*req);
    bool include = req->include_participants();
    impl->post(
        [impl, reactor, id, request = std::move(request), include, resp, peer = ctx->peer()]() {
          // A join waits until its round forms: one more long call of its connection (a flood of
          // joins under new node ids, each a spare beyond nnodes MAX, is bounded so).
          if (!startLongCall(impl, reactor, peer)) return;
          impl->joins[id] = {reactor, resp, include, peer};
          impl->state.join(id, request, impl->now());
          impl->flush();
        });
    return reactor;
  }

  grpc::ServerWriteReactor<pb::RoundChange>* Watch(grpc::CallbackServerContext* ctx,
                                                   const pb::WatchRequest* req) override;

  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx, const pb::RunRef* req,
                                      pb::HeartbeatResponse* resp) override {
    return unary(ctx, "Heartbeat", [req, resp](Impl* impl) -> Status {
      auto st = impl->state.heartbeat(req->run_id(), req->node_id(), impl->now());
      if (!st.isOk()) return st.status();
      toProto(st.value(), resp->mutable_status());
      return Status::ok();
    });
  }

  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* ctx, const pb::RunRef* req,
                                  pb::LeaveResponse*) override {
    return unary(ctx, "Leave", [req](Impl* impl) {
      return impl->state.leave(req->run_id(), req->node_id(), impl->now());
    });
  }

  grpc::ServerUnaryReactor* ReportFailure(grpc::CallbackServerContext* ctx,
                                          const pb::ReportFailureRequest* req,
                                          pb::ReportFailureResponse* resp) override {
    return unary(ctx, "ReportFailure", [req, resp](Impl* impl) -> Status {
      auto st = impl->state.reportFailure(
          req->run_id(), req->node_id(), req->round(), impl->now(),
          req->recovery_failed() ? FailureKind::kRecovery : FailureKind::kWorkers);
      if (!st.isOk()) return st.status();
      resp->set_next_round(st.value());
      return Status::ok();
    });
  }

  grpc::ServerUnaryReactor* Close(grpc::CallbackServerContext* ctx, const pb::CloseRequest* req,
                                  pb::CloseResponse*) override {
    std::string reason = "by " + ctx->peer();
    return unary(ctx, "Close", [req, reason = std::move(reason)](Impl* impl) {
      return impl->state.close(req->run_id(), impl->now(), reason);
    });
  }

  grpc::ServerUnaryReactor* PublishMaster(grpc::CallbackServerContext* ctx,
                                          const pb::PublishMasterRequest* req,
                                          pb::PublishMasterResponse*) override {
    return unary(ctx, "PublishMaster", [req](Impl* impl) {
      return impl->state.publishMaster(req->run_id(), req->node_id(), req->round(),
                                       {req->master_addr(), req->master_port()}, impl->now());
    });
  }

  grpc::ServerUnaryReactor* GetMaster(grpc::CallbackServerContext* ctx,
                                      const pb::GetMasterRequest* req,
                                      pb::GetMasterResponse* resp) override {
    return wait(
        ctx, "GetMaster",
        [req](Impl* impl, CallId id) {
          impl->state.waitMaster(id, req->run_id(), req->round(), seconds(req->timeout_s()),
                                 impl->now());
        },
        nullptr, resp);
  }

  grpc::ServerUnaryReactor* KvSet(grpc::CallbackServerContext* ctx, const pb::KvSetRequest* req,
                                  pb::KvSetResponse*) override {
    return unary(ctx, "KvSet", [req](Impl* impl) {
      return impl->state.kvSet(req->run_id(), req->key(), req->value(), impl->now());
    });
  }

  grpc::ServerUnaryReactor* KvGet(grpc::CallbackServerContext* ctx, const pb::KvGetRequest* req,
                                  pb::KvGetResponse* resp) override {
    return unary(ctx, "KvGet", [req, resp](Impl* impl) -> Status {
      auto st = impl->state.kvGet(req->run_id(), req->key());
      if (!st.isOk()) return st.status();
      resp->set_value(std::move(st).value());
      return Status::ok();
    });
  }

  grpc::ServerUnaryReactor* KvAdd(grpc::CallbackServerContext* ctx, const pb::KvAddRequest* req,
                                  pb::KvAddResponse* resp) override {
    return unary(ctx, "KvAdd", [req, resp](Impl* impl) -> Status {
      auto st = impl->state.kvAdd(req->run_id(), req->key(), req->delta(), impl->now());
      if (!st.isOk()) return st.status();
      resp->set_value(st.value());
      return Status::ok();
    });
  }

  grpc::ServerUnaryReactor* KvCompareSet(grpc::CallbackServerContext* ctx,
                                         const pb::KvCompareSetRequest* req,
                                         pb::KvCompareSetResponse* resp) override {
    return unary(ctx, "KvCompareSet", [req, resp](Impl* impl) -> Status {
      auto st = impl->state.kvCompareSet(req->run_id(), req->key(), req->expected(), req->desired(),
                                         impl->now());
      if (!st.isOk()) return st.status();
      resp->set_value(std::move(st).value());
      return Status::ok();
    });
  }

  grpc::ServerUnaryReactor* KvWait(grpc::CallbackServerContext* ctx, const pb::KvWaitRequest* req,
                                   pb::KvWaitResponse* resp) override {
    return wait(
        ctx, "KvWait",
        [req](Impl* impl, CallId id) {
          std::vector<std::string> keys(req->keys().begin(), req->keys().end());
          impl->state.kvWait(id, req->run_id(), std::move(keys), seconds(req->timeout_s()),
                             impl->now());
        },
        resp, nullptr);
  }

  grpc::ServerUnaryReactor* KvDelete(grpc::CallbackServerContext* ctx,
                                     const pb::KvDeleteRequest* req,
                                     pb::KvDeleteResponse* resp) override {
    return unary(ctx, "KvDelete", [req, resp](Impl* impl) -> Status {
      if (!req->range_end().empty()) {
        auto count =
            impl->state.kvDeleteRange(req->run_id(), req->key(), req->range_end(), impl->now());
        if (!count.isOk()) return count.status();
        resp->set_deleted(count.value() > 0);
        resp->set_deleted_keys(count.value());
        resp->set_ranged(true);
        return Status::ok();
      }
      auto st = impl->state.kvDelete(req->run_id(), req->key(), impl->now());
      if (!st.isOk()) return st.status();
      resp->set_deleted(st.value());
      return Status::ok();
    });
  }

 private:
  using Impl = RendezvousServer::Impl;

  Status authorize(grpc::CallbackServerContext* ctx, const char* method) const {
    const std::string& token = impl_->options.token;
    if (token.empty()) return Status::ok();
    const auto& md = ctx->client_metadata();
    auto it = md.find("authorization");
    if (it != md.end() &&
        constantTimeEquals(std::string(it->second.data(), it->second.size()), "Bearer " + token)) {
      return Status::ok();
    }
    logger("rendezvous")
        ->warn("refused {} from {}: {} rendezvous token", method, ctx->peer(),
               it == md.end() ? "missing" : "wrong");
    return Status(StatusCode::kUnauthenticated,
                  it == md.end() ? "this rendezvous requires a token (token_file=)"
                                 : "wrong rendezvous token");
  }

  grpc::ServerUnaryReactor* finishNow(grpc::CallbackServerContext* ctx, const Status& st) {
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(toGrpc(st));
    return reactor;
  }

  // A short call: runs `op` on the io thread and finishes with its status.
  template <typename Op>
  grpc::ServerUnaryReactor* unary(grpc::CallbackServerContext* ctx, const char* method, Op op) {
    Status auth = authorize(ctx, method);
    if (!auth.isOk()) return finishNow(ctx, auth);
    auto* reactor = ctx->DefaultReactor();
    Impl* impl = impl_;
    impl->post([impl, reactor, op = std::move(op)]() mutable {
      if (impl->shutting_down) {
        reactor->Finish(kShuttingDown);
        return;
      }
      Status st = op(impl);
      impl->flush();  // first: census() is current once the caller has its answer
      reactor->Finish(toGrpc(st));
    });
    return reactor;
  }

  template <typename Start>
  grpc::ServerUnaryReactor* wait(grpc::CallbackServerContext* ctx, const char* method, Start start,
                                 pb::KvWaitResponse* kv, pb::GetMasterResponse* master) {
    Status auth = authorize(ctx, method);
    if (!auth.isOk()) return finishNow(ctx, auth);
    Impl* impl = impl_;
    CallId id = nextId();
    auto* reactor = new WaitReactor(impl, id);
    impl->post(
        [impl, reactor, id, kv, master, peer = ctx->peer(), start = std::move(start)]() mutable {
          if (!startLongCall(impl, reactor, peer)) return;
          impl->waits[id] = {reactor, kv, master, std::move(peer)};
          start(impl, id);
          impl->flush();
        });
    return reactor;
  }

 public:
  // Ids are handed out on gRPC threads, so they come from an atomic, not the io thread.
  CallId nextId() { return next_id_.fetch_add(1); }

 private:
  Impl* impl_;
  std::atomic<CallId> next_id_{1};
};

grpc::ServerWriteReactor<pb::RoundChange>* RendezvousService::Watch(
    grpc::CallbackServerContext* ctx, const pb::WatchRequest* req) {
  Status auth = authorize(ctx, "Watch");
  Impl* impl = impl_;
  CallId id = nextId();
  auto* reactor = new WatchReactor(impl, id);
  if (!auth.isOk()) {
    reactor->Finish(toGrpc(auth));
    return reactor;
  }
  std::string run_id = req->run_id();
  std::string node_id = req->node_id();
  impl->post([impl, reactor, id, run_id, node_id, peer = ctx->peer()]() {
    if (impl->shutting_down) {
      reactor->Finish(kShuttingDown);
      return;
    }
    if (Status valid = impl->state.validateIds(run_id, node_id); !valid.isOk()) {
      reactor->Finish(toGrpc(valid));
      return;
    }
    if (Status admit = impl->admitStream(peer); !admit.isOk()) {
      reactor->Finish(toGrpc(admit));
      return;
    }
    Impl::WatchSession& s = impl->watches[id];
    s.reactor = reactor;
    s.peer = peer;
    s.run_id = run_id;
    s.node_id = node_id;
    impl->state.watchOpened(run_id, impl->now());
    if (!node_id.empty()) impl->state.watchStarted(run_id, node_id);
    impl->watchers_by_run[run_id].insert(id);
    for (const RoundChange& c : impl->state.watchSnapshot(run_id)) {
      pb::RoundChange msg;
      toProto(c, &msg);
      s.queue.push_back(std::move(msg));
      if (c.kind == ChangeKind::kClosed) s.finish_after_queue = true;
    }
    impl->pump(id);
    impl->flush();
  });
  return reactor;
}

RendezvousServer::RendezvousServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

RendezvousServer::~RendezvousServer() { shutdown(); }

int RendezvousServer::port() const { return impl_->port; }
std::string RendezvousServer::address() const { return impl_->address; }

StateCensus RendezvousServer::census() const {
  ddprun::MutexLock lock(impl_->census_mu);
  return impl_->census;
}

namespace {

// HOST of "HOST:PORT" without the brackets of an IPv6 address.
std::string options_host(const std::string& listen, size_t colon) {
  std::string host = listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return host;
}

}  // namespace

Status whyCannotListen(const std::string& listen, const std::string& host, int port) {
  const std::string where = "cannot listen on " + listen + ": ";
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  const int gai =
      ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found);
  if (gai != 0 || found == nullptr) {
    return invalidArgument(where + "'" + host + "' does not resolve (" +
                           (gai == EAI_SYSTEM ? std::strerror(errno) : ::gai_strerror(gai)) + ")");
  }
  Status why = invalidArgument(where + "the address could not be used (gRPC gave no reason)");
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    (void)::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    const int err = ::bind(fd, a->ai_addr, a->ai_addrlen) == 0 ? 0 : errno;
    ::close(fd);
    if (err == EADDRINUSE) {
      why = invalidArgument(where + "port " + service +
                            " is in use (another process listens there; pick another port)");
      break;
    }
    if (err == EADDRNOTAVAIL) {
      why = invalidArgument(where + "'" + host + "' is not an address of this host");
      break;
    }
    if (err == EACCES) {
      why = invalidArgument(where + "port " + service + " needs privileges (use one above 1023)");
      break;
    }
    if (err != 0) {
      why = invalidArgument(where + std::strerror(err));
      break;
    }
  }
  ::freeaddrinfo(found);
  return why;
}

StatusOr<std::unique_ptr<RendezvousServer>> RendezvousServer::start(ServerOptions options) {
  convert::routeGrpcLogs();
  auto colon = options.listen.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return invalidArgument("listen address '" + options.listen + "' is not HOST:PORT");
  }
  auto port = parseInt(options.listen.substr(colon + 1));
  if (!port || *port < 0 || *port > 65535) {
    return invalidArgument("listen address '" + options.listen + "' has no valid port");
  }
  const std::string host = options.listen.substr(0, colon);
  const bool bracketed = host.front() == '[';
  if (bracketed != (host.back() == ']') || (bracketed && host.size() < 3) ||
      (!bracketed && host.find(':') != std::string::npos)) {
    return invalidArgument("listen address '" + options.listen +
                           "' is not HOST:PORT (an IPv6 address goes in brackets: [::1]:PORT)");
  }
  if (options.tls_cert_pem.empty() != options.tls_key_pem.empty()) {
    return invalidArgument("TLS needs both a certificate and a key");
  }
  if (options.retention.closed_run_ttl <= Duration::zero() ||
      options.retention.idle_run_ttl <= Duration::zero() ||
      options.retention.closed_drain_timeout <= Duration::zero()) {
    return invalidArgument("closed_run_ttl, idle_run_ttl and closed_drain_timeout must be > 0");
  }
  auto impl = std::make_unique<Impl>(std::move(options));
  Impl* raw = impl.get();
  raw->service = std::make_unique<RendezvousService>(raw);

  const auto creds = raw->options.tls_cert_pem.empty()
                         ? grpc::InsecureServerCredentials()
                         : convert::serverTls(raw->options.tls_cert_pem, raw->options.tls_key_pem);
  grpc::ServerBuilder builder;
  int selected = 0;
  builder.AddListeningPort(raw->options.listen, creds, &selected);
  builder.RegisterService(raw->service.get());
  // Without this, Linux gRPC sets SO_REUSEPORT and a second server "binds" a taken port.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(4 << 20);
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                             millisForInt(raw->options.handshake_timeout));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                             millisForInt(raw->options.max_connection_idle));
  raw->server = builder.BuildAndStart();
  if ((!raw->server || selected == 0) && !raw->options.tls_cert_pem.empty()) {
    // Tell bad TLS material from a bad address: the same credentials on loopback port 0.
    grpc::ServerBuilder probe;
    int probe_port = 0;
    probe.AddListeningPort("127.0.0.1:0", creds, &probe_port);
    auto probe_server = probe.BuildAndStart();
    if (!probe_server || probe_port == 0) {
      return invalidArgument(
          "the TLS certificate and key cannot be used (not a matching pair, or not valid PEM)");
    }
    probe_server->Shutdown();
  }
  if (!raw->server || selected == 0) {
    return whyCannotListen(raw->options.listen, options_host(raw->options.listen, colon),
                           static_cast<int>(*port));
  }
  raw->port = selected;
  raw->address = raw->options.listen.substr(0, colon) + ":" + std::to_string(selected);
  raw->io_thread = std::thread([raw] { raw->io.run(); });
  logger("rendezvous")
      ->info("rendezvous server listening on {}{}{}; closed runs kept {}s, idle runs {}s",
             raw->address, raw->options.token.empty() ? "" : ", token required",
             raw->options.tls_cert_pem.empty() ? "" : ", TLS",
             std::chrono::duration<double>(raw->options.retention.closed_run_ttl).count(),
             std::chrono::duration<double>(raw->options.retention.idle_run_ttl).count());
  return std::unique_ptr<RendezvousServer>(new RendezvousServer(std::move(impl)));
}

void RendezvousServer::shutdown() {
  ddprun::MutexLock lock(impl_->shutdown_mu);
  if (impl_->stopped) return;
  impl_->stopped = true;
  Impl* impl = impl_.get();
  impl->post([impl] { impl->stopServing(); });
  // Pending calls were answered above; calls still arriving are refused on the io thread, which
  // keeps running until gRPC has finished every reactor.
  impl->server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  impl->work.reset();
  impl->post([impl] { impl->timer.cancel(); });
  impl->io_thread.join();
  logger("rendezvous")->info("rendezvous server on {} stopped", impl->address);
}

}  // namespace ddprun::rendezvous
