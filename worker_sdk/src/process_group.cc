#include "ddprun/worker/process_group.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "control_client.h"
#include "ddprun/common/log_text.h"
#include "ddprun/worker/errors.h"
#include "gloo_communicator.h"

namespace ddprun::worker {

namespace {

// The local address on the route to `host`: connect() a UDP socket (sends nothing) and read the
// address the kernel picked. Falls back to loopback when the host cannot be resolved.
std::string localAddressToward(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 ||
      res == nullptr) {
    return "127.0.0.1";
  }
  std::string out = "127.0.0.1";
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    int fd = socket(ai->ai_family, SOCK_DGRAM, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      char buf[INET6_ADDRSTRLEN] = {0};
      const void* src =
          local.ss_family == AF_INET
              ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr)
              : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr);
      if (inet_ntop(local.ss_family, src, buf, sizeof(buf)) != nullptr) {
        out = buf;
        close(fd);
        break;
      }
    }
    close(fd);
  }
  freeaddrinfo(res);
  return out;
}

std::unique_ptr<Communicator> makeCommunicator(int rank, int size,
                                               std::shared_ptr<KeyValueStore> store,
                                               const ProcessGroupOptions& options,
                                               const std::string& address) {
  GlooOptions g{address,
                options.prefix,
                options.connect_timeout,
                options.op_timeout,
                std::max(options.cuda_device, 0),
                options.shared_memory,
                options.host_identity};
  if (options.backend == Backend::kNccl) {
#ifdef DDPRUN_WITH_NCCL
    return makeNcclCommunicator(rank, size, std::move(store), g);
#else
    throw ConfigError(
        "the nccl backend was requested but this build of ddprun's worker SDK has no NCCL support "
        "(it needs the CUDA toolkit and NCCL >= 2.14 at build time; see the configure line "
        "'ddprun worker SDK: NCCL backend ...'); use --backend gloo");
#endif
  }
  return makeGlooCommunicator(rank, size, std::move(store), g);
}

// Rank 0 hosts the store (unless the agent does); the others connect, within `timeout`.
std::shared_ptr<KeyValueStore> openStore(bool host, const std::string& addr, int port,
                                         std::chrono::milliseconds timeout,
                                         const KeyValueStore::Cancel& cancel = {}) {
  return host ? KeyValueStore::tcpServer(addr, port, timeout)
              : KeyValueStore::tcpClient(addr, port, timeout, cancel);
}

void checkRank(int rank, int size) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw ConfigError("process group: rank " + std::to_string(rank) + " is outside [0, " +
                      std::to_string(size - 1) + "]");
  }
}

}  // namespace

ProcessGroup::ProcessGroup(int rank, int size, std::shared_ptr<KeyValueStore> store,
                           std::unique_ptr<Communicator> comm)
    : rank_(rank), size_(size), store_(std::move(store)), comm_(std::move(comm)) {}

// The agent's abort's way to the group (see ProcessGroup::abort_target_).
struct ProcessGroup::AbortTarget {
  std::mutex mu;
  ProcessGroup* group = nullptr;            // guarded by mu; null once the group is being destroyed
  std::atomic<int> aborted_generation{-1};  // the highest generation the agent aborted

  // What the store's waits ask while generation `gen` is this process's: whether the agent
  // aborted it. Set from before it forms until the next one forms, so a wait of the generation
  // gives up at the abort, also one after the group formed (the DDP buckets' shared-memory
  // exchange, while a peer that died at start-up never publishes its key).
  static KeyValueStore::Cancel cancelFor(const std::shared_ptr<AbortTarget>& target, int gen) {
    return [target, gen]() -> std::string {
      return target->aborted_generation.load() >= gen
                 ? "the agent aborted generation " + std::to_string(gen)
                 : "";
    };
  }
};

std::shared_ptr<ProcessGroup> ProcessGroup::initFromEnv(const ProcessGroupOptions& options) {
  return initFromEnv(WorkerEnv::fromProcessEnv(), options);
}

