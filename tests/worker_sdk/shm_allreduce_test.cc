// The intra-host shared-memory all-reduce: exact sums for every dtype and size across 2-4 ranks
// (threads, each with its own mapping), with slots small enough that most sizes take many chunks;
// bit-identical results on every rank; the all-or-nobody fallback; nothing left in /dev/shm; and
// a clear error when a peer process dies mid-collective; and an aborted group's buffers taken over
// by the next group (in-place recovery), but never a live group's or a file a peer names.
#include "shm_allreduce.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ddprun/worker/errors.h"
#include "ddprun/worker/store.h"
#include "half_kernels.h"
#include "process_helpers.h"

using namespace ddprun::worker;
namespace t = ddprun::testing;

namespace {

ShmOptions smallSlots(const std::string& prefix) {
  ShmOptions o;
  o.prefix = prefix;
  o.slot_bytes = 4096;  // 1024 floats: sizes below cross many chunk boundaries
  o.setup_timeout = std::chrono::seconds(30);
  o.op_timeout = std::chrono::seconds(60);
  return o;
}

// Runs `body(rank, shm)` on `world` threads; shm is null when the group fell back.
void runShmRanks(int world, const std::function<ShmOptions(int)>& options_of,
                 const std::function<void(int, ShmAllReduce*)>& body) {
  auto store = KeyValueStore::inMemory(std::chrono::seconds(30));
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto shm = ShmAllReduce::tryCreate(r, world, store, options_of(r));
        body(r, shm.get());
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

template <typename T>
std::vector<T> contribution(int rank, size_t n) {
  std::vector<T> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<T>((rank + 1) * static_cast<int64_t>(i % 1000));
  return v;
}

template <typename T>
std::string checkSum(ShmAllReduce& shm, int world, size_t n, ShmDType dtype) {
  std::vector<T> v = contribution<T>(shm.rank(), n);
  shm.allReduce(v.data(), n, dtype);
  const int64_t factor = static_cast<int64_t>(world) * (world + 1) / 2;
  for (size_t i = 0; i < n; ++i) {
    if (v[i] != static_cast<T>(factor * static_cast<int64_t>(i % 1000))) {
      return "n=" + std::to_string(n) + " element " + std::to_string(i) + " is " +
             std::to_string(v[i]);
    }
  }
  return "";
}

std::vector<std::string> ourSegments() {
  std::vector<std::string> out;
  const std::string mine = "ddprun-" + std::to_string(getpid()) + "-";
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) {
      if (std::string(e->d_name).rfind(mine, 0) == 0) out.push_back(e->d_name);
    }
    closedir(d);
  }
  return out;
}

// Runs `check` on every rank of a `world`-rank group with small slots named `name`; each rank
// returns what it found wrong. Every finding is reported with its world and rank, then checked.
void checkOnShmRanks(int world, const std::string& name,
                     const std::function<std::vector<std::string>(int, ShmAllReduce&)>& check) {
  std::mutex mu;
  std::vector<std::string> failures;
  runShmRanks(
      world, [&](int) { return smallSlots(name); },
      [&](int rank, ShmAllReduce* shm) {
        if (shm == nullptr) throw std::runtime_error("no shared-memory group on one host");
        const std::vector<std::string> found = check(rank, *shm);
        std::lock_guard<std::mutex> l(mu);
        for (const std::string& f : found) {
          failures.push_back("world " + std::to_string(world) + " rank " + std::to_string(rank) +
                             ": " + f);
        }
      });
  for (auto& f : failures) UNSCOPED_INFO(f);
  CHECK(failures.empty());
}

}  // namespace

TEST_CASE("shared-memory all-reduce sums every dtype and size exactly across 2, 3 and 4 ranks",
          "[worker][shm]") {
  for (int world : {2, 3, 4}) {
    checkOnShmRanks(world, "sizes" + std::to_string(world), [&](int, ShmAllReduce& shm) {
      std::vector<std::string> found;
      for (size_t n : {size_t{0}, size_t{1}, size_t{15}, size_t{16}, size_t{17}, size_t{1023},
                       size_t{1024}, size_t{1025}, size_t{5000}, size_t{70001}}) {
        for (const std::string& err : {checkSum<float>(shm, world, n, ShmDType::kFloat32),
                                       checkSum<double>(shm, world, n, ShmDType::kFloat64),
                                       checkSum<int32_t>(shm, world, n, ShmDType::kInt32),
                                       checkSum<int64_t>(shm, world, n, ShmDType::kInt64)}) {
          if (!err.empty()) found.push_back(err);
        }
      }
      return found;
    });
  }
}

