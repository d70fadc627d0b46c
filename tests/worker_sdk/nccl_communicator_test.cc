// The NCCL communicator (builds with DDPRUN_WITH_NCCL only). The first cases need no GPU: they
// check the errors a user sees. The GPU cases skip (WARN + return) when no CUDA device is visible;
// they never fail for lack of one. Debian's LibTorch is CPU-only, so CUDA tensors are made with
// at::from_blob over cudaMalloc'd memory, with the device given explicitly (a CPU LibTorch cannot
// ask the driver which device a pointer lives on).
#include "nccl_communicator.h"  // worker_sdk/src: the checks that need no GPU

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "ddprun/worker/errors.h"
#include "ddprun/worker/nccl.h"
#include "ddprun/worker/process_group.h"
#include "test_util.h"
#include "thread_ranks.h"
#include "torch_catch.h"

using namespace ddprun::worker;
namespace t = ddprun::worker::testing;

namespace {

int visibleDevices() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

ProcessGroupOptions ncclOptions(int device) {
  auto o = t::fastOptions();
  o.backend = Backend::kNccl;
  o.cuda_device = device;
  return o;
}

// A tensor that claims to live on cuda:`device` over a host buffer: enough for the argument
// checks, which never dereference it.
at::Tensor fakeCudaTensor(std::vector<float>& host, int device, at::IntArrayRef strides = {}) {
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(at::Device(at::kCUDA, device));
  // TensorMaker keeps the IntArrayRefs it is given: the sizes must outlive make_tensor().
  const std::vector<int64_t> sizes{2, static_cast<int64_t>(host.size()) / 2};
  auto maker = at::for_blob(host.data(), sizes);
  maker.options(opts).target_device(at::Device(at::kCUDA, device));
  if (!strides.empty()) maker.strides(strides);
  return maker.make_tensor();
}

// A float tensor of `n` elements in device memory on cuda:`device`, freed with the tensor.
at::Tensor deviceTensor(int device, int64_t n, at::ScalarType dtype = at::kFloat) {
  if (cudaSetDevice(device) != cudaSuccess) throw std::runtime_error("cudaSetDevice failed");
  void* p = nullptr;
  const size_t bytes = static_cast<size_t>(n) * c10::elementSize(dtype);
  if (cudaMalloc(&p, bytes) != cudaSuccess) throw std::runtime_error("cudaMalloc failed");
  return at::for_blob(p, {n})
      .deleter([](void* q) { cudaFree(q); })
      .options(at::TensorOptions().dtype(dtype).device(at::Device(at::kCUDA, device)))
      .target_device(at::Device(at::kCUDA, device))
      .make_tensor();
}

template <typename T>
void upload(const at::Tensor& dst, const std::vector<T>& src) {
  if (cudaMemcpy(dst.data_ptr(), src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice) !=
      cudaSuccess)
    throw std::runtime_error("cudaMemcpy to device failed");
}

template <typename T>
std::vector<T> download(const at::Tensor& src) {
  std::vector<T> out(static_cast<size_t>(src.numel()));
  if (cudaMemcpy(out.data(), src.data_ptr(), out.size() * sizeof(T), cudaMemcpyDeviceToHost) !=
      cudaSuccess)
    throw std::runtime_error("cudaMemcpy to host failed");
  return out;
}

// Runs body(r) on one thread per rank and rethrows the first rank's failure.
void onRanks(int world, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& th : threads) th.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

// Skips the calling test unless at least one CUDA device is visible.
#define REQUIRE_GPU_OR_SKIP()                                                                 \
  do {                                                                                        \
    if (visibleDevices() < 1) {                                                               \
      WARN(                                                                                   \
          "skipped: no CUDA device is visible (cudaGetDeviceCount); run on a GPU machine to " \
          "exercise the nccl backend");                                                       \
      return;                                                                                 \
    }                                                                                         \
  } while (0)

}  // namespace

