#include "ddprun/etcd/rendezvous_service.h"

#include <unistd.h>

#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "client.h"
#include "ddprun/common/log.h"
#include "ddprun/common/log_throttle.h"
#include "ddprun/common/strings.h"
#include "ddprun/rendezvous/state.h"
#include "state_value.h"

namespace ddprun::etcd {

namespace ep = etcdserverpb;
using rendezvous::RendezvousState;

namespace {

auto log() { return logger("etcd"); }

// Deadlines in the shared state are wall-clock times, the same on every agent (within NTP).
TimePoint wallNow() {
  return TimePoint(
      std::chrono::duration_cast<Duration>(std::chrono::system_clock::now().time_since_epoch()));
}

// Liveness is the lease's business: the state's own heartbeat expiry is pushed out of reach.
constexpr Duration kNoHeartbeatExpiry = std::chrono::hours(24 * 365);

// The end of the key range holding every key that starts with `prefix`.
std::string prefixEnd(std::string prefix) {
  for (size_t i = prefix.size(); i > 0; --i) {
    auto& c = reinterpret_cast<unsigned char&>(prefix[i - 1]);
    if (c < 0xff) {
      ++c;
      prefix.resize(i);
      return prefix;
    }
  }
  return std::string(1, '\0');
}

std::string thisHostName() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "node";
  return buf;
}

}  // namespace

class EtcdRendezvousService::Impl : public std::enable_shared_from_this<Impl> {
 public:
  Impl(boost::asio::io_context& io, EtcdServiceOptions o, std::vector<std::string> endpoints)
      : io_(io),
        o_(std::move(o)),
        prefix_(o_.key_prefix.empty() ? "/ddprun/rdzv/" + o_.run_id : o_.key_prefix),
        state_key_(prefix_ + "/state"),
        kv_prefix_(prefix_ + "/kv/"),
        alive_prefix_(prefix_ + "/alive/"),
        client_(clientOptions(o_, std::move(endpoints))),
        tick_timer_(io),
        grace_timer_(io) {
    const double expiry = std::chrono::duration<double>(o_.run_config.heartbeat_interval).count() *
                          o_.run_config.heartbeat_misses;
    lease_ttl_ = std::max<int64_t>(2, static_cast<int64_t>(std::ceil(expiry)));
    std::random_device rd;
    rng_.seed((static_cast<uint64_t>(rd()) << 32) ^ rd());
  }

  static EtcdOptions clientOptions(const EtcdServiceOptions& o, std::vector<std::string> eps) {
    EtcdOptions c;
    c.endpoints = std::move(eps);
    c.tls = o.tls;
    c.ca_pem = o.ca_pem;
    c.cert_pem = o.cert_pem;
    c.key_pem = o.key_pem;
    c.ca_file = o.ca_file;
    c.cert_file = o.cert_file;
    c.username = o.username;
    c.password = o.password;
    c.rpc_timeout = o.rpc_timeout;
    return c;
  }

  void start() {
    worker_ = std::thread([this] { workerLoop(); });
    std::weak_ptr<Impl> weak = weak_from_this();
    submit([this, weak] {
      Status st = connect();
      post(weak, [this, st] { onConnected(st); });
    });
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    client_.shutdown();
    if (worker_.joinable()) worker_.join();
    if (watcher_.joinable()) watcher_.join();
    if (keeper_.joinable()) keeper_.join();
    // Others learn at once that this agent is gone (its alive keys go with the lease).
    if (const int64_t lease = lease_.load(); lease != 0) {
      EtcdOptions quick = client_.options();
      quick.rpc_timeout = std::chrono::seconds(1);
      EtcdClient last(quick);
      (void)last.leaseRevoke(lease);
    }
  }

  // ---- the loop's side -------------------------------------------------------------------

  template <typename T>
  uint64_t track(std::function<void(StatusOr<T>)> done) {
    const uint64_t id = next_id_++;
    inflight_[id] = [done](Status st) { done(std::move(st)); };
    return id;
  }
  // Completes call `id` unless it was cancelled; returns whether it was still in flight.
  bool finish(uint64_t id) { return inflight_.erase(id) != 0; }

  void whenReady(std::function<void(Status)> fn) {
    if (ready_ || !init_error_.isOk()) {
      fn(init_error_);
    } else {
      on_ready_.push_back(std::move(fn));
    }
  }

  void onConnected(Status st) {
    if (st.isOk()) return;  // ready once the watch delivered its first snapshot
    init_error_ = st;
    auto waiting = std::move(on_ready_);
    on_ready_.clear();
    for (auto& fn : waiting) fn(st);
  }

  // The watch resumed after a break: leases that lapsed during an outage are renewed by their
  // agents (a fresh lease, the alive keys put again) once etcd is back, so deaths wait that long.
  // The agent gets a snapshot, as after a reconnect of the gRPC watch.
  void onResumed() {
    grace_until_ = std::chrono::steady_clock::now() + 2 * std::chrono::seconds(lease_ttl_) +
                   std::chrono::seconds(1);
    if (sink_) {
      for (const auto& change : state().watchSnapshot(o_.run_id)) sink_(change);
    }
  }

  void onWatchError(const Status& st) {
    if (ready_ || !init_error_.isOk()) return;
    onConnected(st);
  }

  // A full picture of the prefix (first sync, or after the watch was re-established).
  void onSync(std::vector<mvccpb::KeyValue> kvs, int64_t revision) {
    kv_.clear();
    kv_bytes_ = 0;
    alive_.clear();
    auto state_value = std::make_shared<const std::string>();
    for (mvccpb::KeyValue& kv : kvs) {
      if (kv.key() == state_key_) {
        state_value = std::make_shared<const std::string>(std::move(*kv.mutable_value()));
        state_rev_ = kv.mod_revision();
      } else if (startsWith(kv.key(), kv_prefix_)) {
        mirrorKv(kv.key().substr(kv_prefix_.size()), std::move(*kv.mutable_value()));
      } else if (startsWith(kv.key(), alive_prefix_)) {
        alive_.insert(kv.key().substr(alive_prefix_.size()));
      }
    }
    seen_rev_ = revision;
    // Changes may have gone by unseen (a first sync, a compacted revision): joins pending here
    // learn where they stand from the whole state once, not from the answers of later changes.
    for (auto& [id, j] : joins_) j.check_state = true;
    loadState(std::move(state_value), /*push=*/false);
    const bool first = !ready_;
    if (!first) {
      // The watch broke (a member or all of etcd went away). Leases that lapsed during an outage
      // are renewed by their agents (a fresh lease, the alive keys put again) once etcd is back:
      // give them that long before declaring anyone dead.
      grace_until_ = std::chrono::steady_clock::now() + 2 * std::chrono::seconds(lease_ttl_) +
                     std::chrono::seconds(1);
    }
    ready_ = true;
    if (first) {
      auto waiting = std::move(on_ready_);
      on_ready_.clear();
      for (auto& fn : waiting) fn(Status::ok());
    }
    if (sink_) {
      for (const auto& change : state().watchSnapshot(o_.run_id)) sink_(change);
    }
    // A node whose lease expired while nobody watched: dead now (or after the grace).
    checkAlive();
    reevaluate();
  }

