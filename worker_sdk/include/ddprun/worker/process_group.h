// ProcessGroup: this worker's membership in the job (rank, world size), the rendezvous store and
// the communicator. initFromEnv() is what a training program calls: it reads the SPEC §3
// environment, rank 0 hosts the c10d TCPStore at MASTER_ADDR:MASTER_PORT, the others connect
// (bounded by connect_timeout), and the communicator bootstraps through that store.
// Lifetime: keep the group alive as long as any DDP model or Work uses it. Thread-safe.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "ddprun/worker/communicator.h"
#include "ddprun/worker/env.h"
#include "ddprun/worker/store.h"

namespace ddprun::worker {

struct ProcessGroupOptions {
  Backend backend = Backend::kGloo;
  std::chrono::milliseconds connect_timeout = std::chrono::minutes(5);
  std::chrono::milliseconds op_timeout = std::chrono::minutes(10);
  // Address the Gloo transport binds; empty = the local address that routes to the store host.
  std::string local_address;
  // Namespace for the store keys this group writes (several groups may share one store).
  std::string prefix = "ddprun/pg0";
  // NCCL: the CUDA device of this rank; -1 = LOCAL_RANK (initFromEnv) or 0 (create).
  int cuda_device = -1;
  // Gloo: when every rank turns out to share this host, all-reduce through a shared-memory
  // segment instead of TCP loopback (broadcast, all_gather and barrier stay on Gloo). Off when
  // false here or DDPRUN_SHM=0 in any rank's environment.
  bool shared_memory = true;
  // With several hosts holding the same number of ranks each, all_reduce is hierarchical: shared
  // memory within each host, Gloo rings across hosts. Ranks are on one host when they share the
  // kernel (boot id, pid namespace); a non-empty value here replaces that identity, which lets
  // tests simulate several hosts with thread ranks.
  std::string host_identity;
};

class ProcessGroup : public std::enable_shared_from_this<ProcessGroup> {
 public:
  static std::shared_ptr<ProcessGroup> initFromEnv(const ProcessGroupOptions& options = {});
  static std::shared_ptr<ProcessGroup> initFromEnv(const WorkerEnv& env,
                                                   const ProcessGroupOptions& options = {});
  // Explicit form (thread-ranks in tests): every rank passes the same store.
  static std::shared_ptr<ProcessGroup> create(int rank, int size,
                                              std::shared_ptr<KeyValueStore> store,
                                              const ProcessGroupOptions& options = {});

  int rank() const { return rank_; }
  int size() const { return size_; }
  Communicator& comm() { return *comm_; }
  KeyValueStore& store() { return *store_; }

 private:
  ProcessGroup(int rank, int size, std::shared_ptr<KeyValueStore> store,
               std::unique_ptr<Communicator> comm);
  int rank_;
  int size_;
  std::shared_ptr<KeyValueStore> store_;
  std::unique_ptr<Communicator> comm_;
};

}  // namespace ddprun::worker
