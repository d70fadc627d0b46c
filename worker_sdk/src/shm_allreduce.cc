#include "shm_allreduce.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <random>
#include <sstream>

#include "ddprun/common/log.h"
#include "ddprun/worker/errors.h"

namespace ddprun::worker {

namespace {

constexpr size_t kPageBytes = 4096;
constexpr size_t kLineBytes = 64;
// Pause this often (a few microseconds) before sleeping on the futex: long spins steal the core
// from the training thread when ranks outnumber cores.
constexpr int kSpins = 200;
constexpr auto kPeerCheck = std::chrono::milliseconds(100);

static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex word must be 32 bits");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "shared atomics must be lock-free");

size_t roundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Shared (not FUTEX_PRIVATE) futex: the word lives in memory mapped by several processes.
void futexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::milliseconds timeout) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  ts.tv_nsec = static_cast<long>((timeout.count() % 1000) * 1000000);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// True once `counter` has reached `target` (wrap-safe: both count up together).
bool reached(uint32_t counter, uint32_t target) {
  return static_cast<int32_t>(counter - target) >= 0;
}

std::string readFirstLine(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// Ranks that see the same boot id and pid namespace share a kernel and can check each other's
// pids; the segment's random magic then proves they also share /dev/shm.
std::string hostIdentity() {
  char ns[128] = {0};
  const ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
  return readFirstLine("/proc/sys/kernel/random/boot_id") + "/" +
         (n > 0 ? std::string(ns, static_cast<size_t>(n)) : std::string());
}

bool disabledByEnvironment() {
  const char* v = std::getenv("DDPRUN_SHM");
  if (v == nullptr) return false;
  const std::string s(v);
  return s == "0" || s == "false" || s == "off" || s == "no";
}

// Element-wise dst = (dst + src) * scale, also stored to `mirror` when not null (one pass instead
// of a sum, a scaling and a copy), in 64-byte vectors (GCC vector extension: SIMD at -O2 on any
// target). scale == 1 skips the multiply (and is the only value integer sums get).
template <typename T>
void sumInto(char* dst_bytes, const char* src_bytes, char* mirror, size_t n, double scale) {
  const bool scaled = scale != 1.0;
  const T factor = static_cast<T>(scale);
  typedef T V __attribute__((vector_size(kLineBytes)));
  constexpr size_t kLanes = kLineBytes / sizeof(T);
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    V a;
    V b;
    std::memcpy(&a, dst_bytes + i * sizeof(T), sizeof(V));
    std::memcpy(&b, src_bytes + i * sizeof(T), sizeof(V));
    a += b;
    if (scaled) a *= factor;
    std::memcpy(dst_bytes + i * sizeof(T), &a, sizeof(V));
    if (mirror != nullptr) std::memcpy(mirror + i * sizeof(T), &a, sizeof(V));
  }
  auto* dst = reinterpret_cast<T*>(dst_bytes);
  const auto* src = reinterpret_cast<const T*>(src_bytes);
  for (; i < n; ++i) {
    dst[i] += src[i];
    if (scaled) dst[i] *= factor;
    if (mirror != nullptr) std::memcpy(mirror + i * sizeof(T), &dst[i], sizeof(T));
  }
}

void sumInto(ShmDType t, char* dst, const char* src, char* mirror, size_t n, double scale) {
  switch (t) {
    case ShmDType::kFloat32:
      return sumInto<float>(dst, src, mirror, n, scale);
    case ShmDType::kFloat64:
      return sumInto<double>(dst, src, mirror, n, scale);
    case ShmDType::kInt32:
      return sumInto<int32_t>(dst, src, mirror, n, 1.0);
    case ShmDType::kInt64:
      return sumInto<int64_t>(dst, src, mirror, n, 1.0);
  }
}

// A mapped segment; unmaps (and, for the creator until release(), unlinks) on destruction.
struct Mapping {
  std::string name;
  void* base = MAP_FAILED;
  size_t bytes = 0;
  bool unlink_on_close = false;

  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (base != MAP_FAILED) munmap(base, bytes);
    unlinkName();
  }
  void unlinkName() {
    if (unlink_on_close) shm_unlink(name.c_str());
    unlink_on_close = false;
  }
  bool ok() const { return base != MAP_FAILED; }
  void* release() {
    void* b = base;
    base = MAP_FAILED;
    return b;
  }
};

