// Holdings: the replicator's table of what this node holds and serves, and the file operations
// that change it. Each version held is served from the inode it was announced with (an open
// descriptor), even after a newer version was renamed over its name; a version still arriving
// here is served as it arrives; a file deleted because another node renamed it is kept a while
// for its new name. Copies are installed and deleted beneath the directory with no symlink
// followed, and the directory's version table (.ddprun-versions) is read and rewritten here.
//
// Threading: the loop thread calls everything but lookup(), which the replication server's gRPC
// threads call: it reads the served tables under `mu_`. Lifetime: outlives the server (which
// calls lookup) and is outlived by the transfer pool (files are let go of on it: closing the last
// descriptor of a file renamed over frees its blocks, which on the loop delayed the next
// announcement by as much: 100 MiB ~26 ms, 1 GiB ~220 ms).
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>

#include "ddprun/common/loop_affinity.h"
#include "ddprun/common/thread_annotations.h"
#include "ddprun/snapshot/core.h"
#include "ddprun/snapshot/transfer.h"
#include "transfer_pool.h"

namespace ddprun::snapshot {

// The names of the agent's own files in the directory start with this (never replicated; removed
// at the next start if a crash leaves one behind).
inline constexpr const char* kRecvPrefix = ".ddprun-recv.";

FileId fileIdOf(const struct stat& st);

class Holdings {
 public:
  Holdings(std::string dir, TransferPool& pool) : dir_(std::move(dir)), pool_(pool) {}

  // gRPC threads: what this agent serves of `want`'s name, held or arriving here, if it is that
  // content (under one number two nodes may have written other content).
  std::optional<ServedFile> lookup(const SnapshotFile& want) const;

  // The file the shell opened for `name` while it gives the core one event (a look, the start's
  // scan): what a Hold of HoldFile::kOpened serves.
  void setOpened(const std::string& name, std::shared_ptr<const OpenFile> file);
  void clearOpened();
  void hold(const Hold& h);
  // What is served as `name` now (nullptr: nothing).
  const ServedFile* served(const std::string& name) const;
  // The file kept under `name` for its new name (nullptr: none).
  std::shared_ptr<const OpenFile> keptFile(const std::string& name) const;

  // A new temp file's path beside `name`, within NAME_MAX whatever the name's length.
  std::string tempFor(const std::string& name) const;
  // Links the file at l.from, if it is still l.expect, to a fresh temp file; its path, or "".
  std::string link(const Link& l);
  // Renames `temp` over t.file.name and serves it; what was held stays served if that fails.
  StatusOr<FileId> install(const SnapshotTransfer& t, const std::string& temp);
  // Deletes this node's copy of d.transfer.file.name (set aside and kept, with d.set_aside).
  Deleted remove(const Delete& d);
  void dropKept(const std::string& name);
  // Serves `v` while it arrives here (a relay); until stopArriving with the same `arriving`.
  void serveArriving(const SnapshotVersion& v, std::shared_ptr<PendingCrc> pending,
                     std::shared_ptr<ArrivingFile> arriving);
  void stopArriving(const std::string& name, const std::shared_ptr<ArrivingFile>& arriving);

  // The directory's version table, if it is one (else a warning, and nothing).
  std::map<std::string, SnapshotVersion> readTable();
  // Rewrites the version table when `text` is not what it holds (a warning when it cannot).
  void recordTable(const std::string& text);

  // The agent stops: kept files set aside are removed, and streams waiting for a CRC-32 or for
  // bytes arriving end with `why` (the server waits for them).
  void stop(const Status& why);

  std::string path(const std::string& name) const { return dir_ + "/" + name; }

 private:
  struct Entry {
    ServedFile served;
    FileId id;
  };
  struct Kept {
    std::shared_ptr<const OpenFile> data;
    std::string aside;  // relative to the directory; empty: kept open only
  };
  // What is held as `name` now (served unless a deletion); the file replaced is let go of.
  void set(const std::string& name, std::optional<Entry> entry);
  void release(std::shared_ptr<const OpenFile> file);
  // Renames `name` aside to a hidden name at the top of the directory; that name, or "".
  std::string setAside(const std::string& name);
  // The name relative to the directory of a path(name).
  std::string relativeName(const std::string& full) const { return full.substr(dir_.size() + 1); }

  const std::string dir_;
  TransferPool& pool_;
  LoopAffinity loop_{"snapshot Holdings"};
  std::map<std::string, Entry> held_;  // names held with a file
  std::map<std::string, Kept> kept_;
  std::map<std::string, std::shared_ptr<const OpenFile>> opened_;
  std::string recorded_table_;  // what the version table file holds
  bool table_failing_ = false;  // the last write of it failed (warned once)
  mutable Mutex mu_;
  std::map<std::string, ServedFile> served_ GUARDED_BY(mu_);
  // Versions being fetched here that are served on as they arrive.
  std::map<std::string, ServedFile> arriving_ GUARDED_BY(mu_);
};

}  // namespace ddprun::snapshot
