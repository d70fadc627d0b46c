#include "ddprun/rendezvous/snapshot_transfer.h"

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
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <system_error>
#include <thread>
#include <utility>

#include "convert.h"
#include "ddprun/common/block_cache.h"
#include "ddprun/common/crc32.h"
#include "ddprun/common/log.h"
#include "ddprun/common/log_throttle.h"
#include "ddprun/common/strings.h"
#include "ddprun/snapshot/v1/snapshot.grpc.pb.h"

namespace ddprun::rendezvous {

namespace spb = ::ddprun::snapshot::v1;

namespace {

bool sameSecret(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

std::string errnoText(int err) { return std::strerror(err); }

// As the proto says: (round << 32) | sequence, shown "round.sequence".
std::string versionText(uint64_t v) {
  return std::to_string(v >> 32) + "." + std::to_string(v & 0xffffffffu);
}

SnapshotFile fromProto(const spb::FileVersion& f) {
  SnapshotFile out{f.name(), f.version(), f.size(), f.crc32()};
  out.crc32_pending = f.crc32_pending();
  out.deleted = f.deleted();
  out.moved_from = f.moved_from();
  out.moved_from_version = f.moved_from_version();
  out.moved_to = f.moved_to();
  return normalizeAnnounced(std::move(out));
}

// The channels to other agents, kept between calls: a fetch on a fresh connection waited
// 5-18 ms for its first chunk, and every announcement paid a connection setup (2-9 ms). One
// channel per (peer, TLS trust, lane) keeps a connection of its own (a local subchannel pool): a
// fetch's parallel ranges use lanes 1..n, announcements lane 0. A channel that lost its
// connection is replaced rather than left to gRPC's reconnect backoff (a restarted peer would
// otherwise be refused at once for up to a second or more). Thread-safe.
class ChannelPool {
 public:
  std::shared_ptr<grpc::Channel> get(const SnapshotPeer& peer, size_t lane) {
    const std::string key =
        peer.endpoint + '\n' + std::to_string(lane) + '\n' + peer.security.tls_ca_pem;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = channels_.find(key);
    if (it != channels_.end()) {
      const auto state = it->second->GetState(false);
      if (state != GRPC_CHANNEL_TRANSIENT_FAILURE && state != GRPC_CHANNEL_SHUTDOWN) {
        return it->second;
      }
      channels_.erase(it);
    }
    if (channels_.size() >= kMaxChannels) channels_.erase(channels_.begin());  // any will do
    auto channel = create(peer);
    channels_.emplace(key, channel);
    return channel;
  }

 private:
  static constexpr size_t kMaxChannels = 256;

  static std::shared_ptr<grpc::Channel> create(const SnapshotPeer& peer) {
    convert::routeGrpcLogs();
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetMaxReceiveMessageSize(64 << 20);
    // Bulk transfer: large HTTP/2 frames and an 8 MiB receive window from the start (loopback and
    // LANs have the bandwidth; gRPC's defaults suit small messages). Not larger, and not grown by
    // BDP probes: what the window admits, gRPC's threads receive into fresh buffers ahead of the
    // fetch thread, which runs at background priority while workers train. With 32 MiB and
    // probes a receiving agent held tens of MiB per fetch and took 21-26k page faults and
    // 0.8-0.9 CPU-s for six 50 MB versions; with 8 MiB, 10-11k and 0.6 CPU-s, with the lag on
    // loopback unchanged within the disk's noise.
    args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 1 << 20);
    args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 8 << 20);
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    const auto creds = peer.security.tls_ca_pem.empty()
                           ? grpc::InsecureChannelCredentials()
                           : convert::channelTls(peer.security.tls_ca_pem);
    return grpc::CreateCustomChannel(peer.endpoint, creds, args);
  }

