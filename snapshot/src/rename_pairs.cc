#include "ddprun/snapshot/rename_pairs.h"

#include <algorithm>
#include <utility>

namespace ddprun::snapshot {

void RenamePairs::movedFrom(uint32_t cookie, Away away, TimePoint now) {
  waiting_[cookie] = Waiting{std::move(away), now, next_order_++};
}

std::optional<RenamePairs::Away> RenamePairs::movedTo(uint32_t cookie) {
  auto it = waiting_.find(cookie);
  if (it == waiting_.end()) return std::nullopt;
  Away away = std::move(it->second.away);
  waiting_.erase(it);
  return away;
}

std::optional<TimePoint> RenamePairs::nextDue() const {
  std::optional<TimePoint> due;
  for (const auto& [cookie, w] : waiting_) {
    if (!due || w.read_at + wait_ < *due) due = w.read_at + wait_;
  }
  return due;
}

std::vector<RenamePairs::Away> RenamePairs::gone(TimePoint now) {
  std::vector<Waiting> taken;
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    if (it->second.read_at + wait_ <= now) {
      taken.push_back(std::move(it->second));
      it = waiting_.erase(it);
    } else {
      ++it;
    }
  }
  std::sort(taken.begin(), taken.end(),
            [](const Waiting& a, const Waiting& b) { return a.order < b.order; });
  std::vector<Away> out;
  out.reserve(taken.size());
  for (auto& w : taken) out.push_back(std::move(w.away));
  return out;
}

}  // namespace ddprun::snapshot
