// libFuzzer target: the pure ReplicationCore of snapshot replication (snapshot/core.h) fed random
// sequences of events, the harness playing the shell: files changed, renamed (pairs or halves)
// and deleted here, directories gone, rescans; looks and hashes answered in any way; peers'
// announcements (any name, version, flags, source); rounds begun and their holdings (good, damaged
// or missing); fetches, links, installs and deletions ending in any way; announcements failing;
// time passing. Small bounds put them in reach. After every step it checks:
// - at most one look runs, and only a look the core asked for is answered;
// - at most one transfer (fetch or link) runs per name, and every action names a replicated name
//   of a possible version (never one that would leave the directory);
// - every round's sync is handed on at most once, and none but the current one is left open;
// - every version table the core records reads back, and the names waiting stay within bounds;
// - once the harness answered everything, the core is quiet (replicated()) unless a fetch is
//   wanted, and nextDeadline() is never in the past after tick() and settled().
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ddprun/snapshot/core.h"
#include "fuzz_check.h"

using namespace ddprun;
using namespace ddprun::snapshot;

namespace {

const char* const kNames[] = {"a", "b", "d/c", "d/e", "e/f", "../x", ".ddprun-versions", "a.tmp"};
const char* const kNodes[] = {"p0:1", "p1:1", "p2:1", "p3:1"};  // p0 is this node
constexpr int kNodeCount = 4;

class Clock final : public ddprun::Clock {
 public:
  TimePoint now() const override { return now_; }
  double wallSeconds() const override { return 0; }
  void advance(Duration d) { now_ += d; }

 private:
  TimePoint now_{std::chrono::hours(1)};
};

struct Harness {
  Clock clock;
  ReplicationCore core;
  std::optional<Look> look;                          // the look that runs
  std::optional<Hash> hash;                          // the hash that runs
  std::deque<Announce> announces;                    // out, not answered
  std::deque<AnnounceAgain> agains;                  // out, not answered
  std::map<std::string, Fetch> fetches;              // by name: running
  std::set<uint64_t> synced;                         // generations handed on
  std::vector<std::pair<size_t, std::string>> late;  // holdings not come yet, by index
  uint64_t ino = 100;

  static CoreOptions options() {
    CoreOptions o;
    o.replica.max_names_per_holder = 4;
    o.replica.max_pending_names = 6;
    o.replica.max_tombstones = 3;
    o.max_unverified = 3;
    return o;
  }
  Harness() : core(options(), clock) { core.setEndpoint(kNodes[0]); }

  static void checkVersion(const SnapshotVersion& v) {
    FUZZ_CHECK(isReplicatedName(v.name));
    FUZZ_CHECK(isPossibleVersion(v.version));
  }

  // Carries out what the core asked for; links, installs and deletions end at once, as in the
  // shell (their outcome drawn from `in`).
  void carryOut(FuzzedDataProvider& in) {
    for (int rounds = 0; rounds < 64; ++rounds) {
      auto actions = core.drain();
      if (actions.empty()) return;
      for (auto& a : actions) act(a, in);
    }
  }

