#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>

#include "ddprun/worker/errors.h"
#include "ddprun/worker/process_group.h"
#include "ddprun/worker/trainer.h"
#include "thread_ranks.h"
#include "torch_catch.h"

using namespace ddprun::worker;
namespace t = ddprun::worker::testing;

namespace {

// Two thread ranks made by initFromEnv against a store at 127.0.0.1:port (hosted by rank 0, or
// by somebody else with use_agent_store); each all-reduces rank + 1 and returns what it got.
std::vector<float> sumsFromEnv(int port, bool use_agent_store) {
  std::vector<float> sums(2, 0);
  std::vector<std::exception_ptr> errs(2);
  std::vector<std::thread> th;
  for (int r = 0; r < 2; ++r) {
    th.emplace_back([&, r] {
      try {
        WorkerEnv env;
        env.rank = r;
        env.world_size = 2;
        env.master_addr = "127.0.0.1";
        env.master_port = port;
        env.use_agent_store = use_agent_store;
        auto pg = ProcessGroup::initFromEnv(env, t::fastOptions());
        auto x = torch::full({4}, float(r + 1));
        pg->comm().allReduce(x);
        sums[static_cast<size_t>(r)] = x[0].item<float>();
        pg->comm().barrier();
      } catch (...) {
        errs[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& x : th) x.join();
  for (auto& e : errs) {
    if (e) std::rethrow_exception(e);
  }
  return sums;
}

}  // namespace

TEST_CASE("all_reduce sums and averages across thread ranks for every size and dtype",
          "[worker][comm]") {
  const int world = 3;
  std::mutex mu;
  std::vector<std::string> failures;
  // Thread ranks share the host, so all_reduce takes the shared-memory path unless it is off.
  const bool shared_memory = GENERATE(true, false);
  ProcessGroupOptions options = t::fastOptions();
  options.shared_memory = shared_memory;
  INFO("shared_memory = " << shared_memory);
  t::runRanks(
      world,
      [&](ProcessGroup& pg) {
        auto fail = [&](const std::string& what) {
          std::lock_guard<std::mutex> l(mu);
          failures.push_back("rank " + std::to_string(pg.rank()) + ": " + what);
        };
        for (int64_t n : {0, 1, 17, 1000, 3 * 1024 * 1024 + 5}) {
          // Rank r contributes (r + 1) * arange(n); the sum is 6 * arange(n).
          auto f = torch::arange(n, torch::kFloat) * (pg.rank() + 1);
          pg.comm().allReduce(f, ReduceOp::kSum);
          if (!torch::allclose(f, torch::arange(n, torch::kFloat) * 6))
            fail("float sum n=" + std::to_string(n));
          auto d = torch::arange(n, torch::kDouble) * (pg.rank() + 1);
          pg.comm().allReduce(d, ReduceOp::kAvg);
          if (!torch::allclose(d, torch::arange(n, torch::kDouble) * 2))
            fail("double avg n=" + std::to_string(n));
          // 16-bit floats (compressed gradients): small integers are exact in both.
          for (auto dt : {torch::kHalf, torch::kBFloat16}) {
            auto h = torch::full({n}, pg.rank() + 1, dt);
            pg.comm().allReduce(h, ReduceOp::kSum);
            if (!torch::equal(h, torch::full({n}, 6, dt)))
              fail(std::string(c10::toString(dt)) + " sum n=" + std::to_string(n));
          }
          auto l = torch::full({n}, pg.rank() + 1, torch::kLong);
          pg.comm().allReduce(l, ReduceOp::kSum);
          if (!torch::equal(l, torch::full({n}, 6, torch::kLong)))
            fail("int64 sum n=" + std::to_string(n));
        }
      },
      options);
  CHECK(failures.empty());
  for (auto& f : failures) UNSCOPED_INFO(f);
}

TEST_CASE("async all_reduces complete in order and non-contiguous tensors are reduced in place",
          "[worker][comm]") {
  std::vector<std::vector<float>> got(2);
  t::runRanks(2, [&](ProcessGroup& pg) {
    std::vector<torch::Tensor> ts;
    std::vector<std::shared_ptr<Work>> works;
    for (int i = 0; i < 8; ++i) {
      ts.push_back(torch::full({1000 * (i + 1)}, float(i + pg.rank())));
      works.push_back(pg.comm().allReduceAsync(ts.back(), ReduceOp::kSum));
    }
    auto m = torch::ones({4, 6}) * (pg.rank() + 1);
    auto col = m.t();  // non-contiguous view
    pg.comm().allReduce(col, ReduceOp::kSum);
    std::vector<float>& out = got[static_cast<size_t>(pg.rank())];
    for (auto& w : works) w->wait();
    for (auto& x : ts) out.push_back(x[0].item<float>());
    out.push_back(m.sum().item<float>());
  });
  for (auto& out : got) {
    REQUIRE(out.size() == 9);
    for (int i = 0; i < 8; ++i) CHECK(out[static_cast<size_t>(i)] == float(2 * i + 1));
    CHECK(out[8] == 24 * 3.0f);
  }
}

TEST_CASE("broadcast, all_gather and barrier work across thread ranks", "[worker][comm]") {
  const int world = 3;
  // Thread ranks share the host: broadcast takes shared memory unless it is off (then Gloo's).
  const bool shared_memory = GENERATE(true, false);
  ProcessGroupOptions options = t::fastOptions();
  options.shared_memory = shared_memory;
  INFO("shared_memory = " << shared_memory);
  std::vector<torch::Tensor> bcast(world), gathered(world), big(world), held(world);
  // Not std::vector<bool>: its bits share words, and the ranks' threads write them at once (a
  // lost write failed CI).
  std::vector<char> pipelined(world);
  t::runRanks(
      world,
      [&](ProcessGroup& pg) {
        const auto r = static_cast<size_t>(pg.rank());
        auto b = torch::full({5, 3}, float(pg.rank() * 10));
        pg.comm().broadcast(b, 1);
        // Larger than the shared-memory slots (several chunks), from another root.
        auto l = torch::arange(3'000'000, torch::kDouble) * (pg.rank() == 2 ? 1 : -1);
        pg.comm().broadcast(l, 2);
        // Rank 0 says it holds root 2's values already: it keeps its own where it may.
        auto h = torch::full({1000}, float(pg.rank()));
        pg.comm().broadcastIfLackingAsync(h, 2, pg.rank() != 0)->wait();
        auto parts = pg.comm().allGather(torch::full({2}, pg.rank(), torch::kLong));
        pg.comm().barrier();
        bcast[r] = b;
        big[r] = l;
        held[r] = h;
        pipelined[r] = pg.comm().broadcastIsPipelined();
        gathered[r] = torch::cat(parts);
      },
      options);
  for (int r = 0; r < world; ++r) {
    const auto i = static_cast<size_t>(r);
    CHECK(static_cast<bool>(pipelined[i]) == shared_memory);
    CHECK(torch::equal(bcast[i], torch::full({5, 3}, 10.0f)));
    CHECK(torch::equal(big[i], torch::arange(3'000'000, torch::kDouble)));
    const float want = r == 0 && shared_memory ? 0.0f : 2.0f;
    CHECK(torch::equal(held[i], torch::full({1000}, want)));
    CHECK(torch::equal(gathered[i], torch::tensor({0, 0, 1, 1, 2, 2}, torch::kLong)));
  }
}

TEST_CASE("misuse of collectives is a clear error, not a hang", "[worker][comm]") {
  std::vector<std::string> errors(2);
  t::runRanks(2, [&](ProcessGroup& pg) {
    std::string& e = errors[static_cast<size_t>(pg.rank())];
    try {
      pg.comm().allReduce(torch::ones({3}, torch::kLong), ReduceOp::kAvg);
    } catch (const WorkerError& x) {
      e += x.what();
    }
    try {
      pg.comm().broadcast(torch::ones({3}), 5);
    } catch (const WorkerError& x) {
      e += std::string("|") + x.what();
    }
    pg.comm().barrier();  // the group still works afterwards
  });
  for (auto& e : errors) {
    CHECK_THAT(e, Catch::Contains("kAvg needs a floating-point tensor"));
    CHECK_THAT(e, Catch::Contains("root 5 is outside [0, 1]"));
  }
}

TEST_CASE("a rank whose peers never arrive fails with a timeout naming the missing keys",
          "[worker][comm]") {
  auto opts = t::fastOptions();
  opts.connect_timeout = std::chrono::milliseconds(500);
  auto store = KeyValueStore::inMemory(opts.connect_timeout);
  CHECK_THROWS_WITH(ProcessGroup::create(0, 2, store, opts), Catch::Contains("could not connect"));
}

TEST_CASE("the TCP store is hosted by rank 0 and reached by the others", "[worker][comm]") {
  auto server = KeyValueStore::tcpServer("127.0.0.1", 0, std::chrono::seconds(10));
  REQUIRE(server->port() > 0);
  auto client = KeyValueStore::tcpClient("127.0.0.1", server->port(), std::chrono::seconds(10));
  client->set("k", {'h', 'i'});
  CHECK(server->get("k") == std::vector<char>{'h', 'i'});
  CHECK(server->add("n", 2) == 2);
  CHECK(client->add("n", 3) == 5);
  CHECK_THROWS_WITH(client->wait({"never"}, std::chrono::milliseconds(200)),
                    Catch::Contains("never"));
}

TEST_CASE(
    "a store wait with a cancel set returns when the keys come, gives up naming the cancel's "
    "reason, and leaves the connection usable",
    "[worker][comm]") {
  auto server = KeyValueStore::tcpServer("127.0.0.1", 0, std::chrono::seconds(10));
  auto client = KeyValueStore::tcpClient("127.0.0.1", server->port(), std::chrono::seconds(10));
  std::atomic<bool> cancelled{false};
  std::atomic<int> asked{0};
  client->setCancel([&]() -> std::string {
    ++asked;
    return cancelled ? "generation 7 was aborted" : "";
  });
  // The key comes while the client asks.
  std::thread setter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    server->set("late", {'x'});
  });
  client->wait({"late"}, std::chrono::seconds(30));
  setter.join();
  CHECK(client->get("late") == std::vector<char>{'x'});
  CHECK(asked > 0);
  // Cancelled while it waits for a key that never comes: the reason, not the 60 s timeout.
  std::thread canceller([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    cancelled = true;
  });
  CHECK_THROWS_WITH(client->wait({"never"}, std::chrono::seconds(60)),
                    Catch::Contains("never") && Catch::Contains("generation 7 was aborted") &&
                        !Catch::Contains("timed out"));
  canceller.join();
  // The connection is still in step, and without the cancel a wait blocks until its timeout.
  client->setCancel({});
  client->set("after", {'y'});
  CHECK(server->get("after") == std::vector<char>{'y'});
  CHECK_THROWS_WITH(client->wait({"never"}, std::chrono::milliseconds(200)),
                    Catch::Contains("timed out"));
  // Connecting to a store nobody hosts gives up on the cancel too, naming the address.
  int port;
  {
    auto s = KeyValueStore::tcpServer("127.0.0.1", 0, std::chrono::seconds(5));
    port = s->port();
  }
  CHECK_THROWS_WITH(
      KeyValueStore::tcpClient("127.0.0.1", port, std::chrono::seconds(60),
                               [] { return std::string("node lost"); }),
      Catch::Contains("127.0.0.1:" + std::to_string(port)) && Catch::Contains("node lost"));
}

TEST_CASE(
    "a store wait that lasts, in a Trainer's step, marks its heartbeat file as waiting for peers "
    "until it ends, with or without a cancel, and a short one writes nothing",
    "[worker][comm]") {
  // A group the program forms after its first step waits in the store for its peers: the agent's
  // hang check must not take it for the rank that hangs.
  char dir[] = "/tmp/ddprun_store_mark_XXXXXX";
  REQUIRE(::mkdtemp(dir) != nullptr);
  const std::string path = std::string(dir) + "/heartbeat";
  // The mark (ddprun/common/heartbeat_file.h): 'w' waits for peers, '-' does not.
  auto mark = [&] {
    std::ifstream in(path);
    return static_cast<char>(in.get());
  };
  auto mtime = [&] {
    struct stat st {};
    REQUIRE(::stat(path.c_str(), &st) == 0);
    return std::make_pair(st.st_mtim.tv_sec, st.st_mtim.tv_nsec);
  };
  auto server = KeyValueStore::tcpServer("127.0.0.1", 0, std::chrono::seconds(10));
  auto client = KeyValueStore::tcpClient("127.0.0.1", server->port(), std::chrono::seconds(10));
  int checked = 0;
  t::runRanks(1, [&](ProcessGroup& pg) {
    torch::manual_seed(3);
    auto model = torch::nn::Linear(2, 1);
    auto opt =
        std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1));
    TrainerOptions o;
    o.total_epochs = 1;
    o.batch_size = 4;
    o.heartbeat_file = path;
    std::ostringstream log;
    o.log = &log;
    o.on_step = [&](const TrainingProgress& p) {
      if (p.global_step != 1) return;
      REQUIRE(mark() == '-');  // the step's touch
      for (const bool with_cancel : {false, true}) {
        INFO((with_cancel ? "with a cancel" : "without a cancel"));
        client->setCancel(with_cancel ? KeyValueStore::Cancel([] { return std::string(); })
                                      : KeyValueStore::Cancel());
        const std::string key = with_cancel ? "late-c" : "late";
        // A key already there: no mark, the file untouched.
        server->set(key + "-now", {'x'});
        const auto before = mtime();
        client->wait({key + "-now"}, std::chrono::seconds(10));
        CHECK(mtime() == before);
        // A key that comes 300 ms later: marked while it waits, unmarked after.
        std::atomic<bool> saw_waiting{false};
        std::atomic<bool> done{false};
        std::thread watcher([&] {
          while (!done) {
            if (mark() == 'w') saw_waiting = true;
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
          }
        });
        std::thread setter([&] {
          std::this_thread::sleep_for(std::chrono::milliseconds(300));
          server->set(key, {'y'});
        });
        client->wait({key}, std::chrono::seconds(10));
        done = true;
        setter.join();
        watcher.join();
        CHECK(saw_waiting);
        CHECK(mark() == '-');
        // One that times out is unmarked too.
        CHECK_THROWS_WITH(client->wait({key + "-never"}, std::chrono::milliseconds(200)),
                          Catch::Contains("timed out"));
        CHECK(mark() == '-');
        ++checked;
      }
    };
    const auto x = torch::randn({8, 2});
    const auto y = torch::randn({8, 1});
    Trainer trainer(
        std::shared_ptr<ProcessGroup>(&pg, [](ProcessGroup*) {}), model.ptr(),
        [model](const torch::Tensor& in) mutable { return model->forward(in); },
        [](const torch::Tensor& out, const torch::Tensor& target) {
          return torch::mse_loss(out, target);
        },
        opt, x, y, o);
    trainer.train();
  });
  CHECK(checked == 2);
  ::unlink(path.c_str());
  ::rmdir(dir);
}

