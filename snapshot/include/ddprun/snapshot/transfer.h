// The transport of snapshot replication: the agents' file transfers over gRPC (proto
// ddprun.snapshot.v1). A server that answers announcements and serves the versions its agent
// holds as checksummed chunks, and the two blocking client calls (announce, fetch into a temp
// file). The replicator (replicator.h) decides what to fetch when; nothing here knows about
// rounds. A plain header: gRPC stays in snapshot/src (server.cc, transfer.cc, wire.h), so the
// agent includes no gRPC header. It authenticates with the rendezvous' token and TLS material.
//
// Threading: the server calls `lookup` and `on_announce` on gRPC threads (they must be
// thread-safe; the replicator's read a mutex-guarded table or post to its loop). The client calls
// block the calling thread (the replicator runs them on its transfer pool, never on its loop).
// Lifetime: destroying the server waits for the calls in flight to finish.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "ddprun/common/clock.h"
#include "ddprun/common/status.h"
#include "ddprun/common/thread_annotations.h"

namespace ddprun::snapshot {

// One complete version of one file of a snapshot directory.
struct SnapshotFile {
  std::string name;      // path relative to the snapshot directory
  uint64_t version = 0;  // (round << 32) | sequence; 0: present before the job, version unknown
  uint64_t size = 0;
  uint32_t crc32 = 0;  // zlib's CRC-32 of the whole content, unless crc32_pending
  // Announced while the writer still hashed it: a fetch learns the CRC-32 from the source's last
  // chunk(s) instead.
  bool crc32_pending = false;
  // This version deletes the file (a tombstone: size and crc32 are 0; never served or fetched).
  bool deleted = false;
  // A hint, not part of the version: its writer renamed `moved_from` at `moved_from_version` to
  // this name (empty: not a rename). See the proto's FileVersion.
  std::string moved_from{};
  uint64_t moved_from_version = 0;
  std::string moved_to{};  // on a deletion: renamed to that name
  bool operator==(const SnapshotFile& o) const {
    return name == o.name && version == o.version && size == o.size && crc32 == o.crc32 &&
           crc32_pending == o.crc32_pending && deleted == o.deleted;
  }
};

// The CRC-32 of a version served before its hash was known. Set once, by the thread that hashes
// the file; a Fetch stream that reaches its last chunk first waits for it (without holding a
// gRPC thread). Thread-safe.
class PendingCrc {
 public:
  // The first call wins; the waiters run on the calling thread.
  void set(StatusOr<uint32_t> crc);
  // Runs `then` with the value: at once when known, else on the thread that calls set().
  void whenKnown(std::function<void(const StatusOr<uint32_t>&)> then);

 private:
  Mutex mu_;
  std::optional<StatusOr<uint32_t>> value_ GUARDED_BY(mu_);
  std::vector<std::function<void(const StatusOr<uint32_t>&)>> waiters_ GUARDED_BY(mu_);
};

// An open, read-only file descriptor, closed when the last holder lets go: a version is served
// from the inode it was announced with, even after a newer version was renamed over its name.
class OpenFile {
 public:
  explicit OpenFile(int fd) : fd_(fd) {}
  ~OpenFile();
  OpenFile(const OpenFile&) = delete;
  OpenFile& operator=(const OpenFile&) = delete;
  int fd() const { return fd_; }

 private:
  int fd_;
};

// A version this node is still fetching, served on to other nodes while it arrives (a pipelined
// relay: a node down the announcement tree need not wait for the whole copy here before its own
// starts). The fetch (fetchSnapshot) reports which bytes are in the temp file, written and
// checked against their chunk's CRC-32; a Fetch stream serving it reads only those, and waits
// (without holding a gRPC thread) for the rest. Its end: every range reached, or fail(). The
// whole content's CRC-32 comes as for any version announced before its hash (PendingCrc) or was
// known beforehand; a downstream copy is checked against it as always.
// Thread-safe; the waiters run on the thread that reports progress (or fails it).
class ArrivingFile {
 public:
  // fetchSnapshot's side: the temp file open for reading, then its ranges, then progress.
  void setData(std::shared_ptr<const OpenFile> data);
  void addRange(uint64_t begin, uint64_t end);
  // The range that starts at `begin` holds its bytes up to `reached`.
  void advance(uint64_t begin, uint64_t reached);
  // The fetch failed or was cancelled: every waiter, now and later, gets `why`. The first call
  // wins.
  void fail(const Status& why);

