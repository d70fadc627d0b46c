#include "shm_allreduce.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
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
#include <functional>
#include <iterator>
#include <mutex>
#include <new>
#include <random>
#include <sstream>

#include "ddprun/common/log_text.h"
#include "ddprun/worker/errors.h"
#include "fault_hooks.h"
#include "half_kernels.h"

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

}  // namespace

std::string localHostIdentity() {
  auto link = [](const char* path) {
    char target[128] = {0};
    const ssize_t n = readlink(path, target, sizeof(target) - 1);
    return n > 0 ? std::string(target, static_cast<size_t>(n)) : std::string();
  };
  return readFirstLine("/proc/sys/kernel/random/boot_id") + "/" + link("/proc/self/ns/pid") + "/" +
         link("/proc/self/ns/net");
}

bool shmDisabledByEnvironment() {
  const char* v = std::getenv("DDPRUN_SHM");
  if (v == nullptr) return false;
  const std::string s(v);
  return s == "0" || s == "false" || s == "off" || s == "no";
}

namespace {

void scaleInPlace(ShmDType t, char* data, size_t n, double scale) {
  if (scale == 1.0) return;
  if (t == ShmDType::kFloat32) {
    auto* f = reinterpret_cast<float*>(data);
    const auto s = static_cast<float>(scale);
    for (size_t i = 0; i < n; ++i) f[i] *= s;
  } else if (t == ShmDType::kFloat64) {
    auto* d = reinterpret_cast<double*>(data);
    for (size_t i = 0; i < n; ++i) d[i] *= scale;
  } else if (t == ShmDType::kBFloat16 || t == ShmDType::kHalf) {
    auto* h = reinterpret_cast<uint16_t*>(data);
    (t == ShmDType::kBFloat16 ? kernels::scaleBf16 : kernels::scaleHalf)(h, n,
                                                                         static_cast<float>(scale));
  }  // integers: plain sums
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

// 16-bit floats: dst = round(dst + src), then round(dst * scale) when scaled.
void sumInto16(ShmDType t, char* dst, const char* src, char* mirror, size_t n, double scale) {
  (t == ShmDType::kBFloat16 ? kernels::sumBf16 : kernels::sumHalf)(dst, dst, src, n);
  scaleInPlace(t, dst, n, scale);
  if (mirror != nullptr) std::memcpy(mirror, dst, n * 2);
}

void sumInto(ShmDType t, char* dst, const char* src, char* mirror, size_t n, double scale) {
  switch (t) {
    case ShmDType::kBFloat16:
    case ShmDType::kHalf:
      return sumInto16(t, dst, src, mirror, n, scale);
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

std::string errnoText(const std::string& what) { return what + ": " + std::strerror(errno); }

std::vector<char> bytesOf(const std::string& s) { return std::vector<char>(s.begin(), s.end()); }

}  // namespace

// One mapped segment; unmaps on destruction and, for its creator until every rank mapped it,
// unlinks its name. A buffer's segment keeps its descriptor open: a later group's newcomer opens
// the segment through it (/proc/<pid>/fd/<fd>) to take it over.
struct ShmAllReduce::Segment {
  std::string name;
  char* base = nullptr;
  size_t bytes = 0;
  bool unlink_on_close = false;
  int fd = -1;
  uint64_t magic = 0;

  Segment() = default;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment() {
    if (base != nullptr) munmap(base, bytes);
    if (fd >= 0) close(fd);
    unlinkName();
  }
  void unlinkName() {
    if (unlink_on_close) shm_unlink(name.c_str());
    unlink_on_close = false;
  }
};

struct ShmAllReduce::Header {
  uint64_t magic;  // first 8 bytes of every segment: proves ranks share /dev/shm
  uint32_t size;
  uint32_t reserved;
  uint64_t slot_bytes;
  alignas(kLineBytes) std::atomic<uint32_t> arrived;   // barrier arrivals, ever
  alignas(kLineBytes) std::atomic<uint32_t> sleepers;  // ranks sleeping on `arrived`
  // Followed, on the next cache lines, by `size` std::atomic<int32_t> (each rank's pid), then by
  // `size` OpDescriptor (each rank's current collective).
};

size_t shmDTypeSize(ShmDType t) {
  switch (t) {
    case ShmDType::kFloat32:
    case ShmDType::kInt32:
      return 4;
    case ShmDType::kFloat64:
    case ShmDType::kInt64:
      return 8;
    case ShmDType::kBFloat16:
    case ShmDType::kHalf:
      return 2;
  }
  return 0;
}

const char* shmDTypeName(ShmDType t) {
  switch (t) {
    case ShmDType::kFloat32:
      return "float32";
    case ShmDType::kFloat64:
      return "float64";
    case ShmDType::kInt32:
      return "int32";
    case ShmDType::kInt64:
      return "int64";
    case ShmDType::kBFloat16:
      return "bfloat16";
    case ShmDType::kHalf:
      return "float16";
  }
  return "?";
}

namespace {

// What a rank is about to reduce; written before the op's first barrier, read after it.
struct alignas(kLineBytes) OpDescriptor {
  uint64_t count;
  uint32_t dtype;
  uint32_t in_place;  // 1 = a range of an allocate()d buffer
  uint64_t buffer_id;
  uint64_t offset;
  int32_t root;  // -1 = an all-reduce; else a broadcast of `count` bytes from this rank
};

size_t pidsOffset() { return roundUp(sizeof(ShmAllReduce::Header), kLineBytes); }

size_t descriptorsOffset(int size) {
  return roundUp(pidsOffset() + sizeof(std::atomic<int32_t>) * static_cast<size_t>(size),
                 kLineBytes);
}

size_t headerBytes(int size) {
  return roundUp(descriptorsOffset(size) + sizeof(OpDescriptor) * static_cast<size_t>(size),
                 kPageBytes);
}

std::atomic<int32_t>* pidsOf(char* base) {
  return reinterpret_cast<std::atomic<int32_t>*>(base + pidsOffset());
}

OpDescriptor* descriptorsOf(char* base, int size) {
  return reinterpret_cast<OpDescriptor*>(base + descriptorsOffset(size));
}

// Publishes `value` under key + rank and returns every rank's, in rank order. Collective.
std::vector<std::string> exchange(KeyValueStore& store, const std::string& key, int rank, int size,
                                  const std::string& value, std::chrono::milliseconds timeout) {
  store.set(key + std::to_string(rank), bytesOf(value));
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(key + std::to_string(r));
  store.wait(keys, timeout);
  std::vector<std::string> values;
  for (const std::string& k : keys) {
    const std::vector<char> v = store.get(k);
    values.emplace_back(v.begin(), v.end());
  }
  return values;
}

// Each rank says why it failed ("" = it did not); returns "" when none did, else the first
// refusal as "rank r: why". Collective.
std::string firstRefusal(KeyValueStore& store, const std::string& key, int rank, int size,
                         const std::string& why, std::chrono::milliseconds timeout) {
  const std::vector<std::string> all =
      exchange(store, key, rank, size, why.empty() ? "1" : "0" + why, timeout);
  for (int r = 0; r < size; ++r) {
    const std::string& v = all[static_cast<size_t>(r)];
    if (v.empty() || v[0] != '1') {
      return "rank " + std::to_string(r) + ": " + (v.empty() ? v : v.substr(1));
    }
  }
  return "";
}

// Rank 0 creates a segment of `bytes` (reserving the memory, so a full /dev/shm is a refusal now
// rather than a SIGBUS later), lets `init` lay it out, and publishes it under `key`; the others
// map it. Returns "" when every rank mapped it, else the first refusal ("rank r: why"). Either
// way the name is unlinked before returning. Collective.
// With `stride` (a buffer: a page, then one region of `stride` bytes per rank), each rank reserves
// its own region and rank 0 also the first page: the ranks zero their parts in parallel.
std::string shareSegment(int rank, int size, KeyValueStore& store, const std::string& key,
                         size_t bytes, bool enabled, const std::string& identity,
                         std::chrono::milliseconds timeout, ShmAllReduce::Segment& seg,
                         const std::function<void(char*)>& init, size_t stride = 0) {
  const bool keep_fd = stride != 0;  // a buffer: a later group may take it over
  std::string why;                   // empty = this rank mapped the segment
  uint64_t magic = 0;
  // The part of the segment this rank reserves: [begin, begin + length).
  const size_t begin =
      stride == 0 || rank == 0 ? 0 : kPageBytes + static_cast<size_t>(rank) * stride;
  const size_t length = stride == 0 ? bytes : rank == 0 ? kPageBytes + stride : stride;
  auto reserve = [&](int fd) {
    const int rc = posix_fallocate(fd, static_cast<off_t>(begin), static_cast<off_t>(length));
    return rc == 0
               ? std::string()
               : "reserving " + std::to_string(length) + " bytes in /dev/shm: " + std::strerror(rc);
  };
  auto mapFd = [&](int fd) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (keep_fd) {
      seg.fd = fd;
    } else {
      close(fd);
    }
    if (p == MAP_FAILED) return errnoText("mmap");
    seg.base = static_cast<char*>(p);
    seg.bytes = bytes;
    return std::string();
  };
  if (rank == 0) {
    std::string record = "-";
    if (!enabled) {
      why = "disabled";
    } else {
      std::random_device rd;
      magic = (static_cast<uint64_t>(rd()) << 32 | rd()) | 1u;
      std::ostringstream name;
      name << "/ddprun-" << getpid() << "-" << std::hex << rd() << rd();
      seg.name = name.str();
      const int fd = shm_open(seg.name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0) {
        why = errnoText("shm_open " + seg.name);
      } else {
        seg.unlink_on_close = true;
        if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
          why = errnoText("ftruncate " + seg.name);
        } else {
          why = reserve(fd);
        }
        if (!why.empty()) {
          close(fd);
        } else {
          why = mapFd(fd);
        }
      }
      if (why.empty()) {
        init(seg.base);
        std::memcpy(seg.base, &magic, sizeof(magic));
        std::ostringstream rec;
        rec << seg.name << "\n" << magic << "\n" << identity;
        record = rec.str();
      }
    }
    store.set(key + "segment", bytesOf(record));
  } else {
    store.wait({key + "segment"}, timeout);
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
      seg.name = name;
      const int fd = shm_open(name.c_str(), O_RDWR, 0);
      struct stat st {};
      if (fd < 0) {
        why = errnoText("shm_open " + name);
      } else if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
        close(fd);
        why = "segment " + name + " has an unexpected size";
      } else if (stride != 0 && !(why = reserve(fd)).empty()) {
        close(fd);
      } else {
        why = mapFd(fd);
      }
      uint64_t seen = 0;
      if (why.empty()) std::memcpy(&seen, seg.base, sizeof(seen));
      if (why.empty() && seen != magic) why = "segment " + name + " belongs to another host";
    }
  }
  seg.magic = magic;
  const std::string refusal = firstRefusal(store, key + "ok/", rank, size, why, timeout);
  seg.unlinkName();  // every rank that could map it has: nothing is left in /dev/shm
  return refusal;
}

}  // namespace

