#include "announcer.h"

#include <memory>

#include "convert.h"

namespace ddprun::snapshot {

namespace {

// An announcement is a small unary call that a live agent answers in milliseconds: one that has
// not answered in this long (stopped, or its host gone without a reset) is stepped over.
constexpr auto kAnnounceTimeout = std::chrono::seconds(2);

}  // namespace

void Announcer::announce(const Announce& a, std::function<void(const Announced&)> done) {
  auto result = std::make_shared<Announced>(Announced{a, {}});
  pool_.run(
      [result, base = peer("")] {
        const Announce& a = result->announce;
        const SnapshotFile file = toWire(a.version);
        for (const auto& line : a.lines) {
          for (size_t i = 0; i < line.size(); ++i) {
            SnapshotPeer to = base;
            to.endpoint = line[i];
            Status st = announceSnapshot(to, file, a.source, a.origin, kAnnounceTimeout);
            if (st.isOk()) break;
            result->failed.push_back({line[i], st.message(), i + 1 < line.size()});
          }
        }
      },
      [result, done = std::move(done)] { done(*result); }, TransferPool::Urgency::kPrompt);
}

void Announcer::announceAgain(const AnnounceAgain& again, std::function<void(size_t)> done) {
  auto told = std::make_shared<size_t>(0);  // how many it took, in order
  pool_.run(
      [again, told, to = peer(again.peer)] {
        for (const auto& u : again.items) {
          Status st = announceSnapshot(to, toWire(u.version), u.source, u.origin, kAnnounceTimeout);
          if (!st.isOk()) return;  // still not answering: the rest waits for the next time
          ++*told;
        }
      },
      [told, done = std::move(done)] { done(*told); }, TransferPool::Urgency::kPrompt);
}

}  // namespace ddprun::snapshot
