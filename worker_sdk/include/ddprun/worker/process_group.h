// ProcessGroup: this worker's membership in the job (rank, world size), the rendezvous store and
// the communicator. initFromEnv() is what a training program calls: it reads the SPEC §3
// environment, rank 0 hosts the c10d TCPStore at MASTER_ADDR:MASTER_PORT, the others connect
// (bounded by connect_timeout), and the communicator bootstraps through that store.
// Lifetime: keep the group alive as long as any DDP model or Work uses it. Thread-safe.
//
// In-place recovery: under `ddprun --restart-mode=in-place` the worker gets DDPRUN_CONTROL_SOCKET;
// initFromEnv() then connects to the agent, whose welcome names the generation to form (store keys
// under prefix/g<generation>). When a peer fails the agent's `abort` interrupts the communicator
// (abort(), from the channel's thread) and the training thread re-forms the group with the
// agent's `group` (reform()). docs/in-place-recovery.md.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
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

class ControlClient;

// One generation of the group, as the agent's `group` message names it.
struct GroupSpec {
  int generation = 0;
  int rank = 0;
  int size = 1;
  std::string master_addr;
  int master_port = 0;
  std::string key;  // the generation's store namespace under ProcessGroupOptions::prefix ("g7")
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

  ~ProcessGroup();

  int rank() const { return rank_; }
  int size() const { return size_; }
  // The current generation's communicator: after reform() a new one (take it again).
  Communicator& comm() { return *comm_; }
  KeyValueStore& store() { return *store_; }

  // True when the agent's control channel is open (in-place recovery possible).
  bool inPlace() const { return control_ != nullptr; }
  // The generation this group formed last (0 without a control channel).
  int generation() const { return generation_.load(); }
  // The control channel, or null (the worker SDK's Trainer speaks through it).
  ControlClient* control() { return control_.get(); }
  // Any thread: interrupts the current communicator's collectives (Communicator::abort).
  void abort(const std::string& reason);
  // The training thread, once nothing uses the old communicator: drops it (it is aborted and
  // awaited first), opens the store of `spec` (rank 0 keeps the store it hosts at that port, or
  // hosts it; the others connect, within connect_timeout) and forms the new communicator under
  // prefix/<spec.key>. Throws CommError/ConfigError like initFromEnv; CommError as soon as the
  // agent aborts spec.generation while the ranks wait for each other in the store.
  void reform(const GroupSpec& spec);

 private:
  ProcessGroup(int rank, int size, std::shared_ptr<KeyValueStore> store,
               std::unique_ptr<Communicator> comm);
  int rank_;
  int size_;
  std::shared_ptr<KeyValueStore> store_;
  std::unique_ptr<Communicator> comm_;
  std::mutex comm_mu_;  // comm_'s replacement (reform) against abort() from another thread
  // What reform() needs to form the next generation the way this one was formed.
  ProcessGroupOptions options_;
  bool hosts_store_ = false;  // store_ is the server this rank hosts
  std::atomic<int> generation_{0};
  // Where the control channel's reader thread sends an agent's abort: a plain pointer, cleared
  // by the destructor, so that thread never holds (and never destroys) the group.
  struct AbortTarget;
  std::shared_ptr<AbortTarget> abort_target_;
  std::unique_ptr<ControlClient> control_;  // last: its thread stops first
};

}  // namespace ddprun::worker