std::unique_ptr<ShmAllReduce> ShmAllReduce::tryCreate(int rank, int size,
                                                      std::shared_ptr<KeyValueStore> store,
                                                      const ShmOptions& given) {
  static const ddprun::TextLogger log("worker");
  if (size < 2) return nullptr;
  ShmOptions options = given;  // with this host's identity resolved once, for every buffer too
  if (options.host_identity.empty()) options.host_identity = localHostIdentity();
  const size_t slot_bytes =
      options.slot_bytes > 0
          ? roundUp(options.slot_bytes, kLineBytes)
          : std::max<size_t>(roundUp(std::min<size_t>(4u << 20, (16u << 20) / size), kLineBytes),
                             64u << 10);
  auto control = std::make_shared<Segment>();
  const std::string refusal =
      shareSegment(rank, size, *store, options.prefix + "/shm/control/",
                   headerBytes(size) + 2 * static_cast<size_t>(size) * slot_bytes,
                   options.enabled && !shmDisabledByEnvironment(), options.host_identity,
                   options.setup_timeout, *control, [&](char* base) {
                     auto* h = new (base) Header{};
                     h->size = static_cast<uint32_t>(size);
                     h->slot_bytes = slot_bytes;
                     for (int r = 0; r < size; ++r) new (pidsOf(base) + r) std::atomic<int32_t>(0);
                   });
  if (!refusal.empty()) {
    // Turned off, or ranks on other hosts, is a plan; a refusal of memory (a full /dev/shm) is
    // worth a line: the job runs on, slower.
    const bool planned = refusal.find("disabled") != std::string::npos ||
                         refusal.find("another host") != std::string::npos ||
                         refusal.find("has no segment") != std::string::npos;
    if (rank == 0 && !planned) {
      DDPRUN_LOG(log, kWarn,
                 "intra-host shared-memory all-reduce off (" << refusal << "); using gloo TCP");
    } else {
      DDPRUN_LOG(log, kDebug,
                 "rank " << rank << ": intra-host shared-memory all-reduce off (" << refusal
                         << "); using gloo TCP");
    }
    return nullptr;
  }
  // Every rank mapped the segment before reporting, so no peer check can miss a pid.
  pidsOf(control->base)[rank].store(static_cast<int32_t>(getpid()));
  DDPRUN_LOG(log, kDebug,
             "rank " << rank << ": all " << size << " ranks share this host: shared-memory "
                     << "all-reduce, " << (slot_bytes >> 10) << " KiB slots");
  return std::unique_ptr<ShmAllReduce>(
      new ShmAllReduce(rank, size, std::move(control), slot_bytes, std::move(store), options));
}

