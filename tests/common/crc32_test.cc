// The CRC-32 of snapshot files and replication chunks: the carry-less-multiply path must give
// zlib's value for every length, alignment and starting value, and split computations must chain.
#include "ddprun/common/crc32.h"

#include <catch2/catch.hpp>
#include <random>
#include <string>
#include <vector>

using ddprun::crc32BestPath;
using ddprun::Crc32Path;
using ddprun::crc32PathName;
using ddprun::crc32Portable;
using ddprun::crc32Update;
using ddprun::crc32UpdateVia;

namespace {

std::vector<unsigned char> randomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

}  // namespace

TEST_CASE("crc32: known values (IEEE 802.3, as zlib)", "[crc32]") {
  const std::string check = "123456789";
  CHECK(crc32Update(0, check.data(), check.size()) == 0xCBF43926u);
  CHECK(crc32Update(0, nullptr, 0) == 0u);
  // 64 bytes and more take the folding path where the CPU has it.
  const std::string fox =
      "The quick brown fox jumps over the lazy dog. "
      "The quick brown fox jumps over the lazy dog.";
  REQUIRE(fox.size() >= 64);
  CHECK(crc32Update(0, fox.data(), fox.size()) == crc32Portable(0, fox.data(), fox.size()));
  const std::vector<unsigned char> zeros(4096, 0), ones(4096, 0xff);
  CHECK(crc32Update(0, zeros.data(), zeros.size()) == crc32Portable(0, zeros.data(), zeros.size()));
  CHECK(crc32Update(0, ones.data(), ones.size()) == crc32Portable(0, ones.data(), ones.size()));
  INFO("this CPU's path: " << crc32PathName(crc32BestPath()));
  SUCCEED();
}

TEST_CASE("crc32: every path, every length 0..1100, every alignment, varied starting values",
          "[crc32]") {
  const auto buf = randomBytes(1100 + 64, 7);
  // Each path this CPU has; one it lacks computes through the best it has (the same value).
  const Crc32Path path = GENERATE(Crc32Path::kPortable, Crc32Path::kClmul, Crc32Path::kWide);
  INFO("path " << crc32PathName(path) << ", this CPU's best " << crc32PathName(crc32BestPath()));
  std::mt19937 rng(11);
  for (size_t align = 0; align < 64; align += (align < 16 ? 1 : 7)) {
    for (size_t n = 0; n + align <= 1100; ++n) {
      const uint32_t start = (n % 3 == 0) ? 0u : static_cast<uint32_t>(rng());
      const auto* p = buf.data() + align;
      const uint32_t want = crc32Portable(start, p, n);
      const uint32_t got = crc32UpdateVia(path, start, p, n);
      if (got != want) {
        FAIL("length " << n << " at offset " << align << " from " << start << ": " << got
                       << " != zlib's " << want);
      }
    }
  }
  SUCCEED();
}

TEST_CASE("crc32: large buffers, and pieces chained give the whole", "[crc32]") {
  const auto buf = randomBytes((8 << 20) + 13, 3);
  const uint32_t whole = crc32Portable(0, buf.data(), buf.size());
  CHECK(crc32Update(0, buf.data(), buf.size()) == whole);
  CHECK(crc32UpdateVia(Crc32Path::kClmul, 0, buf.data(), buf.size()) == whole);
  CHECK(crc32UpdateVia(Crc32Path::kWide, 0, buf.data(), buf.size()) == whole);
  // Pieces of awkward sizes (below and above the 64-byte threshold), chained.
  std::mt19937 rng(5);
  uint32_t c = 0;
  size_t at = 0;
  while (at < buf.size()) {
    const size_t piece =
        std::min<size_t>(buf.size() - at, rng() % 3 == 0 ? rng() % 70 : rng() % 300000);
    c = crc32Update(c, buf.data() + at, piece);
    at += piece;
  }
  CHECK(c == whole);
  // A single flipped bit anywhere changes the value.
  auto bad = buf;
  bad[bad.size() / 2] ^= 0x10;
  CHECK(crc32Update(0, bad.data(), bad.size()) != whole);
}

TEST_CASE("crc32: the CRC-32s of two parts combine into the whole's", "[crc32]") {
  const auto buf = randomBytes((3 << 20) + 7, 9);
  const uint32_t whole = crc32Portable(0, buf.data(), buf.size());
  for (size_t split : {size_t{0}, size_t{1}, size_t{4096}, buf.size() / 2, buf.size()}) {
    CAPTURE(split);
    const uint32_t a = crc32Update(0, buf.data(), split);
    const uint32_t b = crc32Update(0, buf.data() + split, buf.size() - split);
    CHECK(ddprun::crc32Combine(a, b, buf.size() - split) == whole);
  }
}