TEST_CASE("shared-memory all-reduce sums bfloat16 and half, rounding after each addition",
          "[worker][shm]") {
  namespace k = ddprun::worker::kernels;
  for (int world : {2, 3}) {
    checkOnShmRanks(world, "half" + std::to_string(world), [&](int rank, ShmAllReduce& shm) {
      std::vector<std::string> found;
      for (const bool bf16 : {true, false}) {
        auto to16 = [&](float f) { return bf16 ? k::bf16FromFloat(f) : k::halfFromFloat(f); };
        auto from16 = [&](uint16_t h) { return bf16 ? k::floatFromBf16(h) : k::floatFromHalf(h); };
        const ShmDType dtype = bf16 ? ShmDType::kBFloat16 : ShmDType::kHalf;
        const size_t n = 70001;
        // Small integers: exact in both formats, so the sum is exact.
        std::vector<uint16_t> v(n);
        for (size_t i = 0; i < n; ++i) v[i] = to16(static_cast<float>((rank + 1) * (i % 8)));
        shm.allReduce(v.data(), n, dtype);
        // An average: the piece's owner adds the others' 1.1 * (r+1) to its own in rank
        // order, rounding after each addition, then scales and rounds once more.
        std::vector<uint16_t> a(n, to16(1.1f * static_cast<float>(rank + 1)));
        shm.allReduce(a.data(), n, dtype, 1.0 / world);
        std::vector<uint16_t> averages;  // one per possible owner
        for (int owner = 0; owner < world; ++owner) {
          uint16_t sum = to16(1.1f * static_cast<float>(owner + 1));
          for (int r = 0; r < world; ++r) {
            if (r != owner) sum = to16(from16(sum) + from16(to16(1.1f * (r + 1.0f))));
          }
          averages.push_back(to16(from16(sum) * static_cast<float>(1.0 / world)));
        }
        const float factor = static_cast<float>(world * (world + 1) / 2);
        for (size_t i = 0; i < n; ++i) {
          std::string err;
          if (v[i] != to16(factor * static_cast<float>(i % 8))) err = "sum";
          if (std::find(averages.begin(), averages.end(), a[i]) == averages.end()) {
            err = "average";
          }
          if (!err.empty()) {
            found.push_back(std::string(bf16 ? "bfloat16 " : "half ") + err + " at " +
                            std::to_string(i));
            break;
          }
        }
      }
      return found;
    });
  }
}

TEST_CASE("shared-memory all-reduce gives bit-identical floats on every rank", "[worker][shm]") {
  const int world = 3;
  const size_t n = 10007;
  std::vector<std::vector<float>> inputs(world, std::vector<float>(n));
  std::mt19937 gen(7);
  std::normal_distribution<float> dist;
  for (auto& in : inputs)
    for (auto& x : in) x = dist(gen);
  std::vector<std::vector<float>> outputs = inputs;
  runShmRanks(
      world, [](int) { return smallSlots("bits"); },
      [&](int rank, ShmAllReduce* shm) {
        if (shm == nullptr) throw std::runtime_error("no shared-memory group on one host");
        shm->allReduce(outputs[static_cast<size_t>(rank)].data(), n, ShmDType::kFloat32);
      });
  CHECK(outputs[0] == outputs[1]);
  CHECK(outputs[0] == outputs[2]);
  double worst = 0;
  for (size_t i = 0; i < n; ++i) {
    const double want = static_cast<double>(inputs[0][i]) + inputs[1][i] + inputs[2][i];
    worst = std::max(worst, std::abs(want - outputs[0][i]));
  }
  CHECK(worst < 1e-5);
}

TEST_CASE("one rank without shared memory makes every rank fall back, leaving no segment",
          "[worker][shm]") {
  std::vector<int> got(3, -1);
  runShmRanks(
      3,
      [](int rank) {
        ShmOptions o = smallSlots("fallback");
        o.enabled = rank != 2;
        return o;
      },
      [&](int rank, ShmAllReduce* shm) { got[static_cast<size_t>(rank)] = shm ? 1 : 0; });
  CHECK(got == std::vector<int>{0, 0, 0});
  CHECK(ourSegments().empty());

  // And when every rank attached, the name is already gone from /dev/shm while the group lives.
  std::vector<std::string> during;
  runShmRanks(
      2, [](int) { return smallSlots("unlinked"); },
      [&](int rank, ShmAllReduce* shm) {
        if (shm == nullptr) throw std::runtime_error("no shared-memory group on one host");
        int64_t x = 1;
        shm->allReduce(&x, 1, ShmDType::kInt64);  // both ranks are past setup
        if (rank == 0) during = ourSegments();
      });
  CHECK(during.empty());
}

