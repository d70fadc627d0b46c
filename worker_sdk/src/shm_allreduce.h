// ShmAllReduce: all-reduce (sum) between ranks that share one host, over a POSIX shared-memory
// segment instead of TCP loopback. Used by the Gloo communicator when *every* rank of the group
// turned out to be on this host (single-node jobs); otherwise Gloo's TCP ring does the work.
//
// Algorithm, per chunk of at most slot_bytes: every rank copies its chunk into its own slot;
// barrier; rank r sums piece r of all slots into its slot (reduce-scatter); barrier; every rank
// copies the W reduced pieces out (all-gather). Two sets of slots alternate, so a chunk needs two
// barriers and the next chunk's copy-in may start while slower ranks still read the previous one.
// Barriers are an arrival counter in the segment: spin briefly, then sleep on a (shared) futex.
//
// Failure: a wait that exceeds the op timeout, or sees a peer process gone, throws CommError
// naming the rank; the segment is unlinked as soon as every rank attached, so a crash never
// leaves it behind in /dev/shm.
//
// Thread-compatibility: one thread at a time per rank (the communicator's op thread).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "ddprun/worker/store.h"

namespace ddprun::worker {

enum class ShmDType { kFloat32, kFloat64, kInt32, kInt64 };

size_t shmDTypeSize(ShmDType t);

struct ShmOptions {
  std::string prefix;  // store key namespace (shared by all ranks of the group)
  std::chrono::milliseconds setup_timeout{std::chrono::seconds(60)};
  std::chrono::milliseconds op_timeout{std::chrono::minutes(10)};
  // Per-rank slot size; 0 = min(4 MiB, 16 MiB / size), so the segment stays <= 32 MiB + header.
  size_t slot_bytes = 0;
  bool enabled = true;  // false on any rank (or DDPRUN_SHM=0 in its environment) = nobody uses it
};

class ShmAllReduce {
 public:
  // Collective over the store: every rank of the group must call it. Returns nullptr on every
  // rank when any rank is elsewhere, disabled, or cannot map the segment (each rank logs why at
  // debug level); throws CommError only when the store itself fails.
  static std::unique_ptr<ShmAllReduce> tryCreate(int rank, int size, KeyValueStore& store,
                                                 const ShmOptions& options);
  ~ShmAllReduce();
  ShmAllReduce(const ShmAllReduce&) = delete;
  ShmAllReduce& operator=(const ShmAllReduce&) = delete;

  // In place: the sum of `count` elements at `data` over all ranks, times `scale` (1/size for an
  // average; floating dtypes only, integers always get the plain sum). Collective, same order on
  // all ranks; every rank ends with bit-identical values.
  void allReduce(void* data, size_t count, ShmDType dtype, double scale = 1.0);

  int rank() const { return rank_; }
  int size() const { return size_; }
  size_t slotBytes() const { return slot_bytes_; }

  struct Header;  // layout of the segment's first page (defined in the .cc)

 private:
  ShmAllReduce(int rank, int size, void* base, size_t mapped, size_t slot_bytes,
               std::chrono::milliseconds op_timeout);
  char* slot(int set, int rank) const;
  void barrier(const char* phase);
  void checkPeers(const char* phase) const;

  int rank_;
  int size_;
  void* base_;
  size_t mapped_;
  size_t slot_bytes_;
  std::chrono::milliseconds op_timeout_;
  Header* header_;
  uint32_t barriers_ = 0;  // barriers this rank completed; identical on every rank
  uint64_t chunks_ = 0;    // chunks done; picks the slot set
};

}  // namespace ddprun::worker