  // The server's side: runs `then` once bytes [offset, offset + n) are in the file (OK; at once
  // when they are), or with the failure. Their descriptor: data().
  void whenAvailable(uint64_t offset, uint64_t n, std::function<void(const Status&)> then);
  std::shared_ptr<const OpenFile> data() const;

 private:
  struct Range {
    uint64_t end = 0;
    uint64_t reached = 0;
  };
  struct Waiter {
    uint64_t offset;
    uint64_t end;
    std::function<void(const Status&)> then;
  };
  bool availableLocked(uint64_t offset, uint64_t end) const REQUIRES(mu_);
  // Removes the waiters that can run now from waiters_, in the order they came (all once failed_).
  std::vector<Waiter> takeReadyLocked() REQUIRES(mu_);

  mutable Mutex mu_;
  std::shared_ptr<const OpenFile> data_ GUARDED_BY(mu_);
  std::map<uint64_t, Range> ranges_ GUARDED_BY(mu_);  // by first byte
  std::optional<Status> failed_ GUARDED_BY(mu_);
  std::vector<Waiter> waiters_ GUARDED_BY(mu_);
};

struct ServedFile {
  SnapshotFile file;
  std::shared_ptr<const OpenFile> data;  // unset for an arriving file: arriving->data()
  // With file.crc32_pending: where the CRC-32 arrives (must then be set, error or not).
  std::shared_ptr<PendingCrc> pending_crc;
  // Set for a version still being fetched here (served as it arrives).
  std::shared_ptr<ArrivingFile> arriving = nullptr;
};

// Token and TLS material, as the rendezvous uses them (--rdzv-conf token_file, tls_*).
struct TransferSecurity {
  std::string token;         // empty: none required or sent
  std::string tls_cert_pem;  // server: with tls_key_pem, serve TLS
  std::string tls_key_pem;
  std::string tls_ca_pem;  // client: speak TLS trusting this certificate
};

// Test hook (DDPRUN_SNAPSHOT_FAULT in the agent): damage the first `count` transfers this server
// makes, either after the chunk's checksum (corrupted in flight) or before it (a file that does
// not match its announced CRC-32, as a bad disk at the source would give); or (kSlow) pause
// `count` milliseconds before every chunk, so a test can kill a writer mid-transfer. kSlowHash is
// the agent's, not the server's: it pauses `count` milliseconds before hashing each file written
// on its node, so a test can end a round while files are still to be hashed. kLateHoldings is the
// agent's too: it publishes each round's holdings `count` milliseconds late, as an agent stalled
// at the round's start would.
struct ServeFault {
  enum class Kind {
    kNone,
    kInFlight,
    kAtSource,
    kSlow,
    kSlowHash,
    kLateHoldings
  } kind = Kind::kNone;
  int count = 0;
};

// What a server makes of the requests it is sent, without gRPC (snapshot/src/
// requests.cc; the fuzz target fuzz_snapshot_requests drives them with any input).

// The smallest chunk a Fetch may ask for (FetchRequest.chunk_bytes), and the smallest a server
// cuts when many streams share its chunk budget.
inline constexpr size_t kMinFetchChunk = 64 << 10;

// What a Fetch of `name` (a version of `size` bytes) asks for: bytes [begin, end) in chunks of
// `chunk` bytes (chunk_bytes 0: `server_chunk`; others are kept between 64 KiB and it).
// OUT_OF_RANGE, naming the bytes and the name (escaped), past the end.
struct FetchPlan {
  uint64_t begin = 0;
  uint64_t end = 0;
  size_t chunk = 0;
};
StatusOr<FetchPlan> planFetch(const std::string& name, uint64_t size, uint64_t offset,
                              uint64_t length, uint32_t chunk_bytes, size_t server_chunk);

// An announced FileVersion as a receiver takes it: a pending CRC-32 is 0; a deletion has no size,
// CRC-32 or rename-from; a rename hint only on a version with a known CRC-32.
SnapshotFile normalizeAnnounced(SnapshotFile f);

// How many Fetch streams a server serves at once, to each peer address and in all (the
// server's bounds against peers that open streams and never read). Pure; not thread-safe (the
// server guards it).
class FetchAdmission {
 public:
  FetchAdmission(int per_peer = 16, int max = 64) : per_peer_(per_peer), max_(max) {}
  // One more stream from `peer`, counted until release(peer); RESOURCE_EXHAUSTED naming the
  // bound (and its --snapshot-limits key) when it is reached.
  Status admit(const std::string& peer);
  void release(const std::string& peer);
  int total() const { return total_; }

