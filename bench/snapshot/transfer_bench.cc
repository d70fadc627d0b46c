// Raw throughput of one snapshot fetch (snapshot/transfer.h) on 127.0.0.1, against a
// plain read+write copy of the same file on the same disk. Informational.
// Usage: snapshot_transfer_bench SIZE_MB [REPS [DIR]]   (DIR: where the files go, default /tmp)
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "ddprun/snapshot/transfer.h"

using namespace ddprun;
using namespace ddprun::snapshot;

namespace {
double cpuSeconds() {  // user + system time of every thread of this process
  struct rusage ru {};
  ::getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: snapshot_transfer_bench SIZE_MB [REPS [DIR]]\n");
    return 2;
  }
  const size_t size = static_cast<size_t>(std::atol(argv[1])) << 20;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 3;
  const char* streams_env = std::getenv("DDPRUN_SNAPSHOT_STREAMS");  // as the agent takes it
  const size_t streams = streams_env != nullptr && std::atoi(streams_env) > 0
                             ? static_cast<size_t>(std::atoi(streams_env))
                             : kDefaultFetchStreams;
  std::string templ = std::string(argc > 3 ? argv[3] : "/tmp") + "/ddprun_transfer_bench_XXXXXX";
  if (::mkdtemp(templ.data()) == nullptr) {
    std::perror(templ.c_str());
    return 1;
  }
  const std::string dir = templ;
  const std::string src = dir + "/src.bin";
  {
    std::vector<char> block(1 << 20);
    std::mt19937 rng(1);
    for (auto& c : block) c = static_cast<char>(rng());
    const int fd = ::open(src.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    for (size_t done = 0; done < size; done += block.size()) {
      if (::write(fd, block.data(), block.size()) < 0) return 1;
    }
    ::fsync(fd);
    ::close(fd);
  }
  tuneAllocatorForTransfers();  // as the agent does
  const int fd = ::open(src.c_str(), O_RDONLY | O_CLOEXEC);
  auto crc = crc32OfFile(fd);
  ServedFile served{SnapshotFile{"src.bin", 1, crc->first, crc->second},
                    std::make_shared<OpenFile>(fd), nullptr};
  SnapshotServerOptions o;
  o.listen = "127.0.0.1:0";
  o.run_id = "bench";
  o.lookup = [&](const SnapshotFile&) -> std::optional<ServedFile> { return served; };
  auto server = SnapshotServer::start(std::move(o));
  if (!server.isOk()) return 1;
  const SnapshotPeer peer{"127.0.0.1:" + std::to_string((*server)->port()), "bench", {}};
  // Rep -1 warms up and is not shown: on this VM the first ~200 MB written after a pause cost up
  // to 0.5 s more (memory touched for the first time in a while), and the copy that follows the
  // fetch in the same rep reuses the pages the fetch just freed, which made the first ratio 6-7x.
  for (int i = -1; i < reps; ++i) {
    const std::string out = dir + "/out" + std::to_string(i);
    auto t0 = std::chrono::steady_clock::now();
    const double cpu0 = cpuSeconds();
    Status st = fetchSnapshot(peer, served.file, out, nullptr, streams);
    const double fetch =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double fetch_cpu = cpuSeconds() - cpu0;
    ::unlink(out.c_str());
    // The yardstick: read + write + fsync of the same bytes.
    t0 = std::chrono::steady_clock::now();
    const int in = ::open(src.c_str(), O_RDONLY);
    const int cp = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    std::vector<char> buf(1 << 20);
    for (ssize_t n; (n = ::read(in, buf.data(), buf.size())) > 0;) {
      if (::write(cp, buf.data(), static_cast<size_t>(n)) != n) return 1;
    }
    ::fsync(cp);
    ::close(cp);
    ::close(in);
    const double copy =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ::unlink(out.c_str());
    if (i < 0) continue;
    std::printf(
        "%zu MiB: fetch %.3f s (%s, CPU %.3f s, both ends), local copy %.3f s, ratio %.2fx\n",
        size >> 20, fetch, st.isOk() ? "ok" : st.toString().c_str(), fetch_cpu, copy, fetch / copy);
  }
  std::system(("rm -rf '" + dir + "'").c_str());
  return 0;
}
