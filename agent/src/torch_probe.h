// TorchProbe: which PyTorch a Python program's workers will import, asked of their interpreter
// once per agent (`python -c` reading torch's package metadata, in the agent's environment, so
// nothing imports torch). The worker contract depends on it (WorkerEnvInputs::torch_version). It
// starts with the agent and runs while the rendezvous forms; result() waits for what is left of
// it, bounded, when the first workers are planned.
// Loop-only (not thread-safe). The child is killed and reaped by the destructor if still running.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "ddprun/agent/worker_env.h"

namespace ddprun::agent {

class TorchProbe {
 public:
  // Starts asking `interpreter`; an empty one (the program is not Python) or one that cannot be
  // started gives nullopt at once.
  explicit TorchProbe(const std::string& interpreter);
  ~TorchProbe();
  TorchProbe(const TorchProbe&) = delete;
  TorchProbe& operator=(const TorchProbe&) = delete;

  // The version the interpreter reported; nullopt when it has no torch, said something else, or
  // did not answer within `bound` (then it is killed). The first call decides; later calls
  // return the same.
  std::optional<TorchVersion> result(std::chrono::milliseconds bound);

 private:
  void finish();  // closes the pipe, kills and reaps the child

  pid_t pid_ = -1;
  int fd_ = -1;
  bool done_ = false;
  std::optional<TorchVersion> version_;
};

}  // namespace ddprun::agent
