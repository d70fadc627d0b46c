#include "snapshot_sync_client.h"

#include <algorithm>

namespace ddprun::agent {

namespace {

using Quiet = snapshot::Replicator::Quiet;

// How long a failed job's end waits for what the workers wrote to be looked at and versioned.
constexpr auto kVersionedWithin = std::chrono::seconds(10);

}  // namespace

void SnapshotSyncClient::nextRound(RoundCallback done) {
  loop_.check();
  inner_.nextRound([this, done = std::move(done)](StatusOr<RoundInfo> round) mutable {
    if (!round.isOk()) {
      done(std::move(round));
      return;
    }
    RoundInfo r = *round;
    // Nodes whose agents run without --snapshot-dir publish no holdings: not waited for (their
    // identity said so, and JobIdentityClient warned once).
    std::vector<int> ranks;
    for (int i = 0; i < static_cast<int>(r.local_world_sizes.size()); ++i) {
      if (i == r.group_rank || r.without_snapshot_dir.count(i) == 0) ranks.push_back(i);
    }
    const auto self = static_cast<size_t>(
        std::lower_bound(ranks.begin(), ranks.end(), r.group_rank) - ranks.begin());
    replicator_.syncRound(static_cast<uint64_t>(r.round), r.group_rank, std::move(ranks), board_,
                          [this, done = std::move(done), r, self]() mutable {
                            published_.tookPart(static_cast<uint64_t>(r.round), self);
                            done(r);
                          });
  });
}

void SnapshotSyncClient::exitBarrier(Duration timeout, StatusCallback done) {
  loop_.check();
  const auto start = std::chrono::steady_clock::now();
  replicator_.whenQuiet(Quiet::kReplicated, Duration::zero(), timeout / 2,
                        [this, start, timeout, done = std::move(done)]() mutable {
                          const auto spent = std::chrono::steady_clock::now() - start;
                          inner_.exitBarrier(std::max<Duration>(timeout - spent, Duration::zero()),
                                             std::move(done));
                        });
}

void SnapshotSyncClient::shutdown(bool succeeded, bool left, std::function<void()> done) {
  loop_.check();
  if (!succeeded) {
    // A failed or stopped job (SIGTERM, a Slurm requeue) still records what its workers wrote
    // last, often the checkpoint written on that very signal: unrecorded, it would count as
    // version 0 when the job starts again, and an older version another node holds would be
    // fetched over it.
    replicator_.whenQuiet(Quiet::kVersioned, Duration::zero(), kVersionedWithin,
                          [this, succeeded, left, done = std::move(done)]() mutable {
                            inner_.shutdown(succeeded, left, std::move(done));
                          });
    return;
  }
  replicator_.whenQuiet(Quiet::kServed, std::chrono::seconds(1), std::chrono::seconds(20),
                        [this, succeeded, left, done = std::move(done)]() mutable {
                          inner_.shutdown(succeeded, left, std::move(done));
                        });
}

}  // namespace ddprun::agent