 private:
  int per_peer_;
  int max_;
  int total_ = 0;
  std::map<std::string, int> by_peer_;
};

struct SnapshotServerOptions {
  std::string listen;  // HOST:PORT; port 0 picks a free one
  std::string run_id;  // requests for another run are refused (FAILED_PRECONDITION)
  TransferSecurity security;
  size_t chunk_bytes = 4 << 20;
  // Bounds against peers that open Fetch streams and do not read them (docs/reliability.md):
  // streams at once per peer address and in all (more: RESOURCE_EXHAUSTED), and the bytes of
  // chunks read for streams whose receiver has not taken them yet, in all (each chunk is sized
  // to fit, down to 64 KiB: a chunk in flight per stream).
  int max_streams_per_peer = 16;
  int max_streams = 64;
  uint64_t max_buffered_bytes = uint64_t{64} << 20;
  // A connection that has not sent HTTP/2's settings (after TLS's handshake) this long after it
  // was accepted is closed, and so is one without a call in flight for `max_connection_idle` (a
  // GOAWAY: a peer's next call connects again), as the rendezvous server does.
  Duration handshake_timeout = std::chrono::seconds(20);
  Duration max_connection_idle = std::chrono::minutes(10);
  // What this agent holds (or is fetching) of `wanted`'s name and version, if it is that content
  // (its size, and its CRC-32 unless either is pending: what the requester was announced);
  // nullopt: NOT_FOUND. Called on gRPC threads.
  std::function<std::optional<ServedFile>(const SnapshotFile& wanted)> lookup;
  // Another agent holds `file` and serves it at `source` (HOST:PORT); `origin` wrote it. Called
  // on gRPC threads.
  std::function<void(const SnapshotFile& file, const std::string& source,
                     const std::string& origin)>
      on_announce;
  ServeFault fault;
};

class SnapshotServer {
 public:
  // UNAVAILABLE when it cannot listen; INVALID_ARGUMENT for unusable TLS material.
  static StatusOr<std::unique_ptr<SnapshotServer>> start(SnapshotServerOptions options);
  ~SnapshotServer();
  int port() const;
  // Fetch streams being served now (any thread).
  int activeStreams() const;
  // Bytes of chunks read and not yet dropped by gRPC (sent, or the stream gone; any thread): at
  // most max_buffered_bytes, and 64 KiB more per stream when many share it.
  uint64_t bufferedBytes() const;

  struct Impl;

 private:
  explicit SnapshotServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Where another agent's replication service is.
struct SnapshotPeer {
  std::string endpoint;  // HOST:PORT
  std::string run_id;
  TransferSecurity security;
  // A fetch from it ends when no chunk arrived for this long (--snapshot-limits stall_timeout),
  // however large the version: a holder that stalls holds nothing here for longer.
  Duration stall_timeout = std::chrono::seconds(60);
};

// Tells `peer` that `file`, written by `origin`, can be fetched from `source`. Blocks up to
// `timeout`.
Status announceSnapshot(const SnapshotPeer& peer, const SnapshotFile& file,
                        const std::string& source, const std::string& origin, Duration timeout);

// Ends fetches from another thread (the agent's loop). cancel() cancels their gRPC calls at once,
// so a fetch blocked on a source that stopped answering (SIGSTOP, a cut link: no reset, no bytes)
// ends then rather than at its deadline; a fetch that starts after cancel() ends before it
// begins. Such fetches return `why`. Thread-safe; must outlive the fetches that use it.
class FetchCancel {
 public:
  void cancel(Status why);
  bool cancelled() const { return cancelled_.load(); }
  Status why() const;
  // For the fetch: `on_cancel` runs on cancel()'s thread when it comes, or here at once if it
  // came already, until unsubscribe(). It must not call back into this object.
  uint64_t subscribe(std::function<void()> on_cancel);
  void unsubscribe(uint64_t id);

