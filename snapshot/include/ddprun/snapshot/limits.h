// The bounds of --snapshot-dir replication against peers that misbehave (--snapshot-limits,
// docs/reliability.md). Each is per agent. A plain value: the launcher's parser fills it in.
#pragma once

#include <cstdint>

namespace ddprun::snapshot {

struct SnapshotLimits {
  int streams_per_peer = 16;  // Fetch streams served to one peer address at once
  int streams = 64;           // Fetch streams served at once in all
  // Chunks being sent, in all: a stream's next chunk is smaller (down to 64 KiB) when many
  // streams share this, so at most about this much memory holds chunks a peer has not read yet.
  uint64_t buffered_bytes = uint64_t{64} << 20;
  // Names heard of and waiting to be fetched, from one peer and in all (a peer's announcements
  // and round holdings). One peer's default is what a version table holds (~60,000 names).
  int names_per_peer = 65536;
  int names = 131072;
  // A fetch that receives no byte for this long ends (the holder stalled); its deadline is this
  // since the last byte, whatever the size.
  double stall_seconds = 60;
};

}  // namespace ddprun::snapshot
