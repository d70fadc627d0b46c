// JobIdentityClient: two jobs that share one --rdzv-id (and rendezvous) are one run to the
// rendezvous: their nodes form rounds together and start each other's programs, which then hang
// in their collectives until a store timeout (gloo's: 300 s). Every node of a multi-node job
// publishes what it runs for each round (its address and program) in the run's key-value store
// and reads every node's; a node of the round that runs another program fails the round with one
// line naming it and the id, instead of the hang. Every node of the round says so: none fails (and
// closes the run, which erases what the nodes published) before all have read.
//
// The same exchange carries each node's vote for in-place recovery (docs/in-place-recovery.md
// §2.1): whether its agent runs --restart-mode=in-place and its workers can recover in place
// (Supervisor::inPlaceVote, asked as the node publishes). A round in which some node, this one
// included, votes against is handed up with RoundInfo::in_place_veto naming it: a recovery that
// forms it falls back (the nodes that would recover in place restart their workers as processes
// instead of waiting, until inplace_timeout, for ranks that never come). A node under
// --restart-mode=process votes kProcess, and every node runs the round as process mode (its
// workers get no control channel); when every vote against is kListen (in_place_veto_soft) the
// workers get the channel, and may announce support, which brings their node's vote back.
//
// checkSameJob and inPlaceVeto are the pure part; the client is the shell around the rendezvous (as
// SnapshotSyncClient). Threading: the agent's loop thread. Lifetime: outlives no call of `inner`'s
// it made (the agent destroys it with the rendezvous setup).
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "ddprun/agent/rendezvous_client.h"
#include "ddprun/agent/rendezvous_service.h"
#include "ddprun/agent/round_keys.h"
#include "ddprun/common/loop_affinity.h"

namespace ddprun::agent {

// What a node publishes: "<address>[ listens] inplace=1|0\n<program>" (" listens": its agent
// listens on a control channel: kInPlace is " listens inplace=1", kListen " listens inplace=0",
// kProcess " inplace=0"). A value without the vote (an agent that predates it:
// "<address>\n<program>"), or with another value, votes 0 (kProcess); a 1 without " listens" (an
// agent that predates kListen) is kInPlace.
//
// An agent run without --snapshot-dir says so before the " listens" and the vote
// ("<address> nosnapdir[ listens] inplace=..."): the others do not wait for its holdings at each
// round's start (an agent that predates the marker reads it as part of the address; one that
// says nothing is waited for, as before).
std::string encodeJobIdentity(const std::string& address, const std::string& program,
                              InPlaceVote vote, bool snapshot_dir = true);
// OK when every node's published identity (by group rank) runs this node's program (compared by
// its file or module name: one job's nodes may hold it in other directories); FAILED_PRECONDITION
// naming the first node that runs another, and `run_id`.
Status checkSameJob(const std::vector<std::string>& identities, int self_rank,
                    const std::string& run_id);
// Empty when every node's published identity votes for in-place recovery; else a line naming the
// first other node that does not (by group rank), for the round `round`, or this node when only
// its own vote is against.
std::string inPlaceVeto(const std::vector<std::string>& identities, int self_rank, int round);
// Empty when every other node's agent knows the vote; else a line naming the first that predates
// it (said once by an agent under --restart-mode=in-place: such a node's workers may form their
// groups under other keys than this node's).
std::string olderAgent(const std::vector<std::string>& identities, int self_rank);
// Whether every other node's published identity votes for in-place recovery.
bool othersVoteInPlace(const std::vector<std::string>& identities, int self_rank);
// Whether every node's published identity, this one's included, says its agent listens on a
// control channel (kInPlace or kListen, from a release that knows kListen):
// RoundInfo::in_place_veto_soft.
bool everyNodeListens(const std::vector<std::string>& identities);
// The nodes (group rank -> address) whose published identity says their agent runs without
// --snapshot-dir: RoundInfo::without_snapshot_dir.
std::map<int, std::string> nodesWithoutSnapshotDir(const std::vector<std::string>& identities);
// Empty when every node runs with --snapshot-dir or every node without; else a line naming the
// first other node that differs from this one (said once by each agent).
std::string snapshotDirMismatch(const std::vector<std::string>& identities, int self_rank);

// The first segment of the keys identities are published under: "job/<round>/<rank>"
// (common/round_key.h).
inline constexpr char kJobKeys[] = "job";

class JobIdentityClient final : public RendezvousClient {
 public:
  // This node runs `program` at `address`; `in_place`: --restart-mode=in-place, its vote
  // (kInPlace, else kProcess) until setVote; `snapshot_dir`: it replicates a --snapshot-dir.
  JobIdentityClient(RendezvousClient& inner, RendezvousService& service, std::string run_id,
                    std::string address, std::string program, bool in_place, bool snapshot_dir,
                    Duration wait_for = std::chrono::seconds(30))
      : inner_(inner),
        service_(service),
        run_id_(std::move(run_id)),
        address_(std::move(address)),
        program_(std::move(program)),
        vote_([in_place] { return in_place ? InPlaceVote::kInPlace : InPlaceVote::kProcess; }),
        in_place_mode_(in_place),
        snapshot_dir_(snapshot_dir),
        wait_for_(wait_for) {}
  // Asked for this node's vote each time it publishes (on the loop thread).
  void setVote(std::function<InPlaceVote()> vote) { vote_ = std::move(vote); }
  // A round from `inner`, handed on once every node said what it runs (or after wait_for: a
  // node that is slow to say is no other job, and casts no vote), or the mismatch as the round's
  // error.
  void nextRound(RoundCallback done) override;
  void reportFailure(FailureKind kind) override { inner_.reportFailure(kind); }
  void leave() override { inner_.leave(); }
  void exitBarrier(Duration timeout, StatusCallback done) override {
    inner_.exitBarrier(timeout, std::move(done));
  }
  void shutdown(bool succeeded, bool left, std::function<void()> done) override {
    inner_.shutdown(succeeded, left, std::move(done));
  }
  uint64_t currentRound() const override { return inner_.currentRound(); }
  uint64_t formingRound() const override { return inner_.formingRound(); }

 private:
  static constexpr Duration kWaitSlice = std::chrono::milliseconds(500);

  void publish(const RoundInfo& r, RoundCallback done);
  void compare(const RoundInfo& r, const std::string& prefix, RoundCallback done, Duration left);
  // The wait for every node's identity timed out (the round goes on unchecked).
  void sayNotAllSaid(const RoundInfo& r);
  void failOnceAllRead(const RoundInfo& r, const std::string& prefix, Status mismatch,
                       RoundCallback done);

  RendezvousClient& inner_;
  RendezvousService& service_;
  std::string run_id_;
  std::string address_;
  std::string program_;
  std::function<InPlaceVote()> vote_;
  bool in_place_mode_;                // --restart-mode=in-place
  bool snapshot_dir_;                 // --snapshot-dir
  bool warned_older_ = false;         // olderAgent's line was said
  bool warned_snapshot_dir_ = false;  // snapshotDirMismatch's line was said
  bool warned_missing_ = false;       // the line of identities that did not all arrive was said
  Duration wait_for_;
  RoundKeys published_{service_, kJobKeys};  // the previous rounds' identities, deleted
  LoopAffinity loop_{"JobIdentityClient"};
};

}  // namespace ddprun::agent
