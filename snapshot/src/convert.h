// A version as the core knows it (SnapshotVersion) and as the transport carries it
// (SnapshotFile). Private to snapshot/src.
#pragma once

#include "ddprun/snapshot/transfer.h"
#include "ddprun/snapshot/version.h"

namespace ddprun::snapshot {

inline SnapshotFile toWire(const SnapshotVersion& v) {
  SnapshotFile f{v.name, v.version, v.size, v.crc32};
  f.crc32_pending = v.crc_pending;
  f.deleted = v.deleted;
  f.moved_from = v.moved_from;
  f.moved_from_version = v.moved_from_version;
  f.moved_to = v.moved_to;
  return f;
}

inline SnapshotVersion fromWire(const SnapshotFile& f) {
  SnapshotVersion v{f.name, f.version, f.size, f.crc32};
  v.crc_pending = f.crc32_pending;
  v.deleted = f.deleted;
  v.moved_from = f.moved_from;
  v.moved_from_version = f.moved_from_version;
  v.moved_to = f.moved_to;
  return v;
}

}  // namespace ddprun::snapshot
