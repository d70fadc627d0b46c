#include "loop_service.h"

#include <unistd.h>

#include <algorithm>
#include <boost/asio/post.hpp>
#include <cstdio>

#include "log.h"

namespace ddprun::etcd {

using rendezvous::CallPolicy;
using rendezvous::MasterAddress;
using rendezvous::RoundInfo;

namespace {

// Liveness is the lease's business: the state's own heartbeat expiry is pushed out of reach.
constexpr Duration kNoHeartbeatExpiry = std::chrono::hours(24 * 365);

std::string thisHostName() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "node";
  return buf;
}

}  // namespace

LoopService::LoopService(boost::asio::io_context& io, EtcdServiceOptions options)
    : io_(io),
      o_(std::move(options)),
      keys_(Keys::of(o_.run_id, o_.key_prefix)),
      etcd_(o_, keys_, watchEvents()),
      cache_(o_.run_id),
      kv_(keys_.kv, o_.max_kv_keys, o_.max_kv_bytes),
      tick_timer_(io),
      grace_timer_(io) {
  std::random_device rd;
  rng_.seed((static_cast<uint64_t>(rd()) << 32) ^ rd());
}

void LoopService::start() {
  loop_.check();
  etcd_.worker.connect(o_.connect_for, onLoop<Status>([this](Status st) { onConnected(st); }));
}

void LoopService::stop() {
  loop_.check();
  etcd_.stop();
}

void LoopService::post(std::function<void()> fn) {
  boost::asio::post(io_, [weak = weak_from_this(), fn = std::move(fn)] {
    if (!weak.expired()) fn();
  });
}

Watcher::Events LoopService::watchEvents() {
  Watcher::Events ev;
  ev.synced = [this](std::vector<KeyEvent> keys, int64_t revision) {
    post([this, keys = std::move(keys), revision]() mutable { onSync(std::move(keys), revision); });
  };
  ev.changed = [this](std::vector<KeyEvent> events, int64_t revision) {
    post([this, events = std::move(events), revision]() mutable {
      onEvents(std::move(events), revision);
    });
  };
  ev.resumed = [this] { post([this] { onResumed(); }); };
  ev.failed = [this](Status st) { post([this, st] { onWatchError(st); }); };
  ev.store_went_back = [this] { post([this] { onStoreWentBack(); }); };
  return ev;
}

Duration LoopService::retryFor(const CallPolicy& p) const {
  return p.retry_for.value_or(o_.connect_for);
}

void LoopService::onConnected(Status st) {
  loop_.check();
  if (!st.isOk()) return ready_.fail(st);
  // Ready once the watch delivered its first full picture.
  etcd_.startWatching();
}

std::string LoopService::newNodeId() {
  char id[32];
  std::snprintf(id, sizeof(id), "%d-%08x", static_cast<int>(getpid()),
                static_cast<unsigned>(rng_()));
  return thisHostName() + "-" + id;
}

void LoopService::join(rendezvous::JoinRequest req, Done<RoundInfo> done) {
  loop_.check();
  if (req.node_id.empty()) req.node_id = newNodeId();
  req.config.heartbeat_interval = kNoHeartbeatExpiry;
  req.config.heartbeat_misses = 1;
  const uint64_t call = rng_();
  const uint64_t id = calls_.track<RoundInfo>(done);
  ready_.whenReady([this, req, call, id, done](Status ready) {
    if (!ready.isOk()) {
      if (calls_.finish(id)) done(ready);
      return;
    }
    etcd_.worker.joinRun(
        req.node_id, [call, req](State& st, TimePoint now) { st.join(call, req, now); },
        o_.connect_for,
        onLoop<StatusOr<TxnWorker::Applied>>(
            [this, req, call, id, done](StatusOr<TxnWorker::Applied> applied) {
              onJoinApplied(req, call, id, done, std::move(applied));
            }));
  });
}

