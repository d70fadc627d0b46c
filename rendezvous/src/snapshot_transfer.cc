#include "ddprun/rendezvous/snapshot_transfer.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <mutex>
#include <thread>

#include "convert.h"
#include "ddprun/common/crc32.h"
#include "ddprun/common/log.h"
#include "ddprun/snapshot/v1/snapshot.grpc.pb.h"

namespace ddprun::rendezvous {

namespace spb = ::ddprun::snapshot::v1;

namespace {

uint32_t crcOf(const std::string& bytes) { return crc32Update(0, bytes.data(), bytes.size()); }

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
  return SnapshotFile{f.name(), f.version(), f.size(), f.crc32()};
}

std::shared_ptr<grpc::Channel> channelTo(const SnapshotPeer& peer) {
  convert::routeGrpcLogs();
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetMaxReceiveMessageSize(64 << 20);
  // Bulk transfer: large HTTP/2 frames and a large receive window from the start (loopback and
  // LANs have the bandwidth; gRPC's defaults suit small messages).
  args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 1 << 20);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 32 << 20);
  const auto creds = peer.security.tls_ca_pem.empty()
                         ? grpc::InsecureChannelCredentials()
                         : convert::channelTls(peer.security.tls_ca_pem);
  return grpc::CreateCustomChannel(peer.endpoint, creds, args);
}

void addToken(grpc::ClientContext& ctx, const SnapshotPeer& peer) {
  if (!peer.security.token.empty()) {
    ctx.AddMetadata("authorization", "Bearer " + peer.security.token);
  }
}

}  // namespace

OpenFile::~OpenFile() {
  if (fd_ >= 0) ::close(fd_);
}

StatusOr<std::pair<uint64_t, uint32_t>> crc32OfFile(int fd) {
  std::string buf(1 << 20, '\0');
  uint32_t crc = static_cast<uint32_t>(::crc32(0L, Z_NULL, 0));
  uint64_t total = 0;
  for (;;) {
    ssize_t n = ::pread(fd, buf.data(), buf.size(), static_cast<off_t>(total));
    if (n < 0) {
      if (errno == EINTR) continue;
      return internalError("cannot read: " + errnoText(errno));
    }
    if (n == 0) break;
    crc = crc32Update(crc, buf.data(), static_cast<size_t>(n));
    total += static_cast<uint64_t>(n);
  }
  return std::make_pair(total, crc);
}

// ---------------------------------------------------------------------------------------------
// Server

struct SnapshotServer::Impl {
  SnapshotServerOptions options;
  std::unique_ptr<spb::SnapshotReplication::CallbackService> service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::atomic<int> active_streams{0};
  std::mutex fault_mu;
  int faults_left = 0;  // guarded by fault_mu

  Status authorize(grpc::CallbackServerContext* ctx, const std::string& run_id) {
    const std::string& token = options.security.token;
    if (!token.empty()) {
      const auto& md = ctx->client_metadata();
      auto it = md.find("authorization");
      if (it == md.end() ||
          !sameSecret(std::string(it->second.data(), it->second.size()), "Bearer " + token)) {
        logger("agent")->warn("snapshot replication: refused a call from {}: {} token", ctx->peer(),
                              it == md.end() ? "missing" : "wrong");
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
    if (options.fault.kind == ServeFault::Kind::kNone || faults_left <= 0) {
      return ServeFault::Kind::kNone;
    }
    --faults_left;
    return options.fault.kind;
  }
};

namespace {

class FailedStream final : public grpc::ServerWriteReactor<spb::Chunk> {
 public:
  explicit FailedStream(const Status& st) { Finish(convert::toGrpc(st)); }
  void OnDone() override { delete this; }
};

// Streams one version from its open file, one chunk in flight at a time: the next chunk is read
// only when gRPC took the last one, so a slow receiver slows the reads (backpressure).
class FetchStream final : public grpc::ServerWriteReactor<spb::Chunk> {
 public:
  FetchStream(ServedFile served, size_t chunk_bytes, ServeFault::Kind fault, int slow_ms,
              std::atomic<int>* active)
      : served_(std::move(served)),
        chunk_bytes_(chunk_bytes),
        fault_(fault),
        slow_ms_(slow_ms),
        active_(active) {
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
    --*active_;
    delete this;
  }

 private:
  void next() {
    const uint64_t size = served_.file.size;
    if (offset_ >= size) {
      Finish(grpc::Status::OK);
      return;
    }
    if (fault_ == ServeFault::Kind::kSlow) {  // test hook only: blocks this gRPC thread
      std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms_));
    }
    const size_t n = static_cast<size_t>(std::min<uint64_t>(chunk_bytes_, size - offset_));
    std::string* data = chunk_.mutable_data();
    data->resize(n);
    size_t got = 0;
    while (got < n) {
      ssize_t r = ::pread(served_.data->fd(), data->data() + got, n - got,
                          static_cast<off_t>(offset_ + got));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        Finish(grpc::Status(grpc::StatusCode::DATA_LOSS,
                            "the served file is shorter than its version says"));
        return;
      }
      got += static_cast<size_t>(r);
    }
    if (fault_ == ServeFault::Kind::kAtSource && offset_ == 0) (*data)[n / 2] ^= 0x5a;
    chunk_.set_offset(offset_);
    chunk_.set_crc32(crcOf(*data));
    if (fault_ == ServeFault::Kind::kInFlight && offset_ == 0) (*data)[n / 2] ^= 0x5a;
    offset_ += n;
    StartWrite(&chunk_);
  }