  // Declares every node of the state without an alive key dead, unless a grace after an outage
  // runs: then once it ended.
  void checkAlive() {
    if (std::chrono::steady_clock::now() < grace_until_) {
      grace_timer_.expires_at(grace_until_);
      std::weak_ptr<Impl> weak = weak_from_this();
      grace_timer_.async_wait([this, weak](const boost::system::error_code& ec) {
        if (!ec && !weak.expired()) checkAlive();
      });
      return;
    }
    for (const std::string& node : state().nodeIds(o_.run_id)) {
      if (alive_.count(node) == 0) declareDead(node);
    }
  }

  struct Event {
    bool put = true;
    std::string key;
    std::shared_ptr<const std::string> value;  // shared with the worker's copy of the state
    int64_t mod_revision = 0;
  };

  void onEvents(std::vector<Event> events, int64_t revision) {
    seen_rev_ = std::max(seen_rev_, revision);
    for (Event& ev : events) {
      if (ev.key == state_key_) {
        state_rev_ = ev.mod_revision;
        loadState(ev.put ? std::move(ev.value) : std::make_shared<const std::string>(),
                  /*push=*/true);
      } else if (startsWith(ev.key, kv_prefix_)) {
        const std::string key = ev.key.substr(kv_prefix_.size());
        if (ev.put) {
          mirrorKv(key, *ev.value);
        } else {
          forgetKv(key);
        }
      } else if (startsWith(ev.key, alive_prefix_)) {
        const std::string node = ev.key.substr(alive_prefix_.size());
        if (ev.put) {
          alive_.insert(node);
          dead_asked_.erase(node);
        } else {
          alive_.erase(node);
          checkAlive();
        }
      }
    }
    reevaluate();
  }

  // A new value of the state key. Only its header is read here (O(changes)); the snapshot is
  // parsed when something needs the state, and a joiner waiting for its round looks up its call
  // in the join answers the value carries.
  void loadState(std::shared_ptr<const std::string> value, bool push) {
    auto parsed = StateValue::parse(std::move(value));
    if (!parsed.isOk()) {
      log()->error("etcd rendezvous: {} at {}", parsed.status().message(), state_key_);
      return;
    }
    current_ = std::move(parsed).value();
    next_deadline_ = current_.nextDeadline();
    dirty_ = true;
    if (push) {
      if (sink_) {
        for (const auto& change : current_.changes()) sink_(change);
      }
      answerJoins(current_);
    }
  }

  // Pending joins that the transaction which wrote `value` answered.
  void answerJoins(const StateValue& value) {
    std::vector<std::pair<Done<rendezvous::RoundInfo>, StatusOr<rendezvous::RoundInfo>>> answered;
    for (auto it = joins_.begin(); it != joins_.end();) {
      auto answer = value.joinAnswer(it->second.call);
      if (!answer || !finish(it->first)) {
        ++it;
        continue;
      }
      answered.emplace_back(std::move(it->second.done), std::move(*answer));
      it = joins_.erase(it);
    }
    for (auto& [done, answer] : answered) done(std::move(answer));
  }

  // The run as last pushed, parsed on first use after each push.
  RendezvousState& state() {
    if (dirty_) {
      dirty_ = false;
      StatusOr<std::string> snapshot = current_.snapshot();
      Status st =
          snapshot.isOk() ? cached_.importRun(o_.run_id, snapshot.value()) : snapshot.status();
      if (!st.isOk()) log()->error("etcd rendezvous: {}", st.message());
    }
    return cached_;
  }

  void declareDead(const std::string& node) {
    if (std::chrono::steady_clock::now() < grace_until_) return checkAlive();
    if (dead_asked_.count(node) != 0) return;
    dead_asked_.insert(node);
    log()->info("etcd rendezvous: the lease of node {} expired", node);
    applyAsync<bool>(
        [node, run = o_.run_id](RendezvousState& st, TimePoint now) -> StatusOr<bool> {
          (void)st.declareDead(run, node, now);
          return true;
        },
        [](StatusOr<bool>) {}, o_.connect_for);
  }

  void reevaluate() {
    // Joins that may have been answered by a change this agent saw before it knew of the join
    // (or that went by unseen): where they stand is read from the state, once. Every other
    // pending join is answered by the change that answers it (answerJoins).
    std::vector<std::pair<Done<rendezvous::RoundInfo>, StatusOr<rendezvous::RoundInfo>>> answered;
    for (auto it = joins_.begin(); it != joins_.end();) {
      PendingJoin& j = it->second;
      if (inflight_.count(it->first) == 0) {
        it = joins_.erase(it);
        continue;
      }
      if (!j.check_state || (state_rev_ < j.revision && seen_rev_ < j.revision)) {
        ++it;
        continue;
      }
      auto outcome = state().joinOutcome(o_.run_id, j.node_id);
      if (outcome.isOk() && !outcome.value()) {
        j.check_state = false;  // still pending: a later change answers it
        ++it;
        continue;
      }
      finish(it->first);
      if (outcome.isOk()) {
        answered.emplace_back(std::move(j.done), std::move(*outcome.value()));
      } else {
        answered.emplace_back(std::move(j.done), outcome.status());
      }
      it = joins_.erase(it);
    }
    for (auto& [done, answer] : answered) done(std::move(answer));
    // Master waits.
    for (auto it = master_waits_.begin(); it != master_waits_.end();) {
      if (inflight_.count(it->first) == 0) {
        it = master_waits_.erase(it);
        continue;
      }
      std::optional<StatusOr<rendezvous::MasterAddress>> answer = masterAnswer(it->second.round);
      if (!answer) {
        ++it;
        continue;
      }
      auto done = std::move(it->second.done);
      finish(it->first);
      it = master_waits_.erase(it);
      done(std::move(*answer));
    }
    // Key waits.
    for (auto it = kv_waits_.begin(); it != kv_waits_.end();) {
      if (inflight_.count(it->first) == 0) {
        it = kv_waits_.erase(it);
        continue;
      }
      auto values = kvAnswer(it->second.keys);
      if (!values) {
        ++it;
        continue;
      }
      auto done = std::move(it->second.done);
      finish(it->first);
      it = kv_waits_.erase(it);
      done(std::move(*values));
    }
    scheduleTick();
  }