  void act(Action& a, FuzzedDataProvider& in) {
    if (auto* l = std::get_if<Look>(&a)) {
      FUZZ_CHECK(!look && !hash);  // one at a time
      FUZZ_CHECK(isReplicatedName(l->name));
      look = *l;
    } else if (auto* h = std::get_if<Hold>(&a)) {
      checkVersion(h->version);
    } else if (auto* h = std::get_if<Hash>(&a)) {
      FUZZ_CHECK(!hash);
      hash = *h;
    } else if (auto* an = std::get_if<Announce>(&a)) {
      checkVersion(an->version);
      for (const auto& line : an->lines) FUZZ_CHECK(!line.empty());
      announces.push_back(*an);
    } else if (auto* ag = std::get_if<AnnounceAgain>(&a)) {
      FUZZ_CHECK(!ag->items.empty());
      agains.push_back(*ag);
    } else if (auto* f = std::get_if<Fetch>(&a)) {
      checkVersion(f->transfer.file);
      FUZZ_CHECK(!f->transfer.file.deleted);
      FUZZ_CHECK(fetches.count(f->transfer.file.name) == 0);
      fetches[f->transfer.file.name] = *f;
    } else if (auto* k = std::get_if<Link>(&a)) {
      checkVersion(k->transfer.file);
      FUZZ_CHECK(fetches.count(k->transfer.file.name) == 0);
      core.onLinked(Linked{k->transfer, in.ConsumeBool() ? "tmp" : ""});
    } else if (auto* i = std::get_if<Install>(&a)) {
      checkVersion(i->transfer.file);
      const bool ok = in.ConsumeBool();
      core.onInstalled(Installed{i->transfer, i->taken,
                                 ok ? Status::ok() : Status(StatusCode::kInternal, "no rename"),
                                 FileId{1, ++ino, 1, i->transfer.file.size}});
    } else if (auto* d = std::get_if<Delete>(&a)) {
      checkVersion(d->transfer.file);
      FUZZ_CHECK(d->transfer.file.deleted);
      const bool ok = in.ConsumeBool();
      core.onDeleted(Deleted{d->transfer,
                             ok ? Status::ok() : Status(StatusCode::kFailedPrecondition, "link"),
                             ok && d->set_aside, in.ConsumeBool() ? ".ddprun-recv.kept.1" : ""});
    } else if (auto* c = std::get_if<CancelFetch>(&a)) {
      FUZZ_CHECK(!c->why.isOk());
    } else if (auto* r = std::get_if<RecordTable>(&a)) {
      FUZZ_CHECK(decodeVersionTable(r->text).isOk());
    } else if (auto* s = std::get_if<SyncDone>(&a)) {
      FUZZ_CHECK(s->generation <= core.generation());
      FUZZ_CHECK(synced.insert(s->generation).second);
    }
  }

  SnapshotVersion version(FuzzedDataProvider& in) {
    SnapshotVersion v{
        kNames[in.ConsumeIntegralInRange<int>(0, 7)],
        in.ConsumeBool()
            ? in.ConsumeIntegral<uint64_t>()
            : makeSnapshotVersion(in.ConsumeIntegralInRange(0, 3), in.ConsumeIntegralInRange(0, 5)),
        in.ConsumeIntegralInRange<uint64_t>(0, 3), in.ConsumeIntegralInRange<uint32_t>(0, 3)};
    v.crc_pending = in.ConsumeBool();
    v.deleted = in.ConsumeBool();
    if (v.deleted) v.size = v.crc32 = 0;
    if (in.ConsumeBool()) {
      v.moved_from = kNames[in.ConsumeIntegralInRange<int>(0, 7)];
      v.moved_from_version = makeSnapshotVersion(in.ConsumeIntegralInRange(0, 3), 1);
    }
    if (in.ConsumeBool()) v.moved_to = kNames[in.ConsumeIntegralInRange<int>(0, 7)];
    return v;
  }

