// Relay choice: who tells whom of a new version (relayTargets), and the announcements a node
// passes on down the chain they came by (SnapshotRelays). Pure.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "ddprun/snapshot/version.h"

namespace ddprun::snapshot {

// Who tells whom about a new version: the nodes of the round form a chain that starts at the
// writer `origin` (indices: the round's replicating nodes in group-rank order), each node telling
// the next one once its own fetch of the version starts. Every node serves what it fetches as it
// arrives (a pipelined relay), so every node's uplink carries one copy, the writer's too, and the
// last node holds the version about one copy's time plus a few chunks per node after the first:
// between hosts on 1 Gbit/s links, a binomial tree (the writer sending log2(nodes) copies) took 2x
// one copy with 4 nodes, the chain 1.1-1.2x. Every node but the writer is told exactly once.
// Returns indices.
std::vector<int> relayTargets(int origin, int self, int nodes);

// The announcements a node was told and passes on down the chain they came by (relayTargets from
// their origin), kept by content. Two nodes that wrote a name in one round may announce the same
// number with other bytes, each down a chain of its own: each is passed on along its own chain,
// so that the greater content reaches every node (the lesser one's chain ends at the first node
// that holds the greater). Kept by number alone, a node told of both passed the greater on along
// the lesser's chain, which ends one node earlier where the greater's does not: that node was
// never told of it and kept other bytes until the next round's sync.
// Threading: none (the agent's loop thread). Lifetime: a plain value.
class SnapshotRelays {
 public:
  // This node was told of `v` by the chain `origin` (an endpoint) starts. Older versions of the
  // name are forgotten, and `v` is ignored when a newer one was told. The same content told again
  // keeps the chain it came by first, and is to be passed on again if it was passed on as it
  // arrived (passedEarly: a retry of its fetch serves it again).
  void told(const SnapshotVersion& v, const std::string& origin);
  // The origin of the chain that told this node of `v`, passed on or not; nullopt when it was
  // not told (or passed on once its copy was complete).
  std::optional<std::string> origin(const SnapshotVersion& v) const;
  // `v` is passed on now: its origin when it is still to be passed on, else nullopt (each content
  // is passed on once). `early`: passed on as it arrives (its fetch started), and remembered.
  std::optional<std::string> pass(const SnapshotVersion& v, bool early);
  // `v` was passed on as it arrived: a failure of its fetch is the subtree's too.
  bool passedEarly(const SnapshotVersion& v) const;
  // Forgets what was told of every name `keep` says no to (a round's start: names no longer
  // wanted are not passed on, and a peer's many names do not stay here).
  void forgetUnless(const std::function<bool(const std::string&)>& keep);
  size_t size() const { return told_.size(); }

 private:
  struct Told {
    SnapshotVersion version;
    std::string origin;
    bool early = false;  // passed on as it arrived; else still to be passed on
  };
  // Where `v`'s content is in told_[v.name], if it was told.
  std::optional<size_t> indexOf(const SnapshotVersion& v) const;
  std::map<std::string, std::vector<Told>> told_;  // by name: the newest number's contents
};

}  // namespace ddprun::snapshot
