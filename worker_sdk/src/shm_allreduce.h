// ShmAllReduce: all-reduce (sum, optionally scaled) and broadcast between the ranks that share one
// host, over POSIX shared memory instead of TCP loopback. The Gloo communicator builds one group
// per host when every host holds the same number of ranks (see topology.h): with one host it does
// the whole all-reduce; with several, a PieceHook sums each rank's reduced piece across the hosts
// (one Gloo ring per local index) before the host's peers copy it. Otherwise Gloo's TCP ring does
// the work.
//
// Each rank reduces one piece of the tensor (whole cache lines; the last ranks' pieces may be
// short or empty): the sum of its own and its peers' copies of that piece, in rank order.
//
// Two paths:
// - Staged (any tensor): per chunk of at most slot_bytes, every rank publishes in its slot the
//   pieces its peers reduce; barrier; rank r sums piece r of all ranks in place in its own tensor
//   (then the hook, then the scaling) and publishes the result; barrier; every rank copies the
//   other reduced pieces out. Two sets of slots alternate, so the next chunk's copy-in may start
//   while slower ranks still read.
// - In place (tensors inside a buffer from allocate(), e.g. DDP's gradient buckets): peers read
//   each other's buffers directly, so nothing is staged: barrier; reduce own piece in place;
//   barrier; copy the other pieces from their owners; barrier.
// Broadcast (the in-place recovery's state sync) is staged: per chunk of one set of slots (every
// rank's slot of it), the root copies in; barrier; the others copy out; a last barrier at the end.
// A buffer's segment is reserved in parallel: each rank its own region, rank 0 also the header.
// Every op first publishes a descriptor (element count, dtype, path), checked after its first
// barrier; ranks that disagree all get a CommError naming both sides instead of a silent mismatch.
// Barriers are an arrival counter in the control segment: spin briefly, then sleep on a (shared)
// futex. A wait that exceeds the op timeout, or sees a peer process gone, throws CommError naming
// the rank. Segments are unlinked as soon as every rank mapped them: a crash leaves nothing in
// /dev/shm. A buffer's segment stays open, so that an in-place recovery's new group can take it
// over instead of allocating and faulting in new memory (see allocate()).
//
// Thread-compatibility: one thread at a time per rank (the communicator's op thread), for
// allReduce() and allocate() alike.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ddprun/worker/store.h"

namespace ddprun::worker {

// 16-bit floats (compressed gradients) are summed in float and rounded after each addition; a
// scale is applied after the sum (a second rounding).
enum class ShmDType { kFloat32, kFloat64, kInt32, kInt64, kBFloat16, kHalf };

size_t shmDTypeSize(ShmDType t);
const char* shmDTypeName(ShmDType t);

struct ShmOptions {
  std::string prefix;  // store key namespace (shared by all ranks of the group)
  std::chrono::milliseconds setup_timeout{std::chrono::seconds(60)};
  std::chrono::milliseconds op_timeout{std::chrono::minutes(10)};
  // Per-rank slot size; 0 = min(4 MiB, 16 MiB / size), so the segment stays <= 32 MiB + header.
  size_t slot_bytes = 0;
  bool enabled = true;  // false on any rank (or DDPRUN_SHM=0 in its environment) = nobody uses it
  // Who counts as "this host": empty = localHostIdentity(). Tests set it to simulate several
  // hosts with thread ranks.
  std::string host_identity;
};

// This kernel's boot id, pid namespace and network namespace: ranks that share them can share
// memory and check each other's pids. (A random cookie in each segment then proves they also
// share /dev/shm.) Ranks in different network namespaces count as different hosts: their traffic
// takes the network, as between containers or in deploy/netrig.sh's two-host rig.
std::string localHostIdentity();
bool shmDisabledByEnvironment();  // DDPRUN_SHM=0|false|off|no

class ShmAllReduce {
 public:
  struct Header;   // the control segment's first page (defined in the .cc)
  struct Segment;  // one mapped segment (defined in the .cc)

  // Collective over the store: every rank of the group must call it. Returns nullptr on every
  // rank when any rank is elsewhere, disabled, or cannot map the segment (each rank logs why at
  // debug level); throws CommError only when the store itself fails.
  static std::unique_ptr<ShmAllReduce> tryCreate(int rank, int size,
                                                 std::shared_ptr<KeyValueStore> store,
                                                 const ShmOptions& options);
  ~ShmAllReduce();
  ShmAllReduce(const ShmAllReduce&) = delete;
  ShmAllReduce& operator=(const ShmAllReduce&) = delete;

