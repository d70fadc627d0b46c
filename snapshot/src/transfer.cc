// The transport's client side: announcements, fetches (on helper threads per range, with a stall
// watch and a writer thread), local copies, and hashing (a helper for the second half).
#include "ddprun/snapshot/transfer.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/sync_stream.h>
#include <malloc.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <mutex>
#include <sstream>
#include <system_error>
#include <thread>
#include <utility>

#include "ddprun/common/block_cache.h"
#include "ddprun/common/crc32.h"
#include "ddprun/common/strings.h"
#include "ddprun/common/thread_annotations.h"
#include "wire.h"

namespace ddprun::snapshot {

namespace {

// CRC-32 of the bytes from `begin` up to `end` or the end of the file, whichever comes first.
StatusOr<std::pair<uint64_t, uint32_t>> crc32OfPart(int fd, uint64_t begin, uint64_t end) {
  CachedBlock buf(BlockCache::transfers());
  if (!buf) return Status(StatusCode::kResourceExhausted, "no memory for a buffer to hash into");
  uint32_t crc = 0;
  uint64_t at = begin;
  while (at < end) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(buf.size(), end - at));
    ssize_t n = ::pread(fd, buf.get(), want, static_cast<off_t>(at));
    if (n < 0) {
      if (errno == EINTR) continue;
      return internalError("cannot read: " + errnoText(errno));
    }
    if (n == 0) break;
    crc = crc32Update(crc, buf.get(), static_cast<size_t>(n));
    at += static_cast<uint64_t>(n);
  }
  return std::make_pair(at - begin, crc);
}

#ifdef __GLIBC__
// What warmHeapForFetches() adds to the heap: what a fetch's receive window admits (8 MiB a
// stream, two streams) and some.
constexpr size_t kWarmHeap = 24 << 20;

// Grows the heap by `bytes`, populated: pieces below M_MMAP_THRESHOLD, faulted in, then freed
// back into the heap's top (the last one freed joins them all to it).
void warmHeap(size_t bytes) {
  constexpr size_t kPiece = 1 << 20;
  std::vector<void*> pieces;
  pieces.reserve(bytes / kPiece);
  for (size_t got = 0; got < bytes; got += kPiece) {
    void* p = std::malloc(kPiece);
    if (p == nullptr) break;
    pieces.push_back(p);
    if (!populatePages(p, kPiece)) break;  // a kernel that cannot: leave it to the faults
  }
  for (void* p : pieces) std::free(p);
}
#endif

}  // namespace

void tuneAllocatorForTransfers() {
#ifdef __GLIBC__
  ::mallopt(M_MMAP_THRESHOLD, 8 << 20);
  ::mallopt(M_TRIM_THRESHOLD, 64 << 20);
  // One heap for every thread (taking effect for threads that have not allocated yet): each of
  // gRPC's threads otherwise grows a heap of its own to what the receive window admits, and a
  // process's first fetch faulted in every one (a fresh agent fetching 100 MB: 12.8-13.6k page
  // faults, 9.8-10.2k with one heap, and a fifth less CPU).
  ::mallopt(M_ARENA_MAX, 1);
#endif
}

void warmHeapForFetches() {
#ifdef __GLIBC__
  static std::once_flag warmed;
  std::call_once(warmed, [] { warmHeap(kWarmHeap); });
#endif
}

StatusOr<std::pair<uint64_t, uint32_t>> crc32OfFile(int fd) {
  // A large file is read in two halves at once (reading from the page cache and the CRC both
  // take CPU: 1 GB took 0.23-0.27 s on one core here).
  struct stat st {};
  const uint64_t size =
      ::fstat(fd, &st) == 0 && st.st_size > 0 ? static_cast<uint64_t>(st.st_size) : 0;
  if (size < (64 << 20)) return crc32OfPart(fd, 0, UINT64_MAX);
  const uint64_t half = size / 2;
  std::future<StatusOr<std::pair<uint64_t, uint32_t>>> second;
  try {
    second =
        std::async(std::launch::async, [fd, half] { return crc32OfPart(fd, half, UINT64_MAX); });
  } catch (const std::system_error&) {  // no thread to be had (RLIMIT_NPROC): all of it here
    return crc32OfPart(fd, 0, UINT64_MAX);
  }
  auto first = crc32OfPart(fd, 0, half);
  auto rest = second.get();
  if (!first.isOk()) return first.status();
  if (!rest.isOk()) return rest.status();
  if (first->first < half) return first;  // shrank below the middle since fstat
  return std::make_pair(first->first + rest->first,
                        crc32Combine(first->second, rest->second, rest->first));
}

