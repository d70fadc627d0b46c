#include "ddprun/common/deflate.h"

#include <zlib.h>

#include <algorithm>

namespace ddprun {

namespace {
// The inflation's first buffer; it doubles as the stream delivers.
constexpr size_t kInflateStep = 64 << 10;
}  // namespace

std::optional<std::string> deflateFast(std::string_view data) {
  uLongf room = compressBound(static_cast<uLong>(data.size()));
  std::string packed(room, '\0');
  if (compress2(reinterpret_cast<Bytef*>(packed.data()), &room,
                reinterpret_cast<const Bytef*>(data.data()), static_cast<uLong>(data.size()),
                Z_BEST_SPEED) != Z_OK) {
    return std::nullopt;
  }
  packed.resize(room);
  return packed;
}

StatusOr<std::string> inflateExactly(std::string_view deflated, uint64_t size) {
  if (size >= (uint64_t{1} << 40)) return invalidArgument("states more bytes than can be held");
  z_stream zs{};
  if (inflateInit(&zs) != Z_OK) return invalidArgument("cannot be inflated: zlib did not start");
  std::string out;
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(deflated.data()));
  zs.avail_in = static_cast<uInt>(std::min<size_t>(deflated.size(), UINT32_MAX));
  int rc = Z_OK;
  // One byte more than stated is room to notice a stream that goes on.
  while (true) {
    if (zs.total_out == out.size()) {
      if (out.size() > size) break;
      out.resize(static_cast<size_t>(std::min<uint64_t>(
          size + 1, std::max<uint64_t>(kInflateStep, uint64_t{out.size()} * 2))));
    }
    zs.next_out = reinterpret_cast<Bytef*>(out.data() + zs.total_out);
    zs.avail_out = static_cast<uInt>(out.size() - zs.total_out);
    rc = inflate(&zs, Z_NO_FLUSH);
    if (rc == Z_STREAM_END) break;
    if (rc == Z_OK || (rc == Z_BUF_ERROR && zs.avail_out == 0)) continue;
    break;  // damaged, or the input ended before the stream did
  }
  const uint64_t got = zs.total_out;
  inflateEnd(&zs);
  if (got > size) {
    return invalidArgument("does not inflate to the " + std::to_string(size) +
                           " bytes stated: it gives more");
  }
  if (rc != Z_STREAM_END) return invalidArgument("does not inflate");
  if (got != size) {
    return invalidArgument("does not inflate to the " + std::to_string(size) +
                           " bytes stated: it gives " + std::to_string(got));
  }
  out.resize(static_cast<size_t>(got));
  return out;
}

}  // namespace ddprun
