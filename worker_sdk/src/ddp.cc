#include "ddprun/worker/ddp.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/torch.h>

#include <chrono>
#include <iomanip>
#include <mutex>
#include <sstream>

#include "ddprun/common/log_text.h"
#include "ddprun/common/thread_annotations.h"
#include "ddprun/worker/bucket_assignment.h"
#include "ddprun/worker/errors.h"
#include "half_kernels.h"

namespace ddprun::worker {

namespace {
// Milliseconds on the steady clock, for trace lines that show how buckets overlap backward.
double nowMs() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
// Whether the SDK's own 16-bit kernels can cast a bucket (a contiguous float CPU tensor): one
// pass each way instead of LibTorch's divide, then cast (other buckets take LibTorch's path).
bool kernelsCast(const torch::Tensor& bucket) {
  return bucket.device().is_cpu() && bucket.scalar_type() == torch::kFloat &&
         bucket.is_contiguous();
}

// A compressed bucket's reduction: the sum arrives in the 16-bit wire buffer and is cast back
// into the bucket once, by the first wait().
class DecompressWork : public Work {
 public:
  DecompressWork(std::shared_ptr<Work> inner, torch::Tensor wire, torch::Tensor bucket)
      : inner_(std::move(inner)), wire_(std::move(wire)), bucket_(std::move(bucket)) {}
  void wait() override {
    inner_->wait();
    std::call_once(copied_, [this] {
      torch::NoGradGuard no_grad;
      if (kernelsCast(bucket_) && wire_.is_contiguous() && wire_.device().is_cpu()) {
        auto* out = bucket_.data_ptr<float>();
        const auto* in = static_cast<const uint16_t*>(wire_.data_ptr());
        const auto n = static_cast<size_t>(bucket_.numel());
        wire_.scalar_type() == torch::kBFloat16 ? kernels::bf16ToFloat(in, out, n)
                                                : kernels::halfToFloat(in, out, n);
      } else {
        bucket_.copy_(wire_);
      }
      wire_ = torch::Tensor();
    });
  }
  bool isCompleted() override { return inner_->isCompleted(); }

 private:
  std::shared_ptr<Work> inner_;
  torch::Tensor wire_;
  torch::Tensor bucket_;
  std::once_flag copied_;
};

}  // namespace

Compression parseCompression(const std::string& name) {
  if (name == "none") return Compression::kNone;
  if (name == "fp16") return Compression::kFp16;
  if (name == "bf16") return Compression::kBf16;
  throw ConfigError("compression must be none, fp16 or bf16, got '" + name + "'");
}

std::string compressionName(Compression compression) {
  switch (compression) {
    case Compression::kFp16:
      return "fp16";
    case Compression::kBf16:
      return "bf16";
    case Compression::kNone:
      break;
  }
  return "none";
}

CommHook allReduceHook() {
  return [](Communicator& comm, const GradBucket& bucket) {
    return comm.allReduceAsync(bucket.buffer, ReduceOp::kAvg);
  };
}

CommHook compressHook(at::ScalarType wire_dtype) {
  if (wire_dtype != torch::kHalf && wire_dtype != torch::kBFloat16) {
    throw ConfigError("compressHook: the wire dtype must be Half or BFloat16, got " +
                      std::string(c10::toString(wire_dtype)));
  }
  return [wire_dtype](Communicator& comm, const GradBucket& bucket) -> std::shared_ptr<Work> {
    torch::NoGradGuard no_grad;
    // Average before the cast, as PyTorch's hooks do: a sum of large fp16 gradients overflows.
    torch::Tensor wire;
    if (kernelsCast(bucket.buffer)) {
      wire = torch::empty_like(bucket.buffer, bucket.buffer.options().dtype(wire_dtype));
      const auto* in = bucket.buffer.data_ptr<float>();
      auto* out = static_cast<uint16_t*>(wire.data_ptr());
      const auto n = static_cast<size_t>(wire.numel());
      const auto divisor = static_cast<float>(comm.size());
      wire_dtype == torch::kBFloat16 ? kernels::floatToBf16(in, out, n, divisor)
                                     : kernels::floatToHalf(in, out, n, divisor);
    } else {
      wire = bucket.buffer.div(comm.size()).to(wire_dtype);
    }
    auto work = comm.allReduceAsync(wire, ReduceOp::kSum);
    return std::make_shared<DecompressWork>(std::move(work), std::move(wire), bucket.buffer);
  };
}

CommHook hookFor(Compression compression) {
  switch (compression) {
    case Compression::kFp16:
      return compressHook(torch::kHalf);
    case Compression::kBf16:
      return compressHook(torch::kBFloat16);
    case Compression::kNone:
      break;
  }
  return allReduceHook();
}

// A bucket's layout, fixed at construction.
struct DistributedDataParallel::Bucket {
  std::vector<std::size_t> params;
  torch::Tensor flat;
};

// One backward pass's state. Gradient hooks run on autograd threads, so all of it is under `mu`.
struct DistributedDataParallel::Iteration {
  ddprun::Mutex mu;
  bool sync_enabled GUARDED_BY(mu) = true;
  bool in_backward GUARDED_BY(mu) = false;
  std::vector<bool> ready GUARDED_BY(mu);                  // per parameter
  std::vector<std::size_t> pending GUARDED_BY(mu);         // per bucket: gradients still missing
  std::vector<std::shared_ptr<Work>> work GUARDED_BY(mu);  // per bucket: its reduction in flight
  std::size_t next_bucket GUARDED_BY(mu) = 0;

