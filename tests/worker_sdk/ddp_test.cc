#include "ddprun/worker/ddp.h"

#include <mutex>
#include <set>

#include "ddprun/worker/errors.h"
#include "thread_ranks.h"
#include "torch_catch.h"

using namespace ddprun::worker;
namespace t = ddprun::worker::testing;

namespace {

torch::nn::Sequential makeModel() {
  return torch::nn::Sequential(torch::nn::Linear(20, 32), torch::nn::ReLU(),
                               torch::nn::Linear(32, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 4));
}

void copyParams(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard g;
  auto src = from.parameters();
  auto dst = to.parameters();
  for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
}

double maxAbsDiff(torch::nn::Module& a, torch::nn::Module& b) {
  double m = 0;
  auto pa = a.parameters();
  auto pb = b.parameters();
  for (size_t i = 0; i < pa.size(); ++i)
    m = std::max(m, (pa[i] - pb[i]).abs().max().item<double>());
  return m;
}

struct Scenario {
  int world = 2;
  int steps = 5;
  int micro = 1;  // micro-batches per step; all but the last run under noSync
  double bucket_cap_mb = 25;
  double first_bucket_mb = 1;
  bool overlap = true;
  bool grad_views = true;
  Compression compression = Compression::kNone;
  CommHook hook;
  std::vector<std::string> hosts;  // simulated host of each rank; empty = all on this host
};

// Trains W thread-ranks with DDP on shards and one reference model on the whole batch; returns
// the max parameter difference to the reference over all ranks, and whether ranks are identical.
std::pair<double, bool> trainAndCompare(const Scenario& s) {
  const int64_t per_rank = 4;
  const int64_t batch = per_rank * s.world;
  auto init = makeModel();
  std::vector<torch::Tensor> xs, ys;
  for (int i = 0; i < s.steps * s.micro; ++i) {
    xs.push_back(torch::randn({batch, 20}));
    ys.push_back(torch::randn({batch, 4}));
  }

  auto ref = makeModel();
  copyParams(*init, *ref);
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  for (int st = 0; st < s.steps; ++st) {
    ref_opt.zero_grad();
    for (int m = 0; m < s.micro; ++m) {
      auto k = static_cast<size_t>(st * s.micro + m);
      torch::mse_loss(ref->forward(xs[k]), ys[k]).backward();
    }
    ref_opt.step();
  }

  std::vector<torch::nn::Sequential> models(static_cast<size_t>(s.world));
  auto options_of = [&](int rank) {
    ProcessGroupOptions o = t::fastOptions();
    if (!s.hosts.empty()) o.host_identity = s.hosts[static_cast<size_t>(rank)];
    return o;
  };
  t::runRanks(
      s.world,
      [&](ProcessGroup& pg) {
        auto model = makeModel();  // random init: DDP must replace it by rank 0's
        if (pg.rank() == 0) copyParams(*init, *model);
        DdpOptions o;
        o.bucket_cap_mb = s.bucket_cap_mb;
        o.first_bucket_mb = s.first_bucket_mb;
        o.overlap = s.overlap;
        o.gradient_as_bucket_view = s.grad_views;
        o.compression = s.compression;
        o.comm_hook = s.hook;
        DistributedDataParallel ddp(model.ptr(), pg.shared_from_this(), o);
        torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
        for (int st = 0; st < s.steps; ++st) {
          opt.zero_grad();
          for (int m = 0; m < s.micro; ++m) {
            auto k = static_cast<size_t>(st * s.micro + m);
            auto x = xs[k].narrow(0, pg.rank() * per_rank, per_rank);
            auto y = ys[k].narrow(0, pg.rank() * per_rank, per_rank);
            if (m + 1 < s.micro) {
              auto guard = ddp.noSync();
              torch::mse_loss(model->forward(x), y).backward();
            } else {
              torch::mse_loss(model->forward(x), y).backward();
            }
          }
          opt.step();
        }
        models[static_cast<size_t>(pg.rank())] = model;
      },
      options_of);
  double worst = 0;
  bool same = true;
  for (auto& m : models) {
    worst = std::max(worst, maxAbsDiff(*m, *ref));
    same = same && maxAbsDiff(*m, *models[0]) == 0.0;
  }
  return {worst, same};
}

}  // namespace

