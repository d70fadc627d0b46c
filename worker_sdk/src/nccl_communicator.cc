// NCCL implementation of Communicator for CUDA tensors. Compiled when CMake finds the CUDA toolkit
// and NCCL >= 2.14 (DDPRUN_WITH_NCCL). It needs only the CUDA runtime API and NCCL, not a CUDA
// build of LibTorch: tensors are touched through the device-agnostic Tensor API (data_ptr, numel,
// element_size, scalar_type, device, is_contiguous) and nothing here launches an ATen kernel, so
// the same code serves a CUDA LibTorch and a CPU-only one handed CUDA tensors made with
// at::from_blob over device memory.
//
// Ordering: at submission, each op records an event on the producer stream (the legacy default
// stream unless setNcclProducerStream says otherwise) and the communicator's own non-blocking
// stream waits on it, so the collective sees the producer's kernels. The queue thread (OpQueue)
// only enqueues work on that stream and records a completion event.
//
// Faults (nccl_health.h): the communicator is non-blocking (ncclConfig_t.blocking = 0), so no NCCL
// call blocks. Init is polled until connect_timeout; an enqueue until op_timeout. A watchdog
// thread aborts the communicator when a collective outlives op_timeout or NCCL reports an
// asynchronous error, whether or not anyone waits on it; Work::wait() then throws CommError
// naming the op and the timeout. Every way out of a failure goes through ncclCommAbort.
#include "nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ddprun/common/log_text.h"
#include "ddprun/common/thread_annotations.h"
#include "ddprun/worker/errors.h"
#include "ddprun/worker/nccl.h"
#include "gloo_communicator.h"
#include "nccl_health.h"
#include "op_queue.h"
#include "peer_wait.h"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "ddprun's NCCL communicator needs NCCL >= 2.14 (non-blocking communicators, ncclAvg)"
#endif

namespace ddprun::worker {

namespace {

using Clock = std::chrono::steady_clock;

void cudaCheck(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw CommError(std::string("cuda ") + what + " failed: " + cudaGetErrorString(e));
}

std::string msText(const char* name, std::chrono::milliseconds d) {
  return std::string(name) + " (" + std::to_string(d.count()) + " ms)";
}

// Unsupported dtypes map to ncclNumTypes.
ncclDataType_t ncclTypeOf(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return ncclFloat32;
    case at::kDouble:
      return ncclFloat64;
    case at::kHalf:
      return ncclFloat16;
    case at::kBFloat16:
      return ncclBfloat16;
    case at::kLong:
      return ncclInt64;
    case at::kInt:
      return ncclInt32;
    case at::kByte:
      return ncclUint8;
    case at::kChar:
      return ncclInt8;
    default:
      return ncclNumTypes;
  }
}

// Makes `device` current on this thread for the guard's lifetime (callers may use other devices).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    cudaCheck(cudaGetDevice(&previous_), "get device");
    if (previous_ != device_) cudaCheck(cudaSetDevice(device_), "set device");
  }
  ~DeviceGuard() {
    if (previous_ != device_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_;
  int previous_ = 0;
};

// An ncclResult_t as NcclHealth sees it, with NCCL's last error text for failures.
NcclStatus statusOf(ncclResult_t r, ncclComm_t comm) {
  if (r == ncclSuccess) return NcclStatus::success();
  if (r == ncclInProgress) return NcclStatus::inProgress();
  std::string text = ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') text += std::string(" (") + last + ")";
  return NcclStatus::failure(text);
}

// The real NCCL calls behind NcclHealth.
class RealNcclComm : public NcclComm {
 public:
  RealNcclComm(ncclComm_t comm, int device) : comm_(comm), device_(device) {}
  NcclStatus asyncError() override {
    ncclResult_t async = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm_, &async);
    return statusOf(r != ncclSuccess ? r : async, comm_);
  }
  void abort() override {
    cudaSetDevice(device_);
    ncclCommAbort(comm_);
  }
  ncclComm_t handle() const { return comm_; }

 private:
  ncclComm_t comm_;
  int device_;
};

