#include "ddprun/snapshot/relays.h"

namespace ddprun::snapshot {

std::vector<int> relayTargets(int origin, int self, int nodes) {
  std::vector<int> out;
  if (nodes <= 1 || origin < 0 || origin >= nodes || self < 0 || self >= nodes) return out;
  const int k = (self - origin + nodes) % nodes;
  if (k + 1 < nodes) out.push_back((origin + k + 1) % nodes);
  return out;
}

void SnapshotRelays::told(const SnapshotVersion& v, const std::string& origin) {
  auto& contents = told_[v.name];
  if (!contents.empty() && contents.front().version.version > v.version) return;
  if (!contents.empty() && contents.front().version.version < v.version) contents.clear();
  for (auto& t : contents) {
    if (!t.version.sameContent(v)) continue;
    if (t.version.crc_pending && !v.crc_pending) t.version = v;  // its CRC-32 is known now
    t.early = false;
    return;
  }
  contents.push_back(Told{v, origin, false});
}

std::optional<size_t> SnapshotRelays::indexOf(const SnapshotVersion& v) const {
  auto it = told_.find(v.name);
  if (it == told_.end()) return std::nullopt;
  for (size_t i = 0; i < it->second.size(); ++i) {
    if (it->second[i].version.sameContent(v)) return i;
  }
  return std::nullopt;
}

std::optional<std::string> SnapshotRelays::origin(const SnapshotVersion& v) const {
  const auto i = indexOf(v);
  if (!i) return std::nullopt;
  return told_.at(v.name)[*i].origin;
}

std::optional<std::string> SnapshotRelays::pass(const SnapshotVersion& v, bool early) {
  const auto i = indexOf(v);
  if (!i) return std::nullopt;
  auto& contents = told_[v.name];
  if (contents[*i].early) return std::nullopt;
  std::string origin = contents[*i].origin;
  if (early) {
    contents[*i].early = true;
  } else {
    contents.erase(contents.begin() + static_cast<std::ptrdiff_t>(*i));
    if (contents.empty()) told_.erase(v.name);
  }
  return origin;
}

void SnapshotRelays::forgetUnless(const std::function<bool(const std::string&)>& keep) {
  for (auto it = told_.begin(); it != told_.end();) {
    it = keep(it->first) ? std::next(it) : told_.erase(it);
  }
}

bool SnapshotRelays::passedEarly(const SnapshotVersion& v) const {
  const auto i = indexOf(v);
  return i && told_.at(v.name)[*i].early;
}
}  // namespace ddprun::snapshot
