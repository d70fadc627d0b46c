// The file-system helpers of snapshot replication: the version table read and replaced, paths a
// peer names acted on beneath the directory with no symlink followed, and files open for writing.
// Thread-compatible; each call does its own I/O.
#pragma once

#include <sys/stat.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ddprun/common/status.h"

namespace ddprun::snapshot {

// The contents of a regular file of at most `max_bytes`; nullopt when there is none at `path`.
// FAILED_PRECONDITION when it cannot be read, is no regular file or is larger (symlinks are not
// followed).
StatusOr<std::optional<std::string>> readSmallFile(const std::string& path, size_t max_bytes);
// Makes the directories of the relative file path `rel` under `root` (for "a/b/c": root/a, then
// root/a/b), mode 0755; those there already are kept, and each one made is synced into its
// parent (syncDir). FAILED_PRECONDITION naming the directory when one cannot be made, or when
// something other than a directory is in the way there (a symlink is not followed).
Status makeParentDirsUnder(const std::string& root, const std::string& rel);
// fsync of the directory `dir`, so that the names made, renamed or removed in it last through a
// crash of the host; best effort (false when it cannot be opened or synced).
bool syncDir(const std::string& dir);
// Removes the directories of `rel`'s parent path under `root` that are empty, deepest first,
// stopping at the first that is not (or cannot be removed); `root` itself stays. No symlink on
// the way is followed (as the *Beneath functions below).
void removeEmptyParentsUnder(const std::string& root, const std::string& rel);

// Paths a peer names (the snapshot directory's replication): `rel` is relative to `root`, made of
// '/'-separated parts none of which is empty, "." or "..". Every part of the way is resolved with
// no symbolic link followed (an O_NOFOLLOW walk from `root`, which itself may be one): a link
// anywhere in `rel` but its last part fails the call (FAILED_PRECONDITION naming the path and
// the part that is a link), and the last part is acted on as it is (a link is removed or renamed
// itself, never what it points to). So a name another node announced never reaches a file outside
// `root`, whatever symlinks a user or a worker made inside it.
//
// An open directory, closed on destruction.
class DirFd {
 public:
  explicit DirFd(int fd = -1) : fd_(fd) {}
  ~DirFd();
  DirFd(DirFd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  DirFd& operator=(DirFd&& o) noexcept;
  DirFd(const DirFd&) = delete;
  DirFd& operator=(const DirFd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};
// The directory `rel` ("" is `root`) opened with no symlink followed.
StatusOr<DirFd> openDirBeneath(const std::string& root, const std::string& rel);
// unlink of `rel`; a missing file is fine.
Status removeBeneath(const std::string& root, const std::string& rel);
// rename of `from` to `to`, both relative to `root`.
Status renameBeneath(const std::string& root, const std::string& from, const std::string& to);
// link of `from` (its last part not followed either) to the new name `to`.
Status linkBeneath(const std::string& root, const std::string& from, const std::string& to);
// lstat of `rel`.
StatusOr<struct stat> statBeneath(const std::string& root, const std::string& rel);
// Replaces `path` with `contents`: written to a fresh `path`.tmp (whatever was there is removed
// first, a symlink is not followed), then renamed over it, so a reader sees the old or the new
// contents, never a part (not fsynced). FAILED_PRECONDITION naming the file
// and the error; the temp file is removed then.
Status replaceFile(const std::string& path, const std::string& contents);
// removeDeadWritersTempFiles (files.cc) is declared in replicator.h: the agent calls it.

// The regular files on device `dev`, as (device, inode), that a process other than this one
// holds open for writing (O_WRONLY or O_RDWR), read from /proc/PID/fd and fdinfo. Processes
// whose entries cannot be read (another user's, or gone meanwhile) are passed over.
std::set<std::pair<uint64_t, uint64_t>> filesOpenForWriting(uint64_t dev);

}  // namespace ddprun::snapshot