// An owned cudaEvent_t shared by the submitting thread, the queue thread, the watchdog and the
// Work: whichever lets go last destroys it (an op dropped by a broken queue never runs, yet its
// events are freed).
using Event = std::shared_ptr<CUevent_st>;

Event makeEvent() {
  cudaEvent_t ev = nullptr;
  cudaCheck(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "event create");
  return Event(ev, [](cudaEvent_t e) { cudaEventDestroy(e); });
}

bool eventDone(const Event& e) { return cudaEventQuery(e.get()) != cudaErrorNotReady; }

// Work of one NCCL op: done once the queue thread enqueued it and the device finished it.
class NcclWork : public Work {
 public:
  NcclWork(std::shared_ptr<NcclHealth> health, std::shared_ptr<Work> enqueued, Event done,
           std::vector<at::Tensor> keep_alive)
      : health_(std::move(health)),
        enqueued_(std::move(enqueued)),
        done_(std::move(done)),
        keep_alive_(std::move(keep_alive)) {}

  void wait() override;
  bool isCompleted() override {
    // An event never recorded (the op failed before) queries as complete.
    return enqueued_->isCompleted() && eventDone(done_);
  }

 private:
  std::shared_ptr<NcclHealth> health_;
  std::shared_ptr<Work> enqueued_;
  Event done_;
  std::vector<at::Tensor> keep_alive_;  // the GPU may still read/write them until done_
};

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(int rank, int size, int device, std::unique_ptr<RealNcclComm> comm,
                   std::shared_ptr<NcclHealth> health, cudaStream_t stream, void* barrier_buffer)
      : rank_(rank),
        size_(size),
        device_(device),
        comm_(std::move(comm)),
        health_(std::move(health)),
        stream_(stream),
        barrier_buffer_(barrier_buffer),
        queue_(std::make_unique<OpQueue>("nccl communicator")),
        watchdog_([this] { watch(); }) {}

  ~NcclCommunicator() override {
    queue_.reset();  // drain and join: every op is enqueued or failed
    // Let what is in flight finish; the watchdog aborts a collective stuck past op_timeout.
    while (health_->inFlight() > 0 && health_->check().empty()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    {
      ddprun::MutexLock lock(watchdog_mu_);
      stopping_ = true;
    }
    watchdog_cv_.notify_all();
    watchdog_.join();
    DeviceGuard guard(device_);
    if (!health_->aborted()) {
      try {
        const ncclComm_t c = comm_->handle();
        health_->settle(health_->call([c] { return statusOf(ncclCommFinalize(c), c); }),
                        "comm finalize", Clock::now() + health_->opTimeout(),
                        msText("op_timeout", health_->opTimeout()));
      } catch (const std::exception&) {
        // settle aborted the communicator
      }
      if (!health_->aborted()) ncclCommDestroy(comm_->handle());
      health_->retire();
    }
    cudaStreamSynchronize(stream_);  // an aborted communicator's kernels have ended
    cudaFree(barrier_buffer_);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Backend backend() const override { return Backend::kNccl; }
  at::Device device() const override { return at::Device(at::kCUDA, device_); }

  std::shared_ptr<Work> allReduceAsync(at::Tensor tensor, ReduceOp op) override {
    nccl_detail::checkTensor(tensor, device_, "all_reduce");
    if (op == ReduceOp::kAvg && !at::isFloatingType(tensor.scalar_type())) {
      throw WorkerError("all_reduce: ReduceOp::kAvg needs a floating-point tensor");
    }
    const ncclDataType_t type = ncclTypeOf(tensor.scalar_type());
    const ncclRedOp_t red = op == ReduceOp::kAvg ? ncclAvg : ncclSum;
    void* data = tensor.data_ptr();
    const auto count = static_cast<size_t>(tensor.numel());
    return submit("all_reduce", {std::move(tensor)}, [this, data, count, type, red](ncclComm_t c) {
      return ncclAllReduce(data, data, count, type, red, c, stream_);
    });
  }

  std::shared_ptr<Work> broadcastAsync(at::Tensor tensor, int root) override {
    nccl_detail::checkTensor(tensor, device_, "broadcast");
    if (root < 0 || root >= size_) {
      throw WorkerError("broadcast: root " + std::to_string(root) + " is outside [0, " +
                        std::to_string(size_ - 1) + "]");
    }
    void* data = tensor.data_ptr();
    const size_t bytes = static_cast<size_t>(tensor.numel()) * tensor.element_size();
    return submit("broadcast", {std::move(tensor)}, [this, data, bytes, root](ncclComm_t c) {
      return ncclBroadcast(data, data, bytes, ncclUint8, root, c, stream_);
    });
  }

  std::shared_ptr<Work> allGatherAsync(at::Tensor input, at::Tensor output) override {
    nccl_detail::checkTensor(input, device_, "all_gather");
    nccl_detail::checkTensor(output, device_, "all_gather");
    if (output.numel() != input.numel() * size_ || output.scalar_type() != input.scalar_type()) {
      throw WorkerError(
          "all_gather: output must hold size() * input.numel() elements of the input's dtype");
    }
    const void* in = input.data_ptr();
    void* out = output.data_ptr();
    const size_t bytes = static_cast<size_t>(input.numel()) * input.element_size();
    return submit("all_gather", {std::move(input), std::move(output)},
                  [this, in, out, bytes](ncclComm_t c) {
                    return ncclAllGather(in, out, bytes, ncclUint8, c, stream_);
                  });
  }

  // An all-reduce of one float in the communicator's own device buffer: done on this rank only
  // after every rank joined it.
  std::shared_ptr<Work> barrierAsync() override {
    return submit("barrier", {}, [this](ncclComm_t c) {
      return ncclAllReduce(barrier_buffer_, barrier_buffer_, 1, ncclFloat32, ncclSum, c, stream_);
    });
  }

  void abort(const std::string& reason) override {
    queue_->abort(reason);
    health_->fail("aborted: " + reason);  // ncclCommAbort, once
  }

  // ncclBroadcast pipelines the root's bytes along the ring: each link carries them once.
  bool broadcastIsPipelined() const override { return true; }

  bool awaitIdle(std::chrono::milliseconds timeout) override {
    if (!queue_->waitIdle(timeout)) return false;
    DeviceGuard guard(device_);
    return cudaStreamSynchronize(stream_) == cudaSuccess || health_->aborted();
  }

  void setProducerStream(cudaStream_t stream) {
    producer_.store(stream == nullptr ? cudaStreamLegacy : stream);
  }

 private:
  // Records the ready event on the producer stream now (the submitting thread's view of the
  // data), then queues `enqueue` behind it on the communicator's stream.
  template <typename F>
  std::shared_ptr<Work> submit(const char* op, std::vector<at::Tensor> tensors, F enqueue) {
    const std::string failure = health_->failure();
    if (!failure.empty()) {
      throw CommError(std::string("nccl ") + op +
                      ": the communicator failed earlier and cannot run collectives: " + failure);
    }
    Event ready;
    Event done;
    {
      DeviceGuard guard(device_);
      ready = makeEvent();
      done = makeEvent();
      cudaCheck(cudaEventRecord(ready.get(), producer_.load()), "event record (producer stream)");
    }
    auto enqueued = queue_->submit([this, op, ready, done, enqueue] {
      const std::string failed = health_->failure();
      if (!failed.empty()) throw CommError(failed);
      try {
        cudaCheck(cudaSetDevice(device_), "set device");
        cudaCheck(cudaStreamWaitEvent(stream_, ready.get(), 0), "stream wait event");
        const auto start = Clock::now();
        const ncclComm_t c = comm_->handle();
        health_->settle(health_->call([&] { return statusOf(enqueue(c), c); }), op,
                        start + health_->opTimeout(), msText("op_timeout", health_->opTimeout()));
        cudaCheck(cudaEventRecord(done.get(), stream_), "event record");
        health_->track(op, start, [done] { return eventDone(done); });
      } catch (const std::exception& e) {
        health_->fail(std::string("nccl ") + op + ": " + e.what());  // aborts (once)
        throw;
      }
    });
    return std::make_shared<NcclWork>(health_, std::move(enqueued), std::move(done),
                                      std::move(tensors));
  }

  // The watchdog: a pass every 100 ms (sooner for short op_timeouts) until destruction.
  void watch() {
    static const ddprun::TextLogger log("worker");
    const auto interval = std::clamp<std::chrono::milliseconds>(
        health_->opTimeout() / 4, std::chrono::milliseconds(1), std::chrono::milliseconds(100));
    bool reported = false;
    for (;;) {
      {
        ddprun::MutexLock lock(watchdog_mu_);
        const auto until = std::chrono::steady_clock::now() + interval;
        while (!stopping_ &&
               watchdog_cv_.wait_until(watchdog_mu_, until) != std::cv_status::timeout) {
        }
        if (stopping_) return;
      }
      const std::string failure = health_->check();
      if (!failure.empty() && !reported) {
        reported = true;
        DDPRUN_LOG(log, kError, "rank " << rank_ << ": " << failure);
      }
    }
  }

  int rank_;
  int size_;
  int device_;
  std::unique_ptr<RealNcclComm> comm_;
  std::shared_ptr<NcclHealth> health_;
  cudaStream_t stream_;
  void* barrier_buffer_;
  std::atomic<cudaStream_t> producer_{cudaStreamLegacy};
  std::unique_ptr<OpQueue> queue_;
  ddprun::Mutex watchdog_mu_;
  std::condition_variable_any watchdog_cv_;
  bool stopping_ GUARDED_BY(watchdog_mu_) = false;
  std::thread watchdog_;  // last: it starts running in the constructor
};

void NcclWork::wait() {
  // Spin for the first millisecond (small collectives finish in microseconds), then back off.
  const auto start = Clock::now();
  auto pause = std::chrono::microseconds(10);
  std::optional<WaitingForPeers> waiting;  // a wait that lasts: the agent's hang check reads it
  for (;;) {
    if (!waiting && Clock::now() - start >= kMarkAfter) waiting.emplace();
    if (enqueued_->isCompleted()) {
      enqueued_->wait();  // rethrows a failure of the enqueue step
      const cudaError_t e = cudaEventQuery(done_.get());
      // A kernel ended by ncclCommAbort fires its event too: after an abort the op failed.
      if (e == cudaSuccess && health_->aborted()) throw CommError(health_->failure());
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) {
        const std::string reason = std::string("cuda event query failed: ") + cudaGetErrorString(e);
        health_->fail(reason);
        throw CommError(health_->failure());
      }
    }
    const std::string failure = health_->check();
    if (!failure.empty()) throw CommError(failure);
    if (Clock::now() - start < std::chrono::milliseconds(1)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(pause);
      pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(1));
    }
  }
}

}  // namespace