ShmAllReduce::ShmAllReduce(int rank, int size, std::shared_ptr<Segment> control, size_t slot_bytes,
                           std::shared_ptr<KeyValueStore> store, const ShmOptions& options)
    : rank_(rank),
      size_(size),
      control_(std::move(control)),
      header_(reinterpret_cast<Header*>(control_->base)),
      slot_bytes_(slot_bytes),
      store_(std::move(store)),
      options_(options) {}

ShmAllReduce::~ShmAllReduce() = default;

namespace {

// The buffers this process mapped, so that the next group of an in-place recovery can take over
// those of the group it aborted: matched by allocation number, size, group size, this rank's
// place and host. Weak: a buffer nobody holds any more is gone.
struct Carried {
  std::weak_ptr<ShmAllReduce::Segment> segment;
  std::shared_ptr<const std::atomic<bool>> aborted;  // its group's
  uint64_t id;
  size_t bytes;
  int size;
  int rank;
  std::string identity;
};

std::mutex& carriedMutex() {
  static std::mutex mu;
  return mu;
}

std::vector<Carried>& carried() {
  static std::vector<Carried> all;
  return all;
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels refuse it (EINVAL) and fault lazily
#endif
constexpr long kTmpfsMagic = 0x01021994;

// Maps the segment another process of this host holds open as `fd`: it must be an unlinked
// tmpfs file (what shm_open made and shareSegment unlinked) of `bytes` bytes starting with
// `magic`. It is looked at through an O_PATH descriptor first, so that nothing else (a device, a
// FIFO) is ever opened for reading and writing. Returns "" or why not.
std::string openHeldSegment(long pid, int fd, uint64_t magic, size_t bytes,
                            ShmAllReduce::Segment& seg) {
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  const int look = open(path.c_str(), O_PATH | O_CLOEXEC);
  if (look < 0) return errnoText("open " + path);
  struct stat st {};
  struct statfs fs {};
  std::string why;
  if (fstat(look, &st) != 0 || fstatfs(look, &fs) != 0) {
    why = errnoText("fstat " + path);
  } else if (static_cast<long>(fs.f_type) != kTmpfsMagic || !S_ISREG(st.st_mode) ||
             st.st_nlink != 0 || static_cast<size_t>(st.st_size) != bytes) {
    why = path + " is not an unlinked shared-memory segment of " + std::to_string(bytes) + " bytes";
  }
  // The same file, now for reading and writing (/proc/self/fd reopens what `look` refers to).
  const int f = why.empty()
                    ? open(("/proc/self/fd/" + std::to_string(look)).c_str(), O_RDWR | O_CLOEXEC)
                    : -1;
  if (why.empty() && f < 0) why = errnoText("open " + path);
  close(look);
  if (!why.empty()) return why;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
  if (p == MAP_FAILED) {
    why = errnoText("mmap " + path);
    close(f);
    return why;
  }
  seg.name = path;
  seg.fd = f;
  seg.base = static_cast<char*>(p);
  seg.bytes = bytes;
  seg.magic = magic;
  uint64_t seen = 0;
  std::memcpy(&seen, seg.base, sizeof(seen));
  return seen == magic ? "" : path + " holds another segment";
}

}  // namespace

std::shared_ptr<ShmAllReduce::Segment> ShmAllReduce::takeOver(uint64_t id, size_t bytes,
                                                              size_t stride, size_t total,
                                                              const std::string& key) {
  static const ddprun::TextLogger log("worker");
  std::shared_ptr<Segment> mine;
  {
    std::lock_guard<std::mutex> lock(carriedMutex());
    auto& all = carried();
    all.erase(std::remove_if(all.begin(), all.end(),
                             [](const Carried& c) { return c.segment.expired(); }),
              all.end());
    for (auto c = all.rbegin(); c != all.rend() && !mine; ++c) {
      if (c->aborted->load() && c->id == id && c->bytes == bytes && c->size == size_ &&
          c->rank == rank_ && c->identity == options_.host_identity) {
        mine = c->segment.lock();
        if (mine && mine->bytes != total) mine.reset();
        // Claimed: no other group of this process may offer it too (allocate() notes it again,
        // under this group, once taken over).
        if (mine) all.erase(std::next(c).base());
      }
    }
  }
  std::ostringstream offer;
  if (mine) {
    offer << getpid() << " " << mine->fd << " " << mine->magic;
  } else {
    offer << "-";
  }
  const std::vector<std::string> offers =
      exchange(*store_, key + "offer/", rank_, size_, offer.str(), options_.setup_timeout);
  // Every rank that offers must hold the same segment, and be one of this group's processes (the
  // pids every rank wrote into the control segment); the lowest lends it to the others. A real
  // magic is odd.
  const std::atomic<int32_t>* pids = pidsOf(control_->base);
  long pid = 0;
  int fd = -1;
  uint64_t magic = 0;
  for (int r = 0; r < size_; ++r) {
    const std::string& o = offers[static_cast<size_t>(r)];
    if (o == "-") continue;
    std::istringstream in(o);
    long p = 0;
    int f = -1;
    uint64_t m = 0;
    if (!(in >> p >> f >> m) || p != pids[r].load() || f < 0 || (m & 1u) == 0 ||
        (pid != 0 && m != magic)) {
      DDPRUN_LOG(log, kDebug,
                 "rank " << rank_ << ": shared buffer " << id << " not taken over: rank " << r
                         << " offers '" << o.substr(0, 80) << "'");
      return nullptr;
    }
    if (pid == 0) {
      pid = p;
      fd = f;
      magic = m;
    }
  }
  if (pid == 0) return nullptr;  // no rank holds one: a first group, or another layout
  std::string why;
  std::shared_ptr<Segment> seg = mine;
  if (!seg) {
    seg = std::make_shared<Segment>();
    why = openHeldSegment(pid, fd, magic, total, *seg);
  }
  if (why.empty()) {
    // Its pages exist: mapping them in one call is far cheaper than faulting them one by one in
    // the first all-reduce.
    madvise(seg->base + kPageBytes + static_cast<size_t>(rank_) * stride, stride,
            MADV_POPULATE_WRITE);
  }
  const std::string refusal =
      firstRefusal(*store_, key + "taken/", rank_, size_, why, options_.setup_timeout);
  if (!refusal.empty()) {
    DDPRUN_LOG(log, kDebug,
               "rank " << rank_ << ": shared buffer " << id << " not taken over (" << refusal
                       << "); allocating a new one");
    return nullptr;
  }
  DDPRUN_LOG(log, kDebug,
             "rank " << rank_ << ": shared buffer " << id << " taken over from the aborted group ("
                     << (mine ? "kept" : "mapped through pid " + std::to_string(pid)) << ")");
  return seg;
}

std::shared_ptr<void> ShmAllReduce::allocate(size_t bytes) {
  static const ddprun::TextLogger log("worker");
  // (Tests: a rank lost at start-up while the others wait for its buckets' segment in the store,
  // after it said it can recover in place; in the job's first attempt only.)
  if (const char* restarts = std::getenv("TORCHELASTIC_RESTART_COUNT");
      allocations_ == 0 && restarts != nullptr && std::string(restarts) == "0") {
    injectRecoveryFault("buckets", rank_);
  }
  const uint64_t id = ++allocations_;
  const size_t stride = roundUp(std::max<size_t>(bytes, 1), kPageBytes);
  const size_t total = kPageBytes + static_cast<size_t>(size_) * stride;
  const std::string key = options_.prefix + "/shm/buffer" + std::to_string(id) + "/";
  std::shared_ptr<Segment> seg = takeOver(id, bytes, stride, total, key);
  if (!seg) {
    seg = std::make_shared<Segment>();
    const std::string refusal = shareSegment(
        rank_, size_, *store_, key, total, true, options_.host_identity, options_.setup_timeout,
        *seg, [](char*) {}, stride);
    if (!refusal.empty()) {
      DDPRUN_LOG(log, kDebug,
                 "rank " << rank_ << ": shared buffer " << id << " of " << bytes
                         << " bytes refused (" << refusal << "); it stays private");
      return nullptr;
    }
  }
  {
    // A segment taken over left the registry when takeOver() claimed it: one entry each.
    std::lock_guard<std::mutex> lock(carriedMutex());
    carried().push_back(Carried{seg, aborted_, id, bytes, size_, rank_, options_.host_identity});
  }
  char* rank0 = seg->base + kPageBytes;
  char* own = rank0 + static_cast<size_t>(rank_) * stride;
  buffers_.push_back(Buffer{id, own, bytes, stride, rank0, seg});
  return std::shared_ptr<void>(seg, own);
}

const ShmAllReduce::Buffer* ShmAllReduce::findBuffer(const char* data, size_t bytes) {
  // Forget freed buffers first: their addresses may have been reused by unrelated memory.
  buffers_.erase(std::remove_if(buffers_.begin(), buffers_.end(),
                                [](const Buffer& b) { return b.segment.expired(); }),
                 buffers_.end());
  for (const Buffer& b : buffers_) {
    if (data >= b.own && data + bytes <= b.own + b.bytes) return &b;
  }
  return nullptr;
}

char* ShmAllReduce::slot(int set, int rank) const {
  return control_->base + headerBytes(size_) +
         (static_cast<size_t>(set) * static_cast<size_t>(size_) + static_cast<size_t>(rank)) *
             slot_bytes_;
}

void ShmAllReduce::publishDescriptor(size_t count, ShmDType dtype, const Buffer* buffer,
                                     size_t offset, int root) {
  OpDescriptor& d = descriptorsOf(control_->base, size_)[rank_];
  d.count = count;
  d.dtype = static_cast<uint32_t>(dtype);
  d.in_place = buffer != nullptr ? 1 : 0;
  d.buffer_id = buffer != nullptr ? buffer->id : 0;
  d.offset = offset;
  d.root = root;
}

void ShmAllReduce::verifyDescriptors() const {
  const OpDescriptor* all = descriptorsOf(control_->base, size_);
  auto describe = [&](int r) {
    const OpDescriptor& d = all[r];
    if (d.root >= 0) {
      return "rank " + std::to_string(r) + " broadcasts " + std::to_string(d.count) +
             " bytes from rank " + std::to_string(d.root);
    }
    std::string s = "rank " + std::to_string(r) + " reduces " + std::to_string(d.count) + " " +
                    shmDTypeName(static_cast<ShmDType>(d.dtype)) + " elements";
    if (d.in_place) {
      s += " at offset " + std::to_string(d.offset) + " of shared buffer " +
           std::to_string(d.buffer_id);
    }
    return s;
  };
  for (int r = 0; r < size_; ++r) {
    const OpDescriptor& a = all[r];
    const OpDescriptor& b = all[rank_];
    if (a.count != b.count || a.dtype != b.dtype || a.in_place != b.in_place ||
        a.buffer_id != b.buffer_id || a.offset != b.offset || a.root != b.root) {
      throw CommError("shared memory: ranks disagree on the collective: " + describe(rank_) +
                      " but " + describe(r) +
                      " (every rank must issue the same collectives in the same order)");
    }
  }
}

void ShmAllReduce::checkPeers(const char* phase) const {
  for (int r = 0; r < size_; ++r) {
    const int32_t pid = pidsOf(control_->base)[r].load(std::memory_order_relaxed);
    if (r != rank_ && pid > 0 && kill(pid, 0) != 0 && errno == ESRCH) {
      throw CommError("shared-memory all_reduce: rank " + std::to_string(r) + " (pid " +
                      std::to_string(pid) + ") exited while rank " + std::to_string(rank_) +
                      " waited for it (" + phase + ")");
    }
  }
}

void ShmAllReduce::abort() {
  aborted_->store(true);
  // Every sleeper on this segment wakes; those not aborted go back to sleep.
  futexWakeAll(&header_->arrived);
}

void ShmAllReduce::barrier(const char* phase) {
  auto throwIfAborted = [&] {
    if (aborted_->load()) {
      throw CommError("shared-memory all_reduce: rank " + std::to_string(rank_) + " was aborted (" +
                      phase + ")");
    }
  };
  throwIfAborted();
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
    throwIfAborted();
    const auto t = std::chrono::steady_clock::now();
    if (t - start > options_.op_timeout) {
      throw CommError(
          "shared-memory all_reduce: rank " + std::to_string(rank_) + " timed out after " +
          std::to_string(
              std::chrono::duration_cast<std::chrono::milliseconds>(options_.op_timeout).count()) +
          " ms waiting for its peers (" + phase + ")");
    }
    if (t >= next_check) {
      checkPeers(phase);
      next_check = t + kPeerCheck;
    }
  }
}