  std::mutex mu_;
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_;  // guarded by mu_
};

std::shared_ptr<grpc::Channel> channelTo(const SnapshotPeer& peer, size_t lane) {
  static ChannelPool* pool = new ChannelPool;  // never destroyed: used until the process exits
  return pool->get(peer, lane);
}

void addToken(grpc::ClientContext& ctx, const SnapshotPeer& peer) {
  if (!peer.security.token.empty()) {
    ctx.AddMetadata("authorization", "Bearer " + peer.security.token);
  }
}

// The chunks travel as ddprun.snapshot.v1.Chunk on the wire, but both ends build and read that
// encoding themselves, over the slices gRPC sends and receives: protobuf would copy each chunk's
// bytes into a message and out again (two of the four copies a fetch made of every byte).
constexpr char kFetchMethod[] = "/ddprun.snapshot.v1.SnapshotReplication/Fetch";
constexpr uint8_t kOffsetTag = (1 << 3) | 0;   // field 1, varint
constexpr uint8_t kDataTag = (2 << 3) | 2;     // field 2, length-delimited
constexpr uint8_t kCrcTag = (3 << 3) | 0;      // field 3, varint
constexpr uint8_t kFileCrcTag = (4 << 3) | 0;  // field 4, varint

size_t putVarint(uint8_t* out, uint64_t v) {
  size_t n = 0;
  while (v >= 0x80) {
    out[n++] = static_cast<uint8_t>(v | 0x80);
    v >>= 7;
  }
  out[n++] = static_cast<uint8_t>(v);
  return n;
}

// Buffers the server reads chunks into: blocks of the process's transfer cache (present in
// memory and reused, see BlockCache) for chunks of more than half a block, malloc for others
// (with many streams sharing the server's chunk budget, or a relay's 1 MiB chunks: a block would
// hold more memory than the chunk counts). gRPC sends a chunk from its buffer and lets go of it
// (the slice's destroy callback, on any thread) once sent, which may be long after OnWriteDone
// (a receiver that does not read): the buffer, and the bytes of the server's budget it took
// (SnapshotServer::Impl::reserve), are given back only then.
class ChunkBuffers {
 public:
  // A buffer of at least `bytes` bytes (nullptr when memory is short); give it back with put()
  // or slice(). One at a time: put() and slice() are of the last one taken.
  char* take(size_t bytes) {
    const size_t block = BlockCache::transfers().blockBytes();
    cached_ = bytes <= block && bytes * 2 > block;
    return cached_ ? BlockCache::transfers().take() : static_cast<char*>(std::malloc(bytes));
  }
  void put(char* b) const { (cached_ ? &giveBlock : &freeBuffer)(b); }
  // The first `n` bytes of `b` as a slice that gives `b` back, and `reserved` bytes to `budget`,
  // when gRPC drops it.
  grpc::Slice slice(char* b, size_t n, size_t reserved,
                    std::shared_ptr<std::atomic<uint64_t>> budget) const {
    auto* held = new Held{b, cached_, reserved, std::move(budget)};
    return grpc::Slice(b, n, &drop, held);
  }

 private:
  struct Held {
    char* data;
    bool cached;
    size_t reserved;
    std::shared_ptr<std::atomic<uint64_t>> budget;
  };
  static void drop(void* p) {
    auto* held = static_cast<Held*>(p);
    (held->cached ? &giveBlock : &freeBuffer)(held->data);
    *held->budget -= held->reserved;
    delete held;
  }
  static void giveBlock(void* b) { BlockCache::transfers().give(static_cast<char*>(b)); }
  static void freeBuffer(void* b) { std::free(b); }
  bool cached_ = false;
};

// One Chunk message: offset, then the data slice as it is, then the data's CRC-32 (and on a
// stream's last chunk the whole file's).
grpc::ByteBuffer encodeChunk(uint64_t offset, grpc::Slice data, uint32_t crc,
                             std::optional<uint32_t> file_crc) {
  uint8_t head[24];
  size_t h = 0;
  head[h++] = kOffsetTag;
  h += putVarint(head + h, offset);
  head[h++] = kDataTag;
  h += putVarint(head + h, data.size());
  uint8_t tail[16];
  size_t t = 0;
  tail[t++] = kCrcTag;
  t += putVarint(tail + t, crc);
  if (file_crc) {
    tail[t++] = kFileCrcTag;
    t += putVarint(tail + t, *file_crc);
  }
  const grpc::Slice slices[3] = {grpc::Slice(head, h), std::move(data), grpc::Slice(tail, t)};
  return grpc::ByteBuffer(slices, 3);
}

// A received Chunk, its data left where gRPC put it (a run of pieces of the message's slices).
struct ChunkView {
  uint64_t offset = 0;
  uint32_t crc32 = 0;
  std::optional<uint32_t> file_crc32;
  uint64_t size = 0;
  std::vector<std::pair<const char*, size_t>> pieces;
};

// Reads the protobuf encoding of a Chunk across the slices of one message. Proto3 leaves out
// fields that hold zero and allows any field order and unknown fields; all of that reads.
class ChunkReader {
 public:
  explicit ChunkReader(const std::vector<grpc::Slice>& slices) : slices_(slices) {}