  std::optional<StatusOr<rendezvous::MasterAddress>> masterAnswer(uint64_t round) {
    if (auto m = state().masterOf(o_.run_id, round)) return StatusOr<rendezvous::MasterAddress>(*m);
    auto st = state().status(o_.run_id);
    if (st.isOk() && st.value().closed) {
      return StatusOr<rendezvous::MasterAddress>(
          failedPrecondition("run " + o_.run_id + " is closed"));
    }
    if (st.isOk() && st.value().completed_round > round) {
      return StatusOr<rendezvous::MasterAddress>(
          Status(StatusCode::kAborted, "round " + std::to_string(round) + " of run " + o_.run_id +
                                           " was superseded before its master was published"));
    }
    return std::nullopt;
  }

  std::optional<std::vector<std::string>> kvAnswer(const std::vector<std::string>& keys) const {
    std::vector<std::string> values;
    for (const std::string& k : keys) {
      auto it = kv_.find(k);
      if (it == kv_.end()) return std::nullopt;
      values.push_back(it->second);
    }
    return values;
  }

  // Any agent applies the state's deadlines (last calls, join timeouts) when they come; the
  // transaction makes sure only one of them writes. A tick that changed nothing is not repeated
  // for the same deadline sooner than a second later.
  void scheduleTick() {
    auto next = next_deadline_;
    if (!next) {
      tick_timer_.cancel();
      return;
    }
    Duration wait = *next - wallNow();
    if (wait < Duration::zero()) wait = Duration::zero();
    if (last_tick_for_ && *next <= *last_tick_for_) {
      wait = std::max<Duration>(wait, std::chrono::seconds(1));
    }
    wait += std::chrono::milliseconds(rng_() % 20);  // spread the herd a little
    const TimePoint target = *next;
    tick_timer_.expires_after(wait);
    std::weak_ptr<Impl> weak = weak_from_this();
    tick_timer_.async_wait([this, weak, target](const boost::system::error_code& ec) {
      if (ec || weak.expired()) return;
      last_tick_for_ = target;
      applyAsync<bool>(
          [](RendezvousState& st, TimePoint now) -> StatusOr<bool> {
            st.tick(now);
            return true;
          },
          [](StatusOr<bool>) {}, o_.rpc_timeout);
    });
  }

  // ---- the worker's side -----------------------------------------------------------------

  void submit(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_all();
  }