  void step(FuzzedDataProvider& in) {
    const std::string name = kNames[in.ConsumeIntegralInRange<int>(0, 7)];
    switch (in.ConsumeIntegralInRange<int>(0, 13)) {
      case 0:
        core.onChanged(name);
        break;
      case 1:
        core.onMovedFrom(in.ConsumeIntegralInRange<uint32_t>(1, 3), name, in.ConsumeBool());
        break;
      case 2:
        core.onMovedTo(in.ConsumeIntegralInRange<uint32_t>(0, 3), name, in.ConsumeBool(),
                       {name + "/a", kNames[in.ConsumeIntegralInRange<int>(0, 7)]});
        break;
      case 3:
        if (in.ConsumeBool()) {
          core.onDirGone(name);
        } else {
          core.onRescan({name});
        }
        break;
      case 4:
        answerLook(in);
        break;
      case 5:
        if (hash) {
          const Hash h = *hash;
          hash.reset();
          core.onHashed(h.name, h.version,
                        in.ConsumeBool() ? StatusOr<uint32_t>(in.ConsumeIntegral<uint32_t>())
                                         : StatusOr<uint32_t>(internalError("short read")));
        }
        break;
      case 6:
        core.onAnnounce(version(in), kNodes[in.ConsumeIntegralInRange(0, kNodeCount - 1)],
                        in.ConsumeBool() ? kNodes[in.ConsumeIntegralInRange(0, kNodeCount - 1)]
                                         : "elsewhere:1");
        break;
      case 7:
        answerAnnounce(in);
        break;
      case 8:
        newRound(in);
        break;
      case 9:
        answerFetch(in);
        break;
      case 10:
      case 11:
        clock.advance(std::chrono::milliseconds(in.ConsumeIntegralInRange(0, 12000)));
        core.tick();
        core.settled();
        break;
      case 12:
        if (!late.empty() && in.ConsumeBool()) {  // a node's holdings that did not come, come
          const auto [index, value] = late.back();
          late.pop_back();
          core.onLateHoldings(core.generation() - in.ConsumeIntegralInRange<uint64_t>(0, 1), index,
                              value);
          break;
        }
        core.onHoldings(core.generation() - in.ConsumeIntegralInRange<uint64_t>(0, 1),
                        Status(StatusCode::kDeadlineExceeded, "late"));
        break;
      case 13:
        core.onHoldingsNotPublished(core.generation(), Status(StatusCode::kUnavailable, "gone"));
        break;
    }
    carryOut(in);
  }

  void answerLook(FuzzedDataProvider& in) {
    if (!look) return;
    const Look l = *look;
    look.reset();
    Looked r;
    r.kind = static_cast<Looked::Kind>(in.ConsumeIntegralInRange(0, 7));
    if (r.kind == Looked::Kind::kSame && l.held) r.id = *l.held;
    if (r.kind == Looked::Kind::kRenamed) {
      if (!l.renamed)
        r.kind = Looked::Kind::kHashed;  // the shell says so only when asked
      else
        r.id = *l.renamed;
    }
    if (r.kind != Looked::Kind::kSame && r.kind != Looked::Kind::kRenamed) {
      r.id = FileId{1, in.ConsumeBool() && l.held ? l.held->ino : ++ino, 1, 1};
    }
    r.size = in.ConsumeIntegralInRange<uint64_t>(0, 3);
    r.crc32 = in.ConsumeIntegralInRange<uint32_t>(0, 3);
    r.why = "why";
    core.onLooked(l.name, r);
  }

  void answerAnnounce(FuzzedDataProvider& in) {
    if (!announces.empty()) {
      Announced done{announces.front(), {}};
      announces.pop_front();
      for (const auto& line : done.announce.lines) {
        if (in.ConsumeBool()) done.failed.push_back({line.front(), "unavailable", line.size() > 1});
      }
      core.onAnnounced(done);
    }
    if (!agains.empty() && in.ConsumeBool()) {
      const AnnounceAgain again = agains.front();
      agains.pop_front();
      core.onAnnouncedAgain(again, in.ConsumeIntegralInRange<size_t>(0, again.items.size()));
    }
  }