  // False for anything that is not a Chunk (cut short, a Chunk field of another wire type, two
  // data fields, a group); fields it does not know are skipped, as protobuf does.
  bool read(ChunkView* out) {
    bool have_data = false;
    while (!atEnd()) {
      uint64_t key = 0;
      if (!varint(&key)) return false;
      const uint64_t field = key >> 3;
      const int type = static_cast<int>(key & 7);
      uint64_t value = 0;
      if (field == 1 && type == 0) {
        if (!varint(&out->offset)) return false;
      } else if (field == 3 && type == 0) {
        if (!varint(&value)) return false;
        out->crc32 = static_cast<uint32_t>(value);
      } else if (field == 4 && type == 0) {
        if (!varint(&value)) return false;
        out->file_crc32 = static_cast<uint32_t>(value);
      } else if (field == 2 && type == 2) {
        if (have_data || !varint(&out->size) || !take(out->size, &out->pieces)) return false;
        have_data = true;
      } else if (field >= 1 && field <= 4) {
        return false;  // a Chunk field with another wire type
      } else if (type == 0) {
        if (!varint(&value)) return false;
      } else if (type == 1 || type == 5) {
        if (!take(type == 1 ? 8 : 4, nullptr)) return false;
      } else if (type == 2) {
        if (!varint(&value) || !take(value, nullptr)) return false;
      } else {
        return false;  // groups: no Chunk has them
      }
    }
    return true;
  }

 private:
  bool atEnd() {
    while (slice_ < slices_.size() && at_ == slices_[slice_].size()) {
      ++slice_;
      at_ = 0;
    }
    return slice_ == slices_.size();
  }
  bool byte(uint8_t* b) {
    if (atEnd()) return false;
    *b = slices_[slice_].begin()[at_++];
    return true;
  }
  bool varint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b = 0;
      if (!byte(&b)) return false;
      *v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  }
  // The next `n` bytes, as pieces when `pieces` is given.
  bool take(uint64_t n, std::vector<std::pair<const char*, size_t>>* pieces) {
    while (n > 0) {
      if (atEnd()) return false;
      const size_t here = std::min<uint64_t>(n, slices_[slice_].size() - at_);
      if (pieces != nullptr) {
        pieces->emplace_back(reinterpret_cast<const char*>(slices_[slice_].begin()) + at_, here);
      }
      at_ += here;
      n -= here;
    }
    return true;
  }

  const std::vector<grpc::Slice>& slices_;
  size_t slice_ = 0;
  size_t at_ = 0;
};

}  // namespace

OpenFile::~OpenFile() {
  if (fd_ >= 0) ::close(fd_);
}

void PendingCrc::set(StatusOr<uint32_t> crc) {
  std::vector<std::function<void(const StatusOr<uint32_t>&)>> waiters;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (value_) return;
    value_ = std::move(crc);
    waiters.swap(waiters_);
  }
  for (auto& w : waiters) w(*value_);  // value_ never changes once set
}

void PendingCrc::whenKnown(std::function<void(const StatusOr<uint32_t>&)> then) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!value_) {
      waiters_.push_back(std::move(then));
      return;
    }
  }
  then(*value_);
}

