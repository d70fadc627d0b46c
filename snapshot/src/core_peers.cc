// ReplicationCore: the other nodes (core.h). Who is told of a version and by whom, what a node
// told this one, and a round's holdings.
#include <algorithm>

#include "ddprun/common/strings.h"
#include "ddprun/snapshot/core.h"
#include "log.h"

namespace ddprun::snapshot {

void ReplicationCore::announce(const SnapshotVersion& v, const std::string& source,
                               const std::string& origin, const std::vector<int>& ranks) {
  // For each target: it, then the nodes after it in the chain, each tried only when the one
  // before did not take the announcement (a node stopped or gone, not yet out of the round). A
  // node that did not answer an earlier announcement is stepped over without a try: it is told
  // again, with everything else it missed, by tellAgain (at worst twice, which it takes as once).
  const auto& nodes = round_.nodes;
  const int origin_rank = rankOf(origin);
  const int count = static_cast<int>(nodes.size());
  std::vector<std::vector<std::string>> lines;
  bool missed = false;
  for (int r : ranks) {
    std::vector<std::string> line;
    for (int next = r; next >= 0 && next < count && next != round_.self;) {
      if (nodes[next].empty()) {
        // A node whose holdings have not come (or were unreadable): not known to be one of the
        // round yet. Told what it missed once they come (onLateHoldings).
      } else if (announcing_.unanswering.count(nodes[next]) != 0) {
        keepToTellAgain(Unannounced{v, source, origin, nodes[next], round_.number});
        missed = true;
      } else {
        line.push_back(nodes[next]);
      }
      const auto after = relayTargets(origin_rank, next, count);
      next = after.empty() ? -1 : after.front();
    }
    if (!line.empty()) lines.push_back(std::move(line));
  }
  if (missed) tellAgainLater();
  if (lines.empty()) return;
  ++announcing_.in_flight;
  emit(Announce{v, source, origin, std::move(lines), round_.number});
}

void ReplicationCore::onAnnounced(const Announced& done) {
  --announcing_.in_flight;
  const Announce& a = done.announce;
  for (const auto& f : done.failed) {
    if (announcing_.unanswering.insert(f.peer).second) {  // warned once per node, until it answers
      snapLog()->warn(
          "snapshot: announcing {} version {} failed at {}: {}; {}", a.version.name,
          versionText(a.version.version), f.peer, f.why,
          f.stepped ? "told the next node of the chain, and telling it again" : "telling it again");
    }
    keepToTellAgain(Unannounced{a.version, a.source, a.origin, f.peer, a.round});
  }
  if (!done.failed.empty()) tellAgainLater();
}

void ReplicationCore::keepToTellAgain(Unannounced u) {
  // One to tell again per node and name: the newest, by content too (two nodes that wrote the
  // name under one number: the greater content, which every node ends with).
  auto& list = announcing_.again;
  for (const auto& kept : list) {
    if (kept.peer == u.peer && kept.version.name == u.version.name &&
        (kept.version.sameContent(u.version) || kept.version.supersedes(u.version))) {
      return;
    }
  }
  list.erase(std::remove_if(list.begin(), list.end(),
                            [&](const Unannounced& kept) {
                              return kept.peer == u.peer && kept.version.name == u.version.name;
                            }),
             list.end());
  list.push_back(std::move(u));
}

void ReplicationCore::tellAgainLater() {
  if (!announcing_.retry_at) announcing_.retry_at = clock_.now() + options_.announce_retry;
}

void ReplicationCore::tellAgain() {
  // A later round's sync covers what the earlier one's announcements did not.
  std::map<std::string, std::vector<Unannounced>> by_peer;
  for (auto& u : announcing_.again) {
    if (u.round == round_.number && rankOf(u.peer) >= 0) by_peer[u.peer].push_back(std::move(u));
  }
  announcing_.again.clear();
  for (auto& [peer, list] : by_peer) {
    ++announcing_.in_flight;
    emit(AnnounceAgain{peer, std::move(list)});
  }
}

void ReplicationCore::onAnnouncedAgain(const AnnounceAgain& again, size_t told) {
  --announcing_.in_flight;
  if (told >= again.items.size()) {
    announcing_.unanswering.erase(again.peer);
    return;
  }
  for (size_t i = told; i < again.items.size(); ++i) keepToTellAgain(again.items[i]);
  tellAgainLater();
}

void ReplicationCore::relay(const SnapshotVersion& v, const std::string& source) {
  const auto origin = relays_.pass(v, /*early=*/false);
  // None when the round changed: its sync covers it.
  if (origin) announce(v, source, *origin, chainAfter(*origin));
}

std::vector<int> ReplicationCore::subtree(const SnapshotVersion& v, std::string* origin) const {
  auto told = relays_.origin(v);
  if (!told) return {};
  *origin = *told;
  return chainAfter(*told);
}

std::vector<int> ReplicationCore::chainAfter(const std::string& origin) const {
  const int origin_rank = rankOf(origin);
  if (round_.self < 0 || origin_rank < 0) return {};  // the round changed: its sync covers it
  return relayTargets(origin_rank, round_.self, static_cast<int>(round_.nodes.size()));
}

int ReplicationCore::rankOf(const std::string& endpoint) const {
  if (endpoint.empty()) return -1;  // the place of a node not known (yet)
  const auto& nodes = round_.nodes;
  auto at = std::find(nodes.begin(), nodes.end(), endpoint);
  return at == nodes.end() ? -1 : static_cast<int>(at - nodes.begin());
}

void ReplicationCore::onAnnounce(const SnapshotVersion& announced, const std::string& source,
                                 const std::string& origin) {
  if (!isReplicatedName(announced.name)) return;  // a peer's name that would leave the directory
  // Only the nodes of the round are listened to (their endpoints came through the rendezvous,
  // which has the job's token). While a round's holdings are still awaited, who is a node is not
  // known yet: the announcement waits for them (a few, the newest kept).
  if (!round_.nodes_known) {
    keepUnverified(announced, source, origin);
    return;
  }
  if (rankOf(source) < 0) {
    if (keepUnverified(announced, source, origin)) {
      if (auto n = warnings_.ignored.note(source, clock_.now())) {
        snapLog()->warn(
            "snapshot: holding back {} announcement(s) from {}, which is not a node of round {} "
            "whose holdings came (the last: {} version {}): taken if it is one whose holdings are "
            "late",
            *n, quotePeerText(source, 100), round_.number, quotePeerText(announced.name, 200),
            versionText(announced.version));
      }
      return;
    }
    if (auto n = warnings_.ignored.note(source, clock_.now())) {
      snapLog()->warn(
          "snapshot: ignored {} announcement(s) from {}, which is not a node of round {} (the "
          "last: {} version {})",
          *n, quotePeerText(source, 100), round_.number, quotePeerText(announced.name, 200),
          versionText(announced.version));
    }
    return;
  }
  if (!isPossibleVersion(announced.version)) {
    if (auto more = firstFew(warnings_.impossible_versions)) {
      snapLog()->warn(
          "snapshot: {} announced {} with version {} (round {}), which no job reaches: "
          "ignored{}",
          source, announced.name, announced.version, announced.version >> 32, *more);
    }
    return;
  }
  SnapshotVersion v = announced;
  if (!v.moved_from.empty() && !isReplicatedName(v.moved_from)) {
    v.moved_from.clear();  // a hint naming nothing this node could hold
    v.moved_from_version = 0;
  }
  if (!v.moved_to.empty() && !isReplicatedName(v.moved_to)) v.moved_to.clear();
  const bool newer = replica_.shouldInstall(v);
  if (!tookHolder(v, source)) return;
  relays_.told(v, origin);
  if (newer) heardOf(v);
  pump();
}

void ReplicationCore::heardOf(const SnapshotVersion& v) {
  auto& heard = first_heard_[v.name];
  if (heard.first != v.version) heard = {v.version, clock_.now()};
}

bool ReplicationCore::tookHolder(const SnapshotVersion& v, const std::string& source) {
  const HolderNews news = replica_.onHolder(v, source);
  if (news != HolderNews::kTooManyFromHolder && news != HolderNews::kTooManyNames) return true;
  if (auto n = warnings_.names.note(source, clock_.now())) {
    const bool theirs = news == HolderNews::kTooManyFromHolder;
    snapLog()->warn(
        "snapshot: refused {} new name(s) from {} (the last: {}): {} names wait to be fetched "
        "here{}, the most --snapshot-limits {} allows",
        *n, quotePeerText(source, 100), quotePeerText(v.name, 200),
        theirs ? replica_.namesFrom(source) : replica_.pendingNames(),
        theirs ? " from it" : " in all", theirs ? "names_per_peer" : "names");
  }
  return false;
}

uint64_t ReplicationCore::beginRound(uint64_t round, int index) {
  if (round_.syncing) {  // a previous round's sync is superseded: hand that round on as it is
    round_.syncing = false;
    emit(SyncDone{generation_});
  }
  ++generation_;
  round_.number = round;
  round_.rank = index;
  round_.nodes_known = false;  // announcements wait for this round's holdings
  round_.holdings_in = false;
  round_.missing.clear();
  announcing_.unanswering.clear();  // this round's nodes are tried afresh
  replica_.retryGivenUp();
  replica_.setSelfIndex(index);
  return generation_;
}

std::string ReplicationCore::holdings() const {
  return encodeHoldings(endpoint_, replica_.heldList());
}

void ReplicationCore::onHoldingsNotPublished(uint64_t generation, const Status& why) {
  if (generation != generation_ || round_.holdings_in) return;
  snapLog()->warn("snapshot: cannot publish this node's holdings: {}", why.message());
  finishSync(generation);
}

void ReplicationCore::onHoldings(uint64_t generation,
                                 const StatusOr<std::vector<std::string>>& values) {
  if (generation != generation_ || round_.holdings_in) return;
  if (!values.isOk()) {
    snapLog()->warn(
        "snapshot: the other nodes' holdings did not arrive ({}); starting with what this node "
        "holds",
        values.status().message());
    nodesKnown();  // those of the round before, if any
    finishSync(generation);
    return;
  }
  learnHoldings(std::vector<std::optional<std::string>>(values->begin(), values->end()));
  dropGoneSources();
  nodesKnown();
  finishSync(generation);
}

void ReplicationCore::onSomeHoldings(uint64_t generation,
                                     const std::vector<std::optional<std::string>>& values) {
  if (generation != generation_ || round_.holdings_in) return;
  std::vector<std::string> late;
  for (size_t i = 0; i < values.size(); ++i) {
    if (values[i] || static_cast<int>(i) == round_.rank) continue;
    round_.missing.insert(i);
    if (late.size() < 5) late.push_back(std::to_string(i + 1));
  }
  if (!round_.missing.empty()) {  // (the last may have come since the shell's wait ended)
    snapLog()->warn(
        "snapshot: the holdings of replicating node(s) {}{} of {} did not arrive in time; round {} "
        "starts with the {} that did, and takes the others in when theirs come",
        join(late, ", "), round_.missing.size() > late.size() ? ", ..." : "", values.size(),
        round_.number, values.size() - round_.missing.size());
  }
  learnHoldings(values);
  dropGoneSources();
  nodesKnown();
  finishSync(generation);
}

void ReplicationCore::onLateHoldings(uint64_t generation, size_t index, const std::string& value) {
  if (generation != generation_ || round_.missing.erase(index) == 0) return;
  auto h = decodeHoldings(value);
  if (!h.isOk()) {
    snapLog()->warn("snapshot: the late holdings of replicating node {} of {} in round {}: {}",
                    index + 1, round_.nodes.size(), round_.number, h.status().message());
  } else if (h->first == endpoint_ || rankOf(h->first) >= 0) {
    // A node of the round (this one included) has that endpoint already: not a node twice.
    snapLog()->warn(
        "snapshot: the late holdings of replicating node {} of {} in round {} name {}, which "
        "another node of the round published: ignored",
        index + 1, round_.nodes.size(), round_.number, quotePeerText(h->first, 100));
  } else {
    learnHoldingsOf(index, *h);
    tellLateNode(index, h->second);
  }
  // Announcements from it waited; those from sources still unknown wait on while other nodes'
  // holdings are missing, and are ignored once none is.
  replayUnverified();
  pump();
}

void ReplicationCore::tellLateNode(size_t index, const std::vector<SnapshotVersion>& held) {
  const std::string& peer = round_.nodes[index];
  // It read the others' holdings as they were at the round's start: what it lacks of this round
  // (written or heard of here since) is told at once, as one list.
  std::map<std::string, uint64_t> has;
  for (const auto& v : held) has[v.name] = v.version;
  const uint64_t this_round = makeSnapshotVersion(round_.number, 0);
  std::vector<Unannounced> items;
  for (const auto& v : replica_.heldList()) {
    if (v.version < this_round) continue;
    auto it = has.find(v.name);
    if (it != has.end() && it->second >= v.version) continue;
    items.push_back(Unannounced{v, endpoint_, endpoint_, peer, round_.number});
  }
  snapLog()->info(
      "snapshot: the holdings of replicating node {} of {} ({}) came late; it is a node of round "
      "{} from now on{}",
      index + 1, round_.nodes.size(), quotePeerText(peer, 100), round_.number,
      items.empty() ? "" : ", told of " + std::to_string(items.size()) + " version(s) held here");
  if (items.empty()) return;
  ++announcing_.in_flight;
  emit(AnnounceAgain{peer, std::move(items)});
}

void ReplicationCore::learnHoldings(const std::vector<std::optional<std::string>>& values) {
  round_.nodes.assign(values.size(), "");
  round_.self = round_.rank;
  for (size_t i = 0; i < values.size(); ++i) {
    if (!values[i]) continue;
    auto h = decodeHoldings(*values[i]);
    if (!h.isOk()) {
      snapLog()->warn("snapshot: the holdings of replicating node {} of {} in round {}: {}", i + 1,
                      values.size(), round_.number, h.status().message());
      continue;
    }
    learnHoldingsOf(i, *h);
  }
  // This node's own, even when the store did not answer it back.
  const auto self = static_cast<size_t>(round_.self);
  if (round_.self >= 0 && self < values.size() && !values[self]) round_.nodes[self] = endpoint_;
}

void ReplicationCore::learnHoldingsOf(
    size_t index, const std::pair<std::string, std::vector<SnapshotVersion>>& holdings) {
  round_.nodes[index] = holdings.first;
  if (static_cast<int>(index) == round_.self) return;
  for (const auto& v : holdings.second) {
    if (replica_.shouldInstall(v) && tookHolder(v, holdings.first)) heardOf(v);
  }
}

bool ReplicationCore::keepUnverified(const SnapshotVersion& v, const std::string& source,
                                     const std::string& origin) {
  if (round_.nodes_known && round_.missing.empty()) return false;
  if (round_.unverified.size() >= options_.max_unverified) round_.unverified.pop_front();
  round_.unverified.push_back(Round::Unverified{v, source, origin});
  return true;
}

void ReplicationCore::replayUnverified() {
  auto waiting = std::move(round_.unverified);
  round_.unverified.clear();
  for (const auto& u : waiting) onAnnounce(u.version, u.source, u.origin);
}

void ReplicationCore::dropGoneSources() {
  const auto& live = round_.nodes;
  const size_t pending = replica_.pendingNames();
  replica_.keepSources(live);
  // What only the nodes gone were heard to hold is forgotten, with what passing it on needed.
  if (const size_t forgotten = pending - std::min(pending, replica_.pendingNames())) {
    snapLog()->info("snapshot: forgot {} name(s) that only nodes no longer in round {} held{}",
                    forgotten, round_.number,
                    round_.missing.empty() ? "" : " (or nodes whose holdings are late)");
  }
  for (auto it = first_heard_.begin(); it != first_heard_.end();) {
    it = replica_.wanted(it->first) ? std::next(it) : first_heard_.erase(it);
  }
  relays_.forgetUnless(
      [this](const std::string& name) { return replica_.wanted(name).has_value(); });
  // A fetch from a node that is not in the new round ends now: one that stopped answering would
  // hold the round's sync until the fetch's deadline.
  for (auto& [name, fetch] : running_) {
    if (fetch.cancelled) continue;  // ended at an earlier round's sync
    if (std::find(live.begin(), live.end(), fetch.source) != live.end()) continue;
    // (With holdings late, it may be a node of the round all the same: what it holds is fetched
    // again once they come.)
    const std::string why = "not a node of round " + std::to_string(round_.number) +
                            (round_.missing.empty() ? "" : " whose holdings came");
    snapLog()->warn("snapshot: ending the fetch of {} from {}: {}", name, fetch.source, why);
    fetch.cancelled = true;
    emit(CancelFetch{name, Status(StatusCode::kUnavailable, fetch.source + " is " + why)});
  }
}

void ReplicationCore::nodesKnown() {
  round_.nodes_known = true;
  replayUnverified();
}

void ReplicationCore::finishSync(uint64_t generation) {
  if (generation != generation_ || round_.holdings_in) return;
  round_.holdings_in = true;
  round_.syncing = true;
  pump();
}

void ReplicationCore::maybeFinishSync() {
  if (!round_.syncing || replica_.busy()) return;
  round_.syncing = false;
  emit(SyncDone{generation_});
}

}  // namespace ddprun::snapshot