  // Ready for the next backward pass, with these bucket sizes.
  void reset(const std::vector<std::unique_ptr<Bucket>>& buckets) REQUIRES(mu) {
    std::fill(ready.begin(), ready.end(), false);
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      pending[b] = buckets[b]->params.size();
      work[b].reset();
    }
    next_bucket = 0;
    in_backward = false;
  }
};

namespace {
// Launches every complete bucket not launched yet, strictly in bucket order, so that every rank
// issues the same sequence of collectives.
template <typename Bucket, typename Iteration>
void launchReadyBuckets(Iteration& it, const std::vector<std::unique_ptr<Bucket>>& buckets,
                        const CommHook& hook, Communicator& comm) REQUIRES(it.mu) {
  while (it.next_bucket < buckets.size() && it.pending[it.next_bucket] == 0) {
    const Bucket& b = *buckets[it.next_bucket];
    static const ddprun::TextLogger log("worker");
    DDPRUN_LOG(log, kTrace,
               std::fixed << std::setprecision(3) << nowMs() << " ms: bucket " << it.next_bucket
                          << " (" << b.params.size() << " params, " << b.flat.numel()
                          << " elements) launched");
    it.work[it.next_bucket] = hook(comm, GradBucket{it.next_bucket, b.flat});
    if (!it.work[it.next_bucket]) {
      throw WorkerError(
          "DistributedDataParallel: the communication hook returned no work for bucket " +
          std::to_string(it.next_bucket));
    }
    ++it.next_bucket;
  }
}
}  // namespace

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                 std::shared_ptr<ProcessGroup> group,
                                                 const DdpOptions& options)
    : module_(std::move(module)), group_(std::move(group)), options_(options) {
  if (!module_) throw ConfigError("DistributedDataParallel: module is null");
  if (!group_) throw ConfigError("DistributedDataParallel: process group is null");
  if (!(options.bucket_cap_mb > 0) || !(options.first_bucket_mb > 0)) {
    throw ConfigError(
        "DistributedDataParallel: bucket_cap_mb and first_bucket_mb must be positive");
  }
  Communicator& comm = group_->comm();
  hook_ = options_.comm_hook ? options_.comm_hook : hookFor(options_.compression);

  for (auto& item : module_->named_parameters(/*recurse=*/true)) {
    if (!item.value().requires_grad()) continue;
    names_.push_back(item.key());
    params_.push_back(item.value());
  }

  checkPlacement(comm);
  checkSameModel(comm);
  // Start from rank 0's weights and buffers (unless the caller made them equal already).
  if (options_.broadcast_parameters) {
    torch::NoGradGuard no_grad;
    std::vector<std::shared_ptr<Work>> works;
    for (auto& p : module_->parameters(true)) works.push_back(comm.broadcastAsync(p.data(), 0));
    for (auto& b : module_->buffers(true)) works.push_back(comm.broadcastAsync(b, 0));
    for (auto& w : works) w->wait();
  }
  buildBuckets(comm);
  iteration_ = std::make_unique<Iteration>();
  {
    ddprun::MutexLock lock(iteration_->mu);
    iteration_->ready.assign(params_.size(), false);
    iteration_->pending.assign(buckets_.size(), 0);
    iteration_->work.resize(buckets_.size());
    iteration_->reset(buckets_);
  }
  registerHooks();
}

