// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320: zlib's crc32(), the value snapshot files
// and replication chunks carry), computed with carry-less multiplication (PCLMULQDQ) where the
// CPU has it and with zlib elsewhere. Same values as zlib for every input, so peers built either
// way agree.
//
// zlib 1.2.13's table-driven crc32 runs at about 3.5 GB/s here; folding 64 bytes a step with four
// independent carry-less products runs at about 12 GB/s, and 256 bytes a step on 512-bit
// registers faster still, so a checksum costs far less than the copy it guards (it was a fifth
// of a snapshot fetch's CPU).
//
// Threading: pure functions, callable from any thread.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ddprun {

// The CRC-32 of `data` continued from `crc` (0 to start), as zlib's crc32(crc, data, n).
uint32_t crc32Update(uint32_t crc, const void* data, size_t n);

// The CRC-32 of A followed by B, from A's CRC-32, B's and B's length (zlib's crc32_combine).
uint32_t crc32Combine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b);

// How a CRC-32 is computed, slowest first: zlib's tables, carry-less multiplication of 128-bit
// blocks (PCLMULQDQ), of four such blocks at once (VPCLMULQDQ with AVX-512).
enum class Crc32Path { kPortable, kClmul, kWide };

// The fastest path this CPU (and its OS) has; crc32Update takes it.
Crc32Path crc32BestPath();

// crc32Update through `path`, or through the best this CPU has if it lacks `path` (for tests and
// benchmarks: every path gives the same value).
uint32_t crc32UpdateVia(Crc32Path path, uint32_t crc, const void* data, size_t n);

// "zlib", "PCLMULQDQ", "VPCLMULQDQ (AVX-512)".
const char* crc32PathName(Crc32Path path);

// The same value through zlib only (the reference the fast path is tested against).
uint32_t crc32Portable(uint32_t crc, const void* data, size_t n);

}  // namespace ddprun
