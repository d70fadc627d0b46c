#include "gloo_communicator.h"

#include <ATen/ATen.h>
#include <dlfcn.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <iomanip>

#include "ddprun/common/log_text.h"
#include "ddprun/worker/errors.h"
#include "half_kernels.h"
#include "op_queue.h"
#include "shm_allreduce.h"
#include "topology.h"

namespace ddprun::worker {

namespace {

// gloo::rendezvous::Store over our KeyValueStore, with keys under a prefix.
class StoreAdapter : public gloo::rendezvous::Store {
 public:
  StoreAdapter(std::shared_ptr<KeyValueStore> store, std::string prefix,
               std::chrono::milliseconds timeout)
      : store_(std::move(store)), prefix_(std::move(prefix)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(prefix_ + key, data);
  }
  std::vector<char> get(const std::string& key) override {
    store_->wait({prefix_ + key}, timeout_);
    return store_->get(prefix_ + key);
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> full;
    full.reserve(keys.size());
    for (const auto& k : keys) full.push_back(prefix_ + k);
    store_->wait(full, timeout);
  }

 private:
  std::shared_ptr<KeyValueStore> store_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
};

using ReduceFn = void (*)(void*, const void*, const void*, size_t);

// The leaders plan's pipeline (allReduceThroughLeaders): a buffer goes in about kLeaderChunks
// chunks of kMinLeaderChunk..kMaxLeaderChunk bytes (each chunk costs every rank of the host a
// wake-up, so not smaller), and the host's reduction runs kAhead chunks ahead of bringing results
// back.
constexpr size_t kLeaderChunks = 8;
constexpr size_t kMinLeaderChunk = size_t{2} << 20;
constexpr size_t kMaxLeaderChunk = size_t{8} << 20;
constexpr size_t kAhead = 2;

// Gloo's ring all-reduce: reduce-scatter then all-gather around the ring, each rank's share cut
// into segments of at most 1 MiB with two in flight, so small tensors take the plain ring and
// large ones the chunked (pipelined) ring. The same algorithm torch.distributed uses on gloo.
template <typename T>
void runAllReduce(const std::shared_ptr<gloo::Context>& ctx, T* ptr, size_t n, uint32_t tag,
                  std::chrono::milliseconds timeout, ReduceFn sum = &gloo::sum<T>) {
  gloo::AllreduceOptions opts(ctx);
  opts.setOutput(ptr, n);
  opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
  opts.setReduceFunction(sum);
  opts.setTag(tag);
  opts.setTimeout(timeout);
  gloo::allreduce(opts);
}

// Gloo's ring all-reduce of a CPU buffer of one of the four reducible dtypes.
void allReduceBuffer(const std::shared_ptr<gloo::Context>& ctx, void* data, size_t n,
                     at::ScalarType dtype, uint32_t tag, std::chrono::milliseconds timeout) {
  switch (dtype) {
    case at::kFloat:
      return runAllReduce(ctx, static_cast<float*>(data), n, tag, timeout);
    case at::kDouble:
      return runAllReduce(ctx, static_cast<double*>(data), n, tag, timeout);
    case at::kLong:
      return runAllReduce(ctx, static_cast<int64_t*>(data), n, tag, timeout);
    case at::kInt:
      return runAllReduce(ctx, static_cast<int32_t*>(data), n, tag, timeout);
    // 16-bit floats are summed in float and rounded back with the SDK's kernels (AVX2/F16C
    // where the CPU has them; bit-identical to c10's conversions), eight values a step.
    case at::kHalf:
      return runAllReduce(ctx, static_cast<c10::Half*>(data), n, tag, timeout, &kernels::sumHalf);
    case at::kBFloat16:
      return runAllReduce(ctx, static_cast<c10::BFloat16*>(data), n, tag, timeout,
                          &kernels::sumBf16);
    default:
      throw WorkerError("all_reduce: dtype " + std::string(c10::toString(dtype)) +
                        " is not supported by the gloo backend");
  }
}

// How all_reduce runs (topology.h decides which): over Gloo's TCP ring alone; over shared memory
// (every rank on one host); hierarchically: shared memory within each host, and for each local
// index a Gloo ring ("column") across the hosts that sums that local rank's piece; or, for hosts
// of unequal sizes, through one leader per host (shared memory, leaders' ring, shared memory).
struct AllReducePlan {
  std::unique_ptr<ShmAllReduce> shm;      // this host's group, if any
  std::shared_ptr<gloo::Context> column;  // hierarchical only
  // Leaders plan (hosts of unequal sizes): this host's representative holds the ring of all
  // hosts' representatives; shm is null on a host of one rank.
  bool leader_mode = false;
  std::shared_ptr<gloo::Context> leaders;
  std::string description = "gloo TCP ring";
};

class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(int rank, int size, std::shared_ptr<gloo::Context> ctx,
                   std::chrono::milliseconds timeout, AllReducePlan plan)
      : rank_(rank),
        size_(size),
        ctx_(std::move(ctx)),
        timeout_(timeout),
        shm_(std::move(plan.shm)),
        column_(std::move(plan.column)),
        leader_mode_(plan.leader_mode),
        leaders_(std::move(plan.leaders)),
        leader_ring_(leaders_ ? std::make_unique<OpQueue>("gloo leaders ring") : nullptr),
        description_(std::move(plan.description)),
        queue_("gloo communicator") {}

