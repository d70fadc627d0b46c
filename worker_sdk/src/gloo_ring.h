// Gloo's own collectives on plain buffers, as the Gloo communicator's algorithms use them: the
// ring all-reduce of a CPU buffer (reduce-scatter then all-gather around the ring, each rank's
// share cut into segments of at most 1 MiB with two in flight: the algorithm torch.distributed
// uses on gloo), and a vote of every rank of a context.
// Blocking; callers run them on their communicator's op thread, with tags every rank issues alike.
#pragma once

#include <c10/core/ScalarType.h>
#include <gloo/context.h>

#include <chrono>
#include <cstdint>
#include <memory>

namespace ddprun::worker {

// Sums `n` elements of `dtype` (float, double, int64, int32, half, bfloat16) at `data` over every
// rank of `ctx`, in place. Throws WorkerError for another dtype; Gloo's errors as they come.
void allReduceBuffer(const std::shared_ptr<gloo::Context>& ctx, void* data, std::size_t n,
                     at::ScalarType dtype, uint32_t tag, std::chrono::milliseconds timeout);

// Whether `mine` holds on every rank of `ctx` (a min all-reduce): collective.
bool everyRankAgrees(const std::shared_ptr<gloo::Context>& ctx, bool mine, uint32_t tag,
                     std::chrono::milliseconds timeout);

}  // namespace ddprun::worker
