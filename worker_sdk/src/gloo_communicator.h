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

std::unique_ptr<Communicator> makeGlooCommunicator(int rank, int size,
                                                   std::shared_ptr<KeyValueStore> store,
                                                   const GlooOptions& options);

#ifdef DDPRUN_WITH_NCCL
std::unique_ptr<Communicator> makeNcclCommunicator(int rank, int size,
                                                   std::shared_ptr<KeyValueStore> store,
                                                   const GlooOptions& options);
#endif

}  // namespace ddprun::worker
