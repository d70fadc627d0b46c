// MultiNodeRendezvous: the agent's side of a multi-node rendezvous (SPEC §5), over any
// RendezvousService (rendezvous_service.h). It turns completed rounds into RoundInfo (membership
// epoch, the workers' master address, static node ranks), heartbeats on a timer, turns pushed
// round changes into PeerEvents, and runs the exit barrier and the run's close through the
// service's key-value store.
//
// Calls that must keep their order (join, failure report, leave, barrier, shutdown) run one at a
// time in the order made; heartbeats and the watch run beside them. Everything happens on the
// agent's event loop: no thread, no lock.
// Threading: loop thread only; callbacks (round results, events) run on that loop.
// Lifetime: outlives every callback it was given; destroy it (then the service) after the loop
// stopped.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <deque>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "ddprun/agent/rendezvous_client.h"
#include "ddprun/agent/rendezvous_service.h"
#include "ddprun/agent/round_keys.h"
#include "ddprun/common/loop_affinity.h"
#include "ddprun/rendezvous/types.h"

namespace ddprun::agent {

struct MultiNodeOptions {
  std::string run_id;
  std::string local_addr;  // advertised; MASTER_ADDR when this node is group rank 0
  int local_world_size = 1;
  rendezvous::RunConfig run_config;  // min/max nodes, last call, heartbeat interval and misses
  Duration join_timeout = std::chrono::seconds(600);
  int master_port = 0;  // 0: a free port found when this node is rank 0
  // Static backend (--node-rank given): group rank and master are fixed by the command line;
  // nodes exchange their node ranks through the run's key-value store.
  int static_node_rank = -1;
  std::string static_master_addr;
  // How long the endgame (barrier keys, departures, close) retries an unreachable service: the
  // others may be gone already, with the server of the node that hosted it.
  Duration endgame_retry = std::chrono::seconds(2);
  // How long the node that closes the run waits for the others' departures.
  Duration departure_timeout = std::chrono::seconds(10);
};

// Pushed changes the supervisor must act on. kNodeDeclaredDead: a change of nodes because a node
// missed its heartbeats, another one or this one (it may be alive, its agent stalled, and its
// workers finishing the job).
// kPeerRecoveryFailed: another node's in-place recovery failed and it restarts its workers
// (FailureKind::kRecovery: not charged again).
enum class PeerEvent { kMembershipChange, kNodeDeclaredDead, kPeerFailure, kPeerRecoveryFailed };

// The first segments of the round keys (common/round_key.h) it publishes: each node's --node-rank
// ("static_rank/<round>/<node>"), and its exit barrier's marks ("exit_barrier/<round>/<phase>/
// <node>", written at a job's end, and as a node moves on to a newer round).
inline constexpr char kStaticRankKeys[] = "static_rank";
inline constexpr char kBarrierKeys[] = "exit_barrier";

class MultiNodeRendezvous final : public RendezvousClient {
 public:
  using EventSink = std::function<void(PeerEvent)>;  // runs on the loop

  MultiNodeRendezvous(boost::asio::io_context& io, MultiNodeOptions options,
                      RendezvousService& service, EventSink sink);
  ~MultiNodeRendezvous() override;

  void nextRound(RoundCallback done) override;
  void reportFailure(FailureKind kind) override;
  void leave() override;
  void exitBarrier(Duration timeout, StatusCallback done) override;
  void shutdown(bool succeeded, bool left, std::function<void()> done) override;
  uint64_t currentRound() const override { return current_round_; }
  uint64_t formingRound() const override { return forming_round_; }

  // The service's node id for this node ("" before the first join).
  const std::string& nodeId() const { return node_id_; }

 private:
  // One queued operation; it calls `next` exactly once when it is done.
  using Op = std::function<void(std::function<void()> next)>;
  void enqueue(Op op);
  void runNext();

  void join(RoundCallback done, std::function<void()> next);
  void resolveMaster(rendezvous::RoundInfo joined, RoundInfo round, RoundCallback done,
                     std::function<void()> next);
  void resolveStaticRanks(const rendezvous::RoundInfo& joined, RoundInfo round, RoundCallback done);
  void onChange(const rendezvous::RoundChange& change);
  // Tells the sink of a round forming for `reason` about node `cause` (a peer's failure, a node
  // declared dead, any other change), from the watch's message or its snapshot.
  void tellRoundForming(rendezvous::ChangeReason reason, const std::string& cause);
  void scheduleHeartbeat();
  // Waits until every member still expected (not gone) has written `<prefix><phase>/<member>`,
  // re-reading who is gone every slice, until `deadline`.
  void waitForMembers(const std::string& phase, TimePoint deadline, StatusCallback done);
  std::vector<std::string> barrierKeys(const std::string& phase) const;
  // roundAbandoned() when one of `keys`' `values` says its node went on to a newer round.
  Status movedOnFrom(const std::vector<std::string>& keys,
                     const std::vector<std::string>& values) const;
  std::string barrierPrefix() const;

  MultiNodeOptions options_;
  RendezvousService& service_;
  // Past rounds' keys, deleted by each round's lowest node: the --node-rank keys below the round,
  // the exit barrier's below the round before it (a node still waiting in that round's barrier
  // reads the others' moved-on marks there).
  RoundKeys static_ranks_{service_, kStaticRankKeys};
  RoundKeys barriers_{service_, kBarrierKeys};
  EventSink sink_;

  std::deque<Op> ops_;
  bool op_running_ = false;

  std::string node_id_;
  std::vector<std::string> last_members_;  // node ids of the last round, in group-rank order
  std::set<std::string> gone_;             // nodes the service saw leave or die (and not rejoin)
  int membership_epoch_ = 0;
  uint64_t joined_round_ = 0;
  uint64_t current_round_ = 0;
  uint64_t forming_round_ = 0;    // the newest round heard forming
  bool answered_behind_ = false;  // the last join was answered with a round below forming_round_
  bool watching_ = false;
  bool left_ = false;
  bool shut_down_ = false;
  bool dropped_said_ = false;  // "no longer counts this node" said since the last good heartbeat
  boost::asio::steady_timer heartbeat_timer_;
  bool heartbeating_ = false;
  LoopAffinity loop_{"MultiNodeRendezvous"};
};

}  // namespace ddprun::agent
