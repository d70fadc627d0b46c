#include "ddprun/common/block_cache.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>

namespace ddprun {

namespace {

#ifndef MADV_POPULATE_WRITE
constexpr int MADV_POPULATE_WRITE = 23;  // Linux 5.14; older headers lack it
#endif

size_t pageBytes() {
  const long page = ::sysconf(_SC_PAGESIZE);
  return page > 0 ? static_cast<size_t>(page) : 4096;
}

size_t wholePages(size_t bytes) {
  const size_t p = pageBytes();
  return (bytes == 0 ? p : (bytes + p - 1) / p * p);
}

}  // namespace

bool populatePages(void* p, size_t n) {
  const uintptr_t page = pageBytes();
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + n) / page * page;
  if (end <= begin) return true;
  return ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE) == 0;
}

BlockCache::BlockCache(size_t block_bytes, size_t keep)
    : bytes_(wholePages(block_bytes)), keep_(keep) {}

BlockCache::~BlockCache() {
  for (char* b : free_) ::munmap(b, bytes_);
}

char* BlockCache::take() {
  {
    MutexLock lock(mu_);
    if (!free_.empty()) {
      char* b = free_.back();
      free_.pop_back();
      return b;
    }
  }
  void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  // Both are advice: without them (an older kernel) the block still works, page by page.
  (void)::madvise(p, bytes_, MADV_DONTFORK);
  (void)populatePages(p, bytes_);
  return static_cast<char*>(p);
}

void BlockCache::give(char* block) {
  if (block == nullptr) return;
  {
    MutexLock lock(mu_);
    if (free_.size() < keep_) {
      free_.push_back(block);
      return;
    }
  }
  ::munmap(block, bytes_);
}

size_t BlockCache::cached() const {
  MutexLock lock(mu_);
  return free_.size();
}

BlockCache& BlockCache::transfers() {
  static BlockCache* cache = new BlockCache(4 << 20, 8);  // used until the process exits
  return *cache;
}

}  // namespace ddprun
