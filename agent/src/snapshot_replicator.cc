#include "snapshot_replicator.h"

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/inotify.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/ip/address.hpp>
#include <boost/asio/post.hpp>
#include <cerrno>
#include <cstring>
#include <optional>
#include <random>
#include <tuple>

#include "ddprun/common/log.h"
#include "ddprun/common/log_throttle.h"
#include "ddprun/common/strings.h"

namespace ddprun::agent {

using namespace ddprun::snapshot;  // NOLINT: until the replicator moves to snapshot/

namespace {

auto snapLog() { return logger("agent"); }

constexpr const char* kRecvPrefix = ".ddprun-recv.";
constexpr size_t kRecvNameKept = 200;  // of the file's name, in its receiving temp file's
// The directory's version table (encodeVersionTable), rewritten whenever what is held changes.
constexpr const char* kVersionTable = ".ddprun-versions";
constexpr size_t kVersionTableMax = 16 << 20;  // ~60,000 names
constexpr int kTransferNice = 10;
// Threads of offLoop work at once, fetches and the rest (announcements, hashing) apart, so that
// announcements stuck on a stopped node never hold up fetches; more waits its turn. A checkpoint
// directory of thousands of files (2000 written at once) otherwise started a thread for each
// fetch (331 threads in the receiving agent), and past the process's limit the agent would fail.
constexpr size_t kMaxThreads = 32;
constexpr size_t kMaxFetchThreads = 8;
// What is watched in the snapshot dir and every directory below it: files completed, renamed in
// or away, deleted; directories made (IN_CREATE: only a directory's is acted on).
constexpr uint32_t kWatchMask =
    IN_CLOSE_WRITE | IN_MOVED_TO | IN_DELETE | IN_MOVED_FROM | IN_CREATE | IN_ONLYDIR;

// Warnings of one kind (each counted in `count`): the first few are logged, the last of them
// saying so. The text to end the warning with, or nothing when this one is not logged.
std::optional<const char*> firstFew(int& count) {
  constexpr int kLogged = 5;
  if (++count > kLogged) return std::nullopt;
  return count == kLogged ? " (further such warnings: not logged)" : "";
}

// The calling thread as background work: on a busy node the workers' training comes first.
// SCHED_IDLE runs it on the CPU time the workers leave (they wait in collectives often enough: a
// 50 MB snapshot a second still replicated in 0.1-0.5 s), and the threads it starts inherit it;
// nice 10 where SCHED_IDLE is refused. Step-time overhead of `train` (bench_replication.py --what
// step, medians of 16-18 runs): +2.1-2.7 % with SCHED_IDLE, +3.4-3.8 % with nice 10 alone.
void runAsBackground() {
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), kTransferNice);
  struct sched_param idle {};
  (void)::sched_setscheduler(0, SCHED_IDLE, &idle);
}

snapshot::SnapshotFile toWire(const SnapshotVersion& v) {
  snapshot::SnapshotFile f{v.name, v.version, v.size, v.crc32};
  f.crc32_pending = v.crc_pending;
  f.deleted = v.deleted;
  f.moved_from = v.moved_from;
  f.moved_from_version = v.moved_from_version;
  f.moved_to = v.moved_to;
  return f;
}
SnapshotVersion fromWire(const snapshot::SnapshotFile& f) {
  SnapshotVersion v{f.name, f.version, f.size, f.crc32};
  v.crc_pending = f.crc32_pending;
  v.deleted = f.deleted;
  v.moved_from = f.moved_from;
  v.moved_from_version = f.moved_from_version;
  v.moved_to = f.moved_to;
  return v;
}

// From this size on, a completed file is announced at once and hashed while the others fetch it
// (its CRC-32 follows the last chunk of every stream); smaller ones are hashed first (under
// 15 ms), which keeps their announcements self-contained.
constexpr uint64_t kAnnounceBeforeHash = 64 << 20;

// An announcement is a small unary call that a live agent answers in milliseconds: one that has
// not answered in this long (stopped, or its host gone without a reset) is stepped over, and told
// again this often while the round lasts.
constexpr auto kAnnounceTimeout = std::chrono::seconds(2);
constexpr auto kAnnounceRetry = std::chrono::seconds(1);

// How long a round's sync, and a failed job's end, wait for what the workers wrote to be looked
// at and versioned (Quiet::kVersioned): a checkpoint of 2000 files is hashed in ~6 s here. A
// round's sync waits at most half the holdings timeout, which the other nodes wait for it.
constexpr auto kVersionedWithin = std::chrono::seconds(10);

// How long a file deleted here because another node renamed it stays open for the copy under its
// new name (keptForCopy), in case the deletion arrived first.
constexpr auto kKeepRenamedFor = std::chrono::seconds(10);

// A name of the agent's own under the relative directory `dir` ("" or ending in '/'):
// kRecvPrefix, `stem`, this process and a random number. Never replicated, and removed at the
// next start if a crash leaves it behind (scanExisting).
std::string hiddenName(const std::string& dir, const std::string& stem) {
  std::random_device rd;
  return dir + kRecvPrefix + stem + "." + std::to_string(::getpid()) + "." + std::to_string(rd());
}

int64_t mtimeNs(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

TransferOutcome outcomeOf(const Status& st) {
  switch (st.code()) {
    case StatusCode::kOk:
      return TransferOutcome::kOk;
    case StatusCode::kDataLoss:
      return TransferOutcome::kCorrupt;
    case StatusCode::kResourceExhausted:
      return TransferOutcome::kNoSpace;
    case StatusCode::kCancelled:
      return TransferOutcome::kCancelled;
    default:
      return TransferOutcome::kFailed;
  }
}

}  // namespace

Status checkSnapshotDir(const std::string& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    return invalidArgument("--snapshot-dir: " + dir + " does not exist (" + std::strerror(errno) +
                           "); create it on every node");
  }
  if (!S_ISDIR(st.st_mode)) return invalidArgument("--snapshot-dir: " + dir + " is no directory");
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    return invalidArgument("--snapshot-dir: " + dir + " is not writable (" + std::strerror(errno) +
                           ")");
  }
  return Status::ok();
}

StatusOr<snapshot::ServeFault> parseSnapshotFault(const std::string& text) {
  snapshot::ServeFault fault;
  if (text.empty()) return fault;
  auto parts = split(text, ':');
  auto count = parts.size() == 2 ? parseInt(parts[1]) : std::nullopt;
  if (!count || *count < 0 || *count > 1000 ||
      (parts[0] != "in-flight" && parts[0] != "at-source" && parts[0] != "slow" &&
       parts[0] != "slow-hash")) {
    return invalidArgument("DDPRUN_SNAPSHOT_FAULT: '" + text +
                           "' is not in-flight:N, at-source:N, slow:MS or slow-hash:MS (a test "
                           "hook)");
  }
  fault.kind = parts[0] == "in-flight"   ? snapshot::ServeFault::Kind::kInFlight
               : parts[0] == "at-source" ? snapshot::ServeFault::Kind::kAtSource
               : parts[0] == "slow"      ? snapshot::ServeFault::Kind::kSlow
                                         : snapshot::ServeFault::Kind::kSlowHash;
  fault.count = static_cast<int>(*count);
  return fault;
}

uint64_t raiseOpenFileLimit() {
  struct rlimit lim {};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return 0;
  if (lim.rlim_cur < lim.rlim_max) {
    struct rlimit raised = lim;
    raised.rlim_cur = lim.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) lim = raised;
  }
  return static_cast<uint64_t>(lim.rlim_cur);
}

namespace {

// Why a file a worker completed cannot be opened to be replicated.
std::string cannotOpen(const std::string& path, int err) {
  std::string out = "cannot open " + path + ": " + std::strerror(err);
  if (err == EMFILE || err == ENFILE) {
    struct rlimit lim {};
    ::getrlimit(RLIMIT_NOFILE, &lim);
    out += " (the agent keeps one open file per replicated name; its limit is " +
           std::to_string(lim.rlim_cur) + ": raise the hard limit, ulimit -Hn)";
  }
  return out;
}
}  // namespace

StatusOr<size_t> parseSnapshotStreams(const std::string& text) {
  if (text.empty()) return snapshot::kDefaultFetchStreams;
  auto n = parseInt(text);
  if (!n || *n < 1 || *n > 16) {
    return invalidArgument("DDPRUN_SNAPSHOT_STREAMS: '" + text +
                           "' is not a whole number from 1 to 16 (streams for one large fetch)");
  }
  return static_cast<size_t>(*n);
}