Status announceSnapshot(const SnapshotPeer& peer, const SnapshotFile& file,
                        const std::string& source, const std::string& origin, Duration timeout) {
  auto stub = spb::SnapshotReplication::NewStub(channelTo(peer, 0));
  grpc::ClientContext ctx;
  addToken(ctx, peer);
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::duration_cast<std::chrono::system_clock::duration>(timeout));
  spb::AnnounceRequest req;
  req.set_run_id(peer.run_id);
  req.set_source(source);
  req.set_origin(origin);
  auto* f = req.mutable_file();
  f->set_name(file.name);
  f->set_version(file.version);
  f->set_size(file.size);
  f->set_crc32(file.crc32);
  f->set_crc32_pending(file.crc32_pending);
  f->set_deleted(file.deleted);
  f->set_moved_from(file.moved_from);
  f->set_moved_from_version(file.moved_from_version);
  f->set_moved_to(file.moved_to);
  spb::AnnounceResponse resp;
  const Status st = fromGrpc(stub->Announce(&ctx, req, &resp));
  if (st.isOk()) return st;
  return Status(st.code(),
                statusCodeName(st.code()) + std::string(": ") + quotePeerText(st.message()));
}

namespace {

// What a peer answered, as this node tells it: the peer named, its text escaped and cut (it may
// hold anything: 100 KB, terminal escapes). A holder's RESOURCE_EXHAUSTED (too many streams, no
// memory) is its own state, not this node's disk: UNAVAILABLE, so the fetch is tried again
// (from the next holder) rather than given up as a local lack of space. Other codes stay.
Status fromPeer(const SnapshotPeer& peer, const Status& st) {
  if (st.isOk()) return st;
  const std::string text = quotePeerText(st.message());
  if (st.code() == StatusCode::kResourceExhausted) {
    return Status(StatusCode::kUnavailable,
                  peer.endpoint + " is out of resources (RESOURCE_EXHAUSTED): " + text);
  }
  return Status(st.code(), peer.endpoint + " answered " + statusCodeName(st.code()) + ": " + text);
}

// The receiving end of one fetch: the temp file, removed unless the whole version arrived.
class TempFile {
 public:
  explicit TempFile(std::string path) : path_(std::move(path)) {}
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!kept_) ::unlink(path_.c_str());
  }
  Status create() {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ < 0) {
      kept_ = true;  // not ours to remove
      return internalError("cannot create " + path_ + ": " + errnoText(errno));
    }
    return Status::ok();
  }
  int fd() const { return fd_; }
  Status finish() {
    if (::fsync(fd_) != 0) return internalError("cannot fsync " + path_ + ": " + errnoText(errno));
    if (::close(fd_) != 0) {
      fd_ = -1;
      return internalError("cannot close " + path_ + ": " + errnoText(errno));
    }
    fd_ = -1;
    kept_ = true;
    return Status::ok();
  }

 private:
  std::string path_;
  int fd_ = -1;
  bool kept_ = false;
};