TEST_CASE("a single rank never builds a shared-memory group", "[worker][shm]") {
  auto store = KeyValueStore::inMemory(std::chrono::seconds(5));
  CHECK(ShmAllReduce::tryCreate(0, 1, store, smallSlots("single")) == nullptr);
}

TEST_CASE(
    "ranks in separate processes share a segment, and a peer that exits is named, not waited on",
    "[worker][shm]") {
  const std::string peer = std::string(DDPRUN_TEST_BUILD_DIR) + "/tests/worker_sdk/shm_peer";
  auto store = KeyValueStore::tcpServer("127.0.0.1", 0, std::chrono::seconds(30));
  const std::string port = std::to_string(store->port());
  ShmOptions options = smallSlots("peer");

  SECTION("a peer process reduces with us") {
    t::Process child({peer, port, "1", "2", "sum", "5000"}, {},
                     {"/tmp/ddprun_shm_peer_sum.log", /*own_process_group=*/true});
    auto shm = ShmAllReduce::tryCreate(0, 2, store, options);
    REQUIRE(shm != nullptr);
    std::vector<int64_t> v(5000, 1);
    shm->allReduce(v.data(), v.size(), ShmDType::kInt64);
    CHECK(v == std::vector<int64_t>(5000, 3));
    INFO(child.output());
    CHECK(child.waitExit(std::chrono::seconds(30)) == 0);
  }

  SECTION("a peer that exits mid-job") {
    t::Process child({peer, port, "1", "2", "attach-exit"}, {},
                     {"/tmp/ddprun_shm_peer_exit.log", /*own_process_group=*/true});
    auto shm = ShmAllReduce::tryCreate(0, 2, store, options);
    REQUIRE(shm != nullptr);
    INFO(child.output());
    REQUIRE(child.waitExit(std::chrono::seconds(30)) == 0);  // reaped: its pid is gone
    std::vector<float> v(100, 1.0f);
    try {
      shm->allReduce(v.data(), v.size(), ShmDType::kFloat32);
      FAIL("all-reduce with a dead peer returned");
    } catch (const CommError& e) {
      const std::string msg = e.what();
      INFO(msg);
      CHECK(msg.find("rank 1") != std::string::npos);
      CHECK(msg.find("exited") != std::string::npos);
    }
  }
}

TEST_CASE("shared-memory average folds 1/size into the reduction and integers ignore the scale",
          "[worker][shm]") {
  for (int world : {2, 4}) {  // 1/2 and 1/4 are exact, so the averages below are too
    std::vector<std::string> failures(static_cast<size_t>(world));
    runShmRanks(
        world, [&](int) { return smallSlots("avg" + std::to_string(world)); },
        [&](int rank, ShmAllReduce* shm) {
          if (shm == nullptr) throw std::runtime_error("no shared-memory group on one host");
          std::vector<double> d(3001);
          std::vector<int64_t> l(3001, rank + 1);
          for (size_t i = 0; i < d.size(); ++i) d[i] = static_cast<double>(rank * 8 + i % 7);
          shm->allReduce(d.data(), d.size(), ShmDType::kFloat64, 1.0 / world);
          shm->allReduce(l.data(), l.size(), ShmDType::kInt64, 1.0 / world);
          const double mean_rank8 = 8.0 * (world - 1) / 2.0;
          for (size_t i = 0; i < d.size(); ++i) {
            if (d[i] != mean_rank8 + static_cast<double>(i % 7)) {
              failures[static_cast<size_t>(rank)] = "double element " + std::to_string(i);
              return;
            }
            if (l[i] != world * (world + 1) / 2) {
              failures[static_cast<size_t>(rank)] = "int64 element " + std::to_string(i);
              return;
            }
          }
        });
    for (auto& f : failures) CHECK(f == "");
  }
}