std::shared_ptr<ProcessGroup> ProcessGroup::initFromEnv(const WorkerEnv& env,
                                                        const ProcessGroupOptions& options) {
  if (options.backend == Backend::kNccl && !ncclAvailable()) {
    makeCommunicator(env.rank, env.world_size, nullptr, options, "");  // throws the clear error
  }
  // Under --restart-mode=in-place the agent names the generation to form first.
  std::unique_ptr<ControlClient> control;
  auto target = std::make_shared<AbortTarget>();
  if (!env.control_socket.empty()) {
    control = ControlClient::connect(
        env.control_socket,
        std::min<std::chrono::milliseconds>(options.connect_timeout, std::chrono::seconds(30)),
        [target](int gen, const std::string& reason) {
          int seen = target->aborted_generation.load();
          while (gen > seen && !target->aborted_generation.compare_exchange_weak(seen, gen)) {
          }
          std::lock_guard<std::mutex> lock(target->mu);
          ProcessGroup* group = target->group;
          if (group != nullptr && gen >= group->generation()) {
            group->abort("aborted by the agent: " + reason);
          }
        });
  }
  const bool hosts = env.rank == 0 && !env.use_agent_store;
  std::shared_ptr<KeyValueStore> store =
      openStore(hosts, env.master_addr, env.master_port, options.connect_timeout);
  ProcessGroupOptions opts = options;
  if (opts.local_address.empty())
    opts.local_address = localAddressToward(env.master_addr, env.master_port);
  if (opts.cuda_device < 0) opts.cuda_device = env.local_rank;
  // A restarted group reuses MASTER_PORT with a fresh store, but keep keys per round anyway
  // (per generation under the agent's control: survivors of a recovery keep their store). The
  // key must be the same on every node: ddprun's round is; a restart count is each node's own (a
  // node that joined after a restart counts from 0), so it only stands in under torchrun.
  const int generation = control ? control->generation() : 0;
  ProcessGroupOptions first = opts;
  if (control) {
    first.prefix += "/g" + std::to_string(generation);
  } else if (env.round >= 0) {
    first.prefix += "/r" + std::to_string(env.round);
  } else {
    first.prefix += "/attempt" + std::to_string(env.restart_count);
  }
  static const ddprun::TextLogger log("worker");
  DDPRUN_LOG(log, kDebug,
             "rank " << env.rank << "/" << env.world_size << ": store " << env.master_addr << ":"
                     << env.master_port << ", gloo on " << opts.local_address);
  auto group = create(env.rank, env.world_size, store, first);
  // Once the first group formed (as under process mode: no recovery forms it), its later waits in
  // the store give up at the agent's abort of it, as a re-formed generation's do.
  if (control) store->setCancel(AbortTarget::cancelFor(target, generation));
  group->options_ = opts;  // reform() adds each generation's key to the prefix
  group->hosts_store_ = hosts;
  group->generation_ = generation;
  {
    std::lock_guard<std::mutex> lock(target->mu);
    target->group = group.get();
  }
  group->abort_target_ = std::move(target);
  group->control_ = std::move(control);
  return group;
}

std::shared_ptr<ProcessGroup> ProcessGroup::create(int rank, int size,
                                                   std::shared_ptr<KeyValueStore> store,
                                                   const ProcessGroupOptions& options) {
  checkRank(rank, size);
  if (!store) throw ConfigError("process group: store is null");
  const std::string address = options.local_address.empty() ? "127.0.0.1" : options.local_address;
  auto comm = makeCommunicator(rank, size, store, options, address);
  auto group = std::shared_ptr<ProcessGroup>(
      new ProcessGroup(rank, size, std::move(store), std::move(comm)));
  group->options_ = options;
  return group;
}

ProcessGroup::~ProcessGroup() {
  // No abort reaches a communicator being destroyed. (A weak_ptr locked on the reader thread
  // could make that thread the group's last owner: its destructor would then join itself.)
  if (abort_target_) {
    std::lock_guard<std::mutex> lock(abort_target_->mu);
    abort_target_->group = nullptr;
  }
  control_.reset();
}

void ProcessGroup::abort(const std::string& reason) {
  std::lock_guard<std::mutex> lock(comm_mu_);
  if (comm_) comm_->abort(reason);
}

void ProcessGroup::reform(const GroupSpec& spec) {
  checkRank(spec.rank, spec.size);
  std::unique_ptr<Communicator> old;
  {
    std::lock_guard<std::mutex> lock(comm_mu_);
    old = std::move(comm_);
  }
  if (old) {
    old->abort("re-forming the group as generation " + std::to_string(spec.generation));
    if (!old->awaitIdle(std::chrono::seconds(2))) {
      throw CommError(
          "process group: the old communicator's collective did not end within 2 s "
          "of its abort");
    }
    old.reset();
  }
  // Forming waits for the other ranks in the store. The agent aborts the generation when a node
  // is lost meanwhile: the waits then give up at once (CommError) instead of at the timeout.
  KeyValueStore::Cancel cancel;
  if (control_ && abort_target_) cancel = AbortTarget::cancelFor(abort_target_, spec.generation);
  // The store: rank 0 keeps the one it hosts at that port (the keys of each generation have their
  // own prefix); a new rank 0 hosts it; every other rank connects again (rank 0 may be new).
  const bool hosts = spec.rank == 0;
  if (!(hosts && hosts_store_ && store_ && store_->port() == spec.master_port)) {
    store_.reset();  // a client's connection, or a server's port, goes first
    store_ = openStore(hosts, spec.master_addr, spec.master_port, options_.connect_timeout, cancel);
    hosts_store_ = hosts;
  }
  ProcessGroupOptions opts = options_;
  opts.prefix += "/" + spec.key;
  const std::string address = opts.local_address.empty() ? "127.0.0.1" : opts.local_address;
  // The cancel holds while this generation forms and is this process's (AbortTarget::cancelFor).
  store_->setCancel(cancel);
  auto comm = makeCommunicator(spec.rank, spec.size, store_, opts, address);
  {
    std::lock_guard<std::mutex> lock(comm_mu_);
    comm_ = std::move(comm);
    rank_ = spec.rank;
    size_ = spec.size;
    generation_ = spec.generation;
    // An abort of this very generation that came while it formed.
    if (control_ && control_->abortedGeneration() >= spec.generation) {
      comm_->abort("the agent asked before the group formed");
    }
  }
}

}  // namespace ddprun::worker
