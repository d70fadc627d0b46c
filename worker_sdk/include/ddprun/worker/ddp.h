// DistributedDataParallel for LibTorch's C++ frontend: wraps a torch::nn::Module so that, after
// loss.backward(), every parameter's gradient is the average over all ranks of the process group.
//
// How: parameters are bucketed (computeBucketAssignment: reverse parameter order, first bucket
// 1 MiB, then bucket_cap_mb). A post-hook on each parameter's gradient accumulator copies the
// fresh gradient into its bucket's flat buffer (after the first step the gradient is accumulated
// there in place); when a bucket is complete its averaging all-reduce (kAvg) is launched
// asynchronously (in bucket order, identical on every rank), overlapping the rest of backward. An
// autograd final callback waits for all buckets and writes the averaged gradients back before
// backward() returns, so the optimizer step needs nothing extra.
//
// Threading: one DDP object per rank; forward/backward from one thread at a time. The module and
// the process group must outlive this object. Parameters and buffers are broadcast from rank 0 in
// the constructor (a collective: every rank must construct at the same point).
#pragma once

#include <torch/nn/module.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ddprun/worker/communicator.h"
#include "ddprun/worker/process_group.h"

namespace ddprun::worker {

// One bucket handed to a communication hook: its flat 1-D gradient buffer (the parameters'
// dtype) and its index (bucket 0 is reduced first).
struct GradBucket {
  std::size_t index = 0;
  at::Tensor buffer;
};

// A communication hook (PyTorch DDP's register_comm_hook): starts the reduction of `bucket` and
// returns its work; once that work's wait() returned, bucket.buffer must hold the average of the
// bucket over all ranks, bit-identical on every rank. Called in bucket order, the same on every
// rank, from whichever thread completed the bucket (an autograd thread during backward).
using CommHook = std::function<std::shared_ptr<Work>(Communicator& comm, const GradBucket& bucket)>;

// Gradient compression on the wire, as PyTorch's fp16_compress_hook / bf16_compress_hook.
enum class Compression { kNone, kFp16, kBf16 };
// "none", "fp16" or "bf16"; ConfigError naming the choices otherwise.
Compression parseCompression(const std::string& name);
std::string compressionName(Compression compression);

// The default hook: an averaging all-reduce of the bucket in its own dtype.
CommHook allReduceHook();
// Divides the bucket by the world size (before the cast, so large gradients cannot overflow
// fp16), casts it to `wire_dtype` (at::kHalf or at::kBFloat16), sums that over all ranks, and
// casts the result back into the bucket when the work is waited on. Halves the bytes on the wire
// for float32 gradients; results carry the wire dtype's precision.
CommHook compressHook(at::ScalarType wire_dtype);
// The hook for `compression` (allReduceHook() for kNone).
CommHook hookFor(Compression compression);

struct DdpOptions {
  double bucket_cap_mb = 25.0;
  double first_bucket_mb = 1.0;
  // Allow parameters that receive no gradient in some iteration (their gradient counts as zero).
  // When false, such a parameter makes backward() throw, naming it.
  bool find_unused_parameters = false;
  // false: launch every bucket only after backward finished (no overlap; for measurements).
  bool overlap = true;
  // Make each parameter's .grad alias its slice of the bucket buffer (after the first backward),
  // so gradients accumulate straight into the buckets and nothing is copied back after the
  // all-reduce. Saves two passes over all gradients per step.
  bool gradient_as_bucket_view = true;
  // Casts each bucket to 16 bits for the all-reduce (see compressHook).
  Compression compression = Compression::kNone;
  // When set, reduces every bucket instead of the hook `compression` names.
  CommHook comm_hook;
  // false: every rank holds the same parameters and buffers already (the Trainer's state sync in
  // an in-place recovery sent them), so the constructor does not broadcast rank 0's. The same
  // value on every rank.
  bool broadcast_parameters = true;
};

class DistributedDataParallel {
 public:
  DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                          std::shared_ptr<ProcessGroup> group, const DdpOptions& options = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  torch::nn::Module& module() { return *module_; }
  ProcessGroup& group() { return *group_; }

  // RAII scope in which backward passes only accumulate local gradients (no communication); the
  // first backward after the scope ends synchronises the accumulated gradients.
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(DistributedDataParallel& ddp);
    ~NoSyncGuard();
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    DistributedDataParallel& ddp_;
    bool previous_;
  };
  NoSyncGuard noSync() { return NoSyncGuard(*this); }

  // Broadcasts the module's buffers (e.g. BatchNorm statistics) from rank 0.
  void syncBuffers();

  // Waits for outstanding bucket all-reduces and writes gradients back. Runs automatically at the
  // end of every synchronised backward; calling it again is a no-op.
  void finalize();

  // Bucket layout as parameter indices (into module().parameters() with requires_grad), bucket 0
  // reduced first.
  const std::vector<std::vector<std::size_t>>& bucketIndices() const { return bucket_indices_; }

  // The buckets' flat buffers. An in-place recovery holds them while it builds the next group's
  // DistributedDataParallel, whose buckets may then take the same memory over (see
  // Communicator::allocateBuffer).
  std::vector<torch::Tensor> bucketBuffers() const;

 private:
  struct Bucket;
  struct Iteration;
  // Construction, in order.
  void checkPlacement(Communicator& comm) const;
  void checkSameModel(Communicator& comm) const;
  void buildBuckets(Communicator& comm);
  void registerHooks();

  void onGradReady(std::size_t param_index);
  void finalizeBackward();

  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<ProcessGroup> group_;
  DdpOptions options_;
  std::vector<torch::Tensor> params_;
  std::vector<std::string> names_;
  // One per parameter: removes its gradient accumulator's post hook (and keeps the accumulator
  // alive until then).
  std::vector<std::function<void()>> remove_hooks_;
  std::vector<std::vector<std::size_t>> bucket_indices_;
  CommHook hook_;
  std::vector<std::unique_ptr<Bucket>> buckets_;
  std::vector<std::size_t> bucket_of_;  // param index -> bucket
  std::vector<std::size_t> offset_of_;  // param index -> element offset in its bucket
  std::vector<torch::Tensor> views_;  // param index -> its slice of the bucket, shaped as the param
  // What one backward pass changes, under a mutex: gradient hooks run on autograd threads.
  std::unique_ptr<Iteration> iteration_;
};

}  // namespace ddprun::worker