TEST_CASE("DDP over W thread-ranks on a split batch equals one process on the whole batch",
          "[worker][ddp]") {
  // One host (shared memory), and two simulated hosts (shared memory within, gloo across).
  const std::vector<std::vector<std::string>> layouts = {
      {"", ""}, {"", "", ""}, {"A", "A", "B", "B"}, {"A", "A", "B"}};
  for (const auto& hosts : layouts) {
    for (double cap : {25.0, 0.0005}) {
      Scenario s;
      s.world = static_cast<int>(hosts.size());
      if (!hosts.front().empty()) s.hosts = hosts;
      s.bucket_cap_mb = cap;
      s.first_bucket_mb = cap < 1 ? cap : 1.0;
      auto [diff, same] = trainAndCompare(s);
      INFO("world=" << s.world << " hosts=" << (s.hosts.empty() ? "one" : "several")
                    << " bucket_cap_mb=" << cap << " max diff=" << diff);
      CHECK(diff < 1e-6);
      CHECK(same);
    }
  }
}

TEST_CASE("DDP on uneven hosts (4+2, 3+1, 2+2+1) matches the reference on every rank",
          "[worker][ddp]") {
  const std::vector<std::vector<std::string>> layouts = {
      {"A", "A", "A", "A", "B", "B"}, {"A", "A", "A", "B"}, {"A", "A", "B", "B", "C"}};
  for (const auto& hosts : layouts) {
    Scenario s;
    s.world = static_cast<int>(hosts.size());
    s.hosts = hosts;
    s.bucket_cap_mb = 0.001;
    s.first_bucket_mb = 0.001;
    auto [diff, same] = trainAndCompare(s);
    INFO("world=" << s.world << " max diff=" << diff);
    CHECK(diff < 1e-6);
    CHECK(same);
  }
}

TEST_CASE("gradient accumulation under no_sync equals one process on the whole batch",
          "[worker][ddp]") {
  Scenario s;
  s.world = 2;
  s.micro = 3;
  s.bucket_cap_mb = 0.001;
  s.first_bucket_mb = 0.001;
  auto [diff, same] = trainAndCompare(s);
  INFO("max diff=" << diff);
  CHECK(diff < 1e-6);
  CHECK(same);
}

TEST_CASE("DDP without overlap (all-reduce after backward) gives the same result",
          "[worker][ddp]") {
  Scenario s;
  s.overlap = false;
  s.bucket_cap_mb = 0.001;
  auto [diff, same] = trainAndCompare(s);
  CHECK(diff < 1e-6);
  CHECK(same);
}

TEST_CASE("DDP with gradients copied out of the buckets (no bucket views) gives the same result",
          "[worker][ddp]") {
  for (int micro : {1, 3}) {
    Scenario s;
    s.grad_views = false;
    s.micro = micro;
    s.bucket_cap_mb = 0.001;
    auto [diff, same] = trainAndCompare(s);
    INFO("micro-batches=" << micro << " max diff=" << diff);
    CHECK(diff < 1e-6);
    CHECK(same);
  }
}

TEST_CASE("with bucket views each gradient aliases its bucket after the first step",
          "[worker][ddp]") {
  std::vector<int> aliased(2, 0);
  t::runRanks(2, [&](ProcessGroup& pg) {
    auto model = makeModel();
    DistributedDataParallel ddp(model.ptr(), pg.shared_from_this());
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    for (int st = 0; st < 2; ++st) {
      opt.zero_grad();
      torch::mse_loss(model->forward(torch::randn({4, 20})), torch::randn({4, 4})).backward();
      opt.step();
    }
    // Distinct parameters never share gradient memory...
    std::set<void*> ptrs;
    auto params = model->parameters();
    for (auto& p : params) ptrs.insert(p.grad().data_ptr());
    // ...and the last layer's bias (bucket offset 0) is followed directly by its weight.
    const auto gap = static_cast<char*>(params[4].grad().data_ptr()) -
                     static_cast<char*>(params[5].grad().data_ptr());
    aliased[static_cast<size_t>(pg.rank())] =
        ptrs.size() == 6 && gap == 4 * static_cast<long>(sizeof(float));
  });
  CHECK(aliased == std::vector<int>{1, 1});
}

