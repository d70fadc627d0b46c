// What the watch delivers, on the loop: the run's state, its key-value store and the alive keys
// kept current, and whatever they now answer answered.
#include <boost/asio/steady_timer.hpp>

#include "ddprun/common/strings.h"
#include "log.h"
#include "loop_service.h"

namespace ddprun::etcd {

using rendezvous::MasterAddress;
using rendezvous::RoundInfo;

// A full picture of the prefix (the first sync, or after the watch was established again).
void LoopService::onSync(std::vector<KeyEvent> keys, int64_t revision) {
  loop_.check();
  kv_.clear();
  live_.reset();
  auto state_value = std::make_shared<const std::string>();
  for (KeyEvent& key : keys) {
    if (key.key == keys_.state) {
      state_value = std::move(key.value);
      cache_.noteStateRevision(key.mod_revision);
    } else if (startsWith(key.key, keys_.kv)) {
      kv_.keep(key.key.substr(keys_.kv.size()), *key.value);
    } else if (startsWith(key.key, keys_.alive)) {
      live_.present(key.key.substr(keys_.alive.size()));
    }
  }
  cache_.resetSeen(revision);
  // Changes may have gone by unseen (a first sync, a compacted revision): joins pending here
  // learn where they stand from the whole state once, not from the answers of later changes.
  for (auto& [id, j] : joins_) j.check_state = true;
  loadState(std::move(state_value), /*push=*/false);
  // After a break (a member or all of etcd went away), deaths wait for the grace.
  if (ready_.ready()) startGrace();
  ready_.becomeReady();
  pushSnapshot();
  // A node whose lease expired while nobody watched: dead now (or after the grace).
  checkAlive();
  reevaluate();
}

void LoopService::onEvents(std::vector<KeyEvent> events, int64_t revision) {
  loop_.check();
  cache_.noteSeen(revision);
  for (KeyEvent& ev : events) {
    if (ev.key == keys_.state) {
      cache_.noteStateRevision(ev.mod_revision);
      loadState(ev.put ? std::move(ev.value) : std::make_shared<const std::string>(),
                /*push=*/true);
    } else if (startsWith(ev.key, keys_.kv)) {
      const std::string key = ev.key.substr(keys_.kv.size());
      if (ev.put) {
        kv_.keep(key, *ev.value);
      } else {
        kv_.forget(key);
      }
    } else if (startsWith(ev.key, keys_.alive)) {
      onAliveEvent(ev);
    }
  }
  reevaluate();
}

void LoopService::onAliveEvent(const KeyEvent& ev) {
  const std::string node = ev.key.substr(keys_.alive.size());
  if (ev.put) {
    live_.up(node);
    return;
  }
  live_.down(node);
  checkAlive();
}

// The watch resumed after a break: the agent gets a snapshot, as after a reconnect of the gRPC
// watch, and deaths wait for the grace.
void LoopService::onResumed() {
  loop_.check();
  startGrace();
  pushSnapshot();
}

void LoopService::onWatchError(const Status& st) {
  loop_.check();
  if (ready_.ready() || ready_.failed()) return;
  ready_.fail(st);
}

// The store went back: the revisions seen mean nothing now (the full sync that follows brings
// the new store's), and pending joins look at the whole state again.
void LoopService::onStoreWentBack() {
  loop_.check();
  cache_.forgetRevisions();
  for (auto& [id, j] : joins_) {
    j.revision = 0;
    j.check_state = true;
  }
}

// Leases that lapsed during an outage are renewed by their agents (a fresh lease, the alive keys
// put again) once etcd is back: they get that long before anyone is declared dead.
void LoopService::startGrace() {
  live_.graceUntil(std::chrono::steady_clock::now() + 2 * std::chrono::seconds(etcd_.lease.ttl()) +
                   std::chrono::seconds(1));
}

// Only the header of a new state value is read here (O(changes)); the snapshot is parsed when
// something needs the state, and a joiner waiting for its round looks its call up in the join
// answers the value carries.
void LoopService::loadState(std::shared_ptr<const std::string> value, bool push) {
  Status st = cache_.load(std::move(value));
  if (!st.isOk()) {
    etcdLog()->error("etcd rendezvous: {} at {}", st.message(), keys_.state);
    return;
  }
  if (!push) return;
  if (sink_) {
    for (const auto& change : cache_.value().changes()) sink_(change);
  }
  answerJoins(cache_.value());
}

void LoopService::pushSnapshot() {
  if (!sink_) return;
  for (const auto& change : cache_.state().watchSnapshot(o_.run_id)) sink_(change);
}

// Pending joins that the transaction which wrote `value` answered.
void LoopService::answerJoins(const StateValue& value) {
  std::vector<std::pair<Done<RoundInfo>, StatusOr<RoundInfo>>> answered;
  for (auto it = joins_.begin(); it != joins_.end();) {
    auto answer = value.joinAnswer(it->second.call);
    if (!answer || !calls_.finish(it->first)) {
      ++it;
      continue;
    }
    answered.emplace_back(std::move(it->second.done), std::move(*answer));
    it = joins_.erase(it);
  }
  for (auto& [done, answer] : answered) done(std::move(answer));
}

// Every node of the state without an alive key is declared dead, unless a grace after an outage
// runs: then once it ended.
void LoopService::checkAlive() {
  if (live_.inGrace(std::chrono::steady_clock::now())) {
    grace_timer_.expires_at(live_.graceEnd());
    std::weak_ptr<LoopService> weak = weak_from_this();
    grace_timer_.async_wait([this, weak](const boost::system::error_code& ec) {
      if (!ec && !weak.expired()) checkAlive();
    });
    return;
  }
  for (const std::string& node : live_.missing(cache_.state().nodeIds(o_.run_id))) {
    declareDead(node);
  }
}

// Every agent that sees a lease go applies declareDead; one of them wins the transaction, the
// rest find nothing to do.
void LoopService::declareDead(const std::string& node) {
  if (live_.inGrace(std::chrono::steady_clock::now())) return checkAlive();
  if (!live_.askDead(node)) return;
  etcdLog()->info("etcd rendezvous: the lease of node {} expired", node);
  applyAsync<bool>(
      [node, run = o_.run_id](State& st, TimePoint now) -> StatusOr<bool> {
        (void)st.declareDead(run, node, now);
        return true;
      },
      [](StatusOr<bool>) {}, o_.connect_for);
}

void LoopService::reevaluate() {
  answerFromState();
  answerMasterWaits();
  answerKvWaits();
  scheduleTick();
}

// Joins that may have been answered by a change this agent saw before it knew of the join (or
// that went by unseen): where they stand is read from the state, once. Every other pending join
// is answered by the change that answers it (answerJoins).
void LoopService::answerFromState() {
  std::vector<std::pair<Done<RoundInfo>, StatusOr<RoundInfo>>> answered;
  for (auto it = joins_.begin(); it != joins_.end();) {
    PendingJoin& j = it->second;
    if (!calls_.has(it->first)) {
      it = joins_.erase(it);
      continue;
    }
    if (!j.check_state ||
        (cache_.stateRevision() < j.revision && cache_.seenRevision() < j.revision)) {
      ++it;
      continue;
    }
    auto outcome = cache_.state().joinOutcome(o_.run_id, j.node_id);
    if (outcome.isOk() && !outcome.value()) {
      j.check_state = false;  // still pending: a later change answers it
      ++it;
      continue;
    }
    calls_.finish(it->first);
    if (outcome.isOk()) {
      answered.emplace_back(std::move(j.done), std::move(*outcome.value()));
    } else {
      answered.emplace_back(std::move(j.done), outcome.status());
    }
    it = joins_.erase(it);
  }
  for (auto& [done, answer] : answered) done(std::move(answer));
}

template <typename Wait, typename Answer>
void LoopService::answerWaits(std::map<uint64_t, Wait>& waits, Answer answer) {
  for (auto it = waits.begin(); it != waits.end();) {
    if (!calls_.has(it->first)) {
      it = waits.erase(it);
      continue;
    }
    auto value = answer(it->second);
    if (!value) {
      ++it;
      continue;
    }
    auto done = std::move(it->second.done);
    calls_.finish(it->first);
    it = waits.erase(it);
    done(std::move(*value));
  }
}

void LoopService::answerMasterWaits() {
  answerWaits(master_waits_, [this](const MasterWait& w) { return masterAnswer(w.round); });
}

void LoopService::answerKvWaits() {
  answerWaits(kv_waits_, [this](const KvWait& w) { return kv_.values(w.keys); });
}

std::optional<StatusOr<MasterAddress>> LoopService::masterAnswer(uint64_t round) {
  if (auto m = cache_.state().masterOf(o_.run_id, round)) return StatusOr<MasterAddress>(*m);
  auto st = cache_.state().status(o_.run_id);
  if (st.isOk() && st.value().closed) {
    return StatusOr<MasterAddress>(rendezvous::runClosed(o_.run_id));
  }
  if (st.isOk() && st.value().completed_round > round) {
    return StatusOr<MasterAddress>(
        Status(StatusCode::kAborted, "round " + std::to_string(round) + " of run " + o_.run_id +
                                         " was superseded before its master was published"));
  }
  return std::nullopt;
}

// Any agent applies the state's deadlines (last calls, join timeouts) when they come; the
// transaction makes sure only one of them writes. A tick that changed nothing is not repeated
// for the same deadline sooner than a second later.
void LoopService::scheduleTick() {
  const std::optional<TimePoint> next = cache_.nextDeadline();
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
  std::weak_ptr<LoopService> weak = weak_from_this();
  tick_timer_.async_wait([this, weak, target](const boost::system::error_code& ec) {
    if (ec || weak.expired()) return;
    tick(target);
  });
}

void LoopService::tick(TimePoint target) {
  loop_.check();
  last_tick_for_ = target;
  applyAsync<bool>(
      [](State& st, TimePoint now) -> StatusOr<bool> {
        st.tick(now);
        return true;
      },
      [](StatusOr<bool>) {}, o_.rpc_timeout);
}

}  // namespace ddprun::etcd
