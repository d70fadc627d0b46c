#include "kv_mirror.h"

#include "ddprun/common/strings.h"
#include "log.h"

namespace ddprun::etcd {

KvMirror::KvMirror(std::string where, uint64_t max_keys, uint64_t max_bytes)
    : where_(std::move(where)), max_keys_(max_keys), max_bytes_(max_bytes) {}

uint64_t KvMirror::bytesWithout(const std::string& key) const {
  auto it = kv_.find(key);
  return bytes_ - (it == kv_.end() ? 0 : key.size() + it->second.size());
}

void KvMirror::keep(const std::string& key, std::string value) {
  auto it = kv_.find(key);
  const uint64_t without = bytesWithout(key);
  const uint64_t with = without + key.size() + value.size();
  const bool fresh = it == kv_.end();
  if ((fresh && kv_.size() >= max_keys_) || with > max_bytes_) {
    if (!fresh) {
      kv_.erase(it);
      bytes_ = without;
    }
    if (auto n = dropped_.note(where_, std::chrono::steady_clock::now())) {
      etcdLog()->warn(
          "etcd rendezvous: not keeping {} key(s) of {} (the last: {}, {} bytes): this agent "
          "keeps at most {} keys and {} bytes of the run's key-value store (kv_max_keys=, "
          "kv_max_bytes= in --rdzv-conf)",
          *n, where_, quotePeerText(key, 100), value.size(), max_keys_, max_bytes_);
    }
    return;
  }
  kv_[key] = std::move(value);
  bytes_ = with;
}

void KvMirror::forget(const std::string& key) {
  auto it = kv_.find(key);
  if (it == kv_.end()) return;
  bytes_ -= key.size() + it->second.size();
  kv_.erase(it);
}

void KvMirror::clear() {
  kv_.clear();
  bytes_ = 0;
}

Status KvMirror::admits(const std::string& key, uint64_t value_size) const {
  if (kv_.count(key) == 0 && kv_.size() >= max_keys_) {
    return Status(StatusCode::kResourceExhausted, "the run's key-value store has " +
                                                      std::to_string(kv_.size()) +
                                                      " keys, the most kv_max_keys= allows");
  }
  const uint64_t with = bytesWithout(key) + key.size() + value_size;
  if (with > max_bytes_) {
    return Status(
        StatusCode::kResourceExhausted,
        "the run's key-value store would hold " + std::to_string(with) +
            " bytes of keys and values, more than kv_max_bytes=" + std::to_string(max_bytes_));
  }
  return Status::ok();
}

std::optional<std::vector<std::string>> KvMirror::values(
    const std::vector<std::string>& keys) const {
  std::vector<std::string> values;
  for (const std::string& k : keys) {
    auto it = kv_.find(k);
    if (it == kv_.end()) return std::nullopt;
    values.push_back(it->second);
  }
  return values;
}

}  // namespace ddprun::etcd