namespace {
struct TwoHeadsImpl : torch::nn::Module {
  TwoHeadsImpl()
      : used(register_module("used", torch::nn::Linear(4, 4))),
        spare(register_module("spare", torch::nn::Linear(4, 2))) {}
  torch::Tensor forward(const torch::Tensor& x) { return used->forward(x); }
  torch::nn::Linear used;
  torch::nn::Linear spare;
};
TORCH_MODULE(TwoHeads);
}  // namespace

TEST_CASE("a parameter without gradient is named in the error unless unused parameters are allowed",
          "[worker][ddp]") {
  std::vector<std::string> errors(2);
  std::vector<torch::Tensor> grads(2);
  t::runRanks(2, [&](ProcessGroup& pg) {
    auto shared = pg.shared_from_this();
    {
      TwoHeads m;
      DistributedDataParallel ddp(m.ptr(), shared);
      try {
        m->forward(torch::ones({2, 4})).sum().backward();
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(pg.rank())] = e.what();
      }
    }
    TwoHeads m;
    DdpOptions o;
    o.find_unused_parameters = true;
    DistributedDataParallel ddp(m.ptr(), shared, o);
    m->forward(torch::ones({2, 4}) * (pg.rank() + 1)).sum().backward();
    grads[static_cast<size_t>(pg.rank())] = m->used->weight.grad().clone();
  });
  for (auto& e : errors) {
    CHECK_THAT(e, Catch::Contains("spare.weight") && Catch::Contains("find_unused_parameters"));
  }
  // d(sum(W x))/dW = column sums of x over 2 rows: 2 on rank 0, 4 on rank 1, average 3.
  CHECK(torch::allclose(grads[0], torch::full({4, 4}, 3.0f)));
  CHECK(torch::equal(grads[0], grads[1]));
}

namespace {
// A float layer feeding a double one: buckets of each dtype.
struct MixedImpl : torch::nn::Module {
  MixedImpl()
      : low(register_module("low", torch::nn::Linear(20, 300))),
        high(register_module("high", torch::nn::Linear(300, 4))) {
    high->to(torch::kDouble);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return high->forward(torch::tanh(low->forward(x)).to(torch::kDouble));
  }
  torch::nn::Linear low;
  torch::nn::Linear high;
};
TORCH_MODULE(Mixed);
}  // namespace

TEST_CASE(
    "float and double buckets lie apart, each gradient in its bucket, and train like one process",
    "[worker][ddp]") {
  torch::manual_seed(7);
  Mixed init;
  std::vector<torch::Tensor> xs, ys;
  for (int i = 0; i < 3; ++i) {
    xs.push_back(torch::randn({8, 20}));
    ys.push_back(torch::randn({8, 4}, torch::kDouble));
  }
  Mixed ref;
  copyParams(*init, *ref);
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1));
  for (size_t k = 0; k < xs.size(); ++k) {
    ref_opt.zero_grad();
    torch::mse_loss(ref->forward(xs[k]), ys[k]).backward();
    ref_opt.step();
  }
  std::vector<double> diff(2, -1);
  std::vector<std::string> layout(2);
  t::runRanks(2, [&](ProcessGroup& pg) {
    Mixed model;
    if (pg.rank() == 0) copyParams(*init, *model);
    DdpOptions o;
    o.first_bucket_mb = 0.001;
    o.bucket_cap_mb = 0.01;  // the float weight (6000 elements) fills buckets of its own
    DistributedDataParallel ddp(model.ptr(), pg.shared_from_this(), o);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    for (size_t k = 0; k < xs.size(); ++k) {
      opt.zero_grad();
      auto x = xs[k].narrow(0, pg.rank() * 4, 4);
      torch::mse_loss(model->forward(x), ys[k].narrow(0, pg.rank() * 4, 4)).backward();
      opt.step();
    }
    diff[static_cast<size_t>(pg.rank())] = maxAbsDiff(*model, *ref);
    // The gradients (bucket views) of one bucket follow each other, and no two buckets overlap.
    const auto params = model->parameters();
    struct Range {
      const char* begin;
      const char* end;
      at::ScalarType dtype;
    };
    std::vector<Range> ranges;
    for (const auto& bucket : ddp.bucketIndices()) {
      const torch::Tensor& first = params[bucket.front()];
      const char* begin = static_cast<const char*>(first.grad().data_ptr());
      const char* at = begin;
      for (std::size_t i : bucket) {
        if (params[i].grad().data_ptr() != at) layout[static_cast<size_t>(pg.rank())] += "gap ";
        at += params[i].numel() * params[i].element_size();
      }
      ranges.push_back(Range{begin, at, first.scalar_type()});
    }
    std::set<at::ScalarType> dtypes;
    for (const Range& a : ranges) {
      dtypes.insert(a.dtype);
      for (const Range& b : ranges) {
        if (&a == &b) continue;
        if (a.begin < b.end && b.begin < a.end)
          layout[static_cast<size_t>(pg.rank())] += "overlap ";
      }
    }
    if (ranges.size() < 4 || dtypes.size() != 2) layout[static_cast<size_t>(pg.rank())] += "few ";
  });
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    CHECK(diff[static_cast<size_t>(r)] < 1e-6);
    CHECK(diff[static_cast<size_t>(r)] >= 0);
    CHECK(layout[static_cast<size_t>(r)].empty());
  }
}