void ShmAllReduce::allReduce(void* data, size_t count, ShmDType dtype, double scale,
                             const PieceHook& hook) {
  char* p = static_cast<char*>(data);
  const size_t bytes = count * shmDTypeSize(dtype);
  if (const Buffer* buffer = findBuffer(p, bytes)) {
    publishDescriptor(count, dtype, buffer, static_cast<size_t>(p - buffer->own));
    allReduceInPlace(*buffer, p, count, dtype, scale, hook);
  } else {
    publishDescriptor(count, dtype, nullptr, 0);
    allReduceStaged(p, count, dtype, scale, hook);
  }
}

namespace {

// Rank r's share of n elements: whole cache lines; the last ranks' pieces may be short or empty.
struct Pieces {
  size_t n;
  size_t piece;
  size_t begin(int r) const { return std::min(n, static_cast<size_t>(r) * piece); }
  size_t end(int r) const { return std::min(n, begin(r) + piece); }
};

Pieces piecesOf(size_t n, int size, size_t es) {
  return Pieces{n, roundUp((n + static_cast<size_t>(size) - 1) / size, kLineBytes / es)};
}

}  // namespace

void ShmAllReduce::reduceOwnPiece(char* own, const std::function<const char*(int)>& peer_piece,
                                  char* publish, size_t n, ShmDType dtype, double scale,
                                  const PieceHook& hook) {
  if (n == 0) return;
  // Ours + every peer's, in rank order.
  const int last = size_ - 1 == rank_ ? size_ - 2 : size_ - 1;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const bool fused = r == last && !hook;
    sumInto(dtype, own, peer_piece(r), fused ? publish : nullptr, n, fused ? scale : 1.0);
  }
  if (!hook) return;
  hook(own, n);
  if (scale != 1.0) scaleInPlace(dtype, own, n, scale);
  if (publish != nullptr) std::memcpy(publish, own, n * shmDTypeSize(dtype));
}