namespace {
SnapshotReplicaOptions replicaOptions(const SnapshotLimits& limits) {
  SnapshotReplicaOptions o;
  o.max_names_per_holder = static_cast<size_t>(std::max(limits.names_per_peer, 1));
  o.max_pending_names = static_cast<size_t>(std::max(limits.names, 1));
  return o;
}
}  // namespace

SnapshotReplicator::SnapshotReplicator(boost::asio::io_context& io,
                                       SnapshotReplicatorOptions options)
    : io_(io),
      options_(std::move(options)),
      replica_(replicaOptions(options_.limits)),
      event_buf_(64 * 1024) {}

StatusOr<std::unique_ptr<SnapshotReplicator>> SnapshotReplicator::start(
    boost::asio::io_context& io, SnapshotReplicatorOptions options) {
  DDPRUN_RETURN_IF_ERROR(checkSnapshotDir(options.dir));
  std::unique_ptr<SnapshotReplicator> r(new SnapshotReplicator(io, std::move(options)));
  DDPRUN_RETURN_IF_ERROR(r->init());
  return r;
}

Status SnapshotReplicator::init() {
  // Watch first, then scan: a file completed in between is seen twice, never missed.
  const int fd = ::inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  if (fd < 0) return internalError(std::string("inotify: ") + std::strerror(errno));
  const int wd =
      ::inotify_add_watch(fd, options_.dir.c_str(), kWatchMask | IN_DELETE_SELF | IN_MOVE_SELF);
  if (wd < 0) {
    const int err = errno;
    ::close(fd);
    return invalidArgument("--snapshot-dir: cannot watch " + options_.dir + ": " +
                           std::strerror(err));
  }
  watched_[wd] = "";
  inotify_ = std::make_unique<boost::asio::posix::stream_descriptor>(io_, fd);
  scanExisting();

  std::string host = options_.local_addr;
  boost::system::error_code ec;
  auto addr = boost::asio::ip::make_address(host, ec);
  std::string listen_host = ec ? "0.0.0.0" : (addr.is_v6() ? "[" + host + "]" : host);
  snapshot::SnapshotServerOptions so;
  so.listen = listen_host + ":0";
  so.run_id = options_.run_id;
  so.security = options_.security;
  so.fault = options_.fault;
  so.max_streams_per_peer = options_.limits.streams_per_peer;
  so.max_streams = options_.limits.streams;
  so.max_buffered_bytes = options_.limits.buffered_bytes;
  so.lookup = [this](const snapshot::SnapshotFile& want) -> std::optional<snapshot::ServedFile> {
    const SnapshotVersion wanted = fromWire(want);
    std::lock_guard<std::mutex> lock(served_mu_);
    // Held here, or being fetched here (served as it arrives): under one number that may be
    // other content (written on two nodes in one round), so the content decides.
    for (const auto* table : {&served_, &arriving_}) {
      auto it = table->find(want.name);
      if (it != table->end() && fromWire(it->second.file).sameContent(wanted)) return it->second;
    }
    return std::nullopt;
  };
  std::weak_ptr<int> alive = alive_;
  so.on_announce = [this, alive](const snapshot::SnapshotFile& f, const std::string& source,
                                 const std::string& origin) {
    boost::asio::post(io_, [this, alive, v = fromWire(f), source, origin] {
      if (alive.lock()) onAnnounce(v, source, origin);
    });
  };
  auto server = snapshot::SnapshotServer::start(std::move(so));
  if (!server.isOk()) return server.status();
  server_ = std::move(server).value();
  const bool v6 = !ec && addr.is_v6();
  endpoint_ = (v6 ? "[" + host + "]" : host) + ":" + std::to_string(server_->port());
  snapLog()->info("snapshot dir {}: replicated between the nodes; serving at {}{}", options_.dir,
                  endpoint_, options_.security.tls_cert_pem.empty() ? "" : " (TLS)");
  watchDir();
  return Status::ok();
}

SnapshotReplicator::~SnapshotReplicator() {
  alive_.reset();
  for (const auto& [name, kept] : kept_for_copy_) {
    if (!kept.aside.empty()) ::unlink(path(kept.aside).c_str());
  }
  for (auto& [name, fetch] : fetching_) {
    fetch.second->cancel(Status(StatusCode::kCancelled, "the agent is stopping"));
  }
  if (inotify_) {
    boost::system::error_code ignored;
    inotify_->close(ignored);
  }
  for (auto& [id, t] : threads_) {
    if (t.joinable()) t.join();
  }
  // Work still queued (pools_) never runs: a Fetch stream waiting for a hash or a fetch of it (a
  // CRC-32 pending, bytes still arriving) would hold up the server's shutdown for ever. Ended now.
  std::vector<snapshot::ServedFile> waited_on;
  {
    std::lock_guard<std::mutex> lock(served_mu_);
    for (const auto& [name, s] : served_) waited_on.push_back(s);
    for (const auto& [name, s] : arriving_) waited_on.push_back(s);
  }
  const Status stopping(StatusCode::kCancelled, "the agent is stopping");
  for (const auto& s : waited_on) {
    if (s.pending_crc) s.pending_crc->set(stopping);
    if (s.arriving) s.arriving->fail(stopping);
  }
  server_.reset();
}