void DistributedDataParallel::checkPlacement(Communicator& comm) const {
  // The tensor-device rule (worker_sdk/README.md): a collective takes tensors on the
  // communicator's device. The parameters and buffers are broadcast in place and the gradients
  // reduced in buckets of the parameters' device, so the model must be there already.
  const at::Device device = comm.device();
  auto check = [&](const std::string& what, const std::string& name, const torch::Tensor& t) {
    if (t.device().type() == device.type() &&
        (!device.has_index() || t.device().index() == device.index())) {
      return;
    }
    throw ConfigError("DistributedDataParallel: " + what + " '" + name + "' is on " +
                      t.device().str() + " but the " + backendName(comm.backend()) +
                      " communicator works on " + device.str() +
                      ": move the model there (module->to(device)) before wrapping it");
  };
  for (auto& item : module_->named_parameters(/*recurse=*/true)) {
    check("parameter", item.key(), item.value());
  }
  for (auto& item : module_->named_buffers(/*recurse=*/true))
    check("buffer", item.key(), item.value());
}

void DistributedDataParallel::checkSameModel(Communicator& comm) const {
  // Every rank must hold the same model: compare parameter count and total size.
  int64_t total = 0;
  for (auto& p : params_) total += p.numel();
  auto sig = torch::tensor({static_cast<int64_t>(params_.size()), total},
                           torch::TensorOptions().dtype(torch::kLong).device(comm.device()));
  const torch::Tensor all = torch::stack(comm.allGather(sig)).to(torch::kCPU);
  for (int r = 0; r < comm.size(); ++r) {
    const int64_t count = all[r][0].item<int64_t>();
    const int64_t elements = all[r][1].item<int64_t>();
    if (count != static_cast<int64_t>(params_.size()) || elements != total) {
      throw ConfigError("DistributedDataParallel: rank " + std::to_string(r) + " has " +
                        std::to_string(count) + " parameters / " + std::to_string(elements) +
                        " elements but rank " + std::to_string(comm.rank()) + " has " +
                        std::to_string(params_.size()) + " / " + std::to_string(total) +
                        ": every rank must build the same model");
    }
  }
}