void ShmAllReduce::allReduceStaged(char* data, size_t count, ShmDType dtype, double scale,
                                   const PieceHook& hook) {
  const size_t es = shmDTypeSize(dtype);
  const size_t chunk_elems = slot_bytes_ / es;
  for (size_t done = 0; done < count;) {
    const size_t n = std::min(chunk_elems, count - done);
    char* chunk = data + done * es;
    const int set = static_cast<int>(chunks_++ & 1u);
    char* mine = slot(set, rank_);
    // Rank r reduces piece r, so its peers need every piece of this chunk but ours: only those
    // are published.
    const Pieces pieces = piecesOf(n, size_, es);
    const size_t b = pieces.begin(rank_);
    const size_t e = pieces.end(rank_);
    std::memcpy(mine, chunk, b * es);
    std::memcpy(mine + e * es, chunk + e * es, (n - e) * es);
    barrier("copying in");
    if (done == 0) verifyDescriptors();

    // Own piece, in place in the caller's tensor, published in our slot for the peers.
    reduceOwnPiece(
        chunk + b * es, [&](int r) { return slot(set, r) + b * es; }, mine + b * es, e - b, dtype,
        scale, hook);
    barrier("reducing");

    for (int r = 0; r < size_; ++r) {
      if (r != rank_ && pieces.end(r) > pieces.begin(r)) {
        std::memcpy(chunk + pieces.begin(r) * es, slot(set, r) + pieces.begin(r) * es,
                    (pieces.end(r) - pieces.begin(r)) * es);
      }
    }
    done += n;
  }
}