  // Runs on this rank's piece once the local ranks' contributions are summed into it, before the
  // peers copy it: the hierarchical (multi-host) all-reduce sums it across hosts here. Every rank
  // with the same local index sees the same sequence of piece sizes (empty pieces are skipped).
  using PieceHook = std::function<void(void* piece, size_t count)>;

  // In place: the sum of `count` elements at `data` over all ranks, times `scale` (1/size for an
  // average; floating dtypes only, integers always get the plain sum). Collective, same order on
  // all ranks; every rank ends with bit-identical values. With `hook`, `scale` is applied after it.
  void allReduce(void* data, size_t count, ShmDType dtype, double scale = 1.0,
                 const PieceHook& hook = nullptr);

  // `bytes` at `data` on `root` copied to `data` on every other rank, through the slots (no
  // allocate()d buffer needed). Collective, same order on all ranks as the all-reduces; ranks that
  // disagree on the size or the root all get a CommError. A rank that already holds root's bytes
  // passes `receive` false: it takes part but copies nothing.
  void broadcast(void* data, size_t bytes, int root, bool receive = true);

  // Collective (same sizes in the same order on every rank): `bytes` of memory that peers can read
  // in place, so all-reduces of ranges inside it skip the staging copy. Returns nullptr on every
  // rank when /dev/shm cannot hold size() such buffers. The memory stays valid while the returned
  // pointer (or a copy) lives. It is zeroed, except when it is taken over: after an in-place
  // recovery, the n-th allocation of the new group reuses the n-th buffer of the aborted one when
  // it has the same size, every rank that still holds it kept its place, and it is still held
  // (survivors keep their pages; a replacement maps the segment through a survivor's descriptor,
  // /proc/<pid>/fd, of a pid in this group): then it holds what the old group left there. Each
  // buffer keeps one descriptor open while it is held.
  std::shared_ptr<void> allocate(size_t bytes);

  int rank() const { return rank_; }
  int size() const { return size_; }
  size_t slotBytes() const { return slot_bytes_; }

  // From any thread: the barrier this rank waits in (now or later) throws CommError at once.
  // Idempotent; touches no data. The group is unusable afterwards.
  void abort();

 private:
  struct Buffer {
    uint64_t id;
    char* own;      // this rank's region
    size_t bytes;   // requested size
    size_t stride;  // distance between ranks' regions
    char* rank0;    // rank 0's region in this rank's mapping
    std::weak_ptr<Segment> segment;
  };

  ShmAllReduce(int rank, int size, std::shared_ptr<Segment> control, size_t slot_bytes,
               std::shared_ptr<KeyValueStore> store, const ShmOptions& options);
  char* slot(int set, int rank) const;
  const Buffer* findBuffer(const char* data, size_t bytes);
  // `root` >= 0: a broadcast of `count` bytes from that rank (no dtype, no buffer).
  void publishDescriptor(size_t count, ShmDType dtype, const Buffer* buffer, size_t offset,
                         int root = -1);
  void verifyDescriptors() const;
  void barrier(const char* phase);
  void checkPeers(const char* phase) const;
  void allReduceStaged(char* data, size_t count, ShmDType dtype, double scale,
                       const PieceHook& hook);
  void allReduceInPlace(const Buffer& buffer, char* data, size_t count, ShmDType dtype,
                        double scale, const PieceHook& hook);
  // In-place recovery: the segment (`total` bytes) of buffer `id` of this process's aborted group,
  // when every rank that holds one (the survivors, each at its old place) holds the same; the
  // others (the newcomers) map it through the lowest holder's descriptor. nullptr on every rank
  // otherwise. Collective.
  std::shared_ptr<Segment> takeOver(uint64_t id, size_t bytes, size_t stride, size_t total,
                                    const std::string& key);
  // Sums the peers' copies of [b, e) into `own` (in rank order); the last pass scales and, when
  // `publish` is set, also stores the result there. With a hook: plain sums, then the hook, then
  // the scaling and the publishing.
  void reduceOwnPiece(char* own, const std::function<const char*(int)>& peer_piece, char* publish,
                      size_t n, ShmDType dtype, double scale, const PieceHook& hook);

  int rank_;
  int size_;
  std::shared_ptr<Segment> control_;
  Header* header_;
  size_t slot_bytes_;
  std::shared_ptr<KeyValueStore> store_;
  ShmOptions options_;
  std::vector<Buffer> buffers_;
  uint64_t allocations_ = 0;
  uint32_t barriers_ = 0;  // barriers this rank completed; identical on every rank
  // Shared with the buffers' entries for a later group (see takeOver()).
  std::shared_ptr<std::atomic<bool>> aborted_ = std::make_shared<std::atomic<bool>>(false);
  uint64_t chunks_ = 0;  // staged chunks done; picks the slot set
};

}  // namespace ddprun::worker
