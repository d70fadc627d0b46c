// Run by snapshot_transfer_tests as a fresh process: the page faults that a thread other than main
// takes for 16 MiB of 64 KiB allocations, written to once (what gRPC's threads allocate for a
// fetch's receive window), after tuneAllocatorForTransfers() and warmHeapForFetches() or, with
// --untuned, without them.
// Prints "faults N", or "skip: WHY" where the count says nothing.
#include <sys/mman.h>
#include <sys/resource.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "ddprun/common/block_cache.h"
#include "ddprun/snapshot/transfer.h"
#include "sanitizer.h"

int main(int argc, char** argv) {
  if (ddprun::testing::kAddressSanitizer) {
    std::puts("skip: a sanitizer's allocator");
    return 0;
  }
  const bool tuned = !(argc > 1 && std::string(argv[1]) == "--untuned");
  {
    const size_t n = 1 << 16;
    void* scratch = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (scratch == MAP_FAILED || !ddprun::populatePages(scratch, n)) {
      std::puts("skip: this kernel cannot populate (MADV_POPULATE_WRITE)");
      return 0;
    }
    ::munmap(scratch, n);
  }
  if (tuned) {
    ddprun::snapshot::tuneAllocatorForTransfers();
    ddprun::snapshot::warmHeapForFetches();
  }
  long faults = -1;
  std::thread([&faults] {
    std::vector<char*> slices;
    struct rusage before {};
    ::getrusage(RUSAGE_THREAD, &before);
    for (int i = 0; i < 256; ++i) {
      char* s = static_cast<char*>(std::malloc(64 << 10));
      if (s == nullptr) return;
      std::memset(s, i, 64 << 10);
      slices.push_back(s);
    }
    struct rusage after {};
    ::getrusage(RUSAGE_THREAD, &after);
    faults = after.ru_minflt - before.ru_minflt;
    for (char* s : slices) std::free(s);
  }).join();
  std::printf("faults %ld\n", faults);
  return faults < 0 ? 1 : 0;
}
