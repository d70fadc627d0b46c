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
  DDPRUN_RETURN_IF_ERROR(validateIds(run_id, node_id));
  Run* run = findRun(run_id);
  if (run == nullptr && findTombstone(run_id) != nullptr) {
    return runClosed(run_id);
  }
  if (run == nullptr) return runUnknown(run_id);
  if (master.addr.size() > limits_.max_id_bytes) {
    return invalidArgument("master address is longer than " + std::to_string(limits_.max_id_bytes) +
                           " bytes");
  }
  if (master.addr.empty() || master.port == 0 || master.port > 65535) {
    return invalidArgument("master address must be a non-empty host and a port in 1..65535");
  }
  if (hasControlByte(master.addr)) return invalidArgument("master address contains a control byte");
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
  if (Status s = validateIds(run_id); !s.isOk()) {
    outbox_.masters.push_back({id, s});
    return;
  }
  if (Status s = validateKey(run_id, masterKey(round)); !s.isOk()) {  // a closed run's too
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

StatusOr<std::vector<std::string>> RendezvousState::waitAnswer(
    const std::string& run_id, const std::vector<std::string>& keys) const {
  std::vector<std::string> values;
  size_t bytes = 0;
  for (const std::string& k : keys) {
    values.push_back(*lookup(run_id, k));
    bytes += values.back().size();
    if (bytes > limits_.max_wait_answer_bytes) {
      return Status(StatusCode::kResourceExhausted,
                    "the values of the " + std::to_string(keys.size()) +
                        " key(s) waited for in run " + run_id + " take more than " +
                        std::to_string(limits_.max_wait_answer_bytes) +
                        " bytes together, more than one answer carries (wait for fewer keys)");
    }
  }
  return values;
}

namespace {
// "key(s) a, b, c and N more": a message that names keys stays short whatever was asked.
std::string keysNamed(const std::vector<std::string>& keys) {
  std::vector<std::string> shown;
  for (size_t i = 0; i < keys.size() && i < 5; ++i) shown.push_back(quotePeerText(keys[i], 100));
  std::string out = "key(s) " + ddprun::join(shown, ", ");
  if (keys.size() > shown.size())
    out += " and " + std::to_string(keys.size() - shown.size()) + " more";
  return out;
}
}  // namespace

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

Status RendezvousState::validateIds(const std::string& run_id, const std::string& node_id) const {
  if (run_id.empty()) return invalidArgument("run id is empty");
  for (const auto& [what, id] : {std::pair{"run id", &run_id}, std::pair{"node id", &node_id}}) {
    if (id->size() > limits_.max_id_bytes) {
      return invalidArgument(std::string(what) + " is " + std::to_string(id->size()) +
                             " bytes, above the limit of " + std::to_string(limits_.max_id_bytes));
    }
    if (hasControlByte(*id)) return invalidArgument(std::string(what) + " contains a control byte");
  }
  return Status::ok();
}

Status RendezvousState::validateKey(const std::string& run_id, const std::string& key) const {
  DDPRUN_RETURN_IF_ERROR(validateIds(run_id));
  // A closed run's keys are gone with it: a write would start an empty store under its id, and a
  // wait (a node's exit barrier) would wait for keys written before the close until it times out.
  if (findRun(run_id) == nullptr && findTombstone(run_id) != nullptr) {
    return runClosed(run_id);
  }
  if (key.empty()) return invalidArgument("key is empty");
  if (key.size() > limits_.max_key_bytes) {
    return invalidArgument("key is " + std::to_string(key.size()) + " bytes, above the limit of " +
                           std::to_string(limits_.max_key_bytes));
  }
  return Status::ok();
}

Status RendezvousState::store(const std::string& run_id, const std::string& key, std::string value,
                              TimePoint now) {
  if (value.size() > limits_.max_value_bytes) {
    return invalidArgument("value of key " + quotePeerText(key, 100) + " is " +
                           std::to_string(value.size()) + " bytes, above the limit of " +
                           std::to_string(limits_.max_value_bytes));
  }
  // The quotas are checked before anything is created, so a refused write leaves no trace.
  size_t keys = 0, bytes = 0, old_entry = 0;
  bool present = false;
  if (auto space = kv_.find(run_id); space != kv_.end()) {
    keys = space->second.data.size();
    bytes = space->second.bytes;
    if (auto it = space->second.data.find(key); it != space->second.data.end()) {
      present = true;
      old_entry = key.size() + it->second.size();
    }
  }
  const size_t new_entry = key.size() + value.size();
  auto exhausted = [&](const char* what, const char* name, size_t limit) {
    return Status(StatusCode::kResourceExhausted,
                  std::string(what) + " would exceed " + name + " = " + std::to_string(limit) +
                      " (ddprun-rendezvous --" + std::string(name) + ")");
  };
  if (!present && keys + 1 > limits_.max_run_keys) {
    return exhausted(("a new key in run " + run_id).c_str(), "max-run-keys", limits_.max_run_keys);
  }
  if (new_entry > old_entry) {
    const size_t grow = new_entry - old_entry;
    if (bytes + grow > limits_.max_run_kv_bytes) {
      return exhausted(("storing " + std::to_string(new_entry) + " bytes in run " + run_id).c_str(),
                       "max-run-kv-bytes", limits_.max_run_kv_bytes);
    }
    if (kv_bytes_ + grow > limits_.max_kv_bytes) {
      return exhausted(("storing " + std::to_string(new_entry) + " bytes").c_str(), "max-kv-bytes",
                       limits_.max_kv_bytes);
    }
  }
  KvSpace& space = kvSpace(run_id, now);
  space.bytes = space.bytes - old_entry + new_entry;
  kv_bytes_ = kv_bytes_ - old_entry + new_entry;
  space.data[key] = std::move(value);
  return Status::ok();
}

void RendezvousState::dropKvSpace(const std::string& run_id) {
  auto it = kv_.find(run_id);
  if (it == kv_.end()) return;
  kv_bytes_ -= it->second.bytes;
  kv_.erase(it);
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
    const std::vector<std::string> keys = std::move(waits_.at(id).keys);
    waits_.erase(id);
    outbox_.waits.push_back({id, waitAnswer(run_id, keys)});
  }
  // A wait kept the space in use; now only its idle clock does.
  if (!done.empty()) scheduleCollect(now + retention_.idle_run_ttl);
}