  std::string describe() const override { return "gloo: all_reduce over " + description_; }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Backend backend() const override { return Backend::kGloo; }
  at::Device device() const override { return at::kCPU; }

  std::shared_ptr<Work> allReduceAsync(at::Tensor tensor, ReduceOp op) override {
    checkCpu(tensor, "all_reduce");
    if (op == ReduceOp::kAvg && !at::isFloatingType(tensor.scalar_type())) {
      throw WorkerError("all_reduce: ReduceOp::kAvg needs a floating-point tensor, got " +
                        std::string(c10::toString(tensor.scalar_type())));
    }
    checkReducible(tensor.scalar_type());
    const uint32_t tag = nextTag();
    return queue_.submit([this, tensor, op, tag] {
      static const ddprun::TextLogger log("worker");
      const auto t0 = std::chrono::steady_clock::now();
      at::Tensor work = tensor.is_contiguous() ? tensor : tensor.contiguous();
      const size_t n = static_cast<size_t>(work.numel());
      bool averaged = false;
      if (n > 0 && size_ > 1) {
        if (leader_mode_ && shmReducible(work.scalar_type())) {
          allReduceThroughLeaders(work, op == ReduceOp::kAvg ? 1.0 / size_ : 1.0);
          averaged = true;
        } else if (shm_ && shmReducible(work.scalar_type())) {
          // The average's scaling rides on the reduction's last pass.
          ShmAllReduce::PieceHook across_hosts;
          if (column_) {
            const at::ScalarType dtype = work.scalar_type();
            across_hosts = [this, dtype](void* piece, size_t count) {
              // Each column collective its own tag (same sequence on every host of the column).
              allReduceBuffer(column_, piece, count, dtype, column_tag_++ & 0x7fffffffu, timeout_);
            };
          }
          shm_->allReduce(work.data_ptr(), n, shmType(work.scalar_type()),
                          op == ReduceOp::kAvg ? 1.0 / size_ : 1.0, across_hosts);
          averaged = true;
        } else {
          allReduceBuffer(ctx_, work.data_ptr(), n, work.scalar_type(), tag, timeout_);
        }
      }
      if (op == ReduceOp::kAvg && !averaged) work.div_(size_);
      if (!work.is_same(tensor)) tensor.copy_(work);
      DDPRUN_LOG(
          log, kTrace,
          std::fixed << std::setprecision(3)
                     << std::chrono::duration<double, std::milli>(t0.time_since_epoch()).count()
                     << " ms: all_reduce of " << n << " elements took "
                     << std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() -
                                                                  t0)
                            .count()
                     << " ms");
    });
  }

