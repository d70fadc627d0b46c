// NCCL implementation of Communicator for CUDA tensors. Compiled when CMake finds the CUDA toolkit
// and NCCL >= 2.10 (DDPRUN_WITH_NCCL). It needs only the CUDA runtime API and NCCL, not a CUDA
// build of LibTorch: tensors are touched through the device-agnostic Tensor API (data_ptr, numel,
// element_size, scalar_type, device, is_contiguous) and nothing here launches an ATen kernel, so
// the same code serves a CUDA LibTorch and a CPU-only one handed CUDA tensors made with
// at::from_blob over device memory.
//
// Ordering: at submission, each op records an event on the producer stream (the legacy default
// stream unless setNcclProducerStream says otherwise) and the communicator's own non-blocking
// stream waits on it, so the collective sees the producer's kernels. The queue thread (OpQueue)
// only enqueues work on that stream and records a completion event; Work::wait() polls that event,
// NCCL's asynchronous error and op_timeout, so a dead peer is a CommError rather than a hang.
#include "nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ddprun/worker/errors.h"
#include "ddprun/worker/nccl.h"
#include "gloo_communicator.h"
#include "op_queue.h"

#if NCCL_VERSION_CODE < 21000
#error "ddprun's NCCL communicator needs NCCL >= 2.10 (ncclAvg, ncclBfloat16)"
#endif

