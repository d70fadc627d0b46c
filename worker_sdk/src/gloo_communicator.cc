#include "gloo_communicator.h"

#include <ATen/ATen.h>
#include <dlfcn.h>
#include <gloo/allgather.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/transport/tcp/device.h>

#include <chrono>
#include <iomanip>

#include "allreduce_route.h"
#include "ddprun/common/log_text.h"
#include "ddprun/worker/errors.h"
#include "fault_hooks.h"
#include "gloo_abort.h"
#include "gloo_communicator_impl.h"
#include "gloo_dtypes.h"
#include "gloo_mesh.h"
#include "gloo_ring.h"

namespace ddprun::worker {

namespace {

void checkCpu(const at::Tensor& t, const char* op) {
  if (!t.defined()) throw WorkerError(std::string(op) + ": tensor is undefined");
  if (!t.device().is_cpu()) {
    throw WorkerError(std::string(op) +
                      ": the gloo backend handles CPU tensors only, got a tensor on " +
                      t.device().str() + " (use the nccl backend for CUDA tensors)");
  }
}

}  // namespace

GlooCommunicator::GlooCommunicator(int rank, int size, std::shared_ptr<gloo::Context> ctx,
                                   std::chrono::milliseconds timeout, AllReducePlan plan)
    : rank_(rank),
      size_(size),
      ctx_(std::move(ctx)),
      timeout_(timeout),
      shm_(std::move(plan.shm)),
      column_(std::move(plan.column)),
      leaders_(plan.leader_mode ? std::make_unique<LeadersAllReduce>(
                                      shm_.get(), std::move(plan.leaders), timeout)
                                : nullptr),
      description_(std::move(plan.description)),
      queue_("gloo communicator") {}

std::shared_ptr<Work> GlooCommunicator::allReduceAsync(at::Tensor tensor, ReduceOp op) {
  checkCpu(tensor, "all_reduce");
  if (op == ReduceOp::kAvg && !at::isFloatingType(tensor.scalar_type())) {
    throw WorkerError("all_reduce: ReduceOp::kAvg needs a floating-point tensor, got " +
                      std::string(c10::toString(tensor.scalar_type())));
  }
  if (!glooReducible(tensor.scalar_type())) {
    throw WorkerError("all_reduce: dtype " + std::string(c10::toString(tensor.scalar_type())) +
                      " is not supported by the gloo backend (float, double, half, bfloat16, "
                      "int32, int64)");
  }
  const uint32_t tag = nextTag();
  return queue_.submit([this, tensor, op, tag] { allReduceNow(tensor, op, tag); });
}

void GlooCommunicator::allReduceNow(const at::Tensor& tensor, ReduceOp op, uint32_t tag) {
  static const ddprun::TextLogger log("worker");
  const auto t0 = std::chrono::steady_clock::now();
  at::Tensor work = tensor.is_contiguous() ? tensor : tensor.contiguous();
  const size_t n = static_cast<size_t>(work.numel());
  const at::ScalarType dtype = work.scalar_type();
  AllReduceCall call;
  call.leaders_plan = leaders_ != nullptr;
  call.shared_memory = shm_ != nullptr;
  call.columns = column_ != nullptr;
  call.size = size_;
  call.numel = n;
  call.shm_reducible = glooReducible(dtype);
  call.average = op == ReduceOp::kAvg;
  const AllReducePlanChoice choice = chooseAllReduceRoute(call);
  const double scale = choice.scale_in_reduction ? 1.0 / size_ : 1.0;
  switch (choice.route) {
    case AllReduceRoute::kNone:
      break;
    case AllReduceRoute::kLeaders:
      leaders_->run(work, scale);
      break;
    case AllReduceRoute::kSharedMemory:
      shm_->allReduce(work.data_ptr(), n, shmTypeOf(dtype), scale);
      break;
    case AllReduceRoute::kSharedMemoryAndColumns:
      // Each rank's reduced piece summed across the hosts, each column collective with its own
      // tag (the same sequence on every host of the column).
      shm_->allReduce(
          work.data_ptr(), n, shmTypeOf(dtype), scale, [this, dtype](void* piece, size_t count) {
            allReduceBuffer(column_, piece, count, dtype, column_tag_++ & 0x7fffffffu, timeout_);
          });
      break;
    case AllReduceRoute::kRing:
      allReduceBuffer(ctx_, work.data_ptr(), n, dtype, tag, timeout_);
      break;
  }
  if (op == ReduceOp::kAvg && !choice.scale_in_reduction) work.div_(size_);
  if (!work.is_same(tensor)) tensor.copy_(work);
  DDPRUN_LOG(
      log, kTrace,
      std::fixed << std::setprecision(3)
                 << std::chrono::duration<double, std::milli>(t0.time_since_epoch()).count()
                 << " ms: all_reduce of " << n << " elements (" << routeName(choice.route)
                 << ") took "
                 << std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                        .count()
                 << " ms");
}

std::shared_ptr<Work> GlooCommunicator::broadcastIfLackingAsync(at::Tensor tensor, int root,
                                                                bool lacking) {
  checkCpu(tensor, "broadcast");
  if (root < 0 || root >= size_) {
    throw WorkerError("broadcast: root " + std::to_string(root) + " is outside [0, " +
                      std::to_string(size_ - 1) + "]");
  }
  const uint32_t tag = nextTag();
  return queue_.submit([this, tensor, root, tag, lacking] {
    at::Tensor work = tensor.is_contiguous() ? tensor : tensor.contiguous();
    const size_t bytes = static_cast<size_t>(work.numel()) * work.element_size();
    if (bytes > 0 && broadcastIsPipelined()) {
      shm_->broadcast(work.data_ptr(), bytes, root, lacking);
    } else if (bytes > 0 && size_ > 1) {
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

std::shared_ptr<Work> GlooCommunicator::allGatherAsync(at::Tensor input, at::Tensor output) {
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

at::Tensor GlooCommunicator::allocateBuffer(int64_t numel, const at::TensorOptions& options) {
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
        if (column_ && !everyRankAgrees(ctx_, memory != nullptr, tag, timeout_)) memory.reset();
      })
      ->wait();
  if (!memory) return Communicator::allocateBuffer(numel, options);
  return at::from_blob(
      memory.get(), {numel}, [memory](void*) {}, options.requires_grad(false));
}

void GlooCommunicator::abort(const std::string& reason) {
  queue_.abort(reason);
  if (shm_) shm_->abort();
  if (leaders_) leaders_->abort(reason);
  shutdownGlooPairs(*ctx_);
  if (column_) shutdownGlooPairs(*column_);
}

std::shared_ptr<Work> GlooCommunicator::barrierAsync() {
  const uint32_t tag = nextTag();
  return queue_.submit([this, tag] {
    if (size_ == 1) return;
    gloo::BarrierOptions opts(ctx_);
    opts.setTag(tag);
    opts.setTimeout(timeout_);
    gloo::barrier(opts);
  });
}

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
  // While an in-place recovery forms this group, the agent's abort of it (the store's cancel)
  // fails the pairs still connecting and the planning's collectives (gloo_mesh.h).
  FormingWatch watch(store->cancel());
  GlooStoreAdapter adapter(store, options.prefix + "/gloo/", options.connect_timeout);
  std::shared_ptr<gloo::Context> ctx;
  auto failed = [&](const std::string& what, const std::exception& e) {
    const std::string why = watch.fired();
    return CommError("gloo: rank " + std::to_string(rank) +
                     (why.empty() ? " could not " + what + ": " + e.what()
                                  : " gave up forming its group (" + what + "): " + why));
  };
  try {
    ctx = connectGlooMesh(rank, size, adapter, device, options.connect_timeout, &watch, [&] {
      // The test hook's node goes silent once the others are past the store's waits.
      if (!watch.active() || !recoveryFaultRequested("connect", rank)) return;
      std::vector<std::string> every;
      for (int i = 0; i < size; ++i) every.push_back(std::to_string(i));
      adapter.wait(every);
      injectRecoveryFault("connect", rank);
    });
  } catch (const std::exception& e) {
    throw failed("connect to its " + std::to_string(size - 1) + " peers", e);
  }
  ctx->setTimeout(options.op_timeout);
  AllReducePlan plan;
  try {
    plan = planAllReduce(rank, size, store, options, ctx, device, &watch);
  } catch (const CommError& e) {
    if (watch.fired().empty()) throw;  // it names what failed already
    throw failed("plan its all_reduce with its peers", e);
  } catch (const std::exception& e) {
    // A peer lost while the ranks agree on the plan throws gloo's IoException.
    throw failed("plan its all_reduce with its peers", e);
  }
  if (const std::string why = watch.fired(); !why.empty()) {
    throw CommError("gloo: rank " + std::to_string(rank) + " gave up forming its group: " + why);
  }
  if (rank == 0) {
    static const ddprun::TextLogger log("worker");
    DDPRUN_LOG(log, kInfo, "all_reduce over " << plan.description);
  }
  return std::make_unique<GlooCommunicator>(rank, size, std::move(ctx), options.op_timeout,
                                            std::move(plan));
}

}  // namespace ddprun::worker
