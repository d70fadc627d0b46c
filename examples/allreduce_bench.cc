// allreduce_bench: all-reduce bus bandwidth of the SDK's Gloo communicator, 1 KiB - 64 MiB.
// Run under ddprun/torchrun; rank 0 prints "bytes  time_us  busbw_GBps" per size. The Python
// twin is bench/worker_sdk/allreduce_torch.py (torch.distributed.all_reduce on gloo).
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>

#include "ddprun/worker/process_group.h"

int main() {
  try {
    auto group = ddprun::worker::ProcessGroup::initFromEnv();
    auto& comm = group->comm();
    const int n = comm.size();
    if (group->rank() == 0) std::printf("%12s %12s %12s\n", "bytes", "time_us", "busbw_GBps");
    for (int64_t bytes = 1024; bytes <= (64LL << 20); bytes *= 4) {
      auto t = at::ones({bytes / 4}, at::kFloat);
      const int iters = static_cast<int>(std::clamp<int64_t>((256LL << 20) / bytes, 5, 200));
      for (int i = 0; i < 3; ++i) comm.allReduce(t);
      comm.barrier();
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < iters; ++i) comm.allReduce(t);
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
