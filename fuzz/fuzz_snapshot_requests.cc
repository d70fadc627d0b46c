// libFuzzer target: the snapshot replication protocol's request handling, without gRPC, as a
// hostile peer drives it. The input is a program of requests: Fetch ranges (planFetch), Fetch
// streams admitted and ended (FetchAdmission), announcements (normalizeAnnounced, then
// SnapshotReplica::onHolder, takeTransfers, onTransferDone), round holdings (decodeHoldings),
// a node leaving (keepSources) and the version table (decodeVersionTable). Invariants: every
// refusal is one clean line; a Fetch plan stays within the version and the server's chunk size;
// the stream bounds hold; what the replica fetches or deletes is a replicated name (never one
// that leaves the directory) of a possible version; the names waiting stay within their bounds.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "convert.h"  // snapshot/src: a version as the transport carries it
#include "ddprun/snapshot/replica.h"
#include "ddprun/snapshot/transfer.h"
#include "fuzz_check.h"

using ddprun::snapshot::FetchAdmission;
using ddprun::snapshot::HolderNews;
using ddprun::snapshot::SnapshotFile;
using ddprun::snapshot::SnapshotReplica;
using ddprun::snapshot::TransferOutcome;

namespace {

constexpr int kPerPeer = 3;
constexpr int kStreams = 5;
constexpr size_t kNamesPerHolder = 8;
constexpr size_t kNames = 12;

const char* const kPeers[] = {"ipv4:10.0.0.1", "ipv4:10.0.0.2", "ipv6:[::1]", "x"};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  FetchAdmission admission(kPerPeer, kStreams);
  std::map<std::string, int> admitted;
  ddprun::snapshot::SnapshotReplicaOptions options;
  options.max_names_per_holder = kNamesPerHolder;
  options.max_pending_names = kNames;
  options.max_tombstones = 4;
  SnapshotReplica replica(options);
  std::vector<ddprun::snapshot::SnapshotTransfer> running;
  std::vector<std::string> sources = {"10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"};
  for (int op = 0; op < 64 && in.remaining_bytes() > 0; ++op) {
    switch (in.ConsumeIntegralInRange<int>(0, 7)) {
      case 0: {  // a Fetch's range
        const std::string name = in.ConsumeRandomLengthString(64);
        const uint64_t held = in.ConsumeIntegral<uint64_t>();
        const uint64_t offset = in.ConsumeIntegral<uint64_t>();
        const uint64_t length = in.ConsumeIntegral<uint64_t>();
        const uint32_t chunk = in.ConsumeIntegral<uint32_t>();
        const size_t server = in.ConsumeIntegralInRange<size_t>(0, 8 << 20);
        auto plan = ddprun::snapshot::planFetch(name, held, offset, length, chunk, server);
        if (!plan.isOk()) {
          FUZZ_CHECK(isOneCleanLine(plan.status().message()));
          break;
        }
        FUZZ_CHECK(plan->begin <= plan->end && plan->end <= held);
        FUZZ_CHECK(plan->chunk >= 1 && plan->chunk <= std::max<size_t>(server, 1));
        break;
      }
      case 1: {  // a stream admitted
        const std::string peer = kPeers[in.ConsumeIntegralInRange<int>(0, 3)];
        auto st = admission.admit(peer);
        if (st.isOk()) {
          ++admitted[peer];
        } else {
          FUZZ_CHECK(isOneCleanLine(st.message()));
        }
        FUZZ_CHECK(admitted[peer] <= kPerPeer && admission.total() <= kStreams);
        break;
      }
      case 2: {  // a stream ended (or one never admitted)
        const std::string peer = kPeers[in.ConsumeIntegralInRange<int>(0, 3)];
        admission.release(peer);
        if (admitted[peer] > 0) --admitted[peer];
        break;
      }
      case 3: {  // an announcement
        SnapshotFile f{in.ConsumeRandomLengthString(128), in.ConsumeIntegral<uint64_t>(),
                       in.ConsumeIntegral<uint64_t>(), in.ConsumeIntegral<uint32_t>()};
        f.crc32_pending = in.ConsumeBool();
        f.deleted = in.ConsumeBool();
        f.moved_from = in.ConsumeRandomLengthString(64);
        f.moved_from_version = in.ConsumeIntegral<uint64_t>();
        f.moved_to = in.ConsumeRandomLengthString(64);
        const SnapshotFile n = ddprun::snapshot::normalizeAnnounced(f);
        FUZZ_CHECK(!n.deleted || (n.size == 0 && n.crc32 == 0 && n.moved_from.empty()));
        FUZZ_CHECK(!n.crc32_pending || (n.crc32 == 0 && n.moved_from.empty()));
        const std::string& source = sources[in.ConsumeIntegralInRange<size_t>(0, 2)];
        const HolderNews news = replica.onHolder(ddprun::snapshot::fromWire(n), source);
        if (news == HolderNews::kTaken) FUZZ_CHECK(ddprun::snapshot::isReplicatedName(n.name));
        break;
      }
      case 4: {  // transfers started, and how some ended
        for (auto& t : replica.takeTransfers()) {
          FUZZ_CHECK(ddprun::snapshot::isReplicatedName(t.file.name));
          FUZZ_CHECK(ddprun::snapshot::isPossibleVersion(t.file.version));
          FUZZ_CHECK(t.attempt >= 1);
          running.push_back(std::move(t));
        }
        while (!running.empty() && in.ConsumeBool()) {
          const auto outcome = static_cast<TransferOutcome>(in.ConsumeIntegralInRange<int>(0, 5));
          replica.onTransferDone(running.back(), outcome);
          running.pop_back();
        }
        break;
      }
      case 5: {  // a node's round holdings
        auto holdings = ddprun::snapshot::decodeHoldings(in.ConsumeRandomLengthString(512));
        if (!holdings.isOk()) {
          FUZZ_CHECK(isOneCleanLine(holdings.status().message()));
          break;
        }
        for (const auto& v : holdings->second) {
          FUZZ_CHECK(ddprun::snapshot::isReplicatedName(v.name));
          FUZZ_CHECK(ddprun::snapshot::isPossibleVersion(v.version));
          (void)replica.onHolder(v, holdings->first.substr(0, 64));
        }
        break;
      }
      case 6: {  // a node left: the next round's nodes
        const size_t keep = in.ConsumeIntegralInRange<size_t>(0, sources.size());
        const size_t before = replica.pendingNames();
        replica.keepSources(std::vector<std::string>(sources.begin(), sources.begin() + keep));
        FUZZ_CHECK(replica.pendingNames() <= before);
        break;
      }
      case 7: {  // a version table read at start
        auto table = ddprun::snapshot::decodeVersionTable(in.ConsumeRandomLengthString(512));
        if (!table.isOk()) FUZZ_CHECK(isOneCleanLine(table.status().message()));
        break;
      }
    }
    FUZZ_CHECK(replica.pendingNames() <= kNames);
    for (const auto& s : sources) FUZZ_CHECK(replica.namesFrom(s) <= kNamesPerHolder);
  }
  for (const auto& t : running) replica.onTransferDone(t, TransferOutcome::kCancelled);
  return 0;
}