  void newRound(FuzzedDataProvider& in) {
    const int nodes = in.ConsumeIntegralInRange(1, kNodeCount);
    const uint64_t gen = core.beginRound(in.ConsumeIntegralInRange<uint64_t>(1, 4), 0);
    carryOut(in);
    if (in.ConsumeBool()) return;  // holdings later (case 12), or never
    std::vector<std::string> values;
    values.push_back(core.holdings());
    for (int i = 1; i < nodes; ++i) {
      if (in.ConsumeBool()) {
        values.push_back(in.ConsumeRandomLengthString(64));  // damaged
        continue;
      }
      std::vector<SnapshotVersion> held;
      for (int n = in.ConsumeIntegralInRange(0, 3); n > 0; --n) {
        SnapshotVersion v = version(in);
        v.moved_from.clear();
        v.moved_to.clear();
        v.crc_pending = false;
        if (isReplicatedName(v.name) && isPossibleVersion(v.version)) held.push_back(v);
      }
      values.push_back(encodeHoldings(kNodes[i], held));
    }
    late.clear();
    if (!in.ConsumeBool()) {
      core.onHoldings(gen, values);
      return;
    }
    // Some did not come in time: those come later (case 12), in any order, or never.
    std::vector<std::optional<std::string>> some(values.begin(), values.end());
    for (size_t i = 1; i < some.size(); ++i) {
      if (!in.ConsumeBool()) continue;
      late.emplace_back(i, *some[i]);
      some[i].reset();
    }
    core.onSomeHoldings(gen, some);
  }

  void answerFetch(FuzzedDataProvider& in) {
    if (fetches.empty()) return;
    auto it = fetches.begin();
    std::advance(it, in.ConsumeIntegralInRange<size_t>(0, fetches.size() - 1));
    const Fetch f = it->second;
    fetches.erase(it);
    static const StatusCode kCodes[] = {StatusCode::kOk, StatusCode::kDataLoss,
                                        StatusCode::kResourceExhausted, StatusCode::kCancelled,
                                        StatusCode::kUnavailable};
    const StatusCode code = kCodes[in.ConsumeIntegralInRange(0, 4)];
    core.onFetched(Fetched{f.transfer,
                           code == StatusCode::kOk ? Status::ok() : Status(code, "failed"),
                           f.transfer.file.crc32, "tmp", !f.copy_from.empty()});
  }

  // Answers everything still out (as an agent stopping does not: but a quiet core is one that
  // was answered).
  void finish(FuzzedDataProvider& in) {
    for (int i = 0;
         i < 256 && (look || hash || !announces.empty() || !agains.empty() || !fetches.empty());
         ++i) {
      if (look) {
        answerLook(in);
      } else if (hash) {
        core.onHashed(hash->name, hash->version, uint32_t{1});
        hash.reset();
      } else if (!announces.empty()) {
        core.onAnnounced(Announced{announces.front(), {}});
        announces.pop_front();
      } else if (!agains.empty()) {
        core.onAnnouncedAgain(agains.front(), agains.front().items.size());
        agains.pop_front();
      } else {
        const Fetch f = fetches.begin()->second;
        fetches.erase(fetches.begin());
        core.onFetched(Fetched{f.transfer, Status(StatusCode::kCancelled, "stop"), 0, "", false});
      }
      carryOut(in);
    }
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  Harness h;
  std::map<std::string, SnapshotVersion> table;
  if (in.ConsumeBool()) {
    table["a"] = SnapshotVersion{"a", makeSnapshotVersion(1, 1), 1, 1};
    SnapshotVersion gone{"b", makeSnapshotVersion(1, 2), 0, 0};
    gone.deleted = true;
    table["b"] = gone;
  }
  h.core.start(table, {Existing{"a", 1, 1, FileId{1, 1, 1, 1}}});
  h.carryOut(in);
  for (int op = 0; op < 96 && in.remaining_bytes() > 0; ++op) {
    h.step(in);
    FUZZ_CHECK(h.core.replica().pendingNames() <= Harness::options().replica.max_pending_names);
    if (auto due = h.core.nextDeadline()) {
      h.core.tick();
      h.core.settled();
      h.carryOut(in);
      due = h.core.nextDeadline();
      FUZZ_CHECK(!due || *due > h.clock.now());
    }
  }
  h.finish(in);
  if (!h.look && !h.hash && h.announces.empty() && h.agains.empty() && h.fetches.empty() &&
      !h.core.replica().busy()) {
    FUZZ_CHECK(h.core.replicated() || !h.core.versioned() || h.core.nextDeadline());
  }
  return 0;
}
