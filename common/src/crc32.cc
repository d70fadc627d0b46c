#include "ddprun/common/crc32.h"

#include <zlib.h>

#include <algorithm>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#define DDPRUN_CRC32_CLMUL 1
#endif

namespace ddprun {

uint32_t crc32Portable(uint32_t crc, const void* data, size_t n) {
  uLong c = crc;
  const auto* p = static_cast<const Bytef*>(data);
  while (n > 0) {  // zlib takes a uInt length
    const uInt part = static_cast<uInt>(std::min<size_t>(n, 1u << 30));
    c = ::crc32(c, p, part);
    p += part;
    n -= part;
  }
  return static_cast<uint32_t>(c);
}

uint32_t crc32Combine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b) {
  return static_cast<uint32_t>(::crc32_combine(crc_a, crc_b, static_cast<z_off_t>(length_b)));
}

#ifdef DDPRUN_CRC32_CLMUL
namespace {

// The CRC is linear over GF(2): a 16-byte block followed by T more bits of message contributes
// what the block times x^T contributes, reduced modulo the polynomial. A fold multiplies the two
// 64-bit halves of a 128-bit accumulator by (x^(T+32) mod P) and (x^(T-32) mod P), bit-reflected
// and shifted by one as the reflected carry-less product needs, which moves the accumulator T
// bits forward onto the block there (T = 512 while four accumulators run side by side, 128 when
// one is left). Once the message is folded into one 16-byte block, the CRC of that block plus the
// tail, from a zero state, is the CRC of the whole message (zlib computes it).
constexpr long long kFold512Lo = 0x154442bd4;  // x^(512+32) mod P, reflected << 1
constexpr long long kFold512Hi = 0x1c6e41596;  // x^(512-32) mod P, reflected << 1
constexpr long long kFold128Lo = 0x1751997d0;  // x^(128+32) mod P, reflected << 1
constexpr long long kFold128Hi = 0x0ccaa009e;  // x^(128-32) mod P, reflected << 1

__attribute__((target("pclmul,sse2"))) inline __m128i fold(__m128i acc, __m128i k, __m128i next) {
  const __m128i lo = _mm_clmulepi64_si128(acc, k, 0x00);
  const __m128i hi = _mm_clmulepi64_si128(acc, k, 0x11);
  return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}

__attribute__((target("pclmul,sse2"))) inline __m128i load(const unsigned char* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// n >= 64.
__attribute__((target("pclmul,sse2"))) uint32_t crc32Clmul(uint32_t crc, const unsigned char* p,
                                                           size_t n) {
  // zlib's convention: the register starts at ~crc. XORed into the first four message bytes it
  // is the same as starting from zero.
  __m128i x0 = _mm_xor_si128(load(p), _mm_cvtsi32_si128(static_cast<int>(~crc)));
  __m128i x1 = load(p + 16);
  __m128i x2 = load(p + 32);
  __m128i x3 = load(p + 48);
  p += 64;
  n -= 64;
  const __m128i k512 = _mm_set_epi64x(kFold512Hi, kFold512Lo);
  while (n >= 64) {
    x0 = fold(x0, k512, load(p));
    x1 = fold(x1, k512, load(p + 16));
    x2 = fold(x2, k512, load(p + 32));
    x3 = fold(x3, k512, load(p + 48));
    p += 64;
    n -= 64;
  }
  const __m128i k128 = _mm_set_epi64x(kFold128Hi, kFold128Lo);
  __m128i x = fold(x0, k128, x1);
  x = fold(x, k128, x2);
  x = fold(x, k128, x3);
  while (n >= 16) {
    x = fold(x, k128, load(p));
    p += 16;
    n -= 16;
  }
  alignas(16) unsigned char block[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(block), x);
  // zlib's crc32(0xffffffff, ...) runs its register from zero; the result continues as usual.
  const uint32_t folded = crc32Portable(0xffffffffu, block, sizeof(block));
  return crc32Portable(folded, p, n);
}

bool detectClmul() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return false;
  return (ecx & bit_PCLMUL) != 0 && (edx & bit_SSE2) != 0;
}

}  // namespace

bool crc32Accelerated() {
  static const bool has = detectClmul();
  return has;
}

uint32_t crc32Update(uint32_t crc, const void* data, size_t n) {
  if (n >= 64 && crc32Accelerated()) {
    return crc32Clmul(crc, static_cast<const unsigned char*>(data), n);
  }
  return crc32Portable(crc, data, n);
}

#else

bool crc32Accelerated() { return false; }

uint32_t crc32Update(uint32_t crc, const void* data, size_t n) {
  return crc32Portable(crc, data, n);
}

#endif

}  // namespace ddprun
