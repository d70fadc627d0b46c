// NCCL implementation of Communicator for CUDA tensors. Compiled only when CMake finds the CUDA
// toolkit, NCCL and a CUDA-enabled LibTorch (DDPRUN_WITH_NCCL).
//
// Ordering: an op waits (cudaStreamWaitEvent) for an event recorded on the submitting thread's
// current stream, so it sees the producer's kernels; it runs on the communicator's own stream
// and Work::wait() returns once that stream finished the op.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <memory>
#include <string>

#include "ddprun/worker/errors.h"
#include "gloo_communicator.h"
#include "op_queue.h"

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

ncclDataType_t ncclType(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return ncclFloat32;
    case at::kDouble:
      return ncclFloat64;
    case at::kHalf:
      return ncclFloat16;
#if NCCL_VERSION_CODE >= 21000
    case at::kBFloat16:
      return ncclBfloat16;
#endif
    case at::kLong:
      return ncclInt64;
    case at::kInt:
      return ncclInt32;
    case at::kByte:
      return ncclUint8;
    case at::kChar:
      return ncclInt8;
    default:
      throw WorkerError("nccl backend: dtype " + std::string(c10::toString(t)) +
                        " is not supported");
  }
}

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(int rank, int size, int device, ncclComm_t comm, cudaStream_t stream)
      : rank_(rank),
        size_(size),
        device_(device),
        comm_(comm),
        stream_(stream),
        queue_(std::make_unique<OpQueue>("nccl communicator")) {}

  ~NcclCommunicator() override {
    queue_.reset();  // drain and join before the communicator and stream go away
    ncclCommDestroy(comm_);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Backend backend() const override { return Backend::kNccl; }

  std::shared_ptr<Work> allReduceAsync(at::Tensor tensor, ReduceOp op) override {
    check(tensor, "all_reduce");
    if (op == ReduceOp::kAvg && !at::isFloatingType(tensor.scalar_type())) {
      throw WorkerError("all_reduce: ReduceOp::kAvg needs a floating-point tensor");
    }
    const ncclDataType_t type = ncclType(tensor.scalar_type());
    cudaEvent_t ready = recordReady();
    return queue_->submit([this, tensor, op, type, ready] {
      begin(ready);
#if NCCL_VERSION_CODE >= 21000
      const ncclRedOp_t red = op == ReduceOp::kAvg ? ncclAvg : ncclSum;
#else
      const ncclRedOp_t red = ncclSum;
#endif
      ncclCheck(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(),
                              static_cast<size_t>(tensor.numel()), type, red, comm_, stream_),
                "all_reduce");
#if NCCL_VERSION_CODE < 21000
      if (op == ReduceOp::kAvg) {
        c10::cuda::CUDAStreamGuard guard(
            c10::cuda::getStreamFromExternal(stream_, static_cast<c10::DeviceIndex>(device_)));
        tensor.div_(size_);
      }
#endif
      finish();
    });
  }

  std::shared_ptr<Work> broadcastAsync(at::Tensor tensor, int root) override {
    check(tensor, "broadcast");
    if (root < 0 || root >= size_)
      throw WorkerError("broadcast: root " + std::to_string(root) + " is out of range");
    cudaEvent_t ready = recordReady();
    return queue_->submit([this, tensor, root, ready] {
      begin(ready);
      const size_t bytes = static_cast<size_t>(tensor.numel()) * tensor.element_size();
      ncclCheck(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), bytes, ncclUint8, root, comm_,
                              stream_),
                "broadcast");
      finish();
    });
  }

  std::shared_ptr<Work> allGatherAsync(at::Tensor input, at::Tensor output) override {
    check(input, "all_gather");
    check(output, "all_gather");
    if (output.numel() != input.numel() * size_ || output.scalar_type() != input.scalar_type()) {
      throw WorkerError(
          "all_gather: output must hold size() * input.numel() elements of the input's dtype");
    }
    cudaEvent_t ready = recordReady();
    return queue_->submit([this, input, output, ready] {
      begin(ready);
      const size_t bytes = static_cast<size_t>(input.numel()) * input.element_size();
      ncclCheck(
          ncclAllGather(input.data_ptr(), output.data_ptr(), bytes, ncclUint8, comm_, stream_),
          "all_gather");
      finish();
    });
  }

  std::shared_ptr<Work> barrierAsync() override {
    auto token = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, device_));
    return allReduceAsync(token, ReduceOp::kSum);
  }

 private:
  void check(const at::Tensor& t, const char* op) const {
    if (!t.defined() || !t.is_cuda()) {
      throw WorkerError(std::string(op) +
                        ": the nccl backend handles CUDA tensors only (use gloo for CPU tensors)");
    }
    if (t.device().index() != device_) {
      throw WorkerError(std::string(op) +
                        ": tensor is on cuda:" + std::to_string(t.device().index()) +
                        " but this rank's communicator uses cuda:" + std::to_string(device_));
    }
    if (!t.is_contiguous())
      throw WorkerError(std::string(op) + ": the nccl backend needs contiguous tensors");
  }

  // Records an event on the caller's current stream (the producer of the tensor's data).
  cudaEvent_t recordReady() const {
    cudaEvent_t ev;
    cudaCheck(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "event create");
    cudaCheck(
        cudaEventRecord(
            ev, c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)).stream()),
        "event record");
    return ev;
  }

  void begin(cudaEvent_t ready) {
    cudaCheck(cudaSetDevice(device_), "set device");
    cudaCheck(cudaStreamWaitEvent(stream_, ready, 0), "stream wait event");
    cudaEventDestroy(ready);
  }

  void finish() { cudaCheck(cudaStreamSynchronize(stream_), "stream synchronize"); }

  int rank_;
  int size_;
  int device_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  std::unique_ptr<OpQueue> queue_;
};

}  // namespace

std::unique_ptr<Communicator> makeNcclCommunicator(int rank, int size,
                                                   std::shared_ptr<KeyValueStore> store,
                                                   const GlooOptions& options) {
  int count = 0;
  cudaCheck(cudaGetDeviceCount(&count), "device count");
  if (count == 0) throw ConfigError("the nccl backend needs a CUDA device, but none is visible");
  const int device = options.cuda_device % count;
  cudaCheck(cudaSetDevice(device), "set device");

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
      throw CommError("nccl: malformed unique id in the store");
    std::memcpy(id.internal, bytes.data(), sizeof(id.internal));
  }
  ncclComm_t comm;
  ncclCheck(ncclCommInitRank(&comm, size, id, rank), "comm init");
  cudaStream_t stream;
  cudaCheck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream create");
  return std::make_unique<NcclCommunicator>(rank, size, device, comm, stream);
}

}  // namespace ddprun::worker