void LoopService::onJoinApplied(const rendezvous::JoinRequest& req, uint64_t call, uint64_t id,
                                Done<RoundInfo> done, StatusOr<TxnWorker::Applied> applied) {
  loop_.check();
  if (!calls_.has(id)) return;
  std::optional<StatusOr<RoundInfo>> result;
  if (!applied.isOk()) {
    result = applied.status();
  } else {
    for (auto& j : applied.value().out.joins) {
      if (j.id == call) result = std::move(j.result);
    }
  }
  if (result) {
    calls_.finish(id);
    done(std::move(*result));
    return;
  }
  PendingJoin pending;
  pending.node_id = req.node_id;
  pending.call = call;
  pending.revision = applied.value().revision;
  // Changes newer than the join's own transaction already went by: one of them may have
  // answered it.
  pending.check_state = cache_.stateRevision() > pending.revision;
  pending.done = done;
  joins_[id] = std::move(pending);
  // A local bound in case the state's own join timeout is never applied.
  armJoinBound(id, req.join_timeout + std::chrono::seconds(5));
  reevaluate();
}

void LoopService::armJoinBound(uint64_t id, Duration bound) {
  auto timer = std::make_shared<boost::asio::steady_timer>(io_);
  timer->expires_after(bound);
  std::weak_ptr<LoopService> weak = weak_from_this();
  timer->async_wait([this, weak, id, timer](const boost::system::error_code& ec) {
    if (ec || weak.expired()) return;
    auto it = joins_.find(id);
    if (it == joins_.end() || !calls_.finish(id)) return;
    auto d = std::move(it->second.done);
    joins_.erase(it);
    d(deadlineExceeded(std::string(rendezvous::kJoinTimeoutExpired) + "a round of run " +
                       o_.run_id));
  });
}

void LoopService::heartbeat(const std::string& node, Done<rendezvous::RunStatus> done) {
  loop_.check();
  ready_.whenReady([this, node, done](Status ready) {
    if (!ready.isOk()) return done(ready);
    auto ids = cache_.state().nodeIds(o_.run_id);
    if (std::find(ids.begin(), ids.end(), node) == ids.end()) {
      auto st = cache_.state().status(o_.run_id);
      if (st.isOk() && st.value().closed) return done(st);
      return done(notFound("node " + node + " is not part of run " + o_.run_id +
                           " (declared dead, left, or never joined); join again"));
    }
    done(cache_.state().status(o_.run_id));
  });
}

void LoopService::leave(const std::string& node, CallPolicy policy, StatusDone done) {
  loop_.check();
  const uint64_t id = calls_.track<bool>([done](StatusOr<bool> r) { done(r.status()); });
  etcd_.worker.leaveRun(
      node,
      [node, run = o_.run_id](State& st, TimePoint now) {
        Status result = st.leave(run, node, now);
        return result.code() == StatusCode::kNotFound ? Status::ok() : result;
      },
      retryFor(policy), onLoop<Status>([this, id, done](Status result) {
        if (calls_.finish(id)) done(result);
      }));
}

void LoopService::reportFailure(const std::string& node, uint64_t round,
                                rendezvous::FailureKind kind, Done<uint64_t> done) {
  loop_.check();
  applyAsync<uint64_t>(
      [node, round, kind, run = o_.run_id](State& st, TimePoint now) {
        return st.reportFailure(run, node, round, now, kind);
      },
      done, o_.connect_for);
}

void LoopService::close(CallPolicy policy, StatusDone done) {
  loop_.check();
  applyAsync<bool>(
      [run = o_.run_id](State& st, TimePoint now) -> StatusOr<bool> {
        Status s = st.close(run, now);
        if (s.code() == StatusCode::kNotFound) return true;  // nothing to close
        if (!s.isOk()) return s;
        return true;
      },
      [done](StatusOr<bool> r) { done(r.status()); }, retryFor(policy));
}

void LoopService::publishMaster(const std::string& node, uint64_t round, MasterAddress master,
                                StatusDone done) {
  loop_.check();
  applyAsync<bool>(
      [node, round, master, run = o_.run_id](State& st, TimePoint now) -> StatusOr<bool> {
        Status s = st.publishMaster(run, node, round, master, now);
        if (!s.isOk()) return s;
        return true;
      },
      [done](StatusOr<bool> r) { done(r.status()); }, o_.connect_for);
}

void LoopService::waitMaster(uint64_t round, Duration timeout, Done<MasterAddress> done) {
  loop_.check();
  const uint64_t id = calls_.track<MasterAddress>(done);
  ready_.whenReady([this, id, round, timeout, done](Status ready) {
    if (!ready.isOk()) {
      if (calls_.finish(id)) done(ready);
      return;
    }
    master_waits_[id] = MasterWait{round, done};
    armTimeout(id, timeout, "waiting for the master address of round " + std::to_string(round));
    reevaluate();
  });
}