// Writes a fetched version sequentially. Large files go to disk with O_DIRECT, through two
// page-aligned blocks of BlockCache::transfers() (present in memory, kept between fetches): one is
// written on a helper thread while the fetch fills the other, so the disk's time overlaps the
// receiving. A fetched version is read once by the workers that resume from it and served to peers,
// so caching it on the way in only takes memory from the training node, and filling fresh page
// cache is itself slow on some hosts (this 2-core VM: 1 GB buffered took 2.7 s plus a 0.4 s fsync,
// with O_DIRECT 0.6-0.7 s). Falls back to buffered writes where the file system refuses O_DIRECT
// (the fcntl fails) or an aligned direct write (EINVAL); the tail that does not fill a whole block
// is always written buffered. A relay's fetch, which reads what it writes back to serve it on,
// writes buffered (kRelayChunk).
// Threading: one thread calls append/finish; at most one buffer write runs on the helper.
class SequentialWriter {
 public:
  static constexpr size_t kBlock = 4096;
  static constexpr size_t kBuffer = 4 << 20;        // a multiple of kBlock
  static constexpr uint64_t kDirectFrom = 8 << 20;  // smaller files: buffered

  // Writes `size` bytes at [at, at + size) of `fd`; `at` a multiple of kBlock. Without `direct`,
  // buffered whatever the size.
  SequentialWriter(int fd, uint64_t at, uint64_t size, bool direct = true)
      : fd_(fd), offset_(at), durable_(at) {
    if (size < kDirectFrom || !direct || BlockCache::transfers().blockBytes() < kBuffer) return;
    for (auto& b : buffers_) {
      b.reset(BlockCache::transfers().take());  // page-aligned, as O_DIRECT needs
      if (!b) return;
    }
    const int flags = ::fcntl(fd_, F_GETFL);
    direct_ = flags >= 0 && ::fcntl(fd_, F_SETFL, flags | O_DIRECT) == 0;
  }
  ~SequentialWriter() {
    if (pending_.valid()) pending_.wait();  // the buffer and the descriptor outlive the write
  }

  // Appends `n` bytes; errno of a failed write (ENOSPC, EIO, ...) in the returned value, else 0.
  int append(const char* data, size_t n) {
    if (!direct_) {
      const int err = writeAll(fd_, data, n, offset_);
      offset_ += n;
      if (err == 0) durable_ = offset_;
      return err;
    }
    while (n > 0) {
      const size_t take = std::min(n, kBuffer - filled_);
      std::memcpy(buffers_[current_].get() + filled_, data, take);
      filled_ += take;
      data += take;
      n -= take;
      if (filled_ == kBuffer) {
        if (const int err = collect()) return err;
        const char* full = buffers_[current_].get();
        const uint64_t at = offset_;
        try {
          pending_ = std::async(std::launch::async,
                                [this, full, at] { return writeBlocks(full, kBuffer, at); });
        } catch (const std::system_error&) {  // no thread to be had: written here, then
          if (const int err = writeBlocks(full, kBuffer, at)) return err;
          durable_ = at + kBuffer;
        }
        offset_ += kBuffer;
        pending_end_ = offset_;
        current_ ^= 1;
        filled_ = 0;
      }
    }
    return 0;
  }

  // Writes what is buffered: the whole blocks directly, the rest buffered. 0 or an errno.
  int finish() {
    if (!direct_) return 0;
    const int err = finishDirect();
    if (err == 0) durable_ = offset_;
    return err;
  }

  // Where the bytes written so far end: the file holds everything before it.
  uint64_t durable() const { return durable_; }

 private:
  int finishDirect() {
    if (const int err = collect()) return err;
    const char* last = buffers_[current_].get();
    const size_t whole = filled_ / kBlock * kBlock;
    if (whole > 0) {
      if (const int err = writeBlocks(last, whole, offset_)) return err;
    }
    stopDirect(fd_);
    const int err = writeAll(fd_, last + whole, filled_ - whole, offset_ + whole);
    offset_ += filled_;
    filled_ = 0;
    return err;
  }

  // The helper's write of the buffer before: its errno, or 0.
  int collect() {
    if (!pending_.valid()) return 0;
    const int err = pending_.get();
    if (err == 0) durable_ = pending_end_;
    return err;
  }

  // `n` (a multiple of kBlock) bytes at `at`, directly; buffered from here on if the device
  // wants another alignment.
  int writeBlocks(const char* data, size_t n, uint64_t at) {
    int err = writeAll(fd_, data, n, at);
    if (err == EINVAL) {
      stopDirect(fd_);
      err = writeAll(fd_, data, n, at);
    }
    return err;
  }

