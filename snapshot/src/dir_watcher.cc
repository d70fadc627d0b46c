#include "dir_watcher.h"

#include <dirent.h>
#include <sys/inotify.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "ddprun/common/strings.h"
#include "files.h"
#include "log.h"

namespace ddprun::snapshot {

namespace {

// What is watched in the snapshot dir and every directory below it: files completed, renamed in
// or away, deleted; directories made (IN_CREATE: only a directory's is acted on).
constexpr uint32_t kWatchMask =
    IN_CLOSE_WRITE | IN_MOVED_TO | IN_DELETE | IN_MOVED_FROM | IN_CREATE | IN_ONLYDIR;

}  // namespace

Status DirWatcher::init() {
  loop_.check();
  const int fd = ::inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  if (fd < 0) return internalError(std::string("inotify: ") + std::strerror(errno));
  const int wd = ::inotify_add_watch(fd, dir_.c_str(), kWatchMask | IN_DELETE_SELF | IN_MOVE_SELF);
  if (wd < 0) {
    const int err = errno;
    ::close(fd);
    return invalidArgument("--snapshot-dir: cannot watch " + dir_ + ": " + std::strerror(err));
  }
  watched_[wd] = "";
  inotify_ = std::make_unique<boost::asio::posix::stream_descriptor>(io_, fd);
  return Status::ok();
}

std::vector<std::string> DirWatcher::scan() { return watchTree(""); }

void DirWatcher::start() { read(); }

void DirWatcher::close() {
  if (!inotify_) return;
  boost::system::error_code ignored;
  inotify_->close(ignored);
}

bool DirWatcher::eventsQueued() const {
  int queued = 0;
  return inotify_ && inotify_->is_open() &&
         ::ioctl(inotify_->native_handle(), FIONREAD, &queued) == 0 && queued > 0;
}

void DirWatcher::warnIfTooLong(const std::string& name) {
  if (name.size() <= kMaxReplicatedName) return;
  if (auto more = firstFew(long_names_)) {
    snapLog()->warn("snapshot dir: {} is not replicated: its path there is longer than {} bytes{}",
                    path(name), kMaxReplicatedName, *more);
  }
}

std::vector<std::string> DirWatcher::watchTree(const std::string& top) {
  std::vector<std::string> files;
  std::vector<std::string> dirs{top};
  while (!dirs.empty()) {
    const std::string rel = std::move(dirs.back());
    dirs.pop_back();
    if (!rel.empty()) {
      const int wd = ::inotify_add_watch(inotify_->native_handle(), path(rel).c_str(),
                                         kWatchMask | IN_DONT_FOLLOW);
      if (wd < 0) {
        const int err = errno;
        if (err == ENOENT || err == ENOTDIR) continue;  // gone meanwhile
        if (auto more = firstFew(unwatched_dirs_)) {
          snapLog()->warn(
              "snapshot dir: cannot watch {}: {}{}; files completed there are not replicated{}",
              path(rel), std::strerror(err),
              err == ENOSPC ? " (raise fs.inotify.max_user_watches)" : "", *more);
        }
        continue;
      }
      watched_[wd] = rel;
    }
    DIR* d = ::opendir(path(rel).c_str());
    if (d == nullptr) continue;
    while (auto* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name == "." || name == "..") continue;
      const std::string child = rel.empty() ? name : rel + "/" + name;
      bool is_dir = e->d_type == DT_DIR;
      if (e->d_type == DT_UNKNOWN) {
        struct stat st {};
        is_dir = ::lstat(path(child).c_str(), &st) == 0 && S_ISDIR(st.st_mode);
      }
      if (!is_dir) {
        files.push_back(child);
      } else if (isReplicatedName(child)) {  // a symlink to one is not followed
        dirs.push_back(child);
      } else {
        warnIfTooLong(child);
      }
    }
    ::closedir(d);
  }
  return files;
}

std::vector<std::string> DirWatcher::closedFiles(std::vector<std::string> files) const {
  struct stat top {};
  if (files.empty() || ::stat(dir_.c_str(), &top) != 0) return files;
  const auto writing = filesOpenForWriting(top.st_dev);
  if (writing.empty()) return files;
  auto open = [&](const std::string& name) {
    struct stat st {};
    if (::lstat(path(name).c_str(), &st) != 0 || writing.count({st.st_dev, st.st_ino}) == 0) {
      return false;
    }
    snapLog()->debug("snapshot dir: {} is open for writing; looked at once it is closed", name);
    return true;
  };
  files.erase(std::remove_if(files.begin(), files.end(), open), files.end());
  return files;
}