void DistributedDataParallel::buildBuckets(Communicator& comm) {
  std::vector<TensorSpec> specs;
  for (auto& p : params_) {
    specs.push_back(TensorSpec{static_cast<std::size_t>(p.numel()),
                               static_cast<std::size_t>(p.element_size()),
                               static_cast<int>(p.scalar_type()),
                               p.device().is_cpu() ? -1 : static_cast<int>(p.device().index())});
  }
  BucketOptions bopts;
  bopts.first_bucket_bytes =
      static_cast<std::size_t>(options_.first_bucket_mb * BucketOptions::kMiB);
  bopts.bucket_cap_bytes = static_cast<std::size_t>(options_.bucket_cap_mb * BucketOptions::kMiB);
  bucket_indices_ = computeBucketAssignment(specs, bopts);

  bucket_of_.assign(params_.size(), 0);
  offset_of_.assign(params_.size(), 0);
  for (std::size_t b = 0; b < bucket_indices_.size(); ++b) {
    auto bucket = std::make_unique<Bucket>();
    bucket->params = bucket_indices_[b];
    int64_t n = 0;
    for (std::size_t i : bucket->params) {
      bucket_of_[i] = b;
      offset_of_[i] = static_cast<std::size_t>(n);
      n += params_[i].numel();
    }
    // Communicator-provided memory: with the shared-memory path peers reduce it in place.
    bucket->flat =
        comm.allocateBuffer(n, params_[bucket->params.front()].options().requires_grad(false));
    buckets_.push_back(std::move(bucket));
  }
  // Plain aliases (from_blob), not autograd views: the optimizer's zero_grad() detaches grads in
  // place, which LibTorch refuses for views. Each alias keeps its bucket buffer alive.
  views_.resize(params_.size());
  for (std::size_t i = 0; i < params_.size(); ++i) {
    torch::Tensor flat = buckets_[bucket_of_[i]]->flat;
    auto* base = static_cast<char*>(flat.data_ptr()) + offset_of_[i] * flat.element_size();
    views_[i] = torch::from_blob(
        base, params_[i].sizes(), [flat](void*) {}, flat.options());
  }
}

std::vector<torch::Tensor> DistributedDataParallel::bucketBuffers() const {
  std::vector<torch::Tensor> flats;
  for (const auto& b : buckets_) flats.push_back(b->flat);
  return flats;
}

void DistributedDataParallel::registerHooks() {
  // Look every accumulator up before registering any hook, so a failure cannot leave hooks that
  // point at a half-constructed object.
  // The accumulator's pointer type changed across LibTorch versions (shared_ptr, intrusive_ptr).
  using Accumulator =
      decltype(torch::autograd::impl::grad_accumulator(std::declval<const torch::Tensor&>()));
  std::vector<Accumulator> accumulators;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
    if (!acc)
      throw WorkerError("DistributedDataParallel: parameter '" + names_[i] +
                        "' is not a leaf tensor");
    accumulators.push_back(std::move(acc));
  }
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const auto key =
        accumulators[i]->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
            [this, i](const torch::autograd::variable_list& outputs,
                      const torch::autograd::variable_list&) {
              onGradReady(i);
              return outputs;
            }));
    remove_hooks_.push_back([acc = accumulators[i], key] { acc->del_post_hook(key); });
  }
}

DistributedDataParallel::~DistributedDataParallel() {
  // Outstanding work writes into our buckets: let it finish (errors are moot here).
  std::vector<std::shared_ptr<Work>> outstanding;
  if (iteration_) {
    ddprun::MutexLock lock(iteration_->mu);
    outstanding = iteration_->work;
  }
  for (auto& work : outstanding) {
    if (!work) continue;
    try {
      work->wait();
    } catch (const std::exception&) {
    }
  }
  // Hooks capture `this` and the accumulators may outlive us (a live graph holds them).
  for (auto& remove : remove_hooks_) remove();
}

DistributedDataParallel::NoSyncGuard::NoSyncGuard(DistributedDataParallel& ddp) : ddp_(ddp) {
  ddprun::MutexLock lock(ddp_.iteration_->mu);
  previous_ = ddp_.iteration_->sync_enabled;
  ddp_.iteration_->sync_enabled = false;
}

DistributedDataParallel::NoSyncGuard::~NoSyncGuard() {
  ddprun::MutexLock lock(ddp_.iteration_->mu);
  ddp_.iteration_->sync_enabled = previous_;
}

void DistributedDataParallel::syncBuffers() {
  torch::NoGradGuard no_grad;
  std::vector<std::shared_ptr<Work>> works;
  for (auto& b : module_->buffers(true)) works.push_back(group_->comm().broadcastAsync(b, 0));
  for (auto& w : works) w->wait();
}