  // Hosts of unequal sizes: each host's sum in shared memory, the hosts' sum over the ring of
  // leaders, and the leader's result back to its host by a second shared-memory pass to which
  // the others contribute zeros. Every rank ends with (x + 0 + ... + 0) * scale of the same x,
  // so results are bit-identical across hosts; a host of one rank applies that arithmetic itself.
  //
  // A large buffer goes through in chunks, pipelined: while the leaders' ring (on its own thread)
  // sums chunk i across the link, the host already reduces chunk i+1 and brings chunk i-1 back,
  // so the link never waits for the shared-memory passes. Every rank of a host runs the same
  // schedule of passes: reduce(0..kAhead-1), then reduce(i+kAhead) and finish(i) in turn.
  void allReduceThroughLeaders(at::Tensor& work, double scale) {
    const size_t n = static_cast<size_t>(work.numel());
    const at::ScalarType dtype = work.scalar_type();
    const size_t elem = work.element_size();
    const size_t chunk = std::max<size_t>(
        1, std::clamp(n * elem / kLeaderChunks, kMinLeaderChunk, kMaxLeaderChunk) / elem);
    const size_t chunks = (n + chunk - 1) / chunk;
    char* base = static_cast<char*>(work.data_ptr());
    auto piece = [&](size_t i) {
      return std::make_pair(base + i * chunk * elem, std::min(chunk, n - i * chunk));
    };
    std::vector<std::shared_ptr<Work>> rings(chunks);
    auto reduce = [&](size_t i) {
      auto [p, count] = piece(i);
      if (shm_) shm_->allReduce(p, count, shmType(dtype), 1.0);
      if (!leaders_) return;
      const uint32_t tag = leaders_tag_++ & 0x7fffffffu;
      if (chunks == 1) {  // nothing to overlap: no thread hop
        allReduceBuffer(leaders_, p, count, dtype, tag, timeout_);
        return;
      }
      // The tensor rides along, so its memory outlives the ring even if this op throws.
      rings[i] = leader_ring_->submit([this, work, p = p, count = count, dtype, tag] {
        allReduceBuffer(leaders_, p, count, dtype, tag, timeout_);
      });
    };
    auto finish = [&](size_t i) {
      auto [p, count] = piece(i);
      if (rings[i]) rings[i]->wait();
      if (shm_) {
        if (!leaders_) std::memset(p, 0, count * elem);
        shm_->allReduce(p, count, shmType(dtype), scale);
      } else if (dtype == at::kFloat) {
        addZeroAndScale(reinterpret_cast<float*>(p), count, scale);
      } else if (dtype == at::kDouble) {
        addZeroAndScale(reinterpret_cast<double*>(p), count, scale);
      } else if (dtype == at::kBFloat16 || dtype == at::kHalf) {
        addZeroAndScale16(dtype == at::kBFloat16, reinterpret_cast<uint16_t*>(p), count, scale);
      }  // integers: the sum is already exact
    };
    try {
      for (size_t i = 0; i < chunks + kAhead; ++i) {
        if (i < chunks) reduce(i);
        if (i >= kAhead) finish(i - kAhead);
      }
    } catch (...) {
      // No ring may still write into the buffer once the failure is reported.
      for (auto& ring : rings) {
        if (!ring) continue;
        try {
          ring->wait();
        } catch (...) {  // the first failure is the one reported
        }
      }
      throw;
    }
  }

  // The same for 16-bit floats (see ShmDType): each addition rounded, then the scale rounded.
  static void addZeroAndScale16(bool bf16, uint16_t* p, size_t n, double scale) {
    for (size_t i = 0; i < n; ++i) {
      p[i] = bf16 ? kernels::bf16FromFloat(kernels::floatFromBf16(p[i]) + 0.0f)
                  : kernels::halfFromFloat(kernels::floatFromHalf(p[i]) + 0.0f);
    }
    if (scale == 1.0) return;
    (bf16 ? kernels::scaleBf16 : kernels::scaleHalf)(p, n, static_cast<float>(scale));
  }

  // What the shared-memory pass does to a value when every other contribution is zero.
  template <typename T>
  static void addZeroAndScale(T* p, size_t n, double scale) {
    const T factor = static_cast<T>(scale);
    for (size_t i = 0; i < n; ++i) {
      p[i] = scale != 1.0 ? (p[i] + T(0)) * factor : p[i] + T(0);
    }
  }

  std::shared_ptr<Work> broadcastAsync(at::Tensor tensor, int root) override {
    checkCpu(tensor, "broadcast");
    checkRoot(root);
    const uint32_t tag = nextTag();
    return queue_.submit([this, tensor, root, tag] {
      at::Tensor work = tensor.is_contiguous() ? tensor : tensor.contiguous();
      const size_t bytes = static_cast<size_t>(work.numel()) * work.element_size();
      if (bytes > 0 && size_ > 1) {
        gloo::BroadcastOptions opts(ctx_);
        // Output only: the root sends from it, the others receive into it.
        opts.setOutput(static_cast<uint8_t*>(work.data_ptr()), bytes);
        opts.setRoot(root);
        opts.setTag(tag);
        opts.setTimeout(timeout_);
        gloo::broadcast(opts);
      }
      if (!work.is_same(tensor)) tensor.copy_(work);
    });
  }

