// allreduce_bench: all-reduce bus bandwidth of the SDK's communicators. Run under ddprun/torchrun:
//   allreduce_bench            Gloo on CPU tensors, 1 KiB - 64 MiB
//   allreduce_bench nccl       NCCL on device buffers (cuda:LOCAL_RANK), 1 KiB - 256 MiB
// Rank 0 prints "bytes  time_us  busbw_GBps" per size. The Python twin is
// bench/worker_sdk/allreduce_torch.py (torch.distributed.all_reduce).
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "ddprun/worker/process_group.h"

#ifdef DDPRUN_WITH_NCCL
#include <cuda_runtime.h>
#endif

namespace w = ddprun::worker;

namespace {

// A float32 buffer of `max_bytes` that the sizes below view: host memory for Gloo, device memory
// on cuda:`device` for NCCL. Made with from_blob so a CPU-only LibTorch can carry device pointers.
class Buffer {
 public:
  Buffer(w::Backend backend, int device, int64_t max_bytes) : device_(device) {
    if (backend == w::Backend::kGloo) {
      host_ = at::ones({max_bytes / 4}, at::kFloat);
      data_ = host_.data_ptr();
      return;
    }
#ifdef DDPRUN_WITH_NCCL
    if (cudaSetDevice(device) != cudaSuccess || cudaMalloc(&data_, max_bytes) != cudaSuccess ||
        cudaMemset(data_, 0, max_bytes) != cudaSuccess) {
      throw std::runtime_error("cannot allocate " + std::to_string(max_bytes) +
                               " bytes on cuda:" + std::to_string(device));
    }
    device_memory_ = true;
#endif
  }
  ~Buffer() {
#ifdef DDPRUN_WITH_NCCL
    if (device_memory_) cudaFree(data_);
#endif
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  // The first `bytes` of the buffer.
  at::Tensor view(int64_t bytes) const {
    if (host_.defined()) return host_.narrow(0, 0, bytes / 4);
    const std::vector<int64_t> sizes{bytes / 4};  // from_blob reads it in make_tensor()
    const at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(device_));
    return at::for_blob(data_, sizes)
        .options(at::TensorOptions().dtype(at::kFloat).device(device))
        .target_device(device)
        .make_tensor();
  }

 private:
  int device_;
  at::Tensor host_;
  void* data_ = nullptr;
  bool device_memory_ = false;
};

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string backend_name = argc > 1 ? argv[1] : "gloo";
    w::ProcessGroupOptions options;
    options.backend = w::parseBackend(backend_name);
    const bool nccl = options.backend == w::Backend::kNccl;
    const w::WorkerEnv env = w::WorkerEnv::fromProcessEnv();
    auto group = w::ProcessGroup::initFromEnv(env, options);
    auto& comm = group->comm();
    const int n = comm.size();
    // DDPRUN_BENCH_MAX_BYTES raises the largest size (between hosts: 256 MiB).
    int64_t max_bytes = nccl ? (256LL << 20) : (64LL << 20);
    if (const char* m = std::getenv("DDPRUN_BENCH_MAX_BYTES")) {
      char* end = nullptr;
      const long long v = std::strtoll(m, &end, 10);
      if (end == m || *end != '\0' || v < 1024 || v > (4LL << 30)) {
        std::fprintf(stderr,
                     "allreduce_bench: DDPRUN_BENCH_MAX_BYTES must be 1024..4 GiB, got '%s'\n", m);
        return 2;
      }
      max_bytes = v;
    }
    const Buffer buffer(options.backend, env.local_rank, max_bytes);
    if (group->rank() == 0) {
      std::printf("# %s, %d ranks\n%12s %12s %12s\n", backend_name.c_str(), n, "bytes", "time_us",
                  "busbw_GBps");
    }
    for (int64_t bytes = 1024; bytes <= max_bytes; bytes *= 4) {
      const at::Tensor t = buffer.view(bytes);
      const int iters = static_cast<int>(std::clamp<int64_t>((256LL << 20) / bytes, 5, 200));
      for (int i = 0; i < 3; ++i) comm.allReduce(t);
      comm.barrier();
      const auto start = std::chrono::steady_clock::now();
      if (nccl) {
        // Queue them all, as nccl-tests do: the device runs them back to back.
        std::vector<std::shared_ptr<w::Work>> works;
        for (int i = 0; i < iters; ++i) works.push_back(comm.allReduceAsync(t, w::ReduceOp::kSum));
        for (auto& work : works) work->wait();
      } else {
        for (int i = 0; i < iters; ++i) comm.allReduce(t);
      }
      const double us =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
              .count() /
          iters;
      // Bus bandwidth as nccl-tests define it: algbw * 2(n-1)/n.
      const double busbw = static_cast<double>(bytes) / (us * 1e-6) * 2.0 * (n - 1) / n / 1e9;
      if (group->rank() == 0)
        std::printf("%12lld %12.1f %12.3f\n", static_cast<long long>(bytes), us, busbw);
    }
    comm.barrier();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "allreduce_bench: %s\n", e.what());
    return 1;
  }
}
