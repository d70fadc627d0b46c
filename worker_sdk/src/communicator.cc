#include "ddprun/worker/communicator.h"

#include <ATen/ATen.h>

#include "ddprun/common/strings.h"
#include "ddprun/worker/errors.h"

namespace ddprun::worker {

Backend parseBackend(const std::string& name) {
  const std::string n = ddprun::toLower(ddprun::trim(name));
  if (n == "gloo") return Backend::kGloo;
  if (n == "nccl") return Backend::kNccl;
  throw ConfigError("unknown backend '" + name + "': expected gloo or nccl");
}

std::string backendName(Backend backend) { return backend == Backend::kGloo ? "gloo" : "nccl"; }

bool ncclAvailable() {
#ifdef DDPRUN_WITH_NCCL
  return true;
#else
  return false;
#endif
}

at::Tensor Communicator::allocateBuffer(int64_t numel, const at::TensorOptions& options) {
  return at::zeros({numel}, options);
}

void Communicator::allReduce(const at::Tensor& tensor, ReduceOp op) {
  allReduceAsync(tensor, op)->wait();
}

void Communicator::broadcast(const at::Tensor& tensor, int root) {
  broadcastAsync(tensor, root)->wait();
}

std::vector<at::Tensor> Communicator::allGather(const at::Tensor& input) {
  at::Tensor out = at::empty({static_cast<int64_t>(size()) * input.numel()}, input.options());
  allGatherAsync(input, out)->wait();
  std::vector<at::Tensor> parts;
  parts.reserve(static_cast<size_t>(size()));
  for (int r = 0; r < size(); ++r) {
    parts.push_back(out.narrow(0, r * input.numel(), input.numel()).view(input.sizes()));
  }
  return parts;
}

void Communicator::barrier() { barrierAsync()->wait(); }

}  // namespace ddprun::worker