  std::shared_ptr<Work> allGatherAsync(at::Tensor input, at::Tensor output) override {
    checkCpu(input, "all_gather");
    checkCpu(output, "all_gather");
    if (output.numel() != input.numel() * size_ || output.scalar_type() != input.scalar_type() ||
        !output.is_contiguous()) {
      throw WorkerError("all_gather: output must be a contiguous " +
                        std::string(c10::toString(input.scalar_type())) + " tensor of " +
                        std::to_string(input.numel() * size_) + " elements");
    }
    const uint32_t tag = nextTag();
    return queue_.submit([this, input, output, tag] {
      at::Tensor in = input.contiguous();
      const size_t bytes = static_cast<size_t>(in.numel()) * in.element_size();
      if (size_ == 1 || bytes == 0) {
        output.view({-1}).copy_(in.view({-1}));
        return;
      }
      gloo::AllgatherOptions opts(ctx_);
      opts.setInput(static_cast<uint8_t*>(in.data_ptr()), bytes);
      opts.setOutput(static_cast<uint8_t*>(output.data_ptr()), bytes * size_);
      opts.setTag(tag);
      opts.setTimeout(timeout_);
      gloo::allgather(opts);
    });
  }

  at::Tensor allocateBuffer(int64_t numel, const at::TensorOptions& options) override {
    // Taken on every rank, with or without shared memory (a leaders plan has hosts of one rank
    // without it), so the ring's tags stay in step across ranks.
    const uint32_t tag = nextTag();
    const at::ScalarType dtype = c10::typeMetaToScalarType(options.dtype());
    if (!shm_ || numel <= 0 || !options.device().is_cpu() ||
        (dtype != at::kFloat && dtype != at::kDouble && dtype != at::kLong && dtype != at::kInt)) {
      return Communicator::allocateBuffer(numel, options);
    }
    const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
    std::shared_ptr<void> memory;
    // On the op thread, in order with the collectives: allocation is itself collective. With
    // several hosts every host must agree, or the hosts' pieces would be cut differently.
    queue_
        .submit([&] {
          memory = shm_->allocate(bytes);
          if (column_) {
            int32_t all_shared = memory ? 1 : 0;
            gloo::AllreduceOptions opts(ctx_);
            opts.setOutput(&all_shared, 1);
            opts.setReduceFunction(static_cast<ReduceFn>(&gloo::min<int32_t>));
            opts.setTag(tag);
            opts.setTimeout(timeout_);
            gloo::allreduce(opts);
            if (all_shared == 0) memory.reset();
          }
        })
        ->wait();
    if (!memory) return Communicator::allocateBuffer(numel, options);
    return at::from_blob(
        memory.get(), {numel}, [memory](void*) {}, options.requires_grad(false));
  }

  std::shared_ptr<Work> barrierAsync() override {
    const uint32_t tag = nextTag();
    return queue_.submit([this, tag] {
      if (size_ == 1) return;
      gloo::BarrierOptions opts(ctx_);
      opts.setTag(tag);
      opts.setTimeout(timeout_);
      gloo::barrier(opts);
    });
  }

 private:
  uint32_t nextTag() { return tag_.fetch_add(1) & 0x7fffffffu; }
  static void checkCpu(const at::Tensor& t, const char* op) {
    if (!t.defined()) throw WorkerError(std::string(op) + ": tensor is undefined");
    if (!t.device().is_cpu()) {
      throw WorkerError(std::string(op) +
                        ": the gloo backend handles CPU tensors only, got a tensor on " +
                        t.device().str() + " (use the nccl backend for CUDA tensors)");
    }
  }
  static ShmDType shmType(at::ScalarType t) {
    switch (t) {
      case at::kDouble:
        return ShmDType::kFloat64;
      case at::kLong:
        return ShmDType::kInt64;
      case at::kInt:
        return ShmDType::kInt32;
      case at::kBFloat16:
        return ShmDType::kBFloat16;
      case at::kHalf:
        return ShmDType::kHalf;
      default:
        return ShmDType::kFloat32;  // checkReducible admitted only these six
    }
  }
  // The dtypes every path (shared memory, hierarchical, leaders, TCP ring) reduces.
  static bool shmReducible(at::ScalarType t) {
    return t == at::kFloat || t == at::kDouble || t == at::kLong || t == at::kInt ||
           t == at::kBFloat16 || t == at::kHalf;
  }
  static void checkReducible(at::ScalarType t) {
    if (!shmReducible(t)) {
      throw WorkerError("all_reduce: dtype " + std::string(c10::toString(t)) +
                        " is not supported by the gloo backend (float, double, half, bfloat16, "
                        "int32, int64)");
    }
  }
  void checkRoot(int root) const {
    if (root < 0 || root >= size_) {
      throw WorkerError("broadcast: root " + std::to_string(root) + " is outside [0, " +
                        std::to_string(size_ - 1) + "]");
    }
  }