  static void stopDirect(int fd) {
    const int flags = ::fcntl(fd, F_GETFL);
    if (flags >= 0 && (flags & O_DIRECT) != 0) (void)::fcntl(fd, F_SETFL, flags & ~O_DIRECT);
  }

  static int writeAll(int fd, const char* data, size_t n, uint64_t at) {
    while (n > 0) {
      const ssize_t w = ::pwrite(fd, data, n, static_cast<off_t>(at));
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) return errno;
      if (w == 0) return EIO;
      data += w;
      n -= static_cast<size_t>(w);
      at += static_cast<uint64_t>(w);
    }
    return 0;
  }

  struct Free {
    void operator()(char* p) const { BlockCache::transfers().give(p); }
  };
  int fd_;
  bool direct_ = false;
  std::unique_ptr<char, Free> buffers_[2];
  int current_ = 0;           // the buffer being filled
  size_t filled_ = 0;         // bytes in it
  uint64_t offset_;           // where the current buffer's first byte lands
  uint64_t durable_;          // see durable()
  uint64_t pending_end_ = 0;  // where the other buffer's write ends
  std::future<int> pending_;  // the other buffer's write, if one runs
};

Status noSpace(const SnapshotFile& file, const std::string& dir, uint64_t free_bytes) {
  return Status(StatusCode::kResourceExhausted,
                "no space for " + file.name + " version " + versionText(file.version) + " in " +
                    dir + ": needs " + std::to_string(file.size) + " bytes, " +
                    std::to_string(free_bytes) + " free");
}

