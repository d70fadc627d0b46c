#include "job_identity.h"

#include <algorithm>

#include "ddprun/common/log.h"
#include "ddprun/common/round_key.h"
#include "ddprun/common/strings.h"

namespace ddprun::agent {

namespace {
// The vote ends the first line, after the address: an agent that predates it reads the line as
// the address (shown only in its mismatch message) and the rest, unchanged, as the program.
constexpr char kVote[] = " inplace=";
// Before the vote, an agent that listens on a control channel under --restart-mode=in-place says
// so (kInPlace and kListen). kListen is then `inplace=0`: an agent of the release before
// kListen reads it as a vote against and gives its workers no channel, as a node that reads no
// marker on that agent's line does too, so the two never form groups under different keys.
constexpr char kListens[] = " listens";
// Before that, an agent without --snapshot-dir says so.
constexpr char kNoSnapshotDir[] = " nosnapdir";

struct Identity {
  std::string address;
  std::string program;
  InPlaceVote vote = InPlaceVote::kProcess;
  bool voted = false;        // its agent knows the vote (an older one publishes no field)
  bool listens = false;      // its agent knows kListen, and listens on a control channel
  bool snapshot_dir = true;  // false: its agent said it runs without --snapshot-dir
};

Identity decode(const std::string& value) {
  Identity id;
  const auto nl = value.find('\n');
  if (nl == std::string::npos) {
    id.program = value;
    return id;
  }
  id.address = value.substr(0, nl);
  id.program = value.substr(nl + 1);
  const auto vote = id.address.rfind(kVote);
  if (vote == std::string::npos) return id;
  const std::string said = id.address.substr(vote + sizeof(kVote) - 1);
  if (said != "1" && said != "0") return id;
  id.voted = true;
  id.address.resize(vote);
  if (endsWith(id.address, kListens)) {
    id.listens = true;
    id.address.resize(id.address.size() - (sizeof(kListens) - 1));
  }
  if (endsWith(id.address, kNoSnapshotDir)) {
    id.snapshot_dir = false;
    id.address.resize(id.address.size() - (sizeof(kNoSnapshotDir) - 1));
  }
  if (said == "1") {
    id.vote = InPlaceVote::kInPlace;
  } else if (id.listens) {
    id.vote = InPlaceVote::kListen;
  }
  return id;
}
// Programs are compared by their file (or module) name: the nodes of one job may run it from
// other directories.
std::string baseName(const std::string& program) {
  const auto slash = program.rfind('/');
  return slash == std::string::npos ? program : program.substr(slash + 1);
}
}  // namespace

std::string encodeJobIdentity(const std::string& address, const std::string& program,
                              InPlaceVote vote, bool snapshot_dir) {
  const std::string node = snapshot_dir ? address : address + kNoSnapshotDir;
  switch (vote) {
    case InPlaceVote::kInPlace:
      return node + kListens + kVote + "1\n" + program;
    case InPlaceVote::kListen:
      return node + kListens + kVote + "0\n" + program;
    case InPlaceVote::kProcess:
      break;
  }
  return node + kVote + "0\n" + program;
}

Status checkSameJob(const std::vector<std::string>& identities, int self_rank,
                    const std::string& run_id) {
  if (self_rank < 0 || static_cast<size_t>(self_rank) >= identities.size()) return Status::ok();
  const std::string mine = decode(identities[static_cast<size_t>(self_rank)]).program;
  for (size_t i = 0; i < identities.size(); ++i) {
    const Identity id = decode(identities[i]);
    if (baseName(id.program) == baseName(mine)) continue;
    return failedPrecondition("another job uses --rdzv-id '" + quotePeerText(run_id, 100) +
                              "': node " + std::to_string(i) + " of this round (" +
                              quotePeerText(id.address, 100) + ") runs '" +
                              quotePeerText(id.program) + "', this node runs '" +
                              quotePeerText(mine) + "'; give each job an id of its own");
  }
  return Status::ok();
}

namespace {
// Why a node that votes `vote` (not kInPlace) restarts its workers as processes in this round.
std::string whyNot(InPlaceVote vote, bool self) {
  if (vote == InPlaceVote::kListen) {
    return self ? " (a worker failed without having announced in-place support, and none of its "
                  "workers announced it since)"
                : " (one of its workers failed without having announced in-place support, and "
                  "none announced it since)";
  }
  return self ? " (its agent runs --restart-mode=process)"
              : " (its agent runs --restart-mode=process or a ddprun without in-place recovery)";
}
}  // namespace

std::string inPlaceVeto(const std::vector<std::string>& identities, int self_rank, int round) {
  // A node under process mode first: it is the one that makes the veto hard.
  for (const InPlaceVote against : {InPlaceVote::kProcess, InPlaceVote::kListen}) {
    for (size_t i = 0; i < identities.size(); ++i) {
      if (static_cast<int>(i) == self_rank) continue;
      const Identity id = decode(identities[i]);
      if (id.vote != against) continue;
      return "node " + std::to_string(i) + " of round " + std::to_string(round) + " (" +
             quotePeerText(id.address, 100) + ") restarts its workers as processes" +
             whyNot(id.vote, false);
    }
  }
  if (self_rank >= 0 && static_cast<size_t>(self_rank) < identities.size()) {
    const InPlaceVote own = decode(identities[static_cast<size_t>(self_rank)]).vote;
    if (own != InPlaceVote::kInPlace) {
      return "this node (node " + std::to_string(self_rank) + " of round " + std::to_string(round) +
             ") restarts its workers as processes" + whyNot(own, true);
    }
  }
  return "";
}

std::string olderAgent(const std::vector<std::string>& identities, int self_rank) {
  for (size_t i = 0; i < identities.size(); ++i) {
    if (static_cast<int>(i) == self_rank) continue;
    const Identity id = decode(identities[i]);
    if (id.voted) continue;
    return "node " + std::to_string(i) + " (" + quotePeerText(id.address, 100) +
           ") runs a ddprun from before the in-place vote: if it runs --restart-mode=in-place, its "
           "workers and this node's form no group (they would wait for each other until a "
           "timeout); run one ddprun release on every node of a job";
  }
  return "";
}

bool othersVoteInPlace(const std::vector<std::string>& identities, int self_rank) {
  for (size_t i = 0; i < identities.size(); ++i) {
    if (static_cast<int>(i) != self_rank && decode(identities[i]).vote != InPlaceVote::kInPlace) {
      return false;
    }
  }
  return true;
}

bool everyNodeListens(const std::vector<std::string>& identities) {
  return std::all_of(identities.begin(), identities.end(),
                     [](const std::string& value) { return decode(value).listens; });
}

std::map<int, std::string> nodesWithoutSnapshotDir(const std::vector<std::string>& identities) {
  std::map<int, std::string> without;
  for (size_t i = 0; i < identities.size(); ++i) {
    Identity id = decode(identities[i]);
    if (!id.snapshot_dir) without[static_cast<int>(i)] = std::move(id.address);
  }
  return without;
}

std::string snapshotDirMismatch(const std::vector<std::string>& identities, int self_rank) {
  if (self_rank < 0 || static_cast<size_t>(self_rank) >= identities.size()) return "";
  const bool mine = decode(identities[static_cast<size_t>(self_rank)]).snapshot_dir;
  for (size_t i = 0; i < identities.size(); ++i) {
    const Identity id = decode(identities[i]);
    if (id.snapshot_dir == mine) continue;
    const std::string node =
        "node " + std::to_string(i) + " (" + quotePeerText(id.address, 100) + ")";
    return mine ? node +
                      " runs without --snapshot-dir: the files of this node's --snapshot-dir are "
                      "neither sent to it nor fetched from it; pass --snapshot-dir on every "
                      "node of the job"
                : node +
                      " runs with --snapshot-dir and this node without: the files it "
                      "replicates do not reach this node; pass --snapshot-dir on every node "
                      "of the job";
  }
  return "";
}

namespace {
std::vector<std::string> rankKeys(const std::string& prefix, size_t nodes) {
  std::vector<std::string> keys;
  for (size_t i = 0; i < nodes; ++i) keys.push_back(prefix + std::to_string(i));
  return keys;
}
}  // namespace

void JobIdentityClient::nextRound(RoundCallback done) {
  loop_.check();
  inner_.nextRound([this, done = std::move(done)](StatusOr<RoundInfo> round) mutable {
    if (!round.isOk() || round->local_world_sizes.size() < 2) {
      done(std::move(round));
      return;
    }
    publish(*round, std::move(done));
  });
}

void JobIdentityClient::publish(const RoundInfo& r, RoundCallback done) {
  const std::string prefix = roundKeyPrefix(kJobKeys, static_cast<uint64_t>(r.round));
  service_.kvSet(prefix + std::to_string(r.group_rank),
                 encodeJobIdentity(address_, program_, vote_(), snapshot_dir_), {},
                 [this, r, prefix, done = std::move(done)](Status st) mutable {
                   published_.tookPart(static_cast<uint64_t>(r.round),
                                       static_cast<size_t>(r.group_rank));
                   if (!st.isOk()) {  // the job's own rendezvous trouble shows elsewhere
                     done(r);
                     return;
                   }
                   compare(r, prefix, std::move(done), wait_for_);
                 });
}

// The wait goes in slices: a node that left before it said what it runs never will, and the round
// it left is superseded (formingRound): handed on then, the supervisor joins the newer round.
void JobIdentityClient::compare(const RoundInfo& r, const std::string& prefix, RoundCallback done,
                                Duration left) {
  const Duration slice = std::min(left, kWaitSlice);
  service_.kvWait(
      rankKeys(prefix, r.local_world_sizes.size()), slice, {},
      [this, r, prefix, left, slice,
       done = std::move(done)](StatusOr<std::vector<std::string>> values) mutable {
        if (!values.isOk()) {
          const bool timed_out =
              values.status().code() == StatusCode::kDeadlineExceeded && !isSuperseded(inner_, r);
          if (timed_out && left > slice) {
            compare(r, prefix, std::move(done), left - slice);
            return;
          }
          if (timed_out) sayNotAllSaid(r);
          done(r);
          return;
        }
        Status same = checkSameJob(*values, r.group_rank, run_id_);
        if (in_place_mode_ && !warned_older_) {
          const std::string older = olderAgent(*values, r.group_rank);
          if (!older.empty()) {
            warned_older_ = true;
            logger("agent")->warn("--restart-mode=in-place: {}", older);
          }
        }
        if (!warned_snapshot_dir_) {
          const std::string differs = snapshotDirMismatch(*values, r.group_rank);
          if (!differs.empty()) {
            warned_snapshot_dir_ = true;
            logger("agent")->warn("{}", differs);
          }
        }
        if (same.isOk()) {
          RoundInfo voted = r;
          voted.without_snapshot_dir = nodesWithoutSnapshotDir(*values);
          voted.in_place_veto = inPlaceVeto(*values, r.group_rank, r.round);
          voted.in_place_veto_own =
              !voted.in_place_veto.empty() && othersVoteInPlace(*values, r.group_rank);
          voted.in_place_veto_soft = !voted.in_place_veto.empty() && everyNodeListens(*values);
          done(std::move(voted));
          return;
        }
        failOnceAllRead(r, prefix, std::move(same), std::move(done));
      });
}

void JobIdentityClient::sayNotAllSaid(const RoundInfo& r) {
  // Said once at warning level: after that, a stalled node's usual trace.
  logger("agent")->log(warned_missing_ ? spdlog::level::debug : spdlog::level::warn,
                       "round {}: not every node said what it runs within {:.0f} s (a node "
                       "stalled, or runs another ddprun release, whose keys this one does not "
                       "read): the round goes on unchecked for another job, and those nodes cast "
                       "no in-place vote; run one ddprun release on every node of a job",
                       r.round, std::chrono::duration<double>(wait_for_).count());
  warned_missing_ = true;
}

// A mismatch is seen by every node of the round (each differs from one of the two that differ),
// and the first to fail closes the run, which erases the identities. So each says it has read
// them and waits (bounded) until all have, and only then fails: every node names the other job.
void JobIdentityClient::failOnceAllRead(const RoundInfo& r, const std::string& prefix,
                                        Status mismatch, RoundCallback done) {
  const std::string read = prefix + "read/";
  service_.kvSet(read + std::to_string(r.group_rank), "1", {},
                 [this, r, read, mismatch, done = std::move(done)](Status) mutable {
                   service_.kvWait(
                       rankKeys(read, r.local_world_sizes.size()), wait_for_, {},
                       [mismatch, done = std::move(done)](
                           StatusOr<std::vector<std::string>>) mutable { done(mismatch); });
                 });
}

}  // namespace ddprun::agent