TEST_CASE("asking for the nccl backend without a visible CUDA device is a clear error",
          "[worker][nccl]") {
  if (visibleDevices() > 0) {
    WARN("skipped: a CUDA device is visible here; the GPU cases cover the nccl backend");
    return;
  }
  auto store = KeyValueStore::inMemory(std::chrono::seconds(5));
  CHECK_THROWS_MATCHES(ProcessGroup::create(0, 1, store, ncclOptions(0)), ConfigError,
                       Catch::Matchers::Predicate<ConfigError>([](const ConfigError& e) {
                         const std::string m = e.what();
                         return m.find(
                                    "the nccl backend needs a CUDA device; none is visible "
                                    "(cudaGetDeviceCount: ") != std::string::npos;
                       }));
}

TEST_CASE("the nccl device choice names the problem: no device, or one out of range",
          "[worker][nccl]") {
  CHECK_THROWS_WITH(nccl_detail::pickDevice(0, 0, ""),
                    Catch::Contains("none is visible (cudaGetDeviceCount: 0 devices)"));
  CHECK_THROWS_WITH(nccl_detail::pickDevice(0, -1, "no CUDA-capable device is detected"),
                    Catch::Contains("(cudaGetDeviceCount: no CUDA-capable device is detected)"));
  CHECK_THROWS_AS(nccl_detail::pickDevice(0, 0, ""), ConfigError);
  CHECK_THROWS_WITH(nccl_detail::pickDevice(2, 2, ""),
                    Catch::Contains("cuda_device 2 is out of range: 2 CUDA device(s) visible"));
  CHECK_THROWS_AS(nccl_detail::pickDevice(-1, 2, ""), ConfigError);
  CHECK(nccl_detail::pickDevice(1, 2, "") == 1);
}

TEST_CASE("the nccl backend rejects CPU, misplaced, strided and unsupported tensors clearly",
          "[worker][nccl]") {
  CHECK_THROWS_WITH(nccl_detail::checkTensor(at::ones({4}), 0, "all_reduce"),
                    Catch::Contains("all_reduce: the nccl backend handles CUDA tensors only, got a "
                                    "tensor on cpu (use the gloo backend for CPU tensors)"));
  CHECK_THROWS_AS(nccl_detail::checkTensor(at::ones({4}), 0, "all_reduce"), WorkerError);
  CHECK_THROWS_WITH(nccl_detail::checkTensor(at::Tensor(), 0, "broadcast"),
                    Catch::Contains("broadcast: the tensor is undefined"));

  std::vector<float> host(16, 1.0f);
  CHECK_NOTHROW(nccl_detail::checkTensor(fakeCudaTensor(host, 1), 1, "all_reduce"));
  CHECK_THROWS_WITH(
      nccl_detail::checkTensor(fakeCudaTensor(host, 1), 0, "all_reduce"),
      Catch::Contains("the tensor is on cuda:1 but this rank's nccl communicator uses cuda:0"));
  CHECK_THROWS_WITH(nccl_detail::checkTensor(fakeCudaTensor(host, 0, {1, 2}), 0, "all_gather"),
                    Catch::Contains("all_gather: the nccl backend needs a contiguous tensor"));

  auto bools = at::for_blob(host.data(), {4})
                   .options(at::TensorOptions().dtype(at::kBool).device(at::Device(at::kCUDA, 0)))
                   .target_device(at::Device(at::kCUDA, 0))
                   .make_tensor();
  CHECK_THROWS_WITH(nccl_detail::checkTensor(bools, 0, "all_reduce"),
                    Catch::Contains("dtype Bool is not supported by the nccl backend"));
}

TEST_CASE("nccl rejects a cuda_device beyond the visible GPUs (GPU only)", "[worker][nccl][gpu]") {
  REQUIRE_GPU_OR_SKIP();
  auto store = KeyValueStore::inMemory(std::chrono::seconds(5));
  CHECK_THROWS_WITH(ProcessGroup::create(0, 1, store, ncclOptions(visibleDevices())),
                    Catch::Contains("is out of range"));
}

