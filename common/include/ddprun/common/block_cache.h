// Page-aligned blocks of memory for bulk transfers (snapshot replication), kept for reuse.
//
// Why not malloc: every page of fresh memory costs a page fault on first touch. On the VMs this
// project is measured on a fault costs 13-16 us (100 MB touched page by page: 0.33-0.41 s; the
// same populated at once, 0.02-0.04 s), and a 100 MB fetch took ~14k of them, about half its time.
// A block here is mapped and populated at once (MADV_POPULATE_WRITE, Linux 5.14+; elsewhere it
// faults in as usual) and goes back to the cache when given back, so the next transfer finds its
// pages present. Blocks are also left out of forked children (MADV_DONTFORK): the agent forks a
// worker guardian that lives as long as the worker and never execs; memory it shares
// copy-on-write would cost the agent a copy-fault on every page it writes again, and pin the old
// copies in the guardian. No child may touch a block.
//
// Threading: thread-safe; a block may be given back on any thread.
#pragma once

#include <cstddef>
#include <mutex>
#include <vector>

#include "ddprun/common/thread_annotations.h"

namespace ddprun {

class BlockCache {
 public:
  // Blocks of `block_bytes` (rounded up to whole pages); at most `keep` free ones are kept, the
  // rest are unmapped when given back.
  BlockCache(size_t block_bytes, size_t keep);
  ~BlockCache();
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;

  // A block, present in memory; nullptr when none can be mapped (out of memory).
  char* take();
  // Gives back a block take() returned.
  void give(char* block);

  size_t blockBytes() const { return bytes_; }
  // Free blocks held now.
  size_t cached() const;

  // The process's cache of 4 MiB blocks (snapshot chunks, O_DIRECT write buffers, hashing
  // buffers), keeping up to 8 free (32 MiB). Never destroyed.
  static BlockCache& transfers();

 private:
  size_t bytes_;
  size_t keep_;
  mutable Mutex mu_;
  std::vector<char*> free_ GUARDED_BY(mu_);
};

// Faults in the whole pages inside [p, p + n) for writing, at once (MADV_POPULATE_WRITE), leaving
// their content as it is. False where the kernel cannot (before Linux 5.14); nothing is done then.
bool populatePages(void* p, size_t n);

// A block of a BlockCache, given back when it goes out of scope.
class CachedBlock {
 public:
  explicit CachedBlock(BlockCache& cache) : cache_(&cache), data_(cache.take()) {}
  ~CachedBlock() {
    if (data_ != nullptr) cache_->give(data_);
  }
  CachedBlock(const CachedBlock&) = delete;
  CachedBlock& operator=(const CachedBlock&) = delete;
  CachedBlock(CachedBlock&& other) noexcept : cache_(other.cache_), data_(other.data_) {
    other.data_ = nullptr;
  }

  char* get() const { return data_; }
  size_t size() const { return cache_->blockBytes(); }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  BlockCache* cache_;
  char* data_;
};

}  // namespace ddprun