TEST_CASE("buffers from allocate() are reduced in place, whole or in part, between staged ops",
          "[worker][shm]") {
  for (int world : {2, 3}) {
    std::vector<std::string> failures(static_cast<size_t>(world));
    runShmRanks(
        world, [&](int) { return smallSlots("inplace" + std::to_string(world)); },
        [&](int rank, ShmAllReduce* shm) {
          if (shm == nullptr) throw std::runtime_error("no shared-memory group on one host");
          auto& fail = failures[static_cast<size_t>(rank)];
          const int64_t total = static_cast<int64_t>(world) * (world + 1) / 2;
          for (size_t n : {size_t{1}, size_t{5000}, size_t{300000}}) {
            std::shared_ptr<void> mem = shm->allocate(n * sizeof(float));
            if (!mem) throw std::runtime_error("allocate refused");
            auto* f = static_cast<float*>(mem.get());
            if (f[0] != 0.0f || f[n - 1] != 0.0f) fail = "allocate() memory is not zeroed";
            for (size_t i = 0; i < n; ++i) f[i] = static_cast<float>((rank + 1) * (i % 100));
            shm->allReduce(f, n, ShmDType::kFloat32);
            std::vector<int32_t> staged(33, rank + 1);  // a staged op between in-place ones
            shm->allReduce(staged.data(), staged.size(), ShmDType::kInt32);
            if (staged[32] != total) fail = "staged op between in-place ones";
            for (size_t i = 0; i < n; ++i) {
              if (f[i] != static_cast<float>(total * static_cast<int64_t>(i % 100))) {
                fail = "n=" + std::to_string(n) + " element " + std::to_string(i);
                return;
              }
            }
            if (n > 1000) {  // a sub-range, averaged; the rest of the buffer is untouched
              for (size_t i = 100; i < 877; ++i) f[i] = static_cast<float>(rank * world);
              shm->allReduce(f + 100, 777, ShmDType::kFloat32, 1.0 / world);
              const float mean = static_cast<float>(world * (world - 1)) / 2.0f;
              if (f[99] != static_cast<float>(total * 99) || f[100] != mean || f[876] != mean ||
                  f[877] != static_cast<float>(total * 77)) {
                fail = "sub-range n=" + std::to_string(n);
              }
            }
          }
        });
    for (auto& f : failures) CHECK(f == "");
  }
}

TEST_CASE("allocate() that /dev/shm cannot hold is refused on every rank", "[worker][shm]") {
  std::vector<int> got(2, -1);
  runShmRanks(
      2, [](int) { return smallSlots("huge"); },
      [&](int rank, ShmAllReduce* shm) {
        if (shm == nullptr) throw std::runtime_error("no shared-memory group on one host");
        got[static_cast<size_t>(rank)] = shm->allocate(size_t{1} << 50) ? 1 : 0;  // 1 PiB
        int64_t x = 1;  // the group still works afterwards
        shm->allReduce(&x, 1, ShmDType::kInt64);
        if (x != 2) got[static_cast<size_t>(rank)] = -2;
      });
  CHECK(got == std::vector<int>{0, 0});
}

TEST_CASE("ranks that disagree on an all-reduce all get an error naming both sides",
          "[worker][shm]") {
  std::vector<std::string> errors(2);
  auto body = [&](bool in_place_on_rank1) {
    runShmRanks(
        2, [&](int) { return smallSlots(in_place_on_rank1 ? "disagree-path" : "disagree-count"); },
        [&](int rank, ShmAllReduce* shm) {
          if (shm == nullptr) throw std::runtime_error("no shared-memory group on one host");
          std::shared_ptr<void> mem = shm->allocate(64 * sizeof(float));
          std::vector<float> plain(64, 1.0f);
          float* data =
              in_place_on_rank1 && rank == 1 ? static_cast<float*>(mem.get()) : plain.data();
          const size_t n = !in_place_on_rank1 && rank == 1 ? 32 : 64;
          try {
            shm->allReduce(data, n, ShmDType::kFloat32);
          } catch (const CommError& e) {
            errors[static_cast<size_t>(rank)] = e.what();
          }
        });
  };
  body(false);
  for (auto& e : errors) {
    INFO(e);
    CHECK(e.find("ranks disagree") != std::string::npos);
    CHECK(e.find("64 float32 elements") != std::string::npos);
    CHECK(e.find("32 float32 elements") != std::string::npos);
  }
  errors.assign(2, "");
  body(true);
  for (auto& e : errors) {
    INFO(e);
    CHECK(e.find("shared buffer") != std::string::npos);
  }
}