std::map<std::string, SnapshotVersion> SnapshotReplicator::readVersionTable() {
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

void SnapshotReplicator::recordVersions() {
  if (!recording_) return;  // scanning the directory: the table is written once at the end
  std::vector<SnapshotVersion> held;
  for (const auto& [name, h] : held_files_) held.push_back(fromWire(h.served.file));
  std::string text = encodeVersionTable(held);
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
  recorded_table_ = std::move(text);
}

std::vector<std::string> SnapshotReplicator::watchTree(const std::string& top) {
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

void SnapshotReplicator::forgetTree(const std::string& rel) {
  unwatchTree(rel);
  lookAgainAtHeld(rel + "/");
}

std::vector<std::string> SnapshotReplicator::closedFiles(std::vector<std::string> files) const {
  struct stat top {};
  if (files.empty() || ::stat(options_.dir.c_str(), &top) != 0) return files;
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

void SnapshotReplicator::unwatchTree(const std::string& rel) {
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

void SnapshotReplicator::rescan() {
  for (const auto& name : closedFiles(watchTree(""))) onDirEvent(name);
  lookAgainAtHeld("");
}

void SnapshotReplicator::lookAgainAtHeld(const std::string& prefix) {
  std::vector<std::string> held;
  for (const auto& [name, h] : held_files_) {
    if (!h.served.file.deleted && startsWith(name, prefix)) held.push_back(name);
  }
  for (const auto& name : held) onDirEvent(name);
}

void SnapshotReplicator::scanExisting() {
  const auto table = readVersionTable();
  for (const auto& name : watchTree("")) {
    const auto slash = name.rfind('/');
    if (startsWith(name.substr(slash == std::string::npos ? 0 : slash + 1), kRecvPrefix)) {
      ::unlink(path(name).c_str());  // a transfer cut short by a crash
      continue;
    }
    if (!isReplicatedName(name)) {
      warnIfTooLong(name);
      continue;
    }
    // Regular files only: a symlink is not followed out of the directory, a FIFO does not block.
    const int fd = ::open(path(name).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) continue;
    auto file = std::make_shared<snapshot::OpenFile>(fd);
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) continue;
    auto crc = snapshot::crc32OfFile(fd);
    if (!crc.isOk()) continue;
    const uint64_t version = recordedVersion(table, name, crc->first, crc->second);
    replica_.adoptExisting(name, crc->first, crc->second, version);
    setHeld(name, Held{{{name, version, crc->first, crc->second}, file, nullptr},
                       st.st_dev,
                       st.st_ino,
                       mtimeNs(st)});
    if (version != 0) {
      snapLog()->info(
          "snapshot dir: {} ({} bytes) is version {}, as recorded before this agent "
          "started",
          name, crc->first, versionText(version));
    } else {
      auto known = table.find(name);
      snapLog()->info(
          "snapshot dir: {} ({} bytes) was there before the job (version 0{})", name, crc->first,
          known == table.end() ? std::string()
                               : "; it changed since version " +
                                     versionText(known->second.version) + " was recorded");
    }
  }
  // Deletions recorded of files still absent stay deletions: older copies elsewhere are deleted,
  // not fetched back.
  for (const auto& [name, v] : table) {
    if (!v.deleted || held_files_.count(name) != 0) continue;
    replica_.adoptDeleted(name, v.version);
    setHeld(name, Held{{toWire(v), nullptr, nullptr}});
  }
  dropForgottenDeletions();  // a table of more deletions than are kept
  recording_ = true;
  recordVersions();  // drops what is no longer there
}

void SnapshotReplicator::setHeld(const std::string& name, Held held) {
  {
    std::lock_guard<std::mutex> lock(served_mu_);
    if (held.served.file.deleted) {
      served_.erase(name);  // nothing to serve
    } else {
      served_[name] = held.served;  // the replaced file stays referenced from held_files_ below
    }
  }
  metrics_.newest_version = std::max(metrics_.newest_version, held.served.file.version);
  auto& slot = held_files_[name];
  auto replaced = std::move(slot.served.data);
  slot = std::move(held);
  if (replaced != slot.served.data) releaseOffLoop(std::move(replaced));  // else: the same file
  recordVersions();
}

bool SnapshotReplicator::dropForgottenDeletions() {
  bool dropped = false;
  for (auto it = held_files_.begin(); it != held_files_.end();) {
    if (it->second.served.file.deleted && !replica_.held(it->first)) {
      it = held_files_.erase(it);
      dropped = true;
    } else {
      ++it;
    }
  }
  return dropped;
}

void SnapshotReplicator::restoreHeld(const std::string& name, const std::optional<Held>& before) {
  if (before) return setHeld(name, *before);
  held_files_.erase(name);
  {
    std::lock_guard<std::mutex> lock(served_mu_);
    served_.erase(name);
  }
  recordVersions();
}

void SnapshotReplicator::releaseOffLoop(std::shared_ptr<const snapshot::OpenFile> file) {
  if (!file) return;
  offLoop([file = std::move(file)]() mutable { file.reset(); }, [] {});
}

void SnapshotReplicator::watchDir() {
  inotify_->async_read_some(
      boost::asio::buffer(event_buf_), [this](const boost::system::error_code& ec, size_t n) {
        if (ec) {
          if (ec != boost::asio::error::operation_aborted) {
            snapLog()->error("snapshot dir {}: watching stopped: {}", options_.dir, ec.message());
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
          auto* ev = reinterpret_cast<const inotify_event*>(event_buf_.data() + off);
          events.push_back(Event{ev->wd, ev->mask, ev->cookie, ev->len > 0 ? ev->name : ""});
          off += sizeof(inotify_event) + ev->len;
        }
        for (const auto& ev : events) onWatchEvent(ev.wd, ev.mask, ev.cookie, ev.name);
        notRenamedWithin();
        watchDir();
      });
}

void SnapshotReplicator::onWatchEvent(int wd, uint32_t mask, uint32_t cookie,
                                      const std::string& name) {
  if (mask & (IN_DELETE_SELF | IN_MOVE_SELF)) {
    snapLog()->error("snapshot dir {} was removed or moved: replication stops", options_.dir);
    return;
  }
  if (mask & IN_Q_OVERFLOW) {
    if (auto more = firstFew(overflows_)) {
      snapLog()->warn("snapshot dir {}: too many changes at once; looking at every file again{}",
                      options_.dir, *more);
    }
    rescan();
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
  // Renamed away: a rename within the directory if its IN_MOVED_TO follows (notRenamedWithin).
  if ((mask & IN_MOVED_FROM) && cookie != 0 && isReplicatedName(rel)) {
    if (dir_event) unwatchTree(rel);
    renamed_away_.movedFrom(cookie, RenamePairs::Away{rel, dir_event},
                            std::chrono::steady_clock::now());
    return;
  }
  std::optional<RenamePairs::Away> from;
  if ((mask & IN_MOVED_TO) && cookie != 0) {
    from = renamed_away_.movedTo(cookie);
    if (from && from->dir != dir_event) from.reset();  // cannot be; treated as unrelated
  }
  if (dir_event) {
    if (mask & (IN_MOVED_FROM | IN_DELETE)) forgetTree(rel);
    if (!(mask & (IN_CREATE | IN_MOVED_TO))) return;
    if (isReplicatedName(rel)) {
      for (const auto& file : closedFiles(watchTree(rel))) {
        // The same file under its name before, if it was held: no hash, no fetch elsewhere.
        if (from && isReplicatedName(file)) {
          renamed_from_[file] = from->name + file.substr(rel.size());
        }
        onDirEvent(file);
      }
    } else {
      warnIfTooLong(rel);
    }
    if (from) lookAgainAtHeld(from->name + "/");  // their deletions, after the new names
    return;
  }
  if (mask & IN_CREATE) return;  // a file being written: looked at once it is complete
  if (from && isReplicatedName(rel)) renamed_from_[rel] = from->name;
  onDirEvent(rel);
  if (from) onDirEvent(from->name);  // its deletion, after the new name
}

void SnapshotReplicator::notRenamedWithin() {
  if (eventsQueued()) return;  // the read they wait for comes first; it calls this again
  for (const auto& r : renamed_away_.gone(std::chrono::steady_clock::now())) {
    if (r.dir) {
      lookAgainAtHeld(r.name + "/");
    } else {
      onDirEvent(r.name);
    }
  }
  const auto due = renamed_away_.nextDue();
  if (!due || renamed_away_timer_armed_) return;
  if (!renamed_away_timer_) {
    renamed_away_timer_ = std::make_unique<boost::asio::steady_timer>(io_);
  }
  renamed_away_timer_armed_ = true;
  renamed_away_timer_->expires_at(*due);
  std::weak_ptr<int> alive = alive_;
  renamed_away_timer_->async_wait([this, alive](const boost::system::error_code& ec) {
    if (ec || !alive.lock()) return;
    renamed_away_timer_armed_ = false;
    notRenamedWithin();
  });
}

void SnapshotReplicator::warnIfTooLong(const std::string& name) {
  if (name.size() <= kMaxReplicatedName) return;
  if (auto more = firstFew(long_names_)) {
    snapLog()->warn("snapshot dir: {} is not replicated: its path there is longer than {} bytes{}",
                    path(name), kMaxReplicatedName, *more);
  }
}

void SnapshotReplicator::onDirEvent(const std::string& name) {
  if (!isReplicatedName(name)) return warnIfTooLong(name);
  // Several events for one name while it waits: one look at the file (its latest content) is
  // enough.
  if (std::find(hash_queue_.begin(), hash_queue_.end(), name) == hash_queue_.end()) {
    hash_queue_.push_back(name);
  }
  hashNext();
}

// One file at a time, in the order completed, off the loop: its version is assigned when it has
// been looked at (small files: hashed too), so versions follow the order of the writes. A large
// file is announced before its hash is known and hashed while it is fetched
// (announceThenHash); the next file waits for that hash.
void SnapshotReplicator::hashNext() {
  if (hashing_ || hash_queue_.empty()) return;
  hashing_ = true;
  const std::string name = hash_queue_.front();
  hash_queue_.pop_front();
  std::optional<Held> known;
  if (auto it = held_files_.find(name); it != held_files_.end()) known = it->second;
  // Renamed to another name (onRenamed): its deletion says so.
  std::string moved_to;
  if (auto r = renamed_to_.find(name); r != renamed_to_.end()) {
    moved_to = std::move(r->second);
    renamed_to_.erase(r);
  }
  // Renamed from a name held with a known version and CRC-32: the same inode needs no hash.
  std::optional<Held> renamed;
  std::string from;
  if (auto r = renamed_from_.find(name); r != renamed_from_.end()) {
    from = std::move(r->second);
    renamed_from_.erase(r);
    auto it = held_files_.find(from);
    if (it != held_files_.end() && it->second.served.data && !it->second.served.file.deleted &&
        !it->second.served.file.crc32_pending && it->second.served.file.version != 0) {
      renamed = it->second;
    }
  }
  struct Looked {
    std::shared_ptr<snapshot::OpenFile> file;
    struct stat st {};
    bool same = false;     // what this node holds already
    bool renamed = false;  // what this node held as `from`
    StatusOr<std::pair<uint64_t, uint32_t>> crc = internalError("not read");
    bool deferred = false;  // large: announced first, hashed after
    bool gone = false;      // no file of that name (deleted, or renamed away)
    std::string unopened;   // why it could not be opened (not for ENOENT)
  };
  auto looked = std::make_shared<Looked>();
  const auto slow_hash = std::chrono::milliseconds(
      options_.fault.kind == snapshot::ServeFault::Kind::kSlowHash ? options_.fault.count : 0);
  offLoop(
      [looked, known, renamed, path = path(name), slow_hash] {
        std::this_thread::sleep_for(slow_hash);  // test hook (DDPRUN_SNAPSHOT_FAULT=slow-hash)
        const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
        if (fd < 0) {
          looked->gone = errno == ENOENT;
          if (!looked->gone) looked->unopened = cannotOpen(path, errno);
          return;
        }
        looked->file = std::make_shared<snapshot::OpenFile>(fd);
        if (::fstat(fd, &looked->st) != 0 || !S_ISREG(looked->st.st_mode)) {
          looked->file.reset();
          return;
        }
        const auto& st = looked->st;
        auto isFile = [&](const std::optional<Held>& h) {
          return h && h->dev == st.st_dev && h->ino == st.st_ino && h->mtime_ns == mtimeNs(st) &&
                 h->served.file.size == static_cast<uint64_t>(st.st_size);
        };
        if (isFile(known)) {
          looked->same = true;  // e.g. a copy this node just renamed into place
          return;
        }
        if (isFile(renamed)) {
          looked->renamed = true;
          return;
        }
        if (static_cast<uint64_t>(st.st_size) >= kAnnounceBeforeHash) {
          looked->deferred = true;
          return;
        }
        runAsBackground();
        looked->crc = snapshot::crc32OfFile(fd);
      },
      [this, name, looked, from, moved_to, renamed] {
        if (looked->deferred) {
          announceThenHash(name, looked->file, looked->st);
          return;
        }
        if (looked->renamed) {
          onRenamed(name, from, renamed->served.file.version, looked->file, looked->st);
          return;
        }
        hashing_ = false;
        // Named for the first few files (past a descriptor limit, every later file fails too).
        if (!looked->unopened.empty()) {
          if (auto more = firstFew(unopened_files_)) {
            snapLog()->warn("snapshot dir: {}; {} is not replicated{}", looked->unopened, name,
                            *more);
          }
        }
        if (looked->gone) {
          onDeleted(name, moved_to);
        } else {
          onHashed(name, looked->file, looked->st, looked->same, looked->crc);
        }
        hashNext();
      },
      Urgency::kPrompt);
}

bool SnapshotReplicator::holdsAlready(const std::string& name, const struct stat& st) const {
  auto it = held_files_.find(name);
  return it != held_files_.end() && it->second.dev == st.st_dev && it->second.ino == st.st_ino &&
         it->second.mtime_ns == mtimeNs(st);
}

void SnapshotReplicator::announceThenHash(const std::string& name,
                                          std::shared_ptr<snapshot::OpenFile> file,
                                          const struct stat& st) {
  if (holdsAlready(name, st)) {  // installed here while it was looked at
    hashing_ = false;
    hashNext();
    return;
  }
  const SnapshotVersion v =
      replica_.onLocalWritePending(name, static_cast<uint64_t>(st.st_size), round_);
  auto pending = std::make_shared<snapshot::PendingCrc>();
  publishWritten(v, Held{{toWire(v), file, pending}, st.st_dev, st.st_ino, mtimeNs(st)},
                 " while it is hashed");
  auto crc = std::make_shared<StatusOr<uint32_t>>(internalError("not hashed"));
  offLoop(
      // Always sets `pending`: streams waiting for it end either way.
      [file, pending, crc, size = v.size] {
        auto hashed = snapshot::crc32OfFile(file->fd());
        if (!hashed.isOk()) {
          *crc = hashed.status();
        } else if (hashed->first != size) {
          *crc = internalError("it changed size while it was hashed (" + std::to_string(size) +
                               " -> " + std::to_string(hashed->first) + " bytes)");
        } else {
          *crc = hashed->second;
        }
        pending->set(*crc);
      },
      [this, name, v, crc] {
        hashing_ = false;
        if (!crc->isOk()) {
          snapLog()->warn(
              "snapshot: cannot hash {} version {}: {}; the other nodes cannot fetch it", name,
              versionText(v.version), crc->status().message());
        } else {
          replica_.onCrcKnown(name, v.version, **crc);
          auto it = held_files_.find(name);
          if (it != held_files_.end() && it->second.served.file.version == v.version) {
            Held known = it->second;
            known.served.file.crc32 = **crc;
            known.served.file.crc32_pending = false;
            setHeld(name, std::move(known));
          }
        }
        hashNext();
      });
}

void SnapshotReplicator::onHashed(const std::string& name, std::shared_ptr<snapshot::OpenFile> file,
                                  const struct stat& st, bool same,
                                  const StatusOr<std::pair<uint64_t, uint32_t>>& crc) {
  if (!file || same) return;
  if (!crc.isOk()) {
    snapLog()->warn("snapshot dir: cannot read {}: {}", name, crc.status().message());
    return;
  }
  if (holdsAlready(name, st)) return;  // installed here while it was being hashed
  SnapshotVersion v = replica_.onLocalWrite(name, crc->first, crc->second, round_);
  publishWritten(v, Held{{toWire(v), std::move(file), nullptr}, st.st_dev, st.st_ino, mtimeNs(st)},
                 "");
}

void SnapshotReplicator::onRenamed(const std::string& name, const std::string& from,
                                   uint64_t from_version, std::shared_ptr<snapshot::OpenFile> file,
                                   const struct stat& st) {
  hashing_ = false;
  if (!holdsAlready(name, st)) {
    if (auto v = replica_.onLocalRename(name, from, from_version, round_)) {
      renamed_to_[from] = name;  // its deletion, looked at next, says so
      publishWritten(
          *v, Held{{toWire(*v), std::move(file), nullptr}, st.st_dev, st.st_ino, mtimeNs(st)},
          " (renamed from " + from + ")");
    } else {
      hash_queue_.push_front(name);  // what was held as `from` changed meanwhile: hashed after all
    }
  }
  hashNext();
}

void SnapshotReplicator::onDeleted(const std::string& name, const std::string& moved_to) {
  auto v = replica_.onLocalDelete(name, round_);
  if (!v) return;
  v->moved_to = moved_to;
  dropForgottenDeletions();  // the oldest one, past the core's max_tombstones
  publishWritten(*v, Held{{toWire(*v), nullptr, nullptr}}, "");
}

void SnapshotReplicator::publishWritten(const SnapshotVersion& v, Held held,
                                        const std::string& note) {
  setHeld(v.name, std::move(held));
  if (!v.deleted) ++metrics_.versions_written;
  const auto targets = relayTargets(self_rank_, self_rank_, static_cast<int>(nodes_.size()));
  snapLog()->info("snapshot: {} version {} {} here; announcing it to {} of {} other node(s){}",
                  v.name, versionText(v.version),
                  v.deleted ? std::string("(a deletion) made")
                            : "(" + std::to_string(v.size) + " bytes) written",
                  targets.size(), nodes_.empty() ? 0 : nodes_.size() - 1, note);
  announce(v, endpoint_, endpoint_, targets);
}

void SnapshotReplicator::announce(const SnapshotVersion& v, const std::string& source,
                                  const std::string& origin, const std::vector<int>& ranks) {
  // For each target: it, then the nodes after it in the chain, each tried only when the one
  // before did not take the announcement (a node stopped or gone, not yet out of the round). A
  // node that did not answer an earlier announcement is stepped over without a try: it is told
  // again, with everything else it missed, by announceAgainLater (at worst twice, which it
  // takes as once).
  const int origin_rank = rankOf(origin);
  const int nodes = static_cast<int>(nodes_.size());
  std::vector<std::vector<std::string>> lines;
  bool missed = false;
  for (int r : ranks) {
    std::vector<std::string> line;
    for (int next = r; next >= 0 && next < nodes && next != self_rank_;) {
      if (unanswering_.count(nodes_[next]) != 0) {
        keepToTellAgain(Unannounced{v, source, origin, nodes_[next], round_});
        missed = true;
      } else {
        line.push_back(nodes_[next]);
      }
      const auto after = relayTargets(origin_rank, next, nodes);
      next = after.empty() ? -1 : after.front();
    }
    if (!line.empty()) lines.push_back(std::move(line));
  }
  if (missed) announceAgainLater();
  if (lines.empty()) return;
  ++announcing_;
  const std::string run_id = options_.run_id;
  const auto security = options_.security;
  // (peer, why, whether the next node of the chain was told instead)
  auto failed = std::make_shared<std::vector<std::tuple<std::string, std::string, bool>>>();
  offLoop(
      [lines, v, source, origin, run_id, security, failed] {
        for (const auto& line : lines) {
          for (size_t i = 0; i < line.size(); ++i) {
            Status st =
                snapshot::announceSnapshot(snapshot::SnapshotPeer{line[i], run_id, security},
                                           toWire(v), source, origin, kAnnounceTimeout);
            if (st.isOk()) break;
            failed->emplace_back(line[i], st.message(), i + 1 < line.size());
          }
        }
      },
      [this, failed, v, source, origin, round = round_] {
        --announcing_;
        for (const auto& [peer, why, stepped] : *failed) {
          if (unanswering_.insert(peer).second) {  // warned once per node, until it answers
            snapLog()->warn("snapshot: announcing {} version {} failed at {}: {}; {}", v.name,
                            versionText(v.version), peer, why,
                            stepped ? "told the next node of the chain, and telling it again"
                                    : "telling it again");
          }
          keepToTellAgain(Unannounced{v, source, origin, peer, round});
        }
        if (!failed->empty()) announceAgainLater();
      },
      Urgency::kPrompt);
}

void SnapshotReplicator::keepToTellAgain(Unannounced u) {
  // One to tell again per node and name: the newest, by content too (two nodes that wrote the
  // name under one number: the greater content, which every node ends with).
  auto& list = unannounced_;
  for (const auto& kept : list) {
    if (kept.peer == u.peer && kept.version.name == u.version.name &&
        (kept.version.sameContent(u.version) || kept.version.supersedes(u.version))) {
      return;
    }
  }
  list.erase(std::remove_if(list.begin(), list.end(),
                            [&](const Unannounced& kept) {
                              return kept.peer == u.peer && kept.version.name == u.version.name;
                            }),
             list.end());
  list.push_back(std::move(u));
}

void SnapshotReplicator::announceAgainLater() {
  if (!announce_timer_) announce_timer_ = std::make_unique<boost::asio::steady_timer>(io_);
  if (announce_timer_armed_) return;
  announce_timer_armed_ = true;
  announce_timer_->expires_after(kAnnounceRetry);
  std::weak_ptr<int> alive = alive_;
  announce_timer_->async_wait([this, alive](const boost::system::error_code& ec) {
    if (ec || !alive.lock()) return;
    announce_timer_armed_ = false;
    // A later round's sync covers what the earlier one's announcements did not.
    std::map<std::string, std::vector<Unannounced>> by_peer;
    for (auto& u : unannounced_) {
      if (u.round == round_ && rankOf(u.peer) >= 0) by_peer[u.peer].push_back(std::move(u));
    }
    unannounced_.clear();
    for (auto& [peer, list] : by_peer) announceAgain(peer, std::move(list));
  });
}

void SnapshotReplicator::announceAgain(const std::string& peer, std::vector<Unannounced> list) {
  ++announcing_;
  auto told = std::make_shared<size_t>(0);  // how many it took, in order
  auto shared = std::make_shared<std::vector<Unannounced>>(std::move(list));
  offLoop(
      [peer, shared, told, run_id = options_.run_id, security = options_.security] {
        for (const auto& u : *shared) {
          Status st =
              snapshot::announceSnapshot(snapshot::SnapshotPeer{peer, run_id, security},
                                         toWire(u.version), u.source, u.origin, kAnnounceTimeout);
          if (!st.isOk()) return;  // still not answering: the rest waits for the next time
          ++*told;
        }
      },
      [this, peer, shared, told] {
        --announcing_;
        if (*told == shared->size()) {
          unanswering_.erase(peer);
          return;
        }
        for (size_t i = *told; i < shared->size(); ++i) keepToTellAgain((*shared)[i]);
        announceAgainLater();
      },
      Urgency::kPrompt);
}

void SnapshotReplicator::relay(const SnapshotVersion& v, const std::string& source) {
  const auto origin = relays_.pass(v, /*early=*/false);
  // None when the round changed: its sync covers it.
  if (origin) announce(v, source, *origin, chainAfter(*origin));
}

void SnapshotReplicator::onAnnounce(const SnapshotVersion& announced, const std::string& source,
                                    const std::string& origin) {
  if (!isReplicatedName(announced.name)) return;  // a peer's name that would leave the directory
  // Only the nodes of the round are listened to (their endpoints came through the rendezvous,
  // which has the job's token). While a round's holdings are still awaited, who is a node is not
  // known yet: the announcement waits for them (a few, the newest kept).
  if (!nodes_known_) {
    if (unverified_.size() >= kMaxUnverified) unverified_.pop_front();
    unverified_.push_back(Unverified{announced, source, origin});
    return;
  }
  if (rankOf(source) < 0) {
    if (auto n = ignored_log_.note(source, std::chrono::steady_clock::now())) {
      snapLog()->warn(
          "snapshot: ignored {} announcement(s) from {}, which is not a node of round {} (the "
          "last: {} version {})",
          *n, quotePeerText(source, 100), round_, quotePeerText(announced.name, 200),
          versionText(announced.version));
    }
    return;
  }
  if (!isPossibleVersion(announced.version)) {
    if (auto more = firstFew(impossible_versions_)) {
      snapLog()->warn(
          "snapshot: {} announced {} with version {} (round {}), which no job reaches: "
          "ignored{}",
          source, announced.name, announced.version, announced.version >> 32, *more);
    }
    return;
  }
  SnapshotVersion v = announced;
  if (!v.moved_from.empty() && !isReplicatedName(v.moved_from)) {
    v.moved_from.clear();  // a hint naming nothing this node could hold
    v.moved_from_version = 0;
  }
  if (!v.moved_to.empty() && !isReplicatedName(v.moved_to)) v.moved_to.clear();
  const bool newer = replica_.shouldInstall(v);
  if (!tookHolder(v, source)) return;
  relays_.told(v, origin);
  if (newer) {
    auto& heard = first_heard_[v.name];
    if (heard.first != v.version) heard = {v.version, std::chrono::steady_clock::now()};
  }
  pump();
}

std::vector<int> SnapshotReplicator::subtree(const SnapshotVersion& v, std::string* origin) const {
  auto told = relays_.origin(v);
  if (!told) return {};
  *origin = *told;
  return chainAfter(*told);
}

std::vector<int> SnapshotReplicator::chainAfter(const std::string& origin) const {
  const int origin_rank = rankOf(origin);
  if (self_rank_ < 0 || origin_rank < 0) return {};  // the round changed: its sync covers it
  return relayTargets(origin_rank, self_rank_, static_cast<int>(nodes_.size()));
}

int SnapshotReplicator::rankOf(const std::string& endpoint) const {
  auto at = std::find(nodes_.begin(), nodes_.end(), endpoint);
  return at == nodes_.end() ? -1 : static_cast<int>(at - nodes_.begin());
}

std::shared_ptr<snapshot::ArrivingFile> SnapshotReplicator::serveArriving(
    const SnapshotVersion& v, std::shared_ptr<snapshot::PendingCrc>* pending) {
  std::string origin;
  const auto targets = subtree(v, &origin);
  if (targets.empty()) return nullptr;
  auto arriving = std::make_shared<snapshot::ArrivingFile>();
  if (v.crc_pending) *pending = std::make_shared<snapshot::PendingCrc>();
  {
    std::lock_guard<std::mutex> lock(served_mu_);
    arriving_[v.name] = snapshot::ServedFile{toWire(v), nullptr, *pending, arriving};
  }
  if (relays_.pass(v, /*early=*/true)) {  // told once: a retry of the fetch serves it quietly
    snapLog()->info("snapshot: passing {} version {} on to {} node(s) as it arrives", v.name,
                    versionText(v.version), targets.size());
    announce(v, endpoint_, origin, targets);
  }
  return arriving;
}

void SnapshotReplicator::pump() {
  // While a round's sync waits for them, this node's workers are not running and their start
  // waits for these transfers: they run at the agent's priority then, in the background else.
  const Urgency urgency = sync_done_ ? Urgency::kPrompt : Urgency::kBackground;
  for (auto& t : replica_.takeTransfers()) {
    if (t.file.deleted) {
      applyDeletion(t);
      continue;
    }
    if (urgency == Urgency::kPrompt) snapshot::warmHeapForFetches();  // no workers yet
    // Received next to where it goes (the rename stays in one directory and file system), under
    // a name that stays within NAME_MAX (255) whatever the file's.
    const auto slash = t.file.name.rfind('/');
    const std::string dir = slash == std::string::npos ? "" : t.file.name.substr(0, slash + 1);
    const std::string temp = path(hiddenName(dir, t.file.name.substr(dir.size(), kRecvNameKept)));
    const auto started = std::chrono::steady_clock::now();
    auto status = std::make_shared<Status>();
    auto crc = std::make_shared<uint32_t>(0);
    snapshot::SnapshotPeer peer{t.source, options_.run_id, options_.security};
    peer.stall_timeout = seconds(options_.limits.stall_seconds);
    // Renamed on the node that wrote it, from a file held here: copied from that (it is passed on
    // once complete, a local copy being quick). Else a node this one relays the version to
    // fetches it from here while it arrives.
    auto local = localCopyOf(t.file);
    const bool linked = local && linkHeld(t.file, temp);
    if (local) dropKept(t.file.moved_from);  // linked, or copied from `local` (held by the copy)
    if (linked) {
      // Installed from the loop's next turn (onFetched pumps, and this loop is not done).
      std::weak_ptr<int> alive = alive_;
      boost::asio::post(io_, [this, alive, t, temp, started] {
        if (alive.lock())
          onFetched(t, Status::ok(), temp, started, "linked from " + t.file.moved_from);
      });
      continue;
    }
    auto copied = std::make_shared<bool>(false);
    std::shared_ptr<snapshot::PendingCrc> pending;
    auto arriving = local ? nullptr : serveArriving(t.file, &pending);
    auto cancel = std::make_shared<snapshot::FetchCancel>();
    fetching_[t.file.name] = {t.source, cancel};
    offLoop(
        [peer, file = toWire(t.file), temp, status, crc, cancel, streams = options_.fetch_streams,
         arriving, pending, root = options_.dir, local, copied] {
          *status = makeParentDirsUnder(root, file.name);
          if (status->isOk() && local) {
            *status = snapshot::copySnapshotLocally(*local, file, temp, cancel.get());
            *copied = status->isOk();
            *crc = file.crc32;
            if (!status->isOk() && status->code() != StatusCode::kCancelled &&
                status->code() != StatusCode::kResourceExhausted) {
              snapLog()->warn("snapshot: copying {} from {} here failed: {}; fetching it from {}",
                              file.name, file.moved_from, status->message(), peer.endpoint);
              *status = snapshot::fetchSnapshot(peer, file, temp, cancel.get(), streams, crc.get());
            }
          } else if (status->isOk()) {
            *status = snapshot::fetchSnapshot(peer, file, temp, cancel.get(), streams, crc.get(),
                                              arriving);
          } else if (arriving) {
            arriving->fail(*status);
          }
          // Set here, not on the loop: streams waiting for it must end even while the agent
          // stops (its server waits for them).
          if (pending) pending->set(status->isOk() ? StatusOr<uint32_t>(*crc) : *status);
        },
        [this, t, status, crc, temp, started, arriving, cancel, copied]() mutable {
          auto running = fetching_.find(t.file.name);
          if (running != fetching_.end() && running->second.second == cancel) {
            fetching_.erase(running);
          }
          if (status->isOk()) {  // the verified CRC-32 (the target's may have been pending)
            t.file.crc32 = *crc;
            t.file.crc_pending = false;
          }
          onFetched(t, *status, temp, started,
                    *copied ? "copied from " + t.file.moved_from : std::string());
          if (arriving) {  // after onFetched: a copy renamed into place is served from there now
            std::lock_guard<std::mutex> lock(served_mu_);
            auto it = arriving_.find(t.file.name);
            if (it != arriving_.end() && it->second.arriving == arriving) arriving_.erase(it);
          }
        },
        urgency, Pool::kFetch);
  }
  maybeFinishSync();
}

void SnapshotReplicator::applyDeletion(const SnapshotTransfer& t) {
  const std::string& name = t.file.name;
  Status st;
  if (replica_.shouldInstall(t.file)) {
    // Recorded first: the unlink's IN_DELETE then finds the deletion held already.
    auto before = held_files_.find(name);
    std::optional<Held> previous;
    if (before != held_files_.end()) previous = before->second;
    setHeld(name, Held{{toWire(t.file), nullptr, nullptr}});
    // Renamed on the node that deleted it: its new name may not have arrived yet.
    const bool keep =
        previous && !t.file.moved_to.empty() && worthKeeping(t.file.moved_to, *previous);
    std::string aside = keep ? setAside(name) : std::string();
    // Never through a symlink: a name another node announced stays inside the directory.
    if (aside.empty()) st = removeBeneath(options_.dir, name);
    if (!st.isOk()) {
      restoreHeld(name, previous);
      ++metrics_.transfer_failures;
      snapLog()->warn("snapshot: not deleting {} (deleted at version {} on another node): {}", name,
                      versionText(t.file.version), st.message());
    } else {
      if (keep) keepForCopy(name, *previous, std::move(aside));
      removeEmptyParentsUnder(options_.dir, name);  // as a deleted checkpoint directory goes
      snapLog()->info("snapshot: deleted {} (version {}, deleted on another node)", name,
                      versionText(t.file.version));
    }
  }
  // A deletion refused (through a symlink) is not tried again: nothing here would change that.
  replica_.onTransferDone(t, st.isOk() ? TransferOutcome::kOk : TransferOutcome::kRefused);
  if (dropForgottenDeletions()) recordVersions();
  if (st.isOk()) relay(t.file, endpoint_);
}

std::shared_ptr<const snapshot::OpenFile> SnapshotReplicator::localCopyOf(
    const SnapshotVersion& v) {
  if (v.moved_from.empty() || v.crc_pending || v.deleted) return nullptr;
  auto isIt = [&](const snapshot::ServedFile& s) {
    const auto& f = s.file;
    return s.data && !f.deleted && !f.crc32_pending && f.version == v.moved_from_version &&
           f.size == v.size && f.crc32 == v.crc32;
  };
  if (auto it = held_files_.find(v.moved_from);
      it != held_files_.end() && isIt(it->second.served)) {
    return it->second.served.data;
  }
  auto kept = kept_for_copy_.find(v.moved_from);
  if (kept == kept_for_copy_.end() || !isIt(kept->second.held.served)) return nullptr;
  return kept->second.held.served.data;
}

bool SnapshotReplicator::linkHeld(const SnapshotVersion& v, const std::string& temp) {
  const Held* held = nullptr;
  std::string from;  // relative to the directory, as `temp`
  if (auto it = held_files_.find(v.moved_from);
      it != held_files_.end() && it->second.served.file.version == v.moved_from_version) {
    held = &it->second;
    from = v.moved_from;
  } else if (auto kept = kept_for_copy_.find(v.moved_from);
             kept != kept_for_copy_.end() && !kept->second.aside.empty()) {
    held = &kept->second.held;
    from = kept->second.aside;
  } else {
    return false;  // kept open for the copy only (keepForCopy)
  }
  const Held& h = *held;
  // No symlink followed on either side (a directory replaced by one meanwhile is refused).
  auto st = statBeneath(options_.dir, from);
  if (!st.isOk() || !S_ISREG(st->st_mode) || st->st_dev != h.dev || st->st_ino != h.ino ||
      mtimeNs(*st) != h.mtime_ns || static_cast<uint64_t>(st->st_size) != v.size) {
    return false;  // not the file held (changed by a worker meanwhile)
  }
  return makeParentDirsUnder(options_.dir, v.name).isOk() &&
         linkBeneath(options_.dir, from, relativeName(temp)).isOk();
}

bool SnapshotReplicator::worthKeeping(const std::string& moved_to, const Held& before) const {
  const auto& served = before.served;
  if (!served.data || served.file.deleted || served.file.crc32_pending) return false;
  auto now_there = held_files_.find(moved_to);
  return now_there == held_files_.end() || now_there->second.dev != before.dev ||
         now_there->second.ino != before.ino;  // else linked there already (linkHeld)
}

std::string SnapshotReplicator::setAside(const std::string& name) {
  const std::string aside = hiddenName("", "kept");
  return renameBeneath(options_.dir, name, aside).isOk() ? aside : std::string();
}

void SnapshotReplicator::keepForCopy(const std::string& name, const Held& before,
                                     std::string aside) {
  dropKept(name);  // one kept before under that name: the newer deletion's file replaces it
  kept_for_copy_[name] =
      KeptCopy{before, std::chrono::steady_clock::now() + kKeepRenamedFor, std::move(aside)};
  dropKeptCopiesLater();
}

void SnapshotReplicator::dropKept(const std::string& name) {
  auto it = kept_for_copy_.find(name);
  if (it == kept_for_copy_.end()) return;
  if (!it->second.aside.empty()) ::unlink(path(it->second.aside).c_str());
  releaseOffLoop(std::move(it->second.held.served.data));  // its blocks are freed then
  kept_for_copy_.erase(it);
}

void SnapshotReplicator::dropKeptCopiesLater() {
  if (kept_timer_armed_ || kept_for_copy_.empty()) return;
  if (!kept_timer_) kept_timer_ = std::make_unique<boost::asio::steady_timer>(io_);
  TimePoint first = TimePoint::max();
  for (const auto& [name, kept] : kept_for_copy_) first = std::min(first, kept.until);
  kept_timer_armed_ = true;
  kept_timer_->expires_at(first);
  std::weak_ptr<int> alive = alive_;
  kept_timer_->async_wait([this, alive](const boost::system::error_code& ec) {
    if (ec || !alive.lock()) return;
    kept_timer_armed_ = false;
    const auto now = std::chrono::steady_clock::now();
    std::vector<std::string> due;
    for (const auto& [name, kept] : kept_for_copy_) {
      if (kept.until <= now) due.push_back(name);
    }
    for (const auto& name : due) dropKept(name);
    dropKeptCopiesLater();
  });
}

void SnapshotReplicator::onFetched(const SnapshotTransfer& t, const Status& fetched,
                                   const std::string& temp, TimePoint started,
                                   const std::string& taken) {
  Status st = fetched;
  const auto now = std::chrono::steady_clock::now();
  const double secs = std::chrono::duration<double>(now - started).count();
  if (st.isOk() && !replica_.shouldInstall(t.file)) {
    ::unlink(temp.c_str());  // something newer arrived meanwhile
  } else if (st.isOk()) {
    const int fd = ::open(temp.c_str(), O_RDONLY | O_CLOEXEC);
    struct stat sb {};
    if (fd < 0 || ::fstat(fd, &sb) != 0) {
      st = internalError("cannot reopen " + temp + ": " + std::strerror(errno));
      if (fd >= 0) ::close(fd);
      ::unlink(temp.c_str());
    } else {
      auto file = std::make_shared<snapshot::OpenFile>(fd);
      // Record it first: the rename's IN_MOVED_TO then finds what this node holds already.
      Held held{{toWire(t.file), file, nullptr}, sb.st_dev, sb.st_ino, mtimeNs(sb)};
      auto previous = held_files_.find(t.file.name);
      std::optional<Held> before;  // released off the loop below (releaseOffLoop)
      if (previous != held_files_.end()) before = previous->second;
      setHeld(t.file.name, held);
      // Never through a symlink, which would place the file outside the directory.
      if (Status moved = renameBeneath(options_.dir, relativeName(temp), t.file.name);
          !moved.isOk()) {
        st = Status(moved.code(), "cannot place " + t.file.name + ": " + moved.message());
        ::unlink(temp.c_str());
        restoreHeld(t.file.name, before);
      } else {
        // The directory that holds the name (not always the top): its new entry lasts through a
        // crash of the host.
        const std::string placed = path(t.file.name);
        syncDir(placed.substr(0, placed.rfind('/')));
        if (taken.empty()) {
          ++metrics_.versions_fetched;
          metrics_.bytes_fetched += t.file.size;
        } else {
          ++metrics_.versions_copied;
        }
        auto heard = first_heard_.find(t.file.name);
        const TimePoint since = heard != first_heard_.end() && heard->second.first == t.file.version
                                    ? std::min(heard->second.second, started)
                                    : started;
        metrics_.last_lag_seconds = std::chrono::duration<double>(now - since).count();
        if (taken.empty()) {
          snapLog()->info("snapshot: fetched {} version {}: {} bytes from {} in {:.3f} s",
                          t.file.name, versionText(t.file.version), t.file.size, t.source, secs);
        } else {
          snapLog()->info(
              "snapshot: {} version {}: {} bytes {} here (renamed on another node) in {:.3f} s",
              t.file.name, versionText(t.file.version), t.file.size, taken, secs);
        }
        relay(t.file, endpoint_);  // this node serves its subtree of the announcement tree
      }
      if (before) releaseOffLoop(std::move(before->served.data));
    }
  }
  if (!st.isOk()) {
    ++metrics_.transfer_failures;
    if (st.code() == StatusCode::kResourceExhausted) {  // this node's disk (or memory)
      snapLog()->error("snapshot: {} (fetching it from {}); keeping the previous version",
                       st.message(), t.source);
    } else if (st.code() != StatusCode::kCancelled) {
      // A peer can fail many fetches (one per name it announced): a few lines a minute each.
      if (auto n = fetch_log_.note(t.source, now)) {
        snapLog()->warn(
            "snapshot: fetching {} version {} from {} failed (attempt {}): {}{}", t.file.name,
            versionText(t.file.version), t.source, t.attempt, st.message(),
            *n > 1 ? " (" + std::to_string(*n - 1) + " more failures from it were not logged)"
                   : std::string());
      }
    }
  }
  replica_.onTransferDone(t, outcomeOf(st));
  if (!st.isOk()) {
    std::string origin;
    const auto targets = subtree(t.file, &origin);
    if (relays_.passedEarly(t.file)) {
      // The subtree was told to fetch from here as it arrived: their streams failed with this
      // one. They fetch from where this node tried too.
      announce(t.file, t.source, origin, targets);
    } else if (!replica_.wanted(t.file.name)) {
      relay(t.file, t.source);  // given up here: the subtree fetches from where this node tried
    }
  }
  if (!st.isOk() && st.code() != StatusCode::kResourceExhausted && !replica_.wanted(t.file.name) &&
      replica_.shouldInstall(t.file)) {
    auto kept = replica_.held(t.file.name);
    if (auto n = gave_up_log_.note(t.source, now)) {
      snapLog()->error(
          "snapshot: gave up on {} version {} (last tried from {}); keeping {}{}", t.file.name,
          versionText(t.file.version), t.source,
          kept ? "version " + versionText(kept->version) : std::string("none"),
          *n > 1 ? " (" + std::to_string(*n - 1) + " more given up, not logged)" : std::string());
    }
  }
  pump();
}

bool SnapshotReplicator::tookHolder(const SnapshotVersion& v, const std::string& source) {
  const HolderNews news = replica_.onHolder(v, source);
  if (news != HolderNews::kTooManyFromHolder && news != HolderNews::kTooManyNames) return true;
  if (auto n = names_log_.note(source, std::chrono::steady_clock::now())) {
    const bool theirs = news == HolderNews::kTooManyFromHolder;
    snapLog()->warn(
        "snapshot: refused {} new name(s) from {} (the last: {}): {} names wait to be fetched "
        "here{}, the most --snapshot-limits {} allows",
        *n, quotePeerText(source, 100), quotePeerText(v.name, 200),
        theirs ? replica_.namesFrom(source) : replica_.pendingNames(),
        theirs ? " from it" : " in all", theirs ? "names_per_peer" : "names");
  }
  return false;
}

void SnapshotReplicator::dropGoneSources(const std::vector<std::string>& live) {
  const size_t pending = replica_.pendingNames();
  replica_.keepSources(live);
  // What only the nodes gone were heard to hold is forgotten, with what passing it on needed.
  if (const size_t forgotten = pending - std::min(pending, replica_.pendingNames())) {
    snapLog()->info("snapshot: forgot {} name(s) that only nodes no longer in round {} held",
                    forgotten, round_);
  }
  for (auto it = first_heard_.begin(); it != first_heard_.end();) {
    it = replica_.wanted(it->first) ? std::next(it) : first_heard_.erase(it);
  }
  relays_.forgetUnless(
      [this](const std::string& name) { return replica_.wanted(name).has_value(); });
  for (auto& [name, fetch] : fetching_) {
    const std::string& source = fetch.first;
    if (fetch.second->cancelled()) continue;  // ended at an earlier round's sync
    if (std::find(live.begin(), live.end(), source) != live.end()) continue;
    snapLog()->warn("snapshot: ending the fetch of {} from {}: not a node of round {}", name,
                    source, round_);
    fetch.second->cancel(Status(StatusCode::kUnavailable,
                                source + " is not a node of round " + std::to_string(round_)));
  }
}

void SnapshotReplicator::maybeFinishSync() {
  if (!sync_done_ || replica_.busy()) return;
  auto done = std::move(sync_done_);
  sync_done_ = nullptr;
  done();
}

void SnapshotReplicator::offLoop(std::function<void()> work, std::function<void()> then,
                                 Urgency urgency, Pool pool) {
  auto& slots = pools_[static_cast<size_t>(pool)];
  if (slots.running >= (pool == Pool::kFetch ? kMaxFetchThreads : kMaxThreads)) {
    slots.waiting.push_back(Work{std::move(work), std::move(then), urgency});
    return;
  }
  const uint64_t id = next_thread_++;
  std::weak_ptr<int> alive = alive_;
  auto body = [this, id, alive, urgency, pool, work, then] {
    if (urgency == Urgency::kBackground) runAsBackground();
    work();
    boost::asio::post(io_, [this, id, alive, pool, then] {
      if (!alive.lock()) return;
      auto it = threads_.find(id);
      if (it != threads_.end()) {
        it->second.join();  // it has posted this: it is at its end
        threads_.erase(it);
      }
      --pools_[static_cast<size_t>(pool)].running;
      then();
      startWaiting(pool);
    });
  };
  try {
    threads_[id] = std::thread(std::move(body));
    ++slots.running;
  } catch (const std::system_error& e) {  // out of threads (ulimit -u, memory)
    threads_.erase(id);
    if (slots.running == 0) {  // none of its pool to wait for: done here, on the loop
      snapLog()->warn("snapshot: cannot start a thread ({}); working on the agent's loop",
                      e.what());
      work();
      then();
      return;
    }
    slots.waiting.push_front(Work{std::move(work), std::move(then), urgency});
  }
}

void SnapshotReplicator::startWaiting(Pool pool) {
  auto& slots = pools_[static_cast<size_t>(pool)];
  const size_t cap = pool == Pool::kFetch ? kMaxFetchThreads : kMaxThreads;
  while (!slots.waiting.empty() && slots.running < cap) {
    Work next = std::move(slots.waiting.front());
    slots.waiting.pop_front();
    const size_t running = slots.running;
    offLoop(std::move(next.work), std::move(next.then), next.urgency, pool);
    if (slots.running == running) return;  // it could not start either (put back): later
  }
}

void SnapshotReplicator::syncRound(const RoundInfo& round, RendezvousService& service,
                                   std::function<void()> done) {
  if (sync_done_) {  // a previous round's sync is superseded: hand that round on as it is
    auto old = std::move(sync_done_);
    sync_done_ = nullptr;
    old();
  }
  const uint64_t generation = ++sync_generation_;
  round_ = static_cast<uint64_t>(round.round);
  nodes_known_ = false;  // announcements wait for this round's holdings (onAnnounce)
  unanswering_.clear();  // this round's nodes are tried afresh
  replica_.retryGivenUp();
  replica_.setSelfIndex(round.group_rank);
  const int nodes = static_cast<int>(round.local_world_sizes.size());
  const std::string prefix = "snapshot/" + std::to_string(round.round) + "/";
  std::vector<std::string> keys;
  for (int i = 0; i < nodes; ++i) keys.push_back(prefix + std::to_string(i));
  const auto started = std::chrono::steady_clock::now();
  auto finish = [this, generation, done = std::move(done), started]() mutable {
    if (generation != sync_generation_) return;
    sync_done_ = [done = std::move(done), started] {
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      snapLog()->debug("snapshot: directory in sync after {:.3f} s", secs);
      done();
    };
    pump();
  };
  // What the workers wrote just before the round ended (a checkpoint saved, then a failure) is
  // versioned first, so that the holdings published say so and no node starts without it.
  const Duration versioned_within =
      std::min<Duration>(kVersionedWithin, options_.holdings_timeout / 2);
  whenQuiet(Quiet::kVersioned, Duration::zero(), versioned_within,
            [this, &service, prefix, keys, generation, me = round.group_rank,
             finish = std::move(finish)]() mutable {
              if (generation != sync_generation_) return;
              publishHoldings(service, prefix, keys, generation, me, std::move(finish));
            });
}

void SnapshotReplicator::publishHoldings(RendezvousService& service, const std::string& prefix,
                                         const std::vector<std::string>& keys, uint64_t generation,
                                         int me, std::function<void()> finish) {
  service.kvSet(
      prefix + std::to_string(me), encodeHoldings(endpoint_, replica_.heldList()), {},
      [this, &service, keys, generation, me, finish = std::move(finish)](Status st) mutable {
        if (generation != sync_generation_) return;
        if (!st.isOk()) {
          snapLog()->warn("snapshot: cannot publish this node's holdings: {}", st.message());
          finish();
          return;
        }
        service.kvWait(keys, options_.holdings_timeout, {},
                       [this, generation, me, finish = std::move(finish)](
                           StatusOr<std::vector<std::string>> values) mutable {
                         if (generation != sync_generation_) return;
                         if (!values.isOk()) {
                           snapLog()->warn(
                               "snapshot: the other nodes' holdings did not arrive ({}); "
                               "starting with what this node holds",
                               values.status().message());
                           nodesKnown();  // those of the round before, if any
                           finish();
                           return;
                         }
                         nodes_.assign(values->size(), "");
                         self_rank_ = me;
                         const auto now = std::chrono::steady_clock::now();
                         for (size_t i = 0; i < values->size(); ++i) {
                           auto h = decodeHoldings((*values)[i]);
                           if (!h.isOk()) {
                             snapLog()->warn("snapshot: node {}: {}", i, h.status().message());
                             continue;
                           }
                           nodes_[i] = h->first;
                           if (static_cast<int>(i) == me) continue;
                           for (const auto& v : h->second) {
                             if (replica_.shouldInstall(v) && tookHolder(v, h->first)) {
                               auto& heard = first_heard_[v.name];
                               if (heard.first != v.version) heard = {v.version, now};
                             }
                           }
                         }
                         dropGoneSources(nodes_);
                         nodesKnown();
                         finish();
                       });
      });
}

void SnapshotReplicator::nodesKnown() {
  nodes_known_ = true;
  auto waiting = std::move(unverified_);
  unverified_.clear();
  for (const auto& u : waiting) onAnnounce(u.version, u.source, u.origin);
}

bool SnapshotReplicator::eventsQueued() const {
  int queued = 0;
  return inotify_ && ::ioctl(inotify_->native_handle(), FIONREAD, &queued) == 0 && queued > 0;
}

bool SnapshotReplicator::isQuiet(Quiet level) const {
  const bool versioned =
      !hashing_ && hash_queue_.empty() && !renamed_away_.nextDue() && !eventsQueued();
  if (level == Quiet::kVersioned || !versioned) return versioned;
  const bool replicated = !replica_.busy() && announcing_ == 0;
  if (level == Quiet::kReplicated || !replicated) return replicated;
  return server_->activeStreams() == 0;
}

void SnapshotReplicator::whenQuiet(Quiet level, Duration grace, Duration bound,
                                   std::function<void()> done) {
  auto timer = std::make_shared<boost::asio::steady_timer>(io_);  // one per wait: they may overlap
  const auto deadline = std::chrono::steady_clock::now() + bound;
  auto quiet_since = std::make_shared<std::optional<TimePoint>>();
  auto check = std::make_shared<std::function<void()>>();
  *check = [this, level, grace, bound, deadline, quiet_since, timer, done = std::move(done),
            check] {
    const auto now = std::chrono::steady_clock::now();
    const bool quiet = isQuiet(level);
    if (!quiet) {
      quiet_since->reset();
    } else if (!*quiet_since) {
      *quiet_since = now;
    }
    if ((*quiet_since && now - **quiet_since >= grace) || now >= deadline) {
      if (!quiet) {
        snapLog()->warn(
            level == Quiet::kVersioned
                ? "snapshot: files written here are still being looked at after {:.1f} s; "
                  "going on without waiting for them"
                : "snapshot: stopping with transfers still under way",
            std::chrono::duration<double>(bound).count());
      }
      auto d = done;
      *check = nullptr;  // breaks the cycle
      d();
      return;
    }
    timer->expires_after(std::chrono::milliseconds(20));
    timer->async_wait([check](const boost::system::error_code& ec) {
      if (!ec && *check) (*check)();
    });
  };
  (*check)();
}

void SnapshotSyncClient::exitBarrier(Duration timeout, StatusCallback done) {
  const auto start = std::chrono::steady_clock::now();
  replicator_.whenQuiet(SnapshotReplicator::Quiet::kReplicated, Duration::zero(), timeout / 2,
                        [this, start, timeout, done = std::move(done)]() mutable {
                          const auto spent = std::chrono::steady_clock::now() - start;
                          inner_.exitBarrier(std::max<Duration>(timeout - spent, Duration::zero()),
                                             std::move(done));
                        });
}

void SnapshotSyncClient::shutdown(bool succeeded, bool left, std::function<void()> done) {
  if (!succeeded) {
    // A failed or stopped job (SIGTERM, a Slurm requeue) still records what its workers wrote
    // last, often the checkpoint written on that very signal: unrecorded, it would count as
    // version 0 when the job starts again, and an older version another node holds would be
    // fetched over it.
    replicator_.whenQuiet(SnapshotReplicator::Quiet::kVersioned, Duration::zero(), kVersionedWithin,
                          [this, succeeded, left, done = std::move(done)]() mutable {
                            inner_.shutdown(succeeded, left, std::move(done));
                          });
    return;
  }
  replicator_.whenQuiet(SnapshotReplicator::Quiet::kServed, std::chrono::seconds(1),
                        std::chrono::seconds(20),
                        [this, succeeded, left, done = std::move(done)]() mutable {
                          inner_.shutdown(succeeded, left, std::move(done));
                        });
}

void SnapshotSyncClient::nextRound(RoundCallback done) {
  inner_.nextRound([this, done = std::move(done)](StatusOr<RoundInfo> round) mutable {
    if (!round.isOk()) {
      done(std::move(round));
      return;
    }
    RoundInfo r = *round;
    replicator_.syncRound(r, service_, [done = std::move(done), r]() mutable { done(r); });
  });
}

}  // namespace ddprun::agent