void ArrivingFile::setData(std::shared_ptr<const OpenFile> data) {
  std::lock_guard<std::mutex> lock(mu_);
  data_ = std::move(data);
}

void ArrivingFile::addRange(uint64_t begin, uint64_t end) {
  std::lock_guard<std::mutex> lock(mu_);
  ranges_[begin] = Range{end, begin};
}

void ArrivingFile::advance(uint64_t begin, uint64_t reached) {
  std::vector<Waiter> ready;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ranges_.find(begin);
    if (it == ranges_.end() || reached <= it->second.reached) return;
    it->second.reached = std::min(reached, it->second.end);
    ready = takeReadyLocked();
  }
  for (auto& w : ready) w.then(Status::ok());
}

void ArrivingFile::fail(const Status& why) {
  std::vector<Waiter> ready;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_) return;
    failed_ = why;
    ready = takeReadyLocked();
  }
  for (auto& w : ready) w.then(why);
}

void ArrivingFile::whenAvailable(uint64_t offset, uint64_t n,
                                 std::function<void(const Status&)> then) {
  Status now;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_) {
      now = *failed_;
    } else if (!availableLocked(offset, offset + n)) {
      waiters_.push_back(Waiter{offset, offset + n, std::move(then)});
      return;
    }
  }
  then(now);
}

std::shared_ptr<const OpenFile> ArrivingFile::data() const {
  std::lock_guard<std::mutex> lock(mu_);
  return data_;
}

bool ArrivingFile::availableLocked(uint64_t offset, uint64_t end) const {
  if (!data_) return false;
  // The ranges that cover [offset, end), each far enough.
  auto it = ranges_.upper_bound(offset);
  if (it == ranges_.begin()) return false;
  --it;
  while (offset < end) {
    if (it == ranges_.end() || it->first > offset) return false;  // a gap: no range holds it
    if (it->second.reached < std::min(end, it->second.end)) return false;
    offset = it->second.end;
    ++it;
  }
  return true;
}

std::vector<ArrivingFile::Waiter> ArrivingFile::takeReadyLocked() {
  std::vector<Waiter> ready;
  auto ready_from = std::stable_partition(
      waiters_.begin(), waiters_.end(),
      [this](const Waiter& w) { return !failed_ && !availableLocked(w.offset, w.end); });
  std::move(ready_from, waiters_.end(), std::back_inserter(ready));
  waiters_.erase(ready_from, waiters_.end());
  return ready;
}

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

// ---------------------------------------------------------------------------------------------
// Server

// The address of a call's peer without its port ("ipv4:10.0.0.7:41234" -> "ipv4:10.0.0.7"):
// what the server's per-peer bounds and throttled warnings count by.
std::string peerAddress(const std::string& peer) {
  const auto colon = peer.rfind(':');
  const auto kind = peer.find(':');
  return colon == std::string::npos || colon == kind ? peer : peer.substr(0, colon);
}

struct SnapshotServer::Impl {
  SnapshotServerOptions options;
  std::unique_ptr<grpc::Service> service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::atomic<int> active_streams{0};
  std::mutex fault_mu;
  int faults_left = 0;  // guarded by fault_mu
  std::mutex log_mu;
  LogThrottle refused_log{std::chrono::seconds(60)};  // guarded by log_mu
  std::mutex streams_mu;
  FetchAdmission admission;  // guarded by streams_mu
  // Bytes of chunks read and not yet dropped by gRPC (shared with the chunks' slices, which may
  // outlive a stream).
  std::shared_ptr<std::atomic<uint64_t>> buffered = std::make_shared<std::atomic<uint64_t>>(0);