TEST_CASE(
    "shared-memory broadcast copies the root's bytes to every rank, any size, any root, "
    "between all-reduces",
    "[worker][shm]") {
  for (int world : {2, 3, 4}) {
    checkOnShmRanks(world, "bcast", [world](int rank, ShmAllReduce& shm) {
      std::vector<std::string> found;
      // Slots of 4096 bytes: a chunk is world * 4096 bytes. Sizes around it, empty and odd.
      const size_t chunk = shm.slotBytes() * static_cast<size_t>(world);
      for (size_t bytes :
           {size_t{0}, size_t{1}, size_t{7}, chunk - 1, chunk, chunk + 1, 3 * chunk + 13}) {
        for (int root = 0; root < world; ++root) {
          std::vector<unsigned char> v(bytes);
          for (size_t i = 0; i < bytes; ++i) {
            v[i] = static_cast<unsigned char>(rank == root ? (i * 31 + root) & 0xff : 0xee);
          }
          shm.broadcast(v.data(), bytes, root);
          for (size_t i = 0; i < bytes; ++i) {
            if (v[i] != static_cast<unsigned char>((i * 31 + root) & 0xff)) {
              found.push_back(std::to_string(bytes) + " bytes from root " + std::to_string(root) +
                              ": byte " + std::to_string(i) + " is " + std::to_string(v[i]));
              break;
            }
          }
          // A staged all-reduce right after uses the slots the broadcast just used.
          const std::string sum = checkSum<float>(shm, world, 3000, ShmDType::kFloat32);
          if (!sum.empty()) found.push_back("all-reduce after a broadcast: " + sum);
        }
      }
      return found;
    });
  }
}

TEST_CASE("a rank that already holds the root's bytes takes part in a broadcast but copies nothing",
          "[worker][shm]") {
  checkOnShmRanks(3, "bcast-held", [](int rank, ShmAllReduce& shm) {
    std::vector<std::string> found;
    const size_t bytes = 5 * shm.slotBytes() * 3 + 5;  // several chunks
    std::vector<unsigned char> v(bytes, static_cast<unsigned char>(rank == 0 ? 7 : 9));
    shm.broadcast(v.data(), bytes, 0, /*receive=*/rank != 1);
    const unsigned char want = rank == 1 ? 9 : 7;  // rank 1 kept its own
    if (std::count(v.begin(), v.end(), want) != static_cast<std::ptrdiff_t>(bytes)) {
      found.push_back("holds other bytes than " + std::to_string(want));
    }
    const std::string sum = checkSum<double>(shm, 3, 5000, ShmDType::kFloat64);
    if (!sum.empty()) found.push_back("all-reduce after it: " + sum);
    return found;
  });
}

TEST_CASE("ranks that disagree on a broadcast's root or size all get an error naming both sides",
          "[worker][shm]") {
  for (bool other_root : {true, false}) {
    std::vector<std::string> errors(2);
    runShmRanks(
        2, [](int) { return smallSlots("bcast-mismatch"); },
        [&](int rank, ShmAllReduce* shm) {
          REQUIRE(shm != nullptr);
          std::vector<char> data(100, 'x');
          const int root = other_root && rank == 1 ? 1 : 0;
          const size_t n = !other_root && rank == 1 ? 50 : 100;
          try {
            shm->broadcast(data.data(), n, root);
          } catch (const CommError& e) {
            errors[static_cast<size_t>(rank)] = e.what();
          }
        });
    for (auto& e : errors) {
      INFO(e);
      CHECK(e.find("ranks disagree") != std::string::npos);
      CHECK(e.find(other_root ? "bytes from rank 1" : "broadcasts 50 bytes") != std::string::npos);
    }
  }
  // A root outside the group is refused before anything is shared.
  runShmRanks(
      2, [](int) { return smallSlots("bcast-root"); },
      [&](int, ShmAllReduce* shm) {
        REQUIRE(shm != nullptr);
        char c = 0;
        CHECK_THROWS_WITH(shm->broadcast(&c, 1, 2),
                          Catch::Matchers::Contains("root 2 is outside [0, 1]"));
      });
}