void ShmAllReduce::broadcast(void* data, size_t bytes, int root, bool receive) {
  if (root < 0 || root >= size_) {
    throw CommError("shared-memory broadcast: root " + std::to_string(root) + " is outside [0, " +
                    std::to_string(size_ - 1) + "]");
  }
  publishDescriptor(bytes, ShmDType::kFloat32, nullptr, 0, root);  // (the dtype is unused)
  char* p = static_cast<char*>(data);
  // A chunk fills one set of slots (every rank's slot of the set, contiguous): the root copies it
  // in, the others copy it out. The sets alternate as in the staged all-reduce, so the root writes
  // a set again only after every rank has passed the barrier that follows reading it.
  const size_t chunk = slot_bytes_ * static_cast<size_t>(size_);
  size_t done = 0;
  do {
    const size_t n = std::min(chunk, bytes - done);
    const int set = static_cast<int>(chunks_++ & 1u);
    char* area = slot(set, 0);
    if (rank_ == root) std::memcpy(area, p + done, n);
    barrier("broadcast: copying in");
    if (done == 0) verifyDescriptors();
    if (rank_ != root && receive) std::memcpy(p + done, area, n);
    done += n;
  } while (done < bytes);
  // Every rank has read the slots and checked the descriptors before any rank starts its next op.
  barrier("broadcast: copying out");
}

