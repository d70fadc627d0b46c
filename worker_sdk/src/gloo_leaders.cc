#include "gloo_leaders.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "gloo_abort.h"
#include "gloo_dtypes.h"
#include "gloo_ring.h"
#include "half_kernels.h"

namespace ddprun::worker {

namespace {

// A buffer goes in about kChunks chunks of kMinChunk..kMaxChunk bytes (each chunk costs every rank
// of the host a wake-up, so not smaller), and the host's reduction runs kAhead chunks ahead of
// bringing results back.
constexpr size_t kChunks = 8;
constexpr size_t kMinChunk = size_t{2} << 20;
constexpr size_t kMaxChunk = size_t{8} << 20;
constexpr size_t kAhead = 2;

template <typename T>
void addZeroAndScaleAs(T* p, size_t n, double scale) {
  const T factor = static_cast<T>(scale);
  for (size_t i = 0; i < n; ++i) p[i] = scale != 1.0 ? (p[i] + T(0)) * factor : p[i] + T(0);
}

void addZeroAndScale16(bool bf16, uint16_t* p, size_t n, double scale) {
  for (size_t i = 0; i < n; ++i) {
    p[i] = bf16 ? kernels::bf16FromFloat(kernels::floatFromBf16(p[i]) + 0.0f)
                : kernels::halfFromFloat(kernels::floatFromHalf(p[i]) + 0.0f);
  }
  if (scale == 1.0) return;
  (bf16 ? kernels::scaleBf16 : kernels::scaleHalf)(p, n, static_cast<float>(scale));
}

}  // namespace

void addZeroAndScale(void* data, size_t n, at::ScalarType dtype, double scale) {
  if (dtype == at::kFloat) {
    addZeroAndScaleAs(static_cast<float*>(data), n, scale);
  } else if (dtype == at::kDouble) {
    addZeroAndScaleAs(static_cast<double*>(data), n, scale);
  } else if (dtype == at::kBFloat16 || dtype == at::kHalf) {
    addZeroAndScale16(dtype == at::kBFloat16, static_cast<uint16_t*>(data), n, scale);
  }  // integers: the sum is already exact
}

LeadersAllReduce::LeadersAllReduce(ShmAllReduce* shm, std::shared_ptr<gloo::Context> leaders,
                                   std::chrono::milliseconds timeout)
    : shm_(shm),
      leaders_(std::move(leaders)),
      timeout_(timeout),
      ring_(leaders_ ? std::make_unique<OpQueue>("gloo leaders ring") : nullptr) {}

LeadersAllReduce::~LeadersAllReduce() { ring_.reset(); }

void LeadersAllReduce::abort(const std::string& reason) {
  if (ring_) ring_->abort(reason);
  if (leaders_) shutdownGlooPairs(*leaders_);
}

void LeadersAllReduce::run(at::Tensor& work, double scale) {
  const size_t n = static_cast<size_t>(work.numel());
  const at::ScalarType dtype = work.scalar_type();
  const size_t elem = work.element_size();
  const size_t chunk =
      std::max<size_t>(1, std::clamp(n * elem / kChunks, kMinChunk, kMaxChunk) / elem);
  const size_t chunks = (n + chunk - 1) / chunk;
  char* base = static_cast<char*>(work.data_ptr());
  auto piece = [&](size_t i) {
    return std::make_pair(base + i * chunk * elem, std::min(chunk, n - i * chunk));
  };
  std::vector<std::shared_ptr<Work>> rings(chunks);
  auto reduce = [&](size_t i) {
    auto [p, count] = piece(i);
    if (shm_) shm_->allReduce(p, count, shmTypeOf(dtype), 1.0);
    if (!leaders_) return;
    const uint32_t tag = tag_++ & 0x7fffffffu;
    if (chunks == 1) {  // nothing to overlap: no thread hop
      allReduceBuffer(leaders_, p, count, dtype, tag, timeout_);
      return;
    }
    // The tensor rides along, so its memory outlives the ring even if this op throws.
    rings[i] = ring_->submit([this, work, p = p, count = count, dtype, tag] {
      allReduceBuffer(leaders_, p, count, dtype, tag, timeout_);
    });
  };
  auto finish = [&](size_t i) {
    auto [p, count] = piece(i);
    if (rings[i]) rings[i]->wait();
    if (shm_) {
      if (!leaders_) std::memset(p, 0, count * elem);
      shm_->allReduce(p, count, shmTypeOf(dtype), scale);
    } else {
      addZeroAndScale(p, count, dtype, scale);
    }
  };
  try {
    for (size_t i = 0; i < chunks + kAhead; ++i) {
      if (i < chunks) reduce(i);
      if (i >= kAhead) finish(i - kAhead);
    }
  } catch (...) {
    // No ring may still write into the buffer once the failure is reported.
    for (auto& ring : rings) {
      if (!ring) continue;
      try {
        ring->wait();
      } catch (...) {  // the first failure is the one reported
      }
    }
    throw;
  }
}

}  // namespace ddprun::worker
