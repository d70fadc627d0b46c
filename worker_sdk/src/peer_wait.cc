#include "peer_wait.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <mutex>

#include "ddprun/common/heartbeat_file.h"

namespace ddprun::worker {

namespace {
struct Marker {
  std::mutex mu;
  std::string path;  // guarded by mu
  int fd = -1;       // guarded by mu: opened by the first touch
  int waits = 0;     // guarded by mu: the live WaitingForPeers objects
  int token = 0;     // guarded by mu: markWaitsIn's calls
};

Marker& marker() {
  static Marker* m = new Marker;  // never destroyed: a wait may end during static destruction
  return *m;
}

// The current mark, where the file is open; errno when the write fails.
int write(const Marker& m) {
  if (m.fd < 0) return 0;
  const char mark = m.waits > 0 ? kWaitingForPeers : kNotWaiting;
  return ::pwrite(m.fd, &mark, 1, 0) == 1 ? 0 : errno;
}

void reset(Marker& m, const std::string& path) {
  if (m.fd >= 0) ::close(m.fd);
  m.fd = -1;
  m.path = path;
}
}  // namespace

int markWaitsIn(const std::string& path) {
  Marker& m = marker();
  std::lock_guard<std::mutex> lock(m.mu);
  reset(m, path);
  return ++m.token;
}

void stopMarkingWaits(int token) {
  Marker& m = marker();
  std::lock_guard<std::mutex> lock(m.mu);
  if (token == m.token) reset(m, "");
}

int touchHeartbeat() {
  Marker& m = marker();
  std::lock_guard<std::mutex> lock(m.mu);
  if (m.path.empty()) return 0;
  // A file removed meanwhile (a clean-up of the log directory) is made again: the agent watches
  // the path, not this descriptor's file.
  struct stat st {};
  if (m.fd >= 0 && ::fstat(m.fd, &st) == 0 && st.st_nlink == 0) reset(m, m.path);
  if (m.fd < 0) {
    m.fd = ::open(m.path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (m.fd < 0) return errno;
  }
  return write(m);
}

WaitingForPeers::WaitingForPeers() {
  Marker& m = marker();
  std::lock_guard<std::mutex> lock(m.mu);
  if (m.waits++ == 0) (void)write(m);
}

WaitingForPeers::~WaitingForPeers() {
  Marker& m = marker();
  std::lock_guard<std::mutex> lock(m.mu);
  if (--m.waits == 0) (void)write(m);
}

}  // namespace ddprun::worker