TEST_CASE("an aborted rank's broadcast fails at once instead of waiting for a dead peer",
          "[worker][shm]") {
  std::vector<std::string> errors(2);
  runShmRanks(
      2, [](int) { return smallSlots("bcast-abort"); },
      [&](int rank, ShmAllReduce* shm) {
        REQUIRE(shm != nullptr);
        if (rank == 1) return;  // never joins: rank 0 waits in the broadcast until aborted
        std::thread aborter([shm] {
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
          shm->abort();
        });
        std::vector<char> data(10000, 'x');
        const auto t0 = std::chrono::steady_clock::now();
        try {
          shm->broadcast(data.data(), data.size(), 0);
        } catch (const CommError& e) {
          errors[0] = e.what();
        }
        aborter.join();
        CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30));
      });
  INFO(errors[0]);
  CHECK(errors[0].find("was aborted (broadcast: copying in)") != std::string::npos);
}

namespace {

// A group under `prefix` on the shared store, or an exception.
std::unique_ptr<ShmAllReduce> group(int rank, int world, std::shared_ptr<KeyValueStore> store,
                                    const std::string& prefix) {
  auto shm = ShmAllReduce::tryCreate(rank, world, std::move(store), smallSlots(prefix));
  if (!shm) throw std::runtime_error("no shared-memory group on one host");
  return shm;
}

// Each rank's mark in its region of the n-th buffer.
float markOf(int rank, size_t k) { return static_cast<float>(1000 * (rank + 1) + k); }

// Runs `body(rank, fail)` on `world` threads; `fail` is what the rank found wrong (an exception's
// message counts too). Every rank's finding is checked.
void onRanks(int world, const std::function<void(int, std::string&)>& body) {
  std::vector<std::string> failures(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      std::string& fail = failures[static_cast<size_t>(r)];
      try {
        body(r, fail);
      } catch (const std::exception& e) {
        fail = e.what();
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r);
    CHECK(failures[static_cast<size_t>(r)] == "");
  }
}

}  // namespace

TEST_CASE(
    "after an abort the next group takes the buffers over: survivors keep their pages, a "
    "newcomer maps them through a survivor",
    "[worker][shm]") {
  const int world = 3;
  const int newcomer = 1;  // its "process" dropped everything, as a killed rank's did
  const std::vector<size_t> sizes = {5000, 300000, 7};
  auto store = KeyValueStore::inMemory(std::chrono::seconds(30));
  onRanks(world, [&](int r, std::string& fail) {
    auto a = group(r, world, store, "takeover-a");
    std::vector<std::shared_ptr<void>> old;
    for (size_t k = 0; k < sizes.size(); ++k) {
      old.push_back(a->allocate(sizes[k] * sizeof(float)));
      if (!old.back()) throw std::runtime_error("allocate refused");
      std::fill_n(static_cast<float*>(old.back().get()), sizes[k], markOf(r, k));
    }
    int64_t x = 1;
    a->allReduce(&x, 1, ShmDType::kInt64);  // every rank has marked its regions
    a->abort();
    if (r == newcomer) old.clear();
    auto b = group(r, world, store, "takeover-b");
    a.reset();  // the old group is gone; its buffers live on where held
    for (size_t k = 0; k < sizes.size(); ++k) {
      std::shared_ptr<void> mem = b->allocate(sizes[k] * sizeof(float));
      if (!mem) throw std::runtime_error("allocate refused in the new group");
      auto* f = static_cast<float*>(mem.get());
      if (f[0] != markOf(r, k) || f[sizes[k] - 1] != markOf(r, k)) {
        fail = "buffer " + std::to_string(k) + " was not taken over: holds " + std::to_string(f[0]);
        return;
      }
      if (r != newcomer && mem.get() != old[k].get()) fail = "a survivor's pages moved";
      for (size_t i = 0; i < sizes[k]; ++i) f[i] = static_cast<float>((r + 1) * (i % 100));
      b->allReduce(f, sizes[k], ShmDType::kFloat32);
      for (size_t i = 0; i < sizes[k]; ++i) {
        if (f[i] != static_cast<float>(6 * (i % 100))) {
          fail = "buffer " + std::to_string(k) + " element " + std::to_string(i);
          return;
        }
      }
    }
  });
  CHECK(ourSegments().empty());
}

