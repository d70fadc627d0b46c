#include "jobs.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "ddprun/common/open_files.h"
#include "files.h"
#include "holdings.h"
#include "log.h"

namespace ddprun::snapshot {

namespace {

// Why a file a worker completed cannot be opened to be replicated.
std::string cannotOpen(const std::string& path, int err) {
  std::string out = "cannot open " + path + ": " + std::strerror(err);
  if (err == EMFILE || err == ENFILE) {
    out += " (the agent keeps one open file per replicated name; its limit is " +
           std::to_string(openFileLimit()) + ": raise the hard limit, ulimit -Hn)";
  }
  return out;
}

}  // namespace

LookResult lookAt(const Look& look, const std::string& path, Duration slow_hash) {
  LookResult r;
  std::this_thread::sleep_for(slow_hash);  // test hook (DDPRUN_SNAPSHOT_FAULT=slow-hash)
  // Regular files only: a symlink is not followed out of the directory, a FIFO does not block.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    r.looked.kind = err == ENOENT ? Looked::Kind::kGone : Looked::Kind::kUnopened;
    if (err != ENOENT) r.looked.why = cannotOpen(path, err);
    return r;
  }
  r.file = std::make_shared<OpenFile>(fd);
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    r.file.reset();
    r.looked.kind = Looked::Kind::kNotAFile;
    return r;
  }
  const FileId id = fileIdOf(st);
  r.looked.id = id;
  r.looked.size = id.size;
  auto isIt = [&id](const std::optional<FileId>& h) {
    return h && h->sameFile(id) && h->size == id.size;
  };
  if (isIt(look.held)) {
    r.looked.kind = Looked::Kind::kSame;  // e.g. a copy this node just renamed into place
  } else if (isIt(look.renamed)) {
    r.looked.kind = Looked::Kind::kRenamed;
  } else if (id.size >= look.hash_below) {
    r.looked.kind = Looked::Kind::kLarge;
  } else {
    r.to_hash = true;
  }
  return r;
}

void hashLooked(LookResult& r) {
  auto crc = crc32OfFile(r.file->fd());
  if (!crc.isOk()) {
    r.looked.kind = Looked::Kind::kUnreadable;
    r.looked.why = crc.status().message();
    return;
  }
  r.looked.kind = Looked::Kind::kHashed;
  r.looked.size = crc->first;
  r.looked.crc32 = crc->second;
}

StatusOr<uint32_t> hashServed(const OpenFile& file, uint64_t size, PendingCrc& pending) {
  StatusOr<uint32_t> crc = internalError("not hashed");
  auto hashed = crc32OfFile(file.fd());
  if (!hashed.isOk()) {
    crc = hashed.status();
  } else if (hashed->first != size) {
    crc = internalError("it changed size while it was hashed (" + std::to_string(size) + " -> " +
                        std::to_string(hashed->first) + " bytes)");
  } else {
    crc = hashed->second;
  }
  pending.set(crc);
  return crc;
}

Fetched runFetch(const FetchJob& job, const SnapshotTransfer& t) {
  Fetched out{t, Status::ok(), 0, job.temp, false};
  Status& status = out.status;
  const SnapshotFile& file = job.file;
  status = makeParentDirsUnder(job.dir, file.name);
  if (status.isOk() && job.local) {
    status = copySnapshotLocally(*job.local, file, job.temp, job.cancel.get());
    out.copied = status.isOk();
    out.crc32 = file.crc32;
    if (!status.isOk() && status.code() != StatusCode::kCancelled &&
        status.code() != StatusCode::kResourceExhausted) {
      snapLog()->warn("snapshot: copying {} from {} here failed: {}; fetching it from {}",
                      file.name, file.moved_from, status.message(), job.peer.endpoint);
      status = fetchSnapshot(job.peer, file, job.temp, job.cancel.get(), job.streams, &out.crc32);
    }
  } else if (status.isOk()) {
    status = fetchSnapshot(job.peer, file, job.temp, job.cancel.get(), job.streams, &out.crc32,
                           job.arriving);
  } else if (job.arriving) {
    job.arriving->fail(status);
  }
  // Set here, not on the loop: streams waiting for it must end even while the agent stops (its
  // server waits for them).
  if (job.pending) job.pending->set(status.isOk() ? StatusOr<uint32_t>(out.crc32) : status);
  return out;
}

}  // namespace ddprun::snapshot