TEST_CASE("a client reaches a store whose host comes up only after it began waiting",
          "[worker][comm]") {
  int port;
  {
    auto s = KeyValueStore::tcpServer("127.0.0.1", 0, std::chrono::seconds(5));
    port = s->port();
  }
  // Late enough that the client has left its 10 ms probes for the backed-off ones.
  std::shared_ptr<KeyValueStore> server;
  std::thread host([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    server = KeyValueStore::tcpServer("127.0.0.1", port, std::chrono::seconds(10));
    server->set("k", {'u', 'p'});
  });
  std::vector<char> got;
  try {
    auto client = KeyValueStore::tcpClient("127.0.0.1", port, std::chrono::seconds(20));
    client->wait({"k"}, std::chrono::seconds(20));
    got = client->get("k");
  } catch (...) {
    host.join();
    throw;
  }
  host.join();
  CHECK(got == std::vector<char>{'u', 'p'});
}

TEST_CASE("connecting to a store nobody hosts fails within the timeout naming the address",
          "[worker][comm]") {
  // Take a free port and release it: nothing listens there afterwards.
  int port;
  {
    auto s = KeyValueStore::tcpServer("127.0.0.1", 0, std::chrono::seconds(5));
    port = s->port();
  }
  WorkerEnv env;
  env.rank = 1;
  env.world_size = 2;
  env.master_addr = "127.0.0.1";
  env.master_port = port;
  ProcessGroupOptions o;
  o.connect_timeout = std::chrono::milliseconds(1500);
  CHECK_THROWS_WITH(
      ProcessGroup::initFromEnv(env, o),
      Catch::Contains("127.0.0.1:" + std::to_string(port)) && Catch::Contains("MASTER_ADDR"));
}