std::string errnoText(const std::string& what) { return what + ": " + std::strerror(errno); }

}  // namespace

struct ShmAllReduce::Header {
  uint64_t magic;
  uint32_t size;
  uint32_t reserved;
  uint64_t slot_bytes;
  alignas(kLineBytes) std::atomic<uint32_t> arrived;   // barrier arrivals, ever
  alignas(kLineBytes) std::atomic<uint32_t> sleepers;  // ranks sleeping on `arrived`
  // Followed, on the next cache line, by `size` std::atomic<int32_t>: each rank's pid.
};

size_t shmDTypeSize(ShmDType t) {
  switch (t) {
    case ShmDType::kFloat32:
    case ShmDType::kInt32:
      return 4;
    case ShmDType::kFloat64:
    case ShmDType::kInt64:
      return 8;
  }
  return 0;
}

namespace {

size_t pidsOffset() { return roundUp(sizeof(ShmAllReduce::Header), kLineBytes); }

size_t headerBytes(int size) {
  return roundUp(pidsOffset() + sizeof(std::atomic<int32_t>) * static_cast<size_t>(size),
                 kPageBytes);
}

std::atomic<int32_t>* pidsOf(void* base) {
  return reinterpret_cast<std::atomic<int32_t>*>(static_cast<char*>(base) + pidsOffset());
}

size_t segmentBytes(int size, size_t slot_bytes) {
  return headerBytes(size) + 2 * static_cast<size_t>(size) * slot_bytes;
}

// Creates, reserves (so a full /dev/shm is an error now, not a SIGBUS later) and maps a segment.
std::string createSegment(Mapping& m, int size, size_t slot_bytes) {
  std::random_device rd;
  std::ostringstream name;
  name << "/ddprun-" << getpid() << "-" << std::hex << rd() << rd();
  m.name = name.str();
  const int fd = shm_open(m.name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return errnoText("shm_open " + m.name);
  m.unlink_on_close = true;
  m.bytes = segmentBytes(size, slot_bytes);
  const int rc = posix_fallocate(fd, 0, static_cast<off_t>(m.bytes));
  if (rc != 0) {
    close(fd);
    return "reserving " + std::to_string(m.bytes) + " bytes in /dev/shm: " + std::strerror(rc);
  }
  m.base = mmap(nullptr, m.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (!m.ok()) return errnoText("mmap");
  return "";
}

std::string openSegment(Mapping& m, const std::string& name, int size, size_t slot_bytes) {
  m.name = name;
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return errnoText("shm_open " + name);
  struct stat st {};
  m.bytes = segmentBytes(size, slot_bytes);
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != m.bytes) {
    close(fd);
    return "segment " + name + " has an unexpected size";
  }
  m.base = mmap(nullptr, m.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (!m.ok()) return errnoText("mmap");
  return "";
}

std::vector<char> bytesOf(const std::string& s) { return std::vector<char>(s.begin(), s.end()); }

}  // namespace

std::unique_ptr<ShmAllReduce> ShmAllReduce::tryCreate(int rank, int size, KeyValueStore& store,
                                                      const ShmOptions& options) {
  static const auto log = ddprun::logger("worker");
  if (size < 2) return nullptr;
  const size_t slot_bytes =
      options.slot_bytes > 0
          ? roundUp(options.slot_bytes, kLineBytes)
          : std::max<size_t>(roundUp(std::min<size_t>(4u << 20, (16u << 20) / size), kLineBytes),
                             64u << 10);
  const std::string key = options.prefix + "/shm/";
  const std::string identity = hostIdentity();
  const bool enabled = options.enabled && !disabledByEnvironment();

  Mapping mapping;
  std::string why;  // empty = this rank attached
  uint64_t magic = 0;
  if (rank == 0) {
    std::string record = "-";
    if (!enabled) {
      why = "disabled";
    } else {
      std::random_device rd;
      magic = (static_cast<uint64_t>(rd()) << 32 | rd()) | 1u;
      why = createSegment(mapping, size, slot_bytes);
      if (why.empty()) {
        auto* h = new (mapping.base) Header{};
        h->magic = magic;
        h->size = static_cast<uint32_t>(size);
        h->slot_bytes = slot_bytes;
        for (int r = 0; r < size; ++r) new (pidsOf(mapping.base) + r) std::atomic<int32_t>(0);
        std::ostringstream rec;
        rec << mapping.name << "\n" << magic << "\n" << identity;
        record = rec.str();
      }
    }
    store.set(key + "segment", bytesOf(record));
  } else {
    store.wait({key + "segment"}, options.setup_timeout);
    const std::vector<char> raw = store.get(key + "segment");
    const std::string record(raw.begin(), raw.end());
    std::istringstream in(record);
    std::string name;
    std::string theirs;
    std::getline(in, name);
    in >> magic;
    in.ignore(1);
    std::getline(in, theirs);
    if (!enabled) {
      why = "disabled";
    } else if (record == "-") {
      why = "rank 0 has no segment";
    } else if (theirs != identity) {
      why = "rank 0 runs on another host (or in another pid namespace)";
    } else {
      why = openSegment(mapping, name, size, slot_bytes);
      if (why.empty() && static_cast<Header*>(mapping.base)->magic != magic) {
        why = "segment " + name + " belongs to another host's rank 0";
      }
    }
  }
  if (why.empty()) {
    pidsOf(mapping.base)[rank].store(static_cast<int32_t>(getpid()));
  }
  store.set(key + "ok/" + std::to_string(rank), bytesOf(why.empty() ? "1" : "0" + why));

  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(key + "ok/" + std::to_string(r));
  store.wait(keys, options.setup_timeout);
  std::string refusal;
  for (int r = 0; r < size && refusal.empty(); ++r) {
    const std::vector<char> v = store.get(keys[static_cast<size_t>(r)]);
    if (v.empty() || v[0] != '1') {
      refusal = "rank " + std::to_string(r) + ": " +
                std::string(v.begin() + (v.empty() ? 0 : 1), v.end());
    }
  }
  mapping.unlinkName();  // every rank that could attach has: nothing is left in /dev/shm
  if (!refusal.empty()) {
    log->debug("rank {}: intra-host shared-memory all-reduce off ({}); using gloo TCP", rank,
               refusal);
    return nullptr;
  }
  log->debug("rank {}: all {} ranks share this host: shared-memory all-reduce, {} KiB slots", rank,
             size, slot_bytes >> 10);
  const size_t bytes = mapping.bytes;
  return std::unique_ptr<ShmAllReduce>(
      new ShmAllReduce(rank, size, mapping.release(), bytes, slot_bytes, options.op_timeout));
}

ShmAllReduce::ShmAllReduce(int rank, int size, void* base, size_t mapped, size_t slot_bytes,
                           std::chrono::milliseconds op_timeout)
    : rank_(rank),
      size_(size),
      base_(base),
      mapped_(mapped),
      slot_bytes_(slot_bytes),
      op_timeout_(op_timeout),
      header_(static_cast<Header*>(base)) {}

ShmAllReduce::~ShmAllReduce() { munmap(base_, mapped_); }

char* ShmAllReduce::slot(int set, int rank) const {
  return static_cast<char*>(base_) + headerBytes(size_) +
         (static_cast<size_t>(set) * static_cast<size_t>(size_) + static_cast<size_t>(rank)) *
             slot_bytes_;
}

void ShmAllReduce::checkPeers(const char* phase) const {
  for (int r = 0; r < size_; ++r) {
    const int32_t pid = pidsOf(base_)[r].load(std::memory_order_relaxed);
    if (r != rank_ && pid > 0 && kill(pid, 0) != 0 && errno == ESRCH) {
      throw CommError("shared-memory all_reduce: rank " + std::to_string(r) + " (pid " +
                      std::to_string(pid) + ") exited while rank " + std::to_string(rank_) +
                      " waited for it (" + phase + ")");
    }
  }
}

void ShmAllReduce::barrier(const char* phase) {
  ++barriers_;
  const uint32_t target = barriers_ * static_cast<uint32_t>(size_);
  uint32_t now = header_->arrived.fetch_add(1) + 1;
  if (now == target) {
    if (header_->sleepers.load() > 0) futexWakeAll(&header_->arrived);
    return;
  }
  for (int i = 0; i < kSpins; ++i) {
    cpuRelax();
    if (reached(header_->arrived.load(std::memory_order_acquire), target)) return;
  }
  const auto start = std::chrono::steady_clock::now();
  auto next_check = start + kPeerCheck;
  for (;;) {
    header_->sleepers.fetch_add(1);
    now = header_->arrived.load();
    if (!reached(now, target)) futexWait(&header_->arrived, now, kPeerCheck);
    header_->sleepers.fetch_sub(1);
    if (reached(header_->arrived.load(), target)) return;
    const auto t = std::chrono::steady_clock::now();
    if (t - start > op_timeout_) {
      throw CommError(
          "shared-memory all_reduce: rank " + std::to_string(rank_) + " timed out after " +
          std::to_string(
              std::chrono::duration_cast<std::chrono::milliseconds>(op_timeout_).count()) +
          " ms waiting for its peers (" + phase + ")");
    }
    if (t >= next_check) {
      checkPeers(phase);
      next_check = t + kPeerCheck;
    }
  }
}

void ShmAllReduce::allReduce(void* data, size_t count, ShmDType dtype, double scale) {
  const size_t es = shmDTypeSize(dtype);
  const size_t chunk_elems = slot_bytes_ / es;
  const size_t align_elems = kLineBytes / es;
  char* out = static_cast<char*>(data);
  for (size_t done = 0; done < count;) {
    const size_t n = std::min(chunk_elems, count - done);
    char* chunk = out + done * es;
    const int set = static_cast<int>(chunks_++ & 1u);
    char* mine = slot(set, rank_);
    // Pieces of whole cache lines; the last ranks' pieces may be short or empty. Rank r reduces
    // piece r, so its peers need every piece of this rank's chunk but piece r: only those are
    // published.
    const size_t piece = roundUp((n + static_cast<size_t>(size_) - 1) / size_, align_elems);
    auto begin = [&](int r) { return std::min(n, static_cast<size_t>(r) * piece); };
    auto end = [&](int r) { return std::min(n, begin(r) + piece); };
    const size_t b = begin(rank_);
    const size_t e = end(rank_);
    std::memcpy(mine, chunk, b * es);
    std::memcpy(mine + e * es, chunk + e * es, (n - e) * es);
    barrier("copying in");

    // Own piece, in place in the caller's tensor: ours + every peer's, in rank order; the last
    // pass also scales and publishes the result in our slot for the peers to copy out.
    if (e > b) {
      const int last = size_ - 1 == rank_ ? size_ - 2 : size_ - 1;
      for (int r = 0; r < size_; ++r) {
        if (r == rank_) continue;
        const bool final_pass = r == last;
        sumInto(dtype, chunk + b * es, slot(set, r) + b * es, final_pass ? mine + b * es : nullptr,
                e - b, final_pass ? scale : 1.0);
      }
    }
    barrier("reducing");

    for (int r = 0; r < size_; ++r) {
      if (r != rank_ && end(r) > begin(r)) {
        std::memcpy(chunk + begin(r) * es, slot(set, r) + begin(r) * es, (end(r) - begin(r)) * es);
      }
    }
    done += n;
  }
}

}  // namespace ddprun::worker
