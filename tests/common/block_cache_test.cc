// BlockCache: blocks are reused, the cache keeps no more than asked, a block is present in memory
// when taken (where the kernel can populate), and forked children do not inherit it.
#include "ddprun/common/block_cache.h"

#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <set>
#include <thread>
#include <vector>

using ddprun::BlockCache;
using ddprun::CachedBlock;

namespace {

size_t pageSize() { return static_cast<size_t>(::sysconf(_SC_PAGESIZE)); }

// Pages of [p, p + n) that are resident, per mincore.
size_t residentPages(const char* p, size_t n) {
  std::vector<unsigned char> vec((n + pageSize() - 1) / pageSize());
  if (::mincore(const_cast<char*>(p), n, vec.data()) != 0) return 0;
  size_t resident = 0;
  for (unsigned char v : vec) resident += v & 1;
  return resident;
}

}  // namespace

TEST_CASE("block cache: blocks are whole pages, page-aligned, and reused once given back",
          "[block_cache]") {
  BlockCache cache(10000, 2);
  CHECK(cache.blockBytes() % pageSize() == 0);
  CHECK(cache.blockBytes() >= 10000);
  char* a = cache.take();
  REQUIRE(a != nullptr);
  CHECK(reinterpret_cast<uintptr_t>(a) % pageSize() == 0);
  std::memset(a, 0x5a, cache.blockBytes());  // all of it is ours
  char* b = cache.take();
  REQUIRE(b != nullptr);
  CHECK(b != a);
  cache.give(a);
  CHECK(cache.cached() == 1);
  CHECK(cache.take() == a);  // the block given back, not a fresh one
  CHECK(cache.cached() == 0);
  cache.give(a);
  cache.give(b);
  cache.give(nullptr);  // nothing
  CHECK(cache.cached() == 2);
}

TEST_CASE("block cache: keeps at most `keep` free blocks and unmaps the others", "[block_cache]") {
  BlockCache cache(1 << 16, 2);
  std::vector<char*> blocks;
  for (int i = 0; i < 5; ++i) blocks.push_back(cache.take());
  for (char* b : blocks) REQUIRE(b != nullptr);
  for (char* b : blocks) cache.give(b);
  CHECK(cache.cached() == 2);
  // The last three given back were unmapped (mincore: ENOMEM for an unmapped range).
  unsigned char v = 0;
  CHECK(::mincore(blocks[4], pageSize(), &v) == -1);
  CHECK(errno == ENOMEM);
  CHECK(::mincore(blocks[0], pageSize(), &v) == 0);
}

TEST_CASE("block cache: a taken block is present in memory where the kernel populates",
          "[block_cache]") {
  // MADV_POPULATE_WRITE (Linux 5.14): probe it on a scratch mapping first.
  const size_t n = 16 * pageSize();
  void* probe = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(probe != MAP_FAILED);
  const bool populates = ::madvise(probe, n, 23 /* MADV_POPULATE_WRITE */) == 0;
  ::munmap(probe, n);
  if (!populates) {
    WARN("this kernel cannot populate (MADV_POPULATE_WRITE): residency not checked");
    return;
  }
  BlockCache cache(1 << 20, 1);
  char* b = cache.take();
  REQUIRE(b != nullptr);
  CHECK(residentPages(b, cache.blockBytes()) == cache.blockBytes() / pageSize());
  cache.give(b);
}

TEST_CASE("block cache: a forked child does not inherit the blocks", "[block_cache]") {
  BlockCache cache(1 << 16, 1);
  CachedBlock block(cache);
  REQUIRE(block);
  std::memset(block.get(), 1, block.size());
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    unsigned char v = 0;
    const bool unmapped = ::mincore(block.get(), 4096, &v) == -1 && errno == ENOMEM;
    ::_exit(unmapped ? 0 : 1);
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(block.get()[0] == 1);  // the parent's is untouched
}

TEST_CASE("block cache: CachedBlock gives its block back, from many threads at once",
          "[block_cache]") {
  BlockCache cache(1 << 16, 4);
  {
    CachedBlock a(cache);
    CachedBlock moved(std::move(a));
    CHECK_FALSE(a);
    REQUIRE(moved);
    CHECK(moved.size() == cache.blockBytes());
  }
  CHECK(cache.cached() == 1);

  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&cache, &failures, t] {
      for (int i = 0; i < 200; ++i) {
        CachedBlock x(cache);
        CachedBlock y(cache);
        if (!x || !y || x.get() == y.get()) ++failures;
        if (x) x.get()[i] = static_cast<char>(t);
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(failures.load() == 0);
  CHECK(cache.cached() <= 4);
}

TEST_CASE("block cache: the transfer cache has 4 MiB blocks", "[block_cache]") {
  CHECK(BlockCache::transfers().blockBytes() == (4u << 20));
  CHECK(&BlockCache::transfers() == &BlockCache::transfers());
}
