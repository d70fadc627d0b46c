// Gloo implementation of Communicator: libgloo's TCP transport, full mesh bootstrapped through
// the job's KeyValueStore via a gloo::rendezvous::Store adapter. CPU tensors only.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "ddprun/worker/communicator.h"
#include "ddprun/worker/store.h"

namespace ddprun::worker {

// Options of both communicator implementations.
struct GlooOptions {
  std::string local_address;  // address the Gloo transport binds (must be reachable by peers)
  std::string prefix;         // store key namespace
  std::chrono::milliseconds connect_timeout;
  std::chrono::milliseconds op_timeout;
  int cuda_device = 0;  // NCCL only
  // Gloo only: all-reduce through shared memory among the ranks on one host (topology.h).
  bool shared_memory = true;
  std::string host_identity;  // empty = this host's; tests simulate several hosts with it
};

// Empty when `gloo_function` (the address of one of libgloo's functions, as this process resolved
// it) lies in libgloo; otherwise the error a user sees: LibTorch 2.x exports a gloo of its own, and
// when it is loaded before libgloo the SDK's gloo calls would reach that copy and crash.
std::string glooBindingProblem(const void* gloo_function);

// Throws ConfigError with glooBindingProblem's text when this process binds gloo wrongly.
std::unique_ptr<Communicator> makeGlooCommunicator(int rank, int size,
                                                   std::shared_ptr<KeyValueStore> store,
                                                   const GlooOptions& options);

#ifdef DDPRUN_WITH_NCCL
std::unique_ptr<Communicator> makeNcclCommunicator(int rank, int size,
                                                   std::shared_ptr<KeyValueStore> store,
                                                   const GlooOptions& options);
#endif

}  // namespace ddprun::worker
