// The leaders all-reduce, for hosts holding unequal numbers of ranks (topology.h): each host's sum
// in shared memory, the hosts' sum over the ring of their leaders (one rank per host), and the
// leader's result back to its host by a second shared-memory pass to which the others contribute
// zeros. Every rank ends with (x + 0 + ... + 0) * scale of the same x, so results are
// bit-identical across hosts; a host of one rank applies that arithmetic itself.
//
// A large buffer goes through in chunks, pipelined: while the leaders' ring (on a thread of its
// own) sums chunk i across the link, the host already reduces chunk i+1 and brings chunk i-1 back,
// so the link never waits for the shared-memory passes. Every rank of a host runs the same schedule
// of passes.
// Owned by the Gloo communicator; run() only on its op thread.
#pragma once

#include <ATen/core/Tensor.h>
#include <gloo/context.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "op_queue.h"
#include "shm_allreduce.h"

namespace ddprun::worker {

class LeadersAllReduce {
 public:
  // `shm`: this host's group (null on a host of one rank); `leaders`: the leaders' ring (this
  // host's leader only, null elsewhere). Both must outlive this object.
  LeadersAllReduce(ShmAllReduce* shm, std::shared_ptr<gloo::Context> leaders,
                   std::chrono::milliseconds timeout);
  ~LeadersAllReduce();  // stops the ring's thread before the ring goes away

  // In place; `scale` (1/size for an average, else 1) on the last pass.
  void run(at::Tensor& work, double scale);
  // From any thread: the leaders' ring fails what runs and what is queued (the shared-memory
  // group is its owner's to abort). Idempotent.
  void abort(const std::string& reason);

 private:
  ShmAllReduce* shm_;
  std::shared_ptr<gloo::Context> leaders_;
  std::chrono::milliseconds timeout_;
  uint32_t tag_ = 0;  // op thread only
  std::unique_ptr<OpQueue> ring_;
};

// What the shared-memory pass does to values when every other contribution is zero: each addition
// rounded in the value's own precision, then the scale applied.
void addZeroAndScale(void* data, std::size_t n, at::ScalarType dtype, double scale);

}  // namespace ddprun::worker