  ServedFile served_;
  size_t chunk_bytes_;
  ServeFault::Kind fault_;
  int slow_ms_;
  std::atomic<int>* active_;
  uint64_t offset_ = 0;
  spb::Chunk chunk_;
};

class ReplicationService final : public spb::SnapshotReplication::CallbackService {
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

  grpc::ServerWriteReactor<spb::Chunk>* Fetch(grpc::CallbackServerContext* ctx,
                                              const spb::FetchRequest* req) override {
    Status st = impl_->authorize(ctx, req->run_id());
    if (!st.isOk()) return new FailedStream(st);
    std::optional<ServedFile> served;
    if (impl_->options.lookup) served = impl_->options.lookup(req->name(), req->version());
    if (!served) {
      return new FailedStream(notFound("this agent does not hold " + req->name() + " version " +
                                       versionText(req->version())));
    }
    return new FetchStream(std::move(*served), std::max<size_t>(impl_->options.chunk_bytes, 1),
                           impl_->takeFault(), impl_->options.fault.count, &impl_->active_streams);
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

// ---------------------------------------------------------------------------------------------
// Client

Status announceSnapshot(const SnapshotPeer& peer, const SnapshotFile& file,
                        const std::string& source, const std::string& origin, Duration timeout) {
  auto stub = spb::SnapshotReplication::NewStub(channelTo(peer));
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
  spb::AnnounceResponse resp;
  return convert::fromGrpc(stub->Announce(&ctx, req, &resp));
}

namespace {

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
// aligned buffers: one is written on a helper thread while the fetch fills the other, so the
// disk's time overlaps the receiving. A fetched version is read once by the workers that resume
// from it and served to peers, so caching it on the way in only takes memory from the training
// node, and filling fresh page cache is itself slow on some hosts (this 2-core VM: 1 GB buffered
// took 2.7 s plus a 0.4 s fsync, with O_DIRECT 0.6-0.7 s). Falls back to buffered writes where
// the file system refuses O_DIRECT (the fcntl fails) or an aligned direct write (EINVAL); the
// tail that does not fill a whole block is always written buffered.
// Threading: one thread calls append/finish; at most one buffer write runs on the helper.
class SequentialWriter {
 public:
  static constexpr size_t kBlock = 4096;
  static constexpr size_t kBuffer = 4 << 20;        // a multiple of kBlock
  static constexpr uint64_t kDirectFrom = 8 << 20;  // smaller files: buffered

  SequentialWriter(int fd, uint64_t size) : fd_(fd) {
    if (size < kDirectFrom) return;
    for (auto& b : buffers_) {
      void* mem = nullptr;
      if (::posix_memalign(&mem, kBlock, kBuffer) != 0) return;
      b.reset(static_cast<char*>(mem));
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
        pending_ = std::async(std::launch::async,
                              [this, full, at] { return writeBlocks(full, kBuffer, at); });
        offset_ += kBuffer;
        current_ ^= 1;
        filled_ = 0;
      }
    }
    return 0;
  }

  // Writes what is buffered: the whole blocks directly, the rest buffered. 0 or an errno.
  int finish() {
    if (!direct_) return 0;
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

 private:
  // The helper's write of the buffer before: its errno, or 0.
  int collect() { return pending_.valid() ? pending_.get() : 0; }

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
    void operator()(char* p) const { std::free(p); }
  };
  int fd_;
  bool direct_ = false;
  std::unique_ptr<char, Free> buffers_[2];
  int current_ = 0;           // the buffer being filled
  size_t filled_ = 0;         // bytes in it
  uint64_t offset_ = 0;       // where the current buffer's first byte lands
  std::future<int> pending_;  // the other buffer's write, if one runs
};

Status noSpace(const SnapshotFile& file, const std::string& dir, uint64_t free_bytes) {
  return Status(StatusCode::kResourceExhausted,
                "no space for " + file.name + " version " + versionText(file.version) + " in " +
                    dir + ": needs " + std::to_string(file.size) + " bytes, " +
                    std::to_string(free_bytes) + " free");
}

}  // namespace

Status fetchSnapshot(const SnapshotPeer& peer, const SnapshotFile& file,
                     const std::string& temp_path, const std::atomic<bool>* cancel) {
  const auto slash = temp_path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : temp_path.substr(0, slash);
  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) == 0) {
    const uint64_t free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    if (free_bytes < file.size) return noSpace(file, dir, free_bytes);
  }
  TempFile out(temp_path);
  DDPRUN_RETURN_IF_ERROR(out.create());
  if (file.size > 0) {
    const int err = ::posix_fallocate(out.fd(), 0, static_cast<off_t>(file.size));
    if (err == ENOSPC || err == EDQUOT) {
      uint64_t free_bytes = 0;
      if (::statvfs(dir.c_str(), &vfs) == 0) {
        free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
      }
      return noSpace(file, dir, free_bytes);
    }
    // Other errors (a file system without fallocate): writing finds out.
  }

  SequentialWriter writer(out.fd(), file.size);
  auto writeFailure = [&](int err) {
    return err == ENOSPC || err == EDQUOT
               ? noSpace(file, dir, 0)
               : internalError("cannot write " + temp_path + ": " + errnoText(err));
  };

  auto stub = spb::SnapshotReplication::NewStub(channelTo(peer));
  grpc::ClientContext ctx;
  addToken(ctx, peer);
  // A stuck source must not hold the node forever: a minute plus 10 s per 100 MB.
  const auto allowed = std::chrono::seconds(60 + static_cast<int64_t>(file.size / (10 << 20)));
  ctx.set_deadline(std::chrono::system_clock::now() + allowed);
  spb::FetchRequest req;
  req.set_run_id(peer.run_id);
  req.set_name(file.name);
  req.set_version(file.version);
  auto reader = stub->Fetch(&ctx, req);
  spb::Chunk chunk;
  uint64_t offset = 0;
  uint32_t crc = static_cast<uint32_t>(::crc32(0L, Z_NULL, 0));
  Status failure;
  while (reader->Read(&chunk)) {
    if (cancel != nullptr && cancel->load()) {
      failure = Status(StatusCode::kCancelled, "the fetch was cancelled");
      break;
    }
    const std::string& data = chunk.data();
    if (chunk.offset() != offset || offset + data.size() > file.size) {
      failure = Status(StatusCode::kDataLoss,
                       "a chunk at offset " + std::to_string(chunk.offset()) +
                           " does not continue the file (expected " + std::to_string(offset) + ")");
      break;
    }
    const uint32_t chunk_crc = crcOf(data);
    if (chunk_crc != chunk.crc32()) {
      failure = Status(StatusCode::kDataLoss, "the chunk at offset " + std::to_string(offset) +
                                                  " fails its CRC-32 (corrupted in flight)");
      break;
    }
    if (const int err = writer.append(data.data(), data.size())) {
      failure = writeFailure(err);
      break;
    }
    if (!failure.isOk()) break;
    // The whole file's CRC-32 from the chunks' (one pass over the bytes, not two).
    crc = static_cast<uint32_t>(::crc32_combine(crc, chunk_crc, static_cast<z_off_t>(data.size())));
    offset += data.size();
  }
  if (!failure.isOk()) ctx.TryCancel();
  Status st = convert::fromGrpc(reader->Finish());
  if (!failure.isOk()) return failure;
  if (!st.isOk()) return st;
  if (offset != file.size) {
    return Status(StatusCode::kDataLoss, "the stream ended after " + std::to_string(offset) +
                                             " of " + std::to_string(file.size) + " bytes");
  }
  if (crc != file.crc32) {
    return Status(StatusCode::kDataLoss,
                  "the content does not match the announced CRC-32 (corrupt at the source)");
  }
  if (const int err = writer.finish()) return writeFailure(err);
  return out.finish();
}

}  // namespace ddprun::rendezvous