  void workerLoop() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
        if (stopping_) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }

  void post(const std::weak_ptr<Impl>& weak, std::function<void()> fn) {
    boost::asio::post(io_, [weak, fn = std::move(fn)] {
      if (weak.expired()) return;
      fn();
    });
  }

  // Sleeps up to `d` unless the service stops; returns false when it stops.
  bool pause(Duration d) {
    std::unique_lock<std::mutex> lock(mu_);
    return !cv_.wait_for(lock, d, [&] { return stopping_; });
  }

  bool stopping() {
    std::lock_guard<std::mutex> lock(mu_);
    return stopping_;
  }

  // Retries `call` while etcd is unreachable, for up to `retry_for`.
  template <typename Call>
  Status retrying(Duration retry_for, Call call) {
    const auto deadline = std::chrono::steady_clock::now() + retry_for;
    for (;;) {
      Status st = call();
      if (st.code() != StatusCode::kUnavailable && st.code() != StatusCode::kDeadlineExceeded) {
        return st;
      }
      if (std::chrono::steady_clock::now() >= deadline || !pause(std::chrono::milliseconds(250))) {
        return st;
      }
    }
  }

  // First contact: a v3 member answers with its version, and this agent gets its lease.
  Status connect() {
    StatusOr<std::string> version = unavailable("not tried");
    Status st = retrying(o_.connect_for, [&] {
      version = client_.version();
      return version.status();
    });
    if (!st.isOk()) {
      if (st.code() == StatusCode::kUnimplemented) {
        return unavailable("etcd at " + client_.membersText() + " does not serve the v3 API (" +
                           st.message() + "); etcd-v3 needs etcd 3.x with the v3 API on");
      }
      return st;
    }
    const std::string& v = version.value();
    if (v.empty() || v[0] < '3') {
      return failedPrecondition("etcd at " + client_.membersText() + " is version " + v +
                                "; etcd-v3 needs etcd 3.x");
    }
    log()->info("etcd rendezvous: etcd {} at {}, key prefix {}", v, client_.membersText(), prefix_);
    // A read of the run's state: credentials and permissions on the prefix are checked here,
    // before anything waits on the watch.
    ep::RangeRequest probe;
    probe.set_key(state_key_);
    probe.set_keys_only(true);
    ep::RangeResponse probe_resp;
    st = retrying(o_.connect_for, [&] { return client_.range(probe, &probe_resp); });
    if (!st.isOk()) return st;
    StatusOr<int64_t> lease = unavailable("not tried");
    st = retrying(o_.connect_for, [&] {
      lease = client_.leaseGrant(lease_ttl_);
      return lease.status();
    });
    if (!st.isOk()) return st;
    lease_ = lease.value();
    watcher_ = std::thread([this] { watchLoop(); });
    keeper_ = std::thread([this] { keepAliveLoop(); });
    return Status::ok();
  }

  // The watch: a full sync (a range of the prefix) once, then a watch from the revision after
  // it. When the stream breaks (a member went away, etcd restarted), the next watch resumes at the
  // revision after the last event seen, on the next member, so no round change is lost across
  // the break; only a compacted revision forces a full sync again.
  //
  // A store that went back (etcd restarted on an empty or older data directory, or another
  // cluster behind the same address) is noticed from the headers etcd sends: a cluster id other
  // than the one seen, or a revision below one seen. The watch would otherwise wait at a
  // revision the new store never reaches (every change unseen, joins never answered, the exit
  // barrier waited out): the run is read again as on a first sync, and the agents re-join.
  void watchLoop() {
    std::weak_ptr<Impl> weak = weak_from_this();
    int64_t next_rev = 0;  // 0: a full sync is needed
    bool resumed = false;  // this stream continues an earlier one
    int refused = 0;       // streams in a row that ended before etcd created the watch
    StoreIdentity store;   // what the headers said so far
    while (!stopping()) {
      if (next_rev == 0) {
        ep::RangeRequest range;
        range.set_key(prefix_);
        range.set_range_end(prefixEnd(prefix_));
        ep::RangeResponse resp;
        Status st = client_.range(range, &resp);
        if (!st.isOk()) {
          log()->debug("etcd rendezvous: sync failed: {}", st.message());
          if (st.code() != StatusCode::kUnavailable && st.code() != StatusCode::kDeadlineExceeded &&
              st.code() != StatusCode::kCancelled) {
            // Credentials or permissions: waiting will not help; callers get the error.
            post(weak, [this, st] { onWatchError(st); });
          }
          if (!pause(std::chrono::milliseconds(250))) return;
          continue;
        }
        const int64_t revision = resp.header().revision();
        if (auto why = store.wentBack(resp.header())) forgetStore(*why);
        store.note(resp.header());
        std::vector<mvccpb::KeyValue> kvs(resp.kvs().begin(), resp.kvs().end());
        bool has_state = false;
        for (const mvccpb::KeyValue& kv : kvs) {
          if (kv.key() != state_key_) continue;
          noteStored(std::make_shared<const std::string>(kv.value()), kv.mod_revision(), revision);
          has_state = true;
        }
        if (!has_state) noteStored(std::make_shared<const std::string>(), 0, revision);
        post(weak, [this, kvs = std::move(kvs), revision]() mutable {
          onSync(std::move(kvs), revision);
        });
        next_rev = revision + 1;
        resumed = false;
      }

      grpc::ClientContext ctx;
      // A member cut off from its cluster's leader ends the watch instead of going quiet.
      ctx.AddMetadata("hasleader", "true");
      auto stream = client_.openWatch(&ctx);
      ep::WatchRequest req;
      ep::WatchCreateRequest* create = req.mutable_create_request();
      create->set_key(prefix_);
      create->set_range_end(prefixEnd(prefix_));
      create->set_start_revision(next_rev);
      bool created = false;
      if (stream->Write(req)) {
        ep::WatchResponse wr;
        while (stream->Read(&wr)) {
          if (auto why = store.wentBack(wr.header())) {
            forgetStore(*why);
            store = StoreIdentity{};
            next_rev = 0;
            break;
          }
          store.note(wr.header());
          created = created || wr.created();
          if (wr.compact_revision() != 0) {
            log()->warn("etcd rendezvous: revision {} was compacted; syncing the whole run again",
                        next_rev);
            next_rev = 0;
            break;
          }
          if (wr.canceled()) break;
          if (wr.created() && resumed) {
            post(weak, [this] { onResumed(); });
          }
          if (wr.events_size() == 0) continue;
          std::vector<Event> events;
          for (mvccpb::Event& e : *wr.mutable_events()) {
            Event ev;
            ev.put = e.type() == mvccpb::Event::PUT;
            ev.key = e.kv().key();
            ev.value = std::make_shared<const std::string>(
                ev.put ? std::move(*e.mutable_kv()->mutable_value()) : std::string());
            ev.mod_revision = e.kv().mod_revision();
            next_rev = std::max(next_rev, ev.mod_revision + 1);
            if (ev.key == state_key_) {
              noteStored(ev.value, ev.put ? ev.mod_revision : 0, ev.mod_revision);
            }
            events.push_back(std::move(ev));
          }
          const int64_t rev = wr.header().revision();
          post(weak, [this, events = std::move(events), rev]() mutable {
            onEvents(std::move(events), rev);
          });
        }
      }
      ctx.TryCancel();
      grpc::Status fin = stream->Finish();
      client_.release(&ctx);
      if (stopping()) return;
      refused = created ? 0 : refused + 1;
      // While no member answers, one line says so (not one per attempt), and the attempts slow
      // down to one a second.
      log()->log(refused <= 1 ? spdlog::level::info : spdlog::level::debug,
                 "etcd rendezvous: watch ended ({}); {} on the next member", fin.error_message(),
                 next_rev == 0 ? std::string("reading the whole run again")
                               : "resuming at revision " + std::to_string(next_rev));
      resumed = true;
      client_.rotate();
      const auto wait = std::chrono::milliseconds(100 << std::min(refused, 4));
      if (!pause(std::min<Duration>(wait, std::chrono::seconds(1)))) return;
    }
  }

  // The cluster id and the highest revision the headers of one store carried.
  struct StoreIdentity {
    uint64_t cluster_id = 0;
    int64_t revision = 0;
    // Why `h` is not of this store (or of it gone back in time); nullopt when it may be.
    std::optional<std::string> wentBack(const ep::ResponseHeader& h) const {
      if (cluster_id != 0 && h.cluster_id() != 0 && h.cluster_id() != cluster_id) {
        return "its cluster id changed from " + std::to_string(cluster_id) + " to " +
               std::to_string(h.cluster_id());
      }
      if (h.revision() != 0 && h.revision() < revision) {
        return "it is at revision " + std::to_string(h.revision()) + ", before the revision " +
               std::to_string(revision) + " this agent saw";
      }
      return std::nullopt;
    }
    void note(const ep::ResponseHeader& h) {
      if (h.cluster_id() != 0) cluster_id = h.cluster_id();
      revision = std::max(revision, h.revision());
    }
  };

  // The store went back: nothing read from the old one is kept for transactions, and the loop
  // forgets the revisions it had seen (the full sync that follows brings the new store's).
  void forgetStore(const std::string& why) {
    log()->warn(
        "etcd rendezvous: etcd's store went back ({}: restarted on an empty or older data "
        "directory?); reading the run again, and the nodes join again",
        why);
    {
      std::lock_guard<std::mutex> lock(stored_mu_);
      stored_ = Stored{};
    }
    std::weak_ptr<Impl> weak = weak_from_this();
    post(weak, [this] {
      state_rev_ = 0;
      seen_rev_ = 0;
      for (auto& [id, j] : joins_) {
        j.revision = 0;
        j.check_state = true;
      }
    });
  }

  void keepAliveLoop() {
    const auto period = std::chrono::milliseconds(lease_ttl_ * 1000 / 4);
    while (pause(period)) {
      StatusOr<int64_t> ttl = client_.leaseKeepAliveOnce(lease_.load());
      if (!ttl.isOk()) {
        log()->debug("etcd rendezvous: lease keep-alive: {}", ttl.status().message());
        continue;
      }
      if (ttl.value() > 0) continue;
      (void)replaceLease(lease_.load());
    }
  }

  // The lease `lost` expired (etcd unreachable too long; others may have declared this node
  // dead): a new lease keeps the node ids alive again, and the agent re-joins when it sees
  // NOT_FOUND. Taken once, however many threads (the keeper, a transaction) saw `lost` go.
  Status replaceLease(int64_t lost) {
    std::lock_guard<std::mutex> renewing(lease_mu_);
    if (lease_.load() != lost) return Status::ok();  // replaced already
    log()->warn("etcd rendezvous: this agent's lease expired; taking a new one");
    StatusOr<int64_t> fresh = client_.leaseGrant(lease_ttl_);
    if (!fresh.isOk()) return fresh.status();
    lease_ = fresh.value();
    std::vector<std::string> nodes;
    {
      std::lock_guard<std::mutex> lock(mu_);
      nodes.assign(my_nodes_.begin(), my_nodes_.end());
    }
    for (const std::string& node : nodes) (void)putAliveUnder(node, fresh.value());
    return Status::ok();
  }

  // Runs `call` with this agent's lease; when etcd answers that the lease is gone (it expired
  // while etcd was down, and the keeper has not noticed yet), once more under a fresh one.
  template <typename Call>
  Status underLease(Call call) {
    const int64_t lease = lease_.load();
    Status st = call(lease);
    // etcd's only NOT_FOUND: ErrGRPCLeaseNotFound.
    if (st.code() != StatusCode::kNotFound) return st;
    Status renewed = replaceLease(lease);
    if (!renewed.isOk()) return renewed;
    return call(lease_.load());
  }

  // The newest value of the state key this agent has seen (watch, reads, its own transactions),
  // kept for the first attempt of applyTxn. `revision`: the store revision it was current at.
  void noteStored(std::shared_ptr<const std::string> value, int64_t mod, int64_t revision) {
    std::lock_guard<std::mutex> lock(stored_mu_);
    if (stored_.value && revision < stored_.revision) return;
    stored_.value = std::move(value);
    stored_.mod = mod;
    stored_.revision = revision;
  }

  Status putAlive(const std::string& node) {
    return underLease([&](int64_t lease) { return putAliveUnder(node, lease); });
  }

  Status putAliveUnder(const std::string& node, int64_t lease) {
    ep::PutRequest put;
    put.set_key(alive_prefix_ + node);
    put.set_value("1");
    put.set_lease(lease);
    ep::PutResponse resp;
    return client_.put(put, &resp);
  }

  struct Applied {
    RendezvousState::Outbox out;
    int64_t revision = 0;
  };

  // Applies `fn` to the stored run in a transaction: read (state, mod_revision), import, apply,
  // export, write back if the key still has that mod_revision; on conflict, again with the value
  // the failed transaction returned. Nothing is written when nothing changed.
  // `alive_node`: a node id whose alive key (under this agent's lease) is put in the same
  // transaction (a join: one round trip and one fsync less than a put of its own).
  // The first attempt starts from the state this agent already holds (the watch's latest, or
  // what its own last transaction wrote or was refused with): no read before the write, so a
  // request whose state is current costs one round trip. A stale copy only costs a refused
  // transaction, which returns the current state. A decision to write nothing is taken only on
  // a state read from etcd, never on the held copy.
  template <typename Fn>
  StatusOr<Applied> applyTxn(Fn&& fn, Duration retry_for, const std::string& alive_node = "") {
    std::shared_ptr<const std::string> value;
    int64_t mod = 0;
    int64_t revision = 0;
    bool have = false;
    bool held = false;  // `value` is the held copy, not a read
    {
      std::lock_guard<std::mutex> lock(stored_mu_);
      if (stored_.value) {
        value = stored_.value;
        mod = stored_.mod;
        revision = stored_.revision;
        have = held = true;
      }
    }
    for (int attempt = 0;; ++attempt) {
      if (stopping()) return Status(StatusCode::kCancelled, "the rendezvous service stopped");
      if (!have) {
        ep::RangeRequest range;
        range.set_key(state_key_);
        ep::RangeResponse resp;
        Status st = retrying(retry_for, [&] { return client_.range(range, &resp); });
        if (!st.isOk()) return st;
        value = std::make_shared<const std::string>(
            resp.kvs_size() > 0 ? std::move(*resp.mutable_kvs(0)->mutable_value()) : std::string());
        mod = resp.kvs_size() > 0 ? resp.kvs(0).mod_revision() : 0;
        revision = resp.header().revision();
        noteStored(value, mod, revision);
        held = false;
      }
      auto old = StateValue::parse(value);
      StatusOr<std::string> old_snapshot =
          old.isOk() ? old->snapshot() : StatusOr<std::string>(old.status());
      RendezvousState state;
      Status imported = old_snapshot.isOk() ? state.importRun(o_.run_id, old_snapshot.value())
                                            : old_snapshot.status();
      if (!imported.isOk()) {
        if (held) {  // read what etcd holds instead
          have = held = false;
          continue;
        }
        return imported;
      }
      fn(state, wallNow());
      Applied applied;
      applied.out = state.drain();
      const std::string snapshot = state.exportRun(o_.run_id);
      if (snapshot == old_snapshot.value() && applied.out.changes.empty()) {
        if (held) {
          have = held = false;
          continue;
        }
        applied.revision = revision;
        if (!alive_node.empty()) {
          Status st = retrying(retry_for, [&] { return putAlive(alive_node); });
          if (!st.isOk()) return st;
        }
        return applied;
      }
      ep::TxnRequest txn;
      ep::Compare* cmp = txn.add_compare();
      cmp->set_key(state_key_);
      cmp->set_result(ep::Compare::EQUAL);
      if (mod == 0) {
        cmp->set_target(ep::Compare::CREATE);
        cmp->set_create_revision(0);
      } else {
        cmp->set_target(ep::Compare::MOD);
        cmp->set_mod_revision(mod);
      }
      ep::PutRequest* put = txn.add_success()->mutable_request_put();
      put->set_key(state_key_);
      // The deadlines a fresh import sees (the applying state also holds stale ones).
      RendezvousState reread;
      std::optional<TimePoint> next_deadline;
      if (reread.importRun(o_.run_id, snapshot).isOk()) next_deadline = reread.nextDeadline();
      auto written = std::make_shared<const std::string>(
          encodeStateValue(applied.out.changes, applied.out.joins, snapshot, next_deadline));
      put->set_value(*written);
      ep::PutRequest* alive = nullptr;
      if (!alive_node.empty()) {
        alive = txn.add_success()->mutable_request_put();
        alive->set_key(alive_prefix_ + alive_node);
        alive->set_value("1");
      }
      txn.add_failure()->mutable_request_range()->set_key(state_key_);
      ep::TxnResponse resp;
      Status st = retrying(retry_for, [&] {
        if (alive == nullptr) return client_.txn(txn, &resp);
        return underLease([&](int64_t lease) {
          alive->set_lease(lease);
          return client_.txn(txn, &resp);
        });
      });
      if (!st.isOk()) return st;
      if (resp.succeeded()) {
        applied.revision = resp.header().revision();
        noteStored(std::move(written), applied.revision, applied.revision);
        return applied;
      }
      // Another agent wrote first (or the held copy was stale): apply to what etcd holds.
      ep::RangeResponse* now = resp.mutable_responses(0)->mutable_response_range();
      value = std::make_shared<const std::string>(
          now->kvs_size() > 0 ? std::move(*now->mutable_kvs(0)->mutable_value()) : std::string());
      mod = now->kvs_size() > 0 ? now->kvs(0).mod_revision() : 0;
      revision = resp.header().revision();
      noteStored(value, mod, revision);
      have = true;
      held = false;
      if (attempt > 0 && attempt % 50 == 0) {
        log()->warn("etcd rendezvous: {} conflicting transactions in a row on {}", attempt,
                    state_key_);
      }
    }
  }

  // Runs `fn` on the stored state on the worker; `done` gets what `fn` returned (or the error of
  // the transaction) on the loop.
  template <typename T>
  void applyAsync(std::function<StatusOr<T>(RendezvousState&, TimePoint)> fn,
                  std::function<void(StatusOr<T>)> done, Duration retry_for) {
    const uint64_t id = track<T>(done);
    std::weak_ptr<Impl> weak = weak_from_this();
    submit([this, weak, fn = std::move(fn), done = std::move(done), id, retry_for] {
      StatusOr<T> result = unavailable("not applied");
      auto applied =
          applyTxn([&](RendezvousState& st, TimePoint now) { result = fn(st, now); }, retry_for);
      if (!applied.isOk()) result = applied.status();
      post(weak, [this, done, id, result = std::move(result)]() mutable {
        if (finish(id)) done(std::move(result));
      });
    });
  }

  Duration retryFor(const rendezvous::CallPolicy& p) const {
    return p.retry_for.value_or(o_.connect_for);
  }

  // ---- the operations --------------------------------------------------------------------

  void join(rendezvous::JoinRequest req, Done<rendezvous::RoundInfo> done) {
    if (req.node_id.empty()) {
      char id[32];
      std::snprintf(id, sizeof(id), "%d-%08x", static_cast<int>(getpid()),
                    static_cast<unsigned>(rng_()));
      req.node_id = thisHostName() + "-" + id;
    }
    req.config.heartbeat_interval = kNoHeartbeatExpiry;
    req.config.heartbeat_misses = 1;
    const uint64_t call = rng_();
    const uint64_t id = track<rendezvous::RoundInfo>(done);
    std::weak_ptr<Impl> weak = weak_from_this();
    whenReady([this, weak, req, call, id, done](Status ready) {
      if (!ready.isOk()) {
        if (finish(id)) done(ready);
        return;
      }
      submit([this, weak, req, call, id, done] {
        {
          std::lock_guard<std::mutex> lock(mu_);
          my_nodes_.insert(req.node_id);
        }
        std::optional<StatusOr<rendezvous::RoundInfo>> result;
        // The node and its alive key appear in one transaction: no reader sees one without the
        // other.
        StatusOr<Applied> applied =
            applyTxn([&](RendezvousState& st, TimePoint now) { st.join(call, req, now); },
                     o_.connect_for, req.node_id);
        if (!applied.isOk()) {
          result = applied.status();
        } else {
          for (auto& j : applied.value().out.joins) {
            if (j.id == call) result = std::move(j.result);
          }
        }
        const int64_t revision = applied.isOk() ? applied.value().revision : 0;
        post(weak, [this, req, call, id, done, result = std::move(result), revision]() mutable {
          if (inflight_.count(id) == 0) return;
          if (result) {
            finish(id);
            done(std::move(*result));
            return;
          }
          PendingJoin pending;
          pending.node_id = req.node_id;
          pending.call = call;
          pending.revision = revision;
          // Changes newer than the join's own transaction already went by: one of them may
          // have answered it.
          pending.check_state = state_rev_ > revision;
          pending.done = done;
          joins_[id] = std::move(pending);
          // A local bound in case the state's own join timeout is never applied.
          auto timer = std::make_shared<boost::asio::steady_timer>(io_);
          timer->expires_after(req.join_timeout + std::chrono::seconds(5));
          std::weak_ptr<Impl> w = weak_from_this();
          timer->async_wait([this, w, id, timer, req](const boost::system::error_code& ec) {
            if (ec || w.expired()) return;
            auto it = joins_.find(id);
            if (it == joins_.end() || !finish(id)) return;
            auto d = std::move(it->second.done);
            joins_.erase(it);
            d(deadlineExceeded(std::string(rendezvous::kJoinTimeoutExpired) + "a round of run " +
                               o_.run_id));
          });
          reevaluate();
        });
      });
    });
  }

  void heartbeat(const std::string& node, Done<rendezvous::RunStatus> done) {
    whenReady([this, node, done](Status ready) {
      if (!ready.isOk()) return done(ready);
      auto ids = state().nodeIds(o_.run_id);
      if (std::find(ids.begin(), ids.end(), node) == ids.end()) {
        auto st = state().status(o_.run_id);
        if (st.isOk() && st.value().closed) return done(st);
        return done(notFound("node " + node + " is not part of run " + o_.run_id +
                             " (declared dead, left, or never joined); join again"));
      }
      done(state().status(o_.run_id));
    });
  }

  void leave(const std::string& node, rendezvous::CallPolicy policy, StatusDone done) {
    const uint64_t id = track<bool>([done](StatusOr<bool> r) { done(r.status()); });
    std::weak_ptr<Impl> weak = weak_from_this();
    const Duration retry = retryFor(policy);
    submit([this, weak, node, id, done, retry] {
      Status result = Status::ok();
      auto applied = applyTxn(
          [&](RendezvousState& st, TimePoint now) {
            result = st.leave(o_.run_id, node, now);
            if (result.code() == StatusCode::kNotFound) result = Status::ok();
          },
          retry);
      if (!applied.isOk()) result = applied.status();
      ep::DeleteRangeRequest del;
      del.set_key(alive_prefix_ + node);
      (void)client_.deleteRange(del);
      {
        std::lock_guard<std::mutex> lock(mu_);
        my_nodes_.erase(node);
      }
      post(weak, [this, id, done, result] {
        if (finish(id)) done(result);
      });
    });
  }

  void reportFailure(const std::string& node, uint64_t round, Done<uint64_t> done) {
    applyAsync<uint64_t>(
        [node, round, run = o_.run_id](RendezvousState& st, TimePoint now) {
          return st.reportFailure(run, node, round, now);
        },
        done, o_.connect_for);
  }

  void close(rendezvous::CallPolicy policy, StatusDone done) {
    applyAsync<bool>(
        [run = o_.run_id](RendezvousState& st, TimePoint now) -> StatusOr<bool> {
          Status s = st.close(run, now);
          if (s.code() == StatusCode::kNotFound) return true;  // nothing to close
          if (!s.isOk()) return s;
          return true;
        },
        [done](StatusOr<bool> r) { done(r.status()); }, retryFor(policy));
  }

  void publishMaster(const std::string& node, uint64_t round, rendezvous::MasterAddress master,
                     StatusDone done) {
    applyAsync<bool>(
        [node, round, master, run = o_.run_id](RendezvousState& st,
                                               TimePoint now) -> StatusOr<bool> {
          Status s = st.publishMaster(run, node, round, master, now);
          if (!s.isOk()) return s;
          return true;
        },
        [done](StatusOr<bool> r) { done(r.status()); }, o_.connect_for);
  }

  void waitMaster(uint64_t round, Duration timeout, Done<rendezvous::MasterAddress> done) {
    const uint64_t id = track<rendezvous::MasterAddress>(done);
    whenReady([this, id, round, timeout, done](Status ready) {
      if (!ready.isOk()) {
        if (finish(id)) done(ready);
        return;
      }
      master_waits_[id] = MasterWait{round, done};
      armTimeout(id, timeout, "waiting for the master address of round " + std::to_string(round));
      reevaluate();
    });
  }

  // Keeps `key` of the run's key-value store, unless it would take the mirror past its bounds
  // (then it is not kept: a warning a minute, with a count).
  void mirrorKv(const std::string& key, std::string value) {
    auto it = kv_.find(key);
    const uint64_t without = kv_bytes_ - (it == kv_.end() ? 0 : key.size() + it->second.size());
    const uint64_t with = without + key.size() + value.size();
    const bool fresh = it == kv_.end();
    if ((fresh && kv_.size() >= o_.max_kv_keys) || with > o_.max_kv_bytes) {
      if (!fresh) {
        kv_.erase(it);
        kv_bytes_ = without;
      }
      if (auto n = kv_log_.note(kv_prefix_, std::chrono::steady_clock::now())) {
        log()->warn(
            "etcd rendezvous: not keeping {} key(s) of {} (the last: {}, {} bytes): this agent "
            "keeps at most {} keys and {} bytes of the run's key-value store (kv_max_keys=, "
            "kv_max_bytes= in --rdzv-conf)",
            *n, kv_prefix_, quotePeerText(key, 100), value.size(), o_.max_kv_keys, o_.max_kv_bytes);
      }
      return;
    }
    kv_[key] = std::move(value);
    kv_bytes_ = with;
  }
  std::pair<uint64_t, uint64_t> mirroredKv() const { return {kv_.size(), kv_bytes_}; }
  void forgetKv(const std::string& key) {
    auto it = kv_.find(key);
    if (it == kv_.end()) return;
    kv_bytes_ -= key.size() + it->second.size();
    kv_.erase(it);
  }

  void kvSet(const std::string& key, const std::string& value, rendezvous::CallPolicy policy,
             StatusDone done) {
    // The bounds every agent mirrors the store within (as the gRPC server's quotas refuse).
    {
      auto it = kv_.find(key);
      const uint64_t without = kv_bytes_ - (it == kv_.end() ? 0 : key.size() + it->second.size());
      if (it == kv_.end() && kv_.size() >= o_.max_kv_keys) {
        done(Status(StatusCode::kResourceExhausted, "the run's key-value store has " +
                                                        std::to_string(kv_.size()) +
                                                        " keys, the most kv_max_keys= allows"));
        return;
      }
      if (without + key.size() + value.size() > o_.max_kv_bytes) {
        done(Status(StatusCode::kResourceExhausted,
                    "the run's key-value store would hold " +
                        std::to_string(without + key.size() + value.size()) +
                        " bytes of keys and values, more than kv_max_bytes=" +
                        std::to_string(o_.max_kv_bytes)));
        return;
      }
    }
    const uint64_t id = track<bool>([done](StatusOr<bool> r) { done(r.status()); });
    std::weak_ptr<Impl> weak = weak_from_this();
    const Duration retry = retryFor(policy);
    submit([this, weak, key, value, id, done, retry] {
      ep::PutRequest put;
      put.set_key(kv_prefix_ + key);
      put.set_value(value);
      ep::PutResponse resp;
      Status st = retrying(retry, [&] { return client_.put(put, &resp); });
      post(weak, [this, id, done, st] {
        if (finish(id)) done(st);
      });
    });
  }

  void kvWait(std::vector<std::string> keys, Duration timeout,
              Done<std::vector<std::string>> done) {
    const uint64_t id = track<std::vector<std::string>>(done);
    whenReady([this, id, keys = std::move(keys), timeout, done](Status ready) mutable {
      if (!ready.isOk()) {
        if (finish(id)) done(ready);
        return;
      }
      kv_waits_[id] = KvWait{std::move(keys), done};
      armTimeout(id, timeout, "waiting for keys of run " + o_.run_id);
      reevaluate();
    });
  }

  void armTimeout(uint64_t id, Duration timeout, std::string what) {
    auto timer = std::make_shared<boost::asio::steady_timer>(io_);
    timer->expires_after(timeout);
    std::weak_ptr<Impl> weak = weak_from_this();
    timer->async_wait([this, weak, id, timer, what](const boost::system::error_code& ec) {
      if (ec || weak.expired()) return;
      auto fail = inflight_.find(id);
      if (fail == inflight_.end()) return;
      auto fn = std::move(fail->second);
      inflight_.erase(fail);
      master_waits_.erase(id);
      kv_waits_.erase(id);
      fn(deadlineExceeded(what + ": timed out"));
    });
  }

  void watch(ChangeSink sink) {
    sink_ = std::move(sink);
    const uint64_t generation = ++watch_generation_;
    whenReady([this, generation](Status ready) {
      if (!ready.isOk() || generation != watch_generation_ || !sink_) return;
      for (const auto& change : state().watchSnapshot(o_.run_id)) sink_(change);
    });
  }

  void stopWatch() {
    sink_ = nullptr;
    ++watch_generation_;
  }

  void cancelAll() {
    // Joins pending in the state are withdrawn there too (as a cancelled gRPC join is).
    for (auto& [id, j] : joins_) {
      if (inflight_.count(id) == 0) continue;
      const uint64_t call = j.call;
      applyAsync<bool>(
          [call](RendezvousState& st, TimePoint now) -> StatusOr<bool> {
            st.cancelJoin(call, now);
            return true;
          },
          [](StatusOr<bool>) {}, o_.rpc_timeout);
    }
    auto calls = std::move(inflight_);
    inflight_.clear();
    joins_.clear();
    master_waits_.clear();
    kv_waits_.clear();
    std::weak_ptr<Impl> weak = weak_from_this();
    for (auto& [id, fail] : calls) {
      post(weak, [fail = std::move(fail)] {
        fail(Status(StatusCode::kCancelled, "cancelled by the agent"));
      });
    }
  }

  Status explain(const Status& st) const {
    if (st.message().find("no etcd member answered") != std::string::npos) return st;
    return Status(st.code(), st.message() + " (etcd members: " + client_.membersText() + ")");
  }

  const std::string& prefix() const { return prefix_; }

 private:
  struct PendingJoin {
    std::string node_id;
    uint64_t call = 0;
    int64_t revision = 0;      // the join's transaction: the cache must be at least this new
    bool check_state = false;  // look at the whole state once (see reevaluate)
    Done<rendezvous::RoundInfo> done;
  };
  struct MasterWait {
    uint64_t round = 0;
    Done<rendezvous::MasterAddress> done;
  };
  struct KvWait {
    std::vector<std::string> keys;
    Done<std::vector<std::string>> done;
  };

  boost::asio::io_context& io_;
  EtcdServiceOptions o_;
  const std::string prefix_, state_key_, kv_prefix_, alive_prefix_;
  EtcdClient client_;
  int64_t lease_ttl_ = 2;
  std::atomic<int64_t> lease_{0};
  std::mutex lease_mu_;  // held while a lost lease is replaced

  // Threads and what they share (guarded by mu_).
  std::thread worker_, watcher_, keeper_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false;
  std::set<std::string> my_nodes_;  // node ids whose alive key this agent keeps
  // The newest state value seen, written by the watch and worker threads, read by the worker.
  struct Stored {
    std::shared_ptr<const std::string> value;  // null: none seen yet
    int64_t mod = 0;                           // its mod_revision (0: no key)
    int64_t revision = 0;                      // the store revision it was read at
  };
  std::mutex stored_mu_;
  Stored stored_;  // guarded by stored_mu_

  // The loop's side: no mutex, the loop thread only.
  std::mt19937_64 rng_;
  bool ready_ = false;
  Status init_error_;
  std::vector<std::function<void(Status)>> on_ready_;
  RendezvousState cached_;  // the run as the watch last delivered it (see state())
  StateValue current_;      // the value it came from, imported into cached_ when dirty_
  bool dirty_ = false;
  std::optional<TimePoint> next_deadline_;
  int64_t state_rev_ = 0;
  int64_t seen_rev_ = 0;
  std::map<std::string, std::string> kv_;
  uint64_t kv_bytes_ = 0;                         // of the keys and values in kv_
  LogThrottle kv_log_{std::chrono::seconds(60)};  // keys not kept
  std::set<std::string> alive_;
  std::set<std::string> dead_asked_;
  ChangeSink sink_;
  uint64_t watch_generation_ = 0;
  uint64_t next_id_ = 1;
  std::map<uint64_t, std::function<void(Status)>> inflight_;
  std::map<uint64_t, PendingJoin> joins_;
  std::map<uint64_t, MasterWait> master_waits_;
  std::map<uint64_t, KvWait> kv_waits_;
  boost::asio::steady_timer tick_timer_;
  std::optional<TimePoint> last_tick_for_;
  std::chrono::steady_clock::time_point grace_until_{};
  boost::asio::steady_timer grace_timer_;
};

