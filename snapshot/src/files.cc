#include "files.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "ddprun/snapshot/replicator.h"

namespace ddprun::snapshot {

Status makeParentDirsUnder(const std::string& root, const std::string& rel) {
  DirFd dir(::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir.get() < 0) {
    return failedPrecondition("cannot open directory " + root + ": " + std::strerror(errno));
  }
  size_t begin = 0;
  for (size_t slash = rel.find('/'); slash != std::string::npos; slash = rel.find('/', begin)) {
    const std::string part = rel.substr(begin, slash - begin);
    const std::string path = root + "/" + rel.substr(0, slash);
    begin = slash + 1;
    if (part.empty() || part == "." || part == "..") {
      return invalidArgument("cannot create directory " + path + ": not a plain name");
    }
    const bool made = ::mkdirat(dir.get(), part.c_str(), 0755) == 0;
    if (!made && errno != EEXIST) {
      return failedPrecondition("cannot create directory " + path + ": " + std::strerror(errno));
    }
    if (made) (void)::fsync(dir.get());  // its entry in the parent lasts through a crash
    // Never through a symlink: one in the way is refused, as a file is.
    const int next =
        ::openat(dir.get(), part.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (next < 0) {
      const int err = errno;
      return failedPrecondition("cannot create directory " + path + ": " +
                                (err == ENOTDIR || err == ELOOP
                                     ? std::string("something other than a directory is "
                                                   "in the way there")
                                     : std::string(std::strerror(err))));
    }
    dir = DirFd(next);
  }
  return Status::ok();
}

bool syncDir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool synced = ::fsync(fd) == 0;
  ::close(fd);
  return synced;
}

void removeEmptyParentsUnder(const std::string& root, const std::string& rel) {
  for (size_t slash = rel.rfind('/'); slash != std::string::npos && slash > 0;
       slash = rel.rfind('/', slash - 1)) {
    const std::string dir = rel.substr(0, slash);
    const auto cut = dir.rfind('/');
    auto parent = openDirBeneath(root, cut == std::string::npos ? "" : dir.substr(0, cut));
    if (!parent.isOk()) return;
    const std::string base = cut == std::string::npos ? dir : dir.substr(cut + 1);
    if (::unlinkat(parent->get(), base.c_str(), AT_REMOVEDIR) != 0) return;
  }
}

DirFd::~DirFd() {
  if (fd_ >= 0) ::close(fd_);
}

DirFd& DirFd::operator=(DirFd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

namespace {

// `rel` as its directory part and its last part ("a/b/c" -> "a/b", "c"; "c" -> "", "c").
std::pair<std::string, std::string> splitLast(const std::string& rel) {
  const auto slash = rel.rfind('/');
  if (slash == std::string::npos) return {"", rel};
  return {rel.substr(0, slash), rel.substr(slash + 1)};
}

bool plainPart(const std::string& part) {
  return !part.empty() && part != "." && part != ".." && part.find('/') == std::string::npos;
}

// The directory of `rel` opened beneath `root`, and `rel`'s last part (checked to be plain).
StatusOr<std::pair<DirFd, std::string>> parentBeneath(const std::string& root,
                                                      const std::string& rel) {
  auto [dir, base] = splitLast(rel);
  if (!plainPart(base)) {
    return invalidArgument(root + "/" + rel + ": not a path of plain names below " + root);
  }
  auto fd = openDirBeneath(root, dir);
  if (!fd.isOk()) return fd.status();
  return std::make_pair(std::move(fd).value(), base);
}

}  // namespace

StatusOr<DirFd> openDirBeneath(const std::string& root, const std::string& rel) {
  DirFd dir(::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir.get() < 0) {
    return failedPrecondition("cannot open directory " + root + ": " + std::strerror(errno));
  }
  if (rel.empty()) return dir;
  std::string at = root;
  size_t begin = 0;
  while (begin <= rel.size()) {
    const size_t end = std::min(rel.find('/', begin), rel.size());
    const std::string part = rel.substr(begin, end - begin);
    begin = end + 1;
    at += "/" + part;
    if (!plainPart(part)) {
      return invalidArgument(root + "/" + rel + ": not a path of plain names below " + root);
    }
    const int fd =
        ::openat(dir.get(), part.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      struct stat st {};
      if ((err == ELOOP || err == ENOTDIR) &&
          ::fstatat(dir.get(), part.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 &&
          S_ISLNK(st.st_mode)) {
        return failedPrecondition(at + " is a symbolic link (not followed)");
      }
      return Status(err == ENOENT ? StatusCode::kNotFound : StatusCode::kFailedPrecondition,
                    "cannot open directory " + at + ": " + std::strerror(err));
    }
    dir = DirFd(fd);
  }
  return dir;
}

Status removeBeneath(const std::string& root, const std::string& rel) {
  auto parent = parentBeneath(root, rel);
  if (!parent.isOk()) {
    return parent.status().code() == StatusCode::kNotFound ? Status::ok() : parent.status();
  }
  if (::unlinkat(parent->first.get(), parent->second.c_str(), 0) != 0 && errno != ENOENT) {
    return failedPrecondition("cannot delete " + root + "/" + rel + ": " + std::strerror(errno));
  }
  return Status::ok();
}

Status renameBeneath(const std::string& root, const std::string& from, const std::string& to) {
  auto a = parentBeneath(root, from);
  if (!a.isOk()) return a.status();
  auto b = parentBeneath(root, to);
  if (!b.isOk()) return b.status();
  if (::renameat(a->first.get(), a->second.c_str(), b->first.get(), b->second.c_str()) != 0) {
    return failedPrecondition("cannot rename " + root + "/" + from + " to " + root + "/" + to +
                              ": " + std::strerror(errno));
  }
  return Status::ok();
}

Status linkBeneath(const std::string& root, const std::string& from, const std::string& to) {
  auto a = parentBeneath(root, from);
  if (!a.isOk()) return a.status();
  auto b = parentBeneath(root, to);
  if (!b.isOk()) return b.status();
  if (::linkat(a->first.get(), a->second.c_str(), b->first.get(), b->second.c_str(), 0) != 0) {
    return failedPrecondition("cannot link " + root + "/" + from + " to " + root + "/" + to + ": " +
                              std::strerror(errno));
  }
  return Status::ok();
}

StatusOr<struct stat> statBeneath(const std::string& root, const std::string& rel) {
  auto parent = parentBeneath(root, rel);
  if (!parent.isOk()) return parent.status();
  struct stat st {};
  if (::fstatat(parent->first.get(), parent->second.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    const int err = errno;
    return Status(err == ENOENT ? StatusCode::kNotFound : StatusCode::kFailedPrecondition,
                  "cannot look at " + root + "/" + rel + ": " + std::strerror(err));
  }
  return st;
}

StatusOr<std::optional<std::string>> readSmallFile(const std::string& path, size_t max_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0 && errno == ENOENT) return std::optional<std::string>();
  if (fd < 0) return failedPrecondition("cannot open " + path + ": " + std::strerror(errno));
  auto fail = [&](const std::string& why) {
    ::close(fd);
    return failedPrecondition(path + ": " + why);
  };
  struct stat st {};
  if (::fstat(fd, &st) != 0) return fail(std::strerror(errno));
  if (!S_ISREG(st.st_mode)) return fail("not a regular file");
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    return fail(std::to_string(st.st_size) + " bytes, more than the " + std::to_string(max_bytes) +
                " expected");
  }
  std::string out(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < out.size()) {
    const ssize_t n = ::read(fd, out.data() + got, out.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return fail(std::strerror(errno));
    if (n == 0) break;  // shrank meanwhile
    got += static_cast<size_t>(n);
  }
  out.resize(got);
  ::close(fd);
  return std::optional<std::string>(std::move(out));
}

Status replaceFile(const std::string& path, const std::string& contents) {
  const std::string temp = path + ".tmp";
  ::unlink(temp.c_str());  // one left by a crash, or anything else there: never written through
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) return failedPrecondition("cannot create " + temp + ": " + std::strerror(errno));
  int err = 0;
  for (size_t done = 0; done < contents.size() && err == 0;) {
    const ssize_t n = ::write(fd, contents.data() + done, contents.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) err = errno;
    if (n > 0) done += static_cast<size_t>(n);
  }
  if (::close(fd) != 0 && err == 0) err = errno;
  if (err == 0 && ::rename(temp.c_str(), path.c_str()) != 0) err = errno;
  if (err != 0) {
    ::unlink(temp.c_str());
    return failedPrecondition("cannot write " + path + ": " + std::strerror(err));
  }
  return Status::ok();
}

namespace {

// "<name>.tmp.<pid>.<number>" with process <pid> gone.
bool deadWritersTemp(const std::string& name) {
  const auto at = name.rfind(".tmp.");
  if (at == std::string::npos || at == 0) return false;
  const std::string rest = name.substr(at + 5);
  const auto dot = rest.find('.');
  if (dot == std::string::npos || dot == 0 || dot + 1 == rest.size() || dot > 9) return false;
  if (rest.find_first_not_of("0123456789") != dot ||
      rest.find_first_not_of("0123456789", dot + 1) != std::string::npos) {
    return false;
  }
  const long pid = std::strtol(rest.substr(0, dot).c_str(), nullptr, 10);
  if (pid <= 0 || pid > INT32_MAX) return false;
  return ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

void removeDeadTempsIn(int dir_fd, const std::string& rel, int depth,
                       std::vector<std::string>& removed) {
  DIR* d = ::fdopendir(dir_fd);
  if (d == nullptr) {
    ::close(dir_fd);
    return;
  }
  std::vector<std::string> subdirs;
  while (auto* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    struct stat st {};
    if (::fstatat(::dirfd(d), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (S_ISDIR(st.st_mode)) {
      subdirs.push_back(name);
    } else if (S_ISREG(st.st_mode) && deadWritersTemp(name) &&
               ::unlinkat(::dirfd(d), name.c_str(), 0) == 0) {
      removed.push_back(rel + name);
    }
  }
  if (depth < 32) {
    for (const auto& sub : subdirs) {
      const int fd =
          ::openat(::dirfd(d), sub.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (fd >= 0) removeDeadTempsIn(fd, rel + sub + "/", depth + 1, removed);
    }
  }
  ::closedir(d);
}

}  // namespace

std::vector<std::string> removeDeadWritersTempFiles(const std::string& dir) {
  std::vector<std::string> removed;
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) removeDeadTempsIn(fd, "", 0, removed);
  return removed;
}

namespace {

// The access mode of descriptor `fd_name` from its fdinfo ("flags:\t0100002"); -1 when unread.
int accessModeOf(int fdinfo_dir, const char* fd_name) {
  const int fd = ::openat(fdinfo_dir, fd_name, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  char text[512];
  const ssize_t n = ::read(fd, text, sizeof(text) - 1);
  ::close(fd);
  if (n <= 0) return -1;
  text[n] = '\0';
  const char* flags = std::strstr(text, "flags:");
  if (flags == nullptr) return -1;
  return static_cast<int>(std::strtol(flags + 6, nullptr, 8)) & O_ACCMODE;
}

}  // namespace

std::set<std::pair<uint64_t, uint64_t>> filesOpenForWriting(uint64_t dev) {
  std::set<std::pair<uint64_t, uint64_t>> open;
  DIR* procs = ::opendir("/proc");
  if (procs == nullptr) return open;
  const std::string self = std::to_string(::getpid());
  while (auto* p = ::readdir(procs)) {
    if (p->d_name[0] < '1' || p->d_name[0] > '9' || self == p->d_name) continue;
    const std::string base = std::string("/proc/") + p->d_name;
    const int fdinfo = ::open((base + "/fdinfo").c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fdinfo < 0) continue;  // another user's, or gone
    DIR* fds = ::opendir((base + "/fd").c_str());
    if (fds == nullptr) {
      ::close(fdinfo);
      continue;
    }
    while (auto* f = ::readdir(fds)) {
      struct stat st {};
      if (f->d_name[0] == '.' || ::fstatat(::dirfd(fds), f->d_name, &st, 0) != 0 ||
          !S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_dev) != dev) {
        continue;
      }
      const int mode = accessModeOf(fdinfo, f->d_name);
      if (mode == O_WRONLY || mode == O_RDWR) open.emplace(st.st_dev, st.st_ino);
    }
    ::close(fdinfo);
    ::closedir(fds);
  }
  ::closedir(procs);
  return open;
}

}  // namespace ddprun::snapshot