  // A Fetch stream from `peer` may start (counted until release()), or RESOURCE_EXHAUSTED.
  Status admit(const std::string& peer) {
    std::lock_guard<std::mutex> lock(streams_mu);
    return admission.admit(peer);
  }
  void release(const std::string& peer) {
    std::lock_guard<std::mutex> lock(streams_mu);
    admission.release(peer);
  }
  // Takes up to `want` bytes of the chunk budget (at least kMinFetchChunk, or `want` when less):
  // the size of the next chunk. Give them back with unreserve() once gRPC took the chunk.
  size_t reserve(size_t want) {
    uint64_t cur = buffered->load();
    while (true) {
      const uint64_t left = options.max_buffered_bytes > cur ? options.max_buffered_bytes - cur : 0;
      const size_t n = static_cast<size_t>(std::min<uint64_t>(
          want, std::max<uint64_t>(left, std::min<size_t>(want, kMinFetchChunk))));
      if (buffered->compare_exchange_weak(cur, cur + n)) return n;
    }
  }
  void unreserve(size_t n) { *buffered -= n; }

  Status authorize(grpc::CallbackServerContext* ctx, const std::string& run_id) {
    const std::string& token = options.security.token;
    if (!token.empty()) {
      const auto& md = ctx->client_metadata();
      auto it = md.find("authorization");
      if (it == md.end() ||
          !sameSecret(std::string(it->second.data(), it->second.size()), "Bearer " + token)) {
        const std::string peer = peerAddress(ctx->peer());
        const char* why = it == md.end() ? "missing" : "wrong";
        std::optional<uint64_t> n;
        {
          std::lock_guard<std::mutex> lock(log_mu);
          n = refused_log.note(peer + " " + why, std::chrono::steady_clock::now());
        }
        if (n) {  // a flood of them is a line a minute per peer
          logger("agent")->warn(
              "snapshot replication: refused {} call(s) from {}: {} token (such calls from one "
              "peer are logged at most once a minute)",
              *n, quotePeerText(peer, 100), why);
        }
        return Status(StatusCode::kUnauthenticated, "wrong or missing rendezvous token");
      }
    }
    if (run_id != options.run_id) {
      return failedPrecondition("this agent replicates run '" + options.run_id + "', not '" +
                                run_id + "'");
    }
    return Status::ok();
  }

  ServeFault::Kind takeFault() {
    std::lock_guard<std::mutex> lock(fault_mu);
    if (options.fault.kind == ServeFault::Kind::kSlow) return ServeFault::Kind::kSlow;
    if (options.fault.kind == ServeFault::Kind::kNone ||
        options.fault.kind == ServeFault::Kind::kSlowHash || faults_left <= 0) {
      return ServeFault::Kind::kNone;
    }
    --faults_left;
    return options.fault.kind;
  }
};

namespace {

class FailedStream final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  explicit FailedStream(const Status& st) { Finish(convert::toGrpc(st)); }
  void OnDone() override { delete this; }
};

