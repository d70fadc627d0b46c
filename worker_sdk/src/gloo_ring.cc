#include "gloo_ring.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <gloo/allreduce.h>
#include <gloo/math.h>

#include <string>

#include "ddprun/worker/errors.h"
#include "half_kernels.h"

namespace ddprun::worker {

namespace {

using ReduceFn = void (*)(void*, const void*, const void*, size_t);

template <typename T>
void runAllReduce(const std::shared_ptr<gloo::Context>& ctx, T* ptr, size_t n, uint32_t tag,
                  std::chrono::milliseconds timeout, ReduceFn sum = &gloo::sum<T>) {
  gloo::AllreduceOptions opts(ctx);
  opts.setOutput(ptr, n);
  opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
  opts.setReduceFunction(sum);
  opts.setTag(tag);
  opts.setTimeout(timeout);
  gloo::allreduce(opts);
}

}  // namespace

void allReduceBuffer(const std::shared_ptr<gloo::Context>& ctx, void* data, size_t n,
                     at::ScalarType dtype, uint32_t tag, std::chrono::milliseconds timeout) {
  switch (dtype) {
    case at::kFloat:
      return runAllReduce(ctx, static_cast<float*>(data), n, tag, timeout);
    case at::kDouble:
      return runAllReduce(ctx, static_cast<double*>(data), n, tag, timeout);
    case at::kLong:
      return runAllReduce(ctx, static_cast<int64_t*>(data), n, tag, timeout);
    case at::kInt:
      return runAllReduce(ctx, static_cast<int32_t*>(data), n, tag, timeout);
    // 16-bit floats are summed in float and rounded back with the SDK's kernels (AVX2/F16C
    // where the CPU has them; bit-identical to c10's conversions), eight values a step.
    case at::kHalf:
      return runAllReduce(ctx, static_cast<c10::Half*>(data), n, tag, timeout, &kernels::sumHalf);
    case at::kBFloat16:
      return runAllReduce(ctx, static_cast<c10::BFloat16*>(data), n, tag, timeout,
                          &kernels::sumBf16);
    default:
      throw WorkerError("all_reduce: dtype " + std::string(c10::toString(dtype)) +
                        " is not supported by the gloo backend");
  }
}

bool everyRankAgrees(const std::shared_ptr<gloo::Context>& ctx, bool mine, uint32_t tag,
                     std::chrono::milliseconds timeout) {
  int32_t ok = mine ? 1 : 0;
  gloo::AllreduceOptions opts(ctx);
  opts.setOutput(&ok, 1);
  opts.setReduceFunction(static_cast<ReduceFn>(&gloo::min<int32_t>));
  opts.setTag(tag);
  opts.setTimeout(timeout);
  gloo::allreduce(opts);
  return ok != 0;
}

}  // namespace ddprun::worker
