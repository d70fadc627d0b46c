// The blocking work the replicator hands its transfer pool, one function each: looking at a file
// this node's workers completed (and hashing it), hashing a large one announced before its hash,
// and fetching or copying a version into a temp file. Each returns what the core is to be told.
// Threading: any thread (a pool thread); each touches only what it is given.
#pragma once

#include <memory>
#include <string>

#include "ddprun/common/clock.h"
#include "ddprun/snapshot/core.h"
#include "ddprun/snapshot/transfer.h"

namespace ddprun::snapshot {

// What a look found, with the file it opened (served if the core holds it).
struct LookResult {
  Looked looked;
  std::shared_ptr<OpenFile> file;
  bool to_hash = false;  // a small regular file not held: hash it (hashLooked) before telling
};
// Opens, stats and compares `path` with what `look` says is held (after `slow_hash`, a test
// hook). Not hashed here: a look runs at the agent's priority, a hash in the background.
LookResult lookAt(const Look& look, const std::string& path, Duration slow_hash);
// Hashes what lookAt opened (Looked::kHashed, or kUnreadable).
void hashLooked(LookResult& result);

// Hashes a version served before its hash was known, sets `pending` (streams waiting for it end
// either way) and returns the CRC-32, or why there is none.
StatusOr<uint32_t> hashServed(const OpenFile& file, uint64_t size, PendingCrc& pending);

// One Fetch action, as the pool runs it.
struct FetchJob {
  SnapshotPeer peer;
  SnapshotFile file;
  std::string dir;   // the snapshot directory (the name's parents are made beneath it)
  std::string temp;  // full path
  size_t streams = kDefaultFetchStreams;
  std::shared_ptr<FetchCancel> cancel;
  std::shared_ptr<const OpenFile> local;   // copied from this, when set
  std::shared_ptr<ArrivingFile> arriving;  // served on as it arrives, when set
  std::shared_ptr<PendingCrc> pending;     // the arriving version's CRC-32 goes here
};
// Copies job.local into job.temp (fetching from the peer if that fails), or fetches it. Its
// status, the verified CRC-32, and whether it was copied.
Fetched runFetch(const FetchJob& job, const SnapshotTransfer& t);

}  // namespace ddprun::snapshot
