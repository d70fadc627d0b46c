#include "half_kernels.h"

#include <atomic>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define DDPRUN_X86_KERNELS 1
#endif

namespace ddprun::worker::kernels {

namespace {

uint32_t bitsOf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float floatOf(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

}  // namespace

uint16_t bf16FromFloat(float f) {
  const uint32_t u = bitsOf(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN: the quiet NaN c10 writes
  // Round to nearest, ties to even: add just under half an ulp, plus the kept lsb.
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

float floatFromBf16(uint16_t h) { return floatOf(static_cast<uint32_t>(h) << 16); }

uint16_t halfFromFloat(float f) {
  const uint32_t u = bitsOf(f);
  const auto sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00;  // NaN
  if (a < 0x38800000u) {
    // Below half's smallest normal (2^-14): a multiple of 2^-24. Adding 0.5f, whose ulp is
    // 2^-24, makes the float adder do the rounding (nearest even); 0x400 is the smallest normal.
    return sign | static_cast<uint16_t>(bitsOf(floatOf(a) + 0.5f) - 0x3f000000u);
  }
  // Normal: rebias the exponent (127 -> 15) and round the 23-bit mantissa to 10 bits.
  const uint32_t rounded = (a + 0xfffu + ((a >> 13) & 1u)) - 0x38000000u;
  if (rounded >= (0x7c00u << 13)) return sign | 0x7c00;  // overflow (and inf): infinity
  return sign | static_cast<uint16_t>(rounded >> 13);
}

float floatFromHalf(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t m = h & 0x3ffu;
  if (e == 0x1f) return floatOf(sign | 0x7f800000u | (m << 13));  // inf, NaN
  if (e == 0) {
    const float v = static_cast<float>(m) * 0x1p-24f;  // zero or subnormal: exact
    return sign ? -v : v;
  }
  return floatOf(sign | ((e + 112) << 23) | (m << 13));
}

namespace {

// ---- portable loops ----

void floatToBf16Portable(const float* in, uint16_t* out, size_t n, float divisor) {
  for (size_t i = 0; i < n; ++i) out[i] = bf16FromFloat(in[i] / divisor);
}
void bf16ToFloatPortable(const uint16_t* in, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = floatFromBf16(in[i]);
}
void floatToHalfPortable(const float* in, uint16_t* out, size_t n, float divisor) {
  for (size_t i = 0; i < n; ++i) out[i] = halfFromFloat(in[i] / divisor);
}
void halfToFloatPortable(const uint16_t* in, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = floatFromHalf(in[i]);
}
void sumBf16Portable(uint16_t* c, const uint16_t* a, const uint16_t* b, size_t n) {
  for (size_t i = 0; i < n; ++i) c[i] = bf16FromFloat(floatFromBf16(a[i]) + floatFromBf16(b[i]));
}
void sumHalfPortable(uint16_t* c, const uint16_t* a, const uint16_t* b, size_t n) {
  for (size_t i = 0; i < n; ++i) c[i] = halfFromFloat(floatFromHalf(a[i]) + floatFromHalf(b[i]));
}

#ifdef DDPRUN_X86_KERNELS

// ---- AVX2 + F16C: eight values a step, the portable loop for the tail ----

#define DDPRUN_AVX2 __attribute__((target("avx2,f16c")))

DDPRUN_AVX2 __m256 load8Bf16(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

DDPRUN_AVX2 void store8Bf16(uint16_t* p, __m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  // Every lane is <= 0xffff: unsigned saturation packs without change; the pack works per
  // 128-bit half, so qwords 0 and 2 hold the eight results.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

DDPRUN_AVX2 __m256 load8Half(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

DDPRUN_AVX2 void store8Half(uint16_t* p, __m256 x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}

// One loop per operation, instantiated for each format by its 8-wide load/store and its
// portable loop (which takes the tail).
using Load8 = __m256 (*)(const uint16_t*);
using Store8 = void (*)(uint16_t*, __m256);

template <Store8 store, void (*tail)(const float*, uint16_t*, size_t, float)>
DDPRUN_AVX2 void castAvx2(const float* in, uint16_t* out, size_t n, float divisor) {
  const __m256 d = _mm256_set1_ps(divisor);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) store(out + i, _mm256_div_ps(_mm256_loadu_ps(in + i), d));
  tail(in + i, out + i, n - i, divisor);
}

template <Load8 load, void (*tail)(const uint16_t*, float*, size_t)>
DDPRUN_AVX2 void widenAvx2(const uint16_t* in, float* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, load(in + i));
  tail(in + i, out + i, n - i);
}

template <Load8 load, Store8 store,
          void (*tail)(uint16_t*, const uint16_t*, const uint16_t*, size_t)>
DDPRUN_AVX2 void sumAvx2(uint16_t* c, const uint16_t* a, const uint16_t* b, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) store(c + i, _mm256_add_ps(load(a + i), load(b + i)));
  tail(c + i, a + i, b + i, n - i);
}

constexpr auto floatToBf16Avx2 = &castAvx2<store8Bf16, floatToBf16Portable>;
constexpr auto floatToHalfAvx2 = &castAvx2<store8Half, floatToHalfPortable>;
constexpr auto bf16ToFloatAvx2 = &widenAvx2<load8Bf16, bf16ToFloatPortable>;
constexpr auto halfToFloatAvx2 = &widenAvx2<load8Half, halfToFloatPortable>;
constexpr auto sumBf16Avx2 = &sumAvx2<load8Bf16, store8Bf16, sumBf16Portable>;
constexpr auto sumHalfAvx2 = &sumAvx2<load8Half, store8Half, sumHalfPortable>;

bool cpuHasAvx2F16c() {
  __builtin_cpu_init();
  // avx2 includes the OS's consent to the AVX state (XGETBV); F16C is CPUID leaf 1, ECX bit 29
  // (clang's __builtin_cpu_supports has no name for it).
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & (1u << 29)) != 0;
  return __builtin_cpu_supports("avx2") && f16c;
}

#endif  // DDPRUN_X86_KERNELS

std::atomic<bool> forced_portable{false};

bool useVector() {
#ifdef DDPRUN_X86_KERNELS
  static const bool has = cpuHasAvx2F16c();
  return has && !forced_portable.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

}  // namespace

#ifdef DDPRUN_X86_KERNELS
#define DDPRUN_DISPATCH(name, ...) \
  (useVector() ? name##Avx2(__VA_ARGS__) : name##Portable(__VA_ARGS__))
#else
#define DDPRUN_DISPATCH(name, ...) name##Portable(__VA_ARGS__)
#endif

void floatToBf16(const float* in, uint16_t* out, size_t n, float divisor) {
  DDPRUN_DISPATCH(floatToBf16, in, out, n, divisor);
}
void bf16ToFloat(const uint16_t* in, float* out, size_t n) {
  DDPRUN_DISPATCH(bf16ToFloat, in, out, n);
}
void floatToHalf(const float* in, uint16_t* out, size_t n, float divisor) {
  DDPRUN_DISPATCH(floatToHalf, in, out, n, divisor);
}
void halfToFloat(const uint16_t* in, float* out, size_t n) {
  DDPRUN_DISPATCH(halfToFloat, in, out, n);
}
void sumBf16(void* c, const void* a, const void* b, size_t n) {
  DDPRUN_DISPATCH(sumBf16, static_cast<uint16_t*>(c), static_cast<const uint16_t*>(a),
                  static_cast<const uint16_t*>(b), n);
}
void sumHalf(void* c, const void* a, const void* b, size_t n) {
  DDPRUN_DISPATCH(sumHalf, static_cast<uint16_t*>(c), static_cast<const uint16_t*>(a),
                  static_cast<const uint16_t*>(b), n);
}

void scaleBf16(uint16_t* p, size_t n, float scale) {
  for (size_t i = 0; i < n; ++i) p[i] = bf16FromFloat(floatFromBf16(p[i]) * scale);
}
void scaleHalf(uint16_t* p, size_t n, float scale) {
  for (size_t i = 0; i < n; ++i) p[i] = halfFromFloat(floatFromHalf(p[i]) * scale);
}

const char* vectorPath() { return useVector() ? "avx2+f16c" : "portable"; }

void forcePortableForTesting(bool portable) { forced_portable.store(portable); }

}  // namespace ddprun::worker::kernels