// Streams one version from its open file, one chunk in flight at a time: the next chunk is read
// only when gRPC took the last one, so a slow receiver slows the reads (backpressure). Each chunk
// is sized from the server's budget (Impl::reserve): with many streams open, chunks are smaller,
// so that the bytes held for receivers that do not read stay within max_buffered_bytes. gRPC sends
// each chunk from the buffer it was read into (see ChunkBuffers). A version still arriving here
// (ArrivingFile) is served as its bytes come: the stream waits for each chunk's bytes, parked in
// a WaitSlot that the arrival's progress or the receiver's cancellation takes it out of, whichever
// comes first.
class FetchStream final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  // Serves bytes [begin, end) of `served`.
  // Counted in `impl`'s admission as `peer` (admitted already) until done.
  FetchStream(ServedFile served, uint64_t begin, uint64_t end, size_t chunk_bytes,
              ServeFault::Kind fault, int slow_ms, SnapshotServer::Impl* impl, std::string peer)
      : served_(std::move(served)),
        begin_(begin),
        end_(end),
        chunk_bytes_(chunk_bytes),
        fault_(fault),
        slow_ms_(slow_ms),
        active_(&impl->active_streams),
        impl_(impl),
        peer_(std::move(peer)),
        offset_(begin) {
    ++*active_;
    next();
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the receiver went away"));
      return;
    }
    next();
  }
  void OnDone() override {
    impl_->unreserve(std::exchange(reserved_, 0));
    impl_->release(peer_);
    --*active_;
    delete this;
  }
  void OnCancel() override {
    if (wait_->take() != nullptr) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the receiver went away"));
    }
  }

 private:
  // Where a stream waits for bytes still arriving: it outlives the stream (the arrival holds it),
  // and the stream is taken out of it once, by whichever comes first.
  struct WaitSlot {
    std::mutex mu;
    FetchStream* stream = nullptr;  // guarded by mu
    FetchStream* take() {
      std::lock_guard<std::mutex> lock(mu);
      return std::exchange(stream, nullptr);
    }
  };

  void next() {
    if (offset_ >= end_) {
      Finish(grpc::Status::OK);
      return;
    }
    if (fault_ == ServeFault::Kind::kSlow) {  // test hook only: blocks this gRPC thread
      std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms_));
    }
    const size_t n =
        impl_->reserve(static_cast<size_t>(std::min<uint64_t>(chunk_bytes_, end_ - offset_)));
    reserved_ = n;
    if (!served_.arriving) {
      sendChunk(n);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(wait_->mu);
      wait_->stream = this;
    }
    served_.arriving->whenAvailable(offset_, n, [wait = wait_, n](const Status& st) {
      FetchStream* self = wait->take();
      if (self == nullptr) return;  // cancelled meanwhile
      if (!st.isOk()) {
        self->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                  "this node's own fetch of " + self->served_.file.name +
                                      " version " + versionText(self->served_.file.version) +
                                      ", served as it arrived, failed: " + st.message()));
        return;
      }
      if (!self->served_.data) self->served_.data = self->served_.arriving->data();
      self->sendChunk(n);
    });
  }

  // Reads, checksums and sends the `n` bytes at offset_.
  void sendChunk(size_t n) {
    char* data = buffers_.take(n);
    if (data == nullptr) {
      Finish(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          "no memory for a " + std::to_string(n) + "-byte chunk"));
      return;
    }
    size_t got = 0;
    while (got < n) {
      ssize_t r =
          ::pread(served_.data->fd(), data + got, n - got, static_cast<off_t>(offset_ + got));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        buffers_.put(data);
        Finish(grpc::Status(grpc::StatusCode::DATA_LOSS,
                            "the served file is shorter than its version says"));
        return;
      }
      got += static_cast<size_t>(r);
    }
    const bool first = offset_ == begin_;
    if (fault_ == ServeFault::Kind::kAtSource && first) data[n / 2] ^= 0x5a;
    const uint32_t crc = crc32Update(0, data, n);
    if (fault_ == ServeFault::Kind::kInFlight && first) data[n / 2] ^= 0x5a;
    const uint64_t at = offset_;
    offset_ += n;
    if (offset_ < end_) {
      send(encodeChunk(at, buffers_.slice(data, n, std::exchange(reserved_, 0), impl_->buffered),
                       crc, std::nullopt));
      return;
    }
    // The last chunk carries the whole file's CRC-32: for a version announced while it was
    // still being hashed, once the hash is done (usually long before the stream gets here).
    if (!served_.file.crc32_pending) {
      send(encodeChunk(at, buffers_.slice(data, n, std::exchange(reserved_, 0), impl_->buffered),
                       crc, served_.file.crc32));
      return;
    }
    if (!served_.pending_crc) {
      buffers_.put(data);
      Finish(grpc::Status(grpc::StatusCode::INTERNAL, "no CRC-32 for a version being hashed"));
      return;
    }
    served_.pending_crc->whenKnown([this, at, data, n, crc](const StatusOr<uint32_t>& file_crc) {
      if (!file_crc.isOk()) {
        buffers_.put(data);
        Finish(grpc::Status(
            grpc::StatusCode::DATA_LOSS,
            "the source could not hash " + served_.file.name + ": " + file_crc.status().message()));
        return;
      }
      send(encodeChunk(at, buffers_.slice(data, n, std::exchange(reserved_, 0), impl_->buffered),
                       crc, *file_crc));
    });
  }

  void send(grpc::ByteBuffer message) {
    message_ = std::move(message);
    StartWrite(&message_);
  }

  ServedFile served_;
  uint64_t begin_;
  uint64_t end_;
  size_t chunk_bytes_;
  ChunkBuffers buffers_;
  ServeFault::Kind fault_;
  int slow_ms_;
  std::atomic<int>* active_;
  SnapshotServer::Impl* impl_;
  std::string peer_;
  size_t reserved_ = 0;  // of the server's chunk budget, for the chunk in flight
  uint64_t offset_;
  grpc::ByteBuffer message_;  // the chunk being written
  std::shared_ptr<WaitSlot> wait_ = std::make_shared<WaitSlot>();
};

