// Conversions between float and the 16-bit wire formats of gradient compression (bfloat16 and
// IEEE half), and the sums Gloo's ring applies to them. Pure C++ (no LibTorch, no Gloo): AVX2 and
// F16C where the CPU has them (chosen once, at run time), portable loops elsewhere. Results are
// bit-identical to LibTorch's conversions (c10::BFloat16, c10::Half: round to nearest even) for
// every non-NaN value; a NaN stays a NaN.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ddprun::worker::kernels {

// out[i] = bf16(in[i] / divisor): the division in float, then one rounding, as PyTorch's
// bf16_compress_hook does (div_ then to(bfloat16)).
void floatToBf16(const float* in, uint16_t* out, size_t n, float divisor);
void bf16ToFloat(const uint16_t* in, float* out, size_t n);
// The same for IEEE half (fp16_compress_hook).
void floatToHalf(const float* in, uint16_t* out, size_t n, float divisor);
void halfToFloat(const uint16_t* in, float* out, size_t n);

// Gloo reduce functions: c[i] = round(float(a[i]) + float(b[i])), c may alias a or b.
void sumBf16(void* c, const void* a, const void* b, size_t n);
void sumHalf(void* c, const void* a, const void* b, size_t n);

// p[i] = round(float(p[i]) * scale) (a sum's average, after the sum).
void scaleBf16(uint16_t* p, size_t n, float scale);
void scaleHalf(uint16_t* p, size_t n, float scale);

// The portable scalar conversions every path agrees with (exposed for tests).
uint16_t bf16FromFloat(float f);
float floatFromBf16(uint16_t h);
uint16_t halfFromFloat(float f);
float floatFromHalf(uint16_t h);

// Whether the vector paths are in use on this CPU ("avx2+f16c" or "portable").
const char* vectorPath();
// Tests: force the portable loops (true) or go back to the CPU's best (false).
void forcePortableForTesting(bool portable);

}  // namespace ddprun::worker::kernels