TEST_CASE("ranks holding different models are told so at construction", "[worker][ddp]") {
  std::vector<std::string> errors(2);
  t::runRanks(2, [&](ProcessGroup& pg) {
    auto m = pg.rank() == 0 ? torch::nn::Sequential(torch::nn::Linear(4, 4))
                            : torch::nn::Sequential(torch::nn::Linear(4, 5));
    try {
      DistributedDataParallel ddp(m.ptr(), pg.shared_from_this());
    } catch (const ConfigError& e) {
      errors[static_cast<size_t>(pg.rank())] = e.what();
    }
  });
  for (auto& e : errors) CHECK_THAT(e, Catch::Contains("every rank must build the same model"));
}

TEST_CASE("fp16 and bf16 compression track the reference within the cast's precision",
          "[worker][ddp]") {
  // Two simulated hosts too: the 16-bit buckets take the TCP ring there.
  for (const auto& hosts : std::vector<std::vector<std::string>>{{"", ""}, {"A", "A", "B"}}) {
    for (Compression c : {Compression::kFp16, Compression::kBf16}) {
      Scenario s;
      s.world = static_cast<int>(hosts.size());
      if (!hosts.front().empty()) s.hosts = hosts;
      s.compression = c;
      s.bucket_cap_mb = 0.001;  // several buckets
      s.first_bucket_mb = 0.001;
      auto [diff, same] = trainAndCompare(s);
      INFO(compressionName(c) << " world=" << s.world << " max diff=" << diff);
      // 5 SGD steps at lr 0.1 on gradients carrying 11 (fp16) or 8 (bf16) significant bits.
      CHECK(diff < (c == Compression::kFp16 ? 1e-3 : 1e-2));
      CHECK(diff > 0);  // the cast really happened
      CHECK(same);      // and every rank holds the same parameters
    }
  }
}

TEST_CASE("a custom communication hook reduces every bucket in order", "[worker][ddp]") {
  std::mutex mu;
  std::vector<std::size_t> seen;  // bucket indices rank 0's hook saw, in call order
  Scenario s;
  s.steps = 2;
  s.bucket_cap_mb = 0.001;
  s.first_bucket_mb = 0.001;
  const CommHook plain = allReduceHook();
  s.hook = [&](Communicator& comm, const GradBucket& b) {
    if (comm.rank() == 0) {
      std::lock_guard<std::mutex> l(mu);
      seen.push_back(b.index);
    }
    return plain(comm, b);
  };
  auto [diff, same] = trainAndCompare(s);
  CHECK(diff < 1e-6);
  CHECK(same);
  REQUIRE(seen.size() % 2 == 0);
  const std::size_t buckets = seen.size() / 2;
  REQUIRE(buckets > 1);
  for (std::size_t i = 0; i < seen.size(); ++i) CHECK(seen[i] == i % buckets);
}

TEST_CASE("compression names parse and bad ones are a clear error", "[worker][ddp]") {
  CHECK(parseCompression("none") == Compression::kNone);
  CHECK(parseCompression("fp16") == Compression::kFp16);
  CHECK(parseCompression("bf16") == Compression::kBf16);
  for (const std::string bad : {"", "FP16", "int8", "bf16 "}) {
    try {
      parseCompression(bad);
      FAIL("accepted '" << bad << "'");
    } catch (const ConfigError& e) {
      CHECK(std::string(e.what()) == "compression must be none, fp16 or bf16, got '" + bad + "'");
    }
  }
  CHECK_THROWS_AS(compressHook(torch::kFloat), ConfigError);
}