using ServiceBase = spb::SnapshotReplication::WithCallbackMethod_Announce<
    spb::SnapshotReplication::WithRawCallbackMethod_Fetch<spb::SnapshotReplication::Service>>;

class ReplicationService final : public ServiceBase {
 public:
  explicit ReplicationService(SnapshotServer::Impl* impl) : impl_(impl) {}

  grpc::ServerUnaryReactor* Announce(grpc::CallbackServerContext* ctx,
                                     const spb::AnnounceRequest* req,
                                     spb::AnnounceResponse* /*resp*/) override {
    auto* reactor = ctx->DefaultReactor();
    Status st = impl_->authorize(ctx, req->run_id());
    if (st.isOk() && (req->file().name().empty() || req->source().empty())) {
      st = invalidArgument("an announcement needs a file name and a source");
    }
    if (st.isOk() && impl_->options.on_announce) {
      impl_->options.on_announce(fromProto(req->file()), req->source(),
                                 req->origin().empty() ? req->source() : req->origin());
    }
    reactor->Finish(convert::toGrpc(st));
    return reactor;
  }

  grpc::ServerWriteReactor<grpc::ByteBuffer>* Fetch(grpc::CallbackServerContext* ctx,
                                                    const grpc::ByteBuffer* raw) override {
    spb::FetchRequest req;
    grpc::ByteBuffer copy(*raw);  // shares the slices; Deserialize consumes its argument
    if (!grpc::SerializationTraits<spb::FetchRequest>::Deserialize(&copy, &req).ok()) {
      return new FailedStream(invalidArgument("a Fetch request that does not parse"));
    }
    Status st = impl_->authorize(ctx, req.run_id());
    if (!st.isOk()) return new FailedStream(st);
    std::string peer = peerAddress(ctx->peer());
    st = impl_->admit(peer);
    if (!st.isOk()) return new FailedStream(st);
    // From here the stream counts against `peer` until a FetchStream's OnDone (or just below).
    auto refuse = [&](const Status& why) {
      impl_->release(peer);
      return new FailedStream(why);
    };
    std::optional<ServedFile> served;
    SnapshotFile wanted{req.name(), req.version(), req.size(), req.crc32()};
    wanted.crc32_pending = req.crc32_pending();
    if (impl_->options.lookup) served = impl_->options.lookup(wanted);
    if (!served) {
      return refuse(notFound("this agent does not hold " + quotePeerText(req.name()) + " version " +
                             versionText(req.version()) + " with that content"));
    }
    auto plan = planFetch(req.name(), served->file.size, req.offset(), req.length(),
                          req.chunk_bytes(), impl_->options.chunk_bytes);
    if (!plan.isOk()) return refuse(plan.status());
    return new FetchStream(std::move(*served), plan->begin, plan->end, plan->chunk,
                           impl_->takeFault(), impl_->options.fault.count, impl_, std::move(peer));
  }

 private:
  SnapshotServer::Impl* impl_;
};

}  // namespace

