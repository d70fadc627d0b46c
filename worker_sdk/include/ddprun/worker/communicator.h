// Communicator: the collectives DDP and the training loop need (all_reduce, broadcast, barrier,
// all_gather) over one process group. Implementations: Gloo (CPU tensors, libgloo TCP) and NCCL
// (CUDA tensors; only in builds with CUDA + NCCL, see DDPRUN_WITH_NCCL).
//
// Threading: every *Async call enqueues the operation and returns at once; operations run in
// submission order on the communicator's own thread, so all ranks must submit collectives in the
// same order (as with c10d). Tensors passed in must stay alive and untouched until wait() returns.
// Any thread may submit; Work objects may be waited on from any thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace ddprun::worker {

enum class ReduceOp { kSum, kAvg };
enum class Backend { kGloo, kNccl };

// Parses "gloo" / "nccl"; throws ConfigError otherwise.
Backend parseBackend(const std::string& name);
std::string backendName(Backend backend);
// True when this build contains the NCCL communicator.
bool ncclAvailable();

// Handle to one asynchronous collective.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the operation finished; rethrows its failure as CommError.
  virtual void wait() = 0;
  virtual bool isCompleted() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Backend backend() const = 0;
  // Where the tensors handed to this communicator's collectives must live: the CPU for gloo,
  // this rank's cuda:N for NCCL. The SDK's rule (worker_sdk/README.md, "Tensors and devices"):
  // every tensor the SDK hands to a collective is made on, or moved to, this device.
  virtual at::Device device() const = 0;
  // One line on how collectives run here (e.g. "gloo: all_reduce over shared memory (...)").
  virtual std::string describe() const { return backendName(backend()); }

  // In place. kAvg divides by size() (floating dtypes only).
  virtual std::shared_ptr<Work> allReduceAsync(at::Tensor tensor, ReduceOp op) = 0;
  // In place: every rank ends with root's values.
  virtual std::shared_ptr<Work> broadcastAsync(at::Tensor tensor, int root) = 0;
  // As broadcastAsync, for a rank that may already hold root's values bit for bit (`lacking`
  // false): a communicator that can skip writing them there (Gloo's shared memory) does. Every
  // rank still takes part; the default broadcasts.
  virtual std::shared_ptr<Work> broadcastIfLackingAsync(at::Tensor tensor, int root, bool lacking) {
    (void)lacking;
    return broadcastAsync(std::move(tensor), root);
  }
  // `output` holds size() * input.numel() elements, rank r's input at offset r * numel.
  virtual std::shared_ptr<Work> allGatherAsync(at::Tensor input, at::Tensor output) = 0;
  virtual std::shared_ptr<Work> barrierAsync() = 0;

  // A zeroed 1-D tensor for data this communicator will all-reduce again and again (DDP's
  // gradient buckets). Collective: every rank allocates the same sizes in the same order. The
  // Gloo communicator's shared-memory path places it where peers read it in place (no staging
  // copy per all-reduce); otherwise, and by default, it is at::zeros. After an in-place recovery
  // the shared-memory path may hand back the aborted group's buffer of the same place, size and
  // order, with what that group left in it, while a tensor of it is still held.
  virtual at::Tensor allocateBuffer(int64_t numel, const at::TensorOptions& options);
  // Whether buffers pass from an aborted group to the next one's allocateBuffer (the
  // shared-memory path, on both groups): only then is holding the old ones until the new ones are
  // allocated worth their memory.
  virtual bool buffersOutliveAbort() const { return false; }

  // In-place recovery: interrupts this communicator for good. The collective running fails with
  // CommError soon after (Gloo: its sockets are shut down; shared memory: its barrier wakes;
  // NCCL: ncclCommAbort), queued and later ones fail at once. Thread-safe, idempotent, does not
  // wait and touches no tensor. The default has nothing to interrupt.
  virtual void abort(const std::string& reason) { (void)reason; }
  // True once no collective runs or is queued (after abort(): they have all failed), waiting at
  // most `timeout`. Only then may the tensors handed to this communicator be dropped.
  virtual bool awaitIdle(std::chrono::milliseconds timeout) {
    (void)timeout;
    return true;
  }
  // True when an all-reduce sum of float32/64, float16, bfloat16, int32 or int64 to which every
  // rank but one adds -0.0 (0 for integers) hands every rank that rank's values bit for bit (NaN
  // payloads aside): x + -0.0 == x. False on a route that adds +0.0 of its own (-0.0 would become
  // +0.0), where only broadcast copies exactly.
  virtual bool sumOfZerosIsExact() const { return true; }
  // True when broadcast moves the root's bytes over each link once (NCCL's ring, one host's
  // shared memory), as fast as an all-reduce or faster; false when the root sends them to each
  // rank in turn (Gloo over TCP), where an all-reduce of zeros onto the root's values is faster.
  virtual bool broadcastIsPipelined() const { return false; }

  void allReduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  void broadcast(const at::Tensor& tensor, int root = 0);
  // Returns one tensor per rank, each shaped like `input`.
  std::vector<at::Tensor> allGather(const at::Tensor& input);
  void barrier();
};

}  // namespace ddprun::worker
