// SnapshotSyncClient: the RendezvousClient the supervisor sees when --snapshot-dir is set on a
// multi-node job. Every round comes from `inner`, and is handed on only after the snapshot
// replicator (ddprun/snapshot/replicator.h) synced the directory through the rendezvous'
// key-value store; the end of a job waits for the replication (bounded), so the job's last
// snapshot reaches every node.
// Threading: the agent's loop thread. Lifetime: within `inner`'s, `service`'s and `replicator`'s.
#pragma once

#include <functional>

#include "ddprun/agent/rendezvous_client.h"
#include "ddprun/agent/rendezvous_service.h"
#include "ddprun/agent/round_keys.h"
#include "ddprun/common/loop_affinity.h"
#include "ddprun/snapshot/replicator.h"

namespace ddprun::agent {

class SnapshotSyncClient final : public RendezvousClient {
 public:
  SnapshotSyncClient(RendezvousClient& inner, RendezvousService& service,
                     snapshot::Replicator& replicator)
      : inner_(inner),
        board_(service),
        replicator_(replicator),
        published_(service, snapshot::kHoldingsKeys) {}
  void nextRound(RoundCallback done) override;
  void reportFailure(FailureKind kind) override { inner_.reportFailure(kind); }
  void leave() override { inner_.leave(); }
  // A node arrives at the exit barrier once what it writes is announced and what it was told
  // of is fetched; after a success it departs once the others stopped fetching from it (both
  // bounded), so the job's last snapshot reaches every node.
  void exitBarrier(Duration timeout, StatusCallback done) override;
  void shutdown(bool succeeded, bool left, std::function<void()> done) override;
  uint64_t currentRound() const override { return inner_.currentRound(); }
  uint64_t formingRound() const override { return inner_.formingRound(); }

 private:
  // The run's key-value store, as the replicator's round sync uses it.
  class Board final : public snapshot::HoldingsBoard {
   public:
    explicit Board(RendezvousService& service) : service_(service) {}
    void put(const std::string& key, const std::string& value,
             std::function<void(Status)> done) override {
      service_.kvSet(key, value, {}, std::move(done));
    }
    void waitAll(const std::vector<std::string>& keys, Duration timeout,
                 std::function<void(StatusOr<std::vector<std::string>>)> done) override {
      service_.kvWait(keys, timeout, {}, std::move(done));
    }

   private:
    RendezvousService& service_;
  };

  RendezvousClient& inner_;
  Board board_;
  snapshot::Replicator& replicator_;
  RoundKeys published_;  // the previous rounds' holdings, deleted
  LoopAffinity loop_{"SnapshotSyncClient"};
};

}  // namespace ddprun::agent