std::string dirOf(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

// A write of `file`'s temp file that failed with `err`: no space (naming the bytes), or why.
Status writeFailure(const SnapshotFile& file, const std::string& temp_path, int err) {
  return err == ENOSPC || err == EDQUOT
             ? noSpace(file, dirOf(temp_path), 0)
             : internalError("cannot write " + temp_path + ": " + errnoText(err));
}

// Ranges of at least this size get a stream of their own (a multiple of SequentialWriter::kBuffer,
// so that every range but the last starts and ends on a block).
constexpr uint64_t kRangeMin = 32 << 20;

// A fetch that serves its version on as it arrives (a relay) asks for chunks of this size: the
// nodes below it get each chunk only once it is written and checked, so each relay adds about one
// chunk's time. Between hosts on 1 Gbit/s links (100 MB, 8 hosts in a chain) 4 MiB chunks took
// 1.74x one copy, 1 MiB 1.37x. A relay writes through the page cache, not O_DIRECT: it reads
// every byte back to serve it on, from the cache then rather than from the disk (on loopback,
// 4 nodes sharing one disk, 100 MB: 0.37 s against 0.53 s).
constexpr size_t kRelayChunk = 1 << 20;

// The streams of one fetch: the first that fails cancels the others, and so does `cancel`.
class FetchAbort {
 public:
  explicit FetchAbort(FetchCancel* cancel) : cancel_(cancel) {
    if (cancel_ != nullptr) subscription_ = cancel_->subscribe([this] { fail(); });
  }
  ~FetchAbort() {
    if (cancel_ != nullptr) cancel_->unsubscribe(subscription_);
  }
  FetchAbort(const FetchAbort&) = delete;
  FetchAbort& operator=(const FetchAbort&) = delete;
  // False once the fetch is cancelled or failed; else `ctx` is cancelled with them until left.
  bool enter(grpc::ClientContext* ctx) {
    MutexLock lock(mu_);
    if (failed_) return false;
    contexts_.push_back(ctx);
    return true;
  }
  void leave(grpc::ClientContext* ctx) {
    MutexLock lock(mu_);
    contexts_.erase(std::remove(contexts_.begin(), contexts_.end(), ctx), contexts_.end());
  }
  void fail() {
    MutexLock lock(mu_);
    failed_ = true;
    for (auto* ctx : contexts_) ctx->TryCancel();
  }
  bool stopped() const { return failed_.load(); }

  // A chunk arrived (any stream of the fetch).
  void progress() { last_progress_ = nowNs(); }
  // Fails the fetch, `why` being its cause, when nothing arrived for `bound` (StallWatch).
  bool stalledFor(Duration bound, const Status& why) {
    if (nowNs() - last_progress_.load() < std::chrono::nanoseconds(bound).count()) return false;
    {
      MutexLock lock(mu_);
      if (!stall_) stall_ = why;
    }
    fail();
    return true;
  }
  // Why the fetch stalled, if it did.
  std::optional<Status> stalled() {
    MutexLock lock(mu_);
    return stall_;
  }

 private:
  static int64_t nowNs() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  FetchCancel* cancel_;
  uint64_t subscription_ = 0;
  Mutex mu_;
  std::atomic<bool> failed_{false};
  std::vector<grpc::ClientContext*> contexts_ GUARDED_BY(mu_);
  std::atomic<int64_t> last_progress_{nowNs()};
  std::optional<Status> stall_ GUARDED_BY(mu_);
};

// Ends a fetch whose source sent nothing for the peer's stall_timeout: a thread that looks a few
// times per period, started for the fetch and joined at its end. Without a thread to be had, the
// fetch's streams get the deadline a stall would have given a whole transfer before
// (`fallback()`).
class StallWatch {
 public:
  StallWatch(const SnapshotPeer& peer, FetchAbort* abort) {
    const Duration bound = std::max<Duration>(peer.stall_timeout, std::chrono::milliseconds(10));
    std::ostringstream secs;
    secs << std::chrono::duration<double>(bound).count();
    const Status why(StatusCode::kDeadlineExceeded, "no byte from " + peer.endpoint + " for " +
                                                        secs.str() +
                                                        " s (--snapshot-limits stall_timeout)");
    const Duration step = std::min<Duration>(bound / 4, std::chrono::seconds(1));
    try {
      thread_ = std::thread([this, abort, bound, why, step] {
        MutexLock lock(mu_);
        while (!done_) {
          cv_.wait_for(mu_, step);
          if (!done_ && abort->stalledFor(bound, why)) return;
        }
      });
    } catch (const std::system_error&) {
      fallback_ = true;
    }
  }
  ~StallWatch() {
    {
      MutexLock lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  bool fallback() const { return fallback_; }

 private:
  Mutex mu_;
  std::condition_variable_any cv_;
  bool done_ GUARDED_BY(mu_) = false;
  bool fallback_ = false;
  std::thread thread_;
};

// One stream of a fetch: bytes [begin, end) of the version, written at the same offsets.
struct RangeFetch {
  uint64_t begin = 0;
  uint64_t end = 0;
  Status status;
  uint32_t crc = 0;                  // of the range, when status is OK
  std::optional<uint32_t> file_crc;  // the whole file's, as the source sent it
};

void fetchRange(const SnapshotPeer& peer, const SnapshotFile& file, const std::string& temp_path,
                size_t lane, RangeFetch* range, FetchAbort* abort, ArrivingFile* arriving,
                bool total_deadline) {
  auto fail = [&](Status st) {
    range->status = std::move(st);
    abort->fail();
  };
  // A descriptor of its own: O_DIRECT is a flag of the open file, and each range sets its own.
  const int fd = ::open(temp_path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return fail(internalError("cannot open " + temp_path + ": " + errnoText(errno)));
  OpenFile closer(fd);
  SequentialWriter writer(fd, range->begin, range->end - range->begin,
                          /*direct=*/arriving == nullptr);

  auto channel = channelTo(peer, lane);
  grpc::ClientContext ctx;
  addToken(ctx, peer);
  // A stuck source must not hold the node forever: StallWatch ends a fetch that receives nothing
  // for the stall timeout, whatever the size. Only without it, a deadline for the whole.
  if (total_deadline) {
    const auto allowed = std::chrono::seconds(60 + static_cast<int64_t>(file.size / (10 << 20)));
    ctx.set_deadline(std::chrono::system_clock::now() + allowed);
  }
  if (!abort->enter(&ctx)) {
    // Ended before this stream began: by a stall of the fetch's first streams (nothing in time,
    // the connection included; the fetch is tried again), else by a failure or a cancel the others
    // report.
    range->status =
        abort->stalled().value_or(Status(StatusCode::kCancelled, "the fetch was cancelled"));
    return;
  }
  spb::FetchRequest req;
  req.set_run_id(peer.run_id);
  req.set_name(file.name);
  req.set_version(file.version);
  req.set_offset(range->begin);
  req.set_length(range->end - range->begin);
  req.set_size(file.size);
  req.set_crc32(file.crc32);
  req.set_crc32_pending(file.crc32_pending);
  if (arriving != nullptr) req.set_chunk_bytes(kRelayChunk);
  // The generated stub's call, reading each message as gRPC's slices rather than a Chunk.
  const grpc::internal::RpcMethod method(kFetchMethod, grpc::internal::RpcMethod::SERVER_STREAMING,
                                         channel);
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(channel.get(), method, &ctx,
                                                                    req));
  grpc::ByteBuffer message;
  std::vector<grpc::Slice> slices;
  uint64_t offset = range->begin;
  uint32_t crc = 0;
  Status failure;
  while (reader->Read(&message)) {
    abort->progress();
    if (abort->stopped()) {
      failure = Status(StatusCode::kCancelled, "the fetch was cancelled");
      break;
    }
    slices.clear();
    ChunkView chunk;
    if (!message.Dump(&slices).ok() || !ChunkReader(slices).read(&chunk)) {
      failure = Status(StatusCode::kDataLoss, "a chunk after offset " + std::to_string(offset) +
                                                  " is not a Chunk message");
      break;
    }
    if (chunk.offset != offset) {
      failure = Status(StatusCode::kDataLoss, "a chunk at offset " + std::to_string(chunk.offset) +
                                                  " does not continue the file (expected " +
                                                  std::to_string(offset) + ")");
      break;
    }
    if (chunk.size > range->end - offset) {
      failure = Status(StatusCode::kDataLoss,
                       "a chunk of " + std::to_string(chunk.size) + " bytes at offset " +
                           std::to_string(offset) + " goes past the end of the bytes asked for (" +
                           std::to_string(range->end) + "; the version has " +
                           std::to_string(file.size) + ")");
      break;
    }
    // Written as it is checked: a chunk that fails its CRC-32 fails the fetch, and a failed
    // fetch's temp file is removed, so its bytes never reach a version.
    uint32_t chunk_crc = 0;
    for (const auto& [data, n] : chunk.pieces) {
      chunk_crc = crc32Update(chunk_crc, data, n);
      if (const int err = writer.append(data, n)) {
        failure = writeFailure(file, temp_path, err);
        break;
      }
    }
    if (!failure.isOk()) break;
    if (chunk_crc != chunk.crc32) {
      failure = Status(StatusCode::kDataLoss, "the chunk at offset " + std::to_string(offset) +
                                                  " fails its CRC-32 (corrupted in flight)");
      break;
    }
    if (chunk.file_crc32) range->file_crc = chunk.file_crc32;
    // The range's CRC-32 from the chunks' (one pass over the bytes, not two).
    crc = crc32Combine(crc, chunk_crc, chunk.size);
    offset += chunk.size;
    // Served on from here: what is both in the file and checked.
    if (arriving != nullptr) arriving->advance(range->begin, std::min(offset, writer.durable()));
  }
  if (!failure.isOk()) ctx.TryCancel();
  Status st = fromPeer(peer, fromGrpc(reader->Finish()));
  abort->leave(&ctx);
  if (auto stalled = abort->stalled()) return fail(*stalled);
  if (!failure.isOk()) return fail(failure);
  if (!st.isOk()) return fail(st);
  if (offset != range->end) {
    return fail(Status(StatusCode::kDataLoss,
                       "the stream ended after " + std::to_string(offset - range->begin) + " of " +
                           std::to_string(range->end - range->begin) + " bytes of its range"));
  }
  if (const int err = writer.finish()) return fail(writeFailure(file, temp_path, err));
  range->crc = crc;
  if (arriving != nullptr) arriving->advance(range->begin, range->end);
}

}  // namespace

namespace {

// Creates the temp file a version is received into, once the disk has the space for it
// (RESOURCE_EXHAUSTED naming the bytes when it has not), and hands it to `arriving` for serving
// on.
Status prepareTemp(const SnapshotFile& file, TempFile& out, const std::string& temp_path,
                   ArrivingFile* arriving) {
  const std::string dir = dirOf(temp_path);
  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) == 0) {
    const uint64_t free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    if (free_bytes < file.size) return noSpace(file, dir, free_bytes);
  }
  // No space is reserved for the whole version up front (a holder that announces a large
  // version and stalls would hold it from everyone else on this disk): the writes take it as the
  // bytes arrive, and one that finds none fails the fetch as RESOURCE_EXHAUSTED.
  DDPRUN_RETURN_IF_ERROR(out.create());
  if (arriving != nullptr) {  // served on as it arrives: through a descriptor of its own
    const int fd = ::open(temp_path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return internalError("cannot open " + temp_path + ": " + errnoText(errno));
    arriving->setData(std::make_shared<OpenFile>(fd));
  }
  return Status::ok();
}

Status fetchInto(const SnapshotPeer& peer, const SnapshotFile& file, const std::string& temp_path,
                 FetchCancel* cancel, size_t streams_at_most, uint32_t* crc32_out,
                 ArrivingFile* arriving) {
  TempFile out(temp_path);
  DDPRUN_RETURN_IF_ERROR(prepareTemp(file, out, temp_path, arriving));

  // Large versions come over several streams at once, each a range of the file on a connection
  // of its own: one gRPC stream on loopback kept this 2-core host's CPUs only ~70 % busy.
  const uint64_t streams =
      std::clamp<uint64_t>(file.size / kRangeMin, 1, std::max<size_t>(streams_at_most, 1));
  const uint64_t step = (file.size / streams + SequentialWriter::kBuffer - 1) /
                        SequentialWriter::kBuffer * SequentialWriter::kBuffer;
  std::vector<RangeFetch> ranges;
  for (uint64_t at = 0, i = 0; i < streams && (at < file.size || i == 0); ++i, at += step) {
    RangeFetch r;
    r.begin = at;
    r.end = i + 1 == streams ? file.size : std::min(file.size, at + step);
    if (arriving != nullptr) arriving->addRange(r.begin, r.end);
    ranges.push_back(std::move(r));
  }
  FetchAbort abort(cancel);
  std::vector<std::thread> helpers;
  size_t inline_from = ranges.size();  // ranges no helper thread could be started for
  {
    StallWatch watch(peer, &abort);
    const bool total = watch.fallback();
    for (size_t i = 1; i < ranges.size(); ++i) {
      try {
        helpers.emplace_back([&, i] {
          fetchRange(peer, file, temp_path, i + 1, &ranges[i], &abort, arriving, total);
        });
      } catch (const std::system_error&) {
        inline_from = i;
        break;
      }
    }
    fetchRange(peer, file, temp_path, 1, &ranges[0], &abort, arriving, total);
    for (size_t i = inline_from; i < ranges.size(); ++i) {
      fetchRange(peer, file, temp_path, i + 1, &ranges[i], &abort, arriving, total);
    }
    for (auto& t : helpers) t.join();
  }
  uint32_t crc = 0;
  // The first failure is the cause; the others are mostly the cancellations it caused.
  for (const auto& r : ranges) {
    if (!r.status.isOk() && r.status.code() != StatusCode::kCancelled) return r.status;
  }
  for (const auto& r : ranges) {
    if (!r.status.isOk()) return r.status;
    crc = crc32Combine(crc, r.crc, r.end - r.begin);
  }
  // What the content must hash to: the announced CRC-32, or for a version announced while it was
  // being hashed, the one the source sent with its last chunks (the writer's own hash of its
  // file, not of the bytes it sent).
  std::optional<uint32_t> expected;
  if (!file.crc32_pending) expected = file.crc32;
  for (const auto& r : ranges) {
    if (!r.file_crc) continue;
    if (expected && *expected != *r.file_crc) {
      return Status(StatusCode::kDataLoss,
                    "the source's CRC-32 of the whole version is not the announced one");
    }
    expected = r.file_crc;
  }
  if (!expected) {
    return Status(StatusCode::kDataLoss, "the source sent no CRC-32 for the whole version");
  }
  if (crc != *expected) {
    return Status(StatusCode::kDataLoss,
                  "the content does not match the announced CRC-32 (corrupt at the source)");
  }
  DDPRUN_RETURN_IF_ERROR(out.finish());
  if (crc32_out != nullptr) *crc32_out = crc;
  return Status::ok();
}

Status copyInto(const OpenFile& from, const SnapshotFile& file, const std::string& temp_path,
                FetchCancel* cancel, ArrivingFile* arriving) {
  if (file.crc32_pending) return internalError("a local copy needs the version's CRC-32");
  TempFile out(temp_path);
  DDPRUN_RETURN_IF_ERROR(prepareTemp(file, out, temp_path, arriving));
  if (arriving != nullptr) arriving->addRange(0, file.size);
  CachedBlock buf(BlockCache::transfers());
  if (!buf) return Status(StatusCode::kResourceExhausted, "no memory for a buffer to copy with");
  // Served on in relay-sized steps (each is written, and checked once the whole is).
  const size_t step = arriving != nullptr ? std::min(buf.size(), kRelayChunk) : buf.size();
  SequentialWriter writer(out.fd(), 0, file.size, /*direct=*/arriving == nullptr);
  uint32_t crc = 0;
  uint64_t at = 0;
  while (at < file.size) {
    if (cancel != nullptr && cancel->cancelled()) return cancel->why();
    const size_t want = static_cast<size_t>(std::min<uint64_t>(step, file.size - at));
    const ssize_t n = ::pread(from.fd(), buf.get(), want, static_cast<off_t>(at));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return internalError("cannot read the local copy: " + errnoText(errno));
    if (n == 0) {
      return Status(StatusCode::kDataLoss, "the local copy ends after " + std::to_string(at) +
                                               " of " + std::to_string(file.size) + " bytes");
    }
    crc = crc32Update(crc, buf.get(), static_cast<size_t>(n));
    if (const int err = writer.append(buf.get(), static_cast<size_t>(n))) {
      return writeFailure(file, temp_path, err);
    }
    at += static_cast<uint64_t>(n);
    if (arriving != nullptr) arriving->advance(0, writer.durable());
  }
  if (const int err = writer.finish()) return writeFailure(file, temp_path, err);
  if (crc != file.crc32) {
    return Status(StatusCode::kDataLoss, "the local copy does not match the version's CRC-32");
  }
  if (arriving != nullptr) arriving->advance(0, file.size);
  return out.finish();
}

}  // namespace

Status fetchSnapshot(const SnapshotPeer& peer, const SnapshotFile& file,
                     const std::string& temp_path, FetchCancel* cancel, size_t streams_at_most,
                     uint32_t* crc32_out, const std::shared_ptr<ArrivingFile>& arriving) {
  Status st = fetchInto(peer, file, temp_path, cancel, streams_at_most, crc32_out, arriving.get());
  if (!st.isOk() && cancel != nullptr && cancel->cancelled()) st = cancel->why();
  if (arriving && !st.isOk()) arriving->fail(st);
  return st;
}

Status copySnapshotLocally(const OpenFile& from, const SnapshotFile& file,
                           const std::string& temp_path, FetchCancel* cancel,
                           const std::shared_ptr<ArrivingFile>& arriving) {
  Status st = copyInto(from, file, temp_path, cancel, arriving.get());
  if (arriving && !st.isOk()) arriving->fail(st);
  return st;
}

}  // namespace ddprun::snapshot