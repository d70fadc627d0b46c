#include "holdings.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "convert.h"
#include "files.h"
#include "log.h"

namespace ddprun::snapshot {

namespace {

constexpr size_t kRecvNameKept = 200;  // of the file's name, in its receiving temp file's
// The directory's version table (encodeVersionTable), rewritten whenever what is held changes.
constexpr const char* kVersionTable = ".ddprun-versions";
constexpr size_t kVersionTableMax = 16 << 20;  // ~60,000 names

// A name of the agent's own under the relative directory `dir` ("" or ending in '/'):
// kRecvPrefix, `stem`, this process and a random number. Never replicated, and removed at the
// next start if a crash leaves it behind.
std::string hiddenName(const std::string& dir, const std::string& stem) {
  std::random_device rd;
  return dir + kRecvPrefix + stem + "." + std::to_string(::getpid()) + "." + std::to_string(rd());
}

}  // namespace

FileId fileIdOf(const struct stat& st) {
  return FileId{static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino),
                static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec,
                static_cast<uint64_t>(st.st_size)};
}

std::optional<ServedFile> Holdings::lookup(const SnapshotFile& want) const {
  const SnapshotVersion wanted = fromWire(want);
  MutexLock lock(mu_);
  // Held here, or being fetched here (served as it arrives): under one number that may be
  // other content (written on two nodes in one round), so the content decides.
  for (const auto* table : {&served_, &arriving_}) {
    auto it = table->find(want.name);
    if (it != table->end() && fromWire(it->second.file).sameContent(wanted)) return it->second;
  }
  return std::nullopt;
}

void Holdings::setOpened(const std::string& name, std::shared_ptr<const OpenFile> file) {
  loop_.check();
  opened_[name] = std::move(file);
}

void Holdings::clearOpened() { opened_.clear(); }

void Holdings::hold(const Hold& h) {
  loop_.check();
  const SnapshotVersion& v = h.version;
  switch (h.file) {
    case HoldFile::kNone:
      set(v.name, std::nullopt);  // nothing to serve
      return;
    case HoldFile::kOpened: {
      auto opened = opened_.find(v.name);
      Entry e{ServedFile{toWire(v), opened == opened_.end() ? nullptr : opened->second,
                         v.crc_pending ? std::make_shared<PendingCrc>() : nullptr},
              h.id};
      set(v.name, std::move(e));
      return;
    }
    case HoldFile::kCrcKnown: {
      auto it = held_.find(v.name);
      if (it == held_.end() || it->second.served.file.version != v.version) return;
      Entry known = it->second;
      known.served.file.crc32 = v.crc32;
      known.served.file.crc32_pending = false;
      set(v.name, std::move(known));
      return;
    }
  }
}

void Holdings::set(const std::string& name, std::optional<Entry> entry) {
  {
    MutexLock lock(mu_);
    if (entry) {
      served_[name] = entry->served;  // the replaced file stays referenced from held_ below
    } else {
      served_.erase(name);
    }
  }
  std::shared_ptr<const OpenFile> replaced;
  if (auto it = held_.find(name); it != held_.end()) replaced = it->second.served.data;
  if (entry) {
    held_[name] = *entry;
  } else {
    held_.erase(name);
  }
  if (replaced && (!entry || replaced != entry->served.data)) release(std::move(replaced));
}

void Holdings::release(std::shared_ptr<const OpenFile> file) {
  if (!file) return;
  pool_.run([file = std::move(file)]() mutable { file.reset(); }, [] {});
}

const ServedFile* Holdings::served(const std::string& name) const {
  auto it = held_.find(name);
  return it == held_.end() ? nullptr : &it->second.served;
}

std::shared_ptr<const OpenFile> Holdings::keptFile(const std::string& name) const {
  auto it = kept_.find(name);
  return it == kept_.end() ? nullptr : it->second.data;
}

std::string Holdings::tempFor(const std::string& name) const {
  // Received next to where it goes (the rename stays in one directory and file system).
  const auto slash = name.rfind('/');
  const std::string dir = slash == std::string::npos ? "" : name.substr(0, slash + 1);
  return path(hiddenName(dir, name.substr(dir.size(), kRecvNameKept)));
}

std::string Holdings::link(const Link& l) {
  loop_.check();
  const SnapshotVersion& v = l.transfer.file;
  const std::string temp = tempFor(v.name);
  // No symlink followed on either side (a directory replaced by one meanwhile is refused).
  auto st = statBeneath(dir_, l.from);
  if (!st.isOk() || !S_ISREG(st->st_mode) || !fileIdOf(*st).sameFile(l.expect) ||
      static_cast<uint64_t>(st->st_size) != v.size) {
    return "";  // not the file held (changed by a worker meanwhile)
  }
  if (!makeParentDirsUnder(dir_, v.name).isOk() ||
      !linkBeneath(dir_, l.from, relativeName(temp)).isOk()) {
    return "";
  }
  return temp;
}