TEST_CASE("nccl all_reduce, broadcast, all_gather and barrier on device memory (GPU only)",
          "[worker][nccl][gpu]") {
  REQUIRE_GPU_OR_SKIP();
  // NCCL allows one rank per device in a communicator: two ranks need two GPUs.
  const int world = std::min(2, visibleDevices());
  if (world < 2) WARN("one CUDA device visible: running world size 1 (NCCL needs a GPU per rank)");
  const int64_t n = 1 << 20;

  struct Seen {
    std::vector<float> sum, avg, bcast, gathered;
    std::vector<int64_t> isum;
    bool producer_stream_ok = false;
    std::string cpu_tensor_error;
  };
  std::vector<Seen> seen(static_cast<size_t>(world));
  auto store = KeyValueStore::inMemory(std::chrono::seconds(30));
  onRanks(world, [&](int r) {
    Seen& s = seen[static_cast<size_t>(r)];
    auto pg = ProcessGroup::create(r, world, store, ncclOptions(r));
    Communicator& comm = pg->comm();

    auto x = deviceTensor(r, n);
    upload(x, std::vector<float>(static_cast<size_t>(n), float(r + 1)));
    comm.allReduce(x, ReduceOp::kSum);
    s.sum = download<float>(x);

    upload(x, std::vector<float>(static_cast<size_t>(n), float(r + 1)));
    comm.allReduce(x, ReduceOp::kAvg);
    s.avg = download<float>(x);

    auto i = deviceTensor(r, 3, at::kLong);
    upload(i, std::vector<int64_t>{r, 10 * r, int64_t{1} << 40});
    comm.allReduce(i);
    s.isum = download<int64_t>(i);

    // Root is the last rank, so a two-rank run broadcasts from rank 1.
    auto b = deviceTensor(r, 16);
    upload(b, std::vector<float>(16, float(r * 10 + 7)));
    comm.broadcast(b, world - 1);
    s.bcast = download<float>(b);

    auto in = deviceTensor(r, 4);
    upload(in, std::vector<float>(4, float(r + 100)));
    auto out = deviceTensor(r, 4 * world);
    comm.allGatherAsync(in, out)->wait();
    s.gathered = download<float>(out);

    comm.barrier();

    // Data produced on the caller's own stream: the collective must wait for it.
    cudaStream_t user = nullptr;
    if (cudaStreamCreateWithFlags(&user, cudaStreamNonBlocking) != cudaSuccess)
      throw std::runtime_error("cudaStreamCreate failed");
    setNcclProducerStream(comm, user);
    std::vector<float> twos(static_cast<size_t>(n), 2.0f);
    if (cudaMemcpyAsync(x.data_ptr(), twos.data(), twos.size() * sizeof(float),
                        cudaMemcpyHostToDevice, user) != cudaSuccess)
      throw std::runtime_error("cudaMemcpyAsync failed");
    comm.allReduce(x, ReduceOp::kSum);
    setNcclProducerStream(comm, nullptr);
    cudaStreamDestroy(user);
    const auto back = download<float>(x);
    s.producer_stream_ok = back.front() == 2.0f * world && back.back() == 2.0f * world;

    try {
      comm.allReduce(at::ones({4}));
    } catch (const WorkerError& e) {
      s.cpu_tensor_error = e.what();
    }
    comm.barrier();
  });
  const float sum = static_cast<float>(world * (world + 1) / 2);
  for (int r = 0; r < world; ++r) {
    const Seen& s = seen[static_cast<size_t>(r)];
    INFO("rank " << r);
    CHECK(s.sum.front() == sum);
    CHECK(s.sum.back() == sum);
    CHECK(s.avg.front() == sum / static_cast<float>(world));
    CHECK(s.avg.back() == sum / static_cast<float>(world));
    CHECK(s.isum == std::vector<int64_t>{world * (world - 1) / 2, 10 * world * (world - 1) / 2,
                                         int64_t{world} << 40});
    CHECK(s.bcast == std::vector<float>(16, float((world - 1) * 10 + 7)));
    std::vector<float> gathered;
    for (int q = 0; q < world; ++q) gathered.insert(gathered.end(), 4, float(q + 100));
    CHECK(s.gathered == gathered);
    CHECK(s.producer_stream_ok);
    CHECK_THAT(s.cpu_tensor_error, Catch::Contains("the nccl backend handles CUDA tensors only"));
  }
}