namespace nccl_detail {

int pickDevice(int requested, int visible, const std::string& count_error) {
  if (!count_error.empty() || visible <= 0) {
    throw ConfigError(
        "the nccl backend needs a CUDA device; none is visible (cudaGetDeviceCount: " +
        (count_error.empty() ? std::to_string(visible) + " devices" : count_error) +
        "); use the gloo backend on machines without GPUs");
  }
  if (requested < 0 || requested >= visible) {
    throw ConfigError("the nccl backend: cuda_device " + std::to_string(requested) +
                      " is out of range: " + std::to_string(visible) +
                      " CUDA device(s) visible (cuda_device defaults to LOCAL_RANK; NCCL needs "
                      "one device per local rank, so run at most that many ranks per node or set "
                      "ProcessGroupOptions::cuda_device)");
  }
  return requested;
}

void checkTensor(const at::Tensor& t, int device, const char* op) {
  const std::string what = std::string(op) + ": ";
  if (!t.defined()) throw WorkerError(what + "the tensor is undefined");
  if (!t.device().is_cuda()) {
    throw WorkerError(what + "the nccl backend handles CUDA tensors only, got a tensor on " +
                      t.device().str() + " (use the gloo backend for CPU tensors)");
  }
  if (t.device().index() != device) {
    throw WorkerError(what + "the tensor is on " + t.device().str() +
                      " but this rank's nccl communicator uses cuda:" + std::to_string(device));
  }
  if (t.layout() != at::kStrided) throw WorkerError(what + "the nccl backend needs dense tensors");
  if (!t.is_contiguous()) {
    throw WorkerError(what +
                      "the nccl backend needs a contiguous tensor (call .contiguous() before "
                      "the collective)");
  }
  if (ncclTypeOf(t.scalar_type()) == ncclNumTypes) {
    throw WorkerError(what + "dtype " + std::string(c10::toString(t.scalar_type())) +
                      " is not supported by the nccl backend");
  }
}

}  // namespace nccl_detail

