// The 16-bit kernels of gradient compression against LibTorch's own conversions (what PyTorch's
// fp16/bf16 compress hooks use), on both the vector and the portable path.
#include "half_kernels.h"

#include <torch/torch.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace k = ddprun::worker::kernels;

namespace {

// Values that exercise every branch: zeros, float and half subnormals, the half normal boundary,
// rounding ties, the largest halfs and overflow, infinities and NaN, and a spread of magnitudes.
std::vector<float> trickyValues() {
  std::vector<float> v = {0.0f,
                          -0.0f,
                          1.0f,
                          -1.0f,
                          0x1p-149f,
                          -0x1p-130f,
                          0x1p-126f,
                          0x1p-25f,
                          0x1.000002p-25f,
                          0x1p-24f,
                          0x1.8p-24f,
                          0x1.4p-23f,
                          0x1p-14f,
                          0x1.ffcp-15f,
                          0x1.ffep-15f,
                          65504.0f,
                          65519.0f,
                          65520.0f,
                          1e10f,
                          -1e38f,
                          1.0009765625f,
                          1.00048828125f,
                          1.00146484375f,
                          3.0e38f,
                          std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN()};
  // Bit patterns at and around bfloat16 ties (low 16 bits 0x8000, 0x7fff, 0x8001).
  for (uint32_t hi : {0x3f80u, 0x3f81u, 0xc2f7u, 0x0001u, 0x7f7fu}) {
    for (uint32_t lo : {0x0000u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
      uint32_t u = hi << 16 | lo;
      float f;
      std::memcpy(&f, &u, sizeof(f));
      v.push_back(f);
    }
  }
  torch::manual_seed(5);
  auto r = torch::randn({997}) * torch::pow(10.0, torch::randint(-12, 8, {997}).to(torch::kFloat));
  for (int64_t i = 0; i < r.numel(); ++i) v.push_back(r[i].item<float>());
  return v;
}

std::vector<uint16_t> bitsOf(const torch::Tensor& t) {
  std::vector<uint16_t> out(static_cast<size_t>(t.numel()));
  std::memcpy(out.data(), t.data_ptr(), out.size() * 2);
  return out;
}

bool isNan16(uint16_t h, bool bf16) { return bf16 ? (h & 0x7fff) > 0x7f80 : (h & 0x7fff) > 0x7c00; }

// Equal bits, except that any NaN matches any NaN.
void checkSameBits(const std::vector<uint16_t>& ours, const std::vector<uint16_t>& torchs,
                   bool bf16, const std::vector<float>& inputs) {
  REQUIRE(ours.size() == torchs.size());
  for (size_t i = 0; i < ours.size(); ++i) {
    if (isNan16(torchs[i], bf16)) {
      CHECK(isNan16(ours[i], bf16));
      continue;
    }
    INFO("input " << inputs[i] << " (index " << i << ")");
    CHECK(ours[i] == torchs[i]);
  }
}

}  // namespace

TEST_CASE("16-bit conversions and sums are bit-identical to LibTorch's on both paths",
          "[worker][compression]") {
  const bool portable = GENERATE(false, true);
  k::forcePortableForTesting(portable);
  INFO("path: " << k::vectorPath());
  const std::vector<float> values = trickyValues();
  const auto n = static_cast<int64_t>(values.size());
  const torch::Tensor x = torch::from_blob(const_cast<float*>(values.data()), {n}).clone();
  for (const bool bf16 : {true, false}) {
    const auto dtype = bf16 ? torch::kBFloat16 : torch::kHalf;
    INFO((bf16 ? "bfloat16" : "half"));
    for (const float divisor : {1.0f, 3.0f, 8.0f}) {
      INFO("divisor " << divisor);
      std::vector<uint16_t> ours(values.size());
      (bf16 ? k::floatToBf16 : k::floatToHalf)(values.data(), ours.data(), values.size(), divisor);
      checkSameBits(ours, bitsOf(x.div(divisor).to(dtype)), bf16, values);
    }
    // Back to float: exact, for every 16-bit pattern.
    std::vector<uint16_t> all(65536);
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
    const torch::Tensor wire =
        torch::from_blob(all.data(), {65536}, torch::kShort).clone().view(dtype);
    const torch::Tensor expect = wire.to(torch::kFloat);
    std::vector<float> back(all.size());
    (bf16 ? k::bf16ToFloat : k::halfToFloat)(all.data(), back.data(), all.size());
    for (size_t i = 0; i < all.size(); ++i) {
      const float e = expect[static_cast<int64_t>(i)].item<float>();
      if (std::isnan(e)) {
        CHECK(std::isnan(back[i]));
      } else if (std::memcmp(&e, &back[i], sizeof(float)) != 0) {
        FAIL_CHECK("pattern " << i << ": " << back[i] << " != " << e);
      }
    }
    // The sum Gloo's ring applies, against LibTorch's float sum rounded once.
    const torch::Tensor a = x.to(dtype);
    const torch::Tensor b = x.flip(0).mul(0.75).to(dtype);
    std::vector<uint16_t> sum(values.size());
    (bf16 ? k::sumBf16 : k::sumHalf)(sum.data(), a.data_ptr(), b.data_ptr(), values.size());
    checkSameBits(sum, bitsOf((a.to(torch::kFloat) + b.to(torch::kFloat)).to(dtype)), bf16, values);
  }
  k::forcePortableForTesting(false);
}