 private:
  mutable Mutex mu_;
  std::atomic<bool> cancelled_{false};
  Status why_ GUARDED_BY(mu_);
  std::map<uint64_t, std::function<void()>> subscribers_ GUARDED_BY(mu_);
  uint64_t next_id_ GUARDED_BY(mu_) = 0;
};

// Receives `file` from `peer` into `temp_path` (created, never replacing anything), checks every
// chunk's CRC-32, the size and the whole content's CRC-32, and fsyncs it. On any failure the temp
// file is removed and the status says why: DATA_LOSS for a checksum or size mismatch,
// RESOURCE_EXHAUSTED when the disk lacks the space (naming the bytes needed), NOT_FOUND when the
// peer no longer holds that version, `cancel`'s reason once it was cancelled, UNAVAILABLE or
// DEADLINE_EXCEEDED for the network (DEADLINE_EXCEEDED too when no chunk came for the peer's
// stall_timeout). The disk's space is checked first, but taken only as the bytes arrive: a holder
// that announces a large version and stalls holds no more of the disk than it sent. A version of 64
// MiB or more comes over up to `streams_at_most` streams at once, one range of 32 MiB or more each,
// each on a helper thread and a connection of its own. The whole content's verified CRC-32 goes to
// `*crc32_out` when given (for a file.crc32_pending version, the one the source sent). With
// `arriving`, the bytes that are in the temp file and checked are reported to it as they come, so
// that this node can serve them on; it is failed unless the fetch succeeds. Blocks the calling
// thread.
inline constexpr size_t kDefaultFetchStreams = 2;
Status fetchSnapshot(const SnapshotPeer& peer, const SnapshotFile& file,
                     const std::string& temp_path, FetchCancel* cancel,
                     size_t streams_at_most = kDefaultFetchStreams, uint32_t* crc32_out = nullptr,
                     const std::shared_ptr<ArrivingFile>& arriving = nullptr);

// As fetchSnapshot, from a file this node holds instead of a peer: `file` (its CRC-32 known) is
// the content of `from` (a version another node renamed, announced with moved_from). The copy is
// checked against file.crc32 and fsynced; DATA_LOSS when `from` does not hold that content,
// RESOURCE_EXHAUSTED without the space, `cancel`'s reason once cancelled. Blocks the calling
// thread.
Status copySnapshotLocally(const OpenFile& from, const SnapshotFile& file,
                           const std::string& temp_path, FetchCancel* cancel,
                           const std::shared_ptr<ArrivingFile>& arriving = nullptr);

// Sets this process's allocator up for bulk transfers (glibc: mallopt). By default glibc serves an
// allocation of a few MiB, as gRPC makes for each read of a fetch, with a fresh mmap and returns
// it with munmap, so every byte received first cost a page fault and a page cleared: a fifth of a
// 100 MB fetch's CPU here. From this call on, allocations up to 8 MiB come from the heap, and up
// to 64 MiB of freed heap stays with the process for the next ones, and all threads share one heap.
// (The transfers' own buffers, chunks served, O_DIRECT write buffers and hashing buffers, come from
// BlockCache::transfers().) Process-wide; call it before any other thread allocates (the agent
// does so first thing with --snapshot-dir). Elsewhere than glibc it does nothing.
void tuneAllocatorForTransfers();

// After tuneAllocatorForTransfers(): grows the heap by 24 MiB, faulted in at once, for the
// buffers gRPC reads a fetch's stream into (64 KiB slices, what the 8 MiB window of each of two
// streams admits). In a fresh agent every page of those was a page fault, 13-16 us each on the
// VMs measured: ~5,000 of them in a 100 MB join. Populating 24 MiB takes ~6 ms; interleaved
// 100 MB joins, 5 each: 0.32-0.38 s -> 0.28-0.32 s, the joining agent's CPU 0.22-0.29 s ->
// 0.19-0.21 s. Only while no child shares this process's memory: the agent's worker guardians are
// forked children that never exec, and heap pages present when one is forked cost the agent a
// copy-on-write fault each when it next writes them (warmed before the workers of the step bench
// started, the receiving agent used 0.63-0.73 CPU-s instead of 0.52-0.55). The agent calls it
// when a round's sync needs a fetch, while the round's workers wait for it. Once per process;
// later calls do nothing. Elsewhere than glibc it does nothing.
void warmHeapForFetches();

// zlib's CRC-32 of a whole open file, reading from offset 0 (the size read is returned too). A
// file of 64 MiB or more is read in two halves at once, on this thread and a helper.
StatusOr<std::pair<uint64_t, uint32_t>> crc32OfFile(int fd);

}  // namespace ddprun::snapshot