TEST_CASE(
    "a new group allocates fresh buffers when the old group was not aborted, or sizes or "
    "the group differ",
    "[worker][shm]") {
  enum class Change { kNotAborted, kOtherSize, kSmallerGroup };
  for (Change change : {Change::kNotAborted, Change::kOtherSize, Change::kSmallerGroup}) {
    const int world = 3;
    const int next_world = change == Change::kSmallerGroup ? 2 : 3;
    const std::string tag = std::to_string(static_cast<int>(change));
    auto store = KeyValueStore::inMemory(std::chrono::seconds(30));
    onRanks(world, [&](int r, std::string& fail) {
      auto a = group(r, world, store, "fresh-a" + tag);
      std::shared_ptr<void> old = a->allocate(4000 * sizeof(float));
      if (!old) throw std::runtime_error("allocate refused");
      std::fill_n(static_cast<float*>(old.get()), 4000, markOf(r, 0));
      if (change != Change::kNotAborted) a->abort();
      if (r >= next_world) return;
      auto b = group(r, next_world, store, "fresh-b" + tag);
      const size_t n = change == Change::kOtherSize ? 4100 : 4000;
      std::shared_ptr<void> mem = b->allocate(n * sizeof(float));
      if (!mem) throw std::runtime_error("allocate refused in the new group");
      auto* f = static_cast<float*>(mem.get());
      if (mem.get() == old.get() || f[0] != 0.0f || f[n - 1] != 0.0f) {
        fail = "the old buffer was taken over";
      }
      if (change == Change::kNotAborted && static_cast<float*>(old.get())[0] != markOf(r, 0)) {
        fail = "the live group's buffer changed";
      }
    });
  }
}

TEST_CASE(
    "offers that name anything but this group's segment are refused: a regular file, an even "
    "magic, a process outside the group",
    "[worker][shm]") {
  // Rank 1 is played by hand after setup: as a hostile peer (or whoever writes the store) could, it
  // offers a file of the right size that starts with the magic it names. Rank 0 must not map it
  // (it would write gradients into it), and allocates a new segment instead.
  auto store = KeyValueStore::inMemory(std::chrono::seconds(30));
  std::unique_ptr<ShmAllReduce> peer;
  std::thread setup([&] { peer = group(1, 2, store, "hostile"); });
  auto shm = group(0, 2, store, "hostile");
  setup.join();
  const size_t bytes = 4096 * sizeof(float);
  const size_t total = 4096 + 2 * bytes;  // a page, then a region per rank
  int allocation = 0;
  // Offers `fd` (of `pid`) with `magic` as rank 1; true when rank 0 left the file alone.
  auto offer = [&](int fd, long pid, uint64_t magic) {
    std::vector<char> content(total, 'x');
    std::memcpy(content.data(), &magic, sizeof(magic));
    REQUIRE(pwrite(fd, content.data(), total, 0) == static_cast<ssize_t>(total));
    const std::string key = "hostile/shm/buffer" + std::to_string(++allocation) + "/";
    auto put = [&](const std::string& k, const std::string& v) {
      store->set(key + k, std::vector<char>(v.begin(), v.end()));
    };
    put("offer/1", std::to_string(pid) + " " + std::to_string(fd) + " " + std::to_string(magic));
    put("taken/1", "1");
    put("ok/1", "1");
    std::shared_ptr<void> mem = shm->allocate(bytes);
    REQUIRE(mem != nullptr);
    auto* f = static_cast<float*>(mem.get());
    CHECK(f[0] == 0.0f);  // a new segment
    std::fill_n(f, 4096, 1.0f);
    std::vector<char> after(total);
    REQUIRE(pread(fd, after.data(), total, 0) == static_cast<ssize_t>(total));
    return after == content;
  };

  SECTION("a regular file") {
    const std::string path = "/tmp/ddprun_shm_hostile_" + std::to_string(getpid());
    const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
    REQUIRE(fd >= 0);
    CHECK(offer(fd, getpid(), 0x1234567));
    close(fd);
    std::remove(path.c_str());
    const std::vector<char> taken = store->get("hostile/shm/buffer1/taken/0");
    const std::string why(taken.begin(), taken.end());
    INFO(why);
    CHECK(why.find("is not an unlinked shared-memory segment") != std::string::npos);
  }

  // An unlinked tmpfs file of the right size passes every check on the file itself.
  const int memfd = static_cast<int>(syscall(SYS_memfd_create, "hostile", 0u));
  REQUIRE(memfd >= 0);
  SECTION("an even magic (real ones are odd), here the zeros of a fresh file") {
    CHECK(offer(memfd, getpid(), 0));
  }
  SECTION("a process outside the group, though it holds such a file") {
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      pause();  // holds the memfd (inherited) until killed
      _exit(0);
    }
    CHECK(offer(memfd, child, 0x1234567));
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
  }
  close(memfd);
}
