// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320: zlib's crc32(), the value snapshot files
// and replication chunks carry), computed with carry-less multiplication (PCLMULQDQ) where the
// CPU has it and with zlib elsewhere. Same values as zlib for every input, so peers built either
// way agree.
//
// zlib 1.2.13's table-driven crc32 runs at about 3.5 GB/s here; folding 64 bytes a step with four
// independent carry-less products runs several times faster, so a checksum no longer costs as
// much as the copy it guards (it was a fifth of a snapshot fetch's CPU).
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

// Whether crc32Update uses the carry-less-multiply path on this CPU (for logs and tests).
bool crc32Accelerated();

// The same value through zlib only (the reference the fast path is tested against).
uint32_t crc32Portable(uint32_t crc, const void* data, size_t n);

}  // namespace ddprun