void DistributedDataParallel::onGradReady(std::size_t i) {
  Iteration& it = *iteration_;
  ddprun::MutexLock lock(it.mu);
  if (!it.sync_enabled) return;
  if (!it.in_backward) {
    it.in_backward = true;
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finalizeBackward(); });
  }
  if (it.ready[i]) {
    throw WorkerError(
        "DistributedDataParallel: parameter '" + names_[i] +
        "' received a gradient twice in one backward pass (reused module with shared weights "
        "is not supported)");
  }
  it.ready[i] = true;
  torch::Tensor& view = views_[i];
  torch::Tensor& grad = params_[i].mutable_grad();
  {
    // The bucket's all-reduce averages (kAvg), so nothing is scaled here: a gradient accumulated
    // in place into the bucket needs no pass at all, and communicators that can fold the 1/world
    // factor into the reduction (the shared-memory path) save a pass over the bucket.
    torch::NoGradGuard no_grad;
    if (grad.defined() && grad.data_ptr() == view.data_ptr()) {
      // already accumulated in place into the bucket
    } else if (grad.defined()) {
      view.copy_(grad);
      if (options_.gradient_as_bucket_view) grad = view;
    } else {
      view.zero_();
    }
  }
  if (--it.pending[bucket_of_[i]] == 0 && options_.overlap) {
    launchReadyBuckets(it, buckets_, hook_, group_->comm());
  }
}

void DistributedDataParallel::finalizeBackward() {
  Iteration& it = *iteration_;
  std::vector<std::shared_ptr<Work>> works;
  {
    ddprun::MutexLock lock(it.mu);
    std::vector<std::string> missing;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (it.ready[i]) continue;
      if (!options_.find_unused_parameters) {
        missing.push_back(names_[i]);
        continue;
      }
      views_[i].zero_();
      it.ready[i] = true;
      --it.pending[bucket_of_[i]];
    }
    if (!missing.empty()) {
      std::ostringstream msg;
      msg << "DistributedDataParallel: parameter" << (missing.size() > 1 ? "s " : " ");
      for (std::size_t k = 0; k < missing.size() && k < 10; ++k)
        msg << (k ? ", '" : "'") << missing[k] << "'";
      if (missing.size() > 10) msg << " and " << missing.size() - 10 << " more";
      msg << " received no gradient in this backward pass; make every parameter take part in the "
             "loss, "
             "or construct DistributedDataParallel with find_unused_parameters = true";
      it.reset(buckets_);
      throw WorkerError(msg.str());
    }
    launchReadyBuckets(it, buckets_, hook_, group_->comm());
    works = it.work;  // every bucket's, launched: no hook runs any more this pass
  }
  torch::NoGradGuard no_grad;
  static const ddprun::TextLogger log("worker");
  DDPRUN_LOG(log, kTrace,
             std::fixed << std::setprecision(3) << nowMs() << " ms: backward done, waiting for "
                        << buckets_.size() << " buckets");
  for (std::size_t bi = 0; bi < buckets_.size(); ++bi) {
    works[bi]->wait();
    for (std::size_t i : buckets_[bi]->params) {
      torch::Tensor& grad = params_[i].mutable_grad();
      if (grad.defined() && grad.data_ptr() == views_[i].data_ptr())
        continue;  // already the bucket
      if (options_.gradient_as_bucket_view || !grad.defined()) {
        grad = options_.gradient_as_bucket_view ? views_[i] : views_[i].clone();
      } else {
        grad.copy_(views_[i]);
      }
    }
  }
  DDPRUN_LOG(log, kTrace,
             std::fixed << std::setprecision(3) << nowMs() << " ms: all buckets reduced");
  ddprun::MutexLock lock(it.mu);
  it.reset(buckets_);
}

void DistributedDataParallel::finalize() {
  bool pending;
  {
    ddprun::MutexLock lock(iteration_->mu);
    pending = iteration_->in_backward;
  }
  if (pending) finalizeBackward();
}

}  // namespace ddprun::worker