EtcdRendezvousService::EtcdRendezvousService(boost::asio::io_context& io,
                                             EtcdServiceOptions options) {
  auto endpoints = splitEtcdEndpoints(options.endpoints);
  std::vector<std::string> eps =
      endpoints.isOk() ? endpoints.value() : std::vector<std::string>{options.endpoints};
  impl_ = std::make_shared<Impl>(io, std::move(options), std::move(eps));
  impl_->start();
}

EtcdRendezvousService::~EtcdRendezvousService() { impl_->stop(); }

void EtcdRendezvousService::join(const rendezvous::JoinRequest& req,
                                 Done<rendezvous::RoundInfo> done) {
  impl_->join(req, std::move(done));
}
void EtcdRendezvousService::heartbeat(const std::string& node_id, rendezvous::CallPolicy,
                                      Done<rendezvous::RunStatus> done) {
  impl_->heartbeat(node_id, std::move(done));
}
void EtcdRendezvousService::leave(const std::string& node_id, rendezvous::CallPolicy policy,
                                  StatusDone done) {
  impl_->leave(node_id, policy, std::move(done));
}
void EtcdRendezvousService::reportFailure(const std::string& node_id, uint64_t round,
                                          Done<uint64_t> done) {
  impl_->reportFailure(node_id, round, std::move(done));
}
void EtcdRendezvousService::close(rendezvous::CallPolicy policy, StatusDone done) {
  impl_->close(policy, std::move(done));
}
void EtcdRendezvousService::publishMaster(const std::string& node_id, uint64_t round,
                                          const rendezvous::MasterAddress& master,
                                          StatusDone done) {
  impl_->publishMaster(node_id, round, master, std::move(done));
}
void EtcdRendezvousService::waitMaster(uint64_t round, Duration timeout,
                                       Done<rendezvous::MasterAddress> done) {
  impl_->waitMaster(round, timeout, std::move(done));
}
void EtcdRendezvousService::kvSet(const std::string& key, const std::string& value,
                                  rendezvous::CallPolicy policy, StatusDone done) {
  impl_->kvSet(key, value, policy, std::move(done));
}
void EtcdRendezvousService::kvWait(const std::vector<std::string>& keys, Duration timeout,
                                   rendezvous::CallPolicy, Done<std::vector<std::string>> done) {
  impl_->kvWait(keys, timeout, std::move(done));
}
std::pair<uint64_t, uint64_t> EtcdRendezvousService::mirroredKv() const {
  return impl_->mirroredKv();
}
void EtcdRendezvousService::watch(const std::string&, ChangeSink on_change) {
  impl_->watch(std::move(on_change));
}
void EtcdRendezvousService::stopWatch() { impl_->stopWatch(); }
void EtcdRendezvousService::cancelAll() { impl_->cancelAll(); }
Status EtcdRendezvousService::explainUnavailable(const Status& status) const {
  return impl_->explain(status);
}
const std::string& EtcdRendezvousService::keyPrefix() const { return impl_->prefix(); }

}  // namespace ddprun::etcd