std::vector<std::string> DirWatcher::replicated(const std::vector<std::string>& files) {
  std::vector<std::string> out;
  for (const auto& name : files) {
    if (isReplicatedName(name)) {
      out.push_back(name);
    } else {
      warnIfTooLong(name);
    }
  }
  return out;
}

void DirWatcher::unwatchTree(const std::string& rel) {
  const std::string below = rel + "/";
  for (auto it = watched_.begin(); it != watched_.end();) {
    if (it->second == rel || startsWith(it->second, below)) {
      ::inotify_rm_watch(inotify_->native_handle(), it->first);
      it = watched_.erase(it);
    } else {
      ++it;
    }
  }
}

void DirWatcher::read() {
  inotify_->async_read_some(
      boost::asio::buffer(buf_), [this](const boost::system::error_code& ec, size_t n) {
        if (ec) {
          if (ec != boost::asio::error::operation_aborted) {
            snapLog()->error("snapshot dir {}: watching stopped: {}", dir_, ec.message());
          }
          return;
        }
        struct Event {
          int wd;
          uint32_t mask;
          uint32_t cookie;
          std::string name;
        };
        std::vector<Event> events;
        size_t off = 0;
        while (off + sizeof(inotify_event) <= n) {
          auto* ev = reinterpret_cast<const inotify_event*>(buf_.data() + off);
          events.push_back(Event{ev->wd, ev->mask, ev->cookie, ev->len > 0 ? ev->name : ""});
          off += sizeof(inotify_event) + ev->len;
        }
        for (const auto& ev : events) onEvent(ev.wd, ev.mask, ev.cookie, ev.name);
        // Names renamed away wait for their pair until nothing more is queued: the read they
        // wait for comes first.
        if (!eventsQueued()) core_.settled();
        after_();
        read();
      });
}

void DirWatcher::onEvent(int wd, uint32_t mask, uint32_t cookie, const std::string& name) {
  loop_.check();
  if (mask & (IN_DELETE_SELF | IN_MOVE_SELF)) {
    snapLog()->error("snapshot dir {} was removed or moved: replication stops", dir_);
    return;
  }
  if (mask & IN_Q_OVERFLOW) {
    if (auto more = firstFew(overflows_)) {
      snapLog()->warn("snapshot dir {}: too many changes at once; looking at every file again{}",
                      dir_, *more);
    }
    core_.onRescan(replicated(closedFiles(watchTree(""))));
    return;
  }
  auto dir = watched_.find(wd);
  if (dir == watched_.end()) return;  // a directory no longer watched (renamed or deleted)
  if (mask & IN_IGNORED) {            // its watch is gone: the directory was deleted
    watched_.erase(dir);
    return;
  }
  if (name.empty()) return;
  const std::string rel = dir->second.empty() ? name : dir->second + "/" + name;
  const bool dir_event = (mask & IN_ISDIR) != 0;
  // Renamed away: a rename within the directory if its IN_MOVED_TO follows (the core pairs them).
  if ((mask & IN_MOVED_FROM) && cookie != 0 && isReplicatedName(rel)) {
    if (dir_event) unwatchTree(rel);
    core_.onMovedFrom(cookie, rel, dir_event);
    return;
  }
  if (dir_event) return onDirEvent(mask, cookie, rel);
  if (mask & IN_CREATE) return;  // a file being written: looked at once it is complete
  warnIfTooLong(rel);
  if (mask & IN_MOVED_TO) {
    core_.onMovedTo(cookie, rel, false, {});
  } else {
    core_.onChanged(rel);
  }
}

void DirWatcher::onDirEvent(uint32_t mask, uint32_t cookie, const std::string& rel) {
  if (mask & (IN_MOVED_FROM | IN_DELETE)) {
    unwatchTree(rel);
    core_.onDirGone(rel);
  }
  if (!(mask & (IN_CREATE | IN_MOVED_TO))) return;
  std::vector<std::string> files;
  if (isReplicatedName(rel)) {
    files = replicated(closedFiles(watchTree(rel)));
  } else {
    warnIfTooLong(rel);
  }
  core_.onMovedTo((mask & IN_MOVED_TO) ? cookie : 0, rel, true, files);
}

}  // namespace ddprun::snapshot