Status RendezvousState::kvSet(const std::string& run_id, const std::string& key, std::string value,
                              TimePoint now) {
  DDPRUN_RETURN_IF_ERROR(validateWrite(run_id, key));
  DDPRUN_RETURN_IF_ERROR(store(run_id, key, std::move(value), now));
  touch(run_id, now);
  notifyKeys(run_id, key, now);
  return Status::ok();
}

StatusOr<std::string> RendezvousState::kvGet(const std::string& run_id,
                                             const std::string& key) const {
  DDPRUN_RETURN_IF_ERROR(validateKey(run_id, key));
  auto value = lookup(run_id, key);
  if (!value) return notFound("key " + quotePeerText(key, 100) + " not found in run " + run_id);
  return std::move(*value);
}

StatusOr<int64_t> RendezvousState::kvAdd(const std::string& run_id, const std::string& key,
                                         int64_t delta, TimePoint now) {
  DDPRUN_RETURN_IF_ERROR(validateWrite(run_id, key));
  touch(run_id, now);
  int64_t value = 0;
  if (auto current = lookup(run_id, key)) {
    errno = 0;
    char* end = nullptr;
    long long v = std::strtoll(current->c_str(), &end, 10);
    if (current->empty() || *end != '\0' || errno != 0) {
      return invalidArgument("key " + key + " holds a value that is not an integer");
    }
    value = v;
  }
  if ((delta > 0 && value > std::numeric_limits<int64_t>::max() - delta) ||
      (delta < 0 && value < std::numeric_limits<int64_t>::min() - delta)) {
    return Status(StatusCode::kOutOfRange, "add on key " + key + " overflows int64");
  }
  value += delta;
  DDPRUN_RETURN_IF_ERROR(store(run_id, key, std::to_string(value), now));
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
  touch(run_id, now);
  auto current = lookup(run_id, key);
  if (!current && !expected.empty()) return expected;  // c10d: absent key and non-empty expected
  if (current && *current != expected) return std::move(*current);
  DDPRUN_RETURN_IF_ERROR(store(run_id, key, desired, now));
  notifyKeys(run_id, key, now);
  return desired;
}

StatusOr<bool> RendezvousState::kvDelete(const std::string& run_id, const std::string& key,
                                         TimePoint now) {
  DDPRUN_RETURN_IF_ERROR(validateWrite(run_id, key));
  auto r = kv_.find(run_id);
  if (r == kv_.end()) return false;
  touch(run_id, now);
  auto it = r->second.data.find(key);
  if (it == r->second.data.end()) return false;
  const size_t entry = key.size() + it->second.size();
  r->second.bytes -= entry;
  kv_bytes_ -= entry;
  r->second.data.erase(it);
  return true;
}

StatusOr<size_t> RendezvousState::kvDeleteRange(const std::string& run_id, const std::string& from,
                                                const std::string& to, TimePoint now) {
  DDPRUN_RETURN_IF_ERROR(validateWrite(run_id, from));
  DDPRUN_RETURN_IF_ERROR(validateKey(run_id, to));
  if (!(from < to)) {
    return invalidArgument("the range of keys to delete is empty (its end, " +
                           quotePeerText(to, 100) + ", is not above its start, " +
                           quotePeerText(from, 100) + ")");
  }
  // Reserved keys lie in [kReservedPrefix, its successor); `from` is outside it (validateWrite).
  const std::string reserved = kReservedPrefix;
  if (from < reserved && to > reserved) {
    return invalidArgument("the range of keys to delete covers the keys under " + reserved +
                           ", reserved for the rendezvous server");
  }
  auto r = kv_.find(run_id);
  if (r == kv_.end()) return size_t{0};
  touch(run_id, now);
  auto& data = r->second.data;
  auto it = data.lower_bound(from);
  size_t deleted = 0;
  while (it != data.end() && it->first < to) {
    const size_t entry = it->first.size() + it->second.size();
    r->second.bytes -= entry;
    kv_bytes_ -= entry;
    it = data.erase(it);
    ++deleted;
  }
  return deleted;
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
    outbox_.waits.push_back({id, waitAnswer(run_id, keys)});
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
    const std::string what =
        w.master ? "the master of round " + std::to_string(w.master_round) : keysNamed(w.keys);
    touch(w.run_id, now);
    failWait(id, deadlineExceeded("timed out waiting for " + what + " of run " + w.run_id));
  }
  if (!expired_waits.empty()) scheduleCollect(now + retention_.idle_run_ttl);
}

}  // namespace ddprun::rendezvous
