#include "wire.h"

#include <grpc/support/log.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>

#include <cstring>
#include <map>
#include <mutex>

#include "ddprun/common/log.h"
#include "ddprun/common/thread_annotations.h"

namespace ddprun::snapshot {

std::string errnoText(int err) { return std::strerror(err); }

grpc::Status toGrpc(const Status& s) {
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), s.message());
}

Status fromGrpc(const grpc::Status& s) {
  return s.ok() ? Status::ok() : Status(static_cast<StatusCode>(s.error_code()), s.error_message());
}

void routeGrpcLogs() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Leaked on purpose: gRPC threads may still log while static destructors run.
    static auto* log = new std::shared_ptr<spdlog::logger>(logger("snapshot"));
    gpr_set_log_function([](gpr_log_func_args* args) {
      (*log)->debug("grpc {}:{}: {}", args->file, args->line, args->message);
    });
  });
}

std::shared_ptr<grpc::ServerCredentials> serverCredentials(const TransferSecurity& sec) {
  if (sec.tls_cert_pem.empty() || sec.tls_key_pem.empty()) {
    return grpc::InsecureServerCredentials();
  }
  grpc::SslServerCredentialsOptions ssl;
  ssl.pem_key_cert_pairs.push_back({sec.tls_key_pem, sec.tls_cert_pem});
  return grpc::SslServerCredentials(ssl);
}

std::shared_ptr<grpc::ChannelCredentials> channelCredentials(const TransferSecurity& sec) {
  if (sec.tls_ca_pem.empty()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = sec.tls_ca_pem;
  return grpc::SslCredentials(ssl);
}

namespace {

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
    MutexLock lock(mu_);
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
    routeGrpcLogs();
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
    return grpc::CreateCustomChannel(peer.endpoint, channelCredentials(peer.security), args);
  }

  Mutex mu_;
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_ GUARDED_BY(mu_);
};
}  // namespace

std::shared_ptr<grpc::Channel> channelTo(const SnapshotPeer& peer, size_t lane) {
  static ChannelPool* pool = new ChannelPool;  // never destroyed: used until the process exits
  return pool->get(peer, lane);
}

void addToken(grpc::ClientContext& ctx, const SnapshotPeer& peer) {
  if (!peer.security.token.empty()) {
    ctx.AddMetadata("authorization", "Bearer " + peer.security.token);
  }
}

size_t putVarint(uint8_t* out, uint64_t v) {
  size_t n = 0;
  while (v >= 0x80) {
    out[n++] = static_cast<uint8_t>(v | 0x80);
    v >>= 7;
  }
  out[n++] = static_cast<uint8_t>(v);
  return n;
}

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

}  // namespace ddprun::snapshot
