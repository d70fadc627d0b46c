// shm_peer: one rank of a shared-memory all-reduce group in its own process, for
// shm_allreduce_test. Usage: shm_peer STORE_PORT RANK SIZE MODE
//   MODE attach-exit: attach to the segment, then exit 0 without taking part in any collective.
//   MODE sum N:       all-reduce N int64 elements holding RANK+1 and check every element.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "ddprun/worker/store.h"
#include "shm_allreduce.h"

int main(int argc, char** argv) {
  using namespace ddprun::worker;
  if (argc < 5) {
    std::fprintf(stderr, "usage: shm_peer STORE_PORT RANK SIZE attach-exit|sum N\n");
    return 2;
  }
  const int port = std::atoi(argv[1]);
  const int rank = std::atoi(argv[2]);
  const int size = std::atoi(argv[3]);
  const std::string mode = argv[4];
  try {
    auto store = KeyValueStore::tcpClient("127.0.0.1", port, std::chrono::seconds(30));
    ShmOptions options;
    options.prefix = "peer";
    options.slot_bytes = 4096;
    auto shm = ShmAllReduce::tryCreate(rank, size, store, options);
    if (!shm) {
      std::fprintf(stderr, "shm_peer: no shared-memory group\n");
      return 3;
    }
    if (mode == "attach-exit") return 0;
    const size_t n = argc > 5 ? std::strtoul(argv[5], nullptr, 10) : 1000;
    std::vector<int64_t> v(n, rank + 1);
    shm->allReduce(v.data(), n, ShmDType::kInt64);
    const int64_t want = static_cast<int64_t>(size) * (size + 1) / 2;
    for (size_t i = 0; i < n; ++i) {
      if (v[i] != want) {
        std::fprintf(stderr, "shm_peer: element %zu is %lld, want %lld\n", i,
                     static_cast<long long>(v[i]), static_cast<long long>(want));
        return 4;
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shm_peer: %s\n", e.what());
    return 1;
  }
}