void setNcclProducerStream(Communicator& comm, cudaStream_t stream) {
  auto* nccl = dynamic_cast<NcclCommunicator*>(&comm);
  if (nccl == nullptr) {
    throw ConfigError("setNcclProducerStream: the communicator's backend is " +
                      backendName(comm.backend()) + ", not nccl");
  }
  nccl->setProducerStream(stream);
}

std::unique_ptr<Communicator> makeNcclCommunicator(int rank, int size,
                                                   std::shared_ptr<KeyValueStore> store,
                                                   const GlooOptions& options) {
  int visible = 0;
  const cudaError_t count_status = cudaGetDeviceCount(&visible);
  const int device = nccl_detail::pickDevice(
      options.cuda_device, visible,
      count_status == cudaSuccess ? std::string() : cudaGetErrorString(count_status));
  DeviceGuard guard(device);

  // Rank 0 creates the unique id; the others read it from the store.
  const std::string key = options.prefix + "/nccl/unique_id";
  ncclUniqueId id;
  if (rank == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess)
      throw CommError(std::string("nccl get unique id failed: ") + ncclGetErrorString(r));
    store->set(key, std::vector<char>(id.internal, id.internal + sizeof(id.internal)));
  } else {
    store->wait({key}, options.connect_timeout);
    std::vector<char> bytes = store->get(key);
    if (bytes.size() != sizeof(id.internal))
      throw CommError("nccl: malformed unique id under store key " + key);
    std::memcpy(id.internal, bytes.data(), sizeof(id.internal));
  }
  // Allocate before the NCCL init so a failure here leaks no communicator.
  cudaStream_t stream = nullptr;
  cudaCheck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream create");
  void* barrier_buffer = nullptr;
  cudaError_t e = cudaMalloc(&barrier_buffer, sizeof(float));
  if (e == cudaSuccess) e = cudaMemsetAsync(barrier_buffer, 0, sizeof(float), stream);
  auto release = [&] {
    cudaFree(barrier_buffer);
    cudaStreamDestroy(stream);
  };
  if (e != cudaSuccess) {
    release();
    cudaCheck(e, "barrier buffer");
  }
  // Non-blocking: the init returns at once and is polled, so a rank that never arrives costs
  // connect_timeout, not a hang.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t handle = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&handle, size, id, rank, &config);
  if (handle == nullptr) {
    release();
    throw CommError(std::string("nccl comm init failed: ") + ncclGetErrorString(r));
  }
  auto comm = std::make_unique<RealNcclComm>(handle, device);
  auto health = std::make_shared<NcclHealth>(
      *comm, options.op_timeout, [] { return Clock::now(); },
      [](std::chrono::microseconds d) { std::this_thread::sleep_for(d); });
  try {
    health->settle(statusOf(r, handle),
                   "comm init (rank " + std::to_string(rank) + " of " + std::to_string(size) + ")",
                   Clock::now() + options.connect_timeout,
                   msText("connect_timeout", options.connect_timeout) +
                       ": a rank did not join, or cannot reach the others",
                   store->cancel());
  } catch (...) {
    release();  // settle aborted the communicator
    throw;
  }
  return std::make_unique<NcclCommunicator>(rank, size, device, std::move(comm), std::move(health),
                                            stream, barrier_buffer);
}

}  // namespace ddprun::worker
