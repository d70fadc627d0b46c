#include "ddprun/common/crc32.h"

#include <zlib.h>

#include <algorithm>

#if defined(__x86_64__)
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

// The last step of both folding paths: the message folded into `x` up to `p`, then `n` bytes.
__attribute__((target("pclmul,sse2"))) uint32_t finishFolding(__m128i x, const unsigned char* p,
                                                              size_t n) {
  const __m128i k128 = _mm_set_epi64x(kFold128Hi, kFold128Lo);
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
  return finishFolding(x, p, n);
}

// The same folds four 128-bit lanes at a time (VPCLMULQDQ on 512-bit registers): four registers
// side by side fold 256 bytes a step (T = 2048), then one register 64 bytes a step (T = 512),
// whose four lanes end as one 128-bit block.
constexpr long long kFold2048Lo = 0x11542778a;  // x^(2048+32) mod P, reflected << 1
constexpr long long kFold2048Hi = 0x1322d1430;  // x^(2048-32) mod P, reflected << 1
#define DDPRUN_CRC32_WIDE_TARGET target("avx512f,avx512vl,vpclmulqdq,pclmul,sse2")

__attribute__((DDPRUN_CRC32_WIDE_TARGET)) inline __m512i foldWide(__m512i acc, __m512i k,
                                                                  __m512i next) {
  const __m512i lo = _mm512_clmulepi64_epi128(acc, k, 0x00);
  const __m512i hi = _mm512_clmulepi64_epi128(acc, k, 0x11);
  return _mm512_ternarylogic_epi64(lo, hi, next, 0x96);  // lo ^ hi ^ next
}

__attribute__((DDPRUN_CRC32_WIDE_TARGET)) inline __m512i loadWide(const unsigned char* p) {
  return _mm512_loadu_si512(p);
}

// n >= 256.
__attribute__((DDPRUN_CRC32_WIDE_TARGET)) uint32_t crc32Wide(uint32_t crc, const unsigned char* p,
                                                             size_t n) {
  __m512i x0 = _mm512_xor_si512(loadWide(p),
                                _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(~crc))));
  __m512i x1 = loadWide(p + 64);
  __m512i x2 = loadWide(p + 128);
  __m512i x3 = loadWide(p + 192);
  p += 256;
  n -= 256;
  const __m512i k2048 = _mm512_set_epi64(kFold2048Hi, kFold2048Lo, kFold2048Hi, kFold2048Lo,
                                         kFold2048Hi, kFold2048Lo, kFold2048Hi, kFold2048Lo);
  while (n >= 256) {
    x0 = foldWide(x0, k2048, loadWide(p));
    x1 = foldWide(x1, k2048, loadWide(p + 64));
    x2 = foldWide(x2, k2048, loadWide(p + 128));
    x3 = foldWide(x3, k2048, loadWide(p + 192));
    p += 256;
    n -= 256;
  }
  const __m512i k512 = _mm512_set_epi64(kFold512Hi, kFold512Lo, kFold512Hi, kFold512Lo, kFold512Hi,
                                        kFold512Lo, kFold512Hi, kFold512Lo);
  __m512i x = foldWide(x0, k512, x1);
  x = foldWide(x, k512, x2);
  x = foldWide(x, k512, x3);
  while (n >= 64) {
    x = foldWide(x, k512, loadWide(p));
    p += 64;
    n -= 64;
  }
  alignas(64) unsigned char lanes[64];
  _mm512_store_si512(lanes, x);
  const __m128i k128 = _mm_set_epi64x(kFold128Hi, kFold128Lo);
  __m128i y = fold(load(lanes), k128, load(lanes + 16));
  y = fold(y, k128, load(lanes + 32));
  y = fold(y, k128, load(lanes + 48));
  return finishFolding(y, p, n);
}

Crc32Path detectPath() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("vpclmulqdq")) {
    return Crc32Path::kWide;
  }
  if (__builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse2")) return Crc32Path::kClmul;
  return Crc32Path::kPortable;
}

}  // namespace

Crc32Path crc32BestPath() {
  static const Crc32Path best = detectPath();
  return best;
}

uint32_t crc32UpdateVia(Crc32Path path, uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  path = std::min(path, crc32BestPath());
  if (path == Crc32Path::kWide && n >= 256) return crc32Wide(crc, p, n);
  if (path != Crc32Path::kPortable && n >= 64) return crc32Clmul(crc, p, n);
  return crc32Portable(crc, data, n);
}

#else

Crc32Path crc32BestPath() { return Crc32Path::kPortable; }

uint32_t crc32UpdateVia(Crc32Path, uint32_t crc, const void* data, size_t n) {
  return crc32Portable(crc, data, n);
}

#endif

uint32_t crc32Update(uint32_t crc, const void* data, size_t n) {
  return crc32UpdateVia(crc32BestPath(), crc, data, n);
}

const char* crc32PathName(Crc32Path path) {
  switch (path) {
    case Crc32Path::kWide:
      return "VPCLMULQDQ (AVX-512)";
    case Crc32Path::kClmul:
      return "PCLMULQDQ";
    case Crc32Path::kPortable:
      break;
  }
  return "zlib";
}

}  // namespace ddprun