TEST_CASE("initFromEnv builds a group over the TCP store hosted by rank 0", "[worker][comm]") {
  int port;
  {
    auto s = KeyValueStore::tcpServer("127.0.0.1", 0, std::chrono::seconds(5));
    port = s->port();
  }
  CHECK(sumsFromEnv(port, /*use_agent_store=*/false) == std::vector<float>{3, 3});
}

TEST_CASE("asking for NCCL in a build without it is a clear error", "[worker][comm]") {
  if (ncclAvailable()) {
    WARN("this build has NCCL; the NCCL path is exercised by the GPU tests");
    return;
  }
  WorkerEnv env;
  env.rank = 0;
  env.world_size = 1;
  ProcessGroupOptions o;
  o.backend = Backend::kNccl;
  CHECK_THROWS_WITH(ProcessGroup::initFromEnv(env, o), Catch::Contains("no NCCL support"));
  CHECK(parseBackend("NCCL") == Backend::kNccl);
  CHECK_THROWS_WITH(parseBackend("mpi"), Catch::Contains("expected gloo or nccl"));
}

TEST_CASE("NCCL all_reduce and broadcast on CUDA tensors (GPU only)", "[worker][comm][gpu]") {
  if (!ncclAvailable() || !torch::cuda::is_available() || torch::cuda::device_count() < 1) {
    WARN("skipped: this build has no NCCL backend or no CUDA device is visible");
    return;
  }
  const int world = static_cast<int>(std::min<int64_t>(2, torch::cuda::device_count()));
  std::vector<float> sums(static_cast<size_t>(world)), bcast(static_cast<size_t>(world));
  auto o = t::fastOptions();
  o.backend = Backend::kNccl;
  auto store = KeyValueStore::inMemory(o.connect_timeout);
  std::vector<std::thread> th;
  std::vector<std::exception_ptr> errs(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    th.emplace_back([&, r] {
      try {
        auto opts = o;
        opts.cuda_device = r;
        auto pg = ProcessGroup::create(r, world, store, opts);
        auto x =
            torch::full({1 << 20}, float(r + 1), torch::TensorOptions().device(torch::kCUDA, r));
        pg->comm().allReduce(x);
        sums[static_cast<size_t>(r)] = x[0].item<float>();
        auto b =
            torch::full({16}, float(r * 10 + 7), torch::TensorOptions().device(torch::kCUDA, r));
        pg->comm().broadcast(b, 0);
        bcast[static_cast<size_t>(r)] = b[15].item<float>();
      } catch (...) {
        errs[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& x : th) x.join();
  for (auto& e : errs) {
    if (e) std::rethrow_exception(e);
  }
  const float expected = static_cast<float>(world * (world + 1) / 2);
  for (int r = 0; r < world; ++r) {
    CHECK(sums[static_cast<size_t>(r)] == expected);
    CHECK(bcast[static_cast<size_t>(r)] == 7.0f);
  }
}

TEST_CASE("with an agent-hosted store every rank connects as a client", "[worker][comm]") {
  // The "agent" hosts the store, as torchrun's static backend does (TORCHELASTIC_USE_AGENT_STORE).
  auto agent_store = KeyValueStore::tcpServer("127.0.0.1", 0, std::chrono::seconds(10));
  CHECK(sumsFromEnv(agent_store->port(), /*use_agent_store=*/true) == std::vector<float>{3, 3});
}

namespace {

// Thread ranks whose host identity comes from `hosts` (rank r is on hosts[r]).
void runOnHosts(const std::vector<std::string>& hosts,
                const std::function<void(ProcessGroup&)>& body) {
  t::runRanks(static_cast<int>(hosts.size()), body, [&](int rank) {
    ProcessGroupOptions o = t::fastOptions();
    o.host_identity = hosts[static_cast<size_t>(rank)];
    return o;
  });
}

}  // namespace

TEST_CASE("all_reduce is hierarchical across simulated hosts and exact for every size and dtype",
          "[worker][comm]") {
  // Equal hosts (one ring per local index) and unequal ones (one leader per host).
  const auto layout = GENERATE(std::vector<std::string>{"A", "A", "B", "B"},
                               std::vector<std::string>{"A", "B", "A", "B", "A", "B"},
                               std::vector<std::string>{"A", "A", "B"},
                               std::vector<std::string>{"A", "A", "A", "A", "B", "B"},
                               std::vector<std::string>{"A", "B", "A", "A"},
                               std::vector<std::string>{"A", "A", "B", "B", "C"});
  const int world = static_cast<int>(layout.size());
  const int hosts = static_cast<int>(std::set<std::string>(layout.begin(), layout.end()).size());
  std::mutex mu;
  std::vector<std::string> failures;
  std::vector<std::string> plans(layout.size());
  std::vector<torch::Tensor> averages(layout.size());
  std::vector<torch::Tensor> averages16(layout.size());
  runOnHosts(layout, [&](ProcessGroup& pg) {
    plans[static_cast<size_t>(pg.rank())] = pg.comm().describe();
    // Inexact values: every rank must still end with the same bits, also when the leaders plan
    // pipelines the buffer in 2 MiB chunks (1.5 M floats: three and a remainder).
    auto avg = torch::randn(
        {1500007},
        torch::Generator(at::detail::createCPUGenerator(static_cast<uint64_t>(pg.rank()) + 7)));
    pg.comm().allReduce(avg, ReduceOp::kAvg);
    averages[static_cast<size_t>(pg.rank())] = avg;
    auto avg16 = avg.mul(pg.rank() + 1).to(torch::kBFloat16);
    pg.comm().allReduce(avg16, ReduceOp::kAvg);
    averages16[static_cast<size_t>(pg.rank())] = avg16;
    auto fail = [&](const std::string& what) {
      std::lock_guard<std::mutex> l(mu);
      failures.push_back("rank " + std::to_string(pg.rank()) + ": " + what);
    };
    const int64_t total = static_cast<int64_t>(world) * (world + 1) / 2;
    for (int64_t n : {0, 1, 17, 1000, 3 * 1024 * 1024 + 5}) {
      auto f = torch::arange(n, torch::kFloat) * (pg.rank() + 1);
      pg.comm().allReduce(f, ReduceOp::kSum);
      if (!torch::allclose(f, torch::arange(n, torch::kFloat) * total))
        fail("float sum n=" + std::to_string(n));
      auto d = torch::full({n}, static_cast<double>(pg.rank()), torch::kDouble);
      pg.comm().allReduce(d, ReduceOp::kAvg);
      if (!torch::allclose(d, torch::full({n}, (world - 1) / 2.0, torch::kDouble)))
        fail("double avg n=" + std::to_string(n));
      // Compressed gradients: small integers stay exact in bfloat16 and half (sums <= 7 * 21).
      for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
        auto h = (torch::arange(n, torch::kLong) % 8 * (pg.rank() + 1)).to(dtype);
        pg.comm().allReduce(h, ReduceOp::kSum);
        if (!torch::equal(h, (torch::arange(n, torch::kLong) % 8 * total).to(dtype)))
          fail(std::string(c10::toString(dtype)) + " sum n=" + std::to_string(n));
      }
      // Compressed gradients: small integers stay exact in bfloat16 and half (sums <= 7 * 21).
      for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
        auto h = (torch::arange(n, torch::kLong) % 8 * (pg.rank() + 1)).to(dtype);
        pg.comm().allReduce(h, ReduceOp::kSum);
        if (!torch::equal(h, (torch::arange(n, torch::kLong) % 8 * total).to(dtype)))
          fail(std::string(c10::toString(dtype)) + " sum n=" + std::to_string(n));
      }
      auto l = torch::full({n}, pg.rank() + 1, torch::kLong);
      pg.comm().allReduce(l, ReduceOp::kSum);
      if (!torch::equal(l, torch::full({n}, total, torch::kLong)))
        fail("int64 sum n=" + std::to_string(n));
    }
    // A DDP-style buffer, reduced in place within each host.
    auto buf = pg.comm().allocateBuffer(70000, torch::dtype(torch::kFloat));
    buf.fill_(static_cast<float>(pg.rank() + 1));
    pg.comm().allReduce(buf, ReduceOp::kSum);
    if (!torch::equal(buf, torch::full({70000}, static_cast<float>(total))))
      fail("allocateBuffer sum");
  });
  for (auto& f : failures) UNSCOPED_INFO(f);
  CHECK(failures.empty());
  INFO(plans[0]);
  for (auto& p : plans) CHECK(p == plans[0]);
  CHECK(plans[0].find(std::to_string(hosts) + " hosts") != std::string::npos);
  for (auto& a : averages) CHECK(torch::equal(a, averages[0]));
  for (auto& a : averages16) CHECK(torch::equal(a, averages16[0]));
}
