// GlooCommunicator: the Communicator of the gloo backend, over a Gloo full mesh of CPU ranks.
// all_reduce takes the route the group planned when it formed (gloo_plan.h) as the call allows
// (allreduce_route.h): Gloo's TCP ring (gloo_ring.h), shared memory within a host
// (shm_allreduce.h) with a ring per local index across hosts, or the leaders' pipeline
// (gloo_leaders.h). broadcast, all_gather and barrier are Gloo's own.
// Threading: collectives run in submission order on the op queue's thread (OpQueue); any thread
// submits. Made by makeGlooCommunicator.
#pragma once

#include <gloo/context.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "ddprun/worker/communicator.h"
#include "gloo_leaders.h"
#include "gloo_plan.h"
#include "op_queue.h"

namespace ddprun::worker {

class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(int rank, int size, std::shared_ptr<gloo::Context> ctx,
                   std::chrono::milliseconds timeout, AllReducePlan plan);

  std::string describe() const override { return "gloo: all_reduce over " + description_; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Backend backend() const override { return Backend::kGloo; }
  at::Device device() const override { return at::kCPU; }

  std::shared_ptr<Work> allReduceAsync(at::Tensor tensor, ReduceOp op) override;
  std::shared_ptr<Work> broadcastAsync(at::Tensor tensor, int root) override {
    return broadcastIfLackingAsync(std::move(tensor), root, true);
  }
  std::shared_ptr<Work> broadcastIfLackingAsync(at::Tensor tensor, int root, bool lacking) override;
  std::shared_ptr<Work> allGatherAsync(at::Tensor input, at::Tensor output) override;
  std::shared_ptr<Work> barrierAsync() override;
  at::Tensor allocateBuffer(int64_t numel, const at::TensorOptions& options) override;
  bool buffersOutliveAbort() const override { return shm_ != nullptr; }
  void abort(const std::string& reason) override;
  bool awaitIdle(std::chrono::milliseconds timeout) override { return queue_.waitIdle(timeout); }
  // The leaders' route pads with +0.0 (gloo_leaders.cc).
  bool sumOfZerosIsExact() const override { return leaders_ == nullptr; }
  // Over shared memory when one host holds every rank; otherwise Gloo's broadcast.
  bool broadcastIsPipelined() const override { return shm_ != nullptr && shm_->size() == size_; }

 private:
  // The all-reduce itself, on the op thread.
  void allReduceNow(const at::Tensor& tensor, ReduceOp op, uint32_t tag);
  uint32_t nextTag() { return tag_.fetch_add(1) & 0x7fffffffu; }

  const int rank_;
  const int size_;
  const std::shared_ptr<gloo::Context> ctx_;
  const std::chrono::milliseconds timeout_;
  std::atomic<uint32_t> tag_{0};
  std::unique_ptr<ShmAllReduce> shm_;      // this host's ranks, when all_reduce uses shared memory
  std::shared_ptr<gloo::Context> column_;  // the same local index on every host (hierarchical)
  uint32_t column_tag_ = 0;                // op thread only
  std::unique_ptr<LeadersAllReduce> leaders_;  // the leaders plan only
  const std::string description_;
  OpQueue queue_;  // last member: its thread stops before the rest goes away
};

}  // namespace ddprun::worker
