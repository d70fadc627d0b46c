// The replication server: answers announcements and serves held (or arriving) versions as
// checksummed chunks (transfer.h).
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <utility>

#include "ddprun/common/block_cache.h"
#include "ddprun/common/crc32.h"
#include "ddprun/common/log.h"
#include "ddprun/common/log_throttle.h"
#include "ddprun/common/strings.h"
#include "ddprun/common/thread_annotations.h"
#include "ddprun/snapshot/transfer.h"
#include "wire.h"

namespace ddprun::snapshot {

namespace {

bool sameSecret(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
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

}  // namespace

struct SnapshotServer::Impl {
  SnapshotServerOptions options;
  std::unique_ptr<grpc::Service> service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::atomic<int> active_streams{0};
  Mutex fault_mu;
  int faults_left GUARDED_BY(fault_mu) = 0;
  Mutex log_mu;
  LogThrottle refused_log GUARDED_BY(log_mu){std::chrono::seconds(60)};
  Mutex streams_mu;
  FetchAdmission admission GUARDED_BY(streams_mu);
  // Bytes of chunks read and not yet dropped by gRPC (shared with the chunks' slices, which may
  // outlive a stream).
  std::shared_ptr<std::atomic<uint64_t>> buffered = std::make_shared<std::atomic<uint64_t>>(0);

  // A Fetch stream from `peer` may start (counted until release()), or RESOURCE_EXHAUSTED.
  Status admit(const std::string& peer) {
    MutexLock lock(streams_mu);
    return admission.admit(peer);
  }
  void release(const std::string& peer) {
    MutexLock lock(streams_mu);
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
        const std::string peer = hostOfGrpcPeer(ctx->peer());
        const char* why = it == md.end() ? "missing" : "wrong";
        std::optional<uint64_t> n;
        {
          MutexLock lock(log_mu);
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
    MutexLock lock(fault_mu);
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
  explicit FailedStream(const Status& st) { Finish(toGrpc(st)); }
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
    Mutex mu;
    FetchStream* stream GUARDED_BY(mu) = nullptr;
    FetchStream* take() {
      MutexLock lock(mu);
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
      MutexLock lock(wait_->mu);
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
    reactor->Finish(toGrpc(st));
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
    std::string peer = hostOfGrpcPeer(ctx->peer());
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
  routeGrpcLogs();
  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
  {
    MutexLock lock(impl->fault_mu);
    impl->faults_left = impl->options.fault.count;
  }
  {
    MutexLock lock(impl->streams_mu);
    impl->admission = FetchAdmission(impl->options.max_streams_per_peer, impl->options.max_streams);
  }
  impl->service = std::make_unique<ReplicationService>(impl.get());
  const auto& sec = impl->options.security;
  const auto creds = serverCredentials(sec);
  grpc::ServerBuilder builder;
  int selected = 0;
  builder.AddListeningPort(impl->options.listen, creds, &selected);
  builder.RegisterService(impl->service.get());
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(1 << 20);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 1 << 20);
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                             millisForInt(impl->options.handshake_timeout));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                             millisForInt(impl->options.max_connection_idle));
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

}  // namespace ddprun::snapshot
