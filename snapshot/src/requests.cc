// The request handling of the snapshot replication server that needs no gRPC: a Fetch's byte
// range and chunk size, an announcement's fields, the bounds on streams. (transfer.h)
#include <algorithm>

#include "ddprun/common/strings.h"
#include "ddprun/snapshot/transfer.h"

namespace ddprun::snapshot {

StatusOr<FetchPlan> planFetch(const std::string& name, uint64_t size, uint64_t offset,
                              uint64_t length, uint32_t chunk_bytes, size_t server_chunk) {
  if (offset > size || length > size - offset) {
    return Status(StatusCode::kOutOfRange, "bytes " + std::to_string(offset) + "+" +
                                               std::to_string(length) + " are past the end of " +
                                               quotePeerText(name) + " (" + std::to_string(size) +
                                               " bytes)");
  }
  FetchPlan plan;
  plan.begin = offset;
  plan.end = length == 0 ? size : offset + length;
  const size_t most = std::max<size_t>(server_chunk, 1);
  plan.chunk = chunk_bytes == 0
                   ? most
                   : std::clamp<size_t>(chunk_bytes, std::min(kMinFetchChunk, most), most);
  return plan;
}

SnapshotFile normalizeAnnounced(SnapshotFile f) {
  if (f.crc32_pending) f.crc32 = 0;
  if (f.deleted) {
    SnapshotFile out{std::move(f.name), f.version, 0, 0, false, true};
    out.moved_to = std::move(f.moved_to);
    return out;
  }
  f.moved_to.clear();
  if (f.crc32_pending || f.moved_from_version == 0) {
    f.moved_from.clear();
    f.moved_from_version = 0;
  }
  return f;
}

Status FetchAdmission::admit(const std::string& peer) {
  int& mine = by_peer_[peer];
  if (mine >= per_peer_) {
    if (mine == 0) by_peer_.erase(peer);
    return Status(StatusCode::kResourceExhausted,
                  "this agent serves at most " + std::to_string(per_peer_) +
                      " Fetch streams at once to one peer, and " + peer + " has " +
                      std::to_string(mine) + " (--snapshot-limits streams_per_peer)");
  }
  if (total_ >= max_) {
    if (mine == 0) by_peer_.erase(peer);
    return Status(StatusCode::kResourceExhausted,
                  "this agent serves at most " + std::to_string(max_) +
                      " Fetch streams at once (--snapshot-limits streams); try again later");
  }
  ++mine;
  ++total_;
  return Status::ok();
}

void FetchAdmission::release(const std::string& peer) {
  auto it = by_peer_.find(peer);
  if (it == by_peer_.end()) return;
  --total_;
  if (--it->second == 0) by_peer_.erase(it);
}

}  // namespace ddprun::snapshot
