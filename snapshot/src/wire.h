// The transport's wire, shared by its server (server.cc) and its client calls (transfer.cc): the
// Chunk encoding both ends build and read themselves, the channels to other agents, and the gRPC
// glue (Status, TLS credentials, gRPC's own log lines). Private to snapshot/src.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ddprun/common/status.h"
#include "ddprun/snapshot/transfer.h"
#include "ddprun/snapshot/v1/snapshot.grpc.pb.h"
#include "ddprun/snapshot/version.h"

namespace ddprun::snapshot {

namespace spb = ::ddprun::snapshot::v1;

std::string errnoText(int err);

grpc::Status toGrpc(const Status& s);
Status fromGrpc(const grpc::Status& s);
// Sends gRPC's own log lines to the component's logger at debug level: every failure they
// describe reaches users as a Status with a message of ours.
void routeGrpcLogs();
// TLS when the security material asks for it (a server: certificate and key; a client: a CA).
std::shared_ptr<grpc::ServerCredentials> serverCredentials(const TransferSecurity& sec);
std::shared_ptr<grpc::ChannelCredentials> channelCredentials(const TransferSecurity& sec);

// A channel to `peer` for `lane` (kept between calls; see wire.cc), and the token on a call to it.
std::shared_ptr<grpc::Channel> channelTo(const SnapshotPeer& peer, size_t lane);
void addToken(grpc::ClientContext& ctx, const SnapshotPeer& peer);

// The chunks travel as ddprun.snapshot.v1.Chunk on the wire, but both ends build and read that
// encoding themselves, over the slices gRPC sends and receives: protobuf would copy each chunk's
// bytes into a message and out again (two of the four copies a fetch made of every byte).
constexpr char kFetchMethod[] = "/ddprun.snapshot.v1.SnapshotReplication/Fetch";
constexpr uint8_t kOffsetTag = (1 << 3) | 0;   // field 1, varint
constexpr uint8_t kDataTag = (2 << 3) | 2;     // field 2, length-delimited
constexpr uint8_t kCrcTag = (3 << 3) | 0;      // field 3, varint
constexpr uint8_t kFileCrcTag = (4 << 3) | 0;  // field 4, varint

// One Chunk message: offset, then the data slice as it is, then the data's CRC-32 (and on a
// stream's last chunk the whole file's).
grpc::ByteBuffer encodeChunk(uint64_t offset, grpc::Slice data, uint32_t crc,
                             std::optional<uint32_t> file_crc);

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

}  // namespace ddprun::snapshot