namespace ddprun::worker {

namespace {

void ncclCheck(ncclResult_t r, const char* what) {
  if (r != ncclSuccess)
    throw CommError(std::string("nccl ") + what + " failed: " + ncclGetErrorString(r));
}

void cudaCheck(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw CommError(std::string("cuda ") + what + " failed: " + cudaGetErrorString(e));
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

// An owned cudaEvent_t shared by the submitting thread, the queue thread and the Work: whichever
// lets go last destroys it (an op dropped by a broken queue never runs, yet its events are freed).
using Event = std::shared_ptr<CUevent_st>;

Event makeEvent() {
  cudaEvent_t ev = nullptr;
  cudaCheck(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "event create");
  return Event(ev, [](cudaEvent_t e) { cudaEventDestroy(e); });
}

class NcclCommunicator;

// Work of one NCCL op: done once the queue thread enqueued it and the device finished it.
class NcclWork : public Work {
 public:
  NcclWork(NcclCommunicator* comm, std::shared_ptr<Work> enqueued, Event done,
           std::vector<at::Tensor> keep_alive, const char* op)
      : comm_(comm),
        enqueued_(std::move(enqueued)),
        done_(std::move(done)),
        keep_alive_(std::move(keep_alive)),
        op_(op) {}

  void wait() override;
  bool isCompleted() override {
    // An event never recorded (the op failed before) queries as complete.
    return enqueued_->isCompleted() && cudaEventQuery(done_.get()) != cudaErrorNotReady;
  }

 private:
  NcclCommunicator* comm_;
  std::shared_ptr<Work> enqueued_;
  Event done_;
  std::vector<at::Tensor> keep_alive_;  // the GPU may still read/write them until done_
  const char* op_;
};

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(int rank, int size, int device, ncclComm_t comm, cudaStream_t stream,
                   void* barrier_buffer, std::chrono::milliseconds op_timeout)
      : rank_(rank),
        size_(size),
        device_(device),
        comm_(comm),
        stream_(stream),
        barrier_buffer_(barrier_buffer),
        op_timeout_(op_timeout),
        queue_(std::make_unique<OpQueue>("nccl communicator")) {}

  ~NcclCommunicator() override {
    queue_.reset();  // drain and join before the communicator and stream go away
    DeviceGuard guard(device_);
    if (failed_) {
      ncclCommAbort(comm_);  // a hung collective would block ncclCommDestroy forever
    } else {
      cudaStreamSynchronize(stream_);
      ncclCommDestroy(comm_);
    }
    cudaFree(barrier_buffer_);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Backend backend() const override { return Backend::kNccl; }

  std::shared_ptr<Work> allReduceAsync(at::Tensor tensor, ReduceOp op) override {
    nccl_detail::checkTensor(tensor, device_, "all_reduce");
    if (op == ReduceOp::kAvg && !at::isFloatingType(tensor.scalar_type())) {
      throw WorkerError("all_reduce: ReduceOp::kAvg needs a floating-point tensor");
    }
    const ncclDataType_t type = ncclTypeOf(tensor.scalar_type());
    const ncclRedOp_t red = op == ReduceOp::kAvg ? ncclAvg : ncclSum;
    void* data = tensor.data_ptr();
    const auto count = static_cast<size_t>(tensor.numel());
    return submit("all_reduce", {std::move(tensor)}, [this, data, count, type, red] {
      ncclCheck(ncclAllReduce(data, data, count, type, red, comm_, stream_), "all_reduce");
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
    return submit("broadcast", {std::move(tensor)}, [this, data, bytes, root] {
      ncclCheck(ncclBroadcast(data, data, bytes, ncclUint8, root, comm_, stream_), "broadcast");
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
    return submit("all_gather", {std::move(input), std::move(output)}, [this, in, out, bytes] {
      ncclCheck(ncclAllGather(in, out, bytes, ncclUint8, comm_, stream_), "all_gather");
    });
  }

  // An all-reduce of one float in the communicator's own device buffer: done on this rank only
  // after every rank joined it.
  std::shared_ptr<Work> barrierAsync() override {
    return submit("barrier", {}, [this] {
      ncclCheck(
          ncclAllReduce(barrier_buffer_, barrier_buffer_, 1, ncclFloat32, ncclSum, comm_, stream_),
          "barrier");
    });
  }

  void setProducerStream(cudaStream_t stream) {
    producer_.store(stream == nullptr ? cudaStreamLegacy : stream);
  }

  // Called by a waiting Work: throws CommError (and marks the communicator failed) when NCCL
  // reported an asynchronous error, e.g. a peer that went away.
  void checkAsyncError(const char* op) {
    ncclResult_t async = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(comm_, &async);
    if (r != ncclSuccess) async = r;
    if (async == ncclSuccess || async == ncclInProgress) return;
    failed_ = true;
    std::string detail = ncclGetErrorString(async);
#if NCCL_VERSION_CODE >= 21300
    const char* last = ncclGetLastError(comm_);
    if (last != nullptr && *last != '\0') detail += std::string(" (") + last + ")";
#endif
    throw CommError(std::string("nccl ") + op + " failed: " + detail +
                    "; the communicator is unusable from now on");
  }

  void timedOut(const char* op) {
    failed_ = true;
    throw CommError(std::string("nccl ") + op + " did not complete within op_timeout (" +
                    std::to_string(op_timeout_.count()) +
                    " ms): a peer is gone or stuck; the communicator is unusable from now on");
  }

  std::chrono::milliseconds opTimeout() const { return op_timeout_; }

 private:
  // Records the ready event on the producer stream now (the submitting thread's view of the
  // data), then queues `enqueue` behind it on the communicator's stream.
  template <typename F>
  std::shared_ptr<Work> submit(const char* op, std::vector<at::Tensor> tensors, F enqueue) {
    if (failed_) {
      throw CommError(std::string("nccl ") + op +
                      ": the communicator failed earlier and cannot run collectives");
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
      if (failed_) throw CommError(std::string("nccl ") + op + ": the communicator failed earlier");
      cudaCheck(cudaSetDevice(device_), "set device");
      cudaCheck(cudaStreamWaitEvent(stream_, ready.get(), 0), "stream wait event");
      enqueue();
      cudaCheck(cudaEventRecord(done.get(), stream_), "event record");
    });
    return std::make_shared<NcclWork>(this, std::move(enqueued), std::move(done),
                                      std::move(tensors), op);
  }

  int rank_;
  int size_;
  int device_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  void* barrier_buffer_;
  std::chrono::milliseconds op_timeout_;
  std::atomic<cudaStream_t> producer_{cudaStreamLegacy};
  std::atomic<bool> failed_{false};
  std::unique_ptr<OpQueue> queue_;
};

void NcclWork::wait() {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto deadline = start + comm_->opTimeout();
  // Spin for the first millisecond (small collectives finish in microseconds), then back off.
  auto pause = std::chrono::microseconds(10);
  for (;;) {
    if (enqueued_->isCompleted()) {
      enqueued_->wait();  // rethrows a failure of the enqueue step
      const cudaError_t e = cudaEventQuery(done_.get());
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) cudaCheck(e, "event query");
    }
    comm_->checkAsyncError(op_);
    const auto now = Clock::now();
    if (now > deadline) comm_->timedOut(op_);
    if (now - start < std::chrono::milliseconds(1)) {
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
    ncclCheck(ncclGetUniqueId(&id), "get unique id");
    store->set(key, std::vector<char>(id.internal, id.internal + sizeof(id.internal)));
  } else {
    store->wait({key}, options.connect_timeout);
    std::vector<char> bytes = store->get(key);
    if (bytes.size() != sizeof(id.internal))
      throw CommError("nccl: malformed unique id under store key " + key);
    std::memcpy(id.internal, bytes.data(), sizeof(id.internal));
  }
  // Allocate before the (blocking) NCCL init so a failure here leaks no communicator.
  cudaStream_t stream = nullptr;
  cudaCheck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream create");
  void* barrier_buffer = nullptr;
  cudaError_t e = cudaMalloc(&barrier_buffer, sizeof(float));
  if (e == cudaSuccess) e = cudaMemsetAsync(barrier_buffer, 0, sizeof(float), stream);
  if (e != cudaSuccess) {
    cudaFree(barrier_buffer);
    cudaStreamDestroy(stream);
    cudaCheck(e, "barrier buffer");
  }
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRank(&comm, size, id, rank);
  if (r != ncclSuccess) {
    cudaFree(barrier_buffer);
    cudaStreamDestroy(stream);
    ncclCheck(r, "comm init");
  }
  return std::make_unique<NcclCommunicator>(rank, size, device, comm, stream, barrier_buffer,
                                            options.op_timeout);
}

}  // namespace ddprun::worker