// In-place recovery on NCCL (docs/in-place-recovery.md §3.1): the control channel's abort ends a
// collective that cannot finish, from another thread; the op fails, the communicator goes idle
// (ncclCommAbort), later ops fail with the reason, and the group forms again as the next
// generation on the same devices and computes right. The collective is held back by a host function
// on the producer stream, so it is in flight whatever the number of GPUs; with two GPUs it also
// waits on a peer that never joins it.
TEST_CASE(
    "nccl abort ends a collective in flight and the group re-forms on the same devices (GPU only)",
    "[worker][nccl][gpu][inplace]") {
  REQUIRE_GPU_OR_SKIP();
  const int world = std::min(2, visibleDevices());
  if (world < 2) WARN("one CUDA device visible: running world size 1 (NCCL needs a GPU per rank)");
  const int port = t::freePort();
  struct Seen {
    std::string outcome, later;
    bool idle = false, woke = false, reformed_ok = false;
    double abort_ms = 0, ended_ms = 0;
  };
  std::vector<Seen> seen(static_cast<size_t>(world));
  std::atomic<int> released{0};
  auto store = KeyValueStore::inMemory(std::chrono::seconds(30));
  onRanks(world, [&](int r) {
    Seen& s = seen[static_cast<size_t>(r)];
    auto o = ncclOptions(r);
    o.op_timeout = std::chrono::minutes(10);  // only the abort can end the wait
    auto pg = ProcessGroup::create(r, world, store, o);
    const int64_t n = 1 << 22;
    auto x = deviceTensor(r, n);
    upload(x, std::vector<float>(static_cast<size_t>(n), 1.0f));
    pg->comm().allReduce(x, ReduceOp::kSum);  // the group works before the fault

    // The producer stream holds the next collective back until the host function returns.
    cudaStream_t user = nullptr;
    if (cudaStreamCreateWithFlags(&user, cudaStreamNonBlocking) != cudaSuccess)
      throw std::runtime_error("cudaStreamCreate failed");
    auto hold = [](void* flag) {
      auto* f = static_cast<std::atomic<int>*>(flag);
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(8);
      while (f->load() == 0 && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    };
    if (cudaLaunchHostFunc(user, hold, &released) != cudaSuccess)
      throw std::runtime_error("cudaLaunchHostFunc failed");
    setNcclProducerStream(pg->comm(), user);
    // With two GPUs rank 1 never enters this one: rank 0 also waits on an absent peer.
    std::shared_ptr<Work> work;
    if (r == 0) work = pg->comm().allReduceAsync(x, ReduceOp::kSum);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const auto t0 = std::chrono::steady_clock::now();
    pg->abort("test");  // not the op thread, as the control channel's is not
    s.abort_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    released = 1;  // the stream may run again: the aborted kernel must not count
    if (work) {
      try {
        work->wait();
        s.outcome = "completed";
      } catch (const CommError&) {
        s.outcome = "failed";
      }
    } else {
      s.outcome = "failed";
    }
    s.woke = std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30);
    s.ended_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    s.idle = pg->comm().awaitIdle(std::chrono::seconds(10));
    try {
      pg->comm().allReduce(x, ReduceOp::kSum);
      s.later = "ran";
    } catch (const CommError& e) {
      s.later = e.what();
    }
    setNcclProducerStream(pg->comm(), nullptr);
    cudaStreamSynchronize(user);
    cudaStreamDestroy(user);

    // The next generation, on the same device, under its own store prefix.
    GroupSpec spec;
    spec.generation = 1;
    spec.rank = r;
    spec.size = world;
    spec.master_addr = "127.0.0.1";
    spec.master_port = port;
    spec.key = "g1";
    pg->reform(spec);
    upload(x, std::vector<float>(static_cast<size_t>(n), float(r + 1)));
    pg->comm().allReduce(x, ReduceOp::kSum);
    const auto back = download<float>(x);
    const float sum = static_cast<float>(world * (world + 1) / 2);
    s.reformed_ok = pg->generation() == 1 && back.front() == sum && back.back() == sum;
    pg->comm().barrier();
  });
  for (int r = 0; r < world; ++r) {
    const Seen& s = seen[static_cast<size_t>(r)];
    INFO("rank " << r << ": later op: " << s.later);
    // How long the abort call and the op's end took (the op is held until the abort returned).
    WARN("rank " << r << ": abort() returned after " << s.abort_ms << " ms, the op ended "
                 << s.ended_ms << " ms after the abort began");
    CHECK(s.outcome == "failed");
    CHECK(s.woke);
    CHECK(s.idle);
    CHECK_THAT(s.later, Catch::Contains("aborted"));
    CHECK(s.reformed_ok);
  }
}
