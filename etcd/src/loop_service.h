// LoopService: the loop side of EtcdRendezvousService, where its domain logic lives. It answers the
// agent's calls from the run as the watch delivered it (StateCache), turns requests into state
// transactions for the TxnWorker, and reacts to what the Watcher delivers: round changes to the
// agent's ChangeSink, pending joins answered, master and key waits answered, deaths declared for
// alive keys that went, the state's next deadline armed as a tick. The round decisions are the
// rendezvous core's (RendezvousState), the same code the gRPC server runs.
//
// loop_service.cc holds the agent's calls, loop_service_watch.cc the reactions to the watch.
//
// Threading: the agent's loop only (LoopAffinity); the threads of its Backend reach it only
// through posts, which hold a weak_ptr: nothing runs after it is gone. Lifetime: held by
// EtcdRendezvousService in a shared_ptr; stop() before it goes.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "backend.h"
#include "calls.h"
#include "ddprun/common/loop_affinity.h"
#include "ddprun/etcd/rendezvous_service.h"
#include "keys.h"
#include "kv_mirror.h"
#include "liveness.h"
#include "state_cache.h"

namespace ddprun::etcd {

class LoopService : public std::enable_shared_from_this<LoopService> {
 public:
  template <typename T>
  using Done = rendezvous::Service::Done<T>;
  using StatusDone = rendezvous::Service::StatusDone;
  using ChangeSink = rendezvous::Service::ChangeSink;
  using State = rendezvous::RendezvousState;

  LoopService(boost::asio::io_context& io, EtcdServiceOptions options);
  // The first contact (once made by make_shared: posts need the weak_ptr).
  void start();
  void stop();

  void join(rendezvous::JoinRequest req, Done<rendezvous::RoundInfo> done);
  void heartbeat(const std::string& node, Done<rendezvous::RunStatus> done);
  void leave(const std::string& node, rendezvous::CallPolicy policy, StatusDone done);
  void reportFailure(const std::string& node, uint64_t round, rendezvous::FailureKind kind,
                     Done<uint64_t> done);
  void close(rendezvous::CallPolicy policy, StatusDone done);
  void publishMaster(const std::string& node, uint64_t round, rendezvous::MasterAddress master,
                     StatusDone done);
  void waitMaster(uint64_t round, Duration timeout, Done<rendezvous::MasterAddress> done);
  void kvSet(const std::string& key, const std::string& value, rendezvous::CallPolicy policy,
             StatusDone done);
  void kvWait(std::vector<std::string> keys, Duration timeout, Done<std::vector<std::string>> done);
  void kvDeleteRange(const std::string& from, const std::string& to, rendezvous::CallPolicy policy,
                     StatusDone done);
  std::pair<uint64_t, uint64_t> mirroredKv() const { return kv_.size(); }
  void watch(ChangeSink sink);
  void stopWatch();
  void cancelAll();
  Status explain(const Status& st) const;
  const std::string& prefix() const { return keys_.prefix; }

 private:
  struct PendingJoin {
    std::string node_id;
    uint64_t call = 0;
    int64_t revision = 0;      // the join's transaction: the cache must be at least this new
    bool check_state = false;  // look at the whole state once (see answerFromState)
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

  // ---- posting and the calls (loop_service.cc)
  // Runs `fn` on the loop later, unless the service is gone by then.
  void post(std::function<void()> fn);
  // A callback for a thread that hands its argument to `fn` on the loop.
  template <typename T>
  std::function<void(T)> onLoop(std::function<void(T)> fn);
  Watcher::Events watchEvents();
  Duration retryFor(const rendezvous::CallPolicy& p) const;
  // Applies `fn` to the stored run; `done` gets what `fn` returned, on the loop.
  template <typename T>
  void applyAsync(std::function<StatusOr<T>(State&, TimePoint)> fn, Done<T> done,
                  Duration retry_for);
  void onConnected(Status st);
  void onJoinApplied(const rendezvous::JoinRequest& req, uint64_t call, uint64_t id,
                     Done<rendezvous::RoundInfo> done, StatusOr<TxnWorker::Applied> applied);
  // Fails call `id` with DEADLINE_EXCEEDED after `timeout` (a wait's bound).
  void armTimeout(uint64_t id, Duration timeout, std::string what);
  void armJoinBound(uint64_t id, Duration bound);
  std::string newNodeId();

  // ---- what the watch delivers (loop_service_watch.cc)
  void onSync(std::vector<KeyEvent> keys, int64_t revision);
  void onEvents(std::vector<KeyEvent> events, int64_t revision);
  void onAliveEvent(const KeyEvent& ev);
  void onResumed();
  void onWatchError(const Status& st);
  void onStoreWentBack();
  void startGrace();
  // A new value of the state key: its changes pushed and its join answers given (when `push`).
  void loadState(std::shared_ptr<const std::string> value, bool push);
  void pushSnapshot();
  void answerJoins(const StateValue& value);
  void checkAlive();
  void declareDead(const std::string& node);
  // Answers what the state now answers: pending joins, master and key waits; arms the tick.
  void reevaluate();
  void answerFromState();
  void answerMasterWaits();
  void answerKvWaits();
  // Answers and removes each wait of `waits` that `answer` has a value for; drops the cancelled.
  template <typename Wait, typename Answer>
  void answerWaits(std::map<uint64_t, Wait>& waits, Answer answer);
  std::optional<StatusOr<rendezvous::MasterAddress>> masterAnswer(uint64_t round);
  void scheduleTick();
  void tick(TimePoint target);

  boost::asio::io_context& io_;
  const EtcdServiceOptions o_;
  const Keys keys_;
  LoopAffinity loop_{"the etcd rendezvous service"};
  Backend etcd_;  // the client and the threads (backend.h)
  std::mt19937_64 rng_;
  Readiness ready_;
  StateCache cache_;
  KvMirror kv_;
  Liveness live_;
  ChangeSink sink_;
  uint64_t watch_generation_ = 0;
  Calls calls_;
  std::map<uint64_t, PendingJoin> joins_;
  std::map<uint64_t, MasterWait> master_waits_;
  std::map<uint64_t, KvWait> kv_waits_;
  boost::asio::steady_timer tick_timer_;
  std::optional<TimePoint> last_tick_for_;
  boost::asio::steady_timer grace_timer_;
};

}  // namespace ddprun::etcd

namespace ddprun::etcd {

template <typename T>
std::function<void(T)> LoopService::onLoop(std::function<void(T)> fn) {
  return [this, fn = std::move(fn)](T value) {
    post([fn, value = std::move(value)]() mutable { fn(std::move(value)); });
  };
}

template <typename T>
void LoopService::applyAsync(std::function<StatusOr<T>(State&, TimePoint)> fn, Done<T> done,
                             Duration retry_for) {
  const uint64_t id = calls_.track<T>(done);
  etcd_.worker.apply<T>(std::move(fn), retry_for,
                        onLoop<StatusOr<T>>([this, id, done](StatusOr<T> result) {
                          if (calls_.finish(id)) done(std::move(result));
                        }));
}

}  // namespace ddprun::etcd