void ShmAllReduce::allReduceInPlace(const Buffer& buffer, char* data, size_t count, ShmDType dtype,
                                    double scale, const PieceHook& hook) {
  const size_t es = shmDTypeSize(dtype);
  const size_t offset = static_cast<size_t>(data - buffer.own);
  auto peer = [&](int r) { return buffer.rank0 + static_cast<size_t>(r) * buffer.stride + offset; };
  const Pieces pieces = piecesOf(count, size_, es);
  const size_t b = pieces.begin(rank_);
  const size_t e = pieces.end(rank_);
  barrier("waiting for every rank's buffer");
  verifyDescriptors();
  // Own piece, in place in our buffer, where the peers copy it from. Meanwhile they read only
  // their own pieces of our buffer.
  reduceOwnPiece(
      data + b * es, [&](int r) { return peer(r) + b * es; }, nullptr, e - b, dtype, scale, hook);
  barrier("reducing");
  for (int r = 0; r < size_; ++r) {
    if (r != rank_ && pieces.end(r) > pieces.begin(r)) {
      std::memcpy(data + pieces.begin(r) * es, peer(r) + pieces.begin(r) * es,
                  (pieces.end(r) - pieces.begin(r)) * es);
    }
  }
  // Until every peer copied our piece, the caller must not touch the buffer.
  barrier("copying out");
}

}  // namespace ddprun::worker
