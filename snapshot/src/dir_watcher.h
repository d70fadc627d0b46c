// DirWatcher: inotify on the snapshot directory and every directory below it (one watch each,
// IN_CLOSE_WRITE, IN_MOVED_FROM/TO, IN_DELETE, IN_CREATE), read on the loop through an Asio
// stream_descriptor. It keeps the watches (a directory made or moved in is watched, then read; one
// removed or moved away is no longer watched) and tells the core what happened, by name relative
// to the directory: files completed or deleted, renames' halves (the core pairs them), directories
// gone or appeared with the files found there. A file some other process holds open for writing
// (per /proc) is left for its IN_CLOSE_WRITE, not looked at half-written. Names too long to be
// replicated are warned of here (the first few).
//
// Threading: the loop thread only. Lifetime: within the core's; close() before the loop's end.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ddprun/common/loop_affinity.h"
#include "ddprun/common/status.h"
#include "ddprun/snapshot/core.h"

namespace ddprun::snapshot {

class DirWatcher {
 public:
  // `after`: called after each batch of events read (the replicator carries out the core's
  // actions then).
  DirWatcher(boost::asio::io_context& io, std::string dir, ReplicationCore& core,
             std::function<void()> after)
      : io_(io), dir_(std::move(dir)), core_(core), after_(std::move(after)) {}

  // Watches the directory (INTERNAL when inotify cannot be had, INVALID_ARGUMENT naming the
  // directory when it cannot be watched).
  Status init();
  // Watches every directory below it, and returns what is in them other than directories, by
  // relative path, but files open for writing (replicated names or not; names too long warned).
  std::vector<std::string> scan();
  // Starts reading events.
  void start();
  void close();
  // Whether events wait to be read.
  bool eventsQueued() const;
  // A warning for a file or directory not replicated because its path is too long (the first
  // few named).
  void warnIfTooLong(const std::string& name);

 private:
  void read();
  void onEvent(int wd, uint32_t mask, uint32_t cookie, const std::string& name);
  void onDirEvent(uint32_t mask, uint32_t cookie, const std::string& rel);
  // Watches the directory `rel` ("" is the top, watched by init) and every replicated directory
  // below it, each watched before it is read: a file completed meanwhile is seen twice, never
  // missed. Returns the relative paths of what is in them other than directories.
  std::vector<std::string> watchTree(const std::string& rel);
  // `files` but those some other process holds open for writing: each is looked at once its
  // IN_CLOSE_WRITE comes (its directory is watched), not announced half-written first.
  std::vector<std::string> closedFiles(std::vector<std::string> files) const;
  // The replicated names of `files` (the others warned of when too long).
  std::vector<std::string> replicated(const std::vector<std::string>& files);
  // Stops watching the directory `rel` and those below it.
  void unwatchTree(const std::string& rel);
  std::string path(const std::string& rel) const { return dir_ + "/" + rel; }

  boost::asio::io_context& io_;
  const std::string dir_;
  ReplicationCore& core_;
  std::function<void()> after_;
  LoopAffinity loop_{"snapshot DirWatcher"};
  std::unique_ptr<boost::asio::posix::stream_descriptor> inotify_;
  std::vector<char> buf_ = std::vector<char>(64 * 1024);
  std::map<int, std::string> watched_;  // watch descriptor → directory, relative ("" the top)
  int unwatched_dirs_ = 0;              // directories that could not be watched (firstFew)
  int long_names_ = 0;                  // paths too long to be replicated (firstFew)
  int overflows_ = 0;                   // inotify queue overflows (firstFew)
};

}  // namespace ddprun::snapshot