  int rank_;
  int size_;
  std::shared_ptr<gloo::Context> ctx_;
  std::chrono::milliseconds timeout_;
  std::atomic<uint32_t> tag_{0};
  std::unique_ptr<ShmAllReduce> shm_;       // this host's ranks, when all_reduce uses shared memory
  std::shared_ptr<gloo::Context> column_;   // the same local index on every host (hierarchical)
  uint32_t column_tag_ = 0;                 // only touched on the op thread
  bool leader_mode_ = false;                // hosts of unequal sizes (see AllReducePlan)
  std::shared_ptr<gloo::Context> leaders_;  // this host's leader only
  uint32_t leaders_tag_ = 0;                // only touched on the op thread
  // The leader's ring of chunks runs here, beside the op thread's shared-memory passes; stops
  // before leaders_ goes away.
  std::unique_ptr<OpQueue> leader_ring_;
  std::string description_;
  OpQueue queue_;  // last member: its thread stops before the context goes away
};

}  // namespace

namespace {

// FNV-1a: the same on every rank and build, unlike std::hash.
uint64_t fingerprint(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Collective over `ctx`. Finds which ranks share a host (a fingerprint of the host identity,
// all-gathered), plans the topology from that (planTopology), then sets up shared memory per host
// and, for a hierarchical plan, one Gloo context per local index across the hosts. Any rank or
// host that cannot take part makes every rank fall back to the plain ring.
AllReducePlan planAllReduce(int rank, int size, const std::shared_ptr<KeyValueStore>& store,
                            const GlooOptions& options, const std::shared_ptr<gloo::Context>& ctx,
                            std::shared_ptr<gloo::transport::Device> device) {
  static const ddprun::TextLogger log("worker");
  AllReducePlan plan;
  const bool wanted = options.shared_memory && !shmDisabledByEnvironment();
  if (size < 2) return plan;
  const std::string identity =
      options.host_identity.empty() ? localHostIdentity() : options.host_identity;
  // A rank that does not want shared memory says so (kOptedOut): every rank falls back together.
  const HostKey mine = wanted ? std::max<HostKey>(fingerprint(identity), 1) : kOptedOut;
  std::vector<HostKey> hosts(static_cast<size_t>(size));
  {
    gloo::AllgatherOptions opts(ctx);
    opts.setInput(const_cast<HostKey*>(&mine), 1);
    opts.setOutput(hosts.data(), hosts.size());
    opts.setTag(0x7ffffff0u);
    opts.setTimeout(options.connect_timeout);
    gloo::allgather(opts);
  }
  const TopologyPlan topology = planTopology(hosts, rank);
  const int num_hosts = topology.num_hosts;
  const int host_index = topology.host_index;
  const int local_rank = topology.local_rank;
  const int local_size = static_cast<int>(topology.host_ranks.size());
  if (topology.kind == TopologyKind::kFlat) {
    DDPRUN_LOG(log, kDebug,
               "rank " << rank << ": " << num_hosts << " host(s), " << local_size
                       << " rank(s) on this one: no shared-memory all-reduce");
    return plan;
  }

  ShmOptions shm_options;
  shm_options.prefix = options.prefix + "/host" + std::to_string(host_index);
  shm_options.setup_timeout = options.connect_timeout;
  shm_options.op_timeout = options.op_timeout;
  shm_options.host_identity = identity;
  // A host of one rank (leaders plan) has nobody to share memory with.
  auto shm = local_size > 1 ? ShmAllReduce::tryCreate(local_rank, local_size, store, shm_options)
                            : nullptr;
  auto connect = [&](int index, int count, const std::string& prefix, const std::string& whom) {
    auto context = std::make_shared<gloo::rendezvous::Context>(index, count);
    context->setTimeout(options.connect_timeout);
    StoreAdapter adapter(store, options.prefix + prefix, options.connect_timeout);
    try {
      context->connectFullMesh(adapter, device);
    } catch (const std::exception& e) {
      throw CommError("gloo: rank " + std::to_string(rank) + " could not connect to " + whom +
                      ": " + e.what());
    }
    context->setTimeout(options.op_timeout);
    return context;
  };
  // Collective over ctx: whether every rank can go on with the plan.
  auto everyRank = [&](bool mine) {
    int32_t ok = mine ? 1 : 0;
    gloo::AllreduceOptions opts(ctx);
    opts.setOutput(&ok, 1);
    opts.setReduceFunction(static_cast<ReduceFn>(&gloo::min<int32_t>));
    opts.setTag(0x7ffffff1u);
    opts.setTimeout(options.connect_timeout);
    gloo::allreduce(opts);
    return ok != 0;
  };
  if (topology.kind == TopologyKind::kLeaders) {
    // Every host of several ranks must have its group, or nobody uses one.
    if (!everyRank(shm || local_size == 1)) return plan;
    if (topology.isLeader()) {
      plan.leaders = connect(host_index, num_hosts, "/leaders/", "the other hosts' leaders");
    }
    plan.shm = std::move(shm);
    plan.leader_mode = true;
    plan.description = topology.describe();
    return plan;
  }
  if (topology.kind == TopologyKind::kHierarchical) {
    // Every host must have its group, or nobody uses one.
    if (!everyRank(shm != nullptr)) return plan;
    plan.column = connect(host_index, num_hosts, "/column" + std::to_string(local_rank) + "/",
                          "its peers on the other hosts");
  }
  if (!shm) return plan;
  plan.shm = std::move(shm);
  plan.description = topology.describe();
  return plan;
}

}  // namespace

std::string glooBindingProblem(const void* gloo_function) {
  Dl_info info{};
  if (dladdr(gloo_function, &info) == 0 || info.dli_fname == nullptr) return "";
  const std::string file = info.dli_fname;
  if (file.find("libgloo") != std::string::npos) return "";
  return "gloo: this process reaches gloo's functions in " + file +
         ", not in the libgloo the worker SDK was built with (LibTorch 2.x carries a gloo of its "
         "own, built from other headers, and it was loaded first). Link libgloo before LibTorch "
         "(the ddprun::worker CMake target does; check your program's link line and that "
         "--as-needed does not drop libgloo), or use the nccl backend; see docs/libtorch.md";
}

std::unique_ptr<Communicator> makeGlooCommunicator(int rank, int size,
                                                   std::shared_ptr<KeyValueStore> store,
                                                   const GlooOptions& options) {
  // Every gloo symbol binds to the first library that defines it: one of them tells for all.
  static const std::string binding_problem =
      glooBindingProblem(reinterpret_cast<const void*>(&gloo::transport::tcp::CreateDevice));
  if (!binding_problem.empty()) throw ConfigError(binding_problem);
  gloo::transport::tcp::attr attr;
  attr.hostname = options.local_address;
  std::shared_ptr<gloo::transport::Device> device;
  try {
    device = gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    throw CommError("gloo: cannot create a TCP device on " + options.local_address + ": " +
                    e.what());
  }
  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
  ctx->setTimeout(options.connect_timeout);
  StoreAdapter adapter(store, options.prefix + "/gloo/", options.connect_timeout);
  try {
    ctx->connectFullMesh(adapter, device);
  } catch (const std::exception& e) {
    throw CommError("gloo: rank " + std::to_string(rank) + " could not connect to its " +
                    std::to_string(size - 1) + " peers: " + e.what());
  }
  ctx->setTimeout(options.op_timeout);
  AllReducePlan plan = planAllReduce(rank, size, store, options, ctx, device);
  if (rank == 0) {
    static const ddprun::TextLogger log("worker");
    DDPRUN_LOG(log, kInfo, "all_reduce over " << plan.description);
  }
  return std::make_unique<GlooCommunicator>(rank, size, std::move(ctx), options.op_timeout,
                                            std::move(plan));
}

}  // namespace ddprun::worker