void LoopService::kvSet(const std::string& key, const std::string& value, CallPolicy policy,
                        StatusDone done) {
  loop_.check();
  // The bounds every agent mirrors the store within (as the gRPC server's quotas refuse).
  if (Status room = kv_.admits(key, value.size()); !room.isOk()) {
    done(room);
    return;
  }
  const uint64_t id = calls_.track<bool>([done](StatusOr<bool> r) { done(r.status()); });
  etcd_.worker.put(keys_.kv + key, value, retryFor(policy),
                   onLoop<Status>([this, id, done](Status st) {
                     if (calls_.finish(id)) done(st);
                   }));
}

void LoopService::kvDeleteRange(const std::string& from, const std::string& to, CallPolicy policy,
                                StatusDone done) {
  loop_.check();
  // Refused as by the gRPC server (etcd would read an empty range end as "the key alone"). Both
  // ends lie under the run's kv prefix, which holds no reserved keys: the range cannot leave it.
  if (from.empty() || !(from < to)) {
    done(invalidArgument("the range of keys to delete is empty"));
    return;
  }
  const uint64_t id = calls_.track<bool>([done](StatusOr<bool> r) { done(r.status()); });
  etcd_.worker.removeRange(keys_.kv + from, keys_.kv + to, retryFor(policy),
                           onLoop<Status>([this, id, done](Status st) {
                             if (calls_.finish(id)) done(st);
                           }));
}

void LoopService::kvWait(std::vector<std::string> keys, Duration timeout,
                         Done<std::vector<std::string>> done) {
  loop_.check();
  const uint64_t id = calls_.track<std::vector<std::string>>(done);
  ready_.whenReady([this, id, keys = std::move(keys), timeout, done](Status ready) mutable {
    if (!ready.isOk()) {
      if (calls_.finish(id)) done(ready);
      return;
    }
    kv_waits_[id] = KvWait{std::move(keys), done};
    armTimeout(id, timeout, "waiting for keys of run " + o_.run_id);
    reevaluate();
  });
}

void LoopService::armTimeout(uint64_t id, Duration timeout, std::string what) {
  auto timer = std::make_shared<boost::asio::steady_timer>(io_);
  timer->expires_after(timeout);
  std::weak_ptr<LoopService> weak = weak_from_this();
  timer->async_wait([this, weak, id, timer, what](const boost::system::error_code& ec) {
    if (ec || weak.expired()) return;
    Calls::Fail fail = calls_.take(id);
    if (!fail) return;
    master_waits_.erase(id);
    kv_waits_.erase(id);
    fail(deadlineExceeded(what + ": timed out"));
  });
}

void LoopService::watch(ChangeSink sink) {
  loop_.check();
  sink_ = std::move(sink);
  const uint64_t generation = ++watch_generation_;
  ready_.whenReady([this, generation](Status ready) {
    if (!ready.isOk() || generation != watch_generation_ || !sink_) return;
    pushSnapshot();
  });
}

void LoopService::stopWatch() {
  loop_.check();
  sink_ = nullptr;
  ++watch_generation_;
}

void LoopService::cancelAll() {
  loop_.check();
  // Joins pending in the state are withdrawn there too (as a cancelled gRPC join is).
  for (auto& [id, j] : joins_) {
    if (!calls_.has(id)) continue;
    const uint64_t call = j.call;
    applyAsync<bool>(
        [call](State& st, TimePoint now) -> StatusOr<bool> {
          st.cancelJoin(call, now);
          return true;
        },
        [](StatusOr<bool>) {}, o_.rpc_timeout);
  }
  auto calls = calls_.takeAll();
  joins_.clear();
  master_waits_.clear();
  kv_waits_.clear();
  for (auto& [id, fail] : calls) {
    post([fail = std::move(fail)] {
      fail(Status(StatusCode::kCancelled, "cancelled by the agent"));
    });
  }
}

Status LoopService::explain(const Status& st) const {
  if (st.message().find("no etcd member answered") != std::string::npos) return st;
  return Status(st.code(), st.message() + " (etcd members: " + etcd_.client.membersText() + ")");
}

}  // namespace ddprun::etcd
