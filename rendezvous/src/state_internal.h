// Private to the rendezvous core: the per-run and per-node records behind RendezvousState, shared
// by the files that implement it (state.cc, state_rounds.cc, state_liveness.cc, state_kv.cc,
// state_retention.cc). Not installed; no gRPC.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "ddprun/rendezvous/state.h"

namespace ddprun::rendezvous {

// Keys under this prefix are the server's own (master addresses): readable, not writable.
inline constexpr const char* kReservedPrefix = "__ddprun/";

inline double secondsOf(Duration d) { return std::chrono::duration<double>(d).count(); }

struct RendezvousState::Node {
  std::string id;
  std::string address;
  uint32_t local_world_size = 0;
  uint64_t arrival = 0;  // order of first arrival: tie-break for ranks and spares
  TimePoint last_seen;
  std::optional<CallId> join;  // pending join; a node with one is alive by definition
  TimePoint join_deadline;
  int64_t prev_rank = -1;  // rank in the last round this node completed
  uint64_t prev_round = 0;
  std::optional<TimePoint> suspect_until;  // its watch broke: dead unless it shows life by then
};

struct RendezvousState::Run {
  std::string id;
  RunConfig config;
  bool closed = false;
  TimePoint closed_at{};
  std::string close_reason;
  // When the run was last used: its idle clock, read once it has no node and no watch stream.
  TimePoint last_active{};
  std::map<std::string, Node> nodes;  // every live node: participants, joiners, spares
  uint64_t arrivals = 0;

  uint64_t round = 1;  // the forming round, or the last completed one when !forming
  bool forming = true;
  // Why the forming round opened, and the node it was about (kNone for the run's first round):
  // a watch that begins while it forms is told so in its snapshot.
  ChangeReason pending_reason = ChangeReason::kNone;
  std::string pending_cause;
  std::vector<std::string> members;  // forming: joiners in join order
  std::set<std::string> joined;      // same, as a set
  std::set<std::string> expected;    // survivors of the last round not yet re-joined
  bool reforming = false;            // opened from a completed round with survivors
  std::vector<std::string> spares;   // beyond max_nodes, in arrival order
  std::optional<TimePoint> last_call;

  uint64_t completed_round = 0;
  std::shared_ptr<const std::vector<Participant>> completed;  // rank order
  std::vector<uint32_t> base_ranks;
  uint32_t world_size = 0;
  std::unordered_map<std::string, uint32_t> completed_rank;  // node id -> group rank
  // Published masters by round (only the rank 0 of the last completed round may publish, so this
  // grows by at most one entry per round). Read as the reserved key "__ddprun/master/<round>".
  std::map<uint64_t, MasterAddress> masters;

  Duration expiry() const { return config.heartbeat_interval * config.heartbeat_misses; }
};

}  // namespace ddprun::rendezvous