StatusOr<FileId> Holdings::install(const SnapshotTransfer& t, const std::string& temp) {
  loop_.check();
  const std::string& name = t.file.name;
  const int fd = ::open(temp.c_str(), O_RDONLY | O_CLOEXEC);
  struct stat sb {};
  if (fd < 0 || ::fstat(fd, &sb) != 0) {
    Status st = internalError("cannot reopen " + temp + ": " + std::strerror(errno));
    if (fd >= 0) ::close(fd);
    ::unlink(temp.c_str());
    return st;
  }
  auto file = std::make_shared<OpenFile>(fd);
  std::optional<Entry> before;
  if (auto it = held_.find(name); it != held_.end()) before = it->second;
  // Held first: the rename's IN_MOVED_TO then finds what this node holds already.
  set(name, Entry{ServedFile{toWire(t.file), file, nullptr}, fileIdOf(sb)});
  // Never through a symlink, which would place the file outside the directory.
  if (Status moved = renameBeneath(dir_, relativeName(temp), name); !moved.isOk()) {
    ::unlink(temp.c_str());
    set(name, before);
    return Status(moved.code(), "cannot place " + name + ": " + moved.message());
  }
  // The directory that holds the name (not always the top): its new entry lasts through a crash
  // of the host. On a pool thread: a host busy writing can hold a directory's fsync for seconds,
  // and the loop sends the agent's heartbeats (three missed: the node is declared dead).
  const std::string placed = path(name);
  pool_.run([dir = placed.substr(0, placed.rfind('/'))] { syncDir(dir); }, [] {});
  return fileIdOf(sb);
}

Deleted Holdings::remove(const Delete& d) {
  loop_.check();
  const std::string& name = d.transfer.file.name;
  std::optional<Entry> before;
  if (auto it = held_.find(name); it != held_.end()) before = it->second;
  // Held first: the unlink's IN_DELETE then finds the deletion held already.
  set(name, std::nullopt);
  const bool keep = d.set_aside && before;
  const std::string aside = keep ? setAside(name) : std::string();
  Status st;
  // Never through a symlink: a name another node announced stays inside the directory.
  if (aside.empty()) st = removeBeneath(dir_, name);
  if (!st.isOk()) {
    set(name, before);
    return Deleted{d.transfer, st, false, ""};
  }
  if (keep) {
    dropKept(name);  // one kept before under that name: the newer deletion's file replaces it
    kept_[name] = Kept{before->served.data, aside};
  }
  removeEmptyParentsUnder(dir_, name);  // as a deleted checkpoint directory goes
  return Deleted{d.transfer, Status::ok(), keep, aside};
}

std::string Holdings::setAside(const std::string& name) {
  const std::string aside = hiddenName("", "kept");
  return renameBeneath(dir_, name, aside).isOk() ? aside : std::string();
}

void Holdings::dropKept(const std::string& name) {
  auto it = kept_.find(name);
  if (it == kept_.end()) return;
  if (!it->second.aside.empty()) ::unlink(path(it->second.aside).c_str());
  release(std::move(it->second.data));  // its blocks are freed then
  kept_.erase(it);
}

void Holdings::serveArriving(const SnapshotVersion& v, std::shared_ptr<PendingCrc> pending,
                             std::shared_ptr<ArrivingFile> arriving) {
  MutexLock lock(mu_);
  arriving_[v.name] = ServedFile{toWire(v), nullptr, std::move(pending), std::move(arriving)};
}

void Holdings::stopArriving(const std::string& name,
                            const std::shared_ptr<ArrivingFile>& arriving) {
  MutexLock lock(mu_);
  auto it = arriving_.find(name);
  if (it != arriving_.end() && it->second.arriving == arriving) arriving_.erase(it);
}

std::map<std::string, SnapshotVersion> Holdings::readTable() {
  const std::string where = path(kVersionTable);
  auto text = readSmallFile(where, kVersionTableMax);
  StatusOr<std::map<std::string, SnapshotVersion>> table = std::map<std::string, SnapshotVersion>{};
  if (!text.isOk()) {
    table = text.status();
  } else if (*text) {
    table = decodeVersionTable(**text);
  }
  if (!table.isOk()) {
    snapLog()->warn(
        "snapshot dir: ignoring the version table {}: {}; the files there count as "
        "version 0",
        where, table.status().message());
    return {};
  }
  if (text.isOk() && *text) recorded_table_ = **text;
  return std::move(table).value();
}

void Holdings::recordTable(const std::string& text) {
  if (text == recorded_table_) return;
  Status st = replaceFile(path(kVersionTable), text);
  if (!st.isOk()) {
    if (!table_failing_) {
      snapLog()->warn(
          "snapshot: {}; if this agent starts again, files changed since count as "
          "version 0",
          st.message());
    }
    table_failing_ = true;
    return;
  }
  if (table_failing_) snapLog()->info("snapshot: the version table is written again");
  table_failing_ = false;
  recorded_table_ = text;
}

void Holdings::stop(const Status& why) {
  for (const auto& [name, kept] : kept_) {
    if (!kept.aside.empty()) ::unlink(path(kept.aside).c_str());
  }
  // A Fetch stream waiting for a hash or a fetch of it (a CRC-32 pending, bytes still arriving)
  // would hold up the server's shutdown for ever.
  std::vector<ServedFile> waited_on;
  {
    MutexLock lock(mu_);
    for (const auto& [name, s] : served_) waited_on.push_back(s);
    for (const auto& [name, s] : arriving_) waited_on.push_back(s);
  }
  for (const auto& s : waited_on) {
    if (s.pending_crc) s.pending_crc->set(why);
    if (s.arriving) s.arriving->fail(why);
  }
}

}  // namespace ddprun::snapshot
