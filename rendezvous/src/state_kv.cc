// RendezvousState, the key-value store per run and its waits, and the typed master address of a
// round (publishMaster / waitMaster), with the reserved __ddprun/ keys derived from it.
#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <limits>

#include "ddprun/common/log.h"
#include "ddprun/common/strings.h"
#include "ddprun/rendezvous/state.h"
#include "state_internal.h"

namespace ddprun::rendezvous {

RendezvousState::KvSpace& RendezvousState::kvSpace(const std::string& run_id, TimePoint now) {
  auto [it, inserted] = kv_.try_emplace(run_id);
  // A new space may belong to no run: make sure a collection check comes for it.
  if (inserted) scheduleCollect(now + retention_.idle_run_ttl);
  it->second.last_active = now;
  return it->second;
}

namespace {

const std::string kMasterKeyPrefix = std::string(kReservedPrefix) + "master/";

std::string masterKey(uint64_t round) { return kMasterKeyPrefix + std::to_string(round); }

}  // namespace

Status RendezvousState::publishMaster(const std::string& run_id, const std::string& node_id,
                                      uint64_t round, const MasterAddress& master, TimePoint now) {
  Run* run = findRun(run_id);
  if (run == nullptr && findTombstone(run_id) != nullptr) {
    return failedPrecondition("run " + run_id + " is closed");
  }
  if (run == nullptr) return notFound("run " + run_id + " is unknown to this server");
  if (master.addr.empty() || master.port == 0 || master.port > 65535) {
    return invalidArgument("master address must be a non-empty host and a port in 1..65535");
  }
  if (round == 0 || round != run->completed_round || !run->completed ||
      run->completed->front().node_id != node_id) {
    return failedPrecondition("node " + node_id + " is not rank 0 of round " +
                              std::to_string(round) + " of run " + run_id);
  }
  run->masters[round] = master;
  touch(run_id, now);
  answerMasterWaits(*run, round);
  notifyKeys(run_id, masterKey(round), now);  // key waits on the reserved key
  return Status::ok();
}

std::optional<MasterAddress> RendezvousState::masterOf(const std::string& run_id,
                                                       uint64_t round) const {
  const Run* run = findRun(run_id);
  if (run == nullptr) return std::nullopt;
  auto it = run->masters.find(round);
  if (it == run->masters.end()) return std::nullopt;
  return it->second;
}

void RendezvousState::waitMaster(CallId id, const std::string& run_id, uint64_t round,
                                 Duration timeout, TimePoint now) {
  if (findRun(run_id) == nullptr && findTombstone(run_id) != nullptr) {
    outbox_.masters.push_back({id, failedPrecondition("run " + run_id + " is closed")});
    return;
  }
  if (Status s = validateKey(run_id, masterKey(round)); !s.isOk()) {
    outbox_.masters.push_back({id, s});
    return;
  }
  touch(run_id, now);
  if (auto master = masterOf(run_id, round)) {
    outbox_.masters.push_back({id, *master});
    return;
  }
  if (findRun(run_id) == nullptr) kvSpace(run_id, now);  // as a key wait: collected when idle
  Wait wait;
  wait.run_id = run_id;
  wait.deadline = now + timeout;
  wait.master = true;
  wait.master_round = round;
  deadlines_.insert(wait.deadline);
  waits_[id] = std::move(wait);
  if (const Run* run = findRun(run_id)) abortMasterWaits(*run);
}

void RendezvousState::answerMasterWaits(const Run& run, uint64_t round) {
  const MasterAddress& master = run.masters.at(round);
  std::vector<CallId> done;
  for (const auto& [id, wait] : waits_) {
    if (wait.master && wait.run_id == run.id && wait.master_round == round) done.push_back(id);
  }
  for (CallId id : done) {
    waits_.erase(id);
    outbox_.masters.push_back({id, master});
  }
}

void RendezvousState::abortMasterWaits(const Run& run) {
  // Only the rank 0 of the last completed round can publish (a forming round does not stop it),
  // so a wait for an older round can no longer be answered.
  std::vector<CallId> aborted;
  for (const auto& [id, wait] : waits_) {
    if (wait.run_id == run.id && wait.master && wait.master_round < run.completed_round) {
      aborted.push_back(id);
    }
  }
  for (CallId id : aborted) {
    failWait(id,
             Status(StatusCode::kAborted, "round " + std::to_string(waits_.at(id).master_round) +
                                              " of run " + run.id + " was superseded by round " +
                                              std::to_string(run.completed_round) +
                                              " before its master was published"));
  }
}

void RendezvousState::failWait(CallId id, Status status) {
  auto it = waits_.find(id);
  if (it == waits_.end()) return;
  if (it->second.master) {
    outbox_.masters.push_back({id, std::move(status)});
  } else {
    outbox_.waits.push_back({id, std::move(status)});
  }
  waits_.erase(it);
}

// The one place the reserved keys are derived from typed state.
std::optional<std::string> RendezvousState::lookup(const std::string& run_id,
                                                   const std::string& key) const {
  if (startsWith(key, kReservedPrefix)) {
    if (!startsWith(key, kMasterKeyPrefix)) return std::nullopt;
    auto round = parseInt(key.substr(kMasterKeyPrefix.size()));
    if (!round || *round <= 0) return std::nullopt;
    auto master = masterOf(run_id, static_cast<uint64_t>(*round));
    if (!master) return std::nullopt;
    return master->addr + ":" + std::to_string(master->port);
  }
  auto space = kv_.find(run_id);
  if (space == kv_.end()) return std::nullopt;
  auto it = space->second.data.find(key);
  if (it == space->second.data.end()) return std::nullopt;
  return it->second;
}

bool RendezvousState::hasKey(const std::string& run_id, const std::string& key) const {
  if (startsWith(key, kReservedPrefix)) return lookup(run_id, key).has_value();
  auto space = kv_.find(run_id);
  return space != kv_.end() && space->second.data.count(key) != 0;
}

Status RendezvousState::validateWrite(const std::string& run_id, const std::string& key) const {
  DDPRUN_RETURN_IF_ERROR(validateKey(run_id, key));
  if (startsWith(key, kReservedPrefix)) {
    return invalidArgument("keys under " + std::string(kReservedPrefix) +
                           " are reserved for the rendezvous server");
  }
  return Status::ok();
}

Status RendezvousState::validateKey(const std::string& run_id, const std::string& key) const {
  if (run_id.empty()) return invalidArgument("run id is empty");
  if (run_id.size() > limits_.max_id_bytes) return invalidArgument("run id is too long");
  if (key.empty()) return invalidArgument("key is empty");
  if (key.size() > limits_.max_key_bytes) {
    return invalidArgument("key is " + std::to_string(key.size()) + " bytes, above the limit of " +
                           std::to_string(limits_.max_key_bytes));
  }
  return Status::ok();
}

void RendezvousState::notifyKeys(const std::string& run_id, const std::string& key, TimePoint now) {
  std::vector<CallId> done;
  for (const auto& [id, wait] : waits_) {
    if (wait.run_id != run_id ||
        std::find(wait.keys.begin(), wait.keys.end(), key) == wait.keys.end()) {
      continue;
    }
    bool all = std::all_of(wait.keys.begin(), wait.keys.end(),
                           [&](const std::string& k) { return hasKey(run_id, k); });
    if (all) done.push_back(id);
  }
  for (CallId id : done) {
    std::vector<std::string> values;
    for (const std::string& k : waits_.at(id).keys) values.push_back(*lookup(run_id, k));
    waits_.erase(id);
    outbox_.waits.push_back({id, std::move(values)});
  }
  // A wait kept the space in use; now only its idle clock does.
  if (!done.empty()) scheduleCollect(now + retention_.idle_run_ttl);
}

Status RendezvousState::kvSet(const std::string& run_id, const std::string& key, std::string value,
                              TimePoint now) {
  DDPRUN_RETURN_IF_ERROR(validateWrite(run_id, key));
  if (value.size() > limits_.max_value_bytes) {
    return invalidArgument("value of key " + key + " is " + std::to_string(value.size()) +
                           " bytes, above the limit of " + std::to_string(limits_.max_value_bytes));
  }
  kvSpace(run_id, now).data[key] = std::move(value);
  touch(run_id, now);
  notifyKeys(run_id, key, now);
  return Status::ok();
}

StatusOr<std::string> RendezvousState::kvGet(const std::string& run_id,
                                             const std::string& key) const {
  DDPRUN_RETURN_IF_ERROR(validateKey(run_id, key));
  auto value = lookup(run_id, key);
  if (!value) return notFound("key " + key + " not found in run " + run_id);
  return std::move(*value);
}

StatusOr<int64_t> RendezvousState::kvAdd(const std::string& run_id, const std::string& key,
                                         int64_t delta, TimePoint now) {
  DDPRUN_RETURN_IF_ERROR(validateWrite(run_id, key));
  auto& kv = kvSpace(run_id, now).data;
  touch(run_id, now);
  int64_t value = 0;
  auto it = kv.find(key);
  if (it != kv.end()) {
    errno = 0;
    char* end = nullptr;
    long long v = std::strtoll(it->second.c_str(), &end, 10);
    if (it->second.empty() || *end != '\0' || errno != 0) {
      return invalidArgument("key " + key + " holds a value that is not an integer");
    }
    value = v;
  }
  if ((delta > 0 && value > std::numeric_limits<int64_t>::max() - delta) ||
      (delta < 0 && value < std::numeric_limits<int64_t>::min() - delta)) {
    return Status(StatusCode::kOutOfRange, "add on key " + key + " overflows int64");
  }
  value += delta;
  kv[key] = std::to_string(value);
  notifyKeys(run_id, key, now);
  return value;
}

StatusOr<std::string> RendezvousState::kvCompareSet(const std::string& run_id,
                                                    const std::string& key,
                                                    const std::string& expected,
                                                    std::string desired, TimePoint now) {
  DDPRUN_RETURN_IF_ERROR(validateWrite(run_id, key));
  if (desired.size() > limits_.max_value_bytes) {
    return invalidArgument("value of key " + key + " is " + std::to_string(desired.size()) +
                           " bytes, above the limit of " + std::to_string(limits_.max_value_bytes));
  }
  auto& kv = kvSpace(run_id, now).data;
  touch(run_id, now);
  auto it = kv.find(key);
  if (it == kv.end()) {
    if (!expected.empty()) return expected;  // c10d: absent key and non-empty expected
    kv[key] = desired;
    notifyKeys(run_id, key, now);
    return desired;
  }
  if (it->second != expected) return it->second;
  it->second = desired;
  notifyKeys(run_id, key, now);
  return desired;
}

StatusOr<bool> RendezvousState::kvDelete(const std::string& run_id, const std::string& key,
                                         TimePoint now) {
  DDPRUN_RETURN_IF_ERROR(validateWrite(run_id, key));
  auto r = kv_.find(run_id);
  if (r == kv_.end()) return false;
  touch(run_id, now);
  return r->second.data.erase(key) != 0;
}

void RendezvousState::kvWait(CallId id, const std::string& run_id, std::vector<std::string> keys,
                             Duration timeout, TimePoint now) {
  if (keys.empty()) {
    outbox_.waits.push_back({id, invalidArgument("wait needs at least one key")});
    return;
  }
  for (const std::string& k : keys) {
    if (Status s = validateKey(run_id, k); !s.isOk()) {
      outbox_.waits.push_back({id, s});
      return;
    }
  }
  touch(run_id, now);
  kvSpace(run_id, now);
  bool all = std::all_of(keys.begin(), keys.end(),
                         [&](const std::string& k) { return hasKey(run_id, k); });
  if (all) {
    std::vector<std::string> values;
    for (const std::string& k : keys) values.push_back(*lookup(run_id, k));
    outbox_.waits.push_back({id, std::move(values)});
    return;
  }
  TimePoint deadline = now + timeout;
  waits_[id] = Wait{run_id, std::move(keys), deadline};
  deadlines_.insert(deadline);
}

void RendezvousState::cancelWait(CallId id, TimePoint now) {
  auto it = waits_.find(id);
  if (it == waits_.end()) return;
  touch(it->second.run_id, now);
  waits_.erase(it);
  scheduleCollect(now + retention_.idle_run_ttl);
}

void RendezvousState::expireWaits(TimePoint now) {
  std::vector<CallId> expired_waits;
  for (const auto& [id, wait] : waits_) {
    if (wait.deadline <= now) expired_waits.push_back(id);
  }
  for (CallId id : expired_waits) {
    const Wait& w = waits_.at(id);
    const std::string what = w.master ? "the master of round " + std::to_string(w.master_round)
                                      : "key(s) " + ddprun::join(w.keys, ", ");
    touch(w.run_id, now);
    failWait(id, deadlineExceeded("timed out waiting for " + what + " of run " + w.run_id));
  }
  if (!expired_waits.empty()) scheduleCollect(now + retention_.idle_run_ttl);
}

}  // namespace ddprun::rendezvous
