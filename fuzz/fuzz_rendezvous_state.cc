// libFuzzer target: the pure RendezvousState fed random sequences of requests (joins, cancels,
// heartbeats, leaves, failure reports, closes, watch streams, masters, every key-value call, time
// passing). Small limits put the quotas and bounds in reach. After every step it checks:
// - every completed round has contiguous group ranks 0..n-1, distinct nodes, MIN <= n <= MAX,
//   WORLD_SIZE = the sum of local world sizes, and each node's base rank the sum below it;
// - all joiners of one round of one run are told the same participants;
// - every call is answered at most once, never after it was cancelled, and abortAll() answers
//   every call still pending (none is lost);
// - the key-value bytes held never exceed the server-wide quota.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "ddprun/rendezvous/state.h"
#include "fuzz_check.h"

using namespace ddprun;
using namespace ddprun::rendezvous;

namespace {

using CallId = RendezvousState::CallId;

constexpr int kRuns = 2;
constexpr int kNodes = 6;

struct Harness {
  StateLimits limits;
  RendezvousState state;
  TimePoint now = TimePoint{} + std::chrono::hours(1);
  RunConfig configs[kRuns];
  CallId next_id = 1;
  std::map<CallId, int> pending_joins;  // id -> run
  std::set<CallId> pending_waits;       // key waits and master waits
  std::map<std::pair<std::string, uint64_t>, std::vector<Participant>> rounds;
  std::map<std::string, int> open_watches;
  std::map<std::string, uint64_t> last_round;  // per run: a round number worth asking about

  explicit Harness(const StateLimits& l) : limits(l), state(l) {}

  static std::string run(int r) { return "run" + std::to_string(r); }
  static std::string node(int n) { return "n" + std::to_string(n); }

  void checkRound(const std::string& run_id, const RoundInfo& info) {
    FUZZ_CHECK(info.participants != nullptr);
    const auto& ps = *info.participants;
    FUZZ_CHECK(!ps.empty());
    FUZZ_CHECK(ps.size() == info.group_world_size);
    FUZZ_CHECK(info.group_rank < ps.size());
    FUZZ_CHECK(ps[info.group_rank].node_id == info.node_id);
    uint64_t sum = 0, base = 0;
    std::set<std::string> ids;
    for (uint32_t i = 0; i < ps.size(); ++i) {
      FUZZ_CHECK(ps[i].group_rank == i);  // contiguous, in rank order
      FUZZ_CHECK(ps[i].local_world_size >= 1);
      FUZZ_CHECK(ids.insert(ps[i].node_id).second);
      if (i == info.group_rank) base = sum;
      sum += ps[i].local_world_size;
    }
    FUZZ_CHECK(sum == info.world_size);
    FUZZ_CHECK(base == info.base_rank);
    // A run takes the nnodes of the join that created it: some joins ask for MAX + 1.
    const int r = run_id == run(0) ? 0 : 1;
    FUZZ_CHECK(ps.size() >= configs[r].min_nodes && ps.size() <= configs[r].max_nodes + 1);
    auto [it, inserted] = rounds.try_emplace({run_id, info.round}, ps);
    if (!inserted) {
      FUZZ_CHECK(it->second.size() == ps.size());
      for (size_t i = 0; i < ps.size(); ++i) {
        FUZZ_CHECK(it->second[i].node_id == ps[i].node_id);
        FUZZ_CHECK(it->second[i].local_world_size == ps[i].local_world_size);
      }
    }
    last_round[run_id] = std::max(last_round[run_id], info.round);
  }