StatusOr<std::unique_ptr<SnapshotServer>> SnapshotServer::start(SnapshotServerOptions options) {
  convert::routeGrpcLogs();
  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
  impl->faults_left = impl->options.fault.count;
  impl->admission = FetchAdmission(impl->options.max_streams_per_peer, impl->options.max_streams);
  impl->service = std::make_unique<ReplicationService>(impl.get());
  const auto& sec = impl->options.security;
  const auto creds = !sec.tls_cert_pem.empty() && !sec.tls_key_pem.empty()
                         ? convert::serverTls(sec.tls_cert_pem, sec.tls_key_pem)
                         : grpc::InsecureServerCredentials();
  grpc::ServerBuilder builder;
  int selected = 0;
  builder.AddListeningPort(impl->options.listen, creds, &selected);
  builder.RegisterService(impl->service.get());
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(1 << 20);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 1 << 20);
  impl->server = builder.BuildAndStart();
  if (!impl->server || selected == 0) {
    return unavailable("snapshot replication: cannot listen on " + impl->options.listen +
                       (sec.tls_cert_pem.empty() ? ""
                                                 : " (or the TLS certificate and key are "
                                                   "not a usable pair)"));
  }
  impl->port = selected;
  return std::unique_ptr<SnapshotServer>(new SnapshotServer(std::move(impl)));
}

SnapshotServer::SnapshotServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

SnapshotServer::~SnapshotServer() {
  // Streams in flight end CANCELLED at once; their receivers keep their previous version.
  impl_->server->Shutdown(std::chrono::system_clock::now());
  impl_->server->Wait();
}

int SnapshotServer::port() const { return impl_->port; }

int SnapshotServer::activeStreams() const { return impl_->active_streams.load(); }

uint64_t SnapshotServer::bufferedBytes() const { return impl_->buffered->load(); }

// ---------------------------------------------------------------------------------------------
// Client

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
  const Status st = convert::fromGrpc(stub->Announce(&ctx, req, &resp));
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
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_) return false;
    contexts_.push_back(ctx);
    return true;
  }
  void leave(grpc::ClientContext* ctx) {
    std::lock_guard<std::mutex> lock(mu_);
    contexts_.erase(std::remove(contexts_.begin(), contexts_.end(), ctx), contexts_.end());
  }
  void fail() {
    std::lock_guard<std::mutex> lock(mu_);
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
      std::lock_guard<std::mutex> lock(mu_);
      if (!stall_) stall_ = why;
    }
    fail();
    return true;
  }
  // Why the fetch stalled, if it did.
  std::optional<Status> stalled() {
    std::lock_guard<std::mutex> lock(mu_);
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
  std::mutex mu_;
  std::atomic<bool> failed_{false};
  std::vector<grpc::ClientContext*> contexts_;  // guarded by mu_
  std::atomic<int64_t> last_progress_{nowNs()};
  std::optional<Status> stall_;  // guarded by mu_
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
        std::unique_lock<std::mutex> lock(mu_);
        while (!done_) {
          cv_.wait_for(lock, step);
          if (!done_ && abort->stalledFor(bound, why)) return;
        }
      });
    } catch (const std::system_error&) {
      fallback_ = true;
    }
  }
  ~StallWatch() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  bool fallback() const { return fallback_; }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;  // guarded by mu_
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
    range->status = Status(StatusCode::kCancelled, "the fetch was cancelled");
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
  Status st = fromPeer(peer, convert::fromGrpc(reader->Finish()));
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

// Subscribers run under mu_, so none runs after unsubscribe() returned (FetchAbort's lock is
// only ever taken inside this one, never the other way round).
void FetchCancel::cancel(Status why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (cancelled_.load()) return;
  why_ = std::move(why);
  cancelled_ = true;
  for (auto& [id, on_cancel] : subscribers_) on_cancel();
}

Status FetchCancel::why() const {
  std::lock_guard<std::mutex> lock(mu_);
  return why_;
}

uint64_t FetchCancel::subscribe(std::function<void()> on_cancel) {
  std::lock_guard<std::mutex> lock(mu_);
  if (cancelled_.load()) on_cancel();
  subscribers_[++next_id_] = std::move(on_cancel);
  return next_id_;
}

void FetchCancel::unsubscribe(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  subscribers_.erase(id);
}

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

}  // namespace ddprun::rendezvous