  void drain() {
    auto out = state.drain();
    for (auto& j : out.joins) {
      auto it = pending_joins.find(j.id);
      FUZZ_CHECK(it != pending_joins.end());  // answered once, never after a cancel
      const int r = it->second;
      pending_joins.erase(it);
      if (j.result.isOk()) checkRound(run(r), j.result.value());
    }
    for (auto& w : out.waits) FUZZ_CHECK(pending_waits.erase(w.id) == 1);
    for (auto& m : out.masters) FUZZ_CHECK(pending_waits.erase(m.id) == 1);
    for (auto& c : out.changes) {
      last_round[c.run_id] = std::max(last_round[c.run_id], c.change.round);
    }
    FUZZ_CHECK(state.census().kv_bytes <= limits.max_kv_bytes);
    FUZZ_CHECK(state.census().runs <= limits.max_runs);
    // A node new to a run becomes a spare only below the bound; a node the run knew (a survivor
    // of its round asking again) may wait beyond it, one per place of the round.
    for (int r = 0; r < kRuns; ++r) {
      auto st = state.status(run(r));
      if (st.isOk()) FUZZ_CHECK(st->spares <= limits.max_run_spares + configs[r].max_nodes);
    }
    // A run that was dropped (idle, or its tombstone expired) starts again at round 1.
    for (int r = 0; r < kRuns; ++r) {
      if (state.status(run(r)).status().code() != StatusCode::kNotFound) continue;
      rounds.erase(rounds.lower_bound({run(r), 0}), rounds.upper_bound({run(r), UINT64_MAX}));
      last_round.erase(run(r));
    }
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  StateLimits limits;
  limits.max_value_bytes = 64;
  limits.max_key_bytes = 16;
  limits.max_run_keys = 8;
  limits.max_run_kv_bytes = 256;
  limits.max_kv_bytes = 384;
  limits.max_local_world_size = 1024;
  limits.max_nodes = 16;
  limits.max_run_spares = 2;
  limits.max_wait_answer_bytes = 128;
  limits.max_runs = in.ConsumeBool() ? 1 : 2;  // 1: the second run is refused while the first is
  Harness h(limits);
  for (auto& c : h.configs) {
    c.min_nodes = in.ConsumeIntegralInRange<uint32_t>(1, 4);
    c.max_nodes = c.min_nodes + in.ConsumeIntegralInRange<uint32_t>(0, 3);
    c.last_call_timeout = std::chrono::milliseconds(in.ConsumeIntegralInRange<int>(0, 3000));
    c.heartbeat_interval = std::chrono::milliseconds(in.ConsumeIntegralInRange<int>(1, 2000));
    c.heartbeat_misses = in.ConsumeIntegralInRange<uint32_t>(1, 4);
  }
  while (in.remaining_bytes() > 0) {
    const int r = in.ConsumeIntegralInRange<int>(0, kRuns - 1);
    const std::string run = Harness::run(r);
    const std::string node = Harness::node(in.ConsumeIntegralInRange<int>(0, kNodes - 1));
    const uint64_t round = h.last_round[run] + in.ConsumeIntegralInRange<int>(-1, 1);
    const std::string key = "k" + std::to_string(in.ConsumeIntegralInRange<int>(0, 11));
    switch (in.ConsumeIntegralInRange<int>(0, 19)) {
      case 0:
      case 1: {
        JoinRequest req;
        req.run_id = run;
        req.node_id = in.ConsumeBool() ? node : "";
        req.address = node + ".host";
        req.local_world_size = in.ConsumeIntegralInRange<uint32_t>(0, 5);
        req.config = h.configs[r];
        if (in.ConsumeIntegralInRange<int>(0, 15) == 0) req.config.max_nodes += 1;  // mismatch
        req.join_timeout = std::chrono::milliseconds(in.ConsumeIntegralInRange<int>(1, 10000));
        const CallId id = h.next_id++;
        h.pending_joins[id] = r;
        h.state.join(id, req, h.now);
        break;
      }
      case 2:
        if (!h.pending_joins.empty()) {
          auto it = h.pending_joins.begin();
          std::advance(it, in.ConsumeIntegralInRange<size_t>(0, h.pending_joins.size() - 1));
          const CallId id = it->first;
          h.pending_joins.erase(it);
          h.state.cancelJoin(id, h.now);
        }
        break;
      case 3:
        (void)h.state.heartbeat(run, node, h.now);
        break;
      case 4:
        (void)h.state.leave(run, node, h.now);
        break;
      case 5:
        (void)h.state.reportFailure(
            run, node, round, h.now,
            in.ConsumeBool() ? FailureKind::kRecovery : FailureKind::kWorkers);
        break;
      case 6:
        if (in.ConsumeIntegralInRange<int>(0, 7) == 0) (void)h.state.close(run, h.now);
        break;
      case 7:
        h.state.watchLost(run, node, h.now);
        break;
      case 8:
        h.state.watchStarted(run, node);
        (void)h.state.watchSnapshot(run);
        break;
      case 9:
        h.state.watchOpened(run, h.now);
        ++h.open_watches[run];
        break;
      case 10:
        if (h.open_watches[run] > 0) {
          --h.open_watches[run];
          h.state.watchClosed(run, h.now);
        }
        break;
      case 11:
        (void)h.state.publishMaster(run, node, round,
                                    {node + ".host", in.ConsumeIntegralInRange<uint32_t>(0, 70000)},
                                    h.now);
        break;
      case 12: {
        const CallId id = h.next_id++;
        h.pending_waits.insert(id);
        h.state.waitMaster(id, run, round,
                           std::chrono::milliseconds(in.ConsumeIntegralInRange<int>(0, 5000)),
                           h.now);
        break;
      }
      case 13:
        (void)h.state.kvSet(run, key, in.ConsumeBytesAsString(in.ConsumeIntegralInRange(0, 80)),
                            h.now);
        break;
      case 14:
        (void)h.state.kvAdd(run, key, in.ConsumeIntegral<int64_t>(), h.now);
        break;
      case 15:
        (void)h.state.kvCompareSet(
            run, key, in.ConsumeBytesAsString(in.ConsumeIntegralInRange(0, 4)),
            in.ConsumeBytesAsString(in.ConsumeIntegralInRange(0, 80)), h.now);
        break;
      case 16:
        if (in.ConsumeBool()) {
          (void)h.state.kvDelete(run, key, h.now);
        } else {
          // A range, empty, reversed or over the reserved keys at times; nothing in it remains.
          const std::string to = in.ConsumeBool()
                                     ? std::string("__ddprun/z")
                                     : "k" + std::to_string(in.ConsumeIntegralInRange<int>(0, 11));
          const auto deleted = h.state.kvDeleteRange(run, key, to, h.now);
          if (deleted.isOk()) {
            FUZZ_CHECK(key < to);
            FUZZ_CHECK(h.state.kvGet(run, key).status().code() == StatusCode::kNotFound);
          }
        }
        (void)h.state.kvGet(run, key);
        break;
      case 17: {
        std::vector<std::string> keys;
        const int n = in.ConsumeIntegralInRange<int>(0, 3);
        for (int i = 0; i < n; ++i)
          keys.push_back("k" + std::to_string(in.ConsumeIntegralInRange(0, 11)));
        const CallId id = h.next_id++;
        h.pending_waits.insert(id);
        h.state.kvWait(id, run, std::move(keys),
                       std::chrono::milliseconds(in.ConsumeIntegralInRange<int>(0, 5000)), h.now);
        break;
      }
      case 18:
        if (!h.pending_waits.empty()) {
          auto it = h.pending_waits.begin();
          std::advance(it, in.ConsumeIntegralInRange<size_t>(0, h.pending_waits.size() - 1));
          const CallId id = *it;
          h.pending_waits.erase(it);
          h.state.cancelWait(id, h.now);
        }
        break;
      default: {
        // Time passes: to the next deadline, or by a random step (up to past the retention).
        auto next = h.state.nextDeadline();
        if (next && in.ConsumeBool()) {
          h.now = std::max(h.now, *next);
        } else {
          h.now += std::chrono::milliseconds(in.ConsumeIntegralInRange<int64_t>(0, 700000));
        }
        h.state.tick(h.now);
        break;
      }
    }
    h.drain();
  }
  // Nothing is lost: every call still pending is answered by a shutdown.
  h.state.abortAll(unavailable("fuzz: shutting down"));
  h.drain();
  FUZZ_CHECK(h.pending_joins.empty());
  FUZZ_CHECK(h.pending_waits.empty());
  return 0;
}
